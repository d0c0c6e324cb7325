"""Tile assignments in any device order (issue #12, point 4).

A TPU program annotated with its own device order (`devices=[2,4]0,2,3,1,4,6,7,5`)
is a valid layout: a spec on a reordering of the program mesh (same axes, the
assignment's order). Inside the program every op computes in the mesh's order;
inputs and outputs annotated in another order keep it, at the cost of one
permute of whole shards each. Checked at three levels: conversion (pure),
reshard routes between orders (numpy simulator, exact), and partitioned
functions on 8 logical CPUs against the unpartitioned run, collectives counted
against the same function annotated in the mesh's order.
"""

import numpy as np
import pytest
import tensorflow as tf

import tf_gspmd as tg
from tf_gspmd import op_sharding
from tf_gspmd.graph_rewrite import lower_reshard
from tf_gspmd.graph_rewrite import reshard as rp
from tf_gspmd.graph_rewrite.partitioner import Local
from tf_gspmd.graph_rewrite.reshard import sim
from tf_gspmd.mesh import Mesh
from tf_gspmd.partitioned import partition
from tf_gspmd.runtime import ShardedValue, SpmdProgram
from tf_gspmd.sharding import REPLICATED, NamedSharding, P, Sharding, named
from tf_gspmd.testing import assert_close

from helpers import randn

M8 = Mesh.create((8,), ('x',))
M24 = Mesh.create((2, 4), ('x', 'y'))
M222 = Mesh.create((2, 2, 2), ('x', 'y', 'z'))
ISSUE_ORDER = [0, 2, 3, 1, 4, 6, 7, 5]  # the issue's devices=[2,4]0,2,3,1,4,6,7,5


def _proto(dims, devices, last_tile_dims=None, replicate_last=False):
  from tensorflow.compiler.xla import xla_data_pb2

  t = xla_data_pb2.OpSharding
  proto = t(
    type=t.OTHER,
    tile_assignment_dimensions=list(dims),
    tile_assignment_devices=[int(d) for d in devices],
    replicate_on_last_tile_dim=replicate_last,
  )
  if last_tile_dims:
    proto.last_tile_dims.extend(t.REPLICATED for _ in last_tile_dims)
  return proto


# --- conversion -----------------------------------------------------------------------------
def test_issue_example_is_a_spec_on_a_reordered_mesh():
  s = op_sharding.from_proto(_proto([2, 4], ISSUE_ORDER), mesh=M24)
  assert isinstance(s, NamedSharding) and s.spec == P('x', 'y')
  assert s.mesh.device_ids.tolist() == [[0, 2, 3, 1], [4, 6, 7, 5]]
  assert s.is_equivalent_to(Sharding.tiled(np.reshape(ISSUE_ORDER, (2, 4))))
  back = op_sharding.to_proto(s)
  assert list(back.tile_assignment_devices) == ISSUE_ORDER  # written back as read
  assert named(s, M24, reorder=False) is None  # no spec in the mesh's own order says it


# (mesh, tile dims, subgroup style): 1-D, 2-D and 3-D meshes, with replicated subgroups.
LAYOUTS = [
  (M8, (8,), None),
  (M8, (1, 8), None),
  (M8, (8, 1, 1), 'last_tile_dims'),
  (M24, (2, 4), None),
  (M24, (4, 2), None),
  (M24, (1, 8), None),
  (M24, (2, 1, 4), 'replicate_last'),
  (M24, (4, 1, 2), 'last_tile_dims'),
  (M24, (2, 4, 1), 'last_tile_dims'),
  (M222, (2, 2, 2), None),
  (M222, (4, 2), None),
  (M222, (2, 1, 4), 'replicate_last'),
  (M222, (2, 2, 1, 2), 'last_tile_dims'),
]


