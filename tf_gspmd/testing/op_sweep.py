"""Brute-force validation: every registered op under every sharding of its operands.

For each program of `op_builders.op_specs()` (at least one per registered op
type) and a mesh (`'1d'`: 4 devices on axis `x`; `'2d'`: 2x4 on axes `a`,
`b`), a *case* annotates the operands with one partition spec each (or
leaves an operand to propagation), optionally asks for sharded outputs with
`out_shardings`, partitions the program with `tf_gspmd.partition`, runs it
on the logical devices and compares it with the unpartitioned tf.function:
float results within a relative error of 1e-5 (scaled by the largest
magnitude, as the end-to-end tests do), everything else exactly, variables
included. Every case runs twice, and so does the reference: state carried
from call to call (a seeded random op's next draw, a variable's update) is
checked on the second call, and a result that TF changes between calls must
change partitioned too (a stateful op frozen into a constant does not). It
also records the collectives each case emitted; a pass-through op whose
operands are all sharded alike, with its output left to propagation, must
emit none.

Float operands enter the program as constants and the others as arguments:
a constant costs nothing to launch, and integer constants would be folded
before the op under test ever ran.

Which cases run (`enumerate_cases`, `full_cases`, `rotating_slice`,
`sample_cases`, `ci_sample`) is `sweep_cases.py`'s; they are re-exported
here. `Sweep.run` runs one case; `format_table` prints the op x result table.

Known issues (`KNOWN_ISSUES`) are failures found in code outside the sweep
and reported to its owners. Each is matched by its error signature (the
exception type and a regex on its message) on its own programs, never by
op type alone: a case that fails another way, a wrong number above all, is
never excused. Each has an example case that tests run as a strict
expected failure, so a fixed issue shows up (and must then be removed).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import re
import time
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf

from tf_gspmd.mesh import Mesh
from tf_gspmd.propagation import registry
from tf_gspmd.sharding import NamedSharding, P
from tf_gspmd.testing.op_builders import UNSWEPT, OpSpec, op_specs
from tf_gspmd.testing.oracle import compare
from tf_gspmd.testing.sweep_cases import DEFAULT_BUDGET as DEFAULT_BUDGET
from tf_gspmd.testing.sweep_cases import MESHES as MESHES
from tf_gspmd.testing.sweep_cases import Case as Case
from tf_gspmd.testing.sweep_cases import all_specs as all_specs
from tf_gspmd.testing.sweep_cases import ci_sample as ci_sample
from tf_gspmd.testing.sweep_cases import commit_count as commit_count
from tf_gspmd.testing.sweep_cases import enumerate_cases as enumerate_cases
from tf_gspmd.testing.sweep_cases import full_cases as full_cases
from tf_gspmd.testing.sweep_cases import mesh_named as mesh_named
from tf_gspmd.testing.sweep_cases import parse_slice as parse_slice
from tf_gspmd.testing.sweep_cases import rotating_slice as rotating_slice
from tf_gspmd.testing.sweep_cases import sample_cases as sample_cases


def configure_devices(n: int = 8) -> None:
  """Split the CPU into `n` logical devices; call before TensorFlow initializes."""
  cpus = tf.config.list_physical_devices('CPU')
  try:
    tf.config.set_logical_device_configuration(
      cpus[0], [tf.config.LogicalDeviceConfiguration()] * n
    )
  except RuntimeError:
    pass  # already initialized; the check below tells whether it is usable
  have = len(tf.config.list_logical_devices('CPU'))
  if have < n:
    raise RuntimeError(
      f'op sweep: needs {n} logical CPU devices, TensorFlow has {have}; call '
      'configure_devices() before anything else touches TensorFlow.'
    )


def fast_first_runs() -> dict:
  """Skip Grappler: each case runs its program once, and graph optimization would
  cost more than the run. Returns the previous options (for `restore_optimizer`)."""
  previous = tf.config.optimizer.get_experimental_options()
  tf.config.optimizer.set_experimental_options({'disable_meta_optimizer': True})
  return previous


def restore_optimizer(previous: dict) -> None:
  tf.config.optimizer.set_experimental_options(
    dict(previous, disable_meta_optimizer=previous.get('disable_meta_optimizer', False))
  )


@dataclasses.dataclass(frozen=True)
class KnownIssue:
  """A failure the sweep found in code outside the sweep, reported to its owner.

  It excuses a failed case only when the case is one of `programs` and
  failed with this error signature: an exception of type `raises` (its class
  name) whose message matches the regex `match`. Wrong values are never
  excused. `example` is a case that shows it, run as a strict expected
  failure by the tests.
  """

  name: str
  programs: Tuple[str, ...]  # program names or op types
  fix_in: str  # file and function that must change
  diagnosis: str
  raises: str  # the exception's class name, e.g. 'ValueError'
  match: str  # regex searched in the error message
  example: 'Case'

  def matches(self, spec, result: 'CaseResult') -> bool:
    return (
      (spec.name in self.programs or spec.op_type in self.programs)
      and result.status == 'error'
      and result.error_type == self.raises
      and re.search(self.match, result.message) is not None
    )


class KnownFailure(Exception):
  """Raised by a known-issue test when its example failed with the issue's signature."""


