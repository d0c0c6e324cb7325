"""Settling a conflict between factors of one op by the bytes each settlement moves.

Two factors of one op may be proposed the same mesh axis by different tensors
(an embedding table split on its hidden dim over 'batch', FSDP-style, gathered
by ids split on their batch dim over 'batch'). Only one factor can keep it; the
tensor whose proposal loses is resharded by the partitioner (all-gathered over
the axis). Rule order alone would keep the table's split and gather the ids,
moving the whole batch; here each settlement is priced and the cheapest wins
(rule order among equals, and whenever a shape is unknown).

Prices follow the reshard search's cost model (`graph_rewrite.reshard.moves`:
bytes the busiest device receives; an all-gather over g devices receives g-1
blocks, an all-reduce 2(g-1) pieces of E/g elements), on plain per-dim block
sizes: the reshard search sits above propagation, and a conflict is between
all-gathers and pending sums, which this prices exactly for even shardings.
"""

from __future__ import annotations

import math
from typing import Dict, Mapping, Optional, Sequence, Tuple

from tf_gspmd.mesh import Mesh
from tf_gspmd.propagation.rule import NEED_REPLICATION, REDUCTION, OpRule

Axes = Tuple[str, ...]
Spec = Tuple[Axes, ...]


def settle(
  rule: OpRule,
  chosen: Mapping[str, Axes],
  specs: Sequence[Optional[Spec]],
  shapes: Sequence[Optional[Sequence[Optional[int]]]],
  sizes: Sequence[int],
  mesh: Mesh,
) -> Dict[str, Axes]:
  """`rule.resolve_axes(chosen)`, or, where factors conflict over an axis, the settlement
  moving the fewest bytes (each conflicting factor tried first in turn).

  `specs`, `shapes` and `sizes` list operand then result tensors: current axes
  per dim (None: not known yet, or auxiliary), static shape, bytes per element.
  """
  default = rule.resolve_axes(chosen)
  cut = [f for f in rule.factors() if _lost_axes(rule, f, chosen, default)]
  if not cut:
    return default
  best, best_cost = default, price(rule, default, specs, shapes, sizes, mesh)
  if best_cost is None:
    return default
  for f in cut:
    settled = rule.resolve_axes(chosen, first=(f,))
    cost = price(rule, settled, specs, shapes, sizes, mesh)
    if cost is not None and cost < best_cost:
      best, best_cost = settled, cost
  return best


def _lost_axes(rule: OpRule, f: str, chosen, resolved) -> bool:
  """Whether factor `f` lost axes it was proposed to another factor (not to its kind)."""
  if rule.kind(f) == NEED_REPLICATION:
    return False
  return len(resolved.get(f, ())) < len(tuple(chosen.get(f, ())))


def price(rule, resolved, specs, shapes, sizes, mesh) -> Optional[int]:
  """Bytes the busiest device receives to run the op under `resolved`: operands all-gathered
  from their axes to the ones it needs, results from theirs to the axes they already have,
  pending sums all-reduced. None when a shape the price needs is unknown."""
  n_in = len(rule.operands)
  total = 0
  for t, (dims, spec) in enumerate(zip(rule.tensor_dims(), specs)):
    if dims is None or spec is None:
      continue
    shape = shapes[t]
    if shape is None or None in shape:
      return None
    need = rule.tensor_spec(dims, resolved, mesh, shape)
    have, want = (spec, need) if t < n_in else (need, spec)
    total += gather_bytes(have, want, shape, sizes[t], mesh)
  summed = results_all_reduce_bytes(
    rule, resolved, _pending_axes(rule, resolved), shapes, sizes, mesh
  )
  return None if summed is None else total + summed


def results_all_reduce_bytes(rule, resolved, axes: Axes, shapes, sizes, mesh) -> Optional[int]:
  """Bytes the busiest device receives to all-reduce the op's results (laid out as
  `resolved` makes them) over `axes`. None when a result's shape is unknown."""
  if not axes:
    return 0
  n_in = len(rule.operands)
  total = 0
  for dims, shape, size in zip(rule.results, shapes[n_in:], sizes[n_in:]):
    if dims is None:
      continue
    if shape is None or None in shape:
      return None
    need = rule.tensor_spec(dims, resolved, mesh, shape)
    total += all_reduce_bytes(need, axes, shape, size, mesh)
  return total


def _pending_axes(rule: OpRule, resolved) -> Axes:
  return tuple(a for f in rule.factors() if rule.kind(f) == REDUCTION for a in resolved.get(f, ()))


def gather_bytes(have: Spec, want: Spec, shape, size: int, mesh: Mesh) -> int:
  """Bytes one device receives to take `have` to `want`: the axes `want` lacks all-gathered
  (g-1 blocks), then the axes it holds on another dim moved by an all-to-all (g-1 pieces of
  a block split g ways); axes `want` adds are local slices."""
  lost = [a for d, axes in enumerate(have) for a in axes if a not in _dim(want, d)]
  if not lost:
    return 0
  wanted = {a for axes in want for a in axes}
  moved = _group(mesh, [a for a in lost if a in wanted])
  gathered = _group(mesh, [a for a in lost if a not in wanted])
  block = block_elems(have, shape, mesh)
  exchanged = (moved - 1) * -(-block * gathered // moved)
  return ((gathered - 1) * block + exchanged) * size


def _group(mesh: Mesh, axes) -> int:
  return math.prod(mesh.axis_size(a) for a in axes)


def all_reduce_bytes(spec: Spec, axes: Axes, shape, size: int, mesh: Mesh) -> int:
  group = math.prod(mesh.axis_size(a) for a in axes)
  return 2 * (group - 1) * -(-block_elems(spec, shape, mesh) // group) * size


def block_elems(spec: Spec, shape, mesh: Mesh) -> int:
  """Elements of one device's block (ceil shards, as the partitioner pads them)."""
  n = 1
  for d, s in enumerate(shape):
    n *= -(-int(s) // max(1, math.prod(mesh.axis_size(a) for a in _dim(spec, d))))
  return n


def _dim(spec: Spec, d: int) -> Axes:
  return tuple(spec[d]) if d < len(spec) and spec[d] else ()
