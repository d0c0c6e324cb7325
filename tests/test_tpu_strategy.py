"""The TPUStrategy path (tf_gspmd.xla_bridge.tpu), tested as far as it runs without a TPU.

* the topology read from a serialized TopologyProto as TF reads the one TPU
  initialization returns, and the device assignment derived from it;
* the replica function `strategy.run` calls (built under a MirroredStrategy of
  8 logical CPUs, which has the same replica API), lowered by tf2xla with its
  replica groups read from the HLO;
* that function run on 8 PJRT CPU replicas with XLA's replica id as the
  partition id (what `replica_id_in_sync_group` is on a TPU), trained against
  the unpartitioned step.
"""

import collections

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.compiler.xla.service import hlo_pb2

import tf_gspmd as tg
from tf_gspmd.testing import assert_close, check
from tf_gspmd.xla_bridge import tpu
from tf_gspmd.xla_bridge.hlo import hlo_collectives

MODEL_GROUPS = ((0, 1, 2, 3), (4, 5, 6, 7))
DATA_GROUPS = ((0, 4), (1, 5), (2, 6), (3, 7))


def test_topology_from_serialized_proto():
  topology = tf.tpu.experimental.Topology(serialized=tpu.topology_proto((2, 2, 1), 2))
  assert list(topology.mesh_shape) == [2, 2, 1, 2]
  assert topology.num_tasks == 1 and topology.num_tpus_per_task == 8
  # TPU ordinals: chip by chip, the two cores of a chip consecutive.
  assert topology.tpu_device_ordinal_at_coordinates((1, 0, 0, 1)) == 3
  assert topology.tpu_device_ordinal_at_coordinates((0, 1, 0, 0)) == 4


def test_device_assignment_keeps_model_groups_on_neighbouring_chips():
  mesh = tg.Mesh.create((2, 4), ('data', 'model'))
  assignment = tpu.mesh_device_assignment(tpu.topology_proto((2, 2, 1), 2), mesh)
  assert isinstance(assignment, tf.tpu.experimental.DeviceAssignment)
  assert assignment.num_replicas == 8 and assignment.num_cores_per_replica == 1
  coords = [assignment.coordinates(r, 0) for r in range(8)]
  assert sorted(coords) == sorted(set(coords))  # every core once
  for group in MODEL_GROUPS:  # one row of chips (same y)
    assert len({coords[r][1] for r in group}) == 1
    assert {(coords[r][0], coords[r][3]) for r in group} == {(0, 0), (0, 1), (1, 0), (1, 1)}
  for group in DATA_GROUPS:  # same chip position, y differs
    assert len({(coords[r][0], coords[r][3]) for r in group}) == 1
  # Replica r runs on the TPU device of its core.
  assert assignment.tpu_ordinal(replica=0) == 0 and assignment.tpu_ordinal(replica=3) == 3
  assert assignment.tpu_ordinal(replica=4) == 4
  assert assignment.tpu_device(replica=5).endswith('device:TPU:5')


def test_device_assignment_in_another_core_order_and_wrong_size():
  mesh = tg.Mesh.create((2, 4), ('data', 'model'))
  by_x = tpu.mesh_device_assignment(
    tpu.topology_proto((2, 2, 1), 2), mesh, core_order=('x', 'y', 'core', 'z')
  )
  assert [by_x.coordinates(r, 0) for r in range(4)] == [
    (0, 0, 0, 0),
    (1, 0, 0, 0),
    (0, 1, 0, 0),
    (1, 1, 0, 0),
  ]
  with pytest.raises(ValueError, match='has 8 devices but the TPU topology'):
    tpu.mesh_device_assignment(tpu.topology_proto((2, 2, 2), 2), mesh)


# --- the replica program ----------------------------------------------------------------------
def _megatron(seed=0):
  rng = np.random.RandomState(seed)
  return (
    tf.Variable(rng.randn(16, 32).astype(np.float32) * 0.3, name='w1'),
    tf.Variable(rng.randn(32, 8).astype(np.float32) * 0.3, name='w2'),
  )


def _train_step(w1, w2, mesh=None):
  @tf.function
  def step(x):
    if mesh is not None:
      x = tg.shard(x, mesh, tg.P('data', None))
    with tf.GradientTape() as tape:
      loss = tf.reduce_mean(tf.matmul(tf.nn.relu(tf.matmul(x, w1)), w2) ** 2)
    g1, g2 = tape.gradient(loss, [w1, w2])
    w1.assign_sub(0.1 * g1)
    w2.assign_sub(0.1 * g2)
    return loss

  return step


