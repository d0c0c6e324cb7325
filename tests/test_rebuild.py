"""Tests for rebuilding runnable TF functions from captured (and edited) IR programs."""

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.core.framework import attr_value_pb2
from tensorflow.python.compiler.xla.experimental import xla_sharding

from tf_gspmd.graph import capture, ir, rebuild
from tf_gspmd.sharding import Sharding


def _loop_node(graph):
  (loop,) = [n for n in graph.nodes if n.op in ('While', 'StatelessWhile')]
  return loop


def _while_cond_function(v):
  @tf.function
  def f(x, n):
    def body(i, y):
      v.assign_add(tf.ones([3, 4]))
      return i + 1, y + v.read_value()[:, :1] * 1.5

    _, y = tf.while_loop(lambda i, y: i < n, body, [0, x])
    z = tf.cond(n > 2, lambda: y * 2.0, lambda: y - 1.0)
    return z, v.read_value()

  return f


def _same(a, b) -> bool:
  a, b = np.asarray(a), np.asarray(b)
  return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def test_keras_training_step_round_trip_is_bit_identical():
  keras = pytest.importorskip('keras')

  def make_step():
    keras.utils.set_random_seed(1)
    model = keras.Sequential(
      [
        keras.Input((8,)),
        keras.layers.Dense(16),
        keras.layers.BatchNormalization(),
        keras.layers.Dropout(0.3, seed=3),
        keras.layers.Dense(4),
      ]
    )
    optimizer = keras.optimizers.Adam(1e-2)
    optimizer.build(model.trainable_variables)
    loss_fn = keras.losses.MeanSquaredError()
    metric = keras.metrics.Mean()

    @tf.function
    def step(x, y):
      with tf.GradientTape() as tape:
        loss = loss_fn(y, model(x, training=True))  # dropout on, from a seeded state variable
      grads = tape.gradient(loss, model.trainable_variables)
      optimizer.apply_gradients(zip(grads, model.trainable_variables))
      metric.update_state(loss)
      return {'loss': loss, 'mean_loss': metric.result()}

    variables = list(model.variables) + list(optimizer.variables) + list(metric.variables)
    roles = {
      'kernel': model.layers[0].kernel,
      'moving_mean': model.layers[1].moving_mean,
      'dropout_seed': model.layers[2].seed_generator.state,
      'adam_iterations': optimizer.iterations,
      'metric_total': metric.variables[0],
    }
    return model, step, variables, roles

  model_a, step_a, variables_a, _ = make_step()
  model_b, step_b, variables_b, roles_b = make_step()
  model_b.set_weights(model_a.get_weights())
  initial = [np.array(v.numpy()) for v in variables_b]
  assert all(_same(a.numpy(), b) for a, b in zip(variables_a, initial))

  rng = np.random.default_rng(0)
  batches = [
    (
      tf.constant(rng.normal(size=(32, 8)), tf.float32),
      tf.constant(rng.normal(size=(32, 4)), tf.float32),
    )
    for _ in range(3)
  ]
  program = capture.capture(step_b, *batches[0])
  assert len(program.variables) == len(variables_b)
  rebuilt = rebuild.rebuild(program)
  for x, y in batches:
    expected = step_a(x, y)
    got = rebuilt(x, y)
    assert set(got) == {'loss', 'mean_loss'}
    for key in expected:
      assert _same(expected[key], got[key]), key
  for va, vb in zip(variables_a, variables_b):
    assert _same(va.numpy(), vb.numpy()), vb.path
  # Weights, BN statistics, dropout seed, Adam state and metrics all moved.
  for role, variable in roles_b.items():
    (start,) = [s for v, s in zip(variables_b, initial) if v is variable]
    assert not _same(variable.numpy(), start), role
  # The rebuilt function really runs the imported graph, not the original one.
  rebuilt_graph = rebuilt.get_concrete_function(*batches[0]).graph
  assert any(
    op.name.startswith('program/') and op.type == 'MatMul' for op in rebuilt_graph.get_operations()
  )


