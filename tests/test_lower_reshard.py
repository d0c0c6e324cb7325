"""The reshard lowering, end to end on 8 logical CPUs, against numpy.

Each case builds per-device shards of a random integer-valued array (padding
filled with NaN, or a sentinel for ints, so that padding leaking into valid
data fails), runs `lower_reshard.reshard` inside a per-partition program
(`SpmdProgram`) with a minimal stand-in for the partitioner, and compares every
device's valid region with numpy (`reshard.sim.check_shards`, exact). It also
checks that the collectives emitted, in order, are the route's steps (a Repad
counts one permute per round; a Slice none), both in the records noted on the
partitioner and in the runtime backend's own records.

All cases of one mesh run in one program (one trace, one launch) to keep the
test fast; each case is still its own test.
"""

import collections
import collections.abc
import os
import sys

import numpy as np
import pytest
import tensorflow as tf

from tf_gspmd.graph_rewrite import lower_reshard
from tf_gspmd.graph_rewrite import reshard as rp
from tf_gspmd.graph_rewrite.partitioner import Local
from tf_gspmd.graph_rewrite.reshard import sim
from tf_gspmd.mesh import Mesh
from tf_gspmd.runtime import ShardedValue, SpmdProgram
from tf_gspmd.sharding import NamedSharding, P

sys.path.insert(
  0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'bench')
)
import reshard_cases  # noqa: E402  (pure Python case list shared with the benchmarks)

INT_PAD = -12345


class StubPartitioner:
  """What `reshard` needs of the partitioner: the mesh, the backend, a collective log."""

  def __init__(self, mesh, backend):
    self.mesh = mesh
    self.backend = backend
    self.records = []

  def note_collective(self, record):
    self.records.append(record)


Case = collections.namedtuple('Case', 'name mesh src dst shape dtype')


def _case(
  name,
  mesh,
  src_spec,
  dst_spec,
  shape,
  partial=(),
  reduction='sum',
  dtype='float32',
  dst_partial=(),
):
  src = NamedSharding(mesh, P(*src_spec), partial, reduction=reduction)
  dst = NamedSharding(mesh, P(*dst_spec), dst_partial, reduction=reduction)
  return Case(name, mesh, src, dst, tuple(shape), dtype)


# --- the cases -------------------------------------------------------------------------------
def _small(shape, uneven):
  """The bench's big shapes shrunk to test sizes (even ones stay divisible by 8)."""
  small = {
    (1024, 1024): (10, 13) if uneven else (16, 16),
    (1 << 20,): (13,) if uneven else (64,),
    (128, 128, 128): (5, 4, 3) if uneven else (4, 4, 8),
  }
  return small.get(tuple(shape), tuple(shape))


# Bench cases also run at uneven sizes (the others already are uneven, or have twins below).
# Few: the first call of every all-gather, all-to-all and permute costs ~0.4 s here.
UNEVEN_TWINS = (
  '2x4_move_x_dim0_to_dim1',
  '2x4_x_to_xy_minor',
  '2x4_xy_dim0_to_yx_dim0',
  '2x4_partial_y_x_rows_to_xy',
  '1d_partial_to_dim0',
  '3d_rotate_axes',
  '3d_ab_c_to_c_ab',
  '3d_partial_c_to_ac_b',
)


def _bench_cases():
  out = []
  for c in reshard_cases.CASES:
    mesh = Mesh.create(c['mesh_shape'], c['axis_names'])
    out.append(
      _case(
        c['name'], mesh, c['src_spec'], c['dst_spec'], _small(c['shape'], False), c['src_partial']
      )
    )
    if c['name'] in UNEVEN_TWINS:
      uneven = _small(c['shape'], True)
      out.append(
        _case(c['name'] + '@uneven', mesh, c['src_spec'], c['dst_spec'], uneven, c['src_partial'])
      )
  return out


