"""`auto_shard`: the search over the groups' candidates (coordinate descent, or exhaustive),
every candidate priced by the fast model (`simulate.Simulator`, on the step captured once)
and memoized; the best few it ranks are planned with `tg.plan`, and the cheapest planned
layout within the budget wins."""

from __future__ import annotations

import functools
import itertools
import logging
import re
import time
from typing import Any, Callable, Dict, List, Optional

import numpy as np
import tensorflow as tf

from tf_gspmd import annotations
from tf_gspmd.auto_shard.constants import Constants, load_constants
from tf_gspmd.auto_shard.cost import Evaluation, estimate
from tf_gspmd.auto_shard.groups import (
  AUTO,
  Group,
  Var,
  group_variables,
  input_candidates,
  spec_candidates,
  variables_in,
)
from tf_gspmd.auto_shard.result import AutoShardResult
from tf_gspmd.auto_shard.simulate import Simulator
from tf_gspmd.graph import capture
from tf_gspmd.mesh import Mesh
from tf_gspmd.partitioned.signature import name_of
from tf_gspmd.planning import plan
from tf_gspmd.sharding import NamedSharding, P, Sharding

log = logging.getLogger('tf_gspmd')

TIE = 1e-3  # relative cost difference below which the descent does not move
SWEEP_GAIN = 0.01  # a sweep (within the budget) gaining less than this is the last one
SHORTLIST = 4  # after the first sweep a group tries only its best options of the last one
SMALL_SEARCH = 32  # candidates a sweep up to which a third start (batch unsplit) is cheap
MAX_PLANNED = 4  # layouts a search plans with tg.plan at most to confirm its end