@pytest.mark.parametrize('mesh,dims,style', LAYOUTS)
def test_any_permutation_converts_and_keeps_its_meaning(mesh, dims, style):
  rng = np.random.default_rng(sum(dims) + mesh.size)
  for _ in range(6):
    devices = rng.permutation(mesh.size)
    proto = _proto(
      dims,
      devices,
      last_tile_dims=[0] if style == 'last_tile_dims' else None,
      replicate_last=style == 'replicate_last',
    )
    plain = op_sharding.from_proto(proto)
    s = op_sharding.from_proto(proto, mesh=mesh)
    assert isinstance(s, NamedSharding), (dims, devices)
    assert s.mesh.is_reordering_of(mesh) and s.is_equivalent_to(plain)
    for d in mesh.devices:  # every device holds the same piece under both
      assert s.tile_index(d) == plain.tile_index(d)
    assert op_sharding.from_proto(op_sharding.to_proto(s)).is_equivalent_to(plain)
    if style != 'last_tile_dims' or dims[-1] > 1:  # a size-1 subgroup dim is not kept
      assert op_sharding.to_proto(s).SerializeToString() == proto.SerializeToString()


def test_tile_dims_no_axis_grouping_gives_are_refused_clearly():
  # A tile dim of 2 on a mesh whose only axis of size > 2 is 4: no whole-axis grouping.
  s = Sharding.tiled(np.arange(8)[::-1].reshape(2, 2, 2))
  assert named(s, M24) is None
  with pytest.raises(ValueError, match='tile dims'):
    from tf_gspmd.propagation.api import propagate_captured

    mesh = M24

    @tf.function
    def f(x):
      return tg.shard(x, s) * 2.0

    from tf_gspmd.graph.capture import capture

    propagate_captured(capture(f, np.zeros((2, 2, 2), np.float32)), mesh)


# --- routes between device orders (numpy simulator) -------------------------------------------
def _random_spec(rng, mesh, rank):
  dims = [[] for _ in range(rank)]
  for a in rng.permutation(mesh.axis_names):
    where = int(rng.integers(-1, rank))
    if where >= 0:
      dims[where].append(str(a))
  return P(*[tuple(d) if d else None for d in dims])


def _reordered(rng, mesh):
  return mesh.reordered(rng.permutation(mesh.size).reshape(mesh.device_ids.shape))


@pytest.mark.parametrize('mesh', [M8, M24, M222], ids=['1d', '2d', '3d'])
def test_routes_between_orders_are_exact_and_cost_at_most_one_permute(mesh):
  rng = np.random.default_rng(mesh.size + len(mesh.axis_names))
  for case in range(25):
    rank = int(rng.integers(1, 3))
    shape = tuple(int(rng.integers(1, 11)) for _ in range(rank))
    src_spec, dst_spec = _random_spec(rng, mesh, rank), _random_spec(rng, mesh, rank)
    free = [a for a in mesh.axis_names if a not in src_spec.used_axes()]
    partial = tuple(a for a in free if rng.random() < 0.3)
    orders = [mesh, _reordered(rng, mesh)]
    src_mesh, dst_mesh = orders[case % 2], orders[1 - case % 2] if case % 3 else orders[1]
    src = NamedSharding(src_mesh, src_spec, partial)
    dst = NamedSharding(dst_mesh, dst_spec)
    route = rp.route_reshard(src, dst, shape)
    x = rng.integers(1, 100, size=shape).astype(np.float64)
    sim.check_shards(x, dst, sim.simulate(route, sim.make_shards(x, src, rng)))
    assert route.peak_bytes <= route.bound_bytes, route
    same_order = rp.route_reshard(
      NamedSharding(mesh, src_spec, partial), NamedSharding(mesh, dst_spec), shape
    )
    extra = route.bytes_moved - same_order.bytes_moved
    assert extra <= min(route.src_shard_bytes, route.dst_shard_bytes), (route, same_order)
    reorders = [s for s in route.steps if s.kind == 'permute' and s.from_axes == s.to_axes]
    assert len(reorders) <= 1, route


def test_same_order_costs_nothing_and_order_only_is_one_permute():
  d24 = M24.reordered(np.reshape(ISSUE_ORDER, (2, 4)))
  src, dst = NamedSharding(M24, P('x', 'y')), NamedSharding(d24, P('x', 'y'))
  assert rp.route_reshard(src, NamedSharding(M24, P('x', 'y')), (8, 8)).steps == ()
  route = rp.route_reshard(src, dst, (8, 8))
  assert [s.kind for s in route.steps] == ['permute']
  assert len(route.steps[0].pairs) == 6  # devices 0 and 4 keep their shard
  # Orders that agree on the axes a layout uses need no move at all.
  rows_kept = M24.reordered([[1, 0, 3, 2], [5, 4, 7, 6]])
  assert (
    rp.route_reshard(
      NamedSharding(M24, P('x', None)), NamedSharding(rows_kept, P('x', None)), (8, 8)
    ).steps
    == ()
  )