KNOWN_ISSUES: List[KnownIssue] = []  # filled at the end of this module


def known_issue(spec, result: 'CaseResult') -> Optional[KnownIssue]:
  return next((k for k in KNOWN_ISSUES if k.matches(spec, result)), None)


# --- running one case ----------------------------------------------------------------------
@dataclasses.dataclass
class CaseResult:
  """What one case did. `status`: 'pass', 'fail' (wrong values or unexpected
  collectives) or 'error' (an exception)."""

  spec: str
  op_type: str
  mesh: str
  label: str
  status: str
  max_error: Optional[float] = None
  collectives: Dict[str, int] = dataclasses.field(default_factory=dict)
  expect_no_collectives: bool = False
  how: str = ''
  message: str = ''
  error_type: str = ''
  note: str = ''
  known: str = ''
  seconds: float = 0.0

  @property
  def n_collectives(self) -> int:
    return sum(self.collectives.values())

  def to_json(self) -> str:
    return json.dumps(dataclasses.asdict(self))

  @staticmethod
  def from_json(text: str) -> 'CaseResult':
    return CaseResult(**json.loads(text))


class Poisoned(RuntimeError):
  """A collective failed or timed out: every later collective in this process fails too."""


CALLS = 2  # each case (and its reference) is called this many times


@dataclasses.dataclass
class Reference:
  calls: List[List[np.ndarray]]  # outputs of each call
  variables: List[np.ndarray]  # after the last call

  @property
  def outputs(self) -> List[np.ndarray]:
    return self.calls[0]

  @property
  def out_ranks(self) -> List[int]:
    return [o.ndim for o in self.outputs]


def _fed(operand) -> bool:
  """Non-float operands are arguments: as constants they would be folded away."""
  return not operand.variable and operand.value.dtype.kind not in 'fc'


def _flat(result) -> List[np.ndarray]:
  if result is None:
    return []
  return [np.asarray(t) for t in tf.nest.flatten(result)]


def _program(spec: OpSpec, mesh: Optional[Mesh], in_specs, variables):
  """`spec.fn` as a tf.function whose operands carry `in_specs` annotations."""
  from tf_gspmd.annotations import shard

  def program(*args):
    fed = iter(args)
    xs = []
    for operand, s, v in zip(spec.operands, in_specs, variables):
      if operand.variable:
        xs.append(v)
        continue
      x = next(fed) if _fed(operand) else tf.constant(operand.value)
      xs.append(x if s is None else shard(x, mesh, s))
    return spec.fn(*xs)

  program.__name__ = ''.join(c if c.isalnum() else '_' for c in spec.name)
  return tf.function(program, autograph=False)


def _arguments(spec: OpSpec) -> list:
  return [o.value for o in spec.operands if _fed(o)]


