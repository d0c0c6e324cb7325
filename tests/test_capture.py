"""Tests for graph capture: tf.function -> ir.Program."""

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.compiler.xla import xla_data_pb2
from tensorflow.core.framework import attr_value_pb2
from tensorflow.python.compiler.xla.experimental import xla_sharding

from tf_gspmd import op_sharding
from tf_gspmd.graph import capture, ir
from tf_gspmd.sharding import Sharding


def _while_cond_function(v):
  """A function with a while_loop (reading and updating `v`) and a cond."""

  @tf.function
  def f(x, n):
    def body(i, y):
      v.assign_add(tf.ones([3, 4]))
      return i + 1, y + v.read_value()[:, :1] * 1.5

    _, y = tf.while_loop(lambda i, y: i < n, body, [0, x])
    z = tf.cond(n > 2, lambda: y * 2.0, lambda: y - 1.0)
    return z, v.read_value()

  return f


def _nodes_by_op(graph, op):
  return [n for n in graph.nodes if n.op == op]


def _assert_static(graph, skip_ops=()):
  """Every tensor of `graph` has a fully known shape."""
  for t in graph.tensors():
    if graph.producer(t.name).op in skip_ops:
      continue
    assert t.shape is not None and None not in t.shape, (
      f'{graph.name}: {t.name} has shape {t.shape}'
    )


def test_while_and_cond_bodies_are_captured_with_static_shapes():
  v = tf.Variable(tf.ones([3, 4]))
  program = capture.capture(
    _while_cond_function(v), tf.TensorSpec([3, 1]), tf.TensorSpec([], tf.int32)
  )
  (loop,) = _nodes_by_op(program.main, 'While')
  (branch,) = _nodes_by_op(program.main, 'StatelessIf')
  calls = {**loop.called_functions(), **branch.called_functions()}
  assert set(calls) == {'cond', 'body', 'then_branch', 'else_branch'}
  for names in calls.values():
    assert names[0] in program.functions

  body = program.function(loop.called_functions()['body'][0])
  # Arguments named 'node:0' like the top level, in loop-variable order, with the loop's shapes.
  assert [body.tensor(t).shape for t in body.inputs] == [(), (), (), (3, 1), (), ()]
  assert body.tensor(body.inputs[5]).dtype == tf.resource
  assert body.tensor(body.inputs[5]).value_shape == (3, 4)
  (read,) = _nodes_by_op(body, 'ReadVariableOp')
  assert read.output(0).shape == (3, 4)  # known only through the resource argument's handle data
  (update,) = _nodes_by_op(body, 'AssignAddVariableOp')
  assert update.name in body.control_outputs
  _assert_static(body)
  for name in branch.called_functions()['then_branch'] + branch.called_functions()['else_branch']:
    branch_graph = program.function(name)
    assert [branch_graph.tensor(t).shape for t in branch_graph.inputs] == [(3, 1)]
    _assert_static(branch_graph)
  for t in body.outputs:
    body.tensor(t)  # every output names a tensor of the body
  _assert_static(program.main)


def test_top_level_graph_matches_tf_graph():
  v = tf.Variable(tf.ones([3, 4]))
  f = _while_cond_function(v)
  concrete = f.get_concrete_function(tf.TensorSpec([3, 1]), tf.TensorSpec([], tf.int32))
  program = capture.capture(concrete)
  graph = concrete.graph
  assert sorted(n.name for n in program.main.nodes) == sorted(
    op.name for op in graph.get_operations()
  )
  for op in graph.get_operations():
    node = program.main.node(op.name)
    assert node.op == op.type
    assert node.inputs == [t.name for t in op.inputs]
    assert node.control_inputs == [c.name for c in op.control_inputs]
    assert [t.dtype for t in node.outputs] == [t.dtype for t in op.outputs]
    assert [t.shape for t in node.outputs] == [tuple(t.shape.as_list()) for t in op.outputs]
  # Topological order: every input is produced earlier.
  seen = set()
  for node in program.main.nodes:
    for t in node.inputs:
      assert ir.split_tensor_name(t)[0] in seen
    assert all(c in seen for c in node.control_inputs)
    seen.add(node.name)
  assert program.main.outputs == [t.name for t in concrete.outputs]
  assert program.arg_inputs == ['x:0', 'n:0']


