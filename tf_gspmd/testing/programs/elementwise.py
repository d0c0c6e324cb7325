"""Sweep programs of elementwise ops: one kind per operand form, read from each op's entry.

Kinds: `unary` (float input drawn from `sweep_params['domain']`), `unary_special`
(inf and nan among the values), `unary_complex`, `binary` (float inputs from the
domains `x` and `y`), `binary_int` (integer inputs, `y` a range or 'nonzero', `x`
a range), `compare`, `logical`, and `elementwise` for the ops with a program of
their own (casts, annotations, broadcasting, ternary ops, n-ary ops).
"""

from __future__ import annotations

from typing import List

import numpy as np
import tensorflow as tf

from tf_gspmd.testing.op_builders import (
  BINARY_SHAPE,
  UNARY_SHAPE,
  OpSpec,
  Values,
  arg,
  program,
  raw,
  spec,
)


def _float_values(v: Values, shape, kind):
  if kind is None:
    return v.uniform(shape)
  if kind == 'nonzero':
    return v.nonzero(shape)
  if kind == 'with_zeros':
    x = v.uniform(shape).reshape(-1)
    x[::4] = 0.0
    return x.reshape(shape)
  if kind == 'orders':
    return v.ints(shape, 0, 3).astype(np.float32)
  return v.uniform(shape, *kind)


def _replicated_annotation(x):
  from tf_gspmd.annotations import replicate

  return tf.identity(replicate(x))


def _unary(op, x) -> OpSpec:
  return spec(op, lambda a, op=op: raw(op, a), arg(x))


def _binary(op, x, y) -> OpSpec:
  return spec(op, lambda a, b, op=op: raw(op, a, b), arg(x), arg(y))


@program('unary')
def unary(entries) -> List[OpSpec]:
  """`sweep_params['domain']`: the (low, high) the input is drawn from (default (-2, 2))."""
  out = []
  for e in entries:
    v = Values(e.op_type)
    out.append(
      _unary(e.op_type, v.uniform(UNARY_SHAPE, *e.sweep_params.get('domain', (-2.0, 2.0))))
    )
  return out


@program('unary_special')
def unary_special(entries) -> List[OpSpec]:
  return [_unary(e.op_type, Values(e.op_type).specials(UNARY_SHAPE)) for e in entries]


@program('unary_complex')
def unary_complex(entries) -> List[OpSpec]:
  return [_unary(e.op_type, Values(e.op_type).complex(BINARY_SHAPE)) for e in entries]


@program('binary')
def binary(entries) -> List[OpSpec]:
  """`sweep_params['x']`, `['y']`: each input's domain (`_float_values`; default (-2, 2))."""
  out = []
  for e in entries:
    v = Values(e.op_type)
    kx, ky = e.sweep_params.get('x'), e.sweep_params.get('y')
    out.append(
      _binary(e.op_type, _float_values(v, BINARY_SHAPE, kx), _float_values(v, BINARY_SHAPE, ky))
    )
  return out


@program('compare')
def compare(entries) -> List[OpSpec]:
  out = []
  for e in entries:
    v = Values(e.op_type)
    out.append(_binary(e.op_type, v.ints(BINARY_SHAPE, 0, 3), v.ints(BINARY_SHAPE, 0, 3)))
  return out


@program('binary_int')
def binary_int(entries) -> List[OpSpec]:
  """Integer inputs: `sweep_params['y']` a (low, high) range or 'nonzero', `['x']` a range
  (default [-20, 20))."""
  out = []
  for e in entries:
    v = Values(e.op_type)
    ky = e.sweep_params['y']
    y = v.nonzero_ints(BINARY_SHAPE) if ky == 'nonzero' else v.ints(BINARY_SHAPE, *ky)
    x = v.ints(BINARY_SHAPE, *e.sweep_params.get('x', (-20, 20)))
    out.append(_binary(e.op_type, x, y))
  return out


@program('logical')
def logical(entries) -> List[OpSpec]:
  out = []
  for e in entries:
    v = Values(e.op_type)
    out.append(_binary(e.op_type, v.bools(BINARY_SHAPE), v.bools(BINARY_SHAPE)))
  return out


