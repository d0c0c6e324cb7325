"""The op families of the whole-program fuzzer (`fuzz_program`, `fuzz`): drawing, shape, code.

A family is three functions, keyed by its name in `FAMILIES`:

- `draw(g, x)`: an `Op` reading value `x` (and maybe new inputs made with `g.new_input`),
  or None when `x` does not fit the family (its rank, its dims);
- `shape(op, shapes)`: the op's output shape from its inputs' shapes, raising `Invalid`
  when they do not fit its parameters (the shrinker changes shapes under fixed parameters);
- `code(op, names, shapes)`: one Python expression computing it, as the printed program runs it.

Parameters are plain data (ints, strings, tuples), so a program prints as runnable Python and
compares equal after a round trip. Values stay of moderate scale (weights scaled by
1/sqrt(fan-in), bounded activations, loops that contract) so float32 stays well conditioned.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Callable, Dict, Optional, Tuple

import numpy as np


class Invalid(ValueError):
  """Shapes that do not fit an op's parameters: the program is not a valid TF program."""


@dataclasses.dataclass(frozen=True)
class Op:
  """One op: `kind` (a family), the names of the values it reads, its parameters, and the
  annotation of its output (`spec`: one entry per dim, None or a tuple of mesh axes)."""

  name: str
  kind: str
  inputs: Tuple[str, ...]
  params: Tuple[Tuple[str, Any], ...] = ()
  spec: Optional[Tuple[Optional[Tuple[str, ...]], ...]] = None

  def param(self, key: str):
    return dict(self.params)[key]


@dataclasses.dataclass(frozen=True)
class Family:
  draw: Callable
  shape: Callable
  code: Callable
  weight: float


def _op(g, kind, inputs, **params) -> Op:
  return Op(g.fresh('t'), kind, tuple(inputs), tuple(sorted(params.items())))


def _need(ok: bool, what: str) -> None:
  if not ok:
    raise Invalid(what)


def _needs_rank(least: int):
  """A draw for values of rank `least` or more: None for the others."""

  def wrap(draw):
    def checked(g, x):
      return draw(g, x) if len(g.shapes[x]) >= least else None

    return checked

  return wrap