def _error_text(error: BaseException, limit: int = 400) -> str:
  """The error itself, without TF's 'in user code' traceback."""
  text = str(error).strip()
  paragraphs = [p.strip() for p in text.split('\n\n') if p.strip()]
  last = paragraphs[-1] if paragraphs else text
  last = ' '.join(last.split())
  return f'{type(error).__name__}: {last[:limit]}'


def _is_poison(error: BaseException) -> bool:
  text = str(error)
  return (
    type(error).__name__ == 'CollectiveError'
    or 'Collective ops is aborted' in text
    or isinstance(error, tf.errors.DeadlineExceededError)
    or 'timed out' in text.lower()
  )


class Sweep:
  """Runs cases; caches each program's unpartitioned reference result."""

  def __init__(
    self,
    specs: Optional[Sequence[OpSpec]] = None,
    timeout: float = 60.0,
    max_error: Optional[float] = None,
  ):
    self.specs = {s.name: s for s in (specs if specs is not None else op_specs())}
    self.timeout = timeout
    self.max_error = max_error  # None: the oracle's bound for each result's dtype
    self._references: Dict[str, Reference] = {}

  def reference(self, name: str) -> Reference:
    if name not in self._references:
      spec = self.specs[name]
      variables = [tf.Variable(o.value) if o.variable else None for o in spec.operands]
      program = _program(spec, None, [None] * len(spec.operands), variables)
      calls = [_flat(program(*_arguments(spec))) for _ in range(CALLS)]
      self._references[name] = Reference(calls, [v.numpy() for v in variables if v is not None])
    return self._references[name]

  def cases(self, name: str, mesh_name: str, budget: Optional[int] = DEFAULT_BUDGET) -> List[Case]:
    return enumerate_cases(self.specs[name], mesh_name, self.reference(name).out_ranks, budget)

  def sample(self, name: str, mesh_name: str, count: int = 2) -> List[Case]:
    return sample_cases(self.specs[name], mesh_name, self.reference(name).out_ranks, count)

  def run(self, case: Case) -> CaseResult:
    """Partition, run and check one case. Raises `Poisoned` after a failed collective."""
    from tf_gspmd.annotations import shard_variable
    from tf_gspmd.partitioned import partition

    spec = self.specs[case.spec]
    mesh = mesh_named(case.mesh)
    result = CaseResult(spec.name, spec.op_type, case.mesh, case.label(), 'pass')
    start = time.time()
    try:
      ref = self.reference(spec.name)
      variables = []
      for operand, s in zip(spec.operands, case.in_specs):
        v = tf.Variable(operand.value) if operand.variable else None
        if v is not None and s is not None:
          shard_variable(v, mesh, s)
        variables.append(v)
      program = _program(
        spec,
        mesh,
        [None if o.variable else s for o, s in zip(spec.operands, case.in_specs)],
        variables,
      )
      out_shardings = (
        None
        if case.out_specs is None
        else [None if s is None else NamedSharding(mesh, s) for s in case.out_specs]
      )
      pf = partition(program, mesh, out_shardings=out_shardings, timeout=self.timeout)
      args = _arguments(spec)
      calls = [_flat(pf(*args)) for _ in range(CALLS)]
      self._check(result, case, spec, pf, args, calls, ref, variables)
    except Exception as error:  # noqa: BLE001
      result.status = 'error'
      result.error_type = type(error).__name__
      result.message = _error_text(error)
      if _is_poison(error):
        self._finish(result, spec, case, start)
        raise Poisoned(result.to_json()) from error
    self._finish(result, spec, case, start)
    return result

  @staticmethod
  def _finish(result, spec, case, start):
    result.seconds = round(time.time() - start, 3)
    issue = known_issue(spec, result)
    if issue is not None:
      result.known = issue.name

  def _check(self, result, case, spec, pf, args, calls, ref, variables):
    records = pf.op_records()
    hows = sorted({r.how for r in records if r.op == spec.op_type})
    program = pf.get_program(*args).program
    nodes = [(g, n) for g in program.graphs() for n in g.nodes if n.op == spec.op_type]
    if not nodes:
      raise AssertionError(f'the program holds no {spec.op_type} op: fix its builder')
    result.how = ','.join(hows) if hows else 'not partitioned'
    result.collectives = dict(collections.Counter(c['kind'] for c in pf.collectives()))
    errors = []
    worst = 0.0
    for c, (got, want) in enumerate(zip(calls, ref.calls)):
      if len(got) != len(want):
        errors.append(f'call {c + 1}: {len(got)} outputs, expected {len(want)}')
      for k, (a, b) in enumerate(zip(got, want)):
        ok, err, why = compare(a, b, self.max_error)
        worst = max(worst, err)
        if not ok:
          errors.append(f'call {c + 1} output {k}: {why}')
    errors += _frozen_outputs(calls, ref.calls)
    if variables and any(v is not None for v in variables):
      finals = [v.numpy() for v in variables if v is not None]
      for k, (a, b) in enumerate(zip(finals, ref.variables)):
        ok, err, why = compare(a, b, self.max_error)
        worst = max(worst, err)
        if not ok:
          errors.append(f'variable {k}: {why}')
    result.max_error = worst
    alike = _pass_through_alike(spec, case, _rule_of(program, nodes))
    result.expect_no_collectives = alike
    if result.expect_no_collectives and result.n_collectives:
      errors.append(
        f'pass-through op with operands sharded alike emitted {result.n_collectives} '
        f'collectives {result.collectives}'
      )
    if errors:
      result.status = 'fail'
      result.message = '; '.join(errors)