# --- lowering on 8 logical CPUs ----------------------------------------------------------------
class _Log:
  def __init__(self, backend):
    self.backend = backend
    self.records = []

  def note_collective(self, record):
    self.records.append(record)


D24 = M24.reordered(np.reshape(ISSUE_ORDER, (2, 4)))
D222 = M222.reordered(np.array([5, 1, 7, 3, 4, 0, 6, 2]).reshape(2, 2, 2))
LOWERED = [
  ('order_only', NamedSharding(M24, P('x', 'y')), NamedSharding(D24, P('x', 'y')), (8, 12)),
  ('order_and_swap', NamedSharding(D24, P('x', 'y')), NamedSharding(M24, P('y', 'x')), (10, 7)),
  (
    'partial_to_other_order',
    NamedSharding(D24, P(None, 'x'), ('y',)),
    NamedSharding(M24, P('y', None)),
    (9, 6),
  ),
  (
    'gather_in_other_order',
    NamedSharding(D24, P(('y', 'x'), None)),
    NamedSharding(M24, P(None, 'y')),
    (10, 5),
  ),
  (
    '3d_all_to_all',
    NamedSharding(M222, P(('x', 'y'), 'z')),
    NamedSharding(D222, P('z', ('y', 'x'))),
    (7, 10),
  ),
]


@pytest.mark.parametrize('mesh', [M24, M222], ids=['2d', '3d'])
def test_lowered_reshards_between_orders_are_exact(mesh):
  noted = {}
  cases = [c for c in LOWERED if c[1].mesh.is_reordering_of(mesh)]

  def per_partition(ctx, *locals_):
    outs = []
    for (name, src, dst, shape), local in zip(cases, locals_):
      log = _Log(ctx.collectives)
      before = len(ctx.collectives.records)
      outs.append(lower_reshard.reshard(log, Local(local, src, shape), dst, name).tensor)
      noted[name] = (
        [r['kind'] for r in log.records],
        [r.kind for r in ctx.collectives.records[before:]],
      )
    return outs

  program = SpmdProgram(
    mesh,
    per_partition,
    out_shardings=[c[2] for c in cases],
    out_shapes=[c[3] for c in cases],
    keep_sharded=True,
    timeout=60,
    autograph=False,
    name='tile_assignment_lowering',
  )
  rng = np.random.default_rng(3)
  values, inputs = [], []
  for _, src, _, shape in cases:
    x = rng.integers(1, 100, size=shape).astype(np.float64)
    shards = sim.make_shards(x, src, rng)
    values.append(x)
    inputs.append(
      ShardedValue([tf.constant(shards[d].astype(np.float32)) for d in range(8)], src, shape)
    )
  outputs = program(*inputs)
  for (name, src, dst, shape), x, out in zip(cases, values, outputs):
    got = {d: np.asarray(s.numpy(), np.float64) for d, s in enumerate(out.shards)}
    sim.check_shards(x, dst, got)
    np.testing.assert_array_equal(out.numpy(), x)
    route = rp.route_reshard(src, dst, shape)
    want = [
      k
      for s in lower_reshard.merged_steps(route)
      if s.kind != 'slice'
      for k in (['permute'] * len(s.rounds) if s.kind == 'repad' else [s.kind])
    ]
    assert noted[name][0] == want and noted[name][1] == want, (name, noted[name], str(route))
  if mesh == M24:
    assert noted['order_only'][0] == ['permute']


# --- partitioned functions on 8 logical CPUs --------------------------------------------------
def kinds(pf):
  return sorted((r['kind'], r['axes']) for r in pf.collectives())


def _tiled(order, dims, replicate_last=False):
  s = Sharding.tiled(np.reshape(order, dims), (REPLICATED,) if replicate_last else ())
  return s