def test_variables_map_back_to_the_live_variables():
  a = tf.Variable(tf.zeros([2, 3]), name='a')
  b = tf.Variable(tf.zeros([5]), name='b')
  c = tf.Variable(7, name='c')
  unused = tf.Variable(1.0, name='unused')
  offset = tf.constant([1.0, 2.0, 3.0])  # a captured eager tensor that is not a variable

  @tf.function
  def f(x):
    a.assign(a + x)
    b.assign_add(tf.ones([5]))
    return a.read_value() + offset, c.read_value()

  program = capture.capture(f, tf.TensorSpec([2, 3]))
  by_name = {v.name: placeholder for placeholder, v in program.variables.items()}
  assert set(by_name) == {'a:0', 'b:0', 'c:0'}
  for placeholder, variable in program.variables.items():
    assert any(variable is w for w in (a, b, c))
    tensor = program.main.tensor(placeholder)
    assert tensor.dtype == tf.resource
    assert tensor.value_shape == tuple(variable.shape.as_list())
    assert tensor.value_dtype == variable.dtype
    # The placeholder really is what the reads/updates of that variable use.
    users = {program.main.node(n).op for n, _ in program.main.consumers(placeholder)}
    assert users & {'ReadVariableOp', 'AssignVariableOp', 'AssignAddVariableOp'}
  assert not any(v is unused for v in program.variables.values())
  (captured,) = program.captures.values()
  np.testing.assert_array_equal(captured.numpy(), offset.numpy())
  assert program.arg_inputs == ['x:0']


def test_function_calls_are_captured_and_nested():
  @tf.function
  def innermost(x):
    return tf.while_loop(lambda i, y: i < 3, lambda i, y: (i + 1, y * 2.0), [0, x])[1]

  @tf.function
  def inner(x):
    return innermost(x) + 1.0

  @tf.function
  def outer(x):
    return inner(x) * inner(x + 1.0)

  program = capture.capture(outer, tf.TensorSpec([4, 2]))
  calls = _nodes_by_op(program.main, 'PartitionedCall') + _nodes_by_op(
    program.main, 'StatefulPartitionedCall'
  )
  assert len(calls) == 2
  inner_graph = program.function(calls[0].called_functions()['f'][0])
  (inner_call,) = [n for n in inner_graph.nodes if n.called_functions()]
  innermost_graph = program.function(inner_call.called_functions()['f'][0])
  (loop,) = _nodes_by_op(innermost_graph, 'StatelessWhile') + _nodes_by_op(innermost_graph, 'While')
  body = program.function(loop.called_functions()['body'][0])
  for graph in (inner_graph, innermost_graph, body):
    _assert_static(graph)
  assert [body.tensor(t).shape for t in body.inputs][-1] == (4, 2)


def test_call_sites_with_different_shapes_give_the_common_shape():
  @tf.function(input_signature=[tf.TensorSpec([None, 2])])
  def g(x):
    return tf.reduce_sum(x * 2.0, axis=0)

  @tf.function
  def f(a, b):
    return g(a) + g(b)

  program = capture.capture(f, tf.TensorSpec([3, 2]), tf.TensorSpec([5, 2]))
  (name,) = {n.called_functions()['f'][0] for n in program.main.nodes if n.called_functions()}
  callee = program.function(name)
  assert callee.tensor(callee.inputs[0]).shape == (None, 2)
  assert callee.tensor(callee.outputs[0]).shape == (2,)


def test_xla_sharding_ops_and_attrs_become_annotations():
  @tf.function
  def f(x):
    a = xla_sharding.split(x * 2.0, 0, 4, use_sharding_op=True)
    b = xla_sharding.mesh_split(a + 1.0, np.arange(8).reshape(2, 4), [0, -1], use_sharding_op=False)
    c = xla_sharding.replicate(b - 1.0, use_sharding_op=True)
    d = xla_sharding.tile(c * 3.0, np.array([[0, 2], [1, 3], [4, 6], [5, 7]]), use_sharding_op=True)
    return xla_sharding.assign_device(d, 5, use_sharding_op=True)

  program = capture.capture(f, tf.TensorSpec([8, 6]))
  annotated = program.main.annotated()
  expected = {
    'XlaSharding:0': Sharding.tiled(np.arange(4).reshape(4, 1)),
    'add:0': Sharding.tiled(np.arange(8).reshape(2, 1, 4), subgroups=('replicated',)),
    'XlaSharding_1:0': Sharding.replicated(),
    'XlaSharding_2:0': Sharding.tiled(np.array([[0, 2], [1, 3], [4, 6], [5, 7]])),
    'XlaSharding_3:0': Sharding.maximal(5),
  }
  assert annotated == expected
  assert program.main.node('add').op == 'AddV2'  # the attr form annotates the producing op
  # Equality by meaning would accept a differently written tile; check the device order too.
  assert np.array_equal(
    annotated['XlaSharding_2:0'].tile_assignment, [[0, 2], [1, 3], [4, 6], [5, 7]]
  )


