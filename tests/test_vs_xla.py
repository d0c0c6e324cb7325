"""The same annotated TF step partitioned two ways: by tf_gspmd and by XLA's own SPMD partitioner.

XLA's side (tf_gspmd.xla_bridge.reference_partitioner) lowers the unpartitioned
step through tf2xla with its XlaSharding annotations, gives every parameter
the layout tf_gspmd chose for it, and lets XLA partition it on 8 PJRT CPU
devices. Both are trained against the unpartitioned step.
"""

import numpy as np
import pytest
import tensorflow as tf

import tf_gspmd as tg
from tf_gspmd.testing import assert_close

pytest.importorskip('jax')
from tf_gspmd.xla_bridge import reference_partitioner  # noqa: E402

from helpers import keras_mlp, keras_train_step, mlp_batches  # noqa: E402

MESH_SHAPE, AXES = (2, 4), ('data', 'model')


def _megatron_layout(mesh):
  layout = tg.LayoutMap(mesh)
  layout[r'.*hidden_0/kernel'] = tg.P(None, 'model')
  layout[r'.*hidden_0/bias'] = tg.P('model')
  layout[r'.*hidden_1/kernel'] = tg.P('model', None)
  return layout


def _both_ways(mesh, batches):
  """(ours, XLA's, unpartitioned reference, model, reference model) on one shared model."""
  model, optimizer = keras_mlp(0)
  ref_model, ref_optimizer = keras_mlp(0)
  _megatron_layout(mesh).apply(model)
  annotate = lambda x: tg.shard(x, mesh, tg.P('data', None))  # noqa: E731
  step = keras_train_step(model, optimizer, annotate)
  ours = tg.partition(step, mesh)
  program = ours.get_program(*batches[0])
  layouts = {id(v): ours.store.sharded[id(v)].sharding for v in program.variables}
  # XLA's side copies the variables' values now, before either side trains.
  theirs = reference_partitioner.XlaPartitionedStep(
    step,
    batches[0],
    mesh.size,
    arg_shardings=program.arg_shardings,
    variable_sharding=lambda v: layouts.get(id(v)),
  )
  # Ours compiled by XLA too (backend='xla'), to read its collectives from compiled HLO: on a
  # model of its own (a partitioned function's variables are one state with its shards).
  xla_model, xla_optimizer = keras_mlp(0)
  _megatron_layout(mesh).apply(xla_model)
  ours_xla = tg.partition(keras_train_step(xla_model, xla_optimizer, annotate), mesh, backend='xla')
  return ours, ours_xla, theirs, keras_train_step(ref_model, ref_optimizer), model, ref_model