class Search:
  """Prices layouts of `fn` (memoized) and walks the candidates.

  With a `simulator` (the step captured once), `evaluate` prices a layout with the fast
  model and `verify` plans it with `tg.plan`; without one, `evaluate` plans every layout.
  """

  def __init__(
    self,
    fn,
    arg_specs,
    mesh: Mesh,
    budget: int,
    groups: List[Group],
    inputs: list,
    constants: Constants,
    simulator: Optional[Simulator] = None,
    traced=None,
  ):
    self.fn, self.arg_specs, self.mesh, self.budget = fn, list(arg_specs), mesh, budget
    self.groups, self.inputs, self.constants = groups, inputs, constants
    self.simulator = simulator
    self.traced = traced  # fn's ConcreteFunction: plans capture it without tracing again
    self.seen: Dict[tuple, Evaluation] = {}  # priced (by the fast model, if there is one)
    self.planned: Dict[tuple, Evaluation] = {}  # planned with tg.plan
    self.simulated: Dict[tuple, Evaluation] = {}  # the fast model's price of each planned
    self._variable_bytes: Dict[tuple, int] = {}  # (group, spec) -> `variable_bytes`

  @property
  def spaces(self) -> List[list]:
    return [g.candidates for g in self.groups] + [self.inputs]

  def evaluate(self, choice: tuple) -> Evaluation:
    if choice not in self.seen:
      self.seen[choice] = self.verify(choice) if self.simulator is None else self._simulate(choice)
    return self.seen[choice]

  def verify(self, choice: tuple) -> Evaluation:
    """`choice` planned with `tg.plan` (the partitioner's own collectives and bytes)."""
    if choice not in self.planned:
      held = [v.variable for g in self.groups for v in g.members + [f for f, _ in g.followers]]
      saved = [(v, annotations.variable_sharding(v)) for v in held]
      self._annotate(choice)
      try:
        report = plan(
          self.traced or self.fn,
          *self.arg_specs,
          mesh=self.mesh,
          in_shardings=self.input_shardings(choice[-1]),
        )
      finally:  # the variables keep the annotations they had
        for variable, sharding in saved:
          set_layout(variable, self.mesh, AUTO if sharding is None else sharding)
      report.name = name_of(self.fn)
      self.planned[choice] = estimate(report, self.constants, choice)
    return self.planned[choice]

  def _simulate(self, choice: tuple) -> Evaluation:
    arguments = [s.spec for s in self.input_shardings(choice[-1])]
    try:
      return self.simulator.evaluate(self.variable_specs(choice), arguments, choice)
    except Exception as e:  # noqa: BLE001 (a step the fast model cannot walk: planned)
      log.warning('auto_shard: the fast model cannot price %s (%s); planned instead.', choice, e)
      return self.verify(choice)

  def variable_specs(self, choice: tuple) -> Dict[str, Any]:
    """Placeholder -> spec of every variable `choice` lays out (the rest: as annotated)."""
    placeholders = {id(v): n for n, v in self.simulator.program.variables.items()}
    out = {n: s for n, s in self.simulator.program.variable_shardings.items()}
    for group, spec in zip(self.groups, choice):
      spec = group.fixed if group.fixed is not None else spec
      for var in group.members:
        out[placeholders[id(var.variable)]] = None if spec is AUTO else spec
      for var, rank in group.followers:
        kept = spec if rank is None or spec is AUTO else _trailing(spec, len(group.shape), rank)
        out[placeholders[id(var.variable)]] = None if kept is AUTO else kept
    return out

  def confirmed(self, run: Callable[[], Evaluation]) -> Evaluation:
    """`run()` (a search) with the fast model, its best layout planned with `tg.plan`; the
    plan's price replaces the fast model's and the search runs again (memoized: it prices
    only layouts it had not reached), until it ends on a planned layout: one its plan
    confirms, at most MAX_PLANNED plans (then the best planned one)."""
    if self.simulator is None:
      return run()
    for _ in range(MAX_PLANNED + 1):
      priced = run()
      if priced.choice in self.planned:
        return priced
      if not self.worth_planning(priced):
        break
      self.simulated[priced.choice] = priced
      self.seen[priced.choice] = self.verify(priced.choice)
      if len(self.planned) >= MAX_PLANNED:
        break
    best = min(self.planned.values(), key=lambda e: e.key(self.budget))
    if best.memory > self.budget and any(e.memory <= self.budget for e in self.seen.values()):
      return self.planning(run)  # layouts priced within the budget, none planned within it
    return best

  def worth_planning(self, priced: Evaluation) -> bool:
    """Could `priced` (the fast model's) beat the best planned layout? Its cost is first
    scaled by the least plan/fast-model ratio the planned layouts showed (the fast model's
    bias on this step, which it carries to every layout; the least: the benefit of the
    doubt), so a candidate ahead only by that bias is not planned."""
    if not self.planned:
      return True
    ratios = [self.planned[c].cost / e.cost for c, e in self.simulated.items() if e.cost > 0]
    ratio = min(ratios, default=1.0)
    best = min(self.planned.values(), key=lambda e: e.key(self.budget))
    return (priced.overflow(self.budget), priced.cost * ratio) < best.key(self.budget)

  def planning(self, run: Callable[[], Evaluation]) -> Evaluation:
    """`run()` again with every layout planned (the fast model misjudged the step): what
    is planned already is kept."""
    log.warning(
      'auto_shard: the layouts the fast model prices within the budget are planned over '
      'it; searching again with every layout planned (slower).'
    )
    self.simulator, self.seen = None, dict(self.planned)
    return run()

  def better(self, a: Evaluation, b: Evaluation) -> bool:
    return a.key(self.budget) < b.key(self.budget)

  def input_shardings(self, axes) -> list:
    out = []
    for spec in self.arg_specs:
      rank = len(spec.shape)
      head = (axes if axes is None or len(axes) > 1 else axes[0],) if rank else ()
      out.append(NamedSharding(self.mesh, P(*head, *([None] * (rank - 1)))))
    return out

  def _annotate(self, choice: tuple) -> None:
    for group, spec in zip(self.groups, choice):
      spec = group.fixed if group.fixed is not None else spec
      for var in group.members:
        set_layout(var.variable, self.mesh, spec)
      for var, rank in group.followers:
        set_layout(
          var.variable,
          self.mesh,
          spec if rank is None or spec is AUTO else _trailing(spec, len(group.shape), rank),
        )

  # --- the two searches ------------------------------------------------------------------------
  def descend(self, starts: List[tuple]) -> Evaluation:
    """The best of the descents from `starts`."""
    ends = [self._descend(start) for start in starts]
    return min(ends, key=lambda e: e.key(self.budget))

  def _descend(self, start: tuple, max_sweeps: int = 4) -> Evaluation:
    """Coordinate descent: each group (then the inputs) takes its best candidate, others held.

    Best, while the layout is over the budget: one that fits (the cheapest), else the
    one paying the least cost per byte saved (a move saving the most bytes at any
    price strands the walk far from the cheap layouts); once it fits, the cheapest
    that still fits. Candidates whose variables alone rule them out are not planned.
    """
    best = self.evaluate(start)
    order = list(range(len(self.groups))) + [len(self.groups)]
    shortlist = {i: list(self.spaces[i]) for i in order}
    for _ in range(max_sweeps):
      before = best
      for i in order:
        choices = [best.choice[:i] + (option,) + best.choice[i + 1 :] for option in shortlist[i]]
        trials = [
          self.evaluate(c) for c in choices if c != best.choice and not self.cannot_beat(c, best)
        ]
        if self.simulator is None:  # a priced layout costs milliseconds: every option, always
          shortlist[i] = self._shortlist(best, i, trials)
        best = self._pick(best, trials)
      settled = before.memory <= self.budget and best.cost > before.cost * (1 - SWEEP_GAIN)
      if best is before or settled:
        break
    return best

  def _shortlist(self, best: Evaluation, i: int, trials: List[Evaluation]) -> list:
    """Group `i`'s options the next sweeps try: the best ones of this sweep by the budget
    and by cost alone, SHORTLIST in all (while over the budget the cheap options rank
    last by the budget, yet one of them is often best once the rest fits)."""
    tried = trials + [best]
    by_budget = sorted(tried, key=lambda e: e.key(self.budget))
    by_cost = sorted(tried, key=lambda e: e.cost)
    half = SHORTLIST // 2
    ranked = by_budget[:half] + by_cost[:half] + by_budget[half:]
    return list(dict.fromkeys(e.choice[i] for e in ranked))[:SHORTLIST]

  def _pick(self, best: Evaluation, trials: List[Evaluation]) -> Evaluation:
    fitting = [t for t in trials if t.memory <= self.budget]
    if best.memory <= self.budget or fitting:
      cheapest = min(fitting + [best], key=lambda e: e.key(self.budget))
      # A near tie (within TIE of the cost) is no move: it would only add sweeps.
      keep = best.memory <= self.budget and cheapest.cost > best.cost * (1 - TIE)
      return best if keep else cheapest
    saving = [t for t in trials if t.memory < best.memory]
    if not saving:
      return best
    return min(saving, key=lambda t: ((t.cost - best.cost) / (best.memory - t.memory), t.cost))

  def cannot_beat(self, choice: tuple, best: Evaluation) -> bool:
    """True when `choice`'s variables alone (exact bytes, no plan needed) rule it out: they
    exceed the budget a fitting `best` meets, or the bytes an overflowing `best` needs."""
    bound = sum(self.variable_bytes(i, spec) for i, spec in enumerate(choice[:-1]))
    return bound > (self.budget if best.memory <= self.budget else best.memory)

  def variable_bytes(self, i: int, spec) -> int:
    """Per-device bytes of group `i`'s members and followers under `spec` (0 when left to
    propagation: unknown until planned)."""
    group = self.groups[i]
    spec = group.fixed if group.fixed is not None else spec
    if spec is AUTO:
      return 0
    found = self._variable_bytes.get((i, spec))
    if found is None:
      found = self._variable_bytes[(i, spec)] = self._bytes_of(group, spec)
    return found

  def _bytes_of(self, group: Group, spec) -> int:
    total = 0
    for var, rank in [(v, None) for v in group.members] + group.followers:
      kept = (
        spec
        if rank is None or isinstance(spec, Sharding)
        else _trailing(spec, len(group.shape), rank)
      )
      sharding = kept if isinstance(kept, Sharding) else NamedSharding(self.mesh, kept)
      size = tf.as_dtype(var.dtype).size
      total += int(np.prod(sharding.shard_shape(var.shape), dtype=np.int64)) * size
    return total

  def exhaustive(self) -> Evaluation:
    best = None
    for choice in itertools.product(*self.spaces):
      trial = self.evaluate(tuple(choice))
      if best is None or self.better(trial, best):
        best = trial
    return best

  def runner_up(self, best: Evaluation) -> Optional[Evaluation]:
    """The best other planned layout (else the best other priced one)."""
    for pool in (self.planned, self.seen):
      others = [e for e in pool.values() if e.choice != best.choice]
      if others:
        return min(others, key=lambda e: e.key(self.budget))
    return None

  def group_runner_up(self, best: Evaluation, i: int) -> Optional[Evaluation]:
    """The best planned layout that differs from `best` in group `i` only."""
    others = [
      e
      for e in self.seen.values()
      if e.choice[i] != best.choice[i]
      and all(a == b for j, (a, b) in enumerate(zip(e.choice, best.choice)) if j != i)
    ]
    return min(others, key=lambda e: e.key(self.budget), default=None)