def _frozen_outputs(calls, ref_calls) -> List[str]:
  """Outputs TF changes from call to call that the partitioned function repeats."""
  out = []
  for k in range(min(len(calls[0]), len(ref_calls[0]))):
    tf_changes = any(
      not np.array_equal(r[k], ref_calls[0][k], equal_nan=_has_nan(r[k])) for r in ref_calls[1:]
    )
    repeated = all(np.array_equal(c[k], calls[0][k], equal_nan=_has_nan(c[k])) for c in calls[1:])
    if tf_changes and repeated:
      out.append(
        f'output {k}: TF gives new values on every call, the partitioned function '
        'repeats its first (a stateful op computed once?)'
      )
  return out


def _has_nan(x: np.ndarray) -> bool:
  return x.dtype.kind in 'fc'


def _rule_of(program, nodes):
  """The propagation rule of the swept node, when it sits in the top-level graph and has one."""
  graph, node = nodes[0]
  if graph is not program.main:
    return None
  try:
    return registry.rule_for(node, graph)
  except registry.RuleError:
    return None


def _pass_through_alike(spec: OpSpec, case: Case, rule) -> bool:
  """A pass-through op, every operand of one shape and sharded alike, outputs left to propagation.

  Such a case must emit no collectives, a dim split into more pieces than it has
  rows included (its trailing shards are empty, as in any uneven split).
  """
  if rule is None or not rule.is_pass_through or spec.variables or case.out_specs is not None:
    return False
  if registry.entry_of(spec.op_type).linear == 'annotate':
    return False  # an annotation moves its operand to its own layout by definition
  if not any(dims for dims in rule.operands if dims is not None):
    return False  # a sink (Assert, PrintV2): its operands are used whole
  shapes = {o.value.shape for o in spec.operands}
  return len(shapes) == 1 and all(o.shard for o in spec.operands) and len(set(case.in_specs)) == 1


