"""The SPMD partitioner: re-emit a propagated graph as one per-partition program.

Inside the per-partition function being traced, every IR node becomes local
op(s) on this partition's shards. A `Local` pairs a local tensor with its
sharding (which may hold a pending reduction) and its global shape. Before an
op runs, each operand is resharded to what the op's handler requires; the
reshard search decides how, and `lower_reshard` emits the collectives.

Handlers are chosen by `lookup` (`dispatch.lookup`: hand-written handlers,
named by the op's registry entry, for shape-carrying ops, variables, control
flow, windowed ops; otherwise derived from the op's propagation rule; an op
with neither is computed on replicated operands with one warning naming it).
The engine is given it, so it imports no handler.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np
import tensorflow as tf

from tf_gspmd.graph import ir, static_values
from tf_gspmd.mesh import Mesh
from tf_gspmd.sharding import NamedSharding, P

log = logging.getLogger('tf_gspmd')


@dataclasses.dataclass(frozen=True)
class Local:
  """A value inside the per-partition program."""

  tensor: tf.Tensor  # this partition's shard, padded to the ceil shard shape
  sharding: NamedSharding  # how the global value is laid out (may be partial)
  shape: tuple  # the global shape

  @property
  def dtype(self) -> tf.DType:
    return self.tensor.dtype


def replicated(mesh: Mesh, rank: int) -> NamedSharding:
  return NamedSharding(mesh, P(*([None] * rank)))


@dataclasses.dataclass
class OpRecord:
  """What one IR node cost: the collectives emitted for it, and why."""

  graph: str
  node: str
  op: str
  how: str
  collectives: List[dict] = dataclasses.field(default_factory=list)


# A reshard's result of at most this many bytes per device is reused by every later read of
# the same value in the same sharding (`Partitioner.reshard`); a larger one is made again.
REUSED_RESHARD_BYTES = 2**20


def _local_bytes(value: 'Local') -> int:
  elements = value.tensor.shape.num_elements()
  return value.dtype.size * (elements if elements is not None else 1 << 62)


# Keys of `Partitioner.warn_once(..., per_process=True)` messages this process logged already.
_WARNED_IN_PROCESS: set = set()


class Partitioner:
  """Turns IR graphs into per-partition TF code, one node at a time.

  Args:
    program: the captured program.
    target: `target(graph, tensor_name) -> NamedSharding`, the propagated sharding.
    mesh: the device mesh.
    backend: the collective backend of the runtime (emits collectives, knows
      this partition's id and its position along mesh axes).
    resharder: `resharder(partitioner, local, target_sharding, why) -> Local`.
    lookup: `lookup(partitioner, node, graph) -> (handler, how)`.
    coalescer: defers pending sums and fuses their all-reduces (`coalesce.Coalescer`);
      None resolves each where it is produced.
    manual_regions: the program's manual regions (`manual.ManualRegions`) as propagation
      found them (`Propagation.manual_regions`): one search, in `propagation/manual.py`,
      for both.
  """

  def __init__(
    self,
    program: ir.Program,
    target: Callable[[ir.Graph, str], NamedSharding],
    mesh: Mesh,
    backend,
    resharder,
    lookup,
    coalescer=None,
    manual_regions=None,
  ):
    self.program = program
    self.target = target
    self.mesh = mesh
    self.backend = backend
    self._resharder = resharder
    self._lookup = lookup
    self.records: List[OpRecord] = []
    self._static: Dict[str, Dict[str, np.ndarray]] = {}
    self._warned = set()
    self._current: Optional[OpRecord] = None
    self._contexts = {}
    self._resource_shapes: Dict[str, Dict[str, tuple]] = {}
    # Pending sums resolved late, through linear ops, in buckets (graph_rewrite/coalesce.py).
    self._coalescer = coalescer
    # The manual regions propagation found (`Propagation.manual_regions`, a
    # `manual.ManualRegions`); found here only for a partitioner given none (tests).
    self._manual = manual_regions
    # (source tensor, its sharding, target sharding) -> the resharded value (see `reshard`).
    self._reshards: Dict[tuple, Local] = {}
    # An op's factor assignment by everything it depends on (`factors.choose_layouts`).
    self.layout_choices: Dict[tuple, object] = {}

  # --- values ---------------------------------------------------------------
  def static_value(self, graph: ir.Graph, tensor: str) -> Optional[np.ndarray]:
    """The value of `tensor` if it is known before the program runs."""
    if graph.name not in self._static:
      self._static[graph.name] = static_values.fold(graph)
    return self._static[graph.name].get(tensor)

  def rule_context(self, graph: ir.Graph):
    """What propagation rules may ask about `graph` (shapes, constants, variable shapes)."""
    from tf_gspmd.propagation.registry import RuleContext

    if graph.name not in self._contexts:
      self.static_value(graph, '')  # fold once, shared with the rules
      self._contexts[graph.name] = RuleContext(
        graph, self._resource_shapes.setdefault(graph.name, {}), self._static[graph.name]
      )
    return self._contexts[graph.name]

  def reshard_cost(self, src: NamedSharding, dst: NamedSharding, shape, dtype_size: int):
    """(bytes moved per device, peak per-device bytes) of resharding src -> dst."""
    moved, _, peak = self.reshard_price(src, dst, shape, dtype_size)
    return moved, peak

  def reshard_price(self, src: NamedSharding, dst: NamedSharding, shape, dtype_size: int):
    """(bytes moved per device, collectives run, peak per-device bytes) of src -> dst."""
    if src.is_equivalent_to(dst) and not src.partial_axes:
      return 0, 0, 0
    from tf_gspmd.graph_rewrite import reshard
    from tf_gspmd.graph_rewrite.reshard.route import collective_count

    route = reshard.route_reshard(src, dst, tuple(shape), dtype_size)
    return route.bytes_moved, collective_count(route), route.peak_bytes

  def reshard(self, value: Local, target: NamedSharding, why: str = '') -> Local:
    if value.sharding.is_equivalent_to(target) and not value.sharding.partial_axes:
      return value
    if value.sharding.partial_axes or value.dtype == tf.resource:
      return self._resharder(self, value, target, why)
    # One value resharded to one sharding once per graph, as XLA's partitioner caches its
    # reshards: a weight all-gathered for the forward matmul is the one its gradient matmul
    # reads, instead of a second all-gather of the same shards (a Keras step's backward reads
    # the forward's tensors). Only results of up to REUSED_RESHARD_BYTES per device: a
    # collective that small costs its latency, not its bytes; a larger one is made again where
    # it is read, as FSDP gathers a weight again for the backward, so that no gathered weight
    # is held from the forward to the backward. Only within the graph being emitted: a value
    # resharded inside a While body or a cond branch cannot be read outside it.
    graph = tf.compat.v1.get_default_graph()
    key = (value.tensor.ref(), value.sharding, target)
    done = self._reshards.get(key)
    if done is not None and done.tensor.graph is graph:
      return done
    done = self._resharder(self, value, target, why)
    if value.tensor.graph is graph and _local_bytes(done) <= REUSED_RESHARD_BYTES:
      self._reshards[key] = done
    return done

  def replicate(self, value: Local, why: str = '') -> Local:
    return self.reshard(value, replicated(self.mesh, len(value.shape)), why)

  def manual_region(self, graph: ir.Graph, tensor: str):
    """The manual region (`manual.Region`) computing `tensor`, or None."""
    if self._manual is None:
      from tf_gspmd.propagation import manual

      self._manual = manual.regions(self.program, self.mesh)
    return self._manual.region_of_tensor(graph.name, tensor)

  def manual_axes(self, graph: ir.Graph, tensor: str) -> tuple:
    """The mesh axes `tensor` is manual over (inside a manual region), or ()."""
    region = self.manual_region(graph, tensor)
    return region.axes if region is not None else ()

  def _into_region(self, graph: ir.Graph, node: ir.Node, operands: List[Local]) -> List[Local]:
    """Operands of a node inside a manual region, none split over its manual axes.

    A value from outside the region (a constant, a weight read there) enters it
    whole along the manual axes: every partition computes on all of it.
    """
    from tf_gspmd.propagation import manual

    if node.op == manual.ENTER or manual.per_output(node):
      return operands
    axes = next((self.manual_axes(graph, t.name) for t in node.outputs), ())
    if not axes:
      return operands
    out = []
    for value in operands:
      s = value.sharding
      if value.dtype == tf.resource or not isinstance(s, NamedSharding):
        out.append(value)
        continue
      spec = [tuple(a for a in s.spec.axes_of(d) if a not in axes) for d in range(len(s.spec))]
      partial = s.partial_axes
      keep = () if set(partial) & set(axes) else partial
      if spec == [s.spec.axes_of(d) for d in range(len(s.spec))] and keep == partial:
        out.append(value)
        continue
      target = NamedSharding(self.mesh, P(*[d or None for d in spec]))
      out.append(self.reshard(value, target, f'entering the manual region of {node.name}'))
    return out

  def note_collective(self, record: dict) -> None:
    if self._current is not None:
      self._current.collectives.append(record)

  def warn_once(self, key: str, message: str, per_process: bool = False) -> None:
    """Log `message` once per partitioner, or once per process with `per_process` (an op type
    without a rule: a Keras `fit` partitions each step function and signature anew)."""
    seen = _WARNED_IN_PROCESS if per_process else self._warned
    if key not in seen:
      seen.add(key)
      log.warning(message)

  # --- graphs ---------------------------------------------------------------
  def run_graph(
    self, graph: ir.Graph, args: Sequence[Local], bound: Optional[Dict[str, Local]] = None
  ) -> List[Local]:
    """Emit `graph` on local shards. `args` bind `graph.inputs`; `bound` binds others."""
    env: Dict[str, Local] = {}
    for name, value in list(zip(graph.inputs, args)) + list((bound or {}).items()):
      env[name] = value
      if value.dtype == tf.resource:  # rules ask for the variable's shape
        self._resource_shapes.setdefault(graph.name, {})[name] = tuple(value.shape)
    frame = self._coalescer.push(graph, env) if self._coalescer else None
    # Nodes that only feed variable updates (an optimizer's) and would resolve a pending
    # sum are emitted after every other node, once all pending sums are resolved
    # together: the gradients' all-reduces then fill one bucket instead of one per first
    # consumer.
    deferrable = self._coalescer.deferrable(graph) if frame is not None else frozenset()
    postponed: List[ir.Node] = []
    later = set()
    for node in graph.nodes:
      if node.outputs and all(t.name in env for t in node.outputs):
        continue  # an argument or a bound value
      if _after(node, later) or (
        node.name in deferrable and self._coalescer.would_resolve(self, frame, node, env)
      ):
        postponed.append(node)
        later.add(node.name)
        continue
      self._emit_node(graph, node, env, frame)
    if postponed:
      self._resolving(
        graph,
        'pending',
        f'{len(postponed)} update nodes postponed until the pending sums are resolved',
        lambda: self._coalescer.flush(self, frame),
      )
      for node in postponed:
        self._emit_node(graph, node, env, frame)
    if frame is not None:
      self._resolving(
        graph,
        'outputs',
        'pending sums resolved at the end of the graph',
        lambda: self._coalescer.pop(self, frame),
      )
    return [env[t] for t in graph.outputs]

  def _emit_node(self, graph: ir.Graph, node: ir.Node, env: Dict[str, Local], frame) -> None:
    operands = [env[t] for t in node.inputs]
    record = OpRecord(graph.name, node.name, node.op, '')
    self._current = record
    operands = self._into_region(graph, node, operands)
    linear = None
    if frame is not None:  # pending sums: resolved here, or kept through a linear node
      operands, linear = self._coalescer.before_node(self, frame, node, operands)
    handler, how = (linear, 'linear on pending sums') if linear else self._lookup(self, node, graph)
    record.how = how
    outs = handler(self, graph, node, operands)
    self._current = None
    self.records.append(record)
    for t, value in zip(node.outputs, outs):
      env[t.name] = value

  def _resolving(self, graph: ir.Graph, what: str, why: str, resolve: Callable[[], None]) -> None:
    """Run `resolve` (pending sums resolved outside any node) under a record of its own,
    kept if it emitted collectives."""
    self._current = OpRecord(graph.name, f'{graph.name}/{what}', what, why)
    resolve()
    if self._current.collectives:
      self.records.append(self._current)
    self._current = None

  def finish(self, graph: ir.Graph, value: Local, tensor: str) -> Local:
    """Reshard a node result to the sharding propagation chose for `tensor`; a pending sum
    that only needs an all-reduce is resolved later, in a bucket (coalesce.py)."""
    target = self.target(graph, tensor)
    if self._coalescer is not None:
      deferred = self._coalescer.defer(self, graph, value, tensor, target)
      if deferred is not None:
        return deferred
    return self.reshard(value, target, f'result {tensor}')


def _after(node: ir.Node, later) -> bool:
  """Whether `node` reads a postponed node's result or is ordered after one."""
  return any(ir.split_tensor_name(t)[0] in later for t in node.inputs) or any(
    c.lstrip('^') in later for c in node.control_inputs
  )
