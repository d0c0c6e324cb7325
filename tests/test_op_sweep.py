"""The op sweep (tf_gspmd.testing.op_sweep): every registered op type, partitioned and compared.

The CI sample runs every op type on a 1-D mesh of 4 and on a 2-D mesh of 2x4
(with different programs of the op type where it has several; first every
operand split on dim 0 by all mesh axes, then seeded picks), and the
shape-carrying ops of `graph_rewrite/shape_ops.py` once more per mesh plus
every program of theirs. Op types with a hand-written handler that decides layouts are
left to tests/test_one_definition.py, whose brute force runs every program of theirs twice
per mesh (the same check, and the handler's layouts against the rule).
`bench/op_sweep.py --sample N` runs N per program.
Each case partitions the op with annotated operands, runs it twice on the
logical devices and compares both calls with two calls of the unpartitioned
function by the oracle (`tf_gspmd.testing.oracle`: per result, the normwise
relative error within its dtype's bound; integers exactly), and checks that
a pass-through op with operands sharded alike emits no collectives.

A failure is excused only by a known issue's error signature (exception type
and message regex, on its own programs); every known issue is also a strict
expected-failure test of its example case, so a fixed one fails as XPASS
until it is removed from `op_sweep.KNOWN_ISSUES`.

CI also runs one rotating slice of the full sweep: slice k of SWEEP_SLICES
(every SWEEP_SLICES-th case from k on), k = the commit count of HEAD modulo
SWEEP_SLICES, so consecutive commits cover the whole sweep. The slice is
printed; reproduce it with TF_GSPMD_SWEEP_SLICE=k/K or
`bench/op_sweep.py --slice k/K`.

The full sweep (every sharding of every operand, about 19,000 cases) runs
with one command, `.venv/bin/python bench/op_sweep.py` (worker processes,
the op x result table; exit status 0 when every failure is a known one), or
as a test with TF_GSPMD_FULL_SWEEP=1 (marked `sweep`; deselected without it, not skipped).
"""

import os
import re

import ml_dtypes
import numpy as np
import pytest
import tensorflow as tf

from tf_gspmd.graph_rewrite import shape_ops
from tf_gspmd.propagation import registry
from tf_gspmd.sharding import P
from tf_gspmd.testing import op_builders, op_sweep, oracle

from helpers import agreement_specs  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# About 400 of the ~19,000 cases per slice: some 4 minutes on 2 cores.
SWEEP_SLICES = 48
# Op types with hand-written handlers in shape_ops.py get more cases in the sample.
SHAPE_OPS = (
  'Slice',
  'StridedSlice',
  'StridedSliceGrad',
  'Pad',
  'PadV2',
  'MirrorPad',
  'Range',
  'LinSpace',
  'UnsortedSegmentSum',
  'UnsortedSegmentMax',
  'UnsortedSegmentMin',
  'UnsortedSegmentProd',
  'Gather',
  'VariableShape',
)


@pytest.fixture(scope='module')
def sweep():
  previous = op_sweep.fast_first_runs()
  yield op_sweep.Sweep(timeout=60)
  op_sweep.restore_optimizer(previous)


# --- the harness itself ------------------------------------------------------------------
def test_every_registered_op_type_has_a_program():
  swept = set(op_builders.specs_by_op_type())
  registered = set(registry.op_types())
  assert registered - swept == set(op_builders.UNSWEPT)
  assert not set(op_builders.UNSWEPT) & swept


def test_all_specs_enumerates_axes_per_dim_in_every_order():
  one = op_sweep.mesh_named('1d')
  two = op_sweep.mesh_named('2d')
  assert op_sweep.all_specs(one, 2)[0] == P(None, None)
  assert set(op_sweep.all_specs(one, 2)) == {P(None, None), P(None, 'x'), P('x', None)}
  specs = op_sweep.all_specs(two, 2)
  assert len(specs) == len(set(specs)) == 11
  assert specs[0] == P(None, None)
  assert {P(('a', 'b'), None), P(('b', 'a'), None), P('a', 'b'), P('b', 'a')} <= set(specs)
  assert len(op_sweep.all_specs(two, 3)) == 19
  assert op_sweep.all_specs(two, 0) == [P()]


