"""Every collective of the TF backend over 1-D and 2-D meshes, against numpy.

Each mesh runs one per-partition program holding all cases (one trace, one
launch). Partition p's operand is row p of a numpy table, so the reference
needs nothing but `Mesh.groups` / `Mesh.coords`.
"""

import os
import re
import textwrap

import numpy as np
import pytest
import tensorflow as tf

from tf_gspmd import Mesh
from tf_gspmd.runtime import SpmdProgram
from tf_gspmd.testing import assert_close, check

from helpers import run_python

N = 8
LOCAL = (5, 6)  # odd sizes: every split over 2, 4 or 8 is uneven
RNG = np.random.default_rng(0)
FLOATS = RNG.uniform(0.5, 1.5, size=(N,) + LOCAL).astype(np.float32)
INTS = RNG.integers(-50, 50, size=(N,) + LOCAL).astype(np.int32)
BOOLS = RNG.uniform(size=(N,) + LOCAL) < 0.3

MESHES = {
  '1d': (Mesh.create((8,), ('x',)), [('x',)]),
  '2d': (Mesh.create((2, 4), ('x', 'y')), [('y',), ('x',), ('x', 'y'), ('y', 'x')]),
  # Device ids out of row-major order: TF's member order (by device) differs from positions.
  '2d_permuted': (
    Mesh(np.array([[3, 1, 7, 5], [0, 2, 6, 4]]), ('x', 'y')),
    [('y',), ('x',), ('x', 'y')],
  ),
}
PAIRS = [(0, 5), (5, 2), (2, 0), (3, 3), (6, 7)]  # a cycle, a self pair, a lone edge
SHIFTS = ((1, False), (-1, False), (2, False), (1, True), (-3, True))
_NP_REDUCE = {'sum': np.sum, 'max': np.max, 'min': np.min, 'prod': np.prod}


# --- numpy references ---------------------------------------------------------------------------
def group_and_position(mesh, axes, p):
  for g in mesh.groups(axes):
    if p in g:
      return g, g.index(p)
  raise AssertionError(p)


def pad_to(a, dim, size):
  widths = [(0, 0)] * a.ndim
  widths[dim] = (0, size - a.shape[dim])
  return np.pad(a, widths)


def ref_all_reduce(table, mesh, axes, op, p):
  g, _ = group_and_position(mesh, axes, p)
  # In the operand's dtype, as the collective returns it (numpy sums int32 in int64).
  return _NP_REDUCE[op](np.stack([table[m] for m in g]), axis=0).astype(table.dtype)


def ref_all_gather(table, mesh, axes, dim, size, p):
  g, _ = group_and_position(mesh, axes, p)
  out = np.concatenate([table[m] for m in g], axis=dim)
  return out if size is None else np.take(out, range(size), axis=dim)


