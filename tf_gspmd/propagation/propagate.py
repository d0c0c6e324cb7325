"""Sharding propagation over a whole `ir.Program`, nested functions included.

Every tensor carries, per dim, the mesh axes that split it (major to minor)
and whether the dim is closed (a user annotation, which is never changed) or
open (propagation may add minor axes to it). Propagation only ever extends
open dims, so it is monotone and reaches a fixpoint.

Passes: three levels, each run to a fixpoint of alternating forward sweeps
(each op in topological order updates its results from its operands) and
backward sweeps (reverse order, each op updates its operands from its results
and other operands). Level 0 runs only pass-through ops (elementwise,
identities, transposes, variable reads and assigns) and control-flow ties;
level 1 adds every op but lets broadcast operands (a bias, a BroadcastTo
input) only receive shardings; level 2 lets them shard results too. This is
the order XLA's aggressiveness levels and Shardy's op priorities impose:
cheap, certain paths first, so that a tensor reached both ways takes its
sharding from the pass-through path.

Through one op, the tensors' shardings are projected on the op's factors
(`OpRule`); where they disagree, the proposal over more devices wins, then the
earlier operand; where two factors are proposed one axis, it goes to the
earlier factor, or, for gathers, scatters and dots (`Entry.settles_by_bytes`),
where that moves fewer bytes (`pricing`; an activation losing its split to a weight's
is charged the sum its results will need, `Propagator._settle`). While/If/Case/call
ops tie caller and callee tensors into groups that merge like identities, with the
callee swept in between.

Results: per graph and tensor a complete `NamedSharding` on the mesh (open
dims left without axes are replicated; scalars and unknown-rank tensors are
`P()`), and a `Provenance` saying where each sharding came from.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Dict, List, Optional, Tuple

from tf_gspmd import op_sharding
from tf_gspmd.errors import Unsupported
from tf_gspmd.graph import ir
from tf_gspmd.mesh import Mesh
from tf_gspmd.propagation import manual, pricing, registry
from tf_gspmd.propagation.provenance import (
  ANNOTATION,
  AUXILIARY,
  BACKWARD,
  BY_RULE,
  DEFAULT,
  FORWARD,
  MANUAL,
  NO_RULE,
  SCALAR,
  UNKNOWN_RANK,
  VARIABLE,
  Key,
  PropagationResult,
  PropagationWarning,
  Provenance,
  qualified,
)
from tf_gspmd.propagation.registry import RuleContext, is_resource
from tf_gspmd.propagation.resource_shapes import infer_resource_shapes
from tf_gspmd.propagation.rule import NEED_REPLICATION, OpRule, dim_factors, pick_candidate
from tf_gspmd.sharding import NamedSharding, P, Sharding, named_for_rank

LEVELS = (0, 1, 2)
LEVEL_NAMES = {0: 'pass-through ops', 1: 'all ops, broadcasts backward only', 2: 'all ops'}


class _State:
  __slots__ = ('axes', 'closed', 'prov')

  def __init__(self, axes, closed, prov):
    self.axes = tuple(tuple(a) for a in axes)
    self.closed = tuple(closed)
    self.prov = prov


@dataclasses.dataclass
class _NodeInfo:
  graph: ir.Graph
  node: ir.Node
  rule: Optional[OpRule] = None
  call_ties: Optional[object] = None
  ties: Optional[List[List[Key]]] = None
  shapes: Optional[List] = None  # operand shapes then result shapes (value shapes for resources)
  sizes: Optional[List[int]] = None  # bytes per element, the same order (a conflict's price)
  by_bytes: bool = False  # conflicts between its factors settled by bytes (`pricing`)
  error: Optional[str] = None


# Op types without a rule whose warning this process showed already (`Propagator._warn`).
_SHOWN_WITHOUT_RULE: set = set()


class Propagator:
  """Runs propagation on one program; use `propagate_program`."""

  def __init__(self, program: ir.Program, mesh: Mesh, max_sweeps: int = 1000):
    self.program = program
    self.mesh = mesh
    self.max_sweeps = max_sweeps
    self.states: Dict[Key, _State] = {}
    self.resource_shapes: Dict[Key, tuple] = {}
    self.infos: Dict[Tuple[str, str], _NodeInfo] = {}
    self.warnings: List[str] = []
    self._warned = set()
    self.level = 0
    self._active = []
    # The manual regions (`manual.ManualRegions`: (graph, tensor) -> the mesh axes it is
    # manual over, and its region): a tensor's manual axes are never given to it.
    self.manual = manual.ManualRegions()
    # Skipping a node whose tensors did not change since its last apply (same level and
    # direction): `_apply` reads only those tensors' states, so it would propose what it
    # proposed then, which the states already hold. Results are identical with it off
    # (tests/test_first_step.py); a decoder's 12 sweeps applied 20,104 rules without it.
    self.skip_unchanged = True
    self._stamp = 0  # counts state changes during the sweeps
    self._changed_at: Dict[Key, int] = {}  # key -> the stamp of its last change
    self._applied: Dict[Tuple[str, str, bool], Tuple[int, int]] = {}  # -> (level, stamp)
    # The origins a variable's layout has in provenance (`_from_weight`): its key and its name.
    main = program.main.name
    self._weight_origins = {qualified(program, (main, t)) for t in program.variables}
    self._weight_origins |= {getattr(v, 'name', t) for t, v in program.variables.items()}

  # --- setup -------------------------------------------------------------------------
  def _rank(self, key: Key) -> Optional[int]:
    graph = self._graph(key[0])
    t = graph.tensor(key[1])
    if is_resource(t.dtype):
      shape = self.resource_shapes.get(key)
      return None if shape is None else len(shape)
    return t.rank

  def _graph(self, name: str) -> ir.Graph:
    return self.program.main if name == self.program.main.name else self.program.functions[name]

  def _warn(self, op_type: str, message: str, once_per_process: bool = False):
    """Record `message` in this propagation once per op type; show it as a warning too, or (with
    `once_per_process`) only the first time this process meets the op type: a Keras `fit`
    propagates each step function and signature anew, which would repeat it for each."""
    if op_type in self._warned:
      return
    self._warned.add(op_type)
    self.warnings.append(message)
    if once_per_process:
      if op_type in _SHOWN_WITHOUT_RULE:
        return
      _SHOWN_WITHOUT_RULE.add(op_type)
    warnings.warn(message, PropagationWarning, stacklevel=4)

  def _build_infos(self):
    for graph in self.program.graphs():
      shapes = {k[1]: v for k, v in self.resource_shapes.items() if k[0] == graph.name}
      ctx = RuleContext(graph, shapes)
      for node in graph.nodes:
        info = _NodeInfo(graph, node)
        self.infos[(graph.name, node.name)] = info
        entry = registry.lookup(node.op)
        if entry is None:
          info.error = f'no sharding rule for op type {node.op}'
          self._warn(
            node.op,
            f'tf_gspmd propagation: no sharding rule for op type {node.op!r} '
            f'(first seen at node {node.name!r} in graph {graph.name!r}); its results '
            "are replicated (said once per op type; Propagation.warnings lists each program's).",
            once_per_process=True,
          )
          continue
        if entry.call_ties is not None:
          info.call_ties = entry.call_ties
          info.ties = entry.call_ties.ties(node, graph, self.program)
          continue
        try:
          rule = entry.rule(node, ctx)
          self._check_rule(node, rule, ctx)
        except (ValueError, TypeError, KeyError, IndexError, AttributeError) as e:
          info.error = str(e)
          self._warn(
            node.op,
            f'tf_gspmd propagation: the sharding rule of {node.op!r} failed at '
            f'node {node.name!r} in graph {graph.name!r} ({e}); results of such nodes '
            'are replicated.',
          )
          continue
        info.rule = rule
        info.by_bytes = entry.settles_by_bytes
        info.shapes = [ctx.shape(t) for t in node.inputs] + [
          ctx.shape(o.name) for o in node.outputs
        ]
        info.sizes = [_element_bytes(graph.tensor(t)) for t in node.inputs] + [
          _element_bytes(o) for o in node.outputs
        ]

  @staticmethod
  def _check_rule(node, rule: OpRule, ctx):
    if len(rule.operands) != len(node.inputs) or len(rule.results) != len(node.outputs):
      raise ValueError(
        f'rule {rule.text()} has {len(rule.operands)} operands and {len(rule.results)} results '
        f'but the node has {len(node.inputs)} inputs and {len(node.outputs)} outputs'
      )
    for dims, t in zip(
      rule.operands + rule.results, list(node.inputs) + [o.name for o in node.outputs]
    ):
      shape = ctx.shape(t)
      if dims is not None and (shape is None or len(dims) != len(shape)):
        raise ValueError(f'rule {rule.text()} gives {t} {len(dims)} dims but its shape is {shape}')

  def _seed(self):
    """User annotations (never changed later), manual region boundaries and annotated
    variables."""
    for graph in self.program.graphs():
      for node in graph.nodes:
        if node.op in (manual.ENTER, manual.EXIT):
          self._seed_boundary(graph, node)
          continue
        for index, sharding in sorted(node.annotations.items()):
          key = (graph.name, node.outputs[index].name)
          if manual.is_manual_sharding(sharding):
            continue  # a manual region's intermediate: its region says its layout
          self._annotate(
            key, sharding, _unspecified_dims(node), ANNOTATION, qualified(self.program, key)
          )
          self._check_not_manual(key, f'annotation {sharding} on {node.op} {node.name}')
    for tensor, var in self.program.variables.items():
      key = (self.program.main.name, tensor)
      if key in self.states:
        continue
      sharding = _variable_sharding(var)
      name = getattr(var, 'name', tensor)
      if sharding is not None:
        self._annotate(key, sharding, (), VARIABLE, name)
      elif self._rank(key) is not None:
        # Unannotated: replicated unless propagation shards it (open dims).
        rank = self._rank(key)
        self.states[key] = _State(
          ((),) * rank, (False,) * rank, Provenance(VARIABLE, origin=name, detail='not annotated')
        )

  def _seed_boundary(self, graph: ir.Graph, node: ir.Node):
    """A region's entry result takes the region's layout of its shard-shaped value; an
    exit result the full layout: both fixed by the op (but the dims it leaves open)."""
    b = manual.boundary(node, graph, self.mesh)
    key = (graph.name, node.outputs[0].name)
    if node.op == manual.ENTER:
      axes = b.region_spec
    else:
      axes = tuple(b.sharding.spec.axes_of(d) for d in range(len(b.full_shape)))
    closed = tuple(d not in b.open_dims for d in range(len(axes)))
    detail = f'manual over mesh axes {b.manual}' + (
      f', shard shape {list(b.region_shape)}' if node.op == manual.ENTER else ''
    )
    prov = Provenance(
      MANUAL,
      op=qualified(self.program, (graph.name, node.name)),
      op_type=node.op,
      origin=qualified(self.program, key),
      detail=detail,
    )
    self.states[key] = _State(axes, closed, prov)

  def _check_not_manual(self, key, what: str):
    axes = self.manual.get(key)
    state = self.states.get(key)
    if not axes or state is None:
      return
    used = [a for dim in state.axes for a in dim if a in axes]
    if used:
      raise ValueError(
        f'{what}: {qualified(self.program, key)} is inside a manual region over mesh axes '
        f'{axes}, where each partition holds its own value; it cannot be split over the '
        f'manual axes {used} there. Split it before the region or after it.'
      )

  def _annotate(self, key, sharding: Sharding, unspecified, kind, origin):
    rank = self._rank(key)
    if rank is None:
      if not sharding.is_replicated:
        raise Unsupported(
          f'Annotation {sharding} on {qualified(self.program, key)}: the tensor has unknown '
          'rank, so a tiled sharding cannot be checked against it.'
        )
      return
    try:
      # A tile assignment in another device order comes back on a reordering of the mesh.
      # Propagation keeps only its axes: inside the program every op computes in the mesh's
      # order (the order changes no value; the program's inputs and outputs keep theirs,
      # see tg.partition), so an interior annotation in another order costs nothing.
      named = named_for_rank(sharding, self.mesh, rank)
    except ValueError:
      named = None
    if named is None:
      raise Unsupported(
        f'Annotation {sharding} on {qualified(self.program, key)} (rank {rank}) cannot be '
        f'written as a P(...) on mesh {self.mesh} in any device order: its devices are not '
        f"the mesh's, or no grouping of the mesh axes gives its tile dims "
        f'{list(sharding.tile_shape or ())}; annotate with shardings over this mesh.'
      )
    axes = [named.spec.axes_of(d) for d in range(rank)]
    closed = [d not in unspecified for d in range(rank)]
    self.states[key] = _State(axes, closed, Provenance(kind, origin=origin))

  # --- the passes ----------------------------------------------------------------------
  def run(self) -> PropagationResult:
    self.resource_shapes = infer_resource_shapes(self.program)
    self.manual = manual.regions(self.program, self.mesh)
    manual.check_collectives(self.program, self.mesh, self.manual)
    manual.check_replication(self.program, self.mesh, self.manual)
    self._build_infos()
    self._seed()
    roots = [self.program.main] + self._uncalled_functions()
    iterations = {}
    for level in LEVELS:
      self.level = level
      for sweeps in range(1, self.max_sweeps + 1):
        iterations[level] = sweeps
        changed = False
        for root in roots:
          changed |= self._sweep(root, forward=True)
        for root in roots:
          changed |= self._sweep(root, forward=False)
        if not changed:
          break
      else:
        raise RuntimeError(f'Sharding propagation did not converge in {self.max_sweeps} sweeps.')
    return self._result(iterations)

  def _uncalled_functions(self) -> List[ir.Graph]:
    called = set()
    for info in self.infos.values():
      if info.ties:
        for group in info.ties:
          called.update(k[0] for k in group)
    return [g for name, g in self.program.functions.items() if name not in called]

  def _sweep(self, graph: ir.Graph, forward: bool) -> bool:
    if graph.name in self._active:
      return False  # a function calling itself: TF graphs have none, guard anyway
    self._active.append(graph.name)
    changed = False
    nodes = graph.nodes if forward else reversed(graph.nodes)
    for node in nodes:
      info = self.infos[(graph.name, node.name)]
      if info.ties is not None:
        changed |= self._visit_call(info, forward)
      elif info.rule is not None:
        if self.level == 0 and not info.rule.is_pass_through:
          continue
        if self.skip_unchanged and self._unchanged_since_applied(info, forward):
          continue
        changed |= self._apply(info, forward)
    self._active.pop()
    return changed

  def _unchanged_since_applied(self, info: _NodeInfo, forward: bool) -> bool:
    """Whether no tensor of `info`'s node changed since its last apply at this level and in
    this direction began (its own changes count: re-applied, it may propose more); records
    this apply's start otherwise."""
    mark = (info.graph.name, info.node.name, forward)
    last = self._applied.get(mark)
    if last is not None and last[0] == self.level:
      since = last[1]
      g, changed_at = info.graph.name, self._changed_at
      if all(changed_at.get((g, t), 0) < since for t in info.node.inputs) and all(
        changed_at.get((g, o.name), 0) < since for o in info.node.outputs
      ):
        return True
    self._applied[mark] = (self.level, self._stamp + 1)
    return False

  def _set_state(self, key: Key, state: _State) -> None:
    self.states[key] = state
    self._stamp += 1
    self._changed_at[key] = self._stamp

  def _visit_call(self, info: _NodeInfo, forward: bool) -> bool:
    changed = self._merge_groups(info)
    seen = []
    for group in info.ties:
      for g, _ in group:
        if g != info.graph.name and g not in seen:
          seen.append(g)
    for name in seen:
      changed |= self._sweep(self.program.functions[name], forward)
    changed |= self._merge_groups(info)
    return changed

  def _merge_groups(self, info: _NodeInfo) -> bool:
    changed = False
    for group in info.ties:
      known = [(i, k) for i, k in enumerate(group) if k in self.states]
      if not known:
        continue
      ranks = {self._rank(k) for k in group}
      if len(ranks) != 1 or None in ranks:
        continue
      ranked = sorted(known, key=lambda ik: (-_devices(self.mesh, self.states[ik[1]].axes), ik[0]))
      best_i, best_k = ranked[0]
      merged = _merge_compatible([self.states[k].axes for _, k in ranked])
      for i, k in enumerate(group):
        if k == best_k:
          continue
        prov = self._derived(best_k, FORWARD if best_i < i else BACKWARD, info)
        changed |= self._update(k, merged, prov)
    return changed

  def _derived(self, source: Key, kind: str, info: _NodeInfo) -> Provenance:
    src = self.states[source].prov
    step = qualified(self.program, (info.graph.name, info.node.name))
    origin = src.origin or qualified(self.program, source)
    return Provenance(
      kind,
      op=step,
      op_type=info.node.op,
      source=qualified(self.program, source),
      origin=origin,
      path=src.path + (step,),
      level=self.level,
    )

  def _apply(self, info: _NodeInfo, forward: bool) -> bool:
    rule, node, g = info.rule, info.node, info.graph.name
    keys = [(g, t) for t in node.inputs] + [(g, o.name) for o in node.outputs]
    n_in = len(node.inputs)
    dims_all = rule.tensor_dims()
    specs = [
      self.states[k].axes if k in self.states and dims_all[i] is not None else None
      for i, k in enumerate(keys)
    ]
    if not any(s is not None for s in specs):
      return False
    if forward:
      targets = [i for i in range(n_in, len(keys)) if dims_all[i] is not None]
      if self.level < 2 and rule.broadcast_operands:
        specs = [None if i in rule.broadcast_operands else s for i, s in enumerate(specs)]
    else:
      targets = [i for i in range(n_in) if dims_all[i] is not None]
    if not targets:
      return False
    candidates = rule.factor_candidates(specs, self.mesh)
    picked = {f: pick_candidate(c, self.mesh) for f, c in candidates.items() if c}
    chosen = {f: p[0] for f, p in picked.items()}
    resolved = rule.resolve_axes(chosen)
    if info.by_bytes and resolved != chosen:
      resolved = self._settle(rule, chosen, picked, keys, specs, info)
    changed = False
    for t in targets:
      key = keys[t]
      proposed = rule.tensor_spec(dims_all[t], resolved, self.mesh, info.shapes[t])
      source = self._source_of(rule, dims_all[t], resolved, picked, proposed, key, keys)
      if source is None and key not in self.states:
        source = self._reach_source(rule, t, specs, keys)
      if source is None:
        continue
      kind = FORWARD if t >= n_in else BACKWARD
      changed |= self._update(key, proposed, self._derived(source, kind, info))
    return changed

  def _settle(self, rule, chosen, picked, keys, specs, info: _NodeInfo):
    """Two factors proposed one axis: the settlement moving fewer bytes (`pricing`). Where
    one proposal comes from the activations (its origin is not a variable's layout) and the
    other from a weight, a settlement that takes the axis from the activation is also
    charged one all-reduce of its results over that axis: the activation then carries the
    weight's split to the next op contracting over it, which leaves partial sums of
    activation size (FSDP's layouts: the weight is gathered where it is used instead)."""
    from_weight = {f: self._from_weight(keys[picked[f][1]]) for f in chosen if chosen[f]}
    if len(set(from_weight.values())) < 2:
      return pricing.settle(rule, chosen, specs, info.shapes, info.sizes, self.mesh)
    activation = [f for f, w in from_weight.items() if not w]
    options = [
      rule.resolve_axes(chosen, first=activation),
      rule.resolve_axes(chosen, first=[f for f, w in from_weight.items() if w]),
    ]
    costs = [self._settlement_cost(rule, o, chosen, activation, specs, info) for o in options]
    if None in costs:
      return options[0]
    return options[costs.index(min(costs))]

  def _settlement_cost(self, rule, resolved, chosen, activation, specs, info) -> Optional[int]:
    """Bytes `resolved` moves at the op (`pricing.price`), plus, for the axes it takes from
    the `activation` factors, one all-reduce of the results over them. None: a shape unknown."""
    cost = pricing.price(rule, resolved, specs, info.shapes, info.sizes, self.mesh)
    lost = tuple(a for f in activation for a in chosen[f] if a not in tuple(resolved.get(f, ())))
    summed = pricing.results_all_reduce_bytes(
      rule, resolved, lost, info.shapes, info.sizes, self.mesh
    )
    return None if cost is None or summed is None else cost + summed

  def _from_weight(self, key: Key) -> bool:
    """Whether `key`'s sharding started at a variable's layout."""
    state = self.states.get(key)
    return state is not None and state.prov.origin in self._weight_origins

  def _source_of(self, rule, dims, resolved, picked, proposed, key, keys) -> Optional[Key]:
    """The tensor whose sharding gave `key` its first new axes (None if nothing is new)."""
    current = self.states[key].axes if key in self.states else ((),) * len(dims)
    for entry, new, cur in zip(dims, proposed, current):
      if len(new) > len(cur) and new[: len(cur)] == cur:
        for f in dim_factors(entry):
          if resolved.get(f) and f in picked:
            src = keys[picked[f][1]]
            if src != key:
              return src
    return None

  @staticmethod
  def _reach_source(rule: OpRule, t: int, specs, keys) -> Optional[Key]:
    """A tensor with a known sharding that shares a factor with tensor `t` of the op.

    Propagation reaches `t` through it even when the sharding it brings has no
    axes: `t` is then replicated by propagation, not left unreached.
    """
    dims = rule.tensor_dims()
    mine = {f for e in dims[t] for f in dim_factors(e)}
    for i, (other, spec) in enumerate(zip(dims, specs)):
      if i == t or spec is None or other is None or keys[i] == keys[t]:
        continue
      if mine & {f for e in other for f in dim_factors(e) if rule.kind(f) != NEED_REPLICATION}:
        return keys[i]
    return None

  def _update(self, key: Key, proposed, prov: Provenance) -> bool:
    """Extend the open dims of `key` with `proposed` where compatible; True if anything changed.

    A tensor reached for the first time gets a state even when `proposed`
    holds no axes (it is then known to be replicated along this path).
    """
    rank = self._rank(key)
    if rank is None or len(proposed) != rank:
      return False
    if key in self.manual:  # inside a manual region: its manual axes are never proposed
      forbidden = self.manual[key]
      proposed = tuple(_cut(dim, forbidden) for dim in proposed)
    state = self.states.get(key)
    if state is None:
      self._set_state(key, _State(_dedupe(proposed), (False,) * rank, prov))
      return True
    cur = state.axes if state else ((),) * rank
    closed = state.closed if state else (False,) * rank
    merged = list(cur)
    changed_dims = []
    for d in range(rank):
      new = tuple(proposed[d])
      if closed[d] or len(new) <= len(cur[d]) or new[: len(cur[d])] != cur[d]:
        continue
      merged[d] = new
      changed_dims.append(d)
    if not changed_dims:
      return False
    # A mesh axis splits at most one dim: keep the axes the tensor already had.
    used = {a for d in range(rank) if d not in changed_dims for a in merged[d]}
    for d in changed_dims:
      keep = list(cur[d])
      for a in merged[d][len(cur[d]) :]:
        if a in used:
          break
        keep.append(a)
      used.update(keep)
      merged[d] = tuple(keep)
    if tuple(merged) == cur:
      return False
    self._set_state(key, _State(merged, closed, prov))
    return True

  # --- results -------------------------------------------------------------------------
  def _result(self, iterations) -> PropagationResult:
    shardings, provenance = {}, {}
    aux_only = self._auxiliary_tensors()
    made: Dict[tuple, NamedSharding] = {}  # spec -> its sharding: a few distinct ones per program

    def named(spec: tuple) -> NamedSharding:
      if spec not in made:
        made[spec] = NamedSharding(self.mesh, P(*spec))
      return made[spec]

    for graph in self.program.graphs():
      gs, gp = shardings.setdefault(graph.name, {}), provenance.setdefault(graph.name, {})
      for node in graph.nodes:
        info = self.infos[(graph.name, node.name)]
        for index, out in enumerate(node.outputs):
          key = (graph.name, out.name)
          rank = self._rank(key)
          state = self.states.get(key)
          if rank is None:
            gs[out.name], gp[out.name] = named(()), Provenance(UNKNOWN_RANK)
            continue
          if state is not None:
            gs[out.name] = named(tuple(state.axes))
            gp[out.name] = state.prov
            continue
          gs[out.name] = named((None,) * rank)
          gp[out.name] = self._fallback_provenance(info, index, rank, key in aux_only)
    result = PropagationResult(
      self.program, self.mesh, shardings, provenance, self.infos, self.warnings, iterations
    )
    result.manual = self.manual
    return result

  def _fallback_provenance(self, info: _NodeInfo, index: int, rank: int, aux: bool) -> Provenance:
    node = info.node
    if info.rule is None and info.ties is None:
      return Provenance(NO_RULE, op_type=node.op, detail=info.error or '')
    if rank == 0:
      return Provenance(SCALAR)
    if info.rule is not None:
      dims = info.rule.results[index]
      factors = [f for e in dims or () for f in dim_factors(e)]
      shape = info.shapes[len(node.inputs) + index] or ()
      if (
        dims is None
        or all(info.rule.kind(f) == NEED_REPLICATION for f in factors)
        or all(s == 1 for s in shape)
      ):
        return Provenance(BY_RULE, op_type=node.op)
    if aux:
      return Provenance(
        AUXILIARY, detail='unused' if not info.graph.consumers(node.outputs[index].name) else ''
      )
    return Provenance(DEFAULT)

  def _auxiliary_tensors(self) -> set:
    """Tensors used only as auxiliary operands (shape, axes, index lists), directly or through
    shape arithmetic whose results are themselves only auxiliary or replicated by rule."""
    consumers: Dict[Key, List[Tuple[_NodeInfo, int]]] = {}
    for info in self.infos.values():
      for i, t in enumerate(info.node.inputs):
        consumers.setdefault((info.graph.name, t), []).append((info, i))
    by_rule = set()
    for info in self.infos.values():
      if info.rule is None:
        continue
      for dims, out in zip(info.rule.results, info.node.outputs):
        factors = [f for e in dims or () for f in dim_factors(e)]
        if dims is None or all(info.rule.kind(f) == NEED_REPLICATION for f in factors):
          by_rule.add((info.graph.name, out.name))
    # Tensors nothing uses (dead code, e.g. unused gradient pieces) count as auxiliary.
    outputs = {(g.name, t) for g in self.program.graphs() for t in g.outputs}
    aux: set = {
      (info.graph.name, o.name)
      for info in self.infos.values()
      for o in info.node.outputs
      if (info.graph.name, o.name) not in consumers
      and (info.graph.name, o.name) not in outputs
      and (info.graph.name, o.name) not in self.states
    }
    grew = True
    while grew:
      grew = False
      for key, uses in consumers.items():
        if key in aux or key in self.states:
          continue
        if all(self._aux_use(info, i, aux, by_rule) for info, i in uses):
          aux.add(key)
          grew = True
    return aux

  @staticmethod
  def _aux_use(info: _NodeInfo, index: int, aux: set, by_rule: set) -> bool:
    if info.rule is None:
      return False
    if info.rule.operands[index] is None:
      return True
    outs = [(info.graph.name, o.name) for o in info.node.outputs]
    return bool(outs) and all(k in aux or k in by_rule for k in outs)


