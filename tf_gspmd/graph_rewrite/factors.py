"""Partitioning from a propagation rule (einsum-like factors).

A rule maps every operand and result dim to a factor. Choosing mesh axes for
each factor fixes every operand's required layout and the result's layout:
a sharded pass-through factor runs locally; a sharded reduction factor leaves
partial results (a pending reduction over its axes) that the result's reshard
resolves by all-reduce or reduce-scatter; a need-replication factor is never
sharded. Candidate assignments come from the propagated result sharding and
from each operand's current sharding (so operands are used as they are when
that is cheapest); the one moving the fewest bytes wins, then the one running
the fewest collectives, then the one with the smallest peak buffer.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Dict, List, Optional, Sequence, Tuple

import tensorflow as tf

from tf_gspmd.graph_rewrite import uneven
from tf_gspmd.graph_rewrite.handlers import emit_outputs, global_shape
from tf_gspmd.graph_rewrite.partitioner import Local, Partitioner
from tf_gspmd.propagation.rule import REDUCTION, OpRule, dim_factors
from tf_gspmd.sharding import NamedSharding, P

Assignment = Dict[str, Tuple[str, ...]]


def rule_for(p: Partitioner, node, graph):
  from tf_gspmd.propagation import registry

  return registry.rule_for(node, p.rule_context(graph))


def has_rule(node, graph) -> bool:
  from tf_gspmd.propagation import registry

  entry = registry.lookup(node.op)
  return entry is not None and entry.rule is not None


def candidates(
  p: Partitioner,
  rule,
  operands: Sequence[Local],
  targets: Sequence[NamedSharding],
  windowed: bool = False,
) -> List[Assignment]:
  """Factor assignments worth costing: results first, then each operand first.

  Each takes every factor's axes from the first tensor in its preference
  order that shards it, so operands can be used as they are. Where two
  factors are proposed one axis, both settlements are costed: rule order's,
  and this order's own preference (a dot whose contraction and free dim both
  want an axis: the weight moved, or the activation).
  """
  specs = [
    None if dims is None else _axes(op.sharding) for dims, op in zip(rule.operands, operands)
  ] + [_axes(t) for t in targets]
  proposals = rule.factor_candidates(specs, p.mesh)
  n = len(rule.operands)
  orders = [list(range(n, n + len(targets))) + list(range(n))]
  orders += [
    [i] + [j for j in range(n + len(targets)) if j != i]
    for i in range(n)
    if rule.operands[i] is not None
  ]
  out = []
  for order in orders:
    rank = {t: k for k, t in enumerate(order)}
    chosen, source = {}, {}
    for f, props in proposals.items():
      if props:
        chosen[f], source[f] = min(props, key=lambda prop: rank[prop[1]])
    # Two factors proposed one axis: rule order settles it, and so does this order's
    # preference (the result's layout kept, or an operand's), so the cheaper is costed too.
    settled = [
      rule.resolve_axes(chosen),
      rule.resolve_axes(chosen, first=sorted(chosen, key=lambda f: rank[source[f]])),
    ]
    for assignment in settled:
      if not windowed:
        assignment = _drop_windowed(rule, assignment)
      if assignment not in out:
        out.append(assignment)
  return out


def _axes(s: NamedSharding):
  return tuple(s.spec.axes_of(d) for d in range(len(s.spec)))


def _drop_windowed(rule, assignment: Assignment) -> Assignment:
  """Windowed factors (conv/pool spatial dims) need halos: not sharded here."""
  return {f: (() if f in rule.windows else axes) for f, axes in assignment.items()}


@dataclasses.dataclass(frozen=True)
class FactorLayouts:
  """One factor assignment of an op's rule and the layouts it fixes.

  `operands[i]` is the layout operand i must be resharded to (None: an
  auxiliary operand, used whole); `results[j]` the layout result j has when
  the op runs locally on those operands, with a pending reduction over the
  axes of sharded reduction factors.
  """

  rule: OpRule
  factor_axes: Assignment
  operands: Tuple[Optional[NamedSharding], ...]
  results: Tuple[NamedSharding, ...]

  def axes(self, factor: str) -> Tuple[str, ...]:
    return tuple(self.factor_axes.get(factor, ()))

  @property
  def reduced(self) -> set:
    """Reduction factors that are sharded (their results are partial)."""
    return {f for f, axes in self.factor_axes.items() if axes and self.rule.kind(f) == REDUCTION}


def choose_layouts(
  p: Partitioner,
  graph,
  node,
  operands: Sequence[Local],
  rule=None,
  windowed: bool = False,
  combinable: bool = True,
  reduction: str = 'sum',
  whole: Sequence[str] = (),
) -> FactorLayouts:
  """The operand and result layouts of `node` under the cheapest factor assignment of its rule.

  Candidates come from the propagated result shardings and from each
  operand's current sharding (`candidates`); the one moving the fewest bytes
  wins, then the one running the fewest collectives, then the smallest peak
  buffer. Windowed factors (conv and pool spatial dims) stay whole unless the
  caller computes halos
  (`windowed=True`); reduction factors stay whole when partial results
  cannot be combined (`combinable=False`), and so do the factors in `whole`.
  Every hand-written handler of an op with a rule takes its layouts from
  here, so rule and handler agree.
  """
  rule = rule if rule is not None else rule_for(p, node, graph)
  targets = [p.target(graph, t.name) for t in node.outputs]
  shapes = [_known_shape(graph, t.name) for t in node.outputs]
  # The choice depends only on what the key holds: the ops of repeated layers (and a
  # layer's forward and backward alike) are costed once per partitioner.
  key = _choice_key(rule, operands, targets, shapes, (windowed, combinable, reduction, whole))
  memo = p.layout_choices
  if key is not None and key in memo:
    return memo[key]
  chosen = _cheapest(p, rule, operands, targets, shapes, windowed, combinable, reduction, whole)
  if key is not None:
    memo[key] = chosen
  return chosen


def _choice_key(rule, operands: Sequence[Local], targets, shapes, options) -> Optional[tuple]:
  """What `choose_layouts`' choice depends on, hashable; None when a part is not."""
  try:
    key = (
      rule.structure(),
      tuple(
        (_named(op.sharding), None if op.shape is None else tuple(op.shape), op.dtype)
        for op in operands
      ),
      tuple(_named(t) for t in targets),
      tuple(shapes),
      options[:3],
      tuple(options[3]),
    )
    hash(key)
  except TypeError:
    return None
  return key