def test_while_and_cond_round_trip_matches_the_original():
  v = tf.Variable(tf.ones([3, 4]))
  f = _while_cond_function(v)
  program = capture.capture(f, tf.TensorSpec([3, 1]), tf.TensorSpec([], tf.int32))
  rebuilt = rebuild.rebuild(program)
  x = tf.constant([[1.0], [2.0], [3.0]])
  for n in (1, 4):  # the else branch, then the then branch
    v.assign(tf.ones([3, 4]))
    expected = [t.numpy() for t in f(x, tf.constant(n))]
    expected_v = v.numpy()
    v.assign(tf.ones([3, 4]))
    got = [t.numpy() for t in rebuilt(x, tf.constant(n))]
    assert all(_same(a, b) for a, b in zip(expected, got))
    assert _same(expected_v, v.numpy())
    assert float(v.numpy()[0, 0]) == 1.0 + n


def test_nested_function_calls_round_trip():
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
  assert len(program.functions) >= 4  # inner, innermost, while cond and body
  x = tf.reshape(tf.range(8, dtype=tf.float32), [4, 2])
  expected = (x.numpy() * 8 + 1) * ((x.numpy() + 1) * 8 + 1)
  np.testing.assert_array_equal(rebuild.rebuild(program)(x).numpy(), expected)


def _scale_constant(graph, old, new):
  """Replace the float constant `old` of `graph` by `new`; returns the edited node."""
  (node,) = [
    n
    for n in graph.nodes
    if n.op == 'Const'
    and n.output(0).dtype == tf.float32
    and tf.make_ndarray(n.attrs['value'].tensor).tolist() == old
  ]
  node.attrs['value'] = attr_value_pb2.AttrValue(tensor=tf.make_tensor_proto(new, tf.float32))
  return node


def test_edited_while_body_is_the_one_that_runs():
  @tf.function
  def f(x):
    return tf.while_loop(lambda i, y: i < 3, lambda i, y: (i + 1, y * 2.0), [0, x])[1]

  spec = tf.TensorSpec([2])
  original, edited = capture.capture(f, spec), capture.capture(f, spec)
  body_name = _loop_node(edited.main).called_functions()['body'][0]
  _scale_constant(edited.function(body_name), 2.0, 3.0)

  x = tf.constant([1.0, -2.0])
  # Build the edited one first, then the original, then the edited again: no
  # registration may shadow another.
  edited_fn = rebuild.rebuild(edited)
  np.testing.assert_array_equal(edited_fn(x).numpy(), [27.0, -54.0])
  np.testing.assert_array_equal(rebuild.rebuild(original)(x).numpy(), [8.0, -16.0])
  np.testing.assert_array_equal(rebuild.rebuild(edited)(x).numpy(), [27.0, -54.0])
  np.testing.assert_array_equal(f(x).numpy(), [8.0, -16.0])

  original_names = rebuild.build_library(original)
  edited_names = rebuild.build_library(edited)
  # Each capture is a fresh trace, its library functions named afresh.
  original_body = _loop_node(original.main).called_functions()['body'][0]
  assert original_names[original_body].name != edited_names[body_name].name
  assert rebuild.build_library(original)[original_body].name == original_names[original_body].name
  for built in (original_names, edited_names):
    assert all(f.name.decode() != old for old, f in built.items())
  # The rebuilt graph's While calls the edited body under its new name.
  rebuilt_graph = edited_fn.get_concrete_function(x).graph
  (loop_op,) = [
    op for op in rebuilt_graph.get_operations() if op.type in ('While', 'StatelessWhile')
  ]
  assert loop_op.get_attr('body').name == edited_names[body_name].name.decode()


def test_edited_main_graph_is_used():
  @tf.function
  def f(x):
    return x * 5.0

  program = capture.capture(f, tf.TensorSpec([2]))
  _scale_constant(program.main, 5.0, -1.0)
  np.testing.assert_array_equal(
    rebuild.rebuild(program)(tf.constant([1.0, 2.0])).numpy(), [-1.0, -2.0]
  )


