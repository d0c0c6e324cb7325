"""Annotations: the same graphs as TF's xla_sharding, get_sharding whichever API wrote it,
variables, Keras 3."""

import contextlib

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.compiler.xla.experimental import xla_sharding as tfx
from tensorflow.python.eager import context

import tf_gspmd as tg
from tf_gspmd import Mesh, NamedSharding, P, Sharding, get_sharding, op_sharding
from tf_gspmd.testing import assert_close

MESH = Mesh.create((2, 4), ('data', 'model'))
DEVICE_MESH = np.arange(8).reshape(2, 4)
DEVICE_MESH_3D = np.array([[[5, 2], [7, 0]], [[1, 6], [3, 4]]])
SPEC = tf.TensorSpec([8, 6], tf.float32)

# (TF's annotation with use_sharding_op=True, the same annotation made with tf_gspmd)
SAME_ANNOTATIONS = {
  'split': (
    lambda x: tfx.split(x, 1, 3, use_sharding_op=True),
    lambda x: tg.xla_sharding.split(x, 1, 3),
  ),
  'split_negative_dim': (
    lambda x: tfx.split(x, -2, 4, use_sharding_op=True),
    lambda x: tg.xla_sharding.split(x, -2, 4),
  ),
  'tile': (
    lambda x: tfx.tile(x, np.array([[1, 0], [3, 2]]), use_sharding_op=True),
    lambda x: tg.xla_sharding.tile(x, [[1, 0], [3, 2]]),
  ),
  'tile_unspecified_dims': (
    lambda x: tfx.tile(x, np.array([[1, 0], [3, 2]]), use_sharding_op=True, unspecified_dims=[1]),
    lambda x: tg.xla_sharding.tile(x, [[1, 0], [3, 2]], unspecified_dims=[1]),
  ),
  'partial_tile': (
    lambda x: tfx.partial_tile(x, np.array([[[1, 0]], [[3, 2]]]), use_sharding_op=True),
    lambda x: tg.xla_sharding.partial_tile(x, [[[1, 0]], [[3, 2]]]),
  ),
  'replicate': (lambda x: tfx.replicate(x, use_sharding_op=True), tg.xla_sharding.replicate),
  'assign_device': (
    lambda x: tfx.assign_device(x, 3, use_sharding_op=True),
    lambda x: tg.xla_sharding.assign_device(x, 3),
  ),
  'mesh_split': (
    lambda x: tfx.mesh_split(x, DEVICE_MESH, [1, 0], use_sharding_op=True),
    lambda x: tg.xla_sharding.mesh_split(x, DEVICE_MESH, [1, 0]),
  ),
  'mesh_split_unused_axis': (
    lambda x: tfx.mesh_split(x, DEVICE_MESH, [0, -1], use_sharding_op=True),
    lambda x: tg.shard(x, MESH, P('data', None)),
  ),
  'mesh_split_3d': (
    lambda x: tfx.mesh_split(x, DEVICE_MESH_3D, [-1, 2], use_sharding_op=True),
    lambda x: tg.xla_sharding.mesh_split(x, DEVICE_MESH_3D, [-1, 2]),
  ),
  'mesh_split_manual': (
    lambda x: tfx.mesh_split(
      x, DEVICE_MESH_3D, [0, -1], use_sharding_op=True, manual_mesh_dims=[2]
    ),
    lambda x: tg.xla_sharding.mesh_split(x, DEVICE_MESH_3D, [0, -1], manual_mesh_dims=[2]),
  ),
}


def graph_nodes(annotate):
  """(op, inputs, attrs) of every node of `annotate` traced on a [8, 6] float input."""
  fn = tf.function(lambda x: annotate(x * 2.0) + 1.0)
  graph_def = fn.get_concrete_function(SPEC).graph.as_graph_def()
  return [
    (n.op, list(n.input), {k: v.SerializeToString() for k, v in n.attr.items()})
    for n in graph_def.node
  ]


@pytest.mark.parametrize('name', sorted(SAME_ANNOTATIONS))
def test_graph_is_identical_to_tf_xla_sharding(name):
  tf_annotate, ours = SAME_ANNOTATIONS[name]
  nodes = graph_nodes(ours)
  assert nodes == graph_nodes(tf_annotate)
  assert 'XlaSharding' in [op for op, _, _ in nodes]