def test_tuple_sharding_attr_annotates_each_output():
  pb = xla_data_pb2.OpSharding
  split4 = op_sharding.to_proto(Sharding.tiled(np.arange(4)))
  tuple_proto = pb(type=pb.TUPLE, tuple_shardings=[split4, pb(type=pb.REPLICATED)])
  single = op_sharding.to_proto(Sharding.maximal(2))

  @tf.function
  def f(x):
    values, index = tf.unique(x)
    values.op._set_attr('_XlaSharding', attr_value_pb2.AttrValue(s=tuple_proto.SerializeToString()))
    parts = tf.split(x, 2)
    parts[0].op._set_attr('_XlaSharding', attr_value_pb2.AttrValue(s=single.SerializeToString()))
    return values, index, parts

  program = capture.capture(f, tf.TensorSpec([8], tf.int32))
  unique = _nodes_by_op(program.main, 'Unique')[0]
  assert unique.annotations == {0: Sharding.tiled(np.arange(4)), 1: Sharding.replicated()}
  split = _nodes_by_op(program.main, 'Split')[0]
  assert split.annotations == {0: Sharding.maximal(2), 1: Sharding.maximal(2)}


def test_a_tuple_sharding_of_the_wrong_length_is_refused():
  pb = xla_data_pb2.OpSharding
  bad = pb(type=pb.TUPLE, tuple_shardings=[pb(type=pb.REPLICATED)] * 3)

  @tf.function
  def f(x):
    values, index = tf.unique(x)
    values.op._set_attr('_XlaSharding', attr_value_pb2.AttrValue(s=bad.SerializeToString()))
    return values, index

  with pytest.raises(ValueError, match=r"node 'Unique'.*3 elements.*2 outputs"):
    capture.capture(f, tf.TensorSpec([8], tf.int32))


def test_annotations_inside_a_while_body():
  @tf.function
  def f(x):
    def body(i, y):
      return i + 1, xla_sharding.split(y * 2.0, 1, 2, use_sharding_op=True)

    return tf.while_loop(lambda i, y: i < 3, body, [0, x])[1]

  program = capture.capture(f, tf.TensorSpec([4, 6]))
  (loop,) = [n for n in program.main.nodes if n.op in ('While', 'StatelessWhile')]
  body = program.function(loop.called_functions()['body'][0])
  (annotated_node,) = _nodes_by_op(body, 'XlaSharding')
  assert annotated_node.annotations == {0: Sharding.tiled(np.arange(2).reshape(1, 2))}
  assert annotated_node.output(0).shape == (4, 6)


def test_variable_shardings_set_in_python_are_recorded():
  tiled = Sharding.tiled(np.arange(4).reshape(2, 2))
  by_attr = tf.Variable(tf.zeros([4, 4]))
  by_attr._tf_gspmd_sharding = tiled
  by_proto = tf.Variable(tf.zeros([8]))
  by_proto._set_xla_sharding(op_sharding.to_proto(Sharding.tiled(np.arange(8))))
  plain = tf.Variable(tf.zeros([2]))

  @tf.function
  def f():
    return by_attr + 1.0, by_proto + 1.0, plain + 1.0

  program = capture.capture(f)
  placeholder = {id(v): p for p, v in program.variables.items()}
  assert program.variable_shardings == {
    placeholder[id(by_attr)]: tiled,
    placeholder[id(by_proto)]: Sharding.tiled(np.arange(8)),
  }
  node = program.main.producer(placeholder[id(by_attr)])
  assert node.annotations == {0: tiled}
  assert not program.main.producer(placeholder[id(plain)]).annotations