@program('elementwise')
def elementwise(entries) -> List[OpSpec]:
  """Programs of their own: casts, annotations, broadcasting binary ops, ternary and n-ary
  ops, bias additions."""
  out = []
  v = Values('unary_int')
  out.append(spec('Invert', lambda a: raw('Invert', a), arg(v.ints(UNARY_SHAPE, -50, 50))))
  out.append(
    spec('PopulationCount', lambda a: raw('PopulationCount', a), arg(v.ints(UNARY_SHAPE, -50, 50)))
  )
  out.append(spec('LogicalNot', lambda a: raw('LogicalNot', a), arg(v.bools(UNARY_SHAPE))))
  out.append(
    spec(
      'CheckNumerics',
      lambda a: raw('CheckNumerics', a, message='sweep'),
      arg(v.uniform(UNARY_SHAPE)),
    )
  )
  out.append(
    spec(
      'EnsureShape',
      lambda a: raw('EnsureShape', a, shape=list(UNARY_SHAPE)),
      arg(v.uniform(UNARY_SHAPE)),
    )
  )
  out.append(
    spec('Cast', lambda a: raw('Cast', a, DstT=tf.int32), arg(v.uniform(UNARY_SHAPE, -5, 5)))
  )
  out.append(
    spec(
      'Cast/int_to_float',
      lambda a: raw('Cast', a, DstT=tf.float32),
      arg(v.ints(UNARY_SHAPE, -5, 5)),
    )
  )
  out.append(
    spec('Bitcast', lambda a: raw('Bitcast', a, type=tf.int32), arg(v.uniform(BINARY_SHAPE)))
  )
  out.append(
    spec('Bitcast/widen', lambda a: raw('Bitcast', a, type=tf.int64), arg(v.ints((10, 2), -50, 50)))
  )
  out.append(
    spec(
      'XlaSharding',
      _replicated_annotation,
      arg(v.uniform(UNARY_SHAPE)),
      note='annotations themselves: input annotation, a replicated one, out_shardings',
    )
  )

  v = Values('broadcast')
  out.append(
    spec(
      'AddV2/broadcast_row',
      lambda a, b: raw('AddV2', a, b),
      arg(v.uniform(UNARY_SHAPE)),
      arg(v.uniform((3,))),
    )
  )
  out.append(
    spec(
      'Mul/broadcast_column',
      lambda a, b: raw('Mul', a, b),
      arg(v.uniform((10, 1))),
      arg(v.uniform(BINARY_SHAPE)),
    )
  )
  out.append(
    spec(
      'Sub/broadcast_both',
      lambda a, b: raw('Sub', a, b),
      arg(v.uniform((7, 1, 3))),
      arg(v.uniform((10, 1))),
    )
  )
  out.append(
    spec(
      'ApproximateEqual',
      lambda a, b: raw('ApproximateEqual', a, b, tolerance=0.5),
      arg(v.uniform(BINARY_SHAPE)),
      arg(v.uniform(BINARY_SHAPE)),
    )
  )
  out.append(
    spec(
      'Complex',
      lambda a, b: raw('Complex', a, b, Tout=tf.complex64),
      arg(v.uniform(BINARY_SHAPE)),
      arg(v.uniform(BINARY_SHAPE)),
    )
  )
  v = Values('ternary')
  out.append(
    spec(
      'Betainc',
      lambda a, b, x: raw('Betainc', a, b, x),
      arg(v.uniform(BINARY_SHAPE, 0.5, 3.0)),
      arg(v.uniform(BINARY_SHAPE, 0.5, 3.0)),
      arg(v.uniform(BINARY_SHAPE, 0.05, 0.95)),
    )
  )
  out.append(
    spec(
      'Select',
      lambda c, a, b: raw('Select', c, a, b),
      arg(v.bools(BINARY_SHAPE)),
      arg(v.uniform(BINARY_SHAPE)),
      arg(v.uniform(BINARY_SHAPE)),
    )
  )
  out.append(
    spec(
      'SelectV2',
      lambda c, a, b: raw('SelectV2', c, a, b),
      arg(v.bools((10, 1))),
      arg(v.uniform(BINARY_SHAPE)),
      arg(v.uniform((3,))),
    )
  )
  out.append(
    spec(
      'ClipByValue',
      lambda x, lo, hi: raw('ClipByValue', x, lo, hi),
      arg(v.uniform(BINARY_SHAPE)),
      arg(v.uniform(BINARY_SHAPE, -1.0, 0.0)),
      arg(v.uniform(BINARY_SHAPE, 0.0, 1.0)),
    )
  )
  out.append(
    spec(
      'ClipByValue/scalar_bounds',
      lambda x, lo, hi: raw('ClipByValue', x, lo, hi),
      arg(v.uniform(UNARY_SHAPE)),
      arg(np.float32(-0.5)),
      arg(np.float32(0.7)),
    )
  )
  out.append(
    spec(
      'AddN',
      lambda a, b, c: raw('AddN', [a, b, c]),
      arg(v.uniform(BINARY_SHAPE)),
      arg(v.uniform(BINARY_SHAPE)),
      arg(v.uniform(BINARY_SHAPE)),
    )
  )
  out.append(
    spec(
      'IdentityN',
      lambda a, b: tuple(raw('IdentityN', [a, b])),
      arg(v.uniform(BINARY_SHAPE)),
      arg(v.uniform((7,))),
    )
  )
  out.append(
    spec(
      'BiasAdd', lambda x, b: raw('BiasAdd', x, b), arg(v.uniform((4, 10, 3))), arg(v.uniform((3,)))
    )
  )
  out.append(
    spec(
      'BiasAddV1',
      lambda x, b: raw('BiasAddV1', x, b),
      arg(v.uniform((4, 10, 3))),
      arg(v.uniform((3,))),
    )
  )
  return out
