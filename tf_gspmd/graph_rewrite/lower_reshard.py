"""Lowering reshard routes onto the runtime's collective interface ("how", not "what").

`reshard(p, value, target, why)` moves a `Local` to `target`: it asks the
reshard search (`reshard.route_reshard`) for the steps and emits each one inside
the per-partition program being traced, mirroring the numpy simulator
(`reshard.sim`), which is the executable specification of every step;
each step class of `reshard.moves` has one method here (`_Lowering.EMIT`):

- Slice: a window of `chunk` rows at a per-partition start, rolled up by a
  per-partition shift (`reshard.slice_window`); rows past the end of the
  buffer land in the shard's padding, whose content is arbitrary anyway.
- AllGather / AllToAll: the collective, then `regroup_blocks` (static
  reshapes and slices) puts uneven blocks at their offsets.
- ReduceScatter / AllReduce: the collective on the (padded) buffer.
- Permute: the collective permute; devices that receive nothing keep their
  buffer (`tf.where` on a per-partition table), as the route says.
- Repad: a zero buffer, a masked write of the rows a device keeps, then per
  round one permute of fixed-size messages and a masked write of the received
  rows. Offsets and lengths come from per-partition tables (0 rows where a
  device has no entry), so the program is identical on every partition.

Everything that differs between partitions is a row of a constant table
indexed by the partition id (`backend.table`); partition ids are mesh device
ids, which is also what the routes' permute pairs name.

Sub-axes. The search may route on a refined mesh (`ReshardRoute.mesh`) whose
axes split a mesh axis into prime-factor sub-axes ('y' of 4 = 'y#0' x 'y#1',
same devices in the same row-major order). A step whose axes cover whole mesh
axes in order (('y#0', 'y#1') is 'y') runs on the runtime's backend with the
user's axis names. A step over a proper sub-axis ('y#1') runs on a second
backend of the same kind built over the refined mesh with the same partition
id, ordering token, devices and timeout: a `Collectives` backend forms its
groups from `Mesh.groups(axes)` and its positions from the row-major index
along `axes`, both of which the refined mesh gives exactly, and the TF backend
allocates group keys per (device assignment, mesh, axes) family, so the
sub-axis groups get keys of their own. The second backend shares the first
one's `records` list, so record indices (and the TF backend's progress
markers, which name a collective by its index) stay one sequence. This is
simpler than re-expressing sub-axis groups as permutes, and it keeps
all-to-all/all-gather over half an axis one collective, as the route costs it.

Device orders. A value may live on another device order of the backend's
mesh (a tile assignment in a TPU program's own order): the route then runs on
one of the two orders (`ReshardRoute.mesh`, or its refinement) and moves whole
shards once with a Permute by device pairs; collectives over that order's
axes run on a backend of the same kind built over it (`_backend_on`), whose
groups come from that order's `Mesh.groups`.

Runs of all-reduces with the same op are emitted as one all-reduce over the
union of their axes (`merged_steps`): the search splits tiny all-reduces over
sub-axes because its byte model rounds per-device pieces up.

Every collective is reported with `p.note_collective` (kind, axes, shape,
dtype, bytes of the local operand, why). Axes are the user's mesh axis names,
except for a proper sub-axis, which keeps its refined name ('y#1'). A Repad's
rounds are reported as permutes over the dim's axes; a Permute step as a
permute over the axes that change dims.
"""

from __future__ import annotations

import weakref
from typing import Dict, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf

from tf_gspmd import collectives as collectives_lib
from tf_gspmd.errors import Unsupported
from tf_gspmd.graph import emit
from tf_gspmd.graph_rewrite import reshard as rp
from tf_gspmd.graph_rewrite.partitioner import Local
from tf_gspmd.sharding import NamedSharding

_NOT_MOVABLE = (tf.resource, tf.variant, tf.string)


def _record(p, kind, axes, tensor, why):
  p.note_collective(
    {
      'kind': kind,
      'axes': tuple(axes),
      'shape': tuple(tensor.shape),
      'dtype': tensor.dtype.name,
      'bytes': int(tensor.shape.num_elements() or 0) * tensor.dtype.size,
      'why': why,
    }
  )


def _route(
  src: NamedSharding, dst: NamedSharding, shape: tuple, dtype_size: int
) -> rp.ReshardRoute:
  """The search's route (`route_reshard` caches it, keyed by the shardings themselves)."""
  return rp.route_reshard(src, dst, shape, dtype_size)