def test_enumerate_cases_covers_products_within_budget_and_each_operand_beyond():
  spec = {s.name: s for s in op_builders.op_specs()}['AddN']  # three rank-2 operands
  cases = op_sweep.enumerate_cases(spec, '1d', [2], budget=100)
  assert len([c for c in cases if c.out_specs is None]) == 27  # 3 x 3 x 3
  assert len([c for c in cases if c.out_specs is not None]) == 2  # P(x,_), P(_,x) on the output
  cases = op_sweep.enumerate_cases(spec, '2d', [2], budget=40)
  ins = [c.in_specs for c in cases if c.out_specs is None]
  assert len(ins) == len(set(ins)) >= 40
  for i in range(3):  # every sharding of every operand, the others left to propagation
    for s in op_sweep.all_specs(op_sweep.mesh_named('2d'), 2):
      assert tuple(s if k == i else None for k in range(3)) in ins
  assert op_sweep.enumerate_cases(spec, '2d', [2], budget=40) == cases  # deterministic


def test_compare_tolerates_rounding_but_not_errors():
  """The sweep compares through the oracle: normwise per result, not element by element."""
  assert op_sweep.compare is oracle.compare
  rng = np.random.RandomState(0)
  want = rng.randn(16, 8).astype(np.float32)
  want[3, 1] = np.float32(2e-6)
  # Rounding of a sum in another order: every element a few ulps off.
  ok, err, why = op_sweep.compare(want * np.float32(1 + 2**-21), want)
  assert ok and 0 < err < oracle.bound(np.float32) and why == ''
  # One element near zero off by 5x its own size: element-wise rtol would fail; the tensor
  # agrees to 1e-7 and passes.
  near_zero = want.copy()
  near_zero[3, 1] = np.float32(1.2e-5)
  ok, err, _ = op_sweep.compare(near_zero, want)
  assert ok and not np.allclose(near_zero, want, rtol=1e-5, atol=0)
  assert err == pytest.approx(1e-5 / np.linalg.norm(want.astype(np.float64)), rel=1e-3)
  # Relative, not absolute: a small-valued result 1% off fails (the former rule divided by
  # max(1, largest magnitude) and let it through: 1e-2 x 1e-4 < 1e-5).
  small = want * np.float32(1e-4)
  ok, err, why = op_sweep.compare(small * np.float32(1.01), small)
  assert not ok and err == pytest.approx(1e-2, rel=1e-3) and 'bound 1e-05' in why
  # Wrong blocks (a sum missing a shard, two shards swapped) fail by orders of magnitude.
  halved = want.copy()
  halved[8:] *= 0.5
  swapped = np.concatenate([want[8:], want[:8]])
  for wrong in (halved, swapped):
    ok, err, _ = op_sweep.compare(wrong, want)
    assert not ok and err > 1e3 * oracle.bound(np.float32)
  # NaN and inf must match; the norms run over the rest.
  special = np.array([1.0, -300.0, np.nan, np.inf], np.float32)
  assert op_sweep.compare(special + np.float32(1e-3), special)[0]
  assert not op_sweep.compare(np.array([1.0, -300.0, 0.0, np.inf], np.float32), special)[0]
  assert not op_sweep.compare(np.array([1.0, -300.0, np.nan, -np.inf], np.float32), special)[0]
  # Integers and booleans exactly; shapes and dtypes equal.
  assert not op_sweep.compare(np.array([1, 2], np.int32), np.array([1, 3], np.int32))[0]
  assert not op_sweep.compare(np.array([True, False]), np.array([True, True]))[0]
  assert not op_sweep.compare(np.zeros((2, 1), np.float32), np.zeros((2,), np.float32))[0]
  assert not op_sweep.compare(want.astype(np.float64), want)[0]
  # 16-bit floats against their own bound (4 eps): one rounding of a slightly different sum
  # passes, 10% off does not.
  bf16 = want.astype(ml_dtypes.bfloat16)
  assert op_sweep.compare((want * np.float32(1 + 2**-9)).astype(ml_dtypes.bfloat16), bf16)[0]
  assert not op_sweep.compare((want * np.float32(1.1)).astype(ml_dtypes.bfloat16), bf16)[0]
  # An explicit max_error (Sweep(max_error=...)) replaces the dtype's bound.
  assert op_sweep.compare(small * np.float32(1.01), small, max_error=2e-2)[0]


# --- what a slice does to each dim (pure geometry, checked against TensorFlow) -----------------
def _apply_slices(x: np.ndarray, slices):
  index = []
  for e in slices:
    if e.kind == 'new':
      index.append(np.newaxis)
    elif e.kind == 'keep':
      index.append(slice(None))
    elif e.kind == 'index':
      index.append(e.start)
    else:
      index.append(e.rows())
  # One advanced index per dim: apply them one dim at a time.
  out = x
  dim = 0
  for entry in index:
    if entry is np.newaxis:
      out = np.expand_dims(out, dim)
      dim += 1
    elif isinstance(entry, slice):
      dim += 1
    elif isinstance(entry, (int, np.integer)):
      out = np.take(out, entry, axis=dim)
    else:
      out = np.take(out, entry, axis=dim)
      dim += 1
  return out


