"""Dtypes TF's collective kernels refuse (complex, uint64, int8, bool, bfloat16, ...) go through
every collective kind exactly, carried as dtypes they take (`collectives.carriers.carrier_for`),
on 8 logical devices, against numpy; and reductions that are undefined are refused clearly.

One per-partition program per mesh holds every case (one trace, one launch).
"""

import ml_dtypes
import numpy as np
import pytest
import tensorflow as tf

import tf_gspmd as tg
from tf_gspmd import Mesh
from tf_gspmd.partitioned import partition
from tf_gspmd.runtime import SpmdProgram

N = 8
LOCAL = (5, 6)  # odd sizes: every split over 2, 4 or 8 is uneven
RNG = np.random.default_rng(7)


def _complex(dtype):
  real, imag = RNG.uniform(0.5, 1.5, size=(2, N) + LOCAL)
  return (real + 1j * imag).astype(dtype)


TABLES = {
  # Values near 2^64: sums and products wrap, and the low halves carry into the high ones.
  'uint64': (np.uint64(2**64 - 2**40) + RNG.integers(0, 2**62, size=(N,) + LOCAL, dtype=np.uint64)),
  'complex64': _complex(np.complex64),
  'complex128': _complex(np.complex128),
  'int8': RNG.integers(-128, 128, size=(N,) + LOCAL).astype(np.int8),  # sums wrap
  'uint8': RNG.integers(0, 256, size=(N,) + LOCAL).astype(np.uint8),
  'int16': RNG.integers(-(2**15), 2**15, size=(N,) + LOCAL).astype(np.int16),
  'uint32': RNG.integers(2**31, 2**32, size=(N,) + LOCAL).astype(np.uint32),
  'bool': RNG.uniform(size=(N,) + LOCAL) < 0.4,
  # Small integers: bfloat16 sums of up to 8 of them are exact, so the order of adding is moot.
  'bfloat16': RNG.integers(-8, 9, size=(N,) + LOCAL).astype(ml_dtypes.bfloat16),
}
REDUCTIONS = {
  'uint64': ('sum', 'prod', 'max', 'min'),
  'complex64': ('sum', 'prod'),
  'complex128': ('sum',),
  'int8': ('sum', 'prod', 'max', 'min'),
  'uint8': ('sum', 'max'),
  'int16': ('prod', 'min'),
  'uint32': ('sum', 'prod', 'max'),
  'bool': ('max', 'min'),
  'bfloat16': ('sum', 'max', 'min'),
}
_NP_REDUCE = {'sum': np.sum, 'prod': np.prod, 'max': np.max, 'min': np.min}
MAIN_DTYPES = ('complex64', 'uint64', 'int8', 'bool', 'bfloat16')
MESHES = {  # name: (mesh, the axes of every collective, the dtypes sent)
  '1d': (Mesh.create((8,), ('x',)), ('x',), tuple(TABLES)),
  # Device ids out of row-major order, and a group of two axes in reversed order.
  '2d_permuted': (
    Mesh(np.array([[3, 1, 7, 5], [0, 2, 6, 4]]), ('x', 'y')),
    ('y', 'x'),
    MAIN_DTYPES,
  ),
}
PAIRS = [(0, 5), (5, 2), (2, 0), (3, 3), (6, 7)]


# --- numpy references ---------------------------------------------------------------------
def _group(mesh, axes, p):
  g = next(g for g in mesh.groups(axes) if p in g)
  return g, g.index(p)


def _reduce(table, g, op):
  # In the operand's own dtype: integer sums and products wrap as they do on the devices.
  stacked = np.stack([table[m] for m in g])
  if stacked.dtype == bool:
    return stacked.any(0) if op == 'max' else stacked.all(0)
  if op in ('sum', 'prod'):
    with np.errstate(over='ignore'):
      return _NP_REDUCE[op](stacked, axis=0, dtype=stacked.dtype)
  return _NP_REDUCE[op](stacked, axis=0)