@pytest.mark.parametrize('use_sharding_op', [False, True], ids=['attr_form', 'op_form'])
def test_tf_annotations_read_back_equal_to_ours(use_sharding_op):
  """A function annotated with TF's xla_sharding reads back what tf_gspmd's annotations write."""
  read = {}

  @tf.function
  def annotated_by_tf(x):
    outs = {
      'split': tfx.split(x * 1.0, 0, 4, use_sharding_op=use_sharding_op),
      'tile': tfx.tile(x * 2.0, np.array([[1, 0], [3, 2]]), use_sharding_op=use_sharding_op),
      'partial_tile': tfx.partial_tile(
        x * 3.0, np.array([[[1, 0]], [[3, 2]]]), use_sharding_op=use_sharding_op
      ),
      'mesh_split': tfx.mesh_split(x * 4.0, DEVICE_MESH, [0, -1], use_sharding_op=use_sharding_op),
      'replicate': tfx.replicate(x * 5.0, use_sharding_op=use_sharding_op),
      'assign_device': tfx.assign_device(x * 6.0, 2, use_sharding_op=use_sharding_op),
    }
    read['tf'] = {k: get_sharding(t) for k, t in outs.items()}
    return outs

  @tf.function
  def annotated_by_tf_gspmd(x):
    outs = {
      'split': tg.xla_sharding.split(x * 1.0, 0, 4),
      'tile': tg.xla_sharding.tile(x * 2.0, [[1, 0], [3, 2]]),
      'partial_tile': tg.xla_sharding.partial_tile(x * 3.0, [[[1, 0]], [[3, 2]]]),
      'mesh_split': tg.shard(x * 4.0, MESH, P('data', None)),
      'replicate': tg.xla_sharding.replicate(x * 5.0),
      'assign_device': tg.xla_sharding.assign_device(x * 6.0, 2),
    }
    read['ours'] = {k: get_sharding(t) for k, t in outs.items()}
    return outs

  x = np.arange(48, dtype=np.float32).reshape(8, 6)
  by_tf, by_us = annotated_by_tf(x), annotated_by_tf_gspmd(x)
  assert read['tf'] == read['ours'] and None not in read['tf'].values()
  assert read['ours']['mesh_split'].is_equivalent_to(NamedSharding(MESH, P('data', None)))
  assert read['ours']['split'] == Sharding.tiled([[0], [1], [2], [3]])
  for k, scale in [('split', 1), ('tile', 2), ('partial_tile', 3), ('mesh_split', 4)]:
    np.testing.assert_array_equal(by_tf[k].numpy(), x * scale)  # annotations are identities here
    np.testing.assert_array_equal(by_us[k].numpy(), x * scale)


def test_get_sharding_on_a_mesh_and_unannotated_tensors():
  @tf.function
  def f(x):
    a = tfx.mesh_split(x, DEVICE_MESH, [1, 0], use_sharding_op=True)
    b = tg.xla_sharding.replicate(x)
    c = tg.xla_sharding.tile(x, [[1, 0], [3, 2]])
    assert get_sharding(a, MESH) == NamedSharding(MESH, P('model', 'data'))
    assert get_sharding(a, MESH).spec == P('model', 'data')
    assert get_sharding(b, MESH).spec == P(None, None)
    assert type(get_sharding(c, MESH)) is Sharding  # 4 devices: not on this mesh
    assert get_sharding(x) is None and get_sharding(x * 2.0) is None
    return a

  f.get_concrete_function(SPEC)


def test_get_sharding_of_multi_output_op_attr_form():
  @tf.function
  def f(x):
    first, second = tf.split(x, 2, axis=0)
    tfx.split(second, 1, 2)  # attr form on one output of a two-output op: a TUPLE sharding
    assert get_sharding(first) == Sharding.replicated()
    assert get_sharding(second) == Sharding.tiled([[0, 1]])
    return first

  f.get_concrete_function(SPEC)


def test_gradient_carries_the_sharding():
  @tf.function
  def f(x):
    with tf.GradientTape() as tape:
      tape.watch(x)
      y = tg.shard(x * x, MESH, P('data', None))
      loss = tf.reduce_sum(y)
    grad = tape.gradient(loss, x)
    shardings = [
      get_sharding(op.outputs[0]) for op in grad.graph.get_operations() if op.type == 'XlaSharding'
    ]
    assert len(shardings) == 2  # forward and its gradient
    assert all(s.is_equivalent_to(NamedSharding(MESH, P('data', None))) for s in shardings)
    return grad

  x = np.arange(48, dtype=np.float32).reshape(8, 6)
  assert_close(f(x), 2 * x, name='grad')