def _named(sharding: NamedSharding) -> tuple:
  """A sharding as its spec is written (equal shardings may name their axes differently,
  and the candidates are read off the names)."""
  return sharding.mesh, sharding.spec, sharding.partial_axes, sharding.reduction


def _cheapest(
  p: Partitioner, rule, operands, targets, shapes, windowed, combinable, reduction, whole
) -> FactorLayouts:
  options = candidates(p, rule, operands, targets, windowed)

  def keep(f):
    return f not in whole and (combinable or rule.kind(f) != REDUCTION)

  options = [{f: (a if keep(f) else ()) for f, a in c.items()} for c in options]
  if any(dims is not None and not _static(op.shape) for dims, op in zip(rule.operands, operands)):
    # A value of run-time shape is replicated and cannot be resharded (the reshard search needs
    # every dim): the assignment splitting nothing keeps it as it is.
    options.append({f: () for f in rule.factors()})
  layouts = [layouts_of(p, rule, c, operands, shapes, reduction) for c in options]
  return min(layouts, key=lambda lay: _cost(p, lay, operands, shapes, targets))


def layouts_of(
  p: Partitioner,
  rule,
  assignment: Assignment,
  operands: Sequence[Local],
  result_shapes,
  reduction: str = 'sum',
) -> FactorLayouts:
  """(operand layouts, result layouts) of one factor assignment, cut to what every tensor
  can hold (`OpRule.representable`: compound dims, dims smaller than their shard count)."""
  shapes = [None if dims is None else op.shape for dims, op in zip(rule.operands, operands)]
  effective = rule.representable(assignment, p.mesh, shapes + list(result_shapes))
  op_specs = rule.operand_specs(effective, p.mesh, shapes)
  needs = tuple(None if spec is None else NamedSharding(p.mesh, spec) for spec in op_specs)
  partial = tuple(
    a for f in rule.factors() if rule.kind(f) == REDUCTION for a in effective.get(f, ())
  )
  res_specs = rule.result_specs(effective, p.mesh, result_shapes)
  results = tuple(
    NamedSharding(
      p.mesh,
      spec if spec is not None else P(*([None] * len(shape or ()))),
      partial if spec is not None else (),
      reduction,
    )
    for spec, shape in zip(res_specs, result_shapes)
  )
  return FactorLayouts(rule, effective, needs, results)