def _trailing(spec: P, rank: int, kept: int) -> P:
  entries = list(spec) + [None] * (rank - len(spec))
  return P(*entries[rank - kept :])


def set_layout(variable, mesh: Mesh, spec) -> None:
  if spec is AUTO:
    clear_layout(variable)
  elif isinstance(spec, Sharding):
    annotations.shard_variable(variable, spec)
  else:
    annotations.shard_variable(variable, mesh, spec)


def clear_layout(variable) -> None:
  """No annotation at all: propagation decides (TF's own proto and tf_gspmd's attribute)."""
  setattr(variable, annotations._VARIABLE_ATTR, None)  # noqa: SLF001
  if hasattr(variable, '_set_xla_sharding'):
    variable._set_xla_sharding(None)  # noqa: SLF001


# --- the entry point ------------------------------------------------------------------------------
def auto_shard(
  fn,
  *arg_specs,
  mesh: Mesh,
  memory_budget: int,
  fixed: Optional[dict] = None,
  search: str = 'descent',
  constants: Optional[Constants] = None,
  min_group_fraction: float = 0.01,
  axes_per_dim: Optional[int] = None,
  batch_splits: Optional[List[tuple]] = None,
) -> 'AutoShardResult':
  """Choose a layout for every variable of `fn` and the inputs' batch dim (see the module doc).

  `arg_specs`: `tf.TensorSpec`s (or values) of `fn`'s tensor arguments, dim 0
  the batch. `memory_budget`: bytes one device may hold (parameters +
  optimizer state + activation peak). `fixed`: {variable name or regex: P or
  Sharding} the search must keep (as are `shard_variable` annotations already
  on the variables and `tg.shard` inside `fn`). `search`: 'descent'
  (coordinate descent, scales with distinct layers) or 'exhaustive' (every
  combination: small cases). `axes_per_dim`: at most this many mesh axes split one
  dim of a searched layout; `batch_splits`: the inputs' batch splits searched (axis-name
  tuples; default: unsplit or any axis group dividing it) -- `tf_gspmd.keras.auto_layout`
  searches what Keras' ModelParallel can express. The variables' own annotations are restored
  afterwards; apply the result with `.layout_map` or `.shardings`.
  Raises a ValueError naming the smallest per-device bytes found when no
  layout fits.
  """
  if search not in ('descent', 'exhaustive'):
    raise ValueError(f"auto_shard: search must be 'descent' or 'exhaustive', got {search!r}.")
  started = time.perf_counter()
  traced = capture.trace(fn, *arg_specs)  # once: every layout is priced or planned on it
  program = capture.capture(traced)
  variables = variables_in(program)
  saved = {id(v.variable): annotations.variable_sharding(v.variable) for v in variables}
  groups = group_variables(variables, _fixed_layouts(variables, saved, fixed))
  _give_candidates(groups, mesh, min_group_fraction, axes_per_dim)
  inputs = input_candidates(arg_specs, mesh, batch_splits)
  if not inputs:
    raise ValueError(f'auto_shard: no batch split of {batch_splits} divides the batch.')
  constants = constants or load_constants()
  simulator = _simulator(program, mesh, constants)
  searcher = Search(
    fn, arg_specs, mesh, int(memory_budget), groups, inputs, constants, simulator, traced
  )
  try:
    best = searcher.confirmed(
      searcher.exhaustive
      if search == 'exhaustive'
      else functools.partial(searcher.descend, _starts(groups, inputs))
    )
  finally:
    for var in variables:
      set_layout(
        var.variable, mesh, AUTO if saved[id(var.variable)] is None else saved[id(var.variable)]
      )
  if best.overflow(searcher.budget):
    raise ValueError(
      f'auto_shard: no layout of {len(groups)} variable groups over {mesh.size} devices fits '
      f'{searcher.budget:,} bytes per device; the smallest found needs {best.memory:,} bytes '
      f'(parameters {best.report.parameter_bytes:,} + optimizer state '
      f'{best.report.optimizer_bytes:,} + activation peak {best.report.activation_peak:,}). '
      'Raise the budget, use a larger mesh or a smaller batch.'
    )
  return AutoShardResult(
    mesh, searcher.budget, best, searcher, variables, search, time.perf_counter() - started
  )