def _run_both(fn, args, mesh, permuted, in_order, **kwargs):
  """Partition `fn(args)` annotated in another device order and in the mesh's; both checked."""
  want = fn(*args)
  runs = []
  for shardings in (permuted, in_order):
    pf = partition(fn, mesh, in_shardings=shardings[0], out_shardings=shardings[1], **kwargs)
    got = pf(*args)
    assert_close(got, want)
    runs.append(kinds(pf))
  return runs


def _one_more_permute(permuted, in_order, moves):
  extra = list(permuted)
  for item in in_order:
    extra.remove(item)
  assert extra == [('permute', ())] * moves, (permuted, in_order)


def test_matmul_with_operands_in_the_issue_order():
  @tf.function
  def f(x, w):
    return tf.matmul(x, w)

  x, w = randn(0, 16, 12), randn(1, 12, 8)
  order = _tiled(ISSUE_ORDER, (2, 4))  # x: rows over x, cols over y, issue order
  same = NamedSharding(M24, P('x', 'y'))
  w_rows = NamedSharding(M24, P('y', None))
  permuted, in_order = _run_both(f, (x, w), M24, ([order, w_rows], None), ([same, w_rows], None))
  assert ('all_reduce', ('y',)) in in_order  # the contraction over y
  _one_more_permute(permuted, in_order, 1)  # x moves to the mesh's order once


def test_interior_annotations_in_another_order_cost_nothing():
  ordered = np.reshape(ISSUE_ORDER, (2, 4))

  def make(device_mesh):
    @tf.function
    def f(x, w):
      x = tg.xla_sharding.mesh_split(x, device_mesh, [0, -1])  # TPU style: rows over mesh dim 0
      h = tf.nn.relu(tf.matmul(x, w))
      h = tg.xla_sharding.mesh_split(h, device_mesh, [0, 1])
      return tf.reduce_sum(h, axis=1)

    return f

  x, w = randn(2, 16, 12), randn(3, 12, 8)
  got_kinds = []
  for device_mesh in (ordered, np.arange(8).reshape(2, 4)):
    f = make(device_mesh)
    pf = partition(f, M24)
    assert_close(pf(x, w), f(x, w))
    got_kinds.append(kinds(pf))
  assert got_kinds[0] == got_kinds[1]


def test_conv_with_halos_split_in_another_order():
  order = [3, 6, 0, 5, 2, 7, 1, 4]

  @tf.function
  def f(x, k):
    return tf.nn.conv2d(x, k, strides=1, padding='SAME')

  x, k = randn(4, 2, 32, 6, 3), randn(5, 3, 3, 3, 4)
  permuted = _tiled(order, (1, 8, 1, 1))  # rows of the image over 8 devices
  same = NamedSharding(M8, P(None, 'x', None, None))
  perm_kinds, same_kinds = _run_both(f, (x, k), M8, ([permuted, None], None), ([same, None], None))
  assert ('permute', ('x',)) in same_kinds  # the halo exchange
  # The only order annotated is the image's: the program runs in it, nothing extra moves.
  assert perm_kinds == same_kinds


def test_all_to_all_from_and_to_other_orders():
  @tf.function
  def f(x):
    return x * 2.0

  x = randn(6, 16, 24)
  rows = _tiled(ISSUE_ORDER, (8, 1))
  cols_other = _tiled([7, 5, 3, 1, 6, 4, 2, 0], (1, 8))
  same_rows, same_cols = NamedSharding(M8, P('x', None)), NamedSharding(M8, P(None, 'x'))
  perm_kinds, same_kinds = _run_both(f, (x,), M8, (rows, cols_other), (same_rows, same_cols))
  assert same_kinds == [('all_to_all', ('x',))]
  _one_more_permute(perm_kinds, same_kinds, 2)  # the input and the output each move once


