"""Differential fuzzing of whole programs: random annotated TF programs, partitioned vs not.

The op sweep runs each op alone; bugs live in compositions (a reshard between two ops, a
pending sum crossing a cond, a halo after an uneven slice). `generate(seed, index)` draws a
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
the same program built in float64). A ValueError raised in tf_gspmd is a refusal (it names
what it refuses), unless it says "This is a bug"; any other exception is a crash.

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
import traceback
import warnings
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from tf_gspmd.testing.fuzz_ops import FAMILIES, Invalid, Op

MESHES = (((8,), ('x',)), ((2, 4), ('a', 'b')), ((4, 2), ('a', 'b')), ((2, 2, 2), ('a', 'b', 'c')))
DIMS = (1, 2, 2, 3, 3, 4, 4, 5, 6, 7, 8, 8, 9, 10, 12, 16)
MAX_ELEMENTS = 4096  # per value: programs stay small enough to run in well under a second
MAX_OUTPUTS = 4
LEARNING_RATE = 0.1


@dataclasses.dataclass(frozen=True)
class Input:
  """A program input. kind: 'arg' (float argument), 'var' (tf.Variable), 'index' (int32
  argument of values in [0, bound)), 'pred' (float scalar argument a cond tests)."""

  name: str
  kind: str
  shape: Tuple[int, ...]
  spec: Optional[tuple] = None
  scale: float = 1.0
  shift: float = 0.0
  bound: int = 0
  # Broadcast into a binary op: its gradient is a sum over the broadcast dims, and the ops
  # after it may not depend on it (a scale before a BatchNorm, a shift before a softmax):
  # that sum is then all cancellation, so it is no gradient target.
  broadcast: bool = False


@dataclasses.dataclass(frozen=True)
class Program:
  seed: int
  index: int
  mesh_shape: Tuple[int, ...]
  axes: Tuple[str, ...]
  devices: Tuple[int, ...]
  inputs: Tuple[Input, ...]
  ops: Tuple[Op, ...]
  grad: bool = False
  assign: str = ''  # the variable assign_add updates ('' for none)

  def label(self) -> str:
    mesh = 'x'.join(map(str, self.mesh_shape))
    order = '' if self.devices == tuple(range(8)) else '*'
    flags = ' grad' * self.grad + ' assign' * bool(self.assign)
    specs = sum(x.spec is not None for x in self.ops + self.inputs)
    elements = sum(int(np.prod(i.shape)) for i in self.inputs)
    return (
      f'[{self.seed}:{self.index}] {len(self.ops)} ops mesh {mesh}{order}{flags} '
      f'({specs} annotations, {elements} input elements)'
    )


def xla_lowers(program: Program) -> bool:
  """Whether XLA lowers the program's ops: a while loop's gradient keeps its activations in
  TensorLists, which tf2xla cannot size, and a cond's passes them as Optionals (no lowering)."""
  return not (program.grad and any(op.kind in ('while', 'cond') for op in program.ops))


# --- drawing programs ------------------------------------------------------------------------
class _Drawer:
  """The state a program is drawn in: the rng, the inputs and ops so far, every value's shape."""

  def __init__(self, rng, axes):
    self.rng = rng
    self.axes = axes
    self.inputs: List[Input] = []
    self.ops: List[Op] = []
    self.shapes: Dict[str, tuple] = {}
    self.count = 0

  def fresh(self, prefix: str) -> str:
    self.count += 1
    return f'{prefix}{self.count}'

  def choice(self, options):
    return options[self.rng.randint(len(options))]

  def dim(self, low: int = 1) -> int:
    return self.choice([d for d in DIMS if d >= low])

  def shape(self) -> tuple:
    return tuple(self.dim() for _ in range(self.rng.randint(1, 5)))

  def spec(self, rank: int) -> Optional[tuple]:
    return _draw_spec(self.rng, self.axes, rank)

  def new_input(self, kind, shape, scale=1.0, shift=0.0, bound=0, broadcast=False) -> str:
    name = self.fresh({'arg': 'x', 'var': 'v', 'index': 'i', 'pred': 'p'}[kind])
    annotate = kind in ('arg', 'var', 'index') and shape and self.rng.rand() < 0.6
    spec = self.spec(len(shape)) if annotate else None
    self.inputs.append(
      Input(name, kind, tuple(shape), spec, round(scale, 4), shift, bound, broadcast)
    )
    self.shapes[name] = tuple(shape)
    return name

  def pred(self) -> str:
    found = [i.name for i in self.inputs if i.kind == 'pred']
    return found[0] if found else self.new_input('pred', ())

  def float_values(self) -> List[str]:
    return [i.name for i in self.inputs if i.kind in ('arg', 'var')] + [o.name for o in self.ops]

  def add(self, op: Op) -> bool:
    shapes = dict(self.shapes)
    try:
      shape = FAMILIES[op.kind].shape(op, shapes)
    except Invalid:
      return False
    if len(shape) > 4 or int(np.prod(shape)) > MAX_ELEMENTS:
      return False
    if shape and self.rng.rand() < 0.3:
      op = dataclasses.replace(op, spec=self.spec(len(shape)))
    self.ops.append(op)
    self.shapes[op.name] = shape
    return True


