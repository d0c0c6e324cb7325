"""Differential fuzzing of whole programs: random annotated TF programs, partitioned vs not.

The op sweep runs each op alone; bugs live in compositions (a reshard between two ops, a
pending sum crossing a cond, a halo after an uneven slice). `generate(seed, index)` (from
`fuzz_program`, which holds a program as data, draws and prints it) draws a
`Program` of 3 to 30 ops from the families of `fuzz_ops` (elementwise with broadcasting,
matmul/einsum, reductions, reshape/transpose, strided slices, pads, concat, gather, conv and
pools, softmax, batch norm, cond, while), over random shapes (uneven, dims smaller than their
shard count), with random annotations on inputs, intermediates and variables over a 1-D, 2-D
or 3-D mesh of 8 devices (sometimes in another device order); sometimes the gradient of a
scalar loss w.r.t. its inputs and variables, sometimes a variable assign_add.

A program is data: `render` prints it as Python (a `build(dtype)` function), and that text
is what runs (`run`), so a printed case reproduces exactly. `run` calls the program twice
partitioned and twice unpartitioned and compares every output and variable with the oracle;
where float32 itself is ill-conditioned the float64 rule decides (`assert_close_to_float64`,
the same program built in float64). tf_gspmd's own refusal (`tf_gspmd.errors.Unsupported`,
naming what it refuses) is a refusal; any other exception is a crash.

`shrink` reduces a failing program (delete ops, bypass ops, drop annotations, the gradient,
the assign, the mesh's device order, shrink input dims) while it fails the same way, and
`test_case` prints it as a pytest test. CLI:

  python -m tf_gspmd.testing.fuzz --programs N --seed S [--start I] [--xla-every K] [--out DIR]
      [--jobs J]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import math
import os
import sys
import time
import warnings
from typing import Callable, Iterable, List, Optional, Sequence

import numpy as np

from tf_gspmd.testing import fuzz_pool
from tf_gspmd.testing.fuzz_ops import FAMILIES
from tf_gspmd.testing.fuzz_program import (
  HEADER,
  MESHES,
  Program,
  fused_batch_norm,
  generate,
  is_valid,
  load,
  render,
  xla_lowers,
)
from tf_gspmd.testing.fuzz_shrink import candidates, shrink

# What tests and printed cases use (`fuzz.fused_batch_norm` is in every rendered program
# with a batch norm): the program's own API is in `fuzz_program`.
__all__ = [
  'FAMILIES',
  'MESHES',
  'Outcome',
  'Program',
  'candidates',
  'check',
  'classify',
  'failing_like',
  'fused_batch_norm',
  'generate',
  'is_valid',
  'render',
  'run',
  'shrink',
  'shrunk',
  'test_case',
]


# --- running and judging one program ---------------------------------------------------------
CALLS = 2  # state (a variable's assign_add) shows on the second call
# The determinism check: a program without state is called this many more times partitioned
# (a call after the first costs milliseconds), and every `REBUILD_EVERY`-th program is
# partitioned a second time from scratch; each result must be bitwise the first one.
REPEATS = 3
REBUILD_EVERY = 10


@dataclasses.dataclass
class Outcome:
  """status: 'pass', 'mismatch', 'crash', 'refusal' (tf_gspmd's `Unsupported`, naming what it
  refuses), 'invalid' (the unpartitioned program failed: a fuzzer bug)."""

  status: str  # also 'nondeterministic': one partitioned program gave two different bit patterns
  message: str = ''
  error_type: str = ''
  seconds: float = 0.0
  poisoned: bool = False  # a collective failed: later collectives in this process fail too
  float64: bool = False  # passed by the float64 rule, not the float32 bound

  def same_failure(self, other: 'Outcome') -> bool:
    return self.status == other.status and self.error_type == other.error_type


def _calls(fn, args, calls: int = CALLS) -> List[List[np.ndarray]]:
  return [[np.asarray(t) for t in fn(*args)] for _ in range(calls)]


def reference(build, dtype=np.float32, jit: bool = False):
  """Outputs of every call and the variables after them, unpartitioned (compiled by XLA
  on one device with `jit`)."""
  import tensorflow as tf

  _, make, args = build(dtype)
  fn, variables = make()
  if jit:
    fn = tf.function(fn.python_function, jit_compile=True, autograph=False)
  calls = _calls(fn, args)
  return calls, [v.numpy() for v in variables]


def partitioned(build, backend: str = 'tf', timeout: float = 60.0, repeats: int = 0):
  """Outputs of every call and the variables after them, partitioned; with `repeats` (for a
  program without state) that many more calls, whose outputs must be bitwise the first's
  (else `Nondeterministic`)."""
  from tf_gspmd.partitioned import partition

  mesh, make, args = build(np.float32)
  fn, variables = make()
  pf = partition(fn, mesh, backend=backend, timeout=timeout, progress=False)
  calls = _calls(pf, args)
  for k, again in enumerate(_calls(pf, args, repeats)):
    _require_identical(calls[0], again, f'call {CALLS + k + 1} of the same partitioned program')
  return calls, [v.numpy() for v in variables]


class Nondeterministic(AssertionError):
  """The same partitioned program, given the same inputs, gave other bits."""


def _require_identical(first, again, what: str) -> None:
  for j, (a, b) in enumerate(zip(first, again)):
    if a.shape != b.shape or a.tobytes() != b.tobytes():
      with np.errstate(all='ignore'):
        diff = np.max(np.abs(a.astype(np.float64) - b.astype(np.float64))) if a.size else 0.0
      raise Nondeterministic(
        f"{what}: output {j} {a.dtype}{list(a.shape)} is not bitwise the first call's "
        f'(largest difference {diff:.3g})'
      )


def _require_same_run(first, again) -> None:
  """Two runs (outputs of every call, variables after) bitwise equal."""
  for c, (a, b) in enumerate(zip(first[0], again[0])):
    _require_identical(a, b, f'a second build of the program, call {c + 1}')
  _require_identical(first[1], again[1], 'a second build of the program, the variables after')


def compare(build, got, want, backend: str = 'tf', twins: Sequence = ()) -> Optional[str]:
  """None when `got` is `want` by the oracle; '' when it passes only by the float64 rule
  (float32 itself ill-conditioned); else why it fails. `twins`: builds of the same program
  written otherwise (its nested functions inlined), whose XLA runs are witnesses too."""
  from tf_gspmd.testing.oracle import assert_close

  try:
    assert_close(got, want, 'result')
    return None
  except AssertionError as error:
    first = str(error)
  why = by_witnesses(got, want, reference(build, np.float64), _witnesses(build, twins))
  return '' if not why else f'{first}\n{why}'


# Witnesses on inputs rounded another way, made only while the float64 rule still fails:
# groups of `NUDGED_PER_SIZE`, the inputs moved by at most 1, 2, 4, then 8 units in the last
# place (`nudge_ulps`). Why inputs moved is a fair witness: a float32 program's own rounding
# is, by backward error analysis, the exact computation on inputs moved by about its depth
# (the roundings on the way to an output) units of rounding; a program of a dozen ops whose
# result cancels (two batch norms' scale gradient, 777123:512) lands where inputs moved by a
# few units take it, with summation orders other than TF's unpartitioned one (a channel
# split's narrower kernels). A wrong partitioned program (a partial sum counted twice, a block
# missing) is off by the size of the terms themselves: no witness comes near it.
NUDGED_PER_SIZE = 4
NUDGED_SIZES = (1, 2, 4, 8)
NUDGED_WITNESSES = NUDGED_PER_SIZE * len(NUDGED_SIZES)


def nudge_ulps(k: int) -> int:
  """How many units in the last place nudged witness `k` may move each input."""
  return NUDGED_SIZES[min(k // NUDGED_PER_SIZE, len(NUDGED_SIZES) - 1)]


def _witnesses(build, twins: Sequence = ()):
  """More float32 runs of the unpartitioned program, each as correct as TF's, made one at a
  time: XLA sums in other orders (and its training BatchNorm takes the variance as E[x^2] -
  E[x]^2), also on `twins` (XLA lowers a BatchNorm's gradient differently across a function
  boundary than inlined: 883:2's offset gradient 5.6e-6 from float64 one way, 7.3e-5 the
  other, and the partitioned program, whose capture inlines the calls, is the second), and
  the same program on inputs rounded to float32 other ways (`_nudged`)."""
  yield _xla_witness(build)
  for twin in twins:
    yield _xla_witness(twin)
  for k in range(NUDGED_WITNESSES):
    yield _nudged(build, k)


def by_witnesses(got, want, exact, witnesses: Iterable) -> str:
  """The float64 rule ('' when it passes, else why not), `got` measured tensor by tensor
  against whichever float32 witness is furthest from `exact`: `want`, then as many of
  `witnesses` (a lazy iterable of runs like `want`, None for one that could not run) as it
  takes to pass. Where the exact result is 0 or nearly (a gradient a later BatchNorm or
  softmax cancels: what float32 gives there is a few units of the rounding of the terms that
  cancel), one float32 run may land 1 such unit off and another 3; every witness is a correct
  run, so more of them only measure that rounding better. A wrong partitioned program (a
  partial sum counted twice, a block missing) is off by the size of the terms themselves."""
  why = _further_from_float64(got, want, exact)
  for more in witnesses:
    if not why:
      break
    if more is not None:
      want = _further(want, more, exact)
      why = _further_from_float64(got, want, exact)
  return why


def _nudged(build, k: int):
  """The unpartitioned program's outputs and variables, every floating input and variable
  moved by at most `nudge_ulps(k)` units in the last place (up, down or not, at random by
  `k`)."""
  rng = np.random.RandomState(k)
  ulps = nudge_ulps(k)
  _, make, args = build(np.float32)
  fn, variables = make()
  for v in variables:
    if v.dtype.is_floating:
      v.assign(_nudge(v.numpy(), rng, ulps))
  args = [_nudge(a, rng, ulps) if np.asarray(a).dtype.kind == 'f' else a for a in args]
  return _calls(fn, args), [v.numpy() for v in variables]


def _nudge(value, rng, ulps: int = 1) -> np.ndarray:
  """`value` with each element moved by a random whole number of units in the last place,
  at most `ulps` up or down."""
  value = np.asarray(value)
  steps = rng.randint(-ulps, ulps + 1, size=value.shape)
  out = value.copy()
  for k in range(1, ulps + 1):
    out = np.where(steps >= k, np.nextafter(out, np.inf), out)
    out = np.where(steps <= -k, np.nextafter(out, -np.inf), out)
  return out.astype(value.dtype)


def _xla_witness(build):
  try:
    return reference(build, np.float32, jit=True)
  except Exception:  # noqa: BLE001  (an op XLA cannot compile: no witness)
    return None


def _further(a, b, exact):
  """Leaf by leaf, whichever of `a` and `b` is further from `exact`."""
  if isinstance(a, dict):
    return {k: _further(a[k], b[k], exact[k]) for k in a}
  if isinstance(a, (list, tuple)):
    return [_further(x, y, e) for x, y, e in zip(a, b, exact)]
  from tf_gspmd.testing.oracle import relative_error

  if np.asarray(a).dtype.kind not in 'fc':
    return a
  return b if relative_error(b, exact) > relative_error(a, exact) else a


def _further_from_float64(got, want, exact) -> str:
  from tf_gspmd.testing.oracle import assert_close_to_float64

  try:
    assert_close_to_float64(got, want, exact, 'result')
    return ''
  except AssertionError as error:
    return str(error)


def judge(
  build,
  backend: str = 'tf',
  timeout: float = 60.0,
  repeats: int = 0,
  rebuild: bool = False,
  twins: Sequence = (),
) -> Outcome:
  """Run `build`'s program partitioned and not (twice each) and say how it went; `repeats`
  and `rebuild`: the determinism check (see `REPEATS`); `twins`: see `compare`."""

  def split():
    got = partitioned(build, backend, timeout, repeats)
    if rebuild:
      _require_same_run(got, partitioned(build, backend, timeout))
    return got

  return outcome_of(
    lambda: reference(build), split, lambda got, want: compare(build, got, want, backend, twins)
  )


def outcome_of(plain: Callable, split: Callable, judged: Callable) -> Outcome:
  """How a case went: `plain()` failing is 'invalid', `split()` (the partitioned run)
  failing a refusal or a crash (or `Nondeterministic`), else `judged(got, want)` (None, ''
  for the float64 rule, or why they differ) decides. The Keras fuzzer's runs go through here
  too."""
  start = time.time()
  try:
    want = plain()
  except Exception as error:  # noqa: BLE001
    return Outcome('invalid', _error_text(error), type(error).__name__, time.time() - start)
  try:
    got = split()
  except Nondeterministic as error:
    return Outcome('nondeterministic', str(error), type(error).__name__, time.time() - start)
  except Exception as error:  # noqa: BLE001
    return Outcome(
      classify(error),
      _error_text(error),
      type(error).__name__,
      time.time() - start,
      poisoned=_is_poison(error),
    )
  why = judged(got, want)
  status = 'pass' if why is None or why == '' else 'mismatch'
  return Outcome(status, why or '', '', time.time() - start, float64=why == '')


def run(
  program: Program, backend: str = 'tf', timeout: float = 60.0, rebuild: bool = False
) -> Outcome:
  repeats = 0 if program.assign else REPEATS
  twins = (load(render(program, inline=True)),) if program.nested else ()
  return judge(load(render(program)), backend, timeout, repeats, rebuild, twins)


def check(build, backend: str = 'tf') -> None:
  """For tests: raise unless `build`'s program partitions to the unpartitioned result."""
  got = partitioned(build, backend)
  why = compare(build, got, reference(build), backend)
  if why:
    raise AssertionError(why)