@pytest.fixture(scope='module')
def megatron_step():
  mesh = tg.Mesh.create((2, 4), ('data', 'model'))
  w1, w2 = _megatron()
  tg.shard_variable(w1, mesh, tg.P(None, 'model'))
  tg.shard_variable(w2, mesh, tg.P('model', None))
  # MirroredStrategy on 8 logical CPUs: the same replica API as TPUStrategy.
  strategy = tf.distribute.MirroredStrategy([f'/device:CPU:{i}' for i in range(8)])
  x = np.ones((8, 16), np.float32)
  step = tpu.TPUStrategyStep(
    tg.partition(_train_step(w1, w2, mesh), mesh), strategy, x, exported=False
  )
  return step, (w1, w2)


def test_shard_variables_hold_each_replicas_shard(megatron_step):
  step, (w1, _) = megatron_step
  components = step.strategy.experimental_local_results(step.shard_variables[0])
  assert len(components) == 8 and tuple(components[0].shape) == (16, 8)
  for replica, component in enumerate(components):
    column = replica % 4  # w1 is P(None, 'model'): replica r holds columns of model index r % 4
    np.testing.assert_array_equal(component.numpy(), w1.numpy()[:, 8 * column : 8 * column + 8])


def test_the_replica_components_hold_the_variables_value_at_each_step(megatron_step):
  step, (w1, w2) = megatron_step
  before = w1.numpy()
  w1.assign(tf.zeros_like(w1))
  step.scatter_variables()  # what each step does first: a plain variable is its own state
  components = step.variables.sharded[id(w1)].components()
  assert not any(c.numpy().any() for c in components)
  w1.assign(before)
  np.testing.assert_array_equal(w1.numpy(), before)


def _replica_hlo(step, examples):
  function = step.replica_function()
  return function, function.experimental_get_compiler_ir(*examples)


def test_replica_program_lowers_with_mesh_replica_groups(megatron_step):
  step, _ = megatron_step
  variables = [
    tf.Variable(tf.zeros(s.shape, s.dtype)) for s in [tf.TensorSpec((16, 8)), tf.TensorSpec((8, 8))]
  ]
  _, ir = _replica_hlo(step, step.local_examples(variables))
  found = [(c.kind, c.replica_groups) for c in hlo_collectives(ir(stage='hlo'))]
  # The row-parallel matmul over 'model', then the loss and two gradients over 'data', side by
  # side (one bucket: XLA's combiner fuses them).
  assert found == [('all-reduce', MODEL_GROUPS)] + [('all-reduce', DATA_GROUPS)] * 3
  # One program for all replicas: no partition-id parameter, the id is XLA's replica id.
  assert 'replica-id' in ir(stage='hlo')


