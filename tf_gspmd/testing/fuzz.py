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

  python -m tf_gspmd.testing.fuzz --programs N --seed S [--xla-every K] [--out DIR]
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import math
import os
import sys
import time
import warnings
from typing import Callable, Iterable, List, Optional, Sequence

import numpy as np

from tf_gspmd.testing.fuzz_ops import FAMILIES, Op
from tf_gspmd.testing.fuzz_program import (
  HEADER,
  MESHES,
  Input,
  Program,
  fused_batch_norm,
  generate,
  is_valid,
  load,
  render,
  tidy,
  xla_lowers,
)

# What tests and printed cases use (`fuzz.fused_batch_norm` is in every rendered program
# with a batch norm): the program's own API is in `fuzz_program`.
__all__ = [
  'FAMILIES',
  'MESHES',
  'Outcome',
  'Program',
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


def compare(build, got, want, backend: str = 'tf') -> Optional[str]:
  """None when `got` is `want` by the oracle; '' when it passes only by the float64 rule
  (float32 itself ill-conditioned); else why it fails."""
  from tf_gspmd.testing.oracle import assert_close

  try:
    assert_close(got, want, 'result')
    return None
  except AssertionError as error:
    first = str(error)
  why = by_witnesses(got, want, reference(build, np.float64), _witnesses(build))
  return '' if not why else f'{first}\n{why}'


NUDGED_WITNESSES = 4


def _witnesses(build):
  """More float32 runs of the unpartitioned program, each as correct as TF's, made one at a
  time: XLA sums in other orders (and its training BatchNorm takes the variance as E[x^2] -
  E[x]^2), and the same program on inputs rounded to float32 another way (`_nudged`)."""
  yield _xla_witness(build)
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
  moved by at most one unit in the last place (up, down or not, at random by `k`)."""
  rng = np.random.RandomState(k)
  _, make, args = build(np.float32)
  fn, variables = make()
  for v in variables:
    if v.dtype.is_floating:
      v.assign(_nudge(v.numpy(), rng))
  args = [_nudge(a, rng) if np.asarray(a).dtype.kind == 'f' else a for a in args]
  return _calls(fn, args), [v.numpy() for v in variables]


def _nudge(value, rng) -> np.ndarray:
  value = np.asarray(value)
  step = rng.randint(-1, 2, size=value.shape)
  up, down = np.nextafter(value, np.inf), np.nextafter(value, -np.inf)
  return np.where(step > 0, up, np.where(step < 0, down, value)).astype(value.dtype)


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
  build, backend: str = 'tf', timeout: float = 60.0, repeats: int = 0, rebuild: bool = False
) -> Outcome:
  """Run `build`'s program partitioned and not (twice each) and say how it went; `repeats`
  and `rebuild`: the determinism check (see `REPEATS`)."""

  def split():
    got = partitioned(build, backend, timeout, repeats)
    if rebuild:
      _require_same_run(got, partitioned(build, backend, timeout))
    return got

  return outcome_of(
    lambda: reference(build), split, lambda got, want: compare(build, got, want, backend)
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
  return judge(load(render(program)), backend, timeout, repeats, rebuild)


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
def shrink(
  program: Program,
  fails: Callable[[Program], bool],
  budget: int = 150,
  log: Callable[[str], None] = lambda _: None,
  seconds: float = math.inf,
  smaller: Optional[Callable] = None,
  valid: Optional[Callable] = None,
) -> Program:
  """The smallest program found (greedily) that still `fails`: each accepted change restarts
  the candidate list; at most `budget` candidates are run, for at most `seconds`.
  `smaller` and `valid` replace `candidates` and `is_valid` (the Keras fuzzer's cases)."""
  smaller, valid = smaller or candidates, valid or is_valid
  best, tried = program, 0
  deadline = time.time() + seconds
  progress = True
  while progress and tried < budget:
    progress = False
    for candidate in smaller(best):
      if tried >= budget or time.time() > deadline:
        break
      if candidate == best or not valid(candidate):
        continue
      tried += 1
      if fails(candidate):
        best, progress = candidate, True
        log(f'  shrunk to {best.label()}')
        break
  return best


def candidates(p: Program):
  """Smaller programs, the biggest cuts first."""
  for op in reversed(p.ops):
    yield tidy(_without(p, op.name))
  for op in reversed(p.ops):
    for source in op.inputs:
      yield tidy(_bypass(p, op, source))
  if p.grad:
    yield dataclasses.replace(p, grad=False)
  if p.assign:
    yield dataclasses.replace(p, assign='')
  for k, op in enumerate(p.ops):
    if op.spec is not None:
      yield _replace_op(p, k, dataclasses.replace(op, spec=None))
  for k, i in enumerate(p.inputs):
    if i.spec is not None:
      yield _replace_input(p, k, dataclasses.replace(i, spec=None))
  if p.devices != tuple(range(8)):
    yield dataclasses.replace(p, devices=tuple(range(8)))
  for k, i in enumerate(p.inputs):
    for d, size in enumerate(i.shape):
      for smaller in sorted({1, size // 2, size - 1} - {0, size}):
        shape = i.shape[:d] + (smaller,) + i.shape[d + 1 :]
        yield _replace_input(p, k, dataclasses.replace(i, shape=shape))


def _without(p: Program, name: str) -> Program:
  """`name`'s op and every op reading it, directly or not."""
  gone = {name}
  ops = []
  for op in p.ops:
    if op.name in gone or gone.intersection(op.inputs):
      gone.add(op.name)
    else:
      ops.append(op)
  return dataclasses.replace(p, ops=tuple(ops))


def _bypass(p: Program, op: Op, source: str) -> Program:
  """`op` removed, its readers reading `source` instead (valid when the shapes agree)."""
  ops = tuple(
    dataclasses.replace(o, inputs=tuple(source if n == op.name else n for n in o.inputs))
    for o in p.ops
    if o is not op
  )
  return dataclasses.replace(p, ops=ops)


def _replace_op(p: Program, k: int, op: Op) -> Program:
  return dataclasses.replace(p, ops=p.ops[:k] + (op,) + p.ops[k + 1 :])


def _replace_input(p: Program, k: int, i: Input) -> Program:
  return dataclasses.replace(p, inputs=p.inputs[:k] + (i,) + p.inputs[k + 1 :])


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
) -> Tally:
  """Run programs start..start+programs-1 of `seed`; shrink and write each failure."""
  tally = Tally()
  began = time.time()
  for index in range(start, start + programs):
    program = generate(seed, index, max_ops)
    sampled = xla_every and index % xla_every == 0 and xla_lowers(program)
    backends = ['tf'] + (['xla'] if sampled else [])
    for i, backend in enumerate(backends):
      outcome = run(program, backend, rebuild=index % REBUILD_EVERY == 0)
      tally.xla_runs += i > 0  # the sampled second run is XLA's
      _record(tally, program, backend, outcome, echo)
      if outcome.poisoned:
        echo(f'POISONED: a collective failed; resume with --start {index + 1}')
        return tally
      if outcome.status in FAILURES and shrink_budget:
        _shrink_and_write(program, outcome, backend, out, (shrink_budget, shrink_seconds), echo)
    tally.programs += 1
  echo(tally.line(time.time() - began))
  for reason, n in tally.refusals.most_common():
    echo(f'  refusal x{n}: {reason}')
  return tally


def _record(tally, program, backend, outcome, echo):
  tally.counts[outcome.status] += 1
  tally.counts['float64'] += outcome.float64
  if outcome.status == 'refusal':
    tally.refusals[outcome.message[:160]] += 1
  if outcome.status in FAILURES:
    tally.failures.append(f'{program.label()} {backend}: {outcome.message[:300]}')
  note = ' (float64 rule)' if outcome.float64 else ''
  detail = '' if outcome.status == 'pass' else ' ' + ' '.join(outcome.message.split())[:200]
  echo(f'{program.label()} {backend}: {outcome.status}{note} {outcome.seconds:.2f}s{detail}')


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


def _shrink_and_write(program, outcome, backend, out, limits, echo):
  """`limits`: (candidates, seconds) the shrinker may spend."""
  small = shrunk(program, outcome, backend, limits[0], limits[1], echo)
  name = f'test_fuzz_case_{program.seed}_{program.index}_{backend}.py'
  write_case(test_case(small, outcome, backend), out, name, echo)


def write_case(text: str, out: str, name: str, echo) -> None:
  """Echo a shrunk case's test module, and write it to `out`/`name` when `out` is given."""
  echo(text)
  if out:
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, name)
    with open(path, 'w') as f:
      f.write(text)
    echo(f'wrote {path}')


def _freeze_imports() -> None:
  """Put what the imports made (~350k objects of TF and tf_gspmd, alive for the whole run) out
  of the garbage collector's reach: every full collection walked them again."""
  import gc

  import tf_gspmd.partitioned  # noqa: F401  (imported here so that it is frozen too)

  gc.collect()
  gc.freeze()


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
  args = parser.parse_args(argv)
  warnings.filterwarnings('ignore', message='tf_gspmd propagation: no sharding rule')
  from tf_gspmd.testing.op_sweep import configure_devices

  configure_devices(8)
  _freeze_imports()
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
  )
  return 1 if any(tally.counts[s] for s in FAILURES) else 0


if __name__ == '__main__':
  os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
  sys.exit(main())