def classify(error: BaseException) -> str:
  """'refusal' for tf_gspmd's own refusal (`tf_gspmd.errors.Unsupported`, naming what it
  cannot partition), else 'crash': any other error, a plain ValueError from inside tf_gspmd
  too (a broken invariant reads as one), or XLA failing to compile the partitioned program."""
  from tf_gspmd.errors import Unsupported

  if isinstance(error, Unsupported) and 'This is a bug' not in str(error):
    return 'refusal'
  return 'crash'


def _error_text(error: BaseException, limit: int = 600) -> str:
  """The error itself: its last paragraph, without TF's 'in user code' traceback."""
  paragraphs = [p for p in str(error).split('\n\n') if p.strip()] or ['']
  text = ' '.join(paragraphs[-1].split())
  return f'{type(error).__name__}: {text[:limit]}'


def _is_poison(error: BaseException) -> bool:
  text = str(error)
  return (
    type(error).__name__ == 'CollectiveError'
    or 'Collective ops is aborted' in text
    or 'timed out' in text.lower()
  )


# --- shrinking -------------------------------------------------------------------------------
def failing_like(outcome: Outcome, backend: str, timeout: float = 60.0):
  """The shrinker's test: a candidate fails as `outcome` did (status and exception type)."""

  def fails(candidate: Program) -> bool:
    return run(candidate, backend, timeout).same_failure(outcome)

  return fails