@tf.autograph.experimental.do_not_convert  # library code emitting ops: no autograph
def reshard(p, value: Local, target: NamedSharding, why: str = '') -> Local:
  """`value` laid out as `target`, by the search's route.

  `target` may keep some of the source's pending reductions (the search
  resolves the others); it cannot add new ones.
  """
  _check_value(p, value, target, why)
  shape = tuple(int(s) for s in value.shape)
  if 0 in shape:  # nothing to move: every shard is all padding
    return Local(tf.zeros(target.shard_shape(shape), value.dtype), target, shape)
  return apply_route(p, value, _route(value.sharding, target, shape, value.dtype.size), why)


@tf.autograph.experimental.do_not_convert
def apply_route(p, value: Local, route: rp.ReshardRoute, why: str = '') -> Local:
  """Emit the steps of a given `route` (e.g. `reshard.naive_route`) on `value`."""
  _check_value(p, value, route.dst)
  if (
    tuple(int(s) for s in value.shape) != tuple(route.shape)
    or not value.sharding.is_equivalent_to(route.src)
    or value.sharding.mesh != route.src.mesh
  ):
    raise ValueError(
      f'apply_route: the route is for {route.src} of {route.shape}, the value is '
      f'{value.sharding} of {tuple(value.shape)}.'
    )
  x = value.tensor
  lowering = _Lowering(p, route, why)
  for step in merged_steps(route):
    x = lowering.run(step, x)
    if tuple(x.shape) != tuple(step.shape_out):
      raise AssertionError(
        f'lower_reshard: {step.describe()} produced local shape '
        f'{tuple(x.shape)}, the route says {step.shape_out}\n{route}'
      )
  want_out = tuple(route.dst.shard_shape(route.shape))
  if tuple(x.shape) != want_out:
    raise AssertionError(
      f'lower_reshard: route ends with local shape {tuple(x.shape)}, the '
      f'target {route.dst} has shard shape {want_out}\n{route}'
    )
  return Local(x, route.dst, tuple(route.shape))


def _check_value(p, value: Local, target: NamedSharding, why: str = '') -> None:
  src, shape = value.sharding, tuple(int(s) for s in value.shape)
  if value.dtype in _NOT_MOVABLE:
    raise Unsupported(
      f'reshard {src} -> {target}'
      + (f' of {why}' if why else '')
      + f': a {value.dtype.name} value cannot be moved between partitions; keep '
      'it replicated, or shard the numbers it is made from.'
    )
  for s in (src, target):  # another device order of the backend's mesh is fine (a permute)
    if not s.mesh.is_reordering_of(p.backend.mesh):
      raise ValueError(
        f'reshard {src} -> {target}: {s} lives on {s.mesh!r}, the collective '
        f'backend on {p.backend.mesh!r}.'
      )
  want_in = tuple(src.shard_shape(shape))
  if tuple(value.tensor.shape) != want_in:
    raise ValueError(
      f'reshard {src} -> {target} of global shape {shape}: the local tensor has '
      f'shape {tuple(value.tensor.shape)}, not the shard shape {want_in}.'
    )


def merged_steps(route: rp.ReshardRoute) -> list:
  """The route's steps, with runs of all-reduces (same op) merged into one over their axes.

  Reducing over axes a, then over disjoint axes b, is one reduction over a and
  b. The search's byte model (ring all-reduce, 2(g-1) pieces of ceil(E/g)
  elements) rounds up for tensors with fewer elements than the group, so for a
  scalar it prices reducing over 'x#0' then 'x#1' below reducing over 'x';
  one collective is never slower, so that is what runs.
  """
  order = {a: i for i, a in enumerate(route.mesh.axis_names)}
  out = []
  for step in route.steps:
    last = out[-1] if out else None
    if (
      isinstance(step, rp.AllReduce)
      and isinstance(last, rp.AllReduce)
      and last.op == step.op
      and tuple(last.shape_in) == tuple(step.shape_in)
    ):
      axes = tuple(sorted(last.axes + step.axes, key=order.get))
      out[-1] = rp.AllReduce(axes, step.op, last.group_size * step.group_size, last.shape_in)
    else:
      out.append(step)
  return out


# --- sub-axes of a refined mesh ------------------------------------------------------------
_SUB_BACKENDS = weakref.WeakKeyDictionary()


def _backend_on(backend, mesh):
  """A backend of `backend`'s kind over `mesh` (same devices), sharing its records."""
  if mesh == backend.mesh:
    return backend
  per_mesh = _SUB_BACKENDS.setdefault(backend, {})
  if mesh not in per_mesh:
    sub = backend.with_mesh(mesh)
    sub.records = backend.records  # one sequence of record indices (progress markers)
    per_mesh[mesh] = sub
  return per_mesh[mesh]


