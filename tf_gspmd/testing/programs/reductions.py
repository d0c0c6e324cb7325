"""Sweep programs of reductions, scans, softmax and losses.

The program `reductions` reads `sweep_params['form']` of each entry naming it
('reduce', 'reduce_bool', 'arg_reduce', 'scan'; others have a program of
their own below) and `near_one` (values drawn near 1, so products stay finite).
Entries come in `DRAW_ORDER`, the order values were always drawn in (the draws
share one seeded stream).
"""

from __future__ import annotations

from typing import List

from tf_gspmd.propagation import registry
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
from tf_gspmd.testing.programs import in_draw_order

# Per form, the order values were always drawn in (see `in_draw_order`).
DRAW_ORDER = {
  'reduce': ('Sum', 'Max', 'Min', 'Mean', 'EuclideanNorm', 'Prod'),
  'reduce_bool': ('All', 'Any'),
  'arg_reduce': ('ArgMax', 'ArgMin'),
  'scan': ('Cumsum', 'Cumprod', 'CumulativeLogsumexp'),
}


def _ops_named(entries, form: str) -> List[str]:
  return [e.op_type for e in in_draw_order(entries, form, DRAW_ORDER[form])]


def _param(op: str, name: str):
  return registry.entry_of(op).sweep_params.get(name)


@program('reductions')
def reductions(entries) -> List[OpSpec]:
  v = Values('reductions')
  x3 = v.uniform(UNARY_SHAPE)
  out = []
  for op in _ops_named(entries, 'reduce'):
    # A product of values near 1 stays finite.
    values = v.uniform(UNARY_SHAPE, 0.7, 1.3) if _param(op, 'near_one') else x3
    out.append(spec(op, lambda a, op=op: raw(op, a, [1]), arg(values)))
    out.append(
      spec(
        f'{op}/two_axes_keepdims', lambda a, op=op: raw(op, a, [0, 2], keep_dims=True), arg(values)
      )
    )
  for op in _ops_named(entries, 'reduce_bool'):
    out.append(spec(op, lambda a, op=op: raw(op, a, [1]), arg(v.rng.rand(*UNARY_SHAPE) < 0.9)))
    out.append(
      spec(
        f'{op}/all_axes',
        lambda a, op=op: raw(op, a, [0, 1, 2]),
        arg(v.rng.rand(*UNARY_SHAPE) < 0.97),
      )
    )
  for op in _ops_named(entries, 'arg_reduce'):
    out.append(spec(op, lambda a, op=op: raw(op, a, 1), arg(v.uniform((10, 7)))))
    out.append(spec(f'{op}/axis0', lambda a, op=op: raw(op, a, 0), arg(v.uniform((10, 7)))))
  out.append(spec('BiasAddGrad', lambda a: raw('BiasAddGrad', a), arg(v.uniform((4, 10, 3)))))
  for op in _ops_named(entries, 'scan'):
    values = v.uniform((10, 7), 0.7, 1.3) if _param(op, 'near_one') else v.uniform((10, 7))
    out.append(spec(op, lambda a, op=op: raw(op, a, 1), arg(values)))
    out.append(
      spec(
        f'{op}/axis0_exclusive_reverse',
        lambda a, op=op: raw(op, a, 0, exclusive=True, reverse=True),
        arg(values),
      )
    )
  out.append(spec('L2Loss', lambda a: raw('L2Loss', a), arg(v.uniform(BINARY_SHAPE))))
  out.append(spec('Softmax', lambda a: raw('Softmax', a), arg(v.uniform((10, 7)))))
  out.append(spec('LogSoftmax', lambda a: raw('LogSoftmax', a), arg(v.uniform((10, 7)))))
  labels = v.uniform((10, 7), 0.0, 1.0)
  labels = labels / labels.sum(axis=1, keepdims=True)
  out.append(
    spec(
      'SoftmaxCrossEntropyWithLogits',
      lambda a, b: tuple(raw('SoftmaxCrossEntropyWithLogits', a, b)),
      arg(v.uniform((10, 7))),
      arg(labels),
    )
  )
  out.append(
    spec(
      'SparseSoftmaxCrossEntropyWithLogits',
      lambda a, b: tuple(raw('SparseSoftmaxCrossEntropyWithLogits', a, b)),
      arg(v.uniform((10, 7))),
      arg(v.ints((10,), 0, 7)),
    )
  )
  out.append(spec('TopKV2', lambda a: tuple(raw('TopKV2', a, 3)), arg(v.uniform((10, 7)))))
  return out