def test_import_program_in_a_traced_function_with_variables_remapped():
  v_orig = tf.Variable([1.0, 2.0, 3.0])

  @tf.function
  def update(x):
    v_orig.assign_add(x)
    return v_orig.read_value() * 2.0

  program = capture.capture(update, tf.TensorSpec([3]))
  (placeholder,) = program.variables
  assert program.variables[placeholder] is v_orig
  v1 = tf.Variable([10.0, 20.0, 30.0])
  v2 = tf.Variable([0.0, 0.0, 0.0])

  @tf.function
  def outer(x):
    (a,) = rebuild.import_program(program, [x], variables={placeholder: v1})
    (b,), control = rebuild.import_program(
      program,
      [x + 1.0],
      variables={placeholder: v2.handle},
      name='second',
      return_control_outputs=True,
    )
    assert control and all(isinstance(op, tf.Operation) for op in control)
    return a, b

  a, b = outer(tf.constant([1.0, 1.0, 1.0]))
  np.testing.assert_array_equal(a.numpy(), [22.0, 42.0, 62.0])
  np.testing.assert_array_equal(b.numpy(), [4.0, 4.0, 4.0])
  np.testing.assert_array_equal(v1.numpy(), [11.0, 21.0, 31.0])
  np.testing.assert_array_equal(v2.numpy(), [2.0, 2.0, 2.0])
  np.testing.assert_array_equal(v_orig.numpy(), [1.0, 2.0, 3.0])  # untouched
  names = {op.name for op in outer.get_concrete_function(tf.TensorSpec([3])).graph.get_operations()}
  assert any(n.startswith('program/') for n in names) and any(
    n.startswith('second/') for n in names
  )


def test_import_program_errors():
  @tf.function
  def f(x, y):
    return x + y

  program = capture.capture(f, tf.TensorSpec([]), tf.TensorSpec([]))
  with pytest.raises(RuntimeError, match='tf.function is being traced'):
    rebuild.import_program(program, [tf.constant(1.0), tf.constant(2.0)])

  @tf.function
  def wrong_arity(x):
    return rebuild.import_program(program, [x])

  with pytest.raises(ValueError, match=r'takes 2 inputs'):
    wrong_arity(tf.constant(1.0))

  @tf.function
  def unknown_variable(x, y):
    return rebuild.import_program(program, [x, y], variables={'nope:0': tf.Variable(1.0)})

  with pytest.raises(ValueError, match='not captured placeholders'):
    unknown_variable(tf.constant(1.0), tf.constant(2.0))


def test_rebuild_binds_arguments_like_the_original():
  @tf.function
  def f(x, params, scale=2.0):
    return {'out': (x * params['a'] + params['b']) * scale, 'a': params['a']}

  x = tf.constant([1.0, 2.0])
  params = {'a': tf.constant(3.0), 'b': tf.constant([0.5, 0.25])}
  program = capture.capture(f, x, params)
  rebuilt = rebuild.rebuild(program)
  expected = f(x, params)
  for got in (rebuilt(x, params), rebuilt(params=params, x=x), rebuilt(x, params, scale=2.0)):
    assert set(got) == {'out', 'a'}
    np.testing.assert_array_equal(got['out'].numpy(), expected['out'].numpy())
    np.testing.assert_array_equal(got['a'].numpy(), expected['a'].numpy())
  with pytest.raises(TypeError):
    rebuilt(x, params, scale=3.0)  # traced with scale=2.0: another value is another program