def test_shard_variable_and_shard_annotations_are_read_back():
  annotations = pytest.importorskip('tf_gspmd.annotations')
  keras = pytest.importorskip('keras')
  from tf_gspmd.mesh import Mesh
  from tf_gspmd.sharding import NamedSharding, P

  mesh = Mesh.create((2, 4), ('data', 'model'))
  layer = keras.layers.Dense(8)
  layer.build((None, 4))
  annotations.shard_variable(layer.kernel, mesh, P(None, 'model'))
  plain = tf.Variable(tf.zeros([6, 8]))
  annotations.shard_variable(plain, mesh, P('data', None))

  @tf.function
  def f(x):
    x = annotations.shard(x, mesh, P('data', None))
    return layer(x) + plain[:1]

  program = capture.capture(f, tf.TensorSpec([6, 4]))
  by_variable = {
    id(v): s for p, v in program.variables.items() for s in [program.variable_shardings.get(p)]
  }
  assert by_variable[id(layer.kernel.value)].is_equivalent_to(NamedSharding(mesh, P(None, 'model')))
  assert by_variable[id(plain)].is_equivalent_to(NamedSharding(mesh, P('data', None)))
  assert by_variable[id(layer.bias.value)] is None
  (annotated,) = _nodes_by_op(program.main, 'XlaSharding')
  assert list(annotated.annotations) == [0]
  assert annotated.annotations[0].is_equivalent_to(NamedSharding(mesh, P('data', None)))


def test_keras_training_step_is_captured_whole():
  keras = pytest.importorskip('keras')
  keras.utils.set_random_seed(0)
  model = keras.Sequential(
    [
      keras.Input((8,)),
      keras.layers.Dense(16),
      keras.layers.BatchNormalization(),
      keras.layers.Dense(4),
    ]
  )
  optimizer = keras.optimizers.Adam(1e-2)
  optimizer.build(model.trainable_variables)
  metric = keras.metrics.Mean()

  @tf.function
  def step(x, y):
    with tf.GradientTape() as tape:
      loss = tf.reduce_mean(tf.square(model(x, training=True) - y))
    grads = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(grads, model.trainable_variables))
    metric.update_state(loss)
    return {'loss': loss, 'mean': metric.result()}

  x, y = tf.zeros([32, 8]), tf.zeros([32, 4])
  concrete = step.get_concrete_function(x, y)
  program = capture.capture(concrete)
  every_variable = list(model.variables) + list(optimizer.variables) + list(metric.variables)
  captured = list(program.variables.values())
  for v in every_variable:
    assert any(v.value is w for w in captured), v.path
  assert len(captured) == len(every_variable)
  # Every op is captured but the ones nothing needs (dead, stateless: TF would not run them).
  kept = {n.name for n in program.main.nodes}
  dropped = [op for op in concrete.graph.get_operations() if op.name not in kept]
  assert len(kept) + len(dropped) == len(concrete.graph.get_operations())
  for op in dropped:
    assert not op._is_stateful, op.name  # noqa: SLF001
    assert not any(c.name in kept for t in op.outputs for c in t.consumers()), op.name
    assert not any(
      op in c.control_inputs for c in concrete.graph.get_operations() if c.name in kept
    ), op.name
  assert set(program.main.control_outputs) == {op.name for op in concrete.graph.control_outputs}
  _assert_static(program.main, skip_ops=('NoOp',))
  # The updates (forward, backward, optimizer, metrics) are all there.
  ops = {n.op for n in program.main.nodes}
  assert {'MatMul', 'BiasAddGrad', 'AssignVariableOp', 'AssignAddVariableOp'} <= ops


def test_format_program_shows_nodes_shapes_functions_and_annotations():
  v = tf.Variable(tf.ones([3, 4]), name='weights')

  @tf.function
  def f(x, n):
    y = xla_sharding.split(x, 0, 3, use_sharding_op=True)
    return tf.while_loop(lambda i, z: i < n, lambda i, z: (i + 1, z + v[:, :1]), [0, y])[1]

  program = capture.capture(f, tf.TensorSpec([3, 1]), tf.TensorSpec([], tf.int32))
  text = program.dump()
  assert text == ir.format_program(program)
  assert 'graph f(x:0, n:0' in text
  assert 'XlaSharding = XlaSharding(x:0) : float32[3,1]  {0: {devices=[3,1]0,1,2}}' in text
  assert '# variable weights:0' in text
  assert 'resource[]->(float32[3,4])' in text
  for name in program.functions:
    assert f'graph {name}(' in text


def test_capture_of_a_plain_python_function_and_errors():
  program = capture.capture(lambda x: x * 2.0, tf.TensorSpec([2]))
  assert [n.op for n in program.main.nodes].count('Mul') == 1

  def scaled(x, scale=3.0):
    return x * scale

  program = capture.capture(scaled, input_signature=[tf.TensorSpec([None, 2])])
  assert program.main.tensor('x:0').shape == (None, 2)
  assert program.default_values == {'scale': 3.0}
  assert program.arg_inputs == ['x:0']
  with pytest.raises(TypeError, match='expected a tf.function or a callable'):
    capture.capture(42)