def _window_out(size: int, window: int, stride: int, padding: str) -> int:
  if padding == 'SAME':
    return -(-size // stride)
  _need(size >= window, f'VALID window {window} over {size}')
  return -(-(size - window + 1) // stride)


# --- elementwise ---------------------------------------------------------------------------
UNARY = {
  'tanh': 'tf.tanh({})',
  'sigmoid': 'tf.sigmoid({})',
  'relu': 'tf.nn.relu({})',
  'sin': 'tf.sin({})',
  'neg': '-{}',
  'abs': 'tf.abs({})',
  'softplus': 'tf.nn.softplus({})',
  'affine': '{} * 0.5 + 0.25',
}
BINARY = {'add': '{} + {}', 'sub': '{} - {}', 'mul': '{} * {}', 'max': 'tf.maximum({}, {})'}


def draw_unary(g, x):
  return _op(g, 'unary', [x], fn=g.choice(sorted(UNARY)))


def draw_binary(g, x):
  shape = g.shapes[x]
  fn = g.choice(sorted(BINARY))
  same = [n for n in g.float_values() if n != x and _broadcasts_to(g.shapes[n], shape)]
  # A difference of two values of the program may cancel (x + y - x): float32 then keeps
  # little of the result, the gradients above all. Differences take a fresh operand.
  if same and fn != 'sub' and g.rng.rand() < 0.5:
    other = g.choice(same)
  else:  # a new operand: a suffix of x's shape, some dims 1 (broadcast)
    rank = g.rng.randint(0, len(shape) + 1)
    dims = tuple(1 if g.rng.rand() < 0.3 else d for d in shape[len(shape) - rank :])
    other = g.new_input('var' if g.rng.rand() < 0.4 else 'arg', dims, broadcast=dims != shape)
  pair = [x, other] if g.rng.rand() < 0.7 else [other, x]
  return _op(g, 'binary', pair, fn=fn)


def _broadcasts_to(small, big) -> bool:
  if len(small) > len(big):
    return False
  return all(s in (1, b) for s, b in zip(small[::-1], big[::-1]))


def shape_elementwise(op, shapes):
  try:
    return tuple(np.broadcast_shapes(*[shapes[n] for n in op.inputs]))
  except ValueError as error:
    raise Invalid(str(error)) from None


def code_unary(op, names, shapes):
  return UNARY[op.param('fn')].format(names[0])


def code_binary(op, names, shapes):
  return BINARY[op.param('fn')].format(*names)


# --- matmul and einsum ---------------------------------------------------------------------
@_needs_rank(2)
def draw_matmul(g, x):
  shape = g.shapes[x]
  k, n = shape[-1], g.dim()
  form = g.choice(
    ['matmul', 'einsum', 'batch', 'transpose_b']
    if len(shape) == 3
    else ['matmul', 'transpose_b']
    if len(shape) == 2
    else ['einsum']
  )
  if form == 'batch':
    w = g.new_input('arg', shape[:-2] + (k, n), scale=1 / math.sqrt(k))
  elif form == 'transpose_b':
    w = g.new_input('var', (n, k), scale=1 / math.sqrt(k))
  else:
    w = g.new_input(g.choice(['var', 'arg']), (k, n), scale=1 / math.sqrt(k))
  return _op(g, 'matmul', [x, w], form=form)


def shape_matmul(op, shapes):
  x, w = (shapes[n] for n in op.inputs)
  form = op.param('form')
  if form == 'transpose_b':
    _need(len(x) == 2 and len(w) == 2 and x[1] == w[1], f'matmul_t {x} {w}')
    return (x[0], w[0])
  if form == 'batch':
    _need(len(x) == len(w) >= 3 and x[:-2] == w[:-2] and x[-1] == w[-2], f'bmm {x} {w}')
    return x[:-1] + (w[-1],)
  _need(len(x) >= 2 and len(w) == 2 and x[-1] == w[0], f'matmul {x} {w}')
  return x[:-1] + (w[1],)


def code_matmul(op, names, shapes):
  x, w = names
  form = op.param('form')
  if form == 'transpose_b':
    return f'tf.matmul({x}, {w}, transpose_b=True)'
  if form == 'einsum':
    lead = 'abcd'[: len(shapes[op.inputs[0]]) - 1]
    return f"tf.einsum('{lead}k,kn->{lead}n', {x}, {w})"
  return f'tf.matmul({x}, {w})'


# --- reductions ----------------------------------------------------------------------------
REDUCE = {'sum': 'tf.reduce_sum', 'mean': 'tf.reduce_mean', 'max': 'tf.reduce_max'}


@_needs_rank(1)
def draw_reduce(g, x):
  rank = len(g.shapes[x])
  axes = tuple(sorted(g.rng.choice(rank, g.rng.randint(1, rank + 1), replace=False).tolist()))
  keep = bool(g.rng.rand() < 0.4) or len(axes) == rank
  return _op(g, 'reduce', [x], fn=g.choice(['sum', 'mean', 'mean', 'max']), axes=axes, keep=keep)


def shape_reduce(op, shapes):
  shape = shapes[op.inputs[0]]
  axes = op.param('axes')
  _need(all(a < len(shape) for a in axes), f'reduce axes {axes} of {shape}')
  if op.param('keep'):
    return tuple(1 if i in axes else d for i, d in enumerate(shape))
  return tuple(d for i, d in enumerate(shape) if i not in axes)


def code_reduce(op, names, shapes):
  return (
    f'{REDUCE[op.param("fn")]}({names[0]}, axis={list(op.param("axes"))}, '
    f'keepdims={op.param("keep")})'
  )


# --- reshape and transpose -----------------------------------------------------------------
def draw_reshape(g, x):
  shape = g.shapes[x]
  splits = [(i, f) for i, d in enumerate(shape) for f in (2, 3, 4) if d % f == 0 and d > f]
  if len(shape) < 4 and splits and (len(shape) < 2 or g.rng.rand() < 0.5):
    i, f = splits[g.rng.randint(len(splits))]
    return _op(g, 'reshape', [x], how='split', dim=i, factor=f)
  if len(shape) >= 2:
    return _op(g, 'reshape', [x], how='merge', dim=g.rng.randint(len(shape) - 1), factor=0)
  return None


def shape_reshape(op, shapes):
  shape, i, f = shapes[op.inputs[0]], op.param('dim'), op.param('factor')
  if op.param('how') == 'merge':
    _need(i + 1 < len(shape), f'merge {i} of {shape}')
    return shape[:i] + (shape[i] * shape[i + 1],) + shape[i + 2 :]
  _need(i < len(shape) and shape[i] % f == 0, f'split {i} by {f} of {shape}')
  return shape[:i] + (f, shape[i] // f) + shape[i + 1 :]


def code_reshape(op, names, shapes):
  return f'tf.reshape({names[0]}, {list(shape_reshape(op, shapes))})'


@_needs_rank(2)
def draw_transpose(g, x):
  rank = len(g.shapes[x])
  return _op(g, 'transpose', [x], perm=tuple(g.rng.permutation(rank).tolist()))


def shape_transpose(op, shapes):
  shape = shapes[op.inputs[0]]
  perm = op.param('perm')
  _need(len(perm) == len(shape), f'perm {perm} of {shape}')
  return tuple(shape[p] for p in perm)


def code_transpose(op, names, shapes):
  return f'tf.transpose({names[0]}, {list(op.param("perm"))})'


# --- slices, pads, concat, gather ----------------------------------------------------------
@_needs_rank(1)
def draw_slice(g, x):
  shape = g.shapes[x]
  cut = []
  for d in shape:
    if g.rng.rand() < 0.5 or d == 1:
      cut.append(None)
      continue
    begin = g.rng.randint(0, d)
    cut.append((begin, g.rng.randint(begin + 1, d + 1), g.choice([1, 1, 2, 3])))
  return _op(g, 'slice', [x], cut=tuple(cut))


def shape_slice(op, shapes):
  shape = shapes[op.inputs[0]]
  cut = op.param('cut')
  _need(len(cut) == len(shape), f'slice {cut} of {shape}')
  out = []
  for d, c in zip(shape, cut):
    _need(c is None or c[1] <= d, f'slice {c} of {d}')
    out.append(d if c is None else -(-(c[1] - c[0]) // c[2]))
  return tuple(out)


def code_slice(op, names, shapes):
  parts = [
    ':' if c is None else f'{c[0]}:{c[1]}' + (f':{c[2]}' if c[2] != 1 else '')
    for c in op.param('cut')
  ]
  return f'{names[0]}[{", ".join(parts)}]'


@_needs_rank(1)
def draw_pad(g, x):
  shape = g.shapes[x]
  pads = tuple(
    (g.rng.randint(0, 3), g.rng.randint(0, 3)) if g.rng.rand() < 0.6 else (0, 0) for _ in shape
  )
  mode = g.choice(['CONSTANT', 'CONSTANT', 'REFLECT', 'SYMMETRIC'])
  if len(shape) == 4:
    # TF 2.21's oneDNN rewrite fuses a Pad into the Conv2D reading it and pads only the
    # spatial dims: a padded channel or batch dim fails the plain program ("input depth must
    # be evenly divisible by filter depth: 9 vs 10"; a batch of 1 where the pad made 2, found
    # by a concat after it), fine with TF_ENABLE_ONEDNN_OPTS=0 (campaign programs 1414:1382
    # and 1414:1817). Drawn, then not used, so the programs after it stay the same.
    pads = ((0, 0),) + pads[1:3] + ((0, 0),)
  return _op(g, 'pad', [x], pads=pads, mode=mode)


def shape_pad(op, shapes):
  shape, pads, mode = shapes[op.inputs[0]], op.param('pads'), op.param('mode')
  _need(len(pads) == len(shape), f'pads {pads} of {shape}')
  limit = {'CONSTANT': math.inf, 'REFLECT': 0, 'SYMMETRIC': 1}[mode]
  _need(all(max(p) < d + limit for p, d in zip(pads, shape)), f'{mode} pads {pads} of {shape}')
  return tuple(d + lo + hi for d, (lo, hi) in zip(shape, pads))


def code_pad(op, names, shapes):
  return f"tf.pad({names[0]}, {[list(p) for p in op.param('pads')]}, mode='{op.param('mode')}')"


@_needs_rank(1)
def draw_concat(g, x):
  shape = g.shapes[x]
  axis = g.rng.randint(len(shape))
  fits = [
    n
    for n in g.float_values()
    if n != x
    and len(g.shapes[n]) == len(shape)
    and all(a == b for i, (a, b) in enumerate(zip(g.shapes[n], shape)) if i != axis)
  ]
  if fits and g.rng.rand() < 0.5:
    other = g.choice(fits)
  else:
    other = g.new_input(
      g.choice(['arg', 'var']), shape[:axis] + (g.rng.randint(1, 6),) + shape[axis + 1 :]
    )
  return _op(g, 'concat', [x, other], axis=axis)


def shape_concat(op, shapes):
  a, b = (shapes[n] for n in op.inputs)
  axis = op.param('axis')
  _need(
    len(a) == len(b) > axis and a[:axis] + a[axis + 1 :] == b[:axis] + b[axis + 1 :],
    f'concat {a} {b} on {axis}',
  )
  return a[:axis] + (a[axis] + b[axis],) + a[axis + 1 :]


def code_concat(op, names, shapes):
  return f'tf.concat([{names[0]}, {names[1]}], {op.param("axis")})'


@_needs_rank(1)
def draw_gather(g, x):
  axis = g.rng.randint(len(g.shapes[x]))
  dims = (g.dim(),) if g.rng.rand() < 0.7 else (g.dim(), g.dim())  # indices of rank 1 or 2
  indices = g.new_input('index', dims, bound=g.shapes[x][axis])
  return _op(g, 'gather', [x, indices], axis=axis)


def shape_gather(op, shapes):
  x, idx = (shapes[n] for n in op.inputs)
  axis = op.param('axis')
  _need(axis < len(x) and x[axis] >= 1, f'gather axis {axis} of {x}')
  return x[:axis] + idx + x[axis + 1 :]


def code_gather(op, names, shapes):
  return f'tf.gather({names[0]}, {names[1]}, axis={op.param("axis")})'


# --- convolutions, pools, softmax, batch norm ----------------------------------------------
def _image(g, x):
  """x when it is NHWC, else None (the family then starts from a new image input)."""
  return x if len(g.shapes[x]) == 4 else None


def draw_conv(g, x):
  x = _image(g, x) or g.new_input('arg', (g.dim(), g.dim(4), g.dim(4), g.dim()))
  n, h, w, c = g.shapes[x]
  kh, kw = g.rng.randint(1, 4), g.rng.randint(1, 4)
  kernel = g.new_input('var', (kh, kw, c, g.dim()), scale=1 / math.sqrt(kh * kw * c))
  stride = g.choice([1, 2])
  if kh == kw == 1:
    # TF 2.21's oneDNN filter gradient of a strided 1x1 convolution corrupts the heap, in the
    # unpartitioned reference too (the partitioner emits a matmul there: regression test
    # 1414_917): drawn, so the programs after it stay the same, but not used.
    stride = 1
  return _op(g, 'conv', [x, kernel], stride=stride, padding=g.choice(['SAME', 'VALID']))


def shape_conv(op, shapes):
  x, k = (shapes[n] for n in op.inputs)
  _need(len(x) == 4 and len(k) == 4 and x[3] == k[2], f'conv {x} {k}')
  s, p = op.param('stride'), op.param('padding')
  return (x[0], _window_out(x[1], k[0], s, p), _window_out(x[2], k[1], s, p), k[3])


def code_conv(op, names, shapes):
  return (
    f'tf.nn.conv2d({names[0]}, {names[1]}, strides={op.param("stride")}, '
    f"padding='{op.param('padding')}')"
  )


def draw_pool(g, x):
  x = _image(g, x) or g.new_input('arg', (g.dim(), g.dim(4), g.dim(4), g.dim()))
  return _op(
    g,
    'pool',
    [x],
    fn=g.choice(['max', 'avg']),
    window=g.choice([2, 3]),
    stride=g.choice([1, 2]),
    padding=g.choice(['SAME', 'VALID']),
  )


def shape_pool(op, shapes):
  x = shapes[op.inputs[0]]
  _need(len(x) == 4, f'pool {x}')
  k, s, p = op.param('window'), op.param('stride'), op.param('padding')
  return (x[0], _window_out(x[1], k, s, p), _window_out(x[2], k, s, p), x[3])


def code_pool(op, names, shapes):
  return (
    f'tf.nn.{op.param("fn")}_pool2d({names[0]}, {op.param("window")}, '
    f"{op.param('stride')}, '{op.param('padding')}')"
  )


@_needs_rank(1)
def draw_softmax(g, x):
  return _op(g, 'softmax', [x], axis=g.rng.randint(len(g.shapes[x])))


def shape_softmax(op, shapes):
  shape = shapes[op.inputs[0]]
  _need(op.param('axis') < len(shape), f'softmax axis of {shape}')
  return shape


def code_softmax(op, names, shapes):
  return f'tf.nn.softmax({names[0]}, axis={op.param("axis")})'


@_needs_rank(2)
def draw_batch_norm(g, x):
  shape = g.shapes[x]
  if math.prod(shape[:-1]) < 4:
    return None  # statistics of 2 or 3 values: the centred values may be all cancellation
  c = shape[-1]
  scale, offset = g.new_input('var', (c,), scale=0.5, shift=1.0), g.new_input('var', (c,))
  fused = len(shape) == 4 and g.rng.rand() < 0.5
  return _op(g, 'batch_norm', [x, scale, offset], fused=fused)


def shape_batch_norm(op, shapes):
  x, scale, offset = (shapes[n] for n in op.inputs)
  _need(len(x) >= 2 and scale == offset == (x[-1],), f'batch norm {x} {scale}')
  _need(not op.param('fused') or len(x) == 4, f'fused batch norm of {x}')
  return x


def code_batch_norm(op, names, shapes):
  x, scale, offset = names
  if op.param('fused'):
    return f'fuzz.fused_batch_norm({x}, {scale}, {offset})'
  axes = list(range(len(shapes[op.inputs[0]]) - 1))
  return (
    f'tf.nn.batch_normalization({x}, *tf.nn.moments({x}, {axes}, keepdims=True), '
    f'{offset}, {scale}, 1e-3)'
  )


# --- control flow --------------------------------------------------------------------------
# Shape-preserving bodies of y; some reduce (a sum pending across the branch boundary). Not
# y - mean(y): any mean of it after is 0 in exact arithmetic, and float32's round-off of 0 is
# no result two programs can agree on (seen as a false mismatch of 5e-9 against 2e-9).
BRANCHES = {
  'tanh': 'tf.tanh(y)',
  'double': 'y * 2.0',
  'center': 'y - 0.5 * tf.reduce_mean(y)',
  'relu1': 'tf.nn.relu(y) + 1.0',
  'rownorm': 'y / (1.0 + tf.reduce_sum(tf.abs(y), axis=-1, keepdims=True))',
}
LOOP_BODIES = {
  'contract': 'tf.tanh(y) * 0.9 + 0.1',
  'mix': 'y * 0.5 + tf.reduce_mean(y, axis=-1, keepdims=True)',
  'matmul': 'tf.tanh(tf.matmul(y, w))',
}


@_needs_rank(1)
def draw_cond(g, x):
  pred = g.pred()
  true_fn, false_fn = g.choice(sorted(BRANCHES)), g.choice(sorted(BRANCHES))
  return _op(g, 'cond', [x, pred], true_fn=true_fn, false_fn=false_fn)


def shape_cond(op, shapes):
  return shapes[op.inputs[0]]


def code_cond(op, names, shapes):
  x, pred = names
  true_fn = _bind(BRANCHES[op.param('true_fn')], y=x)
  false_fn = _bind(BRANCHES[op.param('false_fn')], y=x)
  return f'tf.cond({pred} > 0, lambda: {true_fn}, lambda: {false_fn})'


def _bind(template: str, **names) -> str:
  """The template with each whole-word placeholder (y, w) replaced by a value's name."""
  for key, name in names.items():
    template = re.sub(rf'\b{key}\b', name, template)
  return template


@_needs_rank(1)
def draw_while(g, x):
  shape = g.shapes[x]
  body = g.choice(sorted(LOOP_BODIES) if len(shape) == 2 else ['contract', 'mix'])
  inputs = [x]
  if body == 'matmul':
    k = shape[-1]
    inputs.append(g.new_input('var', (k, k), scale=1 / math.sqrt(k)))
  return _op(g, 'while', inputs, body=body, steps=g.rng.randint(1, 4))


def shape_while(op, shapes):
  x = shapes[op.inputs[0]]
  if op.param('body') == 'matmul':
    _need(len(x) == 2 and shapes[op.inputs[1]] == (x[1], x[1]), f'loop matmul {x}')
  return x


def code_while(op, names, shapes):
  body = _bind(LOOP_BODIES[op.param('body')], w=names[-1])  # y stays the loop variable
  return (
    f'tf.while_loop(lambda i, y: i < {op.param("steps")}, lambda i, y: (i + 1, {body}), '
    f'[0, {names[0]}])[1]'
  )


FAMILIES: Dict[str, Family] = {
  'unary': Family(draw_unary, shape_elementwise, code_unary, 3),
  'binary': Family(draw_binary, shape_elementwise, code_binary, 3),
  'matmul': Family(draw_matmul, shape_matmul, code_matmul, 3),
  'reduce': Family(draw_reduce, shape_reduce, code_reduce, 2),
  'reshape': Family(draw_reshape, shape_reshape, code_reshape, 1.5),
  'transpose': Family(draw_transpose, shape_transpose, code_transpose, 1.5),
  'slice': Family(draw_slice, shape_slice, code_slice, 2),
  'pad': Family(draw_pad, shape_pad, code_pad, 1.5),
  'concat': Family(draw_concat, shape_concat, code_concat, 1.5),
  'gather': Family(draw_gather, shape_gather, code_gather, 1.5),
  'conv': Family(draw_conv, shape_conv, code_conv, 1.5),
  'pool': Family(draw_pool, shape_pool, code_pool, 1),
  'softmax': Family(draw_softmax, shape_softmax, code_softmax, 1),
  'batch_norm': Family(draw_batch_norm, shape_batch_norm, code_batch_norm, 1),
  'cond': Family(draw_cond, shape_cond, code_cond, 1),
  'while': Family(draw_while, shape_while, code_while, 1),
}