def ref_reduce_scatter(table, mesh, axes, dim, op, p):
  g, pos = group_and_position(mesh, axes, p)
  k = len(g)
  reduced = ref_all_reduce(table, mesh, axes, op, p)
  chunk = -(-reduced.shape[dim] // k)
  return np.take(pad_to(reduced, dim, k * chunk), range(pos * chunk, (pos + 1) * chunk), axis=dim)


def ref_all_to_all(table, mesh, axes, split_dim, concat_dim, concat_size, p):
  g, pos = group_and_position(mesh, axes, p)
  k = len(g)
  chunk = -(-table.shape[1 + split_dim] // k)
  pieces = [
    np.take(
      pad_to(table[m], split_dim, k * chunk), range(pos * chunk, (pos + 1) * chunk), axis=split_dim
    )
    for m in g
  ]
  out = np.concatenate(pieces, axis=concat_dim)
  return out if concat_size is None else np.take(out, range(concat_size), axis=concat_dim)


def ref_broadcast(table, mesh, axes, root, p):
  g, _ = group_and_position(mesh, axes, p)
  return table[g[root]]


def ref_permute(table, pairs, p):
  sources = [s for s, d in pairs if d == p]
  return table[sources[0]] if sources else np.zeros_like(table[p])


def ref_shift(table, mesh, axis, offset, cyclic, p):
  coords = mesh.coords(p)
  source = coords[axis] - offset
  size = mesh.shape[axis]
  if cyclic:
    source %= size
  if not 0 <= source < size:
    return np.zeros_like(table[p])
  return table[mesh.device_at(**{**coords, axis: source})]


# --- cases ----------------------------------------------------------------------------------------
def cases_for(mesh, axes_sets):
  """{name: (body(c, f, i, b) -> tensor, reference(p) -> ndarray)} for one mesh."""
  cases = {}

  def add(name, body, ref):
    cases[name] = (body, ref)

  for axes in axes_sets:
    tag = '_'.join(axes)
    k = mesh.axes_size(axes)
    for op in ('sum', 'max', 'min', 'prod'):
      add(
        f'all_reduce_{op}_{tag}',
        lambda c, f, i, b, axes=axes, op=op: c.all_reduce(f, axes, op),
        lambda p, axes=axes, op=op: ref_all_reduce(FLOATS, mesh, axes, op, p),
      )
    add(
      f'all_reduce_int_{tag}',
      lambda c, f, i, b, axes=axes: c.all_reduce(i, axes),
      lambda p, axes=axes: ref_all_reduce(INTS, mesh, axes, 'sum', p),
    )
    add(
      f'all_reduce_bool_any_{tag}',
      lambda c, f, i, b, axes=axes: c.all_reduce(b, axes, 'max'),
      lambda p, axes=axes: ref_all_reduce(BOOLS, mesh, axes, 'max', p),
    )
    size = k * LOCAL[0] - 3  # uneven global size: the last shard held 2 padded rows
    add(
      f'all_gather_dim0_size_{tag}',
      lambda c, f, i, b, axes=axes, size=size: c.all_gather(f, axes, 0, size=size),
      lambda p, axes=axes, size=size: ref_all_gather(FLOATS, mesh, axes, 0, size, p),
    )
    add(
      f'all_gather_dim1_int_{tag}',
      lambda c, f, i, b, axes=axes: c.all_gather(i, axes, 1),
      lambda p, axes=axes: ref_all_gather(INTS, mesh, axes, 1, None, p),
    )
    add(
      f'reduce_scatter_dim0_{tag}',
      lambda c, f, i, b, axes=axes: c.reduce_scatter(f, axes, 0),
      lambda p, axes=axes: ref_reduce_scatter(FLOATS, mesh, axes, 0, 'sum', p),
    )
    add(
      f'reduce_scatter_dim1_max_int_{tag}',
      lambda c, f, i, b, axes=axes: c.reduce_scatter(i, axes, 1, 'max'),
      lambda p, axes=axes: ref_reduce_scatter(INTS, mesh, axes, 1, 'max', p),
    )
    concat_size = k * -(-LOCAL[1] // k) - 1
    add(
      f'all_to_all_1_to_0_{tag}',
      lambda c, f, i, b, axes=axes: c.all_to_all(f, axes, 1, 0),
      lambda p, axes=axes: ref_all_to_all(FLOATS, mesh, axes, 1, 0, None, p),
    )
    add(
      f'all_to_all_0_to_1_trim_{tag}',
      lambda c, f, i, b, axes=axes, n=k * LOCAL[1] - 2: c.all_to_all(i, axes, 0, 1, concat_size=n),
      lambda p, axes=axes, n=k * LOCAL[1] - 2: ref_all_to_all(INTS, mesh, axes, 0, 1, n, p),
    )
    add(
      f'all_to_all_1_to_1_{tag}',
      lambda c, f, i, b, axes=axes: c.all_to_all(f, axes, 1, 1),
      lambda p, axes=axes: ref_all_to_all(FLOATS, mesh, axes, 1, 1, None, p),
    )
    del concat_size
    add(
      f'broadcast_{tag}',
      lambda c, f, i, b, axes=axes, k=k: c.broadcast(f, axes, k - 1),
      lambda p, axes=axes, k=k: ref_broadcast(FLOATS, mesh, axes, k - 1, p),
    )
    add(
      f'broadcast_bool_{tag}',
      lambda c, f, i, b, axes=axes: c.broadcast(b, axes, 1),
      lambda p, axes=axes: ref_broadcast(BOOLS, mesh, axes, 1, p),
    )
  for axis in mesh.axis_names:
    for offset, cyclic in SHIFTS:
      add(
        f'shift_{axis}_{offset}_{"cyclic" if cyclic else "open"}',
        lambda c, f, i, b, axis=axis, offset=offset, cyclic=cyclic: c.shift(
          f, axis, offset, cyclic
        ),
        lambda p, axis=axis, offset=offset, cyclic=cyclic: ref_shift(
          FLOATS, mesh, axis, offset, cyclic, p
        ),
      )
  add(
    'permute_pairs', lambda c, f, i, b: c.permute(i, PAIRS), lambda p: ref_permute(INTS, PAIRS, p)
  )
  return cases


def run_cases(mesh, cases, timeout=60.0):
  def fn(ctx):
    pid = ctx.partition_id
    f = tf.gather(tf.constant(FLOATS), pid)
    i = tf.gather(tf.constant(INTS), pid)
    b = tf.gather(tf.constant(BOOLS), pid)
    return {name: body(ctx.collectives, f, i, b) for name, (body, _) in cases.items()}

  program = SpmdProgram(mesh, fn, keep_sharded=True, timeout=timeout, autograph=False)
  outputs = program()
  return program, {name: [s.numpy() for s in value.shards] for name, value in outputs.items()}


@pytest.fixture(scope='module', params=sorted(MESHES))
def mesh_results(request):
  mesh, axes_sets = MESHES[request.param]
  cases = cases_for(mesh, axes_sets)
  program, results = run_cases(mesh, cases)
  return mesh, axes_sets, cases, program, results


def test_every_collective_matches_numpy(mesh_results):
  mesh, _, cases, _, results = mesh_results
  failures = []
  for name, (_, reference) in cases.items():
    for p in range(mesh.size):
      verdict = check(results[name][p], reference(p), f'{name} partition {p}')
      if not verdict.ok:
        failures.append(str(verdict))
  assert not failures, '\n'.join(failures[:20])


def test_records_count_every_emitted_collective(mesh_results):
  mesh, axes_sets, cases, program, _ = mesh_results
  records = program.records
  # Every case emits one collective, except shifts that move nothing (off the end of the axis).
  moving_shifts = sum(
    1
    for axis in mesh.axis_names
    for offset, cyclic in SHIFTS
    if (offset % mesh.shape[axis] if cyclic else abs(offset) < mesh.shape[axis])
  )
  silent = 5 * len(mesh.axis_names) - moving_shifts
  assert len(records) == len(cases) - silent
  by_kind = {}
  for r in records:
    by_kind[r.kind] = by_kind.get(r.kind, 0) + 1
    assert re.fullmatch(rf'gspmd/{r.kind}_\d+', r.name), r.name
    assert r.bytes == int(np.prod(r.shape)) * r.dtype.size
  n_axes = len(axes_sets)
  assert by_kind['all_reduce'] == 6 * n_axes
  assert by_kind['all_gather'] == 2 * n_axes
  assert by_kind['reduce_scatter'] == 2 * n_axes
  assert by_kind['all_to_all'] == 3 * n_axes
  assert by_kind['broadcast'] == 2 * n_axes
  assert by_kind['permute'] == moving_shifts + 1
  names = [r.name for r in records if r.kind == 'all_gather']
  assert names[:2] == ['gspmd/all_gather_0', 'gspmd/all_gather_1']
  gather = next(r for r in records if r.kind == 'all_gather')
  assert gather.axes == axes_sets[0]
  assert gather.shape == LOCAL and gather.dtype == tf.float32 and gather.bytes == 4 * 30
  assert np.array_equal(gather.groups, np.array(mesh.groups(gather.axes)))


def test_per_partition_program_is_traced_once_and_called_per_device():
  mesh = Mesh.create((2, 4), ('x', 'y'))

  def fn(ctx, x):
    return ctx.collectives.all_reduce(x, 'y')

  program = SpmdProgram(mesh, fn)
  program(np.ones((4, 3), np.float32))
  outer = program.trace(tf.TensorSpec((4, 3), tf.float32))
  calls = [op for op in outer.graph.get_operations() if op.type == 'StatefulPartitionedCall']
  assert len(calls) == 8
  called = {c.get_attr('f').name for c in calls}
  assert {n.decode() if isinstance(n, bytes) else n for n in called} == {
    program.per_partition.function.name.decode()
    if isinstance(program.per_partition.function.name, bytes)
    else program.per_partition.function.name
  }
  assert sorted(tf.DeviceSpec.from_string(c.device).device_index for c in calls) == list(range(8))
  attrs = program.per_partition.function.function_def.attr
  assert attrs['_noinline'].b


def _collectives_in_order(graph) -> list:
  return [op for op in graph.get_operations() if op.type.startswith('Collective')]


def _reaches(later, earlier) -> bool:
  """Whether `earlier` runs before `later` by some chain of data or control edges."""
  seen, stack = set(), [later]
  while stack:
    op = stack.pop()
    if op is earlier:
      return True
    if op.name in seen:
      continue
    seen.add(op.name)
    stack.extend(t.op for t in op.inputs)
    stack.extend(op.control_inputs)
  return False


@pytest.mark.parametrize('markers', [True, False])
def test_independent_collectives_run_in_program_order_on_every_device(markers):
  """Two collectives no data orders (sums of two inputs) run in program order on each
  device, by the ordering token alone where there are no progress markers (the SavedModel
  export's serving functions): the token itself, not a list of it (which TF packed into a
  new resource tensor per collective, tied to nothing)."""
  mesh = Mesh.create((8,), ('x',))

  def fn(ctx, a, b):
    return ctx.collectives.all_reduce(a, 'x'), ctx.collectives.all_gather(b, 'x', 0)

  program = SpmdProgram(mesh, fn, progress_markers=markers)
  got = program(np.ones((3,), np.float32), np.ones((2,), np.float32))
  assert np.asarray(got[0]).tolist() == [8.0] * 3
  graph = program.per_partition.function.graph
  first, second = _collectives_in_order(graph)
  assert _reaches(second, first)
  assert not any(
    op.type == 'Pack' and op.outputs[0].dtype == tf.resource for op in graph.get_operations()
  )


def test_names_follow_the_enclosing_scope():
  mesh = Mesh.create((8,), ('x',))

  def fn(ctx, x):
    with tf.name_scope('layer1'):
      y = ctx.collectives.all_gather(x, 'x', 0)
    return ctx.collectives.all_reduce(y, 'x')

  program = SpmdProgram(mesh, fn)
  x = np.arange(8, dtype=np.float32).reshape(8, 1)
  out = program(x)  # replicated input: every partition holds x
  np.testing.assert_array_equal(out.numpy(), 8 * np.tile(x, (8, 1)))
  names = [r.name for r in program.records]
  assert names == ['layer1/gspmd/all_gather_0', 'gspmd/all_reduce_0']
  gathers = [
    op.name
    for op in program.per_partition.function.graph.get_operations()
    if op.type == 'CollectiveGatherV2'
  ]
  assert len(gathers) == 1 and gathers[0].startswith('layer1/gspmd/all_gather_0/')


def test_while_loop_with_collectives_inside():
  mesh = Mesh.create((2, 4), ('x', 'y'))
  steps = 4

  def fn(ctx, x):
    c = ctx.collectives
    acc = x
    for _ in tf.range(steps):  # autograph: a While loop in the per-partition program
      acc = c.all_reduce(acc, 'y') * 0.25 + c.shift(acc, 'x', 1, cyclic=True)
    return acc

  table = FLOATS
  program = SpmdProgram(
    mesh,
    lambda ctx: fn(ctx, tf.gather(tf.constant(table), ctx.partition_id)),
    keep_sharded=True,
    timeout=30,
  )
  out = program()
  graph_ops = {op.type for op in program.per_partition.function.graph.get_operations()}
  assert graph_ops & {'While', 'StatelessWhile'}
  acc = [table[p] for p in range(8)]
  for _ in range(steps):
    acc = [
      ref_all_reduce(np.stack(acc), mesh, ('y',), 'sum', p) * 0.25
      + ref_shift(np.stack(acc), mesh, 'x', 1, True, p)
      for p in range(8)
    ]
  assert_close(list(out.shards), acc, 'partitions')


def test_repeated_calls_do_not_leak_threads():
  """TF's per-op collective timeouts park a thread per op execution; the launcher must not."""
  mesh = Mesh.create((2, 4), ('x', 'y'))

  def fn(ctx, x):
    c = ctx.collectives
    return c.all_reduce(c.shift(c.all_gather(x, 'y', 0), 'x', 1), ('x', 'y'))

  program = SpmdProgram(mesh, fn, timeout=60, autograph=False)
  x = np.ones((2, 3), np.float32)
  program(x)
  before = len(os.listdir('/proc/self/task'))
  for _ in range(20):
    program(x)
  assert len(os.listdir('/proc/self/task')) - before < 20


def test_axis_index_and_offsets_tables():
  from tf_gspmd.sharding import NamedSharding, P

  mesh = Mesh(np.array([[3, 1, 7, 5], [0, 2, 6, 4]]), ('x', 'y'))
  sharding = NamedSharding(mesh, P('y', 'x'))

  def fn(ctx):
    return (ctx.axis_index(('y', 'x')), ctx.axis_index('x'), ctx.shard_offsets(sharding, (10, 3)))

  out = SpmdProgram(mesh, fn, keep_sharded=True)()
  for p in range(8):
    assert out[0].shards[p].numpy() == mesh.linear_index(p, ('y', 'x'))
    assert out[1].shards[p].numpy() == mesh.coords(p)['x']
    want = [b[0] for b in sharding.shard_bounds((10, 3), p)]
    assert out[2].shards[p].numpy().tolist() == want


def test_bad_arguments_raise_clear_errors():
  mesh = Mesh.create((8,), ('x',))
  errors = []

  def fn(ctx, x):
    c = ctx.collectives
    for call, kind in (
      (lambda: c.all_reduce(x, 'z'), ValueError),
      (lambda: c.permute(x, [(0, 1), (2, 1)]), ValueError),
      (lambda: c.all_reduce(x > 0, 'x', 'sum'), TypeError),
      (lambda: c.broadcast(x, 'x', 8), ValueError),
      (lambda: c.all_gather(x, 'x', 2), ValueError),
    ):
      with pytest.raises(kind) as info:
        call()
      errors.append(str(info.value))
    return x

  SpmdProgram(mesh, fn).trace(tf.TensorSpec((2, 2), tf.float32))
  assert "'z'" in errors[0]
  assert 'target' in errors[1] and '[1]' in errors[1]
  assert 'ambiguous' in errors[2] and 'all_reduce' in errors[2]
  assert 'root_index 8' in errors[3]
  assert 'dim 2' in errors[4]


_TIMEOUT_SCRIPT = textwrap.dedent("""
    import os, sys, time
    os.environ['TF_CPP_MIN_LOG_LEVEL'] = '3'
    import numpy as np
    import tensorflow as tf
    cpus = tf.config.list_physical_devices('CPU')
    eight = [tf.config.LogicalDeviceConfiguration()] * 8
    tf.config.set_logical_device_configuration(cpus[0], eight)
    from tf_gspmd import Mesh
    from tf_gspmd.runtime import CollectiveError, SpmdProgram
    mesh = Mesh.create((2, 4), ('x', 'y'))

    def fn(ctx, x):
      c = ctx.collectives
      x = c.all_reduce(x, ('x', 'y'))       # everybody joins this one
      return tf.cond(ctx.partition_id < 2,  # only partitions 0 and 1 join the next
                     lambda: c.all_gather(x, 'y', 0), lambda: tf.tile(x, [4]))

    program = SpmdProgram(mesh, fn, timeout=1.5)
    start = time.time()
    try:
      program(np.ones([3], np.float32))
    except CollectiveError as e:
      print('ELAPSED', time.time() - start)
      print(e)
      sys.exit(0)
    print('NO ERROR')
    sys.exit(1)
""")


@pytest.mark.slow  # a page or a fresh interpreter: `make test` runs it, the edit loop not
def test_timed_out_collective_raises_a_clear_error_in_a_subprocess(tmp_path):
  script = tmp_path / 'timeout.py'
  script.write_text(_TIMEOUT_SCRIPT)
  run = run_python(script, 120)
  assert run.returncode == 0, run.stdout + run.stderr[-3000:]
  out = run.stdout
  elapsed = float(out.split('ELAPSED')[1].split()[0])
  assert elapsed < 1.5 + 5.0, out
  assert "all_gather 'cond/gspmd/all_gather_0' over mesh axes ('y',)" in out
  assert 'did not complete within its 1.5 s timeout' in out
  assert 'group [0, 1, 2, 3]: partitions [0, 1] were waiting in it' in out
  assert "partition 2 had last finished 'gspmd/all_reduce_0'" in out
  assert "partition 3 had last finished 'gspmd/all_reduce_0'" in out
  assert 'watchdog: fn: partition 0 waited' in out  # the abort reason comes along


def test_closed_cycle_gives_every_partition_one_send_and_one_receive():
  """A permutation closed into cycles keeps its moving pairs and adds one pair per chain (a
  partition that sends nothing, receives nothing, or keeps its own value is a chain of one);
  a permutation that is already cycles gets nothing added; one partition left alone cannot
  be closed."""
  from tf_gspmd.collectives.tables import closed_cycle

  for pairs, n, added in [
    (PAIRS, 8, 4),  # the chains 1, 3, 4 and 6 -> 7 (the cycle 0 -> 5 -> 2 -> 0 stays)
    ([(p, p + 1) for p in range(7)], 8, 1),  # a shift without wrap: one chain
    ([(p, (p + 1) % 8) for p in range(8)], 8, 0),  # a cyclic shift
    ([(0, 1)], 4, 3),
  ]:
    edges, real = closed_cycle(np.array(pairs), n)
    assert sorted(s for s, _ in edges) == list(range(n)) == sorted(t for _, t in edges)
    moving = [tuple(p) for p in pairs if p[0] != p[1]]
    assert [e for e, r in zip(edges, real) if r] == moving
    assert real.count(False) == added
  assert closed_cycle(np.array([(p, (p + 1) % 7) for p in range(7)]), 8) is None


@pytest.mark.parametrize('path', ['closed', 'branches', 'closed where nothing is added'])
def test_permutes_match_numpy_on_either_path(path, monkeypatch):
  """Shifts (with and without wrap) and a permutation with a cycle, a self pair and a lone
  edge, of floats, ints and bools, are numpy's on either path: closed into cycles (one send
  and one receive per partition, no `If`) or under `If`s; with the closed path's size limit
  at 0, only permutations that are cycles already are closed."""
  from tf_gspmd.runtime import collectives

  if path == 'branches':
    monkeypatch.setattr(
      collectives.TFCollectives,
      '_permute',
      lambda self, x, pairs, family: self._permute_by_branches(x, pairs, family),
    )
  elif path != 'closed':
    monkeypatch.setattr(collectives, 'CLOSED_CYCLE_MAX_BYTES', 0)
  mesh, axes_sets = MESHES['2d_permuted']
  cases = {k: v for k, v in cases_for(mesh, axes_sets).items() if k.startswith(('shift', 'perm'))}
  cases['permute_pairs_bool'] = (
    lambda c, f, i, b: c.permute(b, PAIRS),
    lambda p: ref_permute(BOOLS, PAIRS, p),
  )
  program, results = run_cases(mesh, cases)
  for name, (_, reference) in cases.items():
    for p in range(mesh.size):
      assert check(results[name][p], reference(p), f'{name} partition {p}').ok
  graph = program.per_partition.function.graph
  ifs = [op for op in graph.get_operations() if op.type == 'If']
  sends = [op for op in graph.get_operations() if op.type == 'CollectiveBcastSendV2']
  if path == 'closed':
    assert not ifs and sends
  elif path == 'branches':
    assert ifs and not sends
  else:
    assert ifs and sends  # the cyclic shifts closed, the others under Ifs