def _draw_spec(rng, axes, rank: int) -> Optional[tuple]:
  """Each mesh axis splits a random dim (or none); several on one dim in a random order."""
  if rank == 0:
    return None
  per_dim: List[List[str]] = [[] for _ in range(rank)]
  for axis in rng.permutation(list(axes)).tolist():
    if rng.rand() < 0.6:
      per_dim[rng.randint(rank)].append(axis)
  return tuple(tuple(d) if d else None for d in per_dim)


def generate(seed: int, index: int, max_ops: int = 30, min_ops: int = 3) -> Program:
  """Program `index` of campaign `seed`: the same pair always draws the same program."""
  rng = np.random.RandomState([seed % 2**32, index])
  mesh_shape, axes = MESHES[rng.randint(len(MESHES))]
  devices = tuple(rng.permutation(8).tolist()) if rng.rand() < 0.3 else tuple(range(8))
  drawer = _Drawer(rng, axes)
  for _ in range(1 + (rng.rand() < 0.4)):
    drawer.new_input(drawer.choice(['arg', 'arg', 'var']), drawer.shape())
  target = rng.randint(min_ops, max_ops + 1)
  kinds = sorted(FAMILIES)
  weights = np.array([FAMILIES[k].weight for k in kinds])
  for _ in range(20 * target):
    if len(drawer.ops) >= target:
      break
    values = drawer.float_values()
    x = values[-1] if rng.rand() < 0.6 else drawer.choice(values)
    op = FAMILIES[kinds[rng.choice(len(kinds), p=weights / weights.sum())]].draw(drawer, x)
    if op is not None:
      drawer.add(op)
  variables = [i.name for i in drawer.inputs if i.kind == 'var']
  assign = drawer.choice(variables) if variables and rng.rand() < 0.3 else ''
  return _tidy(
    Program(
      seed,
      index,
      mesh_shape,
      axes,
      devices,
      tuple(drawer.inputs),
      tuple(drawer.ops),
      grad=bool(rng.rand() < 0.3),
      assign=assign,
    )
  )


# --- shapes, validity, outputs ---------------------------------------------------------------
def shapes_of(program: Program) -> Dict[str, tuple]:
  """Every value's shape; raises Invalid when an op does not fit its inputs."""
  shapes = {i.name: i.shape for i in program.inputs}
  bounds = {i.name: i.bound for i in program.inputs if i.kind == 'index'}
  for op in program.ops:
    if any(n not in shapes for n in op.inputs):
      raise Invalid(f'{op.name} reads an undefined value')
    shapes[op.name] = FAMILIES[op.kind].shape(op, shapes)
    if op.kind == 'gather':
      axis = op.param('axis')
      if bounds.get(op.inputs[1], 0) > shapes[op.inputs[0]][axis]:
        raise Invalid(f'{op.name}: indices reach past dim {axis}')
    if op.spec is not None and len(op.spec) != len(shapes[op.name]):
      raise Invalid(f'{op.name}: annotation of another rank')
  for i in program.inputs:
    if i.spec is not None and len(i.spec) != len(i.shape):
      raise Invalid(f'{i.name}: annotation of another rank')
  return shapes


def is_valid(program: Program) -> bool:
  try:
    shapes_of(program)
  except Invalid:
    return False
  return bool(program.ops)


