"""A fuzz program: drawn at random, held as data, printed as the Python that runs.

`generate(seed, index)` draws a `Program` of 3 to 30 ops from the families of `fuzz_ops`
over random shapes (uneven, dims smaller than their shard count), with random annotations
on inputs, intermediates and variables over a 1-D, 2-D or 3-D mesh of 8 devices (sometimes
in another device order); sometimes the gradient of a scalar loss w.r.t. its inputs and
variables, sometimes a variable assign_add. `render` prints it as a `build(dtype)`
function and `load` makes that text the function: a printed case reproduces exactly.
How a program is run, judged and shrunk: `fuzz`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np

from tf_gspmd.testing.fuzz_ops import FAMILIES, Invalid, Op

MESHES = (((8,), ('x',)), ((2, 4), ('a', 'b')), ((4, 2), ('a', 'b')), ((2, 2, 2), ('a', 'b', 'c')))
DIMS = (1, 2, 2, 3, 3, 4, 4, 5, 6, 7, 8, 8, 9, 10, 12, 16)
MAX_ELEMENTS = 4096  # per value: programs stay small enough to run in well under a second
MAX_OUTPUTS = 4
LEARNING_RATE = 0.1
NESTED = 0.2  # the share of programs whose body is a nested tf.function
# The shares of 'forward' nestings whose function is called from two sites, and from the two
# branches of a cond.
TWICE, COND = 0.3, 0.3
NESTED_FLAGS = {
  '': '',
  'all': ' nested',
  'forward': ' nested-forward',
  'twice': ' nested-twice',
  'cond': ' nested-cond',
}


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
  # A nested tf.function the program calls (a call op, its body a library function: the
  # partitioner emits it inline, propagation crosses the call's boundary): 'all' the body,
  # 'forward' its ops, the tape and the assign in the caller (the gradient of a call),
  # 'twice' as 'forward' from two call sites (the second with its float arguments halved),
  # their outputs summed: one function, and under a tape one forward/backward pair, reached
  # from two places whose operands differ; 'cond' as 'twice', the two calls the branches of
  # a tf.cond on the sign of a sum of an input (calls inside an If's branch functions).
  nested: str = ''

  def label(self) -> str:
    mesh = 'x'.join(map(str, self.mesh_shape))
    order = '' if self.devices == tuple(range(8)) else '*'
    flags = ' grad' * self.grad + ' assign' * bool(self.assign)
    flags += NESTED_FLAGS[self.nested]
    specs = sum(x.spec is not None for x in self.ops + self.inputs)
    elements = sum(int(np.prod(i.shape)) for i in self.inputs)
    return (
      f'[{self.seed}:{self.index}] {len(self.ops)} ops mesh {mesh}{order}{flags} '
      f'({specs} annotations, {elements} input elements)'
    )


def xla_lowers(program: Program) -> bool:
  """Whether XLA lowers the program's ops: a while loop's gradient keeps its activations in
  TensorLists, which tf2xla cannot size, and a cond's passes them as Optionals (no lowering),
  its ops' or the one that calls the nested function (`nested='cond'`)."""
  conds = any(op.kind in ('while', 'cond') for op in program.ops) or program.nested == 'cond'
  return not (program.grad and conds)


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
  return tidy(
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
      nested=_draw_nested(seed, index),
    )
  )


def _draw_nested(seed: int, index: int) -> str:
  """How program `index` nests its body, drawn apart from the rest of the program: the
  programs drawn before nesting existed stay as they were, some of them now nested."""
  rng = np.random.RandomState([seed % 2**32, index, 1])
  if rng.rand() >= NESTED:
    return ''
  if rng.rand() >= 0.5:
    return 'all'
  kind = rng.rand()
  return 'twice' if kind < TWICE else 'cond' if kind < TWICE + COND else 'forward'


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


def tidy(program: Program) -> Program:
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


def render(program: Program, name: str = 'build', inline: bool = False) -> str:
  """`program` as Python: `{name}(dtype=np.float32) -> (mesh, make, args)`, where `make()`
  builds fresh variables and the tf.function reading them; with `inline`, its nested function
  a plain Python function (the same program, traced inline)."""
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
  signature = ', '.join(i.name for i in args)
  lines += ['', '    @tf.function(autograph=False)']
  if program.nested:
    # 'forward': the body computes the outputs alone; the caller takes the gradient, assigns.
    whole = program.nested == 'all'
    inner = program if whole else dataclasses.replace(program, grad=False, assign='')
    if inline:
      lines.pop()  # the decorator
    lines += [f'    def body({signature}):']
    lines += _body(inner, shapes, outputs, args, variables if whole else [])
    lines += ['', '    @tf.function(autograph=False)', f'    def program({signature}):']
    if whole:
      lines += [f'      return body({signature})']
    else:
      lines += _body(program, shapes, outputs, args, variables, _calls(program, outputs, args))
  else:
    lines += [f'    def program({signature}):']
    lines += _body(program, shapes, outputs, args, variables)
  lines += [
    '',
    f'    return program, [{", ".join(v.name for v in variables)}]',
    '',
    f'  return mesh, make, [{", ".join(i.name for i in args)}]',
  ]
  return '\n'.join(lines) + '\n'


def _calls(program, outputs, args) -> List[str]:
  """The caller's lines computing `outputs` by calling `body`: once; also on its float
  arguments halved, the two results summed (`nested='twice'`); or one of the two calls, as
  the sign of a sum of the first float input says (`nested='cond'`)."""
  names = ', '.join(i.name for i in args)
  results = f'{", ".join(outputs)},'
  if program.nested not in ('twice', 'cond'):
    return [f'{results} = body({names})']
  halved = ', '.join(f'{i.name} * 0.5' if i.kind == 'arg' else i.name for i in args)
  if program.nested == 'twice':
    return [
      f'first, second = body({names}), body({halved})',
      f'{results} = [a + b for a, b in zip(first, second)]',
    ]
  tested = [i.name for i in program.inputs if i.kind in ('arg', 'var', 'pred')]
  sign = f'tf.reduce_sum({tested[0]}) > 0.0' if tested else 'tf.constant(True)'
  return [
    f'{results} = tf.cond({sign}, lambda: body({names}), lambda: body({halved}))',
  ]


def _body(program, shapes, outputs, args, variables, call=None) -> List[str]:
  """The program's body: its ops (or `call`, lines computing its outputs by a nested call),
  under a tape for the gradient, then the assign."""
  pad = '        ' if program.grad else '      '
  body = []
  float_args = [i.name for i in args if i.kind == 'arg']
  if call is None:
    body += [
      f'{pad}{i.name} = tg.shard({i.name}, mesh, {_spec_code(i.spec)})'
      for i in args
      if i.spec is not None
    ]
  if program.grad and float_args:
    body.append(f'{pad}tape.watch([{", ".join(float_args)}])')
  for op in () if call is not None else program.ops:
    names = list(op.inputs)
    body.append(f'{pad}{op.name} = {FAMILIES[op.kind].code(op, names, shapes)}')
    if op.spec is not None:
      body.append(f'{pad}{op.name} = tg.shard({op.name}, mesh, {_spec_code(op.spec)})')
  body += [pad + line for line in call or ()]
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