def test_case(program: Program, outcome: Outcome, backend: str = 'tf') -> str:
  """A pytest module reproducing `program`'s failure."""
  tag = f'{program.seed}_{program.index}'
  why = '\n'.join(outcome.message.splitlines()[:2]) if outcome.message else outcome.status
  body = render(program, f'build_{tag}')
  return (
    f'"""Shrunk by tf_gspmd.testing.fuzz (seed {program.seed}, program {program.index}, '
    f'backend \'{backend}\'): {outcome.status}.\n\n{why}\n"""\n'
    + HEADER
    + '\n\n'
    + body
    + f"\n\ndef test_fuzz_{tag}():\n  fuzz.check(build_{tag}, backend='{backend}')\n"
  )


# --- the campaign ----------------------------------------------------------------------------
FAILURES = ('mismatch', 'crash', 'invalid', 'nondeterministic')


@dataclasses.dataclass
class Tally:
  programs: int = 0
  xla_runs: int = 0
  counts: collections.Counter = dataclasses.field(default_factory=collections.Counter)
  refusals: collections.Counter = dataclasses.field(default_factory=collections.Counter)
  failures: List[str] = dataclasses.field(default_factory=list)

  def line(self, seconds: float) -> str:
    c = self.counts
    rate = self.programs / seconds if seconds else 0.0
    return (
      f'programs run {self.programs} (xla {self.xla_runs}), mismatches {c["mismatch"]}, '
      f'crashes {c["crash"]}, nondeterministic {c["nondeterministic"]}, refusals '
      f'{c["refusal"]}, invalid {c["invalid"]}, float64 rule {c["float64"]}; {seconds:.1f} s '
      f'({rate:.2f} programs/s)'
    )

  def table(self, seconds: float, jobs: int = 1, what: str = 'programs') -> str:
    """The summary of a campaign (or of one chunk of it, `--start`/`--programs`)."""
    c = self.counts
    rows = [(what, self.programs)]
    rows += [('runs on backend xla', self.xla_runs)] if what == 'programs' else []
    rows += [
      ('passed', c['pass']),
      ('  of them by the float64 rule', c['float64']),
      ('refusals', c['refusal']),
    ]
    rows += [(f'  x{n}: {reason[:100]}', '') for reason, n in self.refusals.most_common()]
    rows += [(status, c[status]) for status in FAILURES]
    rows += [
      (f'{what}/s ({jobs} process{"es" * (jobs > 1)})', f'{self.programs / max(seconds, 1e-9):.3f}')
    ]
    return fuzz_pool.summary_table(rows)