def test_uneven_and_too_small_dims_are_accepted():
  @tf.function
  def f(x):
    y = tg.xla_sharding.split(x, 1, 8)  # 6 columns over 8 devices: TF's split refuses, XLA pads
    assert get_sharding(y).shard_bounds((8, 6), 7) == ((0, 8), (6, 6))
    return y

  f.get_concrete_function(SPEC)


# --- eager ----------------------------------------------------------------------------------------
def test_eager_annotation_returns_the_tensor_unchanged():
  x = tf.constant(np.arange(48, dtype=np.float32).reshape(8, 6))
  for annotate in [
    lambda t: tg.shard(t, MESH, P('data', None)),
    tg.xla_sharding.replicate,
    lambda t: tg.xla_sharding.split(t, 0, 4),
    lambda t: tg.xla_sharding.mesh_split(t, DEVICE_MESH, [0, 1]),
    lambda t: tg.xla_sharding.tile(t, [[0, 1]]),
    lambda t: tg.xla_sharding.partial_tile(t, [[[0, 1]]]),
    lambda t: tg.xla_sharding.assign_device(t, 1),
  ]:
    assert annotate(x) is x
  assert get_sharding(x) is None
  with pytest.raises(ValueError, match=r"P\('data', None, None\).*shape \(8, 6\)"):
    tg.shard(x, MESH, P('data', None, None))  # still checked eagerly


# --- errors ------------------------------------------------------------------------------------
def test_errors_name_tensor_sharding_and_fix():
  @tf.function
  def wrong_rank(x):
    return tg.shard(x, MESH, P('data'))

  with pytest.raises(ValueError, match=r"annotating tensor 'mul:0'.*P\('data'\).*shape \(8, 6\)"):
    tf.function(lambda x: tg.shard(x * 2.0, MESH, P('data'))).get_concrete_function(SPEC)
  with pytest.raises(ValueError, match='one spec entry per tensor dim'):
    wrong_rank.get_concrete_function(SPEC)
  with pytest.raises(ValueError, match=r'mesh dims \[0\] are used twice'):
    tg.xla_sharding.mesh_split_sharding(DEVICE_MESH, [0, 0])
  with pytest.raises(ValueError, match=r'mesh dim 2 does not exist; use 0..1'):
    tg.xla_sharding.mesh_split_sharding(DEVICE_MESH, [2, -1])
  with pytest.raises(ValueError, match=r'mesh dims \[1\] are used twice'):
    tg.xla_sharding.mesh_split_sharding(DEVICE_MESH, [1, -1], manual_mesh_dims=[1])
  with pytest.raises(ValueError, match=r'split_dimension 2 is out of range.*\[-2, 2\)'):
    tf.function(lambda x: tg.xla_sharding.split(x, 2, 4)).get_concrete_function(SPEC)
  with pytest.raises(TypeError, match='Expected a tf.Variable'):
    tg.shard_variable(tf.constant(1.0), MESH, P())
  with pytest.raises(ValueError, match='a mesh needs a spec'):
    tg.shard_variable(tf.Variable(1.0), MESH)
  with pytest.raises(ValueError, match=r"shard_variable\(w.*P\('data'\).*shape \(8, 6\)"):
    tg.shard_variable(tf.Variable(tf.zeros([8, 6]), name='w'), MESH, P('data'))


def test_mesh_split_sharding_matches_tf():
  cases = [
    (DEVICE_MESH, [0, -1], None),
    (DEVICE_MESH, [-1, -1], None),
    (DEVICE_MESH_3D, [2, 0], None),
    (DEVICE_MESH_3D, [-1], [1, 2]),
    (np.arange(4).reshape(2, 2, 1), [1, -1], None),
  ]
  for device_mesh, mapping, manual in cases:
    ours = op_sharding.to_proto(tg.xla_sharding.mesh_split_sharding(device_mesh, mapping, manual))
    theirs = tfx.mesh_split_sharding(device_mesh, mapping, manual).proto
    assert ours.SerializeToString() == theirs.SerializeToString(), (mapping, manual)