class _AxisNames:
  """Translate a route's (sub-)axes to the user's mesh axes."""

  def __init__(self, user_meshes, route_mesh):
    """`user_meshes`: the meshes of the route's source and target (two device orders of one
    mesh, or one mesh twice); the route runs on one of them or on its refinement, `self.base`."""
    for user_mesh in user_meshes:
      if route_mesh == user_mesh:
        self.base = user_mesh
        self.owner = {a: a for a in user_mesh.axis_names}
        self.parts = {a: (a,) for a in user_mesh.axis_names}
        return
      refined, parts = rp.refined_mesh(user_mesh)
      if refined == route_mesh:
        self.base = user_mesh
        self.parts = parts
        self.owner = {s: a for a, subs in parts.items() for s in subs}
        return
    raise ValueError(
      f'lower_reshard: the route runs on {route_mesh!r}, which is neither of the '
      f'meshes {user_meshes!r} nor a prime-factor refinement of one.'
    )

  def _runs(self, axes: Sequence[str]):
    """[(name, whole)]: whole user axes where a full run of sub-axes appears in order."""
    out, i = [], 0
    axes = tuple(axes)
    while i < len(axes):
      owner = self.owner[axes[i]]
      subs = self.parts[owner]
      if axes[i : i + len(subs)] == subs:
        out.append((owner, True))
        i += len(subs)
      else:
        out.append((axes[i], False))
        i += 1
    return out

  def user(self, axes) -> Optional[Tuple[str, ...]]:
    """The same groups (in the same order) named by user axes, or None."""
    runs = self._runs(axes)
    return tuple(a for a, _ in runs) if all(whole for _, whole in runs) else None

  def for_record(self, axes) -> Tuple[str, ...]:
    """User axis names where possible, sub-axis names otherwise."""
    return tuple(a for a, _ in self._runs(axes))