def campaign(
  seed: int,
  programs: int,
  start: int = 0,
  xla_every: int = 0,
  out: str = '',
  max_ops: int = 30,
  shrink_budget: int = 150,
  echo=print,
  shrink_seconds: float = 300,
  jobs: int = 1,
  prepare_here: bool = False,
) -> Tally:
  """Run programs start..start+programs-1 of `seed`; shrink and write each failure (with
  `jobs` > 1 on this process and `jobs` - 1 workers: see `judge_all`; `prepare_here`: this
  process is not configured yet, `judge_all` does it once its workers started)."""
  tally = Tally()
  began = time.time()
  args = (seed, max_ops, xla_every, (shrink_budget, shrink_seconds))
  label_of = lambda index: generate(seed, index, max_ops).label()  # noqa: E731
  indices = range(start, start + programs)
  prepare = _prepare, prepare_here
  if judge_all(indices, judge_program, args, jobs, prepare, label_of, tally, out, echo):
    return tally
  seconds = time.time() - began
  echo(tally.line(seconds))
  for reason, n in tally.refusals.most_common():
    echo(f'  refusal x{n}: {reason}')
  echo(tally.table(seconds, jobs))
  return tally


def judge_all(indices, judge, args, jobs, prepare, label_of, tally, out, echo) -> bool:
  """`judge(index, *args, emit)` for each index, its events (`replay`) counted in `tally`
  and echoed, in index order. With `jobs` > 1 on this process and `jobs` - 1 workers
  (`fuzz_pool`, each `prepare`d once), printing and counting the same lines in the same
  order. `prepare` is (the function, whether this process needs it too): this process runs it
  after its workers started (forked before TF's runtime starts here: see
  `fuzz_pool.start_method`). A worker
  whose collectives failed is replaced, and one that died is a crash of its program, where
  a single process stops at a failed collective (its later ones would fail too) and says
  where to resume: True then."""
  jobs = min(jobs, len(indices))  # no worker without a program
  prepare, prepare_here = prepare
  if jobs > 1:
    with fuzz_pool.Workers(jobs, judged_in_worker, (judge,) + args, prepare, _died(label_of)) as w:
      if prepare_here:
        prepare()
      for _, events in w.results(indices):
        for event in events:
          replay(event, tally, out, echo)
        tally.programs += 1
    return False
  if prepare_here:
    prepare()
  for index in indices:
    poisoned = judge(index, *args, lambda event: replay(event, tally, out, echo))
    tally.programs += 1
    if poisoned:
      echo(f'POISONED: a collective failed; resume with --start {index + 1}')
      return True
    fuzz_pool.collect()
  return False