def test_strided_dim_slices_match_tensorflow():
  rng = np.random.RandomState(0)
  shape = (7, 10, 3)
  x = np.arange(np.prod(shape), dtype=np.int32).reshape(shape)
  checked = 0
  for _ in range(300):
    n_spec = rng.randint(1, 5)
    begin = [int(v) for v in rng.randint(-12, 12, n_spec)]
    end = [int(v) for v in rng.randint(-12, 12, n_spec)]
    strides = [int(v) for v in rng.choice([-3, -2, -1, 1, 2, 3], n_spec)]
    masks = {
      m: int(rng.randint(0, 1 << n_spec))
      for m in ('begin_mask', 'end_mask', 'new_axis_mask', 'shrink_axis_mask')
    }
    masks['ellipsis_mask'] = int(1 << rng.randint(n_spec)) if rng.rand() < 0.3 else 0
    for k in range(n_spec):  # shrunk entries need an index in range and stride 1
      if (masks['shrink_axis_mask'] >> k) & 1:
        strides[k] = 1
    try:
      want = tf.raw_ops.StridedSlice(
        input=x, begin=begin, end=end, strides=strides, **masks
      ).numpy()
    except (tf.errors.InvalidArgumentError, ValueError):
      continue
    slices = shape_ops.strided_dim_slices(shape, begin, end, strides, **masks)
    np.testing.assert_array_equal(
      _apply_slices(x, slices), want, err_msg=f'{begin} {end} {strides} {masks}'
    )
    checked += 1
  assert checked > 100


def test_dim_slices_match_numpy():
  x = np.arange(70).reshape(10, 7)
  slices = shape_ops.dim_slices(x.shape, [1, 0], [8, -1])
  assert [e.kind for e in slices] == ['range', 'keep']
  np.testing.assert_array_equal(_apply_slices(x, slices), x[1:9])


# --- what the shape-op handlers move ---------------------------------------------------------
def _shape_op_specs():
  from tf_gspmd.testing.op_builders import Values, arg, raw, spec

  v = Values('shape_op_collectives')
  x = v.uniform((10, 7))
  return [
    spec('Slice/columns', lambda a: raw('Slice', a, [0, 2], [10, 3]), arg(x)),
    spec('Slice/prefix', lambda a: raw('Slice', a, [0, 0], [9, 7]), arg(x)),
    spec('Pad/tail', lambda a: raw('Pad', a, [[0, 2], [0, 0]]), arg(x)),
    spec('StridedSlice/column', lambda a: a[:, 3], arg(x)),
    spec('StridedSlice/row', lambda a: a[2], arg(x)),
    spec('StridedSlice/few_rows', lambda a: a[1:4], arg(x)),
    spec('StridedSlice/most_rows', lambda a: a[1:9], arg(x)),
    spec('Range/float', lambda s: raw('Range', s, 9.5, 0.5), arg(np.float32(-1.0))),
    spec('OneHot/depth', lambda i: raw('OneHot', i, 7, 1.0, 0.0), arg(v.ints((10,), 0, 7))),
    spec(
      'UnsortedSegmentSum/rows',
      lambda d, i: raw('UnsortedSegmentSum', d, i, 6),
      arg(x),
      arg(v.ints((10,), 0, 6)),
    ),
    spec(
      'Gather/table',
      lambda p, i: raw('Gather', p, i),
      arg(x),
      arg(v.ints((4,), 0, 10), shard=False),
    ),
  ]


ROWS = P('x', None)


