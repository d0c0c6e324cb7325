"""Fewer, larger collectives: pending sums resolved late, through linear ops, in buckets.

Design (deferred emission in the partitioner, not a post-pass: the partitioner
builds TF ops as it goes, and a finished TF graph is not rewritten).

1. Deferral. When a node's result holds a pending reduction (a partial
   `NamedSharding`, e.g. a weight gradient whose batch dim is split over
   'data') and the only thing between it and the layout propagation chose
   is one all-reduce over its partial axes (same spec, same device order, the
   search's route is that single all-reduce), `Partitioner.finish` hands it
   here instead of resolving it. It stays in the frame of the graph being
   emitted (`Frame.pending`), still partial.

2. Partial sums stay partial through linear ops. Before a node is emitted,
   the partitioner asks `Coalescer.before_node` about its operands. If the
   node is linear in its pending operands (AddV2/Add/AddN/Sub of pending sums
   with one layout, Neg, Mul or RealDiv of one pending sum by a non-partial
   scalar, Identity/Snapshot/XlaSharding keeping the layout, a Reshape that
   keeps every sharded dim in a common prefix) and each such operand has this
   node as its only consumer, the node runs on the local partial blocks
   (`linear_handler`) and its result is partial again: sum_i(a_i) + sum_i(b_i)
   = sum_i(a_i + b_i), c * sum_i(a_i) = sum_i(c * a_i). Products of two
   partials, a partial plus a non-partial value, or any non-linear op (Relu,
   Square, ...) are not linear: their pending operands are resolved first.

3. Buckets. A pending value is resolved just before its first consumer is
   emitted. Then every other pending value of the same group (mesh axes,
   reduction, dtype) in the same graph is resolved with it: their flattened
   local blocks are concatenated, all-reduced once, and split back (on XLA, emitted
   side by side for its all-reduce combiner, which needs no copy). Every
   member was already produced (it is pending), none depends on another's
   reduced value (a value that needs a reduced value is emitted after that
   reduction, so it cannot be pending beside it), so the fused collective
   sits after the last of its producers and before the first consumer. A
   group whose pending bytes reach `BUCKET_BYTES` is emitted at once, so no
   bucket exceeds that size (except a single larger value) and the buffer
   stays bounded. Pending graph outputs are resolved at the end of the graph.

4. Update nodes last. A weight gradient's first consumer may sit inside the
   backward pass (Keras reshapes an attention kernel's gradient there), which
   would resolve the group early and split the gradients over several
   all-reduces. So a node that would resolve a pending value and only updates
   variables (`Coalescer.deferrable`: no result reaches a graph output, and it
   reads no activation) is postponed, with everything that reads it or is
   ordered after it; at the end of the graph every pending value is resolved
   in buckets, then the postponed nodes are emitted. The backward pass reads
   activations, so it is never postponed: no sum another gradient waits for
   is delayed.

Deadlock freedom: there is one per-partition program, so every partition
emits the same collectives in the same order; the TF backend chains them per
device with its ordering token in emission order, and a fused all-reduce is
one collective in that chain like any other. Nested graphs (While bodies,
branches) have frames of their own: nothing is fused across graphs.

Set `TF_GSPMD_COALESCE=0` to turn deferral off (each pending sum is resolved
where it is produced, as before), e.g. to measure the difference.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Dict, List, Optional

import numpy as np
import tensorflow as tf

from tf_gspmd.graph.ir import split_tensor_name
from tf_gspmd.graph_rewrite.partitioner import Local
from tf_gspmd.sharding import NamedSharding

BUCKET_BYTES = 32 * 2**20  # largest fused all-reduce buffer (per device)

# Linear forms (`Entry.linear`) by what their pending operands must be.
_ADDS = ('add', 'add_n', 'subtract')  # every operand pending alike
_SCALED = ('scale', 'divide')  # operand 0 pending (divide: the numerator only)
_LAYOUT_ONLY = ('layout', 'annotate')


def linear_form(node) -> Optional[str]:
  """How `node` runs on pending sums (its registry entry's `linear`), None if it cannot."""
  from tf_gspmd.propagation import registry

  return registry.entry_of(node.op).linear


def enabled() -> bool:
  return os.environ.get('TF_GSPMD_COALESCE', '1') not in ('0', 'false', 'False', '')


def coalescer(bucket_bytes: Optional[int] = None) -> Optional['Coalescer']:
  """A fresh `Coalescer` for one partitioner, or None when TF_GSPMD_COALESCE=0."""
  return Coalescer(bucket_bytes) if enabled() else None


@dataclasses.dataclass
class Pending:
  tensor: str  # IR tensor name
  value: Local  # partial
  target: NamedSharding  # where it goes: value's spec, no pending reduction

  @property
  def group(self) -> tuple:
    s = self.value.sharding
    order = {a: i for i, a in enumerate(s.mesh.axis_names)}
    return (tuple(sorted(s.partial_axes, key=order.get)), s.partial, self.value.dtype)

  @property
  def nbytes(self) -> int:
    return int(self.value.tensor.shape.num_elements()) * self.value.dtype.size


@dataclasses.dataclass
class Frame:
  """The pending values of one run of one graph."""

  graph: object
  env: Dict[str, Local]
  pending: Dict[str, Pending] = dataclasses.field(default_factory=dict)


class Coalescer:
  """Defers pending-sum resolutions of one partitioner and emits them in buckets."""

  def __init__(self, bucket_bytes: Optional[int] = None):
    self.bucket_bytes = BUCKET_BYTES if bucket_bytes is None else int(bucket_bytes)
    self.frames: List[Frame] = []
    self._deferrable: Dict[int, tuple] = {}  # id(graph) -> (graph, its deferrable node names)

  # --- frames -------------------------------------------------------------------------
  def push(self, graph, env) -> Frame:
    frame = Frame(graph, env)
    self.frames.append(frame)
    return frame

  def pop(self, p, frame: Frame) -> None:
    """The graph is emitted: resolve its pending outputs (in buckets)."""
    outputs = [t for t in frame.graph.outputs if t in frame.pending]
    if outputs:
      self._resolve(p, frame, outputs)
    assert self.frames[-1] is frame
    self.frames.pop()

  def flush(self, p, frame: Frame) -> None:
    """Resolve every pending value of the frame (in buckets)."""
    if frame.pending:
      self._resolve(p, frame, list(frame.pending))

  def deferrable(self, graph) -> frozenset:
    """Names of the nodes of `graph` that only update variables (an optimizer's math and
    writes): none of their results reaches a graph output, and what they and everything
    downstream of them read is theirs, a variable, a scalar or a constant, never an
    activation. The backward pass is not among them (it reads the forward's
    activations), so postponing these delays no sum another gradient needs. What reads
    a postponed node (by data or control) follows it, so every ordering edge is kept."""
    cached = self._deferrable.get(id(graph))
    if cached is not None and cached[0] is graph:
      return cached[1]
    outputs = {split_tensor_name(t)[0] for t in graph.outputs}
    users = {
      n.name: {c for t in n.outputs for c, _ in graph.consumers(t.name)} for n in graph.nodes
    }
    no_output = set()  # no data path to a graph output
    for n in reversed(graph.nodes):
      if n.name not in outputs and users[n.name] <= no_output:
        no_output.add(n.name)
    found = set()
    for n in reversed(graph.nodes):
      if (
        n.name in no_output
        and users[n.name] <= found
        and all(_update_input(graph, t, no_output) for t in n.inputs)
      ):
        found.add(n.name)
    result = frozenset(found)
    self._deferrable[id(graph)] = (graph, result)
    return result

  # --- deferral -----------------------------------------------------------------------
  def defer(self, p, graph, value: Local, tensor: str, target: NamedSharding) -> Optional[Local]:
    """`value` kept pending (returned as it is) if its resolution to `target` is one
    all-reduce of its own; resolved at once with its group (returned resolved) when the group
    fills a bucket; None: not deferred, the caller resolves it."""
    frame = self.frames[-1] if self.frames else None
    if frame is None or frame.graph is not graph or not _single_all_reduce(p, value, target):
      return None
    if not graph.consumers(tensor) and tensor not in graph.outputs:
      return None  # nobody reads it: nothing to resolve
    frame.pending[tensor] = Pending(tensor, value, target)
    group = frame.pending[tensor].group
    members = [t for t, e in frame.pending.items() if e.group == group]
    if sum(frame.pending[t].nbytes for t in members) >= self.bucket_bytes:
      self._resolve(p, frame, members)
      return frame.env.pop(tensor)  # run_graph stores it when the node is done
    return value

  def would_resolve(self, p, frame: Frame, node, env: Dict[str, Local]) -> bool:
    """Whether emitting `node` now resolves a pending value (not a linear node on them)."""
    if not any(t in frame.pending for t in node.inputs):
      return False
    return not _linear_on_pending(p, frame, node, [env[t] for t in node.inputs])

  def before_node(self, p, frame: Frame, node, operands: List[Local]):
    """(operands, handler or None) for `node`: pending operands resolved, or kept pending
    for a linear node (then the handler is `linear_handler`)."""
    mine = [t for t in node.inputs if t in frame.pending]
    if not mine:
      return operands, None
    if _linear_on_pending(p, frame, node, operands):
      for t in mine:
        del frame.pending[t]  # folded into this node's (partial) result
      return operands, linear_handler
    self._resolve(p, frame, mine)
    return [frame.env[t] for t in node.inputs], None

  # --- resolution ---------------------------------------------------------------------
  def _resolve(self, p, frame: Frame, tensors) -> None:
    """Resolve `tensors` and every pending value of their groups, one bucket per group."""
    groups = {frame.pending[t].group for t in tensors if t in frame.pending}
    for group in sorted(groups, key=repr):
      members = [e for e in frame.pending.values() if e.group == group]
      for bucket in _buckets(members, self.bucket_bytes):
        for entry, resolved in zip(bucket, _all_reduce_bucket(p, bucket)):
          frame.env[entry.tensor] = resolved
          del frame.pending[entry.tensor]


def _buckets(members: List[Pending], limit: int) -> List[List[Pending]]:
  """Consecutive members (in production order) in buckets of at most `limit` bytes."""
  out, size = [], 0
  for entry in members:
    if out and size + entry.nbytes <= limit:
      out[-1].append(entry)
      size += entry.nbytes
    else:
      out.append([entry])
      size = entry.nbytes
  return out


def _all_reduce_bucket(p, bucket: List[Pending]) -> List[Local]:
  """The members' pending sums resolved together (`Collectives.all_reduce_many`: one
  all-reduce of their concatenated blocks, or, on XLA, one each side by side, which its
  combiner fuses without a copy); each collective emitted is recorded."""
  if len(bucket) == 1:  # one reshard's own route, as without coalescing
    entry = bucket[0]
    return [p.reshard(entry.value, entry.target, f'result {entry.tensor}')]
  axes, op, dtype = bucket[0].group
  why = f'bucket of {len(bucket)} pending {op}s: ' + ', '.join(e.tensor for e in bucket)

  def note(members: List[int]) -> None:
    """Record one all-reduce of the bucket's `members` (indices)."""
    sizes = [int(bucket[i].value.tensor.shape.num_elements()) for i in members]
    record = {
      'kind': 'all_reduce',
      'axes': axes,
      'shape': (sum(sizes),) if len(members) > 1 else tuple(bucket[members[0]].value.tensor.shape),
      'dtype': dtype.name,
      'bytes': sum(sizes) * dtype.size,
      'why': why if len(members) > 1 else f'{why} (this one: {bucket[members[0]].tensor})',
    }
    if len(members) > 1:
      record.update(fused=len(members), member_bytes=[size * dtype.size for size in sizes])
    p.note_collective(record)

  with tf.name_scope('gspmd_bucket'):
    reduced = p.backend.all_reduce_many([e.value.tensor for e in bucket], axes, op, note)
  return [Local(value, e.target, e.value.shape) for value, e in zip(reduced, bucket)]


def _single_all_reduce(p, value: Local, target: NamedSharding) -> bool:
  """Whether `value` -> `target` is exactly one all-reduce over value's partial axes on the
  backend's own mesh (what a bucket does for it)."""
  s = value.sharding
  if not s.partial_axes or target.partial_axes or s.spec != target.spec:
    return False
  if s.mesh != p.backend.mesh or target.mesh != p.backend.mesh or 0 in value.shape:
    return False
  if value.dtype in (tf.resource, tf.variant, tf.string) or value.dtype.is_complex:
    return False
  from tf_gspmd.graph_rewrite import lower_reshard, reshard

  route = lower_reshard._route(s, target, tuple(int(d) for d in value.shape), value.dtype.size)  # noqa: SLF001
  steps = lower_reshard.merged_steps(route)
  # The route may name prime-factor sub-axes of the partial axes (all of them: the same groups).
  return (
    len(steps) == 1
    and isinstance(steps[0], reshard.AllReduce)
    and steps[0].group_size == s.mesh.axes_size(s.partial_axes)
  )


def _update_input(graph, tensor: str, no_output) -> bool:
  """Whether an update node may read `tensor`: made by another such node, a variable
  handle, a constant or a scalar (a learning rate, a step count)."""
  producer = graph.producer(tensor)
  if producer.name in no_output or producer.op == 'Const':
    return True
  t = graph.tensor(tensor)
  if t.dtype == tf.resource:
    return True
  return t.shape is not None and None not in t.shape and math.prod(t.shape) == 1


# --- linear ops on pending sums ----------------------------------------------------------
def _only_consumer(frame: Frame, tensor: str, node) -> bool:
  graph = frame.graph
  return tensor not in graph.outputs and [n for n, _ in graph.consumers(tensor)] == [node.name]


def _linear_on_pending(p, frame: Frame, node, operands: List[Local]) -> bool:
  """Whether `node` is linear in its pending operands and may run on their partial blocks."""
  form = linear_form(node)
  if form is None or len(node.outputs) != 1:
    return False
  pending = [t in frame.pending for t in node.inputs]
  if not all(_only_consumer(frame, t, node) for t, is_p in zip(node.inputs, pending) if is_p):
    return False
  first = operands[0]
  out = node.outputs[0].name
  out_shape = frame.graph.tensor(out).shape
  if out_shape is None or None in out_shape:
    return False
  if form in _ADDS:
    return (
      all(pending)
      and first.sharding.partial == 'sum'
      and all(
        o.sharding.is_equivalent_to(first.sharding)
        and o.shape == first.shape
        and o.dtype == first.dtype
        for o in operands
      )
    )
  if form in _SCALED:
    if form == 'scale' and pending == [False, True]:  # c * x: the same as x * c
      first, pending = operands[1], [True, False]
    other = operands[0] if first is not operands[0] else operands[1]
    return (
      pending == [True, False]
      and first.sharding.partial == 'sum'
      and not other.sharding.partial_axes
      and math.prod(other.shape) == 1
      and len(other.shape) <= len(first.shape)
      and tuple(out_shape) == tuple(first.shape)
    )
  if form == 'negate':
    return pending == [True] and first.sharding.partial == 'sum'
  if form in _LAYOUT_ONLY:
    if not pending[0] or any(pending[1:]):
      return False
    target = p.target(frame.graph, out)
    return form != 'annotate' or (
      target.spec == first.sharding.spec and target.mesh == first.sharding.mesh
    )
  if form == 'reshape':
    return pending == [True, False] and _reshape_prefix(first, tuple(out_shape)) is not None
  if form == 'sum':
    return (
      pending == [True, False]
      and first.sharding.partial == 'sum'
      and _summed_dims(operands[1], first) is not None
    )
  return False


def _summed_dims(axes: Local, value: Local) -> Optional[tuple]:
  """The dims a Sum reduces if it names them statically and none is sharded (summing the
  local partial block is then exact), else None."""
  given = tf.get_static_value(axes.tensor)
  rank = len(value.shape)
  if given is None or rank == 0:
    return None
  dims = tuple(sorted({int(a) % rank for a in np.atleast_1d(given)}))
  if any(value.sharding.spec.axes_of(d) for d in dims if d < len(value.sharding.spec)):
    return None
  return dims


def _reshape_prefix(value: Local, out_shape: tuple) -> Optional[int]:
  """Length of the common leading dims of in and out shapes if it holds every sharded dim
  (a local reshape is then exact), else None."""
  in_shape = tuple(value.shape)
  keep = 0
  while keep < min(len(in_shape), len(out_shape)) and in_shape[keep] == out_shape[keep]:
    keep += 1
  spec = value.sharding.spec
  if any(spec.axes_of(d) for d in range(keep, len(in_shape))):
    return None
  return keep


def linear_handler(p, graph, node, operands: List[Local]) -> List[Local]:
  """`node` on the local partial blocks of its pending operands; the result is partial."""
  form = linear_form(node)
  first, other = operands[0], operands[1:]
  if form == 'scale' and first.sharding.partial_axes == () and other[0].sharding.partial_axes:
    first, other = other[0], [first]  # c * x
  out = node.outputs[0].name
  out_shape = tuple(int(d) for d in graph.tensor(out).shape)
  name = node.name + '/gspmd/pending'
  sharding = first.sharding
  if form == 'add':
    y = tf.add(first.tensor, operands[1].tensor, name=name)
  elif form == 'add_n':
    y = tf.add_n([o.tensor for o in operands], name=name)
  elif form == 'subtract':
    y = tf.subtract(first.tensor, operands[1].tensor, name=name)
  elif form == 'negate':
    y = tf.negative(first.tensor, name=name)
  elif form in _SCALED:
    # The one-element factor whole on every partition: split by an axis (its element on one
    # shard, the others empty or padding) it would scale most blocks by nothing.
    scalar = tf.reshape(p.replicate(other[0], f'factor of pending {node.op}').tensor, [])
    y = (tf.multiply if form == 'scale' else tf.math.truediv)(first.tensor, scalar, name=name)
  elif form in _LAYOUT_ONLY:
    y = tf.identity(first.tensor, name=name)
  elif form == 'sum':  # over unsharded dims: the partial axes stay, those dims go
    dims = _summed_dims(operands[1], first)
    keep = bool(node.attrs['keep_dims'].b) if 'keep_dims' in node.attrs else False
    spec = tuple(first.sharding.spec) + (None,) * (len(first.shape) - len(first.sharding.spec))
    spec = (
      tuple(None if d in dims else a for d, a in enumerate(spec))
      if keep
      else tuple(a for d, a in enumerate(spec) if d not in dims)
    )
    sharding = NamedSharding(
      first.sharding.mesh, spec, first.sharding.partial_axes, first.sharding.partial
    )
    y = tf.reduce_sum(first.tensor, list(dims), keepdims=keep, name=name)
  else:  # Reshape keeping the sharded prefix
    keep = _reshape_prefix(first, out_shape)
    spec = tuple(first.sharding.spec)[:keep] + (None,) * (len(out_shape) - keep)
    sharding = NamedSharding(
      first.sharding.mesh, spec, first.sharding.partial_axes, first.sharding.partial
    )
    y = tf.reshape(first.tensor, sharding.shard_shape(out_shape), name=name)
  value = Local(y, sharding, out_shape)
  return [p.finish(graph, value, out)]