# --- variables -----------------------------------------------------------------------------------
@contextlib.contextmanager
def xla_sharding_for_resource_variables():
  was_enabled = context.xla_sharding_for_resource_variables_enabled()
  context.enable_xla_sharding_for_resource_variables()
  try:
    yield
  finally:
    if not was_enabled:
      context.disable_xla_sharding_for_resource_variables()


def test_shard_variable_is_found_from_reads_in_graphs():
  v = tf.Variable(tf.ones([8, 4]), name='kernel')
  assert tg.shard_variable(v, MESH, P(None, 'model')) is v
  expected = NamedSharding(MESH, P(None, 'model'))
  assert tg.get_sharding(v) == expected and get_sharding(v) == expected
  assert (
    v._get_xla_sharding().SerializeToString() == op_sharding.to_proto(expected).SerializeToString()
  )

  @tf.function
  def inner(x):
    assert get_sharding(v.value()) == expected  # read inside a function nested in another
    return tf.matmul(x, v)

  @tf.function
  def outer(x):
    read = v.read_value()
    assert get_sharding(read) == expected and get_sharding(read, MESH).spec == P(None, 'model')
    assert get_sharding(tf.identity(x)) is None
    return inner(x) + tf.reduce_sum(read)

  x = np.ones([3, 8], np.float32)
  assert_close(outer(x), np.full([3, 4], 8.0 + 32.0, np.float32), name='outer')


def test_resource_variables_under_tf_xla_sharding_flag():
  with xla_sharding_for_resource_variables():
    by_tf = tf.Variable(tf.ones([8, 4]))
    tfx.mesh_split(by_tf, DEVICE_MESH, [-1, 1])  # stored on the variable by TF itself
    by_us = tg.shard_variable(tf.Variable(tf.ones([8, 4])), MESH, P(None, 'model'))

    @tf.function
    def f():
      a, b = by_tf.read_value(), by_us.value()
      assert get_sharding(a) == get_sharding(b)
      assert get_sharding(a).is_equivalent_to(NamedSharding(MESH, P(None, 'model')))
      read_ops = [op.type for op in f_graph().get_operations() if op.type == 'XlaSharding']
      assert len(read_ops) == 2  # TF added one XlaSharding per read
      return a + b

    def f_graph():
      return tf.compat.v1.get_default_graph()

    f.get_concrete_function()
    assert get_sharding(by_tf).is_equivalent_to(NamedSharding(MESH, P(None, 'model')))


# --- Keras 3 --------------------------------------------------------------------------------------
class ShardedDense(keras.layers.Layer):
  """Dense layer annotating its kernel and its output; it stores a P as a tracked attribute."""

  def __init__(self, units, output_spec, **kwargs):
    super().__init__(**kwargs)
    self.units, self.output_spec = units, output_spec

  def build(self, input_shape):
    self.kernel = self.add_weight(shape=(input_shape[-1], self.units), name='kernel')
    tg.shard_variable(self.kernel, MESH, P(None, 'model'))

  def call(self, x):
    return tg.shard(keras.ops.matmul(x, self.kernel), MESH, self.output_spec)


def test_keras_layer_annotations():
  layer = ShardedDense(8, P('data', 'model'))
  assert layer.output_spec == P('data', 'model')  # survived Keras' attribute tracking
  x = np.random.default_rng(0).normal(size=(4, 6)).astype(np.float32)
  eager = layer(x).numpy()  # eager call: annotations return their input
  assert tg.get_sharding(layer.kernel) == NamedSharding(MESH, P(None, 'model'))

  @tf.function
  def forward(inputs):
    y = layer(inputs)
    assert get_sharding(y, MESH).spec == P('data', 'model')
    kernel_reads = [op.outputs[0] for op in y.graph.get_operations() if op.type == 'ReadVariableOp']
    assert [get_sharding(t, MESH).spec for t in kernel_reads] == [P(None, 'model')]
    return y

  assert_close(forward(x), eager, name='traced')
  assert_close(eager, x @ layer.kernel.numpy(), name='eager')


def test_keras_functional_model_traces_annotations():
  inputs = keras.Input(shape=(6,), batch_size=4)
  model = keras.Model(inputs, ShardedDense(8, P('data', None))(inputs))
  graph = tf.function(model).get_concrete_function(tf.TensorSpec([4, 6])).graph
  found = [
    get_sharding(op.outputs[0], MESH) for op in graph.get_operations() if op.type == 'XlaSharding'
  ]
  assert found == [NamedSharding(MESH, P('data', None))]
