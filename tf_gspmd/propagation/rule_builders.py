"""Helpers shared by the family modules to write rules compactly."""

from __future__ import annotations

from typing import Dict, Iterable, List, Optional, Sequence

from tf_gspmd.propagation.rule import NEED_REPLICATION, OpRule, TensorDims, dim_factors

LETTERS = 'ijklmnopqrstuvwxyzabcdefgh'


class Namer:
  """Fresh factor names i, j, k, ... then i1, j1, ...; skips names already taken."""

  def __init__(self, taken: Iterable[str] = ()):
    self._taken = set(taken)
    self._next = 0

  def fresh(self) -> str:
    while True:
      k, self._next = self._next, self._next + 1
      rnd, letter = divmod(k, len(LETTERS))
      name = LETTERS[letter] + (str(rnd) if rnd else '')
      if name not in self._taken:
        self._taken.add(name)
        return name

  def take(self, n: int) -> List[str]:
    return [self.fresh() for _ in range(n)]


def make_rule(
  operands,
  results,
  operand_shapes,
  result_shapes,
  kinds=None,
  windows=None,
  broadcast_operands=(),
  sizes=None,
) -> OpRule:
  """An OpRule whose plain (one-factor) dims get their factor size from the tensor shapes."""
  all_sizes: Dict[str, Optional[int]] = dict(sizes or {})
  for dims_list, shapes in ((operands, operand_shapes), (results, result_shapes)):
    for dims, shape in zip(dims_list, shapes):
      if dims is None or shape is None:
        continue
      for entry, size in zip(dims, shape):
        fs = dim_factors(entry)
        if len(fs) == 1 and size is not None and fs[0] not in (windows or {}):
          prev = all_sizes.get(fs[0])
          all_sizes[fs[0]] = size if prev is None else min(prev, size)
  return OpRule(
    operands=tuple(operands),
    results=tuple(results),
    kinds=dict(kinds or {}),
    sizes=all_sizes,
    windows=dict(windows or {}),
    broadcast_operands=tuple(broadcast_operands),
  )


def replicated_results(node, ctx, data_operands: Sequence[int] = (), aux=True) -> OpRule:
  """Every result dim is its own need-replication factor (shape vectors, small int outputs).

  Operands listed in `data_operands` get free pass-through factors (their
  sharding is unconstrained); the others are auxiliary.
  """
  namer = Namer()
  operands: List[TensorDims] = []
  op_shapes = []
  for i, t in enumerate(node.inputs):
    shape = ctx.shape(t)
    if i in data_operands and shape is not None:
      operands.append(tuple(namer.take(len(shape))))
    else:
      operands.append(None)
    op_shapes.append(shape)
  results: List[TensorDims] = []
  res_shapes, kinds = [], {}
  for out in node.outputs:
    shape = ctx.shape(out.name)
    if shape is None:
      results.append(None)
    else:
      fs = namer.take(len(shape))
      kinds.update({f: NEED_REPLICATION for f in fs})
      results.append(tuple(fs))
    res_shapes.append(shape)
  return make_rule(operands, results, op_shapes, res_shapes, kinds)


def normalize_axis(axis: int, rank: int, what: str) -> int:
  if not -rank <= axis < rank:
    raise ValueError(f'{what}: axis {axis} is out of range for rank {rank}.')
  return axis % rank


def data_shapes(node, ctx):
  return [ctx.shape(t) for t in node.inputs], [ctx.shape(o.name) for o in node.outputs]


def free_results(node, ctx, aux_operands=True) -> OpRule:
  """Results with fresh pass-through factors tied to nothing (constants, fills, random values).

  They take a sharding only from their users (backward propagation).
  """
  namer = Namer()
  in_shapes, out_shapes = data_shapes(node, ctx)
  results = [None if s is None else tuple(namer.take(len(s))) for s in out_shapes]
  return make_rule([None] * len(node.inputs), results, in_shapes, out_shapes)