def outputs_of(program: Program) -> List[str]:
  """The values no op reads (the last few): every op contributes to some output."""
  read = {n for op in program.ops for n in op.inputs}
  return [op.name for op in program.ops if op.name not in read][-MAX_OUTPUTS:]


def _tidy(program: Program) -> Program:
  """Drop ops no output depends on, inputs no op reads, an assign of a dropped variable."""
  needed = set(outputs_of(program))
  kept = []
  for op in reversed(program.ops):
    if op.name in needed:
      kept.append(op)
      needed.update(op.inputs)
  ops = tuple(reversed(kept))
  read = {n for op in ops for n in op.inputs}
  inputs = tuple(i for i in program.inputs if i.name in read)
  assign = program.assign if program.assign in read else ''
  return dataclasses.replace(program, inputs=inputs, ops=ops, assign=assign)


# --- printing a program as Python ------------------------------------------------------------
def _spec_code(spec) -> str:
  entries = ['None' if e is None else repr(e[0]) if len(e) == 1 else repr(tuple(e)) for e in spec]
  return f'tg.P({", ".join(entries)})'


def _value_code(i: Input) -> str:
  if i.kind == 'index':
    return f'rng.randint(0, {i.bound}, size={i.shape}).astype(np.int32)'
  if i.kind == 'pred':
    return 'np.asarray(rng.choice([-1.0, 1.0]), dtype)'
  shift = f' + {i.shift}' if i.shift else ''
  return f'(rng.standard_normal({i.shape}) * {i.scale}{shift}).astype(dtype)'


def render(program: Program, name: str = 'build') -> str:
  """`program` as Python: `{name}(dtype=np.float32) -> (mesh, make, args)`, where `make()`
  builds fresh variables and the tf.function reading them."""
  shapes = shapes_of(program)
  outputs = outputs_of(program)
  args = [i for i in program.inputs if i.kind != 'var']
  variables = [i for i in program.inputs if i.kind == 'var']
  lines = [
    f'def {name}(dtype=np.float32):',
    f'  """{program.label()}"""',
    f'  mesh = tg.Mesh(np.array({list(program.devices)}).reshape({program.mesh_shape}), '
    f'{program.axes})',
    f'  rng = np.random.RandomState({program.seed % 2**31 + program.index})',
  ]
  lines += [
    f'  {i.name}{"_value" if i.kind == "var" else ""} = {_value_code(i)}' for i in program.inputs
  ]
  if program.grad:
    lines += [
      f'  loss_weight_{n} = rng.standard_normal({shapes[n]}).astype(dtype)' for n in outputs
    ]
  lines += ['', '  def make():']
  for v in variables:
    lines.append(f'    {v.name} = tf.Variable({v.name}_value)')
    if v.spec is not None:
      lines.append(f'    tg.shard_variable({v.name}, mesh, {_spec_code(v.spec)})')
  lines += [
    '',
    '    @tf.function(autograph=False)',
    f'    def program({", ".join(i.name for i in args)}):',
  ]
  lines += _body(program, shapes, outputs, args, variables)
  lines += [
    '',
    f'    return program, [{", ".join(v.name for v in variables)}]',
    '',
    f'  return mesh, make, [{", ".join(i.name for i in args)}]',
  ]
  return '\n'.join(lines) + '\n'


def _body(program, shapes, outputs, args, variables) -> List[str]:
  pad = '        ' if program.grad else '      '
  body = [
    f'{pad}{i.name} = tg.shard({i.name}, mesh, {_spec_code(i.spec)})'
    for i in args
    if i.spec is not None
  ]
  float_args = [i.name for i in args if i.kind == 'arg']
  if program.grad and float_args:
    body.append(f'{pad}tape.watch([{", ".join(float_args)}])')
  for op in program.ops:
    names = list(op.inputs)
    body.append(f'{pad}{op.name} = {FAMILIES[op.kind].code(op, names, shapes)}')
    if op.spec is not None:
      body.append(f'{pad}{op.name} = tg.shard({op.name}, mesh, {_spec_code(op.spec)})')
  results = list(outputs)
  targets = [i.name for i in args + variables if i.kind in ('arg', 'var') and not i.broadcast]
  if program.grad:
    loss = ' + '.join(f'tf.reduce_sum({n} * loss_weight_{n})' for n in outputs)
    body = ['      with tf.GradientTape() as tape:'] + body + [f'{pad}loss = {loss}']
    body += [
      f'      grads = tape.gradient(loss, [{", ".join(targets)}], '
      'unconnected_gradients=tf.UnconnectedGradients.ZERO)',
      '      grads = [tf.convert_to_tensor(g) for g in grads]',
    ]
    results += [f'grads[{k}]' for k in range(len(targets))]
  if program.assign:
    # A gradient step where there is one, else a step of the variable's own values.
    step = (
      f'grads[{targets.index(program.assign)}]'
      if program.grad and program.assign in targets
      else f'tf.tanh({program.assign})'
    )
    body.append(f'      {program.assign}.assign_add({LEARNING_RATE} * {step})')
  return body + [f'      return [{", ".join(results)}]']