@pytest.mark.parametrize(
  'name,in_specs,out_specs,expected',
  [
    ('Slice/columns', (ROWS,), None, {}),  # the sharded dim is taken whole
    ('Slice/prefix', (ROWS,), None, {}),  # 9 of 10 rows: shards keep their size
    ('Pad/tail', (ROWS,), None, {}),  # 2 rows padded at the end: a local mask
    ('StridedSlice/column', (ROWS,), None, {}),
    ('StridedSlice/row', (ROWS,), None, {'all_reduce': 1}),  # one row, not 10
    # A range of a split dim stays split (as in XLA): rows shift from the neighbours.
    ('StridedSlice/few_rows', (ROWS,), None, {'permute': 1}),  # 3 rows: one row moves
    ('StridedSlice/most_rows', (ROWS,), None, {'permute': 1}),  # 8 rows: two rows move
    ('Range/float', (None,), (P('x'),), {}),  # local values from the shard offset
    ('OneHot/depth', (None,), (P(None, 'x'),), {}),  # local depth range
    ('UnsortedSegmentSum/rows', (ROWS, P('x')), None, {'all_reduce': 1}),
    ('Gather/table', (ROWS, None), None, {'all_reduce': 1}),  # the table is not gathered
  ],
)
def test_shape_op_handlers_move_little(name, in_specs, out_specs, expected):
  previous = op_sweep.fast_first_runs()
  try:
    result = op_sweep.Sweep(specs=_shape_op_specs()).run(
      op_sweep.Case(name, '1d', in_specs, out_specs)
    )
  finally:
    op_sweep.restore_optimizer(previous)
  assert result.status == 'pass', result.message
  assert result.how == 'hand-written'
  assert result.collectives == expected


# --- the CI sample -------------------------------------------------------------------------
def _brute_forced() -> set:
  """Op types tests/test_one_definition.py runs every program of, on both meshes, twice each
  (values by the oracle, and the handler's layouts against the rule): the CI sample skips them."""
  return {spec.op_type for spec in agreement_specs()}


def _sample(sweep):
  if not hasattr(_sample, 'cached'):

    def count(op_type, mesh):
      # Each case costs ~0.1 s plus ~0.15 s per collective (first runs): one sharding per
      # op type and mesh keeps the sample near a minute; the shape-op handlers get one more
      # per mesh, and every program of theirs.
      return 1 + (op_type in SHAPE_OPS)

    cases = op_sweep.ci_sample(sweep, count=count, every_program=SHAPE_OPS)
    skipped = _brute_forced()
    _sample.cached = [c for c in cases if sweep.specs[c.spec].op_type not in skipped]
  return _sample.cached


def test_sample_reaches_every_op_type_on_both_meshes(sweep):
  """The CI sample and test_one_definition's brute force together reach every op type on
  both meshes; the brute force takes a quarter of the op types (those with handlers)."""
  cases = _sample(sweep)
  covered = {(sweep.specs[c.spec].op_type, c.mesh) for c in cases}
  brute_forced = _brute_forced()
  assert 50 < len(brute_forced) < len(op_builders.specs_by_op_type()) / 2  # not vacuous
  covered |= {(t, m) for t in brute_forced for m in op_sweep.MESHES}
  wanted = {(t, m) for t in op_builders.specs_by_op_type() for m in op_sweep.MESHES}
  assert wanted - covered == set()


def _failures(results):
  """Failures no known issue's error signature accounts for."""
  return [
    f'{r.label}: {r.status}: {r.message}' for r in results if r.status != 'pass' and not r.known
  ]


@pytest.mark.slow  # minutes: every op type's programs under several shardings
@pytest.mark.parametrize('mesh', list(op_sweep.MESHES))
def test_ci_sample(sweep, mesh, capsys):
  cases = [c for c in _sample(sweep) if c.mesh == mesh]
  results = [sweep.run(c) for c in cases]
  with capsys.disabled():
    print('\n' + op_sweep.format_table(results, [mesh]))
  failed = _failures(results)
  assert not failed, '\n'.join(failed)


# --- known issues: matched by error signature, each a strict expected failure --------------
def _result(spec_name, status, error_type='', message=''):
  spec = {s.name: s for s in op_builders.op_specs()}[spec_name]
  return spec, op_sweep.CaseResult(
    spec.name, spec.op_type, '1d', spec.name, status, message=message, error_type=error_type
  )


def test_known_issue_excuses_only_its_error_signature():
  issue = next(k for k in op_sweep.KNOWN_ISSUES if k.name == 'slot-sharded-unlike-variable')
  program = issue.programs[0]
  signature = (
    'Unsupported: ResourceApplyAdagrad ResourceApplyAdagrad: slot variable accum:0 is '
    "sharded P('x', None) but its variable var:0 is sharded P(None, None); shard "
    'optimizer slots like their variables.'
  )
  assert op_sweep.known_issue(*_result(program, 'error', 'Unsupported', signature)) is issue
  # A wrong value, another exception type, another message, another program: never excused.
  assert (
    op_sweep.known_issue(*_result(program, 'fail', '', 'call 1 output 0: max error 0.5')) is None
  )
  assert op_sweep.known_issue(*_result(program, 'error', 'ValueError', signature)) is None
  assert (
    op_sweep.known_issue(*_result(program, 'error', 'Unsupported', 'Unsupported: other')) is None
  )
  assert op_sweep.known_issue(*_result('Abs', 'error', 'Unsupported', signature)) is None


