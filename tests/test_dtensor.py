"""TF DTensor Mesh and Layout, taken wherever a tf_gspmd mesh or sharding is, converted exactly.

DTensor meshes are built here without DTensor's runtime (no
`initialize_accelerator_system`, no DTensor device): `dtensor.create_mesh(dims,
devices=[...])` and `dtensor.Mesh(...)` only make value types.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.experimental import dtensor

import tf_gspmd as tg
from tf_gspmd import Mesh, NamedSharding, P, Sharding, get_sharding
from tf_gspmd.annotations import variable_sharding
from tf_gspmd.dtensor_compat import is_dtensor_layout, is_dtensor_mesh, mesh_devices
from tf_gspmd.testing import assert_close

from helpers import loop_training, randn  # noqa: E402

UNSHARDED = dtensor.UNSHARDED
CPUS = [f'CPU:{i}' for i in range(8)]


def dtensor_mesh(*dims, devices=CPUS):
  return dtensor.create_mesh(list(dims), devices=devices)


MESH_2X4 = dtensor_mesh(('batch', 2), ('model', 4))
MESH_2X2X2 = dtensor_mesh(('x', 2), ('y', 2), ('z', 2))
MESH_8 = dtensor_mesh(('batch', 8))


def kinds(pf):
  return sorted((r['kind'], r['axes'], r.get('fused', 1)) for r in pf.collectives())


# --- conversions -----------------------------------------------------------------------------
@pytest.mark.parametrize(
  'mesh, want',
  [
    (MESH_8, Mesh.create((8,), ('batch',))),
    (MESH_2X4, Mesh.create((2, 4), ('batch', 'model'))),
    (MESH_2X2X2, Mesh.create((2, 2, 2), ('x', 'y', 'z'))),
    (
      dtensor.Mesh(['a', 'b'], np.arange(8).reshape(4, 2), list(range(8)), CPUS),
      Mesh.create((4, 2), ('a', 'b')),
    ),
  ],
  ids=['8', '2x4', '2x2x2', 'Mesh(...)'],
)
def test_mesh_converts_to_its_names_shape_and_device_order(mesh, want):
  got = tg.from_dtensor_mesh(mesh)
  assert got == want and got.shape == dict(zip(mesh.dim_names, mesh.shape()))
  # Each id runs on the device DTensor gives it: create_mesh's own job/replica/task names.
  names = [tf.DeviceSpec.from_string(d).to_string() for d in mesh.local_devices()]
  assert mesh_devices(mesh) == tuple(names) and names[5].endswith('device:CPU:5')


def test_mesh_on_later_devices_counts_ids_from_its_first_device():
  mesh = dtensor.Mesh(['x'], np.arange(4, 8), [4, 5, 6, 7], CPUS[4:])
  assert tg.from_dtensor_mesh(mesh) == Mesh.create((4,), ('x',))
  assert mesh_devices(mesh) == tuple(f'/device:CPU:{i}' for i in range(4, 8))


def test_mesh_devices_is_none_when_this_process_lacks_some():
  multi_client = dtensor.Mesh(['x'], np.arange(4), [0, 1], CPUS[:2], global_devices=CPUS[:4])
  one_host_cpu = dtensor.Mesh(['x'], np.arange(4), [0, 1, 2, 3], ['CPU:0'] * 4)
  assert mesh_devices(multi_client) is None and mesh_devices(one_host_cpu) is None
  assert tg.from_dtensor_mesh(multi_client) == Mesh.create((4,), ('x',))


LAYOUTS = {
  'batch_unsharded': (dtensor.Layout(['batch', UNSHARDED], MESH_2X4), P('batch', None)),
  'unsharded_model': (dtensor.Layout([UNSHARDED, 'model'], MESH_2X4), P(None, 'model')),
  'transposed_axes': (dtensor.Layout(['model', 'batch'], MESH_2X4), P('model', 'batch')),
  'batch_sharded': (
    dtensor.Layout.batch_sharded(MESH_2X4, 'batch', rank=3),
    P('batch', None, None),
  ),
  'batch_sharded_axis_1': (
    dtensor.Layout.batch_sharded(MESH_2X4, 'model', rank=3, axis=1),
    P(None, 'model', None),
  ),
  'inner_sharded': (
    dtensor.Layout.inner_sharded(MESH_2X4, 'model', rank=3),
    P(None, None, 'model'),
  ),
  'replicated': (dtensor.Layout.replicated(MESH_2X4, rank=2), P(None, None)),
  'scalar': (dtensor.Layout([], MESH_2X4), P()),
  '2x2x2': (dtensor.Layout(['z', UNSHARDED, 'x'], MESH_2X2X2), P('z', None, 'x')),
  '2x2x2_all_axes': (dtensor.Layout(['y', 'x', 'z'], MESH_2X2X2), P('y', 'x', 'z')),
  '1d': (dtensor.Layout.batch_sharded(MESH_8, 'batch', rank=2), P('batch', None)),
}


@pytest.mark.parametrize('name', sorted(LAYOUTS))
def test_layout_converts_to_the_same_spec_on_the_converted_mesh(name):
  layout, spec = LAYOUTS[name]
  got = tg.from_dtensor_layout(layout)
  assert isinstance(got, NamedSharding)
  assert (got.mesh, got.spec) == (tg.from_dtensor_mesh(layout.mesh), spec)
  # Every device holds the piece DTensor's own layout gives it (shard index per tensor dim).
  for device, shard in enumerate(layout.offset_to_shard()):
    assert got.tile_index(device) == shard, (device, shard)
  assert got.tile_shape == tuple(layout.num_shards(d) for d in range(layout.rank))


def test_replicated_layout_is_replicated():
  assert tg.from_dtensor_layout(dtensor.Layout.replicated(MESH_2X2X2, rank=3)).is_replicated


@pytest.mark.parametrize(
  'layout, device',
  [
    (dtensor.Layout.from_device('CPU:5'), 5),
    (
      dtensor.Layout.from_single_device_mesh(
        dtensor.Mesh.from_device('/job:localhost/replica:0/task:0/device:CPU:3')
      ),
      3,
    ),
  ],
)
def test_single_device_layout_is_maximal_on_that_device(layout, device):
  assert layout.is_single_device()
  got = tg.from_dtensor_layout(layout)
  assert got.is_maximal and got == Sharding.maximal(device)


def test_parted_layout_is_refused_naming_it_and_why():
  parted = dtensor.Layout(['batch', UNSHARDED], MESH_2X4).to_parted()
  with pytest.raises(
    ValueError,
    match=r"parted layout \['batch', 'unsharded'\] on mesh "
    r'\(batch=2, model=4\): .*independent',
  ):
    tg.from_dtensor_layout(parted)
  with pytest.raises(ValueError, match='parted layout'):  # and wherever a layout is taken
    tg.shard_variable(tf.Variable(tf.zeros([4, 4])), parted)


def test_match_spec_is_refused():
  with pytest.raises(ValueError, match=r"\['match', 'batch'\].*another tensor"):
    tg.from_dtensor_layout(dtensor.Layout([dtensor.MATCH, 'batch'], MESH_2X4))


def test_single_device_mesh_and_other_values_are_refused():
  with pytest.raises(ValueError, match='single-device mesh'):
    tg.from_dtensor_mesh(dtensor.Mesh.from_device('CPU:1'))
  with pytest.raises(TypeError, match='tf.experimental.dtensor.Mesh'):
    tg.from_dtensor_mesh(Mesh.create((8,), ('x',)))
  with pytest.raises(TypeError, match='tf.experimental.dtensor.Layout'):
    tg.from_dtensor_layout(P('x'))


def test_is_dtensor_helpers():
  layout = LAYOUTS['batch_unsharded'][0]
  assert is_dtensor_mesh(MESH_2X4) and is_dtensor_mesh(layout.mesh)
  assert is_dtensor_layout(layout) and not is_dtensor_layout(MESH_2X4)
  assert not is_dtensor_mesh(tg.from_dtensor_mesh(MESH_2X4))
  assert not is_dtensor_layout(tg.from_dtensor_layout(layout))


# --- entry points ----------------------------------------------------------------------------
def graph_nodes(annotate):
  fn = tf.function(lambda x: annotate(x * 2.0) + 1.0)
  graph_def = fn.get_concrete_function(tf.TensorSpec([8, 12], tf.float32)).graph.as_graph_def()
  return [
    (n.op, list(n.input), {k: v.SerializeToString() for k, v in n.attr.items()})
    for n in graph_def.node
  ]


@pytest.mark.parametrize(
  'ours',
  [
    lambda x: tg.shard(x, dtensor.Layout([UNSHARDED, 'model'], MESH_2X4)),
    lambda x: tg.shard(x, MESH_2X4, P(None, 'model')),
  ],
  ids=['layout', 'mesh_and_spec'],
)
def test_shard_writes_the_graph_of_the_converted_sharding(ours):
  want = graph_nodes(
    lambda x: tg.shard(x, Mesh.create((2, 4), ('batch', 'model')), P(None, 'model'))
  )
  assert graph_nodes(ours) == want

  @tf.function
  def f(x):
    y = ours(x)
    assert get_sharding(y).is_equivalent_to(
      NamedSharding(Mesh.create((2, 4), ('batch', 'model')), P(None, 'model'))
    )
    return y

  f.get_concrete_function(tf.TensorSpec([8, 12], tf.float32))


def test_shard_with_a_single_device_layout_is_assign_device():
  single = dtensor.Layout.from_device('CPU:3')
  assert graph_nodes(lambda x: tg.shard(x, single)) == graph_nodes(
    lambda x: tg.xla_sharding.assign_device(x, 3)
  )


@pytest.mark.parametrize(
  'args',
  [
    (dtensor.Layout(['model', UNSHARDED], MESH_2X4),),
    (MESH_2X4, P('model', None)),
  ],
  ids=['layout', 'mesh_and_spec'],
)
def test_shard_variable_stores_the_converted_sharding(args):
  v = tf.Variable(tf.zeros([8, 6]))
  tg.shard_variable(v, *args)
  got = variable_sharding(v)
  assert (got.mesh, got.spec) == (Mesh.create((2, 4), ('batch', 'model')), P('model', None))


def _dense_model():
  keras.utils.set_random_seed(0)
  return keras.Sequential(
    [keras.Input((16,)), keras.layers.Dense(32, name='h0'), keras.layers.Dense(4, name='out')],
    name='mlp',
  )


def test_layout_map_takes_a_dtensor_mesh_and_layouts():
  model = _dense_model()
  layout = tg.LayoutMap(MESH_2X4)
  layout[r'.*h0/kernel'] = dtensor.Layout([UNSHARDED, 'model'], MESH_2X4)
  layout[r'.*h0/bias'] = dtensor.Layout(['model'], MESH_2X4)
  layout[r'.*out/kernel'] = ('model', None)  # a plain spec beside them, as before
  assert layout.mesh == Mesh.create((2, 4), ('batch', 'model'))
  applied = dict(layout.apply(model))
  assert applied == {
    'mlp/h0/kernel': P(None, 'model'),
    'mlp/h0/bias': P('model'),
    'mlp/out/kernel': P('model', None),
  }
  kernel = next(v for v in model.variables if v.path == 'mlp/h0/kernel')
  assert variable_sharding(kernel) == NamedSharding(layout.mesh, P(None, 'model'))


def test_layout_map_refuses_a_layout_on_another_mesh():
  layout = tg.LayoutMap(MESH_2X4)
  with pytest.raises(ValueError, match=r"LayoutMap: the DTensor layout for '\.\*kernel'"):
    layout[r'.*kernel'] = dtensor.Layout([UNSHARDED, 'z'], MESH_2X2X2)
  with pytest.raises(ValueError, match='not a spec on this map'):
    layout[r'.*bias'] = dtensor.Layout.from_device('CPU:0')


def test_partition_takes_a_dtensor_mesh_and_layouts_one_per_tensor():
  rows = dtensor.Layout.batch_sharded(MESH_8, 'batch', rank=2)
  pf = tg.partition(
    tf.function(lambda a, b: a * 2.0 + b), MESH_8, in_shardings=[rows, rows], out_shardings=[rows]
  )
  a, b = randn(0, 16, 5), randn(1, 16, 5)
  assert_close(pf(a, b), a * 2.0 + b)
  assert pf.mesh == Mesh.create((8,), ('batch',)) and pf.collectives() == []
  want = NamedSharding(Mesh.create((8,), ('batch',)), P('batch', None))
  assert pf.get_program(a, b).arg_shardings == [want, want]


def test_partition_runs_on_the_dtensor_meshs_devices():
  mesh = dtensor_mesh(('x', 4), devices=CPUS[4:])
  cols = dtensor.Layout([UNSHARDED, 'x'], mesh)
  pf = tg.partition(tf.function(lambda a: tf.reduce_sum(a, axis=1)), mesh, in_shardings=cols)
  a = randn(0, 3, 8)
  assert_close(pf(a), a.sum(axis=1))
  devices = pf.get_program(a).prepared.devices
  assert [tf.DeviceSpec.from_string(d).device_index for d in devices] == [4, 5, 6, 7]
  assert kinds(pf) == [('all_reduce', ('x',), 1)]


def test_partition_refines_its_mesh_for_a_layout_on_a_finer_mesh():
  # A 2x2x2 layout on a 2x4 partition splits 'model' in two: the program needs its sub-axes,
  # which it can only see when the layout is converted before the mesh is chosen.
  layout = dtensor.Layout(['x', 'y', 'z'], MESH_2X2X2)
  pf = tg.partition(tf.function(lambda a: tf.reduce_sum(a, axis=2)), MESH_2X4, in_shardings=layout)
  a = randn(0, 4, 6, 8)
  assert_close(pf(a), a.sum(axis=2))
  assert [(k, axes) for k, axes, _ in kinds(pf)] == [('all_reduce', ('model#1',))]


# --- a DTensor-annotated MLP training step, ported ------------------------------------------
def _dtensor_variable(seed, shape, layout):
  """What `dtensor.DVariable(dtensor.call_with_layout(init, layout))` makes, here annotated.

  `call_with_layout` needs DTensor's runtime; the layout moves to `shard_variable` instead.
  """
  v = tf.Variable(randn(seed, *shape) * 0.1)
  return tg.shard_variable(v, layout)


def _sgd_steps(w1, w2):
  """`steps` SGD steps of the 2-layer MLP `relu(x @ w1) @ w2`; the annotations are the layouts."""
  return loop_training(None, w1, w2, annotate=False)


def test_dtensor_annotated_mlp_trains_partitioned_like_unpartitioned():
  mesh = MESH_2X4
  # Megatron: the first kernel split by columns, the second by rows, over 'model'.
  w1 = _dtensor_variable(0, (16, 32), dtensor.Layout([UNSHARDED, 'model'], mesh))
  w2 = _dtensor_variable(1, (32, 4), dtensor.Layout(['model', UNSHARDED], mesh))
  w1_ref, w2_ref = tf.Variable(randn(0, 16, 32) * 0.1), tf.Variable(randn(1, 32, 4) * 0.1)
  step = tg.partition(
    _sgd_steps(w1, w2),
    mesh,
    in_shardings=[
      dtensor.Layout.batch_sharded(mesh, 'batch', rank=2),
      dtensor.Layout.batch_sharded(mesh, 'batch', rank=1),
      None,
    ],
    out_shardings=dtensor.Layout.replicated(mesh, rank=0),
  )
  reference = _sgd_steps(w1_ref, w2_ref)
  x, y = randn(2, 12, 16), np.random.RandomState(3).randint(0, 4, 12).astype(np.int32)
  one = tf.constant(1)
  for k in range(3):
    assert_close(step(x, y, one), reference(x, y, one), name=f'loss {k}')
  assert_close([w1.numpy(), w2.numpy()], [w1_ref.numpy(), w2_ref.numpy()], name='[w1, w2]')
  args = step.get_program(x, y, one).arg_shardings
  assert [s.spec for s in args[:2]] == [P('batch', None), P('batch')]
  # The row-parallel matmul's one sum over 'model'; the loss and both gradients summed over
  # 'batch' in one bucket. Layouts left unconverted would move or sum other things.
  assert kinds(step) == [('all_reduce', ('batch',), 3), ('all_reduce', ('model',), 1)]