M24 = Mesh.create((2, 4), ('x', 'y'))
M222 = Mesh.create((2, 2, 2), ('x', 'y', 'z'))
M8 = Mesh.create((8,), ('x',))
M2 = Mesh.create((2,), ('x',))
M32 = Mesh.create((3, 2), ('x', 'y'))
# Device ids out of row-major order: positions along axes differ from TF's device-name order.
MPERM = Mesh(np.array([[3, 1, 0, 2], [7, 5, 6, 4]]), ('x', 'y'))

# The chosen cases of tests/test_reshard_route.py and bench/reshard.py's extra cases (shrunk),
# plus other dtypes and targets that keep a pending reduction.
CHOSEN = [
  _case('xy_to_yx_10x7', M24, ('x', 'y'), ('y', 'x'), (10, 7)),
  _case('xy_10_to_x', M24, (('x', 'y'),), ('x',), (10,)),
  _case('xy_to_yx_dim0_10x3', M24, (('x', 'y'), None), (('y', 'x'), None), (10, 3)),
  _case('x_dim1_to_xy_dim0', M24, (None, 'x'), (('x', 'y'), None), (7, 5)),
  _case('7_over_8_slice', M8, (None,), ('x',), (7,)),
  _case('1_over_2_gather', M2, ('x',), (None,), (1,)),
  _case('1_over_2_dim1_to_dim0', M2, (None, 'x'), ('x', None), (1, 3)),
  _case('partial_x_to_y', M24, (None, None), ('y', None), (10, 8), ('x',)),
  _case('partial_xy_to_xy_dim0', M24, (None, None), (('x', 'y'), None), (10, 3), ('x', 'y')),
  _case('partial_max_y_to_x', M24, ('y', None), (None, 'x'), (7, 9), ('x',), 'max'),
  _case('partial_min_to_replicated', M24, ('y', None), (None, None), (7, 8), ('x',), 'min'),
  _case('3d_xy_z_to_z_yx', M222, (('x', 'y'), 'z'), ('z', ('y', 'x')), (7, 10)),
  _case('3d_rank3', M222, ('x', None, 'y'), (None, ('z', 'x'), None), (5, 9, 3)),
  _case('3d_partial_yz', M222, (None, 'x'), ('y', ('z', 'x')), (6, 10), ('y', 'z')),
  _case('3x2_y_to_x', M32, ('x', None), ('y', None), (9, 6)),
  _case('3x2_prod', M32, ('y',), ('x',), (3,), ('x',), 'prod'),
  _case('tg_y_to_x_uneven', M24, ('y', None), ('x', None), (10, 16)),
  _case('tg_xy_minor_to_x_uneven', M24, (('x', 'y'), None), ('x', None), (10, 8)),
  _case('tg_batch_to_model_3d', M24, ('x', None, None), (None, None, 'y'), (4, 3, 8)),
  _case('tg_partial_max_uneven', M24, (None, 'y'), ('x', 'y'), (9, 10), ('x',), 'max'),
  _case('tg_3d_uneven_swap', M222, ('x', ('y', 'z')), (('z', 'y'), 'x'), (11, 9)),
  _case('scalar_partial_over_8', M8, (), (), (), ('x',)),
  _case('tiny_partial_max_over_8', M8, (None,), (None,), (4,), ('x',), 'max'),
  _case('permuted_mesh_swap_uneven', MPERM, ('x', 'y'), ('y', 'x'), (10, 7)),
  _case('permuted_mesh_repad', MPERM, (('x', 'y'),), ('x',), (10,)),
  _case('permuted_mesh_partial_to_y', MPERM, (None, 'x'), ('y', None), (9, 6), ('y',)),
  _case('keep_partial_y', M24, (None, None), (None, 'x'), (6, 10), ('x', 'y'), dst_partial=('y',)),
  _case(
    'int32_partial_max', M24, (None, 'y'), (('x', 'y'), None), (10, 6), ('x',), 'max', dtype='int32'
  ),
  _case('int32_swap_uneven', M24, ('x', 'y'), ('y', 'x'), (10, 7), dtype='int32'),
  _case('bool_swap_uneven', M24, ('x', 'y'), ('y', 'x'), (10, 7), dtype='bool'),
  _case('bool_xy_10_to_x', M24, (('x', 'y'),), ('x',), (10,), dtype='bool'),
]