def test_replica_program_trains_on_pjrt_replicas_like_the_unpartitioned_step(megatron_step):
  pytest.importorskip('jax')
  from jax._src.lib import xla_client

  from tf_gspmd.xla_bridge import export as export_lib
  from tf_gspmd.xla_bridge import pjrt

  devices = pjrt.jax_devices(8)  # before any XLA call: XLA reads its flags once
  step, _ = megatron_step
  mesh = step.mesh
  rng = np.random.RandomState(1)
  batches = [rng.randn(8, 16).astype(np.float32) for _ in range(3)]
  ref_w1, ref_w2 = _megatron()
  reference = _train_step(ref_w1, ref_w2)
  w1, w2 = _megatron()

  # The replica program, lowered once (tf2xla) and compiled for 8 replicas (no donation).
  layouts = [(s, v) for (_, s, _), v in zip(step.variable_layouts, (w1, w2))]
  templates = [tf.Variable(tf.zeros(s.shard_shape(v.shape))) for s, v in layouts]
  _, ir = _replica_hlo(step, step.local_examples(templates))
  module = hlo_pb2.HloModuleProto.FromString(ir(stage='hlo_serialized'))
  updates = {e.output_shape_index[0]: e.parameter_number for e in module.input_output_alias.entries}
  module.ClearField('input_output_alias')
  stablehlo = xla_client._xla.mlir.hlo_to_stablehlo(module.SerializeToString())  # noqa: SLF001
  arg_layout = export_lib.ExportedValue(
    'x', 'argument', (8, 16), tf.float32, step.arg_shardings[0], step.local_specs[0].shape
  )
  var_layouts = [
    export_lib.ExportedValue(
      f'w{i}', 'variable', tuple(v.shape), tf.float32, s, s.shard_shape(v.shape)
    )
    for i, (s, v) in enumerate(layouts)
  ]
  loss_layout = export_lib.ExportedValue(
    'loss', 'output', (), tf.float32, step._compiled.out_shardings[0], ()
  )  # noqa: SLF001
  export = export_lib.XlaExport(
    stablehlo, mesh, [arg_layout] + var_layouts, [loss_layout] + var_layouts, 'tpu_replica'
  )
  executable = pjrt.PjrtExecutable(export, devices)
  state = [pjrt.put_global(v.numpy(), layout, devices) for v, layout in zip((w1, w2), var_layouts)]
  assert sorted(updates.items()) == [(1, 1), (2, 2)]  # the new values of w1, w2
  for i, x in enumerate(batches):
    outputs = executable.run([pjrt.put_global(x, arg_layout, devices)] + state)
    state = outputs[1:]
    assert_close(np.asarray(outputs[0][0]), reference(x), f'step {i + 1} loss')
  assert_close(
    {
      layout.name: pjrt.assemble_global(buffers, layout.sharding, layout.shape, layout.name)
      for buffers, layout in zip(state, var_layouts)
    },
    {layout.name: ref for layout, ref in zip(var_layouts, (ref_w1, ref_w2))},
    'weights',
  )
  # The collectives XLA runs are the mesh's: all-reduces over 'model' and 'data' groups.
  kinds = {(c.kind, c.replica_groups) for c in hlo_collectives(executable.compiled_hlo())}
  assert {g for _, g in kinds} <= {MODEL_GROUPS, DATA_GROUPS}


def test_step_runs_under_strategy_run_with_replica_id_as_partition_id():
  """The host side end to end (split, strategy.run, assemble, shard variables) on a program
  without collectives (XLA collective ops have no CPU kernel outside a compiled program)."""
  mesh = tg.Mesh.create((2, 4), ('data', 'model'))
  w = tf.Variable(np.arange(8, dtype=np.float32), name='w_elementwise')
  tg.shard_variable(w, mesh, tg.P('model'))

  @tf.function
  def fn(x):
    x = tg.shard(x, mesh, tg.P('data', 'model'))
    # The iotas are sliced by each partition's offsets: they depend on the partition id.
    iota = tf.range(4)[:, None] * 100 + tf.range(8)[None, :] * 10
    w.assign(w * 3.0)
    return x * 2.0 + w + tf.cast(iota, tf.float32)

  strategy = tf.distribute.MirroredStrategy([f'/device:CPU:{i}' for i in range(8)])
  x = np.arange(32, dtype=np.float32).reshape(4, 8)
  want = x * 2 + np.arange(8) * 3 + np.arange(4)[:, None] * 100 + np.arange(8) * 10
  # The traced program: the exported module (XlaCallModule) runs only inside a compiled XLA
  # program, and MirroredStrategy on CPUs runs each replica's ops eagerly, one device at a time.
  step = tpu.TPUStrategyStep(tg.partition(fn, mesh), strategy, x, exported=False)
  np.testing.assert_array_equal(step(x).numpy(), want)
  np.testing.assert_array_equal(w.numpy(), np.arange(8) * 3)
  # Every replica claiming partition 0 gives other numbers: the replica id is what decides.
  w.assign(np.arange(8, dtype=np.float32))
  wrong = tpu.TPUStrategyStep(
    tg.partition(fn, mesh), strategy, x, replica_id=lambda: tf.constant(0, tf.int32), exported=False
  )
  verdict = check(wrong(x), want.astype(np.float32), 'every replica as partition 0')
  assert not verdict.ok and 1e3 * verdict.bound < verdict.error < np.inf, verdict


# --- the exported per-replica module (XlaCallModule) ----------------------------------------------
def _zero_megatron_step(w1, w2, mesh=None):
  """Megatron MLP with the weights also split over 'data' (gathered before use: all-gathers)."""
  if mesh is not None:
    tg.shard_variable(w1, mesh, tg.P('data', 'model'))
    tg.shard_variable(w2, mesh, tg.P('model', 'data'))
  return _train_step(w1, w2, mesh)