def judge_program(index, seed, max_ops, xla_every, limits, emit) -> bool:
  """Run program `index` of `seed` (and on backend='xla' where sampled), shrinking each
  failure within `limits` (candidates, seconds); what happens goes to `emit` as events
  (`replay` reads them). True when a collective failed (the process is poisoned)."""
  program = generate(seed, index, max_ops)
  sampled = xla_every and index % xla_every == 0 and xla_lowers(program)
  backends = ['tf'] + (['xla'] if sampled else [])
  for i, backend in enumerate(backends):
    outcome = run(program, backend, rebuild=index % REBUILD_EVERY == 0)
    emit(('record', program.label(), backend, outcome, i > 0))  # the sampled 2nd run is XLA's
    if outcome.poisoned:
      return True
    if outcome.status in FAILURES and limits[0]:
      small = shrunk(program, outcome, backend, limits[0], limits[1], lambda s: emit(('log', s)))
      name = f'test_fuzz_case_{program.seed}_{program.index}_{backend}.py'
      emit(('case', name, test_case(small, outcome, backend)))
  return False


def replay(event, tally, out, echo) -> None:
  """What a campaign does with an event of `judge_program` (or of the Keras fuzzer's):
  ('record', label, backend, Outcome, whether an XLA run), ('log', line) or ('case', file
  name, test module)."""
  if event[0] == 'record':
    _, label, backend, outcome, xla = event
    tally.xla_runs += xla
    _record(tally, label, backend, outcome, echo)
  elif event[0] == 'log':
    echo(event[1])
  else:
    write_case(event[2], out, event[1], echo)


