"""A layout priced on the captured step without partitioning it: the search's fast model.

`tg.plan` prices one layout in seconds (propagation to a fixpoint, then the per-partition
program traced op by op); the search asks about hundreds. `Simulator` walks the captured
program once per layout instead, in milliseconds, with the pieces the partitioner uses:
each op's propagation rule (`OpRule.factor_candidates`: the mesh axes its operands give its
factors, a variable's own layout winning over its value's), the reshard search for every
operand moved to the layout the op needs (`route_reshard`: the same collectives, kinds and
bytes), pending sums kept through linear ops and resolved in fused buckets, the optimizer's
updates last (as `graph_rewrite/coalesce.py` orders them), and a liveness pass over local
bytes in that order. It leaves out propagation's backward flow (an op's layout comes from
its operands, then is moved where an annotation or a variable says otherwise) and the
partitioner's choice among factor assignments, so it ranks layouts; the search plans the
best few it ranks with `tg.plan` before choosing (`search.Search.verify`).

Every answer that depends only on an op and its operands' layouts is memoized on the
`Simulator` (a layer's ops see the same layouts in every candidate that leaves the layer
alone), so a walk after the first few costs little more than a dictionary lookup per op.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Dict, List, Optional, Tuple

import numpy as np
import tensorflow as tf

from tf_gspmd.auto_shard.constants import Constants
from tf_gspmd.auto_shard.cost import Evaluation
from tf_gspmd.graph import ir, static_values
from tf_gspmd.mesh import Mesh
from tf_gspmd.propagation import registry
from tf_gspmd.propagation.rule import REDUCTION, pick_candidate
from tf_gspmd.sharding import NamedSharding, P, named_for_rank
from tf_gspmd.step_cost import (
  StepFeatures,
  axes_size,
  factor_sizes,
  independent_spaces,
  local_points,
  minor_factors,
  op_counts,
  space_weights,
  vector_lanes,
)

Axes = Tuple[str, ...]
Spec = Tuple[Axes, ...]  # mesh axes per dim
# A value's layout: (spec, axes of a pending sum); None: free (a constant, a value nobody
# laid out yet: it takes whatever its consumer needs, at no cost).
SimSharding = Optional[Tuple[Spec, Axes]]
_UNMOVABLE = (tf.resource, tf.variant, tf.string)


@dataclasses.dataclass
class _Op:
  """What a walk needs of one node, computed once per program."""

  index: int
  node: ir.Node
  # 'argument', 'static', 'scalar', 'rule', 'whole' (no rule: operands replicated), 'skip'
  how: str
  rule: object = None
  entry: object = None
  shapes: list = dataclasses.field(default_factory=list)  # operand, then result shapes
  spaces: list = dataclasses.field(default_factory=list)  # [(factor sizes, [factors])]
  handles: Tuple[int, ...] = ()  # operands that are variable handles
  annotations: Dict[int, Spec] = dataclasses.field(default_factory=dict)  # result -> spec
  counted: Tuple[bool, ...] = ()  # per result: its bytes count in the activation peak
  names: Tuple[str, ...] = ()  # its results' tensor names
  sizes: Tuple[int, ...] = ()  # operand, then result dtype sizes
  inputs: Tuple[str, ...] = ()  # its operands' tensor names
  targeted: bool = False  # some result has a target (`Simulator._targets`)
  dtypes: Tuple[str, ...] = ()  # and dtypes
  weights: list = dataclasses.field(default_factory=list)  # per space: `space_weights`
  dtype: str = 'float32'  # its first result's: the rate its contractions run at
  minor: frozenset = frozenset()  # factors padded to `lanes` in its contractions (`step_cost`)
  lanes: int = 1
  # What `Simulator.core` reads of it, hashable: the same op of another layer of the same
  # shapes shares its answers (its index when a part cannot be hashed).
  structure: object = None


@dataclasses.dataclass(frozen=True)
class _Core:
  """An op on given operand layouts: what each operand must be, what each result is."""

  needs: Tuple[Optional[Spec], ...]
  results: Tuple[SimSharding, ...]
  points: float  # iteration-space points one device computes
  repeated: float  # beyond its 1/N share
  flops: float  # of its contractions, one device
  elementwise_bytes: float  # its other spaces' bytes read and written, one device


class Simulator:
  """Prices layouts of one captured program on `mesh` (see the module doc)."""

  def __init__(self, program: ir.Program, mesh: Mesh, constants: Constants):
    self.program, self.mesh, self.constants = program, mesh, constants
    self.profile = constants.profile()
    self.ops_run = op_counts(program)  # (on tensors, small)
    self.graph = program.main
    self.index = {node.name: i for i, node in enumerate(self.graph.nodes)}
    # Arguments, variables' handles and captured values: what the step is given.
    self.sources = set(program.arg_inputs) | set(program.variables) | set(program.captures)
    self.static = static_values.fold(self.graph)
    self.resource_shapes = _resource_shapes(program)
    self.context = registry.RuleContext(self.graph, self.resource_shapes, self.static)
    self.tensor_shapes = {t.name: self.shape(t.name) for t in self.graph.tensors()}
    self.dtype_sizes = {t.name: _dtype_size(t.dtype) for t in self.graph.tensors()}
    self.ops = [self._op(i, node) for i, node in enumerate(self.graph.nodes)]
    for op in self.ops:
      op.names = tuple(t.name for t in op.node.outputs)
      op.inputs = tuple(op.node.inputs)
      op.sizes = tuple(self.dtype_sizes[t] for t in op.inputs + op.names)
      op.dtypes = tuple(t.dtype.name for t in op.node.outputs)
    for op in self.ops:
      first = op.sizes[len(op.inputs)] if len(op.sizes) > len(op.inputs) else 0
      op.lanes = vector_lanes(self.profile.vector_bytes, first)  # its first result's dtype
      if op.rule is not None and op.lanes > 1:
        op.minor = minor_factors(op.rule)
      op.structure = _structure(op)
    self._mark_scalars()
    self.walked = [op for op in self.ops if op.how in ('rule', 'whole')]
    self.targets = self._targets()
    for op in self.ops:
      op.targeted = any(name in self.targets for name in op.names)
    self.deferrable, self.after = _update_nodes(self.graph)
    self.outputs = frozenset(self.graph.outputs)
    self.readers = collections.Counter(t for node in self.graph.nodes for t in node.inputs)
    self.variable_blocks = _variable_blocks(program, self.tensor_shapes)
    self._shardings: Dict[tuple, NamedSharding] = {}
    self._cores: Dict[tuple, _Core] = {}
    self._moves: Dict[tuple, tuple] = {}
    self._bytes: Dict[tuple, int] = {}
    self._sizes: Dict[Axes, int] = {}

  # --- once per program ----------------------------------------------------------------
  def _op(self, index: int, node: ir.Node) -> _Op:
    outs = [t for t in node.outputs if t.dtype not in _UNMOVABLE]
    if any(t.name in self.sources for t in node.outputs):
      return _Op(index, node, 'argument')
    if outs and all(t.name in self.static for t in outs):
      return _Op(index, node, 'static')
    entry = registry.entry_of(node.op)
    counted = tuple(t.dtype not in _UNMOVABLE and not entry.aliasing for t in node.outputs)
    annotations = {}
    for i, sharding in node.annotations.items():
      named = self._named(sharding, self.shape(node.outputs[i].name))
      if named is not None:
        annotations[i] = _spec_of(named.spec, self.shape(node.outputs[i].name))
    rule = None if node.called_functions() else self._rule(node, entry)
    if rule is None:
      how = 'whole' if outs or node.inputs else 'skip'
      return _Op(index, node, how, entry=entry, annotations=annotations, counted=counted)
    shapes = [self.shape(t) for t in list(node.inputs) + [o.name for o in node.outputs]]
    handles = tuple(i for i, t in enumerate(node.inputs) if t in self.program.variables)
    sizes = factor_sizes(rule, shapes)
    spaces = [(sizes, space) for space in independent_spaces(rule, sizes)] if sizes else []
    tensors = [self.graph.tensor(t) for t in node.inputs] + list(node.outputs)
    weights = space_weights(rule, [s for _, s in spaces], [_dtype_size(t.dtype) for t in tensors])
    dtype = node.outputs[0].dtype.name if node.outputs else 'float32'
    return _Op(
      index,
      node,
      'rule',
      rule,
      entry,
      shapes,
      spaces,
      handles,
      annotations,
      counted,
      weights=weights,
      dtype=dtype,
    )

  def _mark_scalars(self) -> None:
    """Ops on single elements from constants, arguments and other such ops (an optimizer's
    step counter, its learning-rate schedule: a third of a training step's ops) lay nothing
    out, move nothing and hold nothing: a walk skips them."""
    scalar = set()
    for op in self.ops:
      tensors = [t.name for t in op.node.outputs] + [
        t for t in op.node.inputs if t not in self.program.variables
      ]
      if op.how in ('static', 'argument'):
        continue
      shapes = [self.shape(t) for t in tensors]
      small = all(shape is not None and _elems(shape) <= 1 for shape in shapes)
      made_by = [ir.split_tensor_name(t)[0] for t in op.node.inputs]
      if small and all(self._is_source(n) or n in scalar for n in made_by):
        scalar.add(op.node.name)
        op.how = 'scalar'

  def _is_source(self, node: str) -> bool:
    """A constant, an argument or a variable's handle: nothing a walk lays out."""
    return self.ops[self.index[node]].how in ('static', 'argument')

  def _targets(self) -> Dict[str, tuple]:
    """tensor -> where propagation would lay it out, as far as a walk can tell before it
    starts: ('annotation', spec) for an annotated tensor, ('variable', handle) for a value
    an update writes into a variable, each carried back through ops that keep the shape
    (the optimizer's math, a residual add before `tg.shard`). An op producing a tensor with
    a target weighs making it that way (`_core`); a pending sum meeting another layout there
    is resolved where it is made (a reduce-scatter, never bucketed)."""
    out: Dict[str, tuple] = {}
    variables = self.program.variables
    for op in reversed(self.ops):
      inputs = op.node.inputs
      for i, spec in op.annotations.items():
        out[op.node.outputs[i].name] = ('annotation', spec)
      for handle in [inputs[i] for i in op.handles]:
        shape = self.resource_shapes.get(handle)
        for t in inputs:
          if t not in variables and self.shape(t) == shape:
            out.setdefault(t, ('variable', handle))
      for o in op.node.outputs:
        if o.name in out:
          for t in inputs:
            if t not in variables and self.shape(t) == self.shape(o.name):
              out.setdefault(t, out[o.name])
    return out

  def _named(self, sharding, shape) -> Optional[NamedSharding]:
    """An annotation as a NamedSharding on this mesh (TF's own `xla_sharding` is a tile
    assignment), None when it names no spec of it (or the shape is unknown)."""
    if shape is None or sharding.is_manual:
      return None
    try:
      return named_for_rank(sharding, self.mesh, len(shape))
    except ValueError:
      return None

  def _rule(self, node, entry):
    if entry.rule is None:
      return None
    try:
      return entry.rule(node, self.context)
    except Exception:  # noqa: BLE001 (a rule that cannot read this node: priced as whole)
      return None

  def shape(self, tensor: str) -> Optional[tuple]:
    t = self.graph.tensor(tensor)
    if t.dtype == tf.resource:
      return self.resource_shapes.get(tensor)
    if t.shape is None or None in t.shape:
      return None
    return tuple(int(d) for d in t.shape)

  def sharding(self, spec: Spec, partial: Axes = ()) -> NamedSharding:
    key = (spec, partial)
    found = self._shardings.get(key)
    if found is None:
      found = NamedSharding(self.mesh, P(*[_entry(a) for a in spec]), partial)
      self._shardings[key] = found
    return found

  def axes_size(self, axes: Axes) -> int:
    size = self._sizes.get(axes)
    if size is None:
      size = self._sizes[axes] = axes_size(self.mesh, axes)
    return size

  # --- memoized answers ------------------------------------------------------------------
  def core(self, op: _Op, operands: Tuple[SimSharding, ...], targets: tuple = ()) -> _Core:
    key = (op.structure, operands, targets)
    found = self._cores.get(key)
    if found is None:
      found = self._cores[key] = self._core(op, operands, targets)
    return found

  def _core(self, op: _Op, operands: Tuple[SimSharding, ...], targets: tuple) -> _Core:
    """The cheaper of two factor assignments (as `graph_rewrite.factors.choose_layouts`
    weighs its candidates, by the bytes they move): the operands' merge (the most devices
    win), and the results' targets first. Not each operand first, as the partitioner also
    tries: with targets known for few tensors, the assignment moving the least here often
    leaves a result that costs more downstream, where propagation's target forbids it."""
    rule, n = op.rule, len(op.rule.operands)
    data = [i for i, dims in enumerate(rule.operands) if dims is not None]
    if data and all(operands[i] is None for i in data):  # free operands: free results
      whole = self._work(op, {})  # laid out by their users: split
      split = [whole[0] / self.mesh.size, 0.0] + [w / self.mesh.size for w in whole[2:]]
      return _Core((None,) * n, (None,) * len(op.node.outputs), *split)
    firsts = [None] + ([n] if any(t is not None for t in targets) else [])
    options = []
    for first in firsts:
      core = self._assigned(op, self._factor_axes(op, operands, targets, first))
      if core not in options:
        options.append(core)
    return min(options, key=lambda core: self._moved(op, core, operands, targets))

  def _moved(self, op: _Op, core: _Core, operands, targets) -> int:
    """Bytes the collectives of `core` move: operands to what it needs, results to their
    targets."""
    pairs = list(zip(operands, core.needs, op.shapes, op.sizes)) + list(
      zip(core.results, targets, op.shapes[len(operands) :], op.sizes[len(operands) :])
    )
    total = 0
    for have, want, shape, size in pairs:
      if have is None or want is None or shape is None or (have[0] == want and not have[1]):
        continue
      total += sum(r[2] for r in self.move_cost(have, want, shape, size)[0])
    return total

  def _assigned(self, op: _Op, factor_axes: dict) -> _Core:
    rule, n = op.rule, len(op.rule.operands)
    effective = rule.representable(factor_axes, self.mesh, op.shapes)
    needs = rule.operand_specs(effective, self.mesh, op.shapes[:n])
    partial = tuple(
      a for f in rule.factors() if rule.kind(f) == REDUCTION for a in effective.get(f, ())
    )
    shapes = op.shapes[n:]
    results = rule.result_specs(effective, self.mesh, shapes)
    return _Core(
      tuple(None if s is None else _spec_of(s, sh) for s, sh in zip(needs, op.shapes[:n])),
      tuple(None if s is None else (_spec_of(s, sh), partial) for s, sh in zip(results, shapes)),
      *self._work(op, effective),
    )

  def _factor_axes(self, op: _Op, operands: Tuple[SimSharding, ...], targets: tuple, first) -> dict:
    """Each factor's axes from the proposals of its tensors: a variable's own layout wins,
    then tensor `first` (`n`: the results' targets), then the one over the most devices
    (`OpRule.factor_axes`' merge)."""
    rule, n = op.rule, len(op.rule.operands)
    specs = [
      None if dims is None or i >= len(operands) or operands[i] is None else operands[i][0]
      for i, dims in enumerate(rule.operands)
    ] + (list(targets) if targets and first == n else [None] * len(rule.results))
    chosen = {}
    for f, props in rule.factor_candidates(specs, self.mesh).items():
      own = [p for p in props if p[1] in op.handles]
      preferred = [p for p in props if p[1] == first or (first == n and p[1] >= n)]
      if props:
        chosen[f] = (own or preferred or [pick_candidate(props, self.mesh)])[0][0]
    if not op.entry.combinable:
      chosen = {f: a for f, a in chosen.items() if rule.kind(f) != REDUCTION}
    chosen = {f: a for f, a in chosen.items() if f not in rule.windows}  # halos: kept whole
    return rule.resolve_axes(chosen)

  def _work(self, op: _Op, factor_axes: dict) -> Tuple[float, float, float, float]:
    """(points, repeated points, contraction flops, elementwise bytes) of one device."""
    points = repeated = flops = nbytes = 0.0
    for (sizes, space), (contraction, per_point) in zip(op.spaces, op.weights):
      total = float(np.prod([sizes[f] for f in space], dtype=np.float64))
      devices = {f: self.axes_size(tuple(factor_axes.get(f, ()))) for f in space}
      local, run = local_points(space, sizes, devices, op.minor, op.lanes)
      points += local
      repeated += max(0.0, local - total / self.mesh.size)
      if contraction:
        flops += 2.0 * run
      else:
        nbytes += per_point * local
    return points, repeated, flops, nbytes

  def move_cost(self, layout: Tuple[Spec, Axes], want: Spec, shape: tuple, size: int) -> tuple:
    """(collective records, bytes of the moved copy) of resharding `layout` to `want`."""
    key = (layout, want, shape, size)
    found = self._moves.get(key)
    if found is None:
      from tf_gspmd.graph_rewrite.reshard import route_reshard

      route = route_reshard(self.sharding(*layout), self.sharding(want), shape, size)
      records = tuple(
        (step.kind, tuple(getattr(step, 'axes', ())), size * _elems(step.shape_in))
        for step in route.steps
        if step.kind != 'slice'
      )
      found = self._moves[key] = (
        records,
        _copy_bytes(route.steps, size, self.local_bytes(want, shape, size)),
      )
    return found

  def local_bytes(self, spec: Optional[Spec], shape: tuple, size: int) -> int:
    key = (spec, shape, size)
    found = self._bytes.get(key)
    if found is None:
      local = shape if spec is None else self.sharding(spec).shard_shape(shape)
      found = self._bytes[key] = size * _elems(local)
    return found

  # --- once per layout -------------------------------------------------------------------
  def evaluate(
    self, variables: Dict[str, Optional[P]], arguments: List[Optional[P]], choice: tuple = ()
  ) -> Evaluation:
    """The cost model's terms for one layout: `variables` maps a variable's placeholder to its
    spec (missing or None: left to propagation), `arguments` gives each argument's spec."""
    walk = _Walk(self, variables, arguments)
    walk.run()
    features = StepFeatures(
      self.mesh.size,
      self.ops_run[0],
      tuple(sorted(walk.flops.items())),
      walk.elementwise_bytes,
      walk.collectives(),
      self.ops_run[1],
    )
    return Evaluation(choice, None, walk.memory(), features, self.profile, int(walk.repeated))


class _Walk:
  """One layout walked through the program: layouts, collectives, work and live bytes."""

  def __init__(self, sim: Simulator, variables, arguments):
    self.sim = sim
    self.layouts: Dict[str, SimSharding] = {}
    self.variables: Dict[str, SimSharding] = {
      name: _layout_of(variables.get(name), sim.tensor_shapes[name])
      for name in sim.program.variables
    }
    for name, spec in zip(sim.program.arg_inputs, arguments):
      self.layouts[name] = _layout_of(spec, sim.tensor_shapes[name])
    self.records: List[tuple] = []
    self.pending: Dict[str, Tuple[Axes, str]] = {}  # tensor -> (its sum's axes, dtype)
    self.points = self.repeated = self.elementwise_bytes = 0.0
    self.flops: Dict[str, float] = {}  # dtype -> contraction flops
    self.step = 0  # ops walked so far: the clock of the liveness pass
    self.born: Dict[str, Tuple[int, int]] = {}  # tensor -> (step, local bytes)
    self.last: Dict[str, int] = {}  # tensor -> the step of its last reader
    self.transient: List[Tuple[int, int]] = []  # (step, bytes) of copies made for one op

  def run(self) -> None:
    """The ops in the partitioner's order: an optimizer update that would resolve a pending
    sum waits (with what follows it) until every pending sum is resolved in buckets."""
    waiting: List[_Op] = []
    later: set = set()
    after, deferrable = self.sim.after, self.sim.deferrable
    for op in self.sim.walked:
      if (later and after[op.index] & later) or (op.index in deferrable and self.would_resolve(op)):
        waiting.append(op)
        later.add(op.index)
        continue
      self.visit(op)
    self.resolve_all()
    for op in waiting:
      self.visit(op)
    self.resolve_all()

  def visit(self, op: _Op) -> None:
    self.step += 1
    last, step = self.last, self.step
    for t in op.inputs:
      last[t] = step
    if op.how == 'rule':
      self.ruled(op)
    elif op.how == 'whole':
      self.whole(op)

  def would_resolve(self, op: _Op) -> bool:
    pending = [i for i, t in enumerate(op.node.inputs) if t in self.pending]
    if not pending:
      return False
    if op.how != 'rule' or not op.entry.linear or len(op.node.outputs) != 1:
      return True
    operands = [self.operand(t) for t in op.node.inputs]
    return _linear_result(op, self.sim, operands, pending) is None

  def operand(self, tensor: str) -> SimSharding:
    if tensor in self.variables:
      return self.variables[tensor]
    return self.layouts.get(tensor)

  def ruled(self, op: _Op) -> None:
    inputs, variables, layouts = op.inputs, self.variables, self.layouts
    operands = [variables[t] if t in variables else layouts.get(t) for t in inputs]
    if self.pending and any(t in self.pending for t in inputs):
      if op.entry.linear and self.linear(op, operands):
        return
      for t in inputs:  # resolving one resolves its bucket: the others' too
        if t in self.pending:
          self.resolve_bucket(self.pending[t])
      operands = [variables[t] if t in variables else layouts.get(t) for t in inputs]
    targets = tuple(self.target(name) for name in op.names) if op.targeted else ()
    core = self.sim.core(op, tuple(operands), targets)
    for i, (need, lay) in enumerate(zip(core.needs, operands)):
      if need is None or (lay is not None and lay[0] == need and not lay[1]):
        continue
      self.move(inputs[i], lay, need, op.shapes[i])
    for i, layout in enumerate(core.results):
      self.produce(op, i, layout)
    self.count(op, core)

  def count(self, op: _Op, core: _Core) -> None:
    self.points += core.points
    self.repeated += core.repeated
    self.elementwise_bytes += core.elementwise_bytes
    if core.flops:
      self.flops[op.dtype] = self.flops.get(op.dtype, 0.0) + core.flops

  def linear(self, op: _Op, operands: List[SimSharding]) -> bool:
    """A linear op on pending sums (coalesce.py's forms): its result is pending alike."""
    node = op.node
    pending = [i for i, t in enumerate(node.inputs) if t in self.pending]
    if not pending or len(node.outputs) != 1:
      return False
    shared = any(self.sim.readers.get(node.inputs[i], 0) > 1 for i in pending)
    result = None if shared else _linear_result(op, self.sim, operands, pending)
    if result is None:
      return False
    for i in pending:  # the sum moves on into the result
      self.pending.pop(node.inputs[i], None)
    self.produce(op, 0, result)
    self.count(op, self.sim.core(op, _unpended(operands)))  # the work on the pending blocks
    return True

  def whole(self, op: _Op) -> None:
    """An op with no rule (or a called function): operands and results replicated."""
    for t in op.node.inputs:
      shape = self.sim.tensor_shapes.get(t)
      if shape is None or not self.sim.dtype_sizes[t]:
        continue
      self.move(t, self.resolved(t, self.layouts.get(t)), ((),) * len(shape), shape)
    for i, name in enumerate(op.names):
      shape = self.sim.tensor_shapes[name]
      self.produce(op, i, None if shape is None else (((),) * len(shape), ()))

  # --- values ------------------------------------------------------------------------------
  def produce(self, op: _Op, index: int, layout: SimSharding) -> None:
    """Result `index` of `op` made with `layout` (moved to its annotation, if it has one)."""
    name = op.names[index]
    want = op.annotations.get(index)
    if want is not None and layout is not None and (want != layout[0] or layout[1]):
      self.move(name, layout, want, self.sim.tensor_shapes[name])
      layout = (want, ())
    if layout is not None and layout[1]:
      layout = self.toward_target(name, layout, op.counted[index])
    self.layouts[name] = layout
    if layout is not None and layout[1]:
      self.pending[name] = (layout[1], op.dtypes[index])
    if op.counted[index]:
      self.hold(name)

  def target(self, tensor: str) -> Optional[Spec]:
    """Where `tensor` is bound (`Simulator._targets`), as this layout has it, or None."""
    found = self.sim.targets.get(tensor)
    if found is None:
      return None
    if found[0] == 'annotation':
      return found[1]
    variable = self.variables[found[1]]
    return None if variable is None else variable[0]

  def toward_target(self, tensor: str, layout: Tuple[Spec, Axes], own: bool) -> SimSharding:
    """A pending sum bound for another layout: resolved into it at once. Its unreduced block
    (`own`: a buffer of its own, not a view of a held operand) lives until the collective
    reads it, beside the collective's result: it is held only as what it becomes."""
    target = self.target(tensor)
    if target is None or target == layout[0]:
      return layout
    shape = self.sim.tensor_shapes[tensor]
    if own:
      size = self.sim.dtype_sizes[tensor]
      self.transient.append((self.step, self.sim.local_bytes(layout[0], shape, size)))
    self.move(tensor, layout, target, shape)
    return (target, ())

  def resolved(self, tensor: str, layout: SimSharding) -> SimSharding:
    """`layout` with its pending sum resolved (with every other one of its bucket)."""
    if tensor not in self.pending:
      return layout
    self.resolve_bucket(self.pending[tensor])
    return self.layouts[tensor]

  def resolve_bucket(self, key: Tuple[Axes, str]) -> None:
    members = [t for t, k in self.pending.items() if k == key]
    total = sum(self.nbytes(t) for t in members)
    self.records.append(('all_reduce', key[0], total))
    self.transient.append((self.step, total))  # the fused buffer (its parts die into it)
    for t in members:
      del self.pending[t]
      self.layouts[t] = (self.layouts[t][0], ())

  def resolve_all(self) -> None:
    for key in list(dict.fromkeys(self.pending.values())):
      if key in self.pending.values():
        self.resolve_bucket(key)

  def move(self, tensor: str, layout: SimSharding, want: Spec, shape) -> None:
    """`tensor` resharded from `layout` to `want`: nothing for a free value; a variable left
    to propagation takes the layout its first user needs."""
    if tensor in self.variables:  # a variable's handle: its layout wins, or is set here
      if self.variables[tensor] is None:
        self.variables[tensor] = (want, ())
      return
    if layout is None and shape is not None:
      self.materialize(tensor, want)
      return
    if layout is None or shape is None or (layout[0] == want and not layout[1]):
      return
    records, copy = self.sim.move_cost(layout, want, shape, self.sim.dtype_sizes[tensor])
    self.records.extend(records)
    self.transient.append((self.step, copy))

  def materialize(self, tensor: str, want: Spec) -> None:
    """A free value (a fill, a broadcast constant) is made where its users want it, free
    for each: it holds the largest of those layouts' bytes (not its all-split guess)."""
    if tensor in self.born:
      born, held = self.born[tensor]
      size = self.sim.dtype_sizes[tensor]
      wanted = self.sim.local_bytes(want, self.sim.tensor_shapes[tensor], size)
      self.born[tensor] = (born, max(held, wanted))

  def nbytes(self, tensor: str) -> int:
    shape = self.sim.tensor_shapes[tensor]
    if shape is None:
      return 0
    layout = self.layouts.get(tensor)
    size = self.sim.dtype_sizes[tensor]
    if layout is None:  # free: its users lay it out, as split as they are (at best, all)
      return size * -(-_elems(shape) // self.sim.mesh.size)
    return self.sim.local_bytes(layout[0], shape, size)

  def hold(self, tensor: str) -> None:
    held = self.nbytes(tensor)
    if held:
      self.born[tensor] = (self.step, held)

  def activation_peak(self) -> int:
    """The most local bytes live at once: each value from the op making it to its last
    reader (graph outputs to the end), each copy made for one op during that op."""
    end = self.step + 1
    live = [0] * (end + 2)
    for tensor, (born, held) in self.born.items():
      dies = end if tensor in self.sim.outputs else self.last.get(tensor, born)
      live[born] += held
      live[dies + 1] -= held
    for at, held in self.transient:
      live[at] += held
      live[at + 1] -= held
    return int(max(np.cumsum(live)))

  # --- totals --------------------------------------------------------------------------------
  def collectives(self) -> tuple:
    """(kind, group size, mesh axes spanned, bytes) of each collective (no axes: all)."""
    mesh = self.sim.mesh
    return tuple(
      (
        kind,
        self.sim.axes_size(axes) if axes else mesh.size,
        len(axes) or len(mesh.axis_names),
        nbytes,
      )
      for kind, axes, nbytes in self.records
    )

  def memory(self) -> int:
    """Parameters + optimizer state + the activation peak, per device."""
    held = 0
    for name, shape, size in self.sim.variable_blocks:
      layout = self.variables[name]
      held += self.sim.local_bytes(None if layout is None else layout[0], shape, size)
    return held + self.activation_peak()


# --- helpers ----------------------------------------------------------------------------------
def _structure(op: _Op) -> object:
  """Everything `Simulator._core` reads of `op` (its rule, shapes, dtype sizes, handles, work
  spaces, lanes), as one hashable key; `op.index` when some part is not hashable."""
  rule = op.rule
  if rule is None:
    return op.index
  try:
    key = (
      rule.structure(),
      tuple(None if s is None else tuple(s) for s in op.shapes),
      op.sizes,
      len(op.node.outputs),
      op.handles,
      bool(op.entry.combinable),
      tuple((tuple(sorted(sizes.items())), tuple(space)) for sizes, space in op.spaces),
      tuple(tuple(w) for w in op.weights),
      op.lanes,
      op.minor,
    )
    hash(key)
  except TypeError:
    return op.index
  return key


def _variable_blocks(program: ir.Program, shapes: Dict[str, Optional[tuple]]) -> List[tuple]:
  """(placeholder, shape, dtype size) of each variable once (two handles of one variable
  hold one block), those of unknown shape left out."""
  blocks, seen = [], set()
  for name, variable in program.variables.items():
    if id(variable) in seen or shapes[name] is None:
      continue
    seen.add(id(variable))
    blocks.append((name, shapes[name], tf.as_dtype(variable.dtype).size))
  return blocks


def _linear_result(
  op: _Op, sim: Simulator, operands: List[SimSharding], pending: List[int]
) -> SimSharding:
  """The pending layout of a linear op's result, or None when its operands must be resolved
  first (a product of two pending sums, a reshape or sum moving a split dim)."""
  form, node = op.entry.linear, op.node
  first = operands[pending[0]]
  shapes = sim.tensor_shapes
  out_shape = shapes[node.outputs[0].name]
  if out_shape is None or first is None:
    return None
  if form in ('reshape', 'sum'):  # linear when it runs on the blocks as they are
    if pending != [0]:
      return None
    core = sim.core(op, _unpended(operands))
    result = core.results[0] if core.results else None
    moved = core.needs[0] != first[0]
    return None if result is None or result[1] or moved else (result[0], first[1])
  if shapes[node.inputs[pending[0]]] != out_shape:
    return None
  if form in ('add', 'add_n', 'subtract'):
    alike = len(pending) == len(node.inputs) and len(set(operands)) == 1
    return first if alike else None
  if form in ('scale', 'divide'):
    others = [shapes[t] for i, t in enumerate(node.inputs) if i not in pending]
    scalars = all(s is not None and _elems(s) <= 1 for s in others)
    ok = len(pending) == 1 and scalars and (form == 'scale' or pending == [0])
    return first if ok else None
  return first if pending == [0] else None


def _unpended(operands: List[SimSharding]) -> tuple:
  """Operand layouts with their pending sums dropped (a linear op computes on the blocks)."""
  return tuple(None if lay is None else (lay[0], ()) for lay in operands)


def _copy_bytes(steps, size: int, result: int) -> int:
  """The most a reshard's route holds beside its source: its result, or a reduce-scatter's
  full reduced block (TF has no CPU reduce-scatter: all-reduce, then a slice, as
  `runtime/collectives.py` emits it)."""
  held = [size * _elems(step.shape_in) for step in steps if step.kind == 'reduce_scatter']
  return max([result] + held)


def _elems(shape) -> int:
  return int(np.prod(shape, dtype=np.int64))


def _entry(axes: Axes):
  if not axes:
    return None
  return axes[0] if len(axes) == 1 else tuple(axes)


def _spec_of(spec: P, shape) -> Spec:
  rank = len(spec) if shape is None else len(shape)
  return tuple(tuple(spec.axes_of(d)) if d < len(spec) else () for d in range(rank))


def _layout_of(spec, shape) -> SimSharding:
  """A P or NamedSharding as a layout (None: left free, as is a sharding of no named spec)."""
  if isinstance(spec, NamedSharding):
    spec = spec.spec
  if not isinstance(spec, P) or shape is None:
    return None
  return (_spec_of(spec, shape), ())


def _resource_shapes(program: ir.Program) -> Dict[str, tuple]:
  from tf_gspmd.propagation.resource_shapes import infer_resource_shapes

  main = program.main.name
  return {t: s for (g, t), s in infer_resource_shapes(program).items() if g == main}


def _update_nodes(graph: ir.Graph) -> Tuple[frozenset, List[frozenset]]:
  """(indices of the nodes that only update variables, as `coalesce.Coalescer.deferrable`
  finds them; per node, the indices of the nodes it reads or is ordered after)."""
  from tf_gspmd.graph_rewrite.coalesce import Coalescer

  index = {node.name: i for i, node in enumerate(graph.nodes)}
  deferrable = frozenset(index[n] for n in Coalescer().deferrable(graph))
  after = [
    frozenset(
      index[name]
      for name in [ir.split_tensor_name(t)[0] for t in node.inputs]
      + [c.lstrip('^') for c in node.control_inputs]
      if name in index
    )
    for node in graph.nodes
  ]
  return deferrable, after


def _dtype_size(dtype) -> int:
  return 0 if dtype in _UNMOVABLE else dtype.size
