"""`AutoShardResult`: the chosen layouts, how to apply them, and the report saying why."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Dict, List

import numpy as np

from tf_gspmd import annotations
from tf_gspmd.auto_shard.cost import Evaluation
from tf_gspmd.auto_shard.groups import AUTO, INPUTS, Var
from tf_gspmd.keras.layout import LayoutMap
from tf_gspmd.mesh import Mesh
from tf_gspmd.planning import PlanReport
from tf_gspmd.sharding import NamedSharding, P

if TYPE_CHECKING:  # the search makes the result: a type only
  from tf_gspmd.auto_shard.search import Search


class AutoShardResult:
  """What `auto_shard` chose: layouts, input shardings, and `report()` saying why."""

  def __init__(
    self,
    mesh: Mesh,
    budget: int,
    best: Evaluation,
    searcher: Search,
    variables: List[Var],
    search: str,
    seconds: float,
  ):
    self.mesh, self.budget, self.best, self.search = mesh, budget, best, search
    self._searcher, self._variables, self.seconds = searcher, variables, seconds
    self.groups = searcher.groups
    self.runner_up = searcher.runner_up(best)
    names = {v.variable.name: v.name for v in variables}
    self.shardings: Dict[str, NamedSharding] = {
      names.get(v.name, v.name): v.sharding for v in best.report.variables
    }
    self.input_shardings: List[NamedSharding] = searcher.input_shardings(best.choice[-1])

  @property
  def plan_report(self) -> PlanReport:
    return self.best.report

  @property
  def evaluations(self) -> int:
    """Layouts priced (by the fast model; `planned` of them planned with tg.plan too)."""
    return len(self._searcher.seen)

  @property
  def planned(self) -> int:
    """Layouts planned with tg.plan."""
    return len(self._searcher.planned)

  @property
  def model_shardings(self) -> Dict[str, NamedSharding]:
    """`shardings` without optimizer state: slots follow their variable by propagation."""
    model = {v.name for g in self.groups for v in g.members}
    model |= {v.name for g in self.groups for v, rank in g.followers if rank is not None}
    return {n: s for n, s in self.shardings.items() if n in model}

  @property
  def layout_map(self) -> LayoutMap:
    """One rule per model variable (its exact name): `.apply(model)` annotates a Keras model."""
    layout = LayoutMap(self.mesh)
    for name, sharding in self.model_shardings.items():
      layout[re.escape(name)] = sharding.spec
    return layout

  def apply(self) -> None:
    """Annotate every variable of the step with its chosen sharding (`shard_variable`)."""
    by_name = {v.name: v.variable for v in self._variables}
    for name, sharding in self.shardings.items():
      annotations.shard_variable(by_name[name], self.mesh, sharding.spec)

  def keras_layout_map(self):
    """A `keras.distribution.LayoutMap` keyed by variable path, on a DeviceMesh of this mesh."""
    import keras

    device_mesh = keras.distribution.DeviceMesh(
      tuple(self.mesh.shape.values()),
      list(self.mesh.axis_names),
      [f'cpu:{d}' for d in np.ravel(self.mesh.device_ids)],
    )
    layout = keras.distribution.LayoutMap(device_mesh)
    for name, sharding in self.model_shardings.items():
      layout[name] = tuple(sharding.spec) + (None,) * (sharding.rank - len(sharding.spec))
    return layout

  def layout_of(self, name: str) -> P:
    return self.shardings[name].spec

  def report(self) -> str:
    return _format_report(self)

  def __str__(self) -> str:
    return self.report()


def _format_report(result: AutoShardResult) -> str:
  best, budget, mesh = result.best, result.budget, result.mesh
  axes = ' x '.join(f'{a}={s}' for a, s in mesh.shape.items())
  lines = [
    f'auto_shard {best.report.name}: {mesh.size} devices ({axes}), budget '
    f'{budget:,} bytes per device; {result.evaluations} layouts priced, {result.planned} '
    f'planned with tg.plan, in {result.seconds:.1f} s ({result.search})',
    f'chosen: {_summary(best, budget)}',
    f'  {_terms(best)}',
  ]
  if result.runner_up is not None:
    lines += [
      f'runner-up: {_summary(result.runner_up, budget)}',
      f'  differs in: {_difference(result, result.runner_up)}',
    ]
  lines.append(f'{"group":<40}{"vars":>5}  {"chosen":<26}runner-up (cost, bytes per device)')
  for i, group in enumerate(result.groups + [None]):
    name = INPUTS if group is None else group.key
    count = '' if group is None else str(len(group.members) + len(group.followers))
    other = result._searcher.group_runner_up(best, i)  # noqa: SLF001
    alt = (
      '-'
      if other is None
      else (
        f'{_spec_text(other.choice[i])} ({_ms(other.cost)}, '
        f'{other.memory:,}{"" if other.memory <= budget else " over"})'
      )
    )
    lines.append(f'{name[:39]:<40}{count:>5}  {_spec_text(best.choice[i]):<26}{alt}')
  return '\n'.join(lines)


def _summary(e: Evaluation, budget: int) -> str:
  r = e.report
  fits = 'fits' if e.memory <= budget else 'over budget'
  if r is None:  # priced by the fast model alone: no breakdown
    return f'predicted {_ms(e.cost)} per step; {e.memory:,} bytes per device ({fits}; not planned)'
  return (
    f'predicted {_ms(e.cost)} per step; {e.memory:,} bytes per device ({fits}: '
    f'parameters {r.parameter_bytes:,} + optimizer {r.optimizer_bytes:,} + activations '
    f'{r.activation_peak:,})'
  )


def _terms(e: Evaluation) -> str:
  kinds = ', '.join(f'{k} {b:,}' for k, b in sorted(e.collective_bytes.items())) or 'none'
  return (
    f'collectives {_ms(e.collective_seconds)}: {len(e.report.collective_records)} per '
    f'step, bytes {kinds}; contractions {_ms(e.time.compute)}, memory traffic '
    f'{_ms(e.time.memory)}, launch {_ms(e.time.launch)}; repeated work '
    f'{e.repeated_work:,} points'
  )


def _difference(result: AutoShardResult, other: Evaluation) -> str:
  names = [g.key for g in result.groups] + [INPUTS]
  diffs = [
    f'{n}: {_spec_text(b)}' for n, a, b in zip(names, result.best.choice, other.choice) if a != b
  ]
  return '; '.join(diffs)


def _spec_text(spec) -> str:
  if spec is AUTO:
    return 'propagated'
  if spec is None:
    return 'replicated'
  if isinstance(spec, tuple) and not isinstance(spec, P):
    return ','.join(spec)
  return str(spec)


def _ms(seconds: float) -> str:
  return f'{seconds * 1e3:.2f} ms'