def _random_cases(count, seed=7):
  """Random specs, sizes and pending sums on the 2x4 and 2x2x2 meshes (a fixed sample)."""
  rng = np.random.default_rng(seed)
  out = []
  while len(out) < count:
    mesh = (M24, M222)[len(out) % 2]
    rank = int(rng.integers(1, 4))

    def spec(axes, rank=rank):
      dims = [[] for _ in range(rank)]
      for a in axes:
        where = int(rng.integers(-1, rank))
        if where >= 0:
          dims[where].append(a)
      return tuple(tuple(d) if len(d) > 1 else (d[0] if d else None) for d in dims)

    names = list(mesh.axis_names)
    src_spec = spec(rng.permutation(names))
    used = {a for e in src_spec if e for a in ((e,) if isinstance(e, str) else e)}
    free = [a for a in names if a not in used]
    partial = tuple(a for a in free if rng.random() < 0.4)
    dst_spec = spec(rng.permutation(names))
    shape = tuple(int(rng.integers(1, 12)) for _ in range(rank))
    reduction = ('sum', 'max')[int(rng.integers(0, 2))]
    out.append(_case(f'random_{len(out)}', mesh, src_spec, dst_spec, shape, partial, reduction))
  return out


CASES = _bench_cases() + CHOSEN + _random_cases(10)
BY_NAME = {c.name: c for c in CASES}
assert len(BY_NAME) == len(CASES), 'case names must be unique'


# --- running -----------------------------------------------------------------------------------
def _global_value(case: Case, seed: int) -> np.ndarray:
  rng = np.random.default_rng(seed)
  if case.dtype == 'bool':
    return rng.integers(0, 2, size=case.shape).astype(np.float64)
  return rng.integers(1, 100, size=case.shape).astype(np.float64)


def _input_shards(case: Case, x: np.ndarray):
  rng = np.random.default_rng(1)
  shards = sim.make_shards(x, case.src, rng)
  out = []
  for d in range(case.mesh.size):
    a = shards[d]
    if case.dtype == 'bool':
      a = np.where(np.isnan(a), 1, a).astype(bool)
    elif case.dtype == 'int32':
      a = np.where(np.isnan(a), INT_PAD, a).astype(np.int32)
    else:
      a = a.astype(np.float32)
    out.append(tf.constant(a))
  return out


def _route(case: Case) -> rp.ReshardRoute:
  size = {'float32': 4, 'int32': 4, 'bool': 1}[case.dtype]
  return rp.route_reshard(case.src, case.dst, case.shape, size)


def run_cases(cases):
  """Run the cases (all on one mesh) in one per-partition program.

  Returns {name: (per-device output arrays, noted records, backend records)}.
  """
  mesh = cases[0].mesh
  assert all(c.mesh == mesh for c in cases)
  noted, emitted = {}, {}

  def per_partition(ctx, *locals_):
    outs = []
    for case, local in zip(cases, locals_):
      stub = StubPartitioner(mesh, ctx.collectives)
      before = len(ctx.collectives.records)
      value = lower_reshard.reshard(stub, Local(local, case.src, case.shape), case.dst, case.name)
      noted[case.name] = stub.records
      emitted[case.name] = ctx.collectives.records[before:]
      outs.append(value.tensor)
    return outs

  program = SpmdProgram(
    mesh,
    per_partition,
    out_shardings=[c.dst.without_partial() for c in cases],
    out_shapes=[c.shape for c in cases],
    keep_sharded=True,
    timeout=60,
    autograph=False,
    name='lower_reshard_test',
  )
  inputs = [
    ShardedValue(_input_shards(c, _global_value(c, i)), c.src, c.shape) for i, c in enumerate(cases)
  ]
  outputs = program(*inputs)
  return {
    c.name: (
      [np.asarray(s.numpy(), np.float64) for s in out.shards],
      noted[c.name],
      emitted[c.name],
    )
    for c, out in zip(cases, outputs)
  }