def _merge_compatible(specs) -> tuple:
  """The first spec, with each dim extended by later specs whose axes it is a prefix of.

  Compatible partial shardings merge (P('data', None) and P(None, 'model') give
  P('data', 'model')); where they conflict the earlier spec wins.
  """
  merged = [tuple(d) for d in specs[0]]
  for other in specs[1:]:
    if len(other) != len(merged):
      continue
    used = {a for d in merged for a in d}
    for d, axes in enumerate(other):
      cur = merged[d]
      if len(axes) > len(cur) and tuple(axes[: len(cur)]) == cur:
        extra = []
        for a in axes[len(cur) :]:
          if a in used:
            break
          extra.append(a)
        merged[d] = cur + tuple(extra)
        used.update(extra)
  return tuple(merged)


def _cut(axes, forbidden) -> tuple:
  """`axes` up to the first forbidden one (a dim's axes are major to minor)."""
  out = []
  for a in axes:
    if a in forbidden:
      break
    out.append(a)
  return tuple(out)


def _dedupe(spec) -> tuple:
  """Per-dim axes with any axis already used by an earlier dim cut off (with what follows it)."""
  used, out = set(), []
  for axes in spec:
    keep = []
    for a in axes:
      if a in used:
        break
      keep.append(a)
    used.update(keep)
    out.append(tuple(keep))
  return tuple(out)