def _known_shape(graph, tensor: str):
  shape = graph.tensor(tensor).shape
  return None if shape is None or None in shape else tuple(int(d) for d in shape)


def _static(shape) -> bool:
  return shape is not None and None not in tuple(shape)


def _cost(p, layouts: FactorLayouts, operands, result_shapes, targets):
  """(bytes moved, collectives, peak buffer) per device: bytes first; at equal bytes the
  assignment running fewer collectives (each has a fixed latency), then the smaller peak."""
  moved = count = peak = 0
  for need, op in zip(layouts.operands, operands):
    if need is not None and not _static(op.shape):
      if not op.sharding.is_equivalent_to(need):
        return math.inf, math.inf, math.inf  # a value of run-time shape stays as it is
    elif need is not None:
      m, c, k = p.reshard_price(op.sharding, need, op.shape, op.dtype.size)
      moved, count, peak = moved + m, count + c, max(peak, k)
  for have, shape, target in zip(layouts.results, result_shapes, targets):
    if shape is None:
      continue
    m, c, k = p.reshard_price(have, target, shape, 4)
    moved, count, peak = moved + m, count + c, max(peak, k)
  return moved, count, peak


def factor_handler(p: Partitioner, graph, node, operands: List[Local]) -> List[Local]:
  """An op with a rule and no hand-written handler: reshard operands to the chosen
  layouts and run the op as it is on the local blocks."""
  from tf_gspmd.propagation import registry

  entry = registry.entry_of(node.op)
  # A mean leaves a pending sum, scaled once it is taken (`_mean`).
  reduction = 'sum' if entry.reduction == 'mean' else entry.reduction
  chosen = choose_layouts(
    p, graph, node, operands, combinable=entry.combinable, reduction=reduction
  )
  inputs = []
  for i, (dims, need, op) in enumerate(zip(chosen.rule.operands, chosen.operands, operands)):
    if need is None:  # an auxiliary operand (axis list, shape): used whole
      inputs.append(p.replicate(op, 'auxiliary operand').tensor)
      continue
    local = p.reshard(op, need, f'operand {i} of {node.op}')
    inputs.append(_mask_reduced(p, dims, local, chosen.reduced, reduction))
  d = entry.divisor
  if d is not None and len(inputs) > d:
    # Padding holds zeros; an integer division by them is an error, not just garbage.
    divisor = Local(inputs[d], chosen.operands[d], operands[d].shape)
    inputs[d] = uneven.mask_padding(
      divisor.tensor,
      divisor.sharding,
      divisor.shape,
      range(len(divisor.shape)),
      1,
      p.backend.partition_id,
    )
  shapes = [global_shape(graph, t.name) for t in node.outputs]
  if entry.reduction == 'mean':
    return _mean(p, graph, node, inputs, chosen.results, operands[0].shape, shapes[0])
  return emit_outputs(p, graph, node, inputs, chosen.results)


def _mean(p, graph, node, inputs, results, in_shape, out_shape) -> List[Local]:
  """A mean over sharded rows is a sum scaled by the true (unpadded) count.

  Scaling before the pending sum is resolved is exact, since the sum is linear.
  """
  total = emit_outputs(p, graph, node, inputs, results, op_type='Sum', finish=False)[0]
  count = math.prod(in_shape) // max(1, math.prod(out_shape))
  scaled = tf.math.multiply(
    total.tensor, tf.cast(1.0 / count, total.dtype), name=node.name + '/gspmd/mean'
  )
  value = Local(scaled, total.sharding, total.shape)
  return [p.finish(graph, value, node.outputs[0].name)]


def _mask_reduced(p, dims, local: Local, reduced, reduction) -> tf.Tensor:
  """Fill the padding of sharded reduction dims with the reduction's identity."""
  padded = [d for d, e in enumerate(dims) if set(dim_factors(e)) & reduced]
  if not padded:
    return local.tensor
  fill = uneven.identity_value(reduction, local.dtype)
  return uneven.mask_padding(
    local.tensor, local.sharding, local.shape, padded, fill, p.backend.partition_id
  )