def test_round_trip_keeps_annotations_shapes_and_bodies():
  v = tf.Variable(tf.ones([4, 6]))

  @tf.function
  def f(x):
    a = xla_sharding.split(x * 2.0, 0, 4, use_sharding_op=True)

    def body(i, y):
      return i + 1, xla_sharding.split(y + v, 1, 2, use_sharding_op=False)

    return tf.while_loop(lambda i, y: i < 2, body, [0, a])[1]

  first = capture.capture(f, tf.TensorSpec([4, 6]))
  rebuilt = rebuild.rebuild(first)
  x = tf.random.stateless_normal([4, 6], seed=[1, 2])
  np.testing.assert_array_equal(rebuilt(x).numpy(), f(x).numpy())
  second = capture.capture(rebuilt, x)

  assert set(second.main.annotated().values()) == {Sharding.tiled(np.arange(4).reshape(4, 1))}
  assert [v2 is v for v2 in second.variables.values()] == [True]
  first_body = first.function(_loop_node(first.main).called_functions()['body'][0])
  second_body = second.function(_loop_node(second.main).called_functions()['body'][0])
  assert second_body.name != first_body.name
  assert [(n.name, n.op, [t.shape for t in n.outputs]) for n in second_body.nodes] == [
    (n.name, n.op, [t.shape for t in n.outputs]) for n in first_body.nodes
  ]
  assert second_body.annotated() == first_body.annotated()
  assert list(first_body.annotated().values()) == [Sharding.tiled(np.arange(2).reshape(1, 2))]
  # Names do not grow over rounds: one hash suffix replaces the previous one.
  third = capture.capture(rebuild.rebuild(second), x)
  third_body = _loop_node(third.main).called_functions()['body'][0]
  assert len(third_body) == len(second_body.name)
  assert ir.format_program(third)  # printable


def test_import_program_follows_the_device_scope():
  v = tf.Variable([1.0, 2.0])

  @tf.function
  def f(x):
    v.assign_add(x)
    with tf.device('/CPU:5'):
      y = x * 3.0  # a node with its own device keeps it
    return v.read_value() + y

  program = capture.capture(f, tf.TensorSpec([2]))

  @tf.function
  def outer(x):
    with tf.device('/CPU:2'):
      return rebuild.import_program(program, [x])

  np.testing.assert_array_equal(outer(tf.constant([1.0, 1.0]))[0].numpy(), [5.0, 6.0])
  graph = outer.get_concrete_function(tf.TensorSpec([2])).graph
  devices = {op.name: op.device for op in graph.get_operations() if op.name.startswith('program/')}
  assert devices['program/mul'].endswith('CPU:5')
  assert devices['program/add'].endswith('CPU:2'), devices
  assert all(d for d in devices.values()), devices


def test_keras_lstm_step_round_trip_is_bit_identical():
  """While loops over TensorLists, forward and gradient, inside a Keras training step."""
  keras = pytest.importorskip('keras')

  def make_step():
    keras.utils.set_random_seed(2)
    model = keras.Sequential([keras.Input((5, 3)), keras.layers.LSTM(8), keras.layers.Dense(2)])
    optimizer = keras.optimizers.SGD(0.1, momentum=0.9, clipnorm=1.0)
    optimizer.build(model.trainable_variables)

    @tf.function
    def step(x, y):
      with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(model(x, training=True) - y))
      grads = tape.gradient(loss, model.trainable_variables)
      optimizer.apply_gradients(zip(grads, model.trainable_variables))
      return loss

    return step, list(model.variables) + list(optimizer.variables)

  step_a, variables_a = make_step()
  step_b, variables_b = make_step()
  x = tf.random.stateless_normal([4, 5, 3], seed=[1, 1])
  y = tf.random.stateless_normal([4, 2], seed=[2, 2])
  program = capture.capture(step_b, x, y)
  loops = [n for g in program.graphs() for n in g.nodes if n.op in ('While', 'StatelessWhile')]
  assert len(loops) >= 2  # the forward loop and its gradient loop
  for graph in program.functions.values():
    for t in graph.tensors():
      assert t.shape is not None and None not in t.shape, (graph.name, t.name)
  rebuilt = rebuild.rebuild(program)
  for _ in range(3):
    assert _same(step_a(x, y).numpy(), rebuilt(x, y).numpy())
  for va, vb in zip(variables_a, variables_b):
    assert _same(va.numpy(), vb.numpy()), vb.path