def _element_bytes(tensor: ir.Tensor) -> int:
  """Bytes per element of a tensor (of the variable behind a handle); 4 where TF says none."""
  dtype = tensor.value_dtype if is_resource(tensor.dtype) else tensor.dtype
  return int(getattr(dtype, 'size', 0) or 4)


def _devices(mesh: Mesh, axes) -> int:
  n = 1
  for dim in axes:
    for a in dim:
      n *= mesh.axis_size(a)
  return n


def _unspecified_dims(node: ir.Node) -> Tuple[int, ...]:
  dims = registry.attr(node, 'unspecified_dims', []) or []
  return tuple(int(d) for d in dims)


def _variable_sharding(var) -> Optional[Sharding]:
  """The sharding stored on a variable (tf_gspmd.annotations or TF's own), or None."""
  try:
    from tf_gspmd.annotations import variable_sharding

    return variable_sharding(var)
  except (ImportError, TypeError):
    pass
  stored = getattr(var, '_tf_gspmd_sharding', None)
  if stored is not None:
    return stored
  getter = getattr(var, '_get_xla_sharding', None)
  proto = getter() if getter is not None else None
  return None if proto is None else op_sharding.from_proto(proto)


def propagate_program(program: ir.Program, mesh: Mesh) -> PropagationResult:
  """Propagate the annotations of `program` over every tensor of every graph it holds."""
  return Propagator(program, mesh).run()
