"""The XLA-op (TPUStrategy tracing) backend: HLO collectives and replica groups where CPU XLA
lowers the op, the graph (op types, attributes, constant groups) where it cannot, and the
per-partition arithmetic around the ops simulated partition by partition. Groups are written
out by hand. The numbers of every collective kind, run through PJRT on 8 CPU devices, are
checked against numpy in tests/test_xla_backend.py."""

import numpy as np
import pytest
import tensorflow as tf

from tf_gspmd import Mesh
from tf_gspmd.runtime import trace_per_partition
from tf_gspmd.xla_bridge import (
  XlaCollectives,
  graph_collectives,
  hlo_collectives,
  per_partition_hlo,
)

MESH_2D = Mesh.create((2, 4), ('x', 'y'))
MESH_1D = Mesh.create((8,), ('x',))
LOCAL = np.arange(30, dtype=np.float32).reshape(5, 6)
AXES_2D = [('y',), ('x',), ('x', 'y')]


# Replica groups written out by hand (row-major device ids, members in position order), not
# recomputed with the algorithm under test.
GROUPS = {
  (MESH_1D, ('x',)): ((0, 1, 2, 3, 4, 5, 6, 7),),
  (MESH_2D, ('y',)): ((0, 1, 2, 3), (4, 5, 6, 7)),
  (MESH_2D, ('x',)): ((0, 4), (1, 5), (2, 6), (3, 7)),
  (MESH_2D, ('x', 'y')): ((0, 1, 2, 3, 4, 5, 6, 7),),
  (MESH_2D, ('y', 'x')): ((0, 4, 1, 5, 2, 6, 3, 7),),
}


def groups(mesh, axes):
  return GROUPS[(mesh, tuple(axes))]