@pytest.fixture(scope='module')
def exported_step():
  pytest.importorskip('jax')
  mesh = tg.Mesh.create((2, 4), ('data', 'model'))
  w1, w2 = _megatron()
  strategy = tf.distribute.MirroredStrategy([f'/device:CPU:{i}' for i in range(8)])
  x = np.ones((8, 16), np.float32)
  step = tpu.TPUStrategyStep(tg.partition(_zero_megatron_step(w1, w2, mesh), mesh), strategy, x)
  return step, (w1, w2)


def test_exported_module_lowers_with_native_all_gathers(exported_step):
  step, _ = exported_step
  assert 'stablehlo.all_gather' in step.export.module
  _, ir = _replica_hlo(
    step, step.local_examples([tf.Variable(tf.zeros((8, 8))), tf.Variable(tf.zeros((8, 4)))])
  )
  hlo = ir(stage='hlo')
  assert 'custom-call' not in hlo  # tf2xla inlined the module: no call, no marker left
  found = collections.Counter((c.kind, c.replica_groups) for c in hlo_collectives(hlo))
  assert found == {
    # w1 and w2 gathered over 'data' once each: the backward's matmul reads the gathered w2
    # the forward's did (one reshard per value and target; a second gather was 3 here).
    ('all-gather', DATA_GROUPS): 2,
    ('all-reduce', MODEL_GROUPS): 1,
    ('all-reduce', DATA_GROUPS): 1,
    ('reduce-scatter', DATA_GROUPS): 2,
  }
  entry = hlo.split('ENTRY', 1)[1].split('\n', 1)[0]
  assert 'partition' not in entry and 'f32[8,16]' not in entry  # local shards only, no id arg


def test_exported_module_trains_on_pjrt_replicas_like_the_unpartitioned_step(exported_step):
  """The replica function strategy.run calls (XlaCallModule of the exported module, variables
  read and assigned), lowered by tf2xla and compiled for 8 PJRT CPU replicas."""
  from jax._src.lib import xla_client

  from tf_gspmd.xla_bridge import export as export_lib
  from tf_gspmd.xla_bridge import pjrt

  devices = pjrt.jax_devices(8)
  step, _ = exported_step
  rng = np.random.RandomState(2)
  batches = [rng.randn(8, 16).astype(np.float32) for _ in range(3)]
  ref_w1, ref_w2 = _megatron()
  reference = _train_step(ref_w1, ref_w2)
  w1, w2 = _megatron()

  arg_layouts = step.export.args  # x, then the variables w1, w2
  templates = [tf.Variable(tf.zeros(a.local_shape)) for a in arg_layouts[1:]]
  _, ir = _replica_hlo(step, step.local_examples(templates))
  module = hlo_pb2.HloModuleProto.FromString(ir(stage='hlo_serialized'))
  updates = {e.output_shape_index[0]: e.parameter_number for e in module.input_output_alias.entries}
  assert sorted(updates.items()) == [(1, 1), (2, 2)]  # the loss, then the new w1, w2
  module.ClearField('input_output_alias')
  stablehlo = xla_client._xla.mlir.hlo_to_stablehlo(module.SerializeToString())  # noqa: SLF001
  results = [step.export.results[0]] + [arg_layouts[updates[j]] for j in (1, 2)]
  lowered = export_lib.XlaExport(stablehlo, step.mesh, list(arg_layouts), results, 'tpu_replica')
  executable = pjrt.PjrtExecutable(lowered, devices)
  state = [
    pjrt.put_global(v.numpy(), layout, devices) for v, layout in zip((w1, w2), arg_layouts[1:])
  ]
  for i, x in enumerate(batches):
    outputs = executable.run([pjrt.put_global(x, arg_layouts[0], devices)] + state)
    state = outputs[1:]
    assert_close(np.asarray(outputs[0][0]), reference(x), f'step {i + 1} loss')
  assert_close(
    {
      layout.name: pjrt.assemble_global(buffers, layout.sharding, layout.shape, layout.name)
      for buffers, layout in zip(state, arg_layouts[1:])
    },
    {layout.name: ref for layout, ref in zip(arg_layouts[1:], (ref_w1, ref_w2))},
    'weights',
  )
  # What XLA compiled: the weights gathered by native all-gathers over 'data'.
  compiled = collections.Counter(
    (c.kind, c.replica_groups) for c in hlo_collectives(executable.compiled_hlo())
  )
  assert compiled[('all-gather', DATA_GROUPS)] >= 2, compiled
  assert {g for _, g in compiled} <= {MODEL_GROUPS, DATA_GROUPS}