def judged_in_worker(index, judge, *args):
  """`judge(index, *args, emit)` in a worker process: (its events, whether the worker must be
  replaced)."""
  events: list = []
  poisoned = judge(index, *args, events.append)
  fuzz_pool.collect()
  return events, poisoned


def _died(label_of: Callable[[int], str]):
  """The result of a program whose worker process died judging it: a crash."""

  def died(index: int, code: int):
    why = f'WorkerDied: the process judging it died (exit code {code})'
    return [('record', label_of(index), 'tf', Outcome('crash', why, 'WorkerDied'), False)]

  return died


def _record(tally, label: str, backend, outcome, echo):
  tally.counts[outcome.status] += 1
  tally.counts['float64'] += outcome.float64
  if outcome.status == 'refusal':
    tally.refusals[outcome.message[:160]] += 1
  if outcome.status in FAILURES:
    tally.failures.append(f'{label} {backend}: {outcome.message[:300]}')
  note = ' (float64 rule)' if outcome.float64 else ''
  detail = '' if outcome.status == 'pass' else ' ' + ' '.join(outcome.message.split())[:200]
  echo(f'{label} {backend}: {outcome.status}{note} {outcome.seconds:.2f}s{detail}')


def shrunk(
  program: Program,
  outcome: Outcome,
  backend: str = 'tf',
  budget: int = 150,
  seconds: float = math.inf,
  log: Callable[[str], None] = lambda _: None,
) -> Program:
  """`program` shrunk while it fails as `outcome` says; as drawn where the reference itself
  failed (a fuzzer bug) or bits differ from run to run (which a shrinker cannot chase)."""
  if outcome.status in ('invalid', 'nondeterministic'):
    return program
  return shrink(program, failing_like(outcome, backend), budget, log, seconds)


def write_case(text: str, out: str, name: str, echo) -> None:
  """Echo a shrunk case's test module, and write it to `out`/`name` when `out` is given."""
  echo(text)
  if out:
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, name)
    with open(path, 'w') as f:
      f.write(text)
    echo(f'wrote {path}')


_CAMPAIGN = contextlib.ExitStack()  # what a campaign's process keeps entered (`_prepare`)


def _prepare() -> None:
  """A campaign's process, before its first program: 8 devices, the warning every program
  would print off, TF's C++ op building for every trace (the unpartitioned references' too;
  tf_gspmd's own traces use it anyway: `tf_private.fast_graph_building`), the imports frozen
  out of the garbage collector's walks."""
  warnings.filterwarnings('ignore', message='tf_gspmd propagation: no sharding rule')
  from tf_gspmd.testing.op_sweep import configure_devices
  from tf_gspmd.tf_private import fast_graph_building

  configure_devices(8)
  import tf_gspmd.partitioned  # noqa: F401  (imported before the freeze, so that it is frozen too)

  _CAMPAIGN.enter_context(fast_graph_building())  # for the process's life

  fuzz_pool.quiet_collector()


def main(argv: Optional[Sequence[str]] = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--programs', type=int, default=100)
  parser.add_argument('--seed', type=int, default=0)
  parser.add_argument('--start', type=int, default=0, help='first program index (to resume)')
  parser.add_argument('--xla-every', type=int, default=0, help='also backend=xla every K-th')
  parser.add_argument('--out', default='', help='directory for shrunk test cases')
  parser.add_argument('--max-ops', type=int, default=30)
  parser.add_argument('--shrink-budget', type=int, default=150, help='candidates per failure')
  parser.add_argument('--shrink-seconds', type=float, default=300, help='time per failure')
  parser.add_argument('--jobs', type=int, default=1, help='worker processes (one per core)')
  args = parser.parse_args(argv)
  # This process judges too (with --jobs J, J - 1 workers): configured by the campaign once
  # its workers have started (forked before TF's runtime starts here).
  tally = campaign(
    args.seed,
    args.programs,
    args.start,
    args.xla_every,
    args.out,
    args.max_ops,
    args.shrink_budget,
    echo=lambda s: print(s, flush=True),
    shrink_seconds=args.shrink_seconds,
    jobs=args.jobs,
    prepare_here=True,
  )
  return 1 if any(tally.counts[s] for s in FAILURES) else 0


if __name__ == '__main__':
  os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
  # The module's own copy (not __main__'s): what worker processes unpickle is its functions.
  from tf_gspmd.testing import fuzz

  sys.exit(fuzz.main())