def fused_batch_norm(x, scale, offset, epsilon=1e-3):
  """Training-mode FusedBatchNormV3 in float32; its formula in float64 (no float64 kernel), so
  a program's float64 twin computes the same function."""
  import tensorflow as tf

  if x.dtype == tf.float32:
    return tf.compat.v1.nn.fused_batch_norm(x, scale, offset, epsilon=epsilon, is_training=True)[0]
  mean, variance = tf.nn.moments(x, [0, 1, 2])
  return tf.nn.batch_normalization(x, mean, variance, offset, scale, epsilon)


HEADER = (
  'import numpy as np\nimport tensorflow as tf\n\nimport tf_gspmd as tg\n'
  'from tf_gspmd.testing import fuzz\n'
)


def load(source: str, name: str = 'build') -> Callable:
  """The `build` function a rendered program defines."""
  namespace: Dict[str, Any] = {}
  code = compile(HEADER + source, f'<fuzz program {name}>', 'exec')
  exec(code, namespace)
  return namespace[name]


# --- running and judging one program ---------------------------------------------------------
CALLS = 2  # state (a variable's assign_add) shows on the second call


@dataclasses.dataclass
class Outcome:
  """status: 'pass', 'mismatch', 'crash', 'refusal' (a ValueError of tf_gspmd naming what it
  refuses), 'invalid' (the unpartitioned program failed: a fuzzer bug)."""

  status: str
  message: str = ''
  error_type: str = ''
  seconds: float = 0.0
  poisoned: bool = False  # a collective failed: later collectives in this process fail too
  float64: bool = False  # passed by the float64 rule, not the float32 bound

  def same_failure(self, other: 'Outcome') -> bool:
    return self.status == other.status and self.error_type == other.error_type


def _calls(fn, args) -> List[List[np.ndarray]]:
  return [[np.asarray(t) for t in fn(*args)] for _ in range(CALLS)]


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


def partitioned(build, backend: str = 'tf', timeout: float = 60.0):
  from tf_gspmd.partitioned import partition

  mesh, make, args = build(np.float32)
  fn, variables = make()
  pf = partition(fn, mesh, backend=backend, timeout=timeout, progress=False)
  calls = _calls(pf, args)
  pf.sync_variables()
  return calls, [v.numpy() for v in variables]


def compare(build, got, want, backend: str = 'tf') -> Optional[str]:
  """None when `got` is `want` by the oracle; '' when it passes only by the float64 rule
  (float32 itself ill-conditioned); else why it fails."""
  from tf_gspmd.testing.oracle import assert_close

  try:
    assert_close(got, want, 'result')
    return None
  except AssertionError as error:
    first = str(error)
  exact = reference(build, np.float64)
  why = _further_from_float64(got, want, exact)
  if why:
    # A second float32 witness: XLA running the unpartitioned program sums in other orders
    # (and its training BatchNorm takes the variance as E[x^2] - E[x]^2). Where the exact
    # result is 0 (a gradient a later BatchNorm or softmax cancels), or float32 keeps little
    # of it, the witnesses disagree as much as a correct partitioned program may: each
    # tensor is measured against the witness further from float64.
    witness = _xla_witness(build)
    if witness is not None:
      why = _further_from_float64(got, _further(want, witness, exact), exact)
  return '' if not why else f'{first}\n{why}'


def _xla_witness(build):
  try:
    return reference(build, np.float32, jit=True)
  except Exception:  # noqa: BLE001  (an op XLA cannot compile: no witness)
    return None


def _further(a, b, exact):
  """Leaf by leaf, whichever of `a` and `b` is further from `exact`."""
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