class _Results(collections.abc.Mapping):
  """Case name -> run_cases' result, each mesh's cases run together when one of them is first
  asked for, once per process: a module fixture is made again each time pytest-xdist's
  worksteal brings a worker back to this file (three times, 45 s, in `make test-fast`)."""

  def __init__(self):
    self._by_mesh = collections.defaultdict(list)
    for case in CASES:
      self._by_mesh[case.mesh].append(case)
    self._mesh_of = {case.name: case.mesh for case in CASES}
    self._done = {}

  def __getitem__(self, name):
    if name not in self._done:
      self._done.update(run_cases(self._by_mesh[self._mesh_of[name]]))
    return self._done[name]

  def __iter__(self):
    return iter(self._mesh_of)

  def __len__(self):
    return len(self._mesh_of)


_RESULTS = _Results()


@pytest.fixture
def results():
  return _RESULTS


def expected_kinds(route: rp.ReshardRoute):
  """Collectives the route's steps emit; consecutive all-reduces run as one."""
  kinds = []
  for step in route.steps:
    if step.kind == 'repad':
      kinds += ['permute'] * len(step.rounds)
    elif step.kind == 'all_reduce' and kinds[-1:] == ['all_reduce']:
      continue
    elif step.kind != 'slice':
      kinds.append(step.kind)
  return kinds


# --- tests -------------------------------------------------------------------------------------
@pytest.mark.parametrize('name', [c.name for c in CASES])
def test_lowered_route_is_exact(results, name):
  case = BY_NAME[name]
  shards, noted, emitted = results[name]
  route = _route(case)
  x = _global_value(case, [c.name for c in CASES if c.mesh == case.mesh].index(name))
  sim.check_shards(x, case.dst, dict(enumerate(shards)))
  want = expected_kinds(route)
  assert [r['kind'] for r in noted] == want, route
  assert [r.kind for r in emitted] == want, route
  for r in noted:
    assert r['why'] == name
    assert r['dtype'] == {'float32': 'float32', 'int32': 'int32', 'bool': 'bool'}[case.dtype]
    assert r['bytes'] == int(np.prod(r['shape'])) * {'bool': 1}.get(case.dtype, 4)


def test_cases_cover_every_step_kind():
  kinds = {s.kind for c in CASES for s in _route(c).steps}
  assert kinds == {t.kind for t in rp.STEP_TYPES}
  assert any(_route(c).mesh != c.mesh for c in CASES)  # some routes run on sub-axes


def test_records_name_user_axes_and_sub_axes(results):
  # P('x','y') -> P('y','x') on 2x4: an all-to-all over half of y, then a permute.
  _, noted, emitted = results['2x4_xy_to_yx']
  assert [(r['kind'], r['axes']) for r in noted] == [
    ('all_to_all', ('y#1',)),
    ('permute', ('x', 'y')),
  ]
  assert emitted[0].group_size == 2
  # Whole axes keep the user's names.
  _, noted, _ = results['2x4_xy_to_replicated']
  assert {r['axes'] for r in noted} <= {('x',), ('y',), ('x', 'y'), ('y', 'x')}
  for name in ('2x4_partial_y_to_replicated', '3d_partial_bc_to_replicated'):
    assert all('#' not in a for r in results[name][1] for a in r['axes'])


def test_partial_sum_to_replicated_is_one_all_reduce(results):
  _, noted, _ = results['2x4_partial_y_to_replicated']
  assert [(r['kind'], r['axes']) for r in noted] == [('all_reduce', ('y',))]


def test_tiny_all_reduces_run_as_one(results):
  # The search reduces a scalar over x#0, x#1, x#2 (its byte model rounds up); one runs.
  assert len(_route(BY_NAME['scalar_partial_over_8']).steps) > 1
  for name in ('scalar_partial_over_8', 'tiny_partial_max_over_8'):
    _, noted, emitted = results[name]
    assert [(r['kind'], r['axes']) for r in noted] == [('all_reduce', ('x',))]
    assert [(r.kind, r.axes, r.group_size) for r in emitted] == [('all_reduce', ('x',), 8)]