@pytest.mark.parametrize('mesh,axes', [(MESH_1D, ('x',))] + [(MESH_2D, a) for a in AXES_2D])
def test_hlo_all_reduce_reduce_scatter_all_gather_broadcast(mesh, axes):
  k = mesh.axes_size(axes)

  def fn(ctx, x):
    c = ctx.collectives
    return (
      c.all_reduce(x, axes),
      c.all_reduce(x, axes, 'max'),
      c.reduce_scatter(x, axes, 0),
      c.all_gather(x, axes, 1),
      c.broadcast(x, axes, k - 1),
    )

  found = hlo_collectives(per_partition_hlo(mesh, fn, [LOCAL]))
  want_groups = groups(mesh, axes)
  kinds = [(c.kind, c.op_name.split('/')[1]) for c in found]
  assert kinds == [
    ('all-reduce', 'all_reduce_0'),
    ('all-reduce', 'all_reduce_1'),
    ('reduce-scatter', 'reduce_scatter_0'),
    ('all-reduce', 'all_gather_0'),
    ('all-reduce', 'broadcast_0'),
  ]
  assert all(c.replica_groups == want_groups for c in found)
  chunk = -(-5 // k)
  assert found[2].shape == f'f32[{chunk},6]' and found[2].dimensions == (0,)
  assert found[3].shape == f'f32[5,{6 * k}]'


def test_graph_all_to_all_and_permutes():
  def fn(ctx, x):
    c = ctx.collectives
    return (
      c.all_to_all(x, 'y', 1, 0),
      c.all_to_all(x, ('x', 'y'), 0, 1),
      c.shift(x, 'x', 1),
      c.shift(x, 'y', -1, cyclic=True),
      c.permute(x, [(0, 7), (7, 0), (3, 4)]),
    )

  program = trace_per_partition(
    MESH_2D, fn, [tf.TensorSpec(LOCAL.shape, tf.float32)], backend=XlaCollectives
  )
  found = graph_collectives(program.function.graph)
  assert [f.op_type for f in found] == [
    'AllToAll',
    'AllToAll',
    'CollectivePermute',
    'CollectivePermute',
    'CollectivePermute',
  ]
  a2a = found[0]
  assert dict(a2a.attrs) == {'concat_dimension': 0, 'split_dimension': 1, 'split_count': 4}
  assert a2a.groups.tolist() == [list(g) for g in groups(MESH_2D, ('y',))]
  assert found[1].groups.tolist() == [list(range(8))]
  assert dict(found[1].attrs)['split_count'] == 8
  assert a2a.name.startswith('gspmd/all_to_all_0/')
  assert sorted(map(tuple, found[2].groups.tolist())) == [(0, 4), (1, 5), (2, 6), (3, 7)]
  shift_y = sorted(map(tuple, found[3].groups.tolist()))
  assert shift_y == sorted(
    (MESH_2D.device_at(x=r, y=(c + 1) % 4), MESH_2D.device_at(x=r, y=c))
    for r in range(2)
    for c in range(4)
  )
  assert found[4].groups.tolist() == [[0, 7], [7, 0], [3, 4]]
  # The split dim (5 rows over 8) is padded to 8 before the op, as the TF backend does.
  a2a_op = program.function.graph.get_operation_by_name(found[1].name)
  assert tuple(a2a_op.inputs[0].shape) == (8, 6)
  assert tuple(program.output_specs[1].shape) == (1, 48)


def test_both_backends_record_the_same_collectives():
  def fn(ctx, x):
    c = ctx.collectives
    with tf.name_scope('block'):
      y = c.all_gather(x, 'y', 0, size=18)
    return c.reduce_scatter(y, 'y', 1), c.shift(x, 'x', 1), c.broadcast(x, ('x', 'y'), 3)

  spec = [tf.TensorSpec(LOCAL.shape, tf.float32)]
  tf_records = trace_per_partition(MESH_2D, fn, spec).records
  xla_records = trace_per_partition(MESH_2D, fn, spec, backend=XlaCollectives).records

  def strip(r):
    return (r.kind, r.name, r.axes, r.shape, r.dtype, r.bytes, r.group_size, r.params)

  assert [strip(r) for r in tf_records] == [strip(r) for r in xla_records]
  assert [r.name for r in xla_records] == [
    'block/gspmd/all_gather_0',
    'gspmd/reduce_scatter_0',
    'gspmd/permute_0',
    'gspmd/broadcast_0',
  ]


class _Contributions(XlaCollectives):
  """Replaces the all-reduce by 'return my contribution', to check the arithmetic around it."""

  def _xla_all_reduce(self, x, axes, op):
    assert op == 'sum'
    return x


@pytest.mark.parametrize('axes', AXES_2D + [('y', 'x')])
def test_all_gather_and_broadcast_contributions_sum_to_the_result(axes):
  table = np.random.default_rng(0).normal(size=(8,) + LOCAL.shape).astype(np.float32)
  k = MESH_2D.axes_size(axes)
  gathered, broadcast = {}, {}
  for p in range(8):
    c = _Contributions(MESH_2D, p)
    gathered[p] = c.all_gather(tf.constant(table[p]), axes, 0).numpy()
    broadcast[p] = c.broadcast(tf.constant(table[p]), axes, k - 1).numpy()
  for g in groups(MESH_2D, axes):
    total_gather = sum(gathered[m] for m in g)
    total_broadcast = sum(broadcast[m] for m in g)
    np.testing.assert_array_equal(total_gather, np.concatenate([table[m] for m in g], 0))
    np.testing.assert_array_equal(total_broadcast, table[g[-1]])


def test_hlo_parser_reads_iota_replica_groups():
  text = '\n'.join(
    [
      '  %ar = f32[4]{0} all-reduce(f32[4]{0} %p), channel_id=1, replica_groups=[2,4]<=[8], '
      'to_apply=%add, metadata={op_name="a/gspmd/all_reduce_0/XlaAllReduce"}',
      '  ROOT %rs = f32[2]{0} reduce-scatter(f32[8]{0} %q), replica_groups=[4,2]<=[2,4]T(1,0), '
      'dimensions={0}, to_apply=%add',
      '  %cp = f32[4]{0} collective-permute(f32[4]{0} %p), source_target_pairs={{0,1},{1,0}}',
      '  %x = f32[4]{0} add(f32[4]{0} %p, f32[4]{0} %p)',
    ]
  )
  found = hlo_collectives(text)
  assert [f.kind for f in found] == ['all-reduce', 'reduce-scatter', 'collective-permute']
  assert found[0].replica_groups == ((0, 1, 2, 3), (4, 5, 6, 7))
  assert found[0].op_name == 'a/gspmd/all_reduce_0/XlaAllReduce'
  assert found[1].replica_groups == ((0, 4), (1, 5), (2, 6), (3, 7))
  assert found[1].dimensions == (0,)
  assert found[2].source_target_pairs == ((0, 1), (1, 0))


def test_bad_mode_is_refused():
  with pytest.raises(ValueError, match='mode'):
    XlaCollectives(MESH_2D, 0, mode='CrossPartition')
