"""A planned layout priced: the step's features (`tf_gspmd.step_cost`: ops, contraction flops,
elementwise bytes, collectives) on this machine's profile (`Constants.profile()`: the
collectives measured by `calibrate()`, the rest fit to measured steps by `fit`), and its
per-device bytes against the budget (`Evaluation`)."""

from __future__ import annotations

import dataclasses
from typing import Dict, Optional, Tuple

from tf_gspmd.auto_shard.constants import Constants, load_constants
from tf_gspmd.planning import PlanReport
from tf_gspmd.step_cost import (
  HardwareProfile,
  StepFeatures,
  StepTime,
  step_features,
  step_time,
  work_of_propagation,
)


# --- evaluating a layout: plan it, price it -------------------------------------------------------
@dataclasses.dataclass
class Evaluation:
  """One priced layout: its step's features and their time on the profile."""

  choice: tuple  # per group: a P or AUTO; last: the inputs' batch axes (or None)
  report: Optional[PlanReport]  # None: priced by the fast model alone
  memory: int  # per-device bytes: parameters + optimizer state + activation peak
  features: StepFeatures
  profile: HardwareProfile
  repeated_work: int  # iteration-space points each device computes beyond its 1/N

  @property
  def time(self) -> StepTime:
    found = self.__dict__.get('_time')
    if found is None:
      found = self.__dict__['_time'] = step_time(self.features, self.profile)
    return found

  @property
  def cost(self) -> float:
    return self.time.total

  @property
  def collective_seconds(self) -> float:
    return self.time.collectives

  @property
  def compute_seconds(self) -> float:
    """Contractions, memory traffic and launch overhead: everything but the collectives."""
    t = self.time
    return t.compute + t.memory + t.launch

  @property
  def collective_bytes(self) -> Dict[str, int]:
    """Per kind: the local operand bytes of one device's collectives in one step."""
    out: Dict[str, int] = {}
    for kind, _, _, nbytes in self.features.collectives:
      out[kind] = out.get(kind, 0) + nbytes
    return out

  def overflow(self, budget: int) -> int:
    return max(0, self.memory - budget)

  def key(self, budget: int) -> tuple:
    """Smaller is better: over the budget by less, then cheaper."""
    return (self.overflow(budget), self.cost)


def collective_cost(report: PlanReport, constants: Constants) -> Tuple[float, Dict[str, int]]:
  """(seconds, bytes per kind) of the step's collectives on this machine's profile."""
  evaluation = estimate(report, constants)
  return evaluation.collective_seconds, evaluation.collective_bytes


def work_per_device(propagation, mesh) -> Tuple[int, int]:
  """(points, repeated points) of iteration space one device computes, over every ruled op
  (`tf_gspmd.step_cost.work_of_propagation`)."""
  work = work_of_propagation(propagation, mesh)
  return int(work.points), int(work.repeated)


def estimate(
  report: PlanReport, constants: Optional[Constants] = None, choice: tuple = ()
) -> Evaluation:
  """The cost model's terms for one planned step (see the package doc)."""
  constants = constants or load_constants()
  profile = constants.profile()
  work = work_of_propagation(report.propagation, report.mesh, profile.vector_bytes)
  features = step_features(report.propagation, report.mesh, report.collective_records, work)
  memory = report.parameter_bytes + report.optimizer_bytes + report.activation_peak
  return Evaluation(choice, report, memory, features, profile, int(work.repeated))