class _Backend:
  """A backend that must not be asked for any collective."""

  def __init__(self, mesh):
    self.mesh = mesh


def test_nothing_to_move_emits_nothing():
  stub = StubPartitioner(M24, _Backend(M24))
  src = NamedSharding(M24, P('x', None))
  x = tf.reshape(tf.range(12.0), [3, 4])
  out = lower_reshard.reshard(stub, Local(x, src, (6, 4)), src)
  assert out.tensor is x and out.sharding == src and not stub.records
  # A tensor with no elements: every shard is padding, nothing moves.
  empty = lower_reshard.reshard(
    stub, Local(tf.zeros([0, 4]), src, (0, 4)), NamedSharding(M24, P(None, 'y'))
  )
  assert tuple(empty.tensor.shape) == (0, 1) and not stub.records


def test_errors_name_the_shardings():
  src = NamedSharding(M24, P('x', None))
  stub = StubPartitioner(M24, _Backend(M24))
  with pytest.raises(ValueError, match='shard shape'):
    lower_reshard.reshard(
      stub, Local(tf.zeros([4, 4]), src, (6, 4)), NamedSharding(M24, P(None, 'y'))
    )
  with pytest.raises(ValueError, match='pending reduction'):
    lower_reshard.reshard(
      stub, Local(tf.zeros([3, 4]), src, (6, 4)), NamedSharding(M24, P('x', None), ('y',))
    )
  with pytest.raises(ValueError, match='backend'):
    lower_reshard.reshard(
      StubPartitioner(M8, _Backend(M8)),
      Local(tf.zeros([3, 4]), src, (6, 4)),
      NamedSharding(M24, P(None, 'y')),
    )


def test_sub_axis_steps_on_the_xla_backend():
  # Traced only (XLA collectives do not run on CPU): the all-to-all over half of y gets the
  # sub-axis replica groups, the permute the route's pairs.
  from tf_gspmd.runtime import trace_per_partition
  from tf_gspmd.xla_bridge import XlaCollectives

  case = BY_NAME['2x4_xy_to_yx']
  route = _route(case)

  def per_partition(ctx, local):
    stub = StubPartitioner(case.mesh, ctx.collectives)
    return lower_reshard.reshard(stub, Local(local, case.src, case.shape), case.dst).tensor

  local = tf.TensorSpec(case.src.shard_shape(case.shape), tf.float32)
  program = trace_per_partition(
    case.mesh, per_partition, [local], backend=XlaCollectives, autograph=False
  )
  assert [(r.kind, r.axes) for r in program.records] == [('all_to_all', ('y#1',)), ('permute', ())]
  assert program.records[0].groups.tolist() == [[0, 1], [2, 3], [4, 5], [6, 7]]
  assert sorted(map(tuple, program.records[1].groups.tolist())) == sorted(route.steps[1].pairs)


@pytest.mark.parametrize('shape, rolls', [((16, 16), 0), ((10, 13), 1)])
def test_a_slice_rolls_only_where_a_window_is_clamped(shape, rolls):
  # Replicated -> (x, y): each device keeps its window of rows. On an even split every
  # window starts at its own rows, so no roll is emitted; on 10 rows over x=2 the windows
  # still fit, but 13 columns over y=4 (chunk 4) clamp the last window, which is rolled.
  from tf_gspmd.runtime import trace_per_partition

  mesh = Mesh.create((2, 4), ('x', 'y'))
  src, dst = NamedSharding(mesh, P(None, None)), NamedSharding(mesh, P('x', 'y'))

  def per_partition(ctx, local):
    stub = StubPartitioner(mesh, ctx.collectives)
    return lower_reshard.reshard(stub, Local(local, src, shape), dst).tensor

  program = trace_per_partition(
    mesh, per_partition, [tf.TensorSpec(shape, tf.float32)], autograph=False
  )
  ops = collections.Counter(op.type for op in program.function.graph.get_operations())
  assert ops['Roll'] == rolls, ops
  assert not program.records  # a local slice: no collective