# --- reporting -------------------------------------------------------------------------------
def format_table(results: Iterable[CaseResult], meshes: Sequence[str] = tuple(MESHES)) -> str:
  """One row per program: how it was partitioned, passes per mesh, collectives; then failures."""
  results = list(results)
  by_spec: Dict[str, List[CaseResult]] = collections.OrderedDict()
  for r in sorted(results, key=lambda r: r.spec):
    by_spec.setdefault(r.spec, []).append(r)
  width = max([len(s) for s in by_spec] + [10])
  head = f'{"program":<{width}}  {"partitioned by":<22}'
  for m in meshes:
    head += f'  {m + " pass":>10}  {m + " coll":>8}'
  lines = [head + '  result', '-' * (len(head) + 8)]
  for name, rs in by_spec.items():
    hows = sorted({h for r in rs for h in r.how.split(',') if h})
    row = f'{name:<{width}}  {",".join(hows)[:22]:<22}'
    for m in meshes:
      mine = [r for r in rs if r.mesh == m]
      ok = sum(r.status == 'pass' for r in mine)
      counts = [r.n_collectives for r in mine if r.status == 'pass']
      coll = f'{min(counts)}-{max(counts)}' if counts else '-'
      row += f'  {f"{ok}/{len(mine)}":>10}  {coll:>8}'
    bad = [r for r in rs if r.status != 'pass']
    unknown = [r for r in bad if not r.known]
    row += '  ok' if not bad else f'  FAIL ({len(bad)}{", known" if not unknown else ""})'
    lines.append(row)
  failures = [r for r in results if r.status != 'pass']
  if failures:
    lines += ['', f'FAILURES ({len(failures)})']
    for r in failures:
      known = f' [known: {r.known}]' if r.known else ''
      lines.append(f'  {r.status.upper():5} {r.label}{known}: {r.message}')
  noted = [r for r in results if r.note]
  if noted:
    lines += ['', f'NOTES ({len(noted)} cases)']
    for note in sorted({r.note for r in noted}):
      which = [f'{r.spec}[{r.mesh}]' for r in noted if r.note == note]
      lines.append(
        f'  {note}: '
        + ', '.join(which[:12])
        + (f' and {len(which) - 12} more' if len(which) > 12 else '')
      )
  issues = sorted({r.known for r in results if r.known})
  if issues:
    lines += ['', 'KNOWN ISSUES (reported; fix outside the sweep)']
    for k in KNOWN_ISSUES:
      if k.name in issues:
        lines.append(f'  {k.name}: {k.diagnosis} Fix in: {k.fix_in}.')
  lines += ['', summary(results)]
  if UNSWEPT:
    lines.append(
      'not swept (no tf.function produces them): '
      + ', '.join(f'{k} ({v})' for k, v in sorted(UNSWEPT.items()))
    )
  return '\n'.join(lines)


def summary(results: Sequence[CaseResult]) -> str:
  counts = collections.Counter(r.status for r in results)
  programs = {r.spec for r in results}
  op_types = {r.op_type for r in results}
  seconds = sum(r.seconds for r in results)
  known = sum(1 for r in results if r.known)
  return (
    f'{len(results)} cases of {len(programs)} programs ({len(op_types)} op types): '
    f'{counts.get("pass", 0)} pass, {counts.get("fail", 0)} fail, '
    f'{counts.get("error", 0)} error; {known} known failures (by error signature), '
    f'{len(results) - counts.get("pass", 0) - known} unexpected; '
    f'{seconds:.0f} s in cases'
  )


# --- failures found by the sweep in code outside it (reported to its owners) ----------------------
# Optimizer updates (their entries' sweep programs of form 'apply').
_SLOT_APPLY = tuple(e.op_type for e in registry.entries() if e.sweep_params.get('form') == 'apply')
_WHOLE = P(None, None)

KNOWN_ISSUES.extend(
  [
    KnownIssue(
      'slot-sharded-unlike-variable',
      _SLOT_APPLY,
      'nothing: a documented refusal (graph_rewrite/variables.py apply_handler)',
      'a slot variable sharded unlike its variable is refused with a clear error naming '
      'both layouts (variables cannot be resharded in place). Listed so the sweep does not '
      'count the refusal as a wrong result.',
      raises='Unsupported',
      match=r'slot variable \S+ is sharded .* but its variable \S+ is sharded',
      example=Case('ResourceApplyAdagrad', '1d', (_WHOLE, P('x', None), _WHOLE)),
    ),
  ]
)
