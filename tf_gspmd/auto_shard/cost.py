"""A planned layout priced: its collectives' seconds and the work one device computes (the cost
model of the package doc), and its per-device bytes against the budget (`Evaluation`)."""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Tuple

import numpy as np

from tf_gspmd.auto_shard.constants import Constants, load_constants
from tf_gspmd.mesh import Mesh
from tf_gspmd.planning import PlanReport
from tf_gspmd.sharding import NamedSharding


# --- evaluating a layout: plan it, price it -------------------------------------------------------
@dataclasses.dataclass
class Evaluation:
  """One planned layout and the cost model's terms."""

  choice: tuple  # per group: a P or AUTO; last: the inputs' batch axes (or None)
  report: PlanReport
  memory: int  # per-device bytes: parameters + optimizer state + activation peak
  collective_seconds: float
  collective_bytes: Dict[str, int]  # per kind, one device, per step
  repeated_work: int  # iteration-space points each device computes beyond its 1/N
  compute_seconds: float  # all the points one device computes, at the matmul rate

  @property
  def cost(self) -> float:
    return self.collective_seconds + self.compute_seconds

  def overflow(self, budget: int) -> int:
    return max(0, self.memory - budget)

  def key(self, budget: int) -> tuple:
    """Smaller is better: over the budget by less, then cheaper."""
    return (self.overflow(budget), self.cost)


def _axes_size(mesh: Mesh, axes) -> int:
  from tf_gspmd.graph_rewrite.reshard import refined_mesh

  names = set(mesh.axis_names)
  source = mesh if all(a in names for a in axes) else refined_mesh(mesh)[0]
  return int(np.prod([source.axis_size(a) for a in axes], dtype=np.int64))


def collective_cost(report: PlanReport, constants: Constants) -> Tuple[float, Dict[str, int]]:
  """(seconds, bytes per kind) of the step's collectives under the cost model."""
  seconds, by_kind = 0.0, {}
  for rec in report.collective_records:
    group = _axes_size(report.mesh, rec['axes'])
    seconds += constants.collective_seconds(rec['kind'], group, rec['bytes'])
    by_kind[rec['kind']] = by_kind.get(rec['kind'], 0) + rec['bytes']
  return seconds, by_kind


def work_per_device(propagation_plan, mesh: Mesh) -> Tuple[int, int]:
  """(points, repeated points) of iteration space one device computes, over every ruled op.

  An op's iteration space is the product of its rule's factor sizes (one
  space per group of factors joined by a tensor); it is split over the mesh
  axes its operands' and results' shardings give its factors
  (`OpRule.factor_axes`, the partitioner's own merge); a factor nobody
  splits is computed whole on every device. Repeated: beyond the 1/N share.
  """
  result, local_total, repeated = propagation_plan.result, 0.0, 0.0
  for graph in propagation_plan.program.graphs():
    shardings = result.shardings.get(graph.name, {})
    for node in graph.nodes:
      rule = result.rule(node.name, graph.name)
      if rule is None:
        continue
      tensors = list(node.inputs) + [o.name for o in node.outputs]
      sizes = _factor_sizes(rule, [graph.tensor(t).shape for t in tensors])
      if not sizes:
        continue
      axes = rule.factor_axes([_per_dim_axes(shardings.get(t)) for t in tensors], result.mesh)
      for space in _independent_spaces(rule, sizes):
        work = float(np.prod([sizes[f] for f in space], dtype=np.float64))
        local = float(
          np.prod(
            [-(-sizes[f] // _axes_size(result.mesh, axes.get(f, ()))) for f in space],
            dtype=np.float64,
          )
        )
        local_total += local
        repeated += max(0.0, local - work / mesh.size)
  return int(local_total), int(repeated)


def estimate(
  report: PlanReport, constants: Optional[Constants] = None, choice: tuple = ()
) -> 'Evaluation':
  """The cost model's terms for one planned step (see the module doc)."""
  constants = constants or load_constants()
  seconds, by_kind = collective_cost(report, constants)
  local, repeated = work_per_device(report.plan, report.mesh)
  memory = report.parameter_bytes + report.optimizer_bytes + report.activation_peak
  return Evaluation(
    choice, report, memory, seconds, by_kind, repeated, 2.0 * local / constants.matmul_flops
  )


def _independent_spaces(rule, sizes: Dict[str, int]) -> List[List[str]]:
  """Factors joined by a common tensor: one iteration space each (IdentityN's operands are
  several independent spaces, a matmul's one)."""
  from tf_gspmd.propagation.rule import dim_factors

  root = {f: f for f in sizes}

  def find(f):
    while root[f] != f:
      f = root[f]
    return f

  for dims in rule.tensor_dims():
    present = [f for e in dims or () for f in dim_factors(e) if f in sizes]
    for f in present[1:]:
      root[find(f)] = find(present[0])
  spaces: Dict[str, List[str]] = {}
  for f in sizes:
    spaces.setdefault(find(f), []).append(f)
  return list(spaces.values())


def _factor_sizes(rule, shapes) -> Dict[str, int]:
  from tf_gspmd.propagation.rule import dim_factors

  sizes = {}
  for dims, shape in zip(rule.tensor_dims(), shapes):
    if dims is None or shape is None or len(shape) != len(dims):
      continue
    for entry, size in zip(dims, shape):
      factors = dim_factors(entry)
      if len(factors) == 1 and size is not None:
        sizes.setdefault(factors[0], int(size))
      for f in factors[1:] if len(factors) > 1 else ():
        if rule.size(f):
          sizes.setdefault(f, int(rule.size(f)))
      if len(factors) > 1 and rule.size(factors[0]):
        sizes.setdefault(factors[0], int(rule.size(factors[0])))
  return sizes


def _per_dim_axes(sharding) -> Optional[list]:
  if not isinstance(sharding, NamedSharding) or sharding.rank is None:
    return None
  return [tuple(sharding.spec.axes_of(d)) for d in range(sharding.rank)]