def _simulator(program, mesh: Mesh, constants: Constants) -> Optional[Simulator]:
  """The fast model of `program`, or None (every layout planned) when it cannot read it."""
  try:
    return Simulator(program, mesh, constants)
  except Exception as e:  # noqa: BLE001 (a program the fast model cannot read: planned)
    log.warning('auto_shard: no fast model of this step (%s); every layout is planned.', e)
    return None


def _fixed_layouts(variables: List[Var], saved: dict, fixed: Optional[dict]) -> Dict[int, Any]:
  """id(Var) -> the layout the user gave it (annotation, or a `fixed` pattern)."""
  out = {id(v): saved[id(v.variable)] for v in variables if saved[id(v.variable)] is not None}
  for pattern, layout in (fixed or {}).items():
    layout = layout if isinstance(layout, (P, Sharding)) else P(*layout)
    matched = [v for v in variables if re.fullmatch(pattern, v.name) or v.name == pattern]
    if not matched:
      raise ValueError(
        f'auto_shard: fixed layout {pattern!r} matches no variable of the step '
        f'(names: {sorted(v.name for v in variables)[:8]} ...).'
      )
    for var in matched:
      out[id(var)] = layout
  return out


def _starts(groups: List[Group], inputs: list) -> List[tuple]:
  """Variables replicated, the batch split over the most devices (data parallelism) or over
  the first axis group only (a batch axis beside model axes): a descent moves one group at
  a time, and from data parallelism alone it cannot take the batch off the model axes and
  split the weights over them in one move. A small search (at most SMALL_SEARCH
  candidates a sweep) also starts from the batch unsplit."""
  replicated = tuple(g.candidates[0] for g in groups)
  split = [axes for axes in inputs if axes is not None] or [None]
  most = max(split, key=lambda axes: len(axes or ()))
  small = sum(len(g.candidates) for g in groups) + len(inputs) <= SMALL_SEARCH
  batches = [most, split[0]] + ([None] if small and None in inputs else [])
  return [replicated + (axes,) for axes in dict.fromkeys(batches)]


def _give_candidates(
  groups: List[Group], mesh: Mesh, min_fraction: float, axes_per_dim: Optional[int] = None
) -> None:
  """Searched specs per group (replicated first); small groups are left to propagation."""
  total = sum(g.nbytes for g in groups)
  for group in groups:
    if group.fixed is not None:
      group.candidates = [group.fixed]
    elif group.nbytes < min_fraction * total:
      group.candidates = [AUTO]
    else:
      group.candidates = spec_candidates(group.shape, mesh, axes_per_dim)