# --- steps -----------------------------------------------------------------------------------
class _Lowering:
  """Emits the steps of one route inside the per-partition program being traced."""

  def __init__(self, p, route: rp.ReshardRoute, why: str):
    self.p = p
    self.route = route
    self.why = why
    self.backend = p.backend
    self.mesh = route.mesh  # the mesh the steps' axes name
    self.names = _AxisNames((route.src.mesh, route.dst.mesh), route.mesh)
    self.num_partitions = route.src.mesh.size  # partition ids are its device ids

  def run(self, step, x: tf.Tensor) -> tf.Tensor:
    return self.EMIT[type(step)](self, step, x)

  # --- plumbing ------------------------------------------------------------------------
  def _on(self, axes):
    """(backend, axes) to run a collective over the route's `axes`."""
    user = self.names.user(axes)
    if user is not None:  # whole axes: on the route's device order (the backend's, usually)
      return _backend_on(self.backend, self.names.base), user
    return _backend_on(self.backend, self.mesh), tuple(axes)

  def _note(self, kind: str, axes, x: tf.Tensor) -> None:
    _record(self.p, kind, self.names.for_record(axes), x, self.why)

  def _table(self, values: Dict[int, Sequence[int]], width: int, name: str):
    """Per-partition int32 rows (zeros for partitions not in `values`) as `width` scalars."""
    rows = np.zeros((self.num_partitions, width), np.int32)
    for pid, row in values.items():
      rows[pid] = row
    # A column equal on every partition is a Python int, no lookup: what it drives (e.g. a
    # slice's roll by 0 on an even split) is decided here instead of run on every call.
    constant = (rows == rows[0]).all(axis=0)
    if constant.all():
      return [int(v) for v in rows[0]]
    looked_up = tf.unstack(self.backend.table(rows, name=name), num=width)  # one op, no bounds
    return [int(rows[0, i]) if constant[i] else looked_up[i] for i in range(width)]

  def _positions(self, axes) -> Dict[int, int]:
    return {d: self.mesh.linear_index(d, axes) for d in self.mesh.devices}

  # --- local ---------------------------------------------------------------------------
  def _slice(self, step: rp.Slice, x):
    rows = int(x.shape[step.dim])
    windows = {
      d: rp.slice_window(i, step.chunk, rows) for d, i in self._positions(step.axes).items()
    }
    start, shift = self._table(windows, 2, 'slice_window')
    y = _window(x, step.dim, start, step.chunk)
    if isinstance(shift, int) and shift == 0:
      return y
    return tf.roll(y, -shift, axis=step.dim)

  # --- collectives -------------------------------------------------------------------------
  def _all_gather(self, step: rp.AllGather, x):
    backend, axes = self._on(step.axes)
    self._note('all_gather', step.axes, x)
    y = backend.all_gather(x, axes, step.dim)
    return rp.regroup_blocks(y, step.dim, step.blocks, step.out_chunk, reshape=_reshape)

  def _all_to_all(self, step: rp.AllToAll, x):
    backend, axes = self._on(step.axes)
    x = collectives_lib.pad_dim(x, step.split_dim, step.split_padded)
    self._note('all_to_all', step.axes, x)
    y = backend.all_to_all(x, axes, step.split_dim, step.concat_dim)
    return rp.regroup_blocks(y, step.concat_dim, step.blocks, step.out_chunk, reshape=_reshape)

  def _reduce_scatter(self, step: rp.ReduceScatter, x):
    backend, axes = self._on(step.axes)
    x = collectives_lib.pad_dim(x, step.dim, step.padded)
    self._note('reduce_scatter', step.axes, x)
    return backend.reduce_scatter(x, axes, step.dim, step.op)

  def _all_reduce(self, step: rp.AllReduce, x):
    backend, axes = self._on(step.axes)
    self._note('all_reduce', step.axes, x)
    return backend.all_reduce(x, axes, step.op)

  def _permute(self, step: rp.Permute, x):
    moved = [
      a
      for before, after in zip(step.from_axes, step.to_axes)
      if before != after
      for a in before + after
    ]
    self._note('permute', tuple(a for a in self.mesh.axis_names if a in moved), x)
    got = self.backend.permute(x, step.pairs)
    return self._keep_where_not_received(x, got, step.pairs)

  def _keep_where_not_received(self, x, got, pairs):
    receives = np.zeros(self.num_partitions, bool)
    receives[[t for _, t in pairs]] = True
    if receives.all():
      return got
    return tf.where(self.backend.table(receives, name='receives'), got, x)

  def _repad(self, step: rp.Repad, x):
    dim = step.dim
    out = tf.zeros(step.shape_out, x.dtype)
    kept = {d: (src, dst, n) for d, src, dst, n in step.local}
    out = self._masked_write(out, x, dim, *self._table(kept, 3, 'repad_local'))
    for rnd in step.rounds:
      (start,) = self._table({d: (s,) for d, s in rnd.sends}, 1, 'repad_send')
      message = _window(x, dim, start, rnd.size)
      self._note('permute', step.axes, message)
      got = self.backend.permute(message, rnd.pairs)
      placed = {d: (mo, do, n) for d, mo, do, n in rnd.recvs}
      out = self._masked_write(out, got, dim, *self._table(placed, 3, 'repad_recv'))
    return out

  # The one place a step class meets the ops it becomes.
  EMIT = {
    rp.Slice: _slice,
    rp.AllGather: _all_gather,
    rp.AllToAll: _all_to_all,
    rp.ReduceScatter: _reduce_scatter,
    rp.AllReduce: _all_reduce,
    rp.Permute: _permute,
    rp.Repad: _repad,
  }

  @staticmethod
  def _masked_write(out, src, dim, src_off, dst_off, length):
    """out rows [dst_off, dst_off+length) along `dim` = src rows [src_off, src_off+length)."""
    if isinstance(length, int) and length == 0:
      return out
    rows_out, rows_src = int(out.shape[dim]), int(src.shape[dim])
    r = tf.range(rows_out, dtype=tf.int32)
    index = tf.clip_by_value(r - dst_off + src_off, 0, rows_src - 1)
    moved = tf.gather(src, index, axis=dim)
    inside = tf.logical_and(r >= dst_off, r < dst_off + length)
    shape = [1] * out.shape.rank
    shape[dim] = rows_out
    return tf.where(tf.reshape(inside, shape), moved, out)


def _reshape(x: tf.Tensor, shape) -> tf.Tensor:
  """tf.reshape to a static `shape`, its shape constant shared within the graph."""
  return tf.reshape(x, emit.constant(np.asarray(shape, np.int32)))


def _window(x: tf.Tensor, dim: int, start, size: int) -> tf.Tensor:
  """Rows [start, start+size) of `dim` (start may be a scalar tensor), with a static shape."""
  if isinstance(start, int):
    return collectives_lib.slice_dim(x, dim, start, size)
  begin = emit.constant(np.eye(x.shape.rank, dtype=np.int32)[dim]) * start
  sizes = [int(s) for s in x.shape]
  sizes[dim] = size
  return tf.slice(x, begin, emit.constant(np.asarray(sizes, np.int32)))