def test_reshard_to_an_output_in_another_order_with_replication():
  @tf.function
  def f(x):
    return tf.nn.relu(x) + 1.0

  x = randn(7, 16, 10)
  src = NamedSharding(M24, P(('x', 'y'), None))
  out = _tiled([6, 2, 4, 0, 7, 3, 5, 1], (2, 1, 4), replicate_last=True)  # rows over 2, x4 copies
  out_same = NamedSharding(M24, P('x', None))
  perm_kinds, same_kinds = _run_both(f, (x,), M24, (src, out), (src, out_same))
  assert same_kinds == [('all_gather', ('y',))]
  _one_more_permute(perm_kinds, same_kinds, 1)


def test_inputs_and_outputs_keep_their_order_as_sharded_values():
  order = _tiled(ISSUE_ORDER, (2, 4))
  layout = named(order, M24)

  @tf.function
  def f(x):
    return x * 3.0

  pf = partition(f, M24, in_shardings=order, out_shardings=order)
  x = randn(8, 8, 8)
  assert_close(pf(x), x * 3.0)
  compiled = pf.get_program(x)
  assert compiled.arg_shardings[0].mesh == layout.mesh  # split in the annotation's order
  assert compiled.prepared.mesh == layout.mesh  # and the program runs in it
  assert kinds(pf) == []
  # Per-device pieces follow the annotation: device 2 holds tile (0, 1).
  shards = compiled.prepared.out_shardings[0]
  assert shards.tile_index(2) == (0, 1) and shards.tile_index(1) == (0, 3)
  # Inputs and outputs must stay in the mesh's order (the output is annotated so): the program
  # keeps the mesh's order, the input moves once on entry.
  pf = partition(f, M24, in_shardings=order, out_shardings=NamedSharding(M24, P('x', 'y')))
  assert_close(pf(x), x * 3.0)
  assert pf.get_program(x).prepared.mesh == M24 and kinds(pf) == [('permute', ())]


def test_variables_pin_the_mesh_order():
  w = tf.Variable(randn(9, 8, 8))
  tg.shard_variable(w, M24, P('x', 'y'))
  order = _tiled(ISSUE_ORDER, (2, 4))

  @tf.function
  def f(x):
    w.assign_add(x)
    return w * 2.0

  x = randn(10, 8, 8)
  want = (w.numpy() + x) * 2.0
  pf = partition(f, M24, in_shardings=order)
  assert_close(pf(x), want)
  assert pf.get_program(x).prepared.mesh == M24  # the variable keeps the mesh's order
  assert kinds(pf) == [('permute', ())]
  assert_close(w.numpy(), want / 2.0, name='w')


def test_input_with_a_last_tile_dims_subgroup_in_another_order():
  # Rows over 2 groups of 4 copies each, written with last_tile_dims={REPLICATED} (XLA's form).
  proto = _proto([2, 1, 4], [5, 1, 7, 3, 4, 0, 6, 2], last_tile_dims=[0])
  given = op_sharding.from_proto(proto)

  @tf.function
  def f(x):
    return tf.reduce_sum(x * x, axis=0)

  x = randn(11, 10, 6)
  pf = partition(f, M24, in_shardings=given)
  assert_close(pf(x), f(x))
  compiled = pf.get_program(x)
  assert compiled.arg_shardings[0].is_equivalent_to(
    given
  )  # split as annotated, each device its rows
  in_order = partition(f, M24, in_shardings=NamedSharding(M24, P('x', None)))
  assert_close(in_order(x), f(x))
  # Only the annotated order differs: the program runs in it, nothing extra moves.
  assert compiled.prepared.mesh != M24 and kinds(pf) == kinds(in_order)


def test_a_variable_annotated_in_the_issue_order_is_stored_in_it():
  d24 = M24.reordered(np.reshape(ISSUE_ORDER, (2, 4)))
  w = tf.Variable(randn(11, 8, 8))
  tg.shard_variable(w, d24, P('x', 'y'))
  w_ref = tf.Variable(w.numpy())

  def make(var):
    @tf.function
    def f(x):
      var.assign_add(x)
      return tf.matmul(x, var)

    return f

  x = randn(12, 8, 8)
  pf = partition(make(w), M24, in_shardings=NamedSharding(d24, P('x', None)))
  assert_close(pf(x), make(w_ref)(x))
  assert pf.get_program(x).prepared.mesh == d24
  (sharded,) = pf.sharded_variables()
  assert sharded.sharding.mesh == d24  # device 2 holds the tile (0, 1) the annotation gives it
  assert sharded.sharding.tile_index(2) == (0, 1)
  assert_close(w.numpy(), w_ref.numpy(), name='w')
  # The same step written in the mesh's order moves exactly the same.
  w2 = tf.Variable(randn(11, 8, 8))
  tg.shard_variable(w2, M24, P('x', 'y'))
  in_order = partition(make(w2), M24, in_shardings=NamedSharding(M24, P('x', None)))
  in_order(x)
  assert kinds(pf) == kinds(in_order)