@pytest.mark.slow  # three programs compiled by XLA (make test runs it)
def test_mlp_2d_mesh_values_and_collectives():
  mesh = tg.Mesh.create(MESH_SHAPE, AXES)
  batches = mlp_batches(16)
  ours, ours_xla, theirs, reference, model, ref_model = _both_ways(mesh, batches)

  # Every parameter carries the layout tf_gspmd chose: the Megatron kernels are split.
  layouts = {p.name.split('/', 1)[-1]: p.sharding for p in theirs.parameters}
  assert layouts['hidden_0/kernel:0'].spec == tg.P(None, 'model')
  assert layouts['hidden_1/kernel:0'].spec == tg.P('model', None)

  for i, (x, y) in enumerate(batches):
    want = reference(x, y)
    assert_close(ours(x, y), want, f'step {i + 1} loss, tf_gspmd')
    assert_close(np.asarray(theirs(x, y)), want, f"step {i + 1} loss, XLA's partitioner")
    assert_close(np.asarray(ours_xla(x, y)), want, f'step {i + 1} loss, tf_gspmd via XLA')
  xla_values = theirs.read_variables()
  assert_close(list(model.variables), list(ref_model.variables), 'tf_gspmd')
  assert_close(
    [np.asarray(xla_values[v.value.name]) for v in model.variables],
    list(ref_model.variables),
    "XLA's partitioner",
  )

  # Collective kinds: both sum the 'model' partial products (groups of 4) and the 'data'
  # gradients (groups of 2) with all-reduces.
  our_kinds = {(r['kind'], r['axes']) for r in ours.collectives()}
  assert our_kinds == {('all_reduce', ('model',)), ('all_reduce', ('data',))}
  xla_kinds = {(r['kind'], r['group_size']) for r in theirs.collectives()}
  assert {('all-reduce', 4), ('all-reduce', 2)} <= xla_kinds
  # XLA shards the update of the replicated weights over 'model' and gathers them back.
  assert xla_kinds <= {('all-reduce', 4), ('all-reduce', 2), ('all-gather', 4)}
  assert all(r['bytes'] > 0 for r in theirs.collectives())
  # Compiled by XLA, ours runs the same two all-reduce kinds, and moves no more bytes.
  ours_compiled = reference_partitioner.partitioned_collectives(
    ours_xla.xla_executable(*batches[0]).compiled_hlo(), mesh.size
  )
  assert {(r['kind'], r['group_size']) for r in ours_compiled} == {
    ('all-reduce', 4),
    ('all-reduce', 2),
  }
  assert sum(r['bytes'] for r in ours_compiled) <= sum(r['bytes'] for r in theirs.collectives())

  memory = theirs.memory()
  assert memory['peak'] >= memory['arguments'] > 0


def test_collectives_read_from_hlo_text():
  """Tuple all-reduces, the three replica-group forms, permutes and all-gathers, by bytes."""
  hlo = '\n'.join(
    [
      'ENTRY %main (p0: f32[8,4], p1: f32[16]) -> f32[8,4] {',
      '  %p0 = f32[8,4]{1,0} parameter(0)',
      '  %p1 = f32[16]{0} parameter(1)',
      '  %ar = (f32[8,4]{1,0}, f32[16]{0}) all-reduce(%p0, %p1), channel_id=1, '
      'replica_groups={{0,1},{2,3},{4,5},{6,7}}, to_apply=%add',
      '  %ag = f32[32,4]{1,0} all-gather(%p0), channel_id=2, replica_groups=[2,4]<=[8], '
      'dimensions={0}',
      "  %rs = f32[4]{0} reduce-scatter(%p1), channel_id=3, replica_groups=mesh['a'=2,'b'=4] "
      "{'b'}, dimensions={0}, to_apply=%add",
      '  ROOT %cp = f32[8,4]{1,0} collective-permute(%p0), channel_id=4, '
      'source_target_pairs={{0,1},{1,0}}',
      '}',
    ]
  )
  found = {r['name']: r for r in reference_partitioner.partitioned_collectives(hlo, 8)}
  # all-reduce, g=2: 2*(g-1) pieces of ceil(E/g) elements per operand.
  assert found['ar']['bytes'] == 2 * (16 * 4 + 8 * 4) and found['ar']['group_size'] == 2
  assert found['ag']['bytes'] == (32 - 8) * 4 * 4 and found['ag']['group_size'] == 4
  assert found['rs']['bytes'] == 16 * 4 * 3 // 4 and found['rs']['group_size'] == 4
  assert found['cp']['bytes'] == 8 * 4 * 4


def test_argument_layout_of_wrong_rank_is_refused_clearly():
  """A parameter sharding that does not fit its tensor is an error naming it, never a wrong
  value."""
  mesh = tg.Mesh.create(MESH_SHAPE, AXES)

  @tf.function
  def fn(x):
    return tf.reduce_sum(tg.shard(x, mesh, tg.P('data', None)) * 2.0)

  x = np.ones((3, 4), np.float32)
  with pytest.raises(ValueError, match='arg0'):
    reference_partitioner.XlaPartitionedStep(
      fn, [x], mesh.size, arg_shardings=[tg.NamedSharding(mesh, tg.P(None, 'model', None))]
    )