def _chunk(a, dim, k, pos):
  c = -(-a.shape[dim] // k)
  widths = [(0, 0)] * a.ndim
  widths[dim] = (0, k * c - a.shape[dim])
  return np.take(np.pad(a, widths), range(pos * c, (pos + 1) * c), axis=dim)


def references(mesh, axes, name, p):
  table = TABLES[name]
  g, pos = _group(mesh, axes, p)
  k = len(g)
  refs = {
    'all_gather': np.concatenate([table[m] for m in g], axis=1)[:, : k * LOCAL[1] - 1],
    'all_to_all': np.concatenate([_chunk(table[m], 1, k, pos) for m in g], axis=0),
    'broadcast': table[g[k - 1]],
    'permute': next((table[s] for s, d in PAIRS if d == p), np.zeros_like(table[p])),
  }
  for op in REDUCTIONS[name]:
    refs[f'all_reduce_{op}'] = _reduce(table, g, op)
    refs[f'reduce_scatter_{op}'] = _chunk(_reduce(table, g, op), 0, k, pos)
  return refs


def run_all(mesh, axes, names):
  k = mesh.axes_size(axes)

  def fn(ctx):
    c, outs = ctx.collectives, {}
    for name in names:
      x = tf.gather(tf.constant(TABLES[name]), ctx.partition_id)
      with tf.name_scope(name):
        outs[name, 'all_gather'] = c.all_gather(x, axes, 1, size=k * LOCAL[1] - 1)
        outs[name, 'all_to_all'] = c.all_to_all(x, axes, 1, 0)
        outs[name, 'broadcast'] = c.broadcast(x, axes, k - 1)
        outs[name, 'permute'] = c.permute(x, PAIRS)
        for op in REDUCTIONS[name]:
          outs[name, f'all_reduce_{op}'] = c.all_reduce(x, axes, op)
          outs[name, f'reduce_scatter_{op}'] = c.reduce_scatter(x, axes, 0, op)
    return {f'{n}/{case}': v for (n, case), v in outs.items()}

  program = SpmdProgram(mesh, fn, keep_sharded=True, timeout=60.0, autograph=False)
  outputs = program()
  return program, {key: [s.numpy() for s in v.shards] for key, v in outputs.items()}


@pytest.fixture(scope='module', params=sorted(MESHES))
def results(request):
  mesh, axes, names = MESHES[request.param]
  program, got = run_all(mesh, axes, names)
  return mesh, names, program, got


def _mismatch(got, want):
  if got.shape != want.shape or got.dtype != want.dtype:
    return f'{got.dtype}{got.shape} != {want.dtype}{want.shape}'
  if want.dtype.kind == 'c':
    err = np.max(np.abs(got - want) / np.maximum(np.abs(want), 1e-30))
    return f'relative error {err}' if err > 1e-5 else None
  return None if np.array_equal(got, want) else f'{got.ravel()[:4]} != {want.ravel()[:4]}'


def test_every_dtype_through_every_collective_matches_numpy(results):
  mesh, names, _, got = results
  axes = MESHES[next(k for k, v in MESHES.items() if v[0] == mesh)][1]
  failures = []
  for name in names:
    for p in range(mesh.size):
      for case, want in references(mesh, axes, name, p).items():
        problem = _mismatch(got[f'{name}/{case}'][p], want)
        if problem:
          failures.append(f'{name} {case} partition {p}: {problem}')
  assert not failures, '\n'.join(failures[:20])


def test_collectives_are_counted_with_their_carriers(results):
  _, names, program, _ = results
  by_dtype = {}
  for r in program.records:
    by_dtype.setdefault(r.dtype.name, []).append(r)
  assert sorted(by_dtype) == sorted(names)
  for name in names:
    ops = REDUCTIONS[name]
    records = by_dtype[name]
    # Products of complex and uint64 are a gather of every member's operand and a local
    # product: an all-gather (of a [1, ...] operand) instead of a reduction.
    by_gather = sum(1 for op in ops if op == 'prod' and name in ('complex64', 'uint64'))
    kinds = sorted(r.kind for r in records)
    assert kinds == sorted(
      ['all_gather'] * (1 + 2 * by_gather)
      + ['all_to_all', 'broadcast', 'permute']
      + ['all_reduce', 'reduce_scatter'] * (len(ops) - by_gather)
    ), name
    for r in records:
      assert r.bytes == int(np.prod(r.shape)) * r.dtype.size  # the value's bytes, not the carrier's
      assert r.name.startswith(f'{name}/gspmd/'), r.name
  carried = {
    (r.dtype.name, r.kind, dict(r.params).get('op')): dict(r.params)['carried_as']
    for r in program.records
  }
  expected = {
    ('complex64', 'all_reduce', 'sum'): 'float32',
    ('complex128', 'permute', None): 'float64',
    ('uint64', 'all_to_all', None): 'int64',
    ('uint64', 'all_reduce', 'sum'): 'int64',  # low and high halves
    ('uint64', 'all_reduce', 'max'): 'int64',  # top bit flipped: order kept
    ('int8', 'all_reduce', 'sum'): 'int32',
    ('bool', 'broadcast', None): 'int32',
    ('uint32', 'reduce_scatter', 'prod'): 'int64',
    ('bfloat16', 'all_gather', None): 'float32',
  }
  for key, carrier in expected.items():
    if key[0] in names:
      assert carried[key] == carrier, key


@pytest.mark.parametrize(
  'dtype, op, words',
  [
    (tf.complex64, 'max', ['complex64', "'max'", 'no order', 'all_reduce', "('x',)"]),
    (tf.complex128, 'min', ['complex128', "'min'", 'no order', 'reduce_scatter']),
    (tf.bool, 'sum', ['bool', "'sum'", 'ambiguous']),
    (tf.string, None, ['string', 'cannot carry', 'all_gather']),
  ],
)
def test_undefined_reductions_and_uncarried_dtypes_are_refused_by_name(dtype, op, words):
  mesh = Mesh.create((8,), ('x',))
  value = tf.constant('s') if dtype == tf.string else tf.zeros((8, 2), dtype)
  value = tf.fill([8, 2], value) if dtype == tf.string else value

  def fn(ctx):
    c = ctx.collectives
    with tf.name_scope('layer7'):
      if op is None:
        return c.all_gather(value, 'x', 0)
      if 'reduce_scatter' in words:
        return c.reduce_scatter(value, 'x', 0, op)
      return c.all_reduce(value, 'x', op)

  with pytest.raises(TypeError) as err:
    SpmdProgram(mesh, fn, autograph=False)()
  for word in words + ['[8,2]', 'layer7']:
    assert word in str(err.value), (word, str(err.value))


# --- through tg.partition: the partitioner's reshards of these dtypes --------------------------
def _reshard_program(mesh, dtype):
  @tf.function
  def f(x):
    x = tg.shard(x, mesh, tg.P('x', None))
    y = tg.shard(tf.identity(x), mesh, tg.P(None, 'x'))  # all-to-all
    z = tg.shard(tf.identity(y), mesh, tg.P(None, None))  # all-gather
    total = tf.reduce_sum(x, axis=0) if dtype != tf.bool else tf.reduce_any(x, axis=0)
    return y, z, total  # an all-reduce for the total

  return f


@pytest.mark.parametrize('name', ['complex64', 'uint64', 'int8', 'bool', 'bfloat16'])
def test_partitioned_reshards_of_carried_dtypes_equal_the_unpartitioned_run(name):
  mesh = Mesh.create((8,), ('x',))
  dtype = tf.as_dtype(TABLES[name].dtype)
  x = tf.constant(TABLES[name].reshape(-1, LOCAL[1])[:16])  # [16, 6]: even on 8 devices
  f = _reshard_program(mesh, dtype)
  pf = partition(f, mesh)
  for got, want in zip(pf(x), f(x)):
    got, want = np.asarray(got), np.asarray(want)
    problem = _mismatch(got, want)
    assert problem is None, (name, problem)
  kinds = sorted(r['kind'] for r in pf.collectives())
  # Reduce-any of bool has no partial-result rule: its input is gathered instead.
  total = 'all_gather' if dtype == tf.bool else 'all_reduce'
  assert kinds == sorted(['all_to_all', 'all_gather', total]), [
    (r['kind'], r['op'], r['shape'], r['dtype']) for r in pf.collectives()
  ]
  assert all(r['dtype'] == dtype for r in pf.collectives()), pf.collectives()