def judge(build, backend: str = 'tf', timeout: float = 60.0) -> Outcome:
  """Run `build`'s program partitioned and not (twice each) and say how it went."""
  start = time.time()
  try:
    want = reference(build)
  except Exception as error:  # noqa: BLE001
    return Outcome('invalid', _error_text(error), type(error).__name__, time.time() - start)
  try:
    got = partitioned(build, backend, timeout)
  except Exception as error:  # noqa: BLE001
    return Outcome(
      classify(error),
      _error_text(error),
      type(error).__name__,
      time.time() - start,
      poisoned=_is_poison(error),
    )
  why = compare(build, got, want, backend)
  status = 'pass' if why is None or why == '' else 'mismatch'
  return Outcome(status, why or '', '', time.time() - start, float64=why == '')


def run(program: Program, backend: str = 'tf', timeout: float = 60.0) -> Outcome:
  return judge(load(render(program)), backend, timeout)


def check(build, backend: str = 'tf') -> None:
  """For tests: raise unless `build`'s program partitions to the unpartitioned result."""
  got = partitioned(build, backend)
  why = compare(build, got, reference(build), backend)
  if why:
    raise AssertionError(why)


def classify(error: BaseException) -> str:
  """'refusal' for a ValueError tf_gspmd raised itself (not a 'This is a bug', nor XLA failing
  to compile ops the partitioner emitted), else 'crash'."""
  if 'This is a bug' in str(error) or not isinstance(error, ValueError):
    return 'crash'
  if type(error).__name__ == 'XlaLoweringError' and 'could not compile' in str(error):
    return 'crash'  # tf2xla failed on the partitioned program (ops the partitioner emitted)
  frames = traceback.extract_tb(error.__traceback__)
  last = frames[-1].filename if frames else ''
  in_tf_gspmd = f'{os.sep}tf_gspmd{os.sep}' in last and f'{os.sep}testing{os.sep}' not in last
  return 'refusal' if in_tf_gspmd else 'crash'


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
) -> Program:
  """The smallest program found (greedily) that still `fails`: each accepted change restarts
  the candidate list; at most `budget` candidates are run, for at most `seconds`."""
  best, tried = program, 0
  deadline = time.time() + seconds
  progress = True
  while progress and tried < budget:
    progress = False
    for candidate in candidates(best):
      if tried >= budget or time.time() > deadline:
        break
      if candidate == best or not is_valid(candidate):
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
    yield _tidy(_without(p, op.name))
  for op in reversed(p.ops):
    for source in op.inputs:
      yield _tidy(_bypass(p, op, source))
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
      f'crashes {c["crash"]}, refusals {c["refusal"]}, invalid {c["invalid"]}, '
      f'float64 rule {c["float64"]}; {seconds:.1f} s ({rate:.2f} programs/s)'
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
    for backend in backends:
      outcome = run(program, backend)
      tally.xla_runs += backend == 'xla'
      _record(tally, program, backend, outcome, echo)
      if outcome.poisoned:
        echo(f'POISONED: a collective failed; resume with --start {index + 1}')
        return tally
      if outcome.status in ('mismatch', 'crash', 'invalid') and shrink_budget:
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
  if outcome.status in ('mismatch', 'crash', 'invalid'):
    tally.failures.append(f'{program.label()} {backend}: {outcome.message[:300]}')
  note = ' (float64 rule)' if outcome.float64 else ''
  detail = '' if outcome.status == 'pass' else ' ' + ' '.join(outcome.message.split())[:200]
  echo(f'{program.label()} {backend}: {outcome.status}{note} {outcome.seconds:.2f}s{detail}')


def _shrink_and_write(program, outcome, backend, out, limits, echo):
  """`limits`: (candidates, seconds) the shrinker may spend."""
  if outcome.status == 'invalid':
    small = program  # the reference itself failed: a fuzzer bug, shown as drawn
  else:
    small = shrink(program, failing_like(outcome, backend), limits[0], echo, limits[1])
  text = test_case(small, outcome, backend)
  echo(text)
  if out:
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, f'test_fuzz_case_{program.seed}_{program.index}_{backend}.py')
    with open(path, 'w') as f:
      f.write(text)
    echo(f'wrote {path}')


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
  return 1 if tally.counts['mismatch'] or tally.counts['crash'] else 0


if __name__ == '__main__':
  os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
  sys.exit(main())