def test_known_issue_examples_are_their_own_programs():
  for issue in op_sweep.KNOWN_ISSUES:
    spec = {s.name: s for s in op_builders.op_specs()}[issue.example.spec]
    assert spec.name in issue.programs or spec.op_type in issue.programs, issue.name
    assert len(issue.example.in_specs) == len(spec.operands), issue.name
    re.compile(issue.match)


@pytest.mark.parametrize(
  'issue',
  [
    pytest.param(
      k,
      id=k.name,
      marks=pytest.mark.xfail(
        strict=True,
        raises=op_sweep.KnownFailure,
        reason=f'known issue {k.name} ({k.raises}: /{k.match}/); fix in {k.fix_in}',
      ),
    )
    for k in op_sweep.KNOWN_ISSUES
  ],
)
def test_known_issue(sweep, issue):
  """Fails as expected while the issue lasts; XPASS (a failure: strict) once it is fixed,
  and then the issue must be removed from op_sweep.KNOWN_ISSUES."""
  result = sweep.run(issue.example)
  if result.known == issue.name:
    raise op_sweep.KnownFailure(result.message)
  assert result.status == 'pass', (
    f'{issue.example.label()} failed, but not with the signature of {issue.name} '
    f'({issue.raises}: /{issue.match}/): {result.status}: {result.message}'
  )


# --- a rotating slice of the full sweep ---------------------------------------------------
def _slice():
  forced = os.environ.get('TF_GSPMD_SWEEP_SLICE')
  if forced:
    return op_sweep.parse_slice(forced)
  commits = op_sweep.commit_count(ROOT)
  return (commits or 0) % SWEEP_SLICES, SWEEP_SLICES


def test_rotating_slices_partition_the_sweep():
  cases = list(range(103))
  slices = [op_sweep.rotating_slice(cases, k, 10) for k in range(10)]
  assert sorted(c for s in slices for c in s) == cases
  assert {len(s) for s in slices} == {10, 11}
  assert op_sweep.parse_slice('3/10') == (3, 10)
  with pytest.raises(ValueError):
    op_sweep.parse_slice('10/10')


# A campaign tool, not a gate (#40): the slice rotates with the commit count, so a commit could
# meet cases no one had run. It runs with TF_GSPMD_FULL_SWEEP=1 (TF_GSPMD_SWEEP_SLICE=i/n picks
# the slice); what it finds becomes fixed cases.
@pytest.mark.slow
@pytest.mark.sweep
def test_sweep_slice(sweep, capsys):
  index, count = _slice()
  cases = op_sweep.rotating_slice(op_sweep.full_cases(sweep), index, count)
  with capsys.disabled():
    print(
      f'\nop sweep slice {index}/{count}: {len(cases)} cases; reproduce with '
      f'TF_GSPMD_SWEEP_SLICE={index}/{count} or bench/op_sweep.py --slice {index}/{count}'
    )
  results = []
  for case in cases:
    try:
      results.append(sweep.run(case))
    except op_sweep.Poisoned as poisoned:
      pytest.fail(
        f'slice {index}/{count}: a collective failed and poisoned the process: {poisoned}'
      )
  with capsys.disabled():
    print(op_sweep.format_table(results))
  failed = _failures(results)
  assert not failed, f'slice {index}/{count}:\n' + '\n'.join(failed)


# --- the full sweep ---------------------------------------------------------------------
@pytest.mark.sweep  # deselected unless TF_GSPMD_FULL_SWEEP=1 (tests/conftest.py)
def test_full_sweep(tmp_path, capsys):
  """Every program under every sharding (up to the budget), in worker processes.

  Workers restart after a poisoned collective (a known issue can leave one), so this
  runs bench/op_sweep.py rather than cases in this process. Known issues are listed as
  FAIL in the table; any other failure fails the test.
  """
  import subprocess
  import sys

  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  results = tmp_path / 'sweep.jsonl'
  run = subprocess.run(
    [
      sys.executable,
      os.path.join(root, 'bench', 'op_sweep.py'),
      '--jobs',
      '2',
      '--timeout',
      '20',
      '--jsonl',
      str(results),
    ],
    capture_output=True,
    text=True,
    check=False,
  )
  with capsys.disabled():
    print('\n' + run.stdout)
  rows = [op_sweep.CaseResult.from_json(line) for line in results.read_text().splitlines()]
  assert rows, run.stderr[-2000:]
  unknown = _failures(rows)
  assert not unknown, '\n'.join(unknown)