# --- tile dims that need sub-axes of the mesh ---------------------------------------------------
@pytest.mark.parametrize(
  'order',
  [list(range(8)), [7, 6, 5, 4, 3, 2, 1, 0], ISSUE_ORDER],
  ids=['mesh-order', 'reversed', 'issue-order'],
)
def test_tile_222_on_a_2x4_mesh_runs_on_sub_axes(order):
  # [2, 2, 2] is no grouping of (x=2, y=4), but is one of (x, y#0, y#1): y split in two.
  w = tf.Variable(randn(21, 8, 6))
  tg.shard_variable(w, M24, P('y', None))
  tile = Sharding.tiled(np.reshape(order, (2, 2, 2)))

  @tf.function
  def f(a):
    a = tg.shard(a, tile)
    return tf.nn.relu(tf.einsum('abc,cd->abd', a, w)) * 2.0

  a = randn(22, 4, 4, 8)
  pf = partition(f, M24)
  assert_close(pf(a), f(a))
  compiled = pf.get_program(a)
  assert set(compiled.mesh.axis_names) == {'x', 'y#0', 'y#1'}
  # The variable keeps the layout it was annotated with (P('y') is P(('y#0', 'y#1'))).
  (sharded,) = pf.sharded_variables()
  assert sharded.sharding.is_equivalent_to(NamedSharding(M24, P('y', None)))
  assert all(a in ('x', 'y#0', 'y#1') for _, axes in kinds(pf) for a in axes)


def test_tile_2x4_on_a_1d_mesh_trains_like_unpartitioned():
  # TPU code annotating a 2-D tile assignment while the user gave a 1-D mesh of 8.
  w, w_ref = tf.Variable(randn(23, 16, 8)), None
  w_ref = tf.Variable(w.numpy())

  def make(var):
    @tf.function
    def step(x):
      x = tg.shard(x, Sharding.tiled(np.arange(8).reshape(2, 4)))
      with tf.GradientTape() as tape:
        loss = tf.reduce_sum(tf.tanh(tf.matmul(x, var)) ** 2)
      var.assign_sub(0.1 * tape.gradient(loss, var))
      return loss

    return step

  x = randn(24, 8, 16)
  pf = partition(make(w), M8)
  step_ref = make(w_ref)
  for _ in range(2):
    assert_close(pf(x), step_ref(x), name='loss')
  assert_close(w.numpy(), w_ref.numpy(), name='w')
  assert set(pf.get_program(x).mesh.axis_names) == {'x#0', 'x#1', 'x#2'}


def test_a_layout_no_refinement_spells_is_still_refused():
  # Tiled over 4 of the mesh's 8 devices: no mesh, refined or reordered, holds it.
  tile = Sharding.tiled(np.arange(4).reshape(2, 2))

  @tf.function
  def f(a):
    return tg.shard(a, tile) * 2.0

  with pytest.raises(ValueError, match='devices'):
    partition(f, M24)(randn(25, 4, 4))


def test_sub_axis_tiles_on_the_xla_backend():
  pytest.importorskip('jax')
  w = tf.Variable(randn(26, 8, 6))
  tg.shard_variable(w, M24, P('y', None))

  @tf.function
  def f(a):
    a = tg.shard(a, Sharding.tiled(np.arange(8).reshape(2, 2, 2)))
    return tf.einsum('abc,cd->abd', a, w)

  a = randn(27, 4, 4, 8)
  tf_run, xla_run = partition(f, M24), partition(f, M24, backend='xla')
  assert_close(xla_run(a), f(a))
  assert_close(tf_run(a), f(a))
  assert kinds(xla_run) == kinds(tf_run)
