"""The collective interface used inside a per-partition program.

`Collectives` is what a per-partition program (written by hand or emitted by
the partitioner) calls to talk to the other partitions. Every method takes
mesh axes (a tuple of `Mesh` axis names), never device lists: the groups are
the mesh's groups along those axes (`Mesh.groups(axes)`), and a partition's
position inside its group is its row-major index along `axes` in the order
given. The program is the same for every partition; whatever differs is read
from constant tables indexed by `partition_id` (see `tables.py`).

Uneven shards follow `tf_gspmd.sharding`: a dim of global size `n` split `k`
ways is held as ceil(n/k)-sized shards, the trailing ones padded. Because all
padding sits at the end, gathering padded shards and keeping the first `n`
rows gives the global value (`all_gather(..., size=n)`), and a reduce-scatter
or all-to-all pads its split dim to a multiple of `k` itself.

Any dtype of numbers (and bool) goes through every collective: a dtype the backends'
kernels refuse travels as one they take, exactly (`carriers.carrier_for`).

Every call is recorded in `records` (kind, axes, local shape, dtype, bytes, name; a
`carried_as` param names the carrier dtype)
so later stages can count and explain collectives, and its ops live under a
readable name scope, `<current scope>/gspmd/<kind>_<i>`.

Two backends implement the interface: `tf_gspmd.runtime.TFCollectives` (TF
collective V2 ops between logical devices; runs on CPU and GPU) and
`tf_gspmd.xla_bridge.XlaCollectives` (XLA collective ops, compiled by XLA).
The partitioner emits its collectives through this interface only, so it
knows neither backend.
"""

from __future__ import annotations

import abc
import collections
import dataclasses
from typing import Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf

from tf_gspmd.collectives import tables
from tf_gspmd.collectives.carriers import carrier_for, reduces_by_gather
from tf_gspmd.mesh import Mesh
from tf_gspmd.sharding import REDUCTIONS, Sharding

KINDS = ('all_reduce', 'all_gather', 'reduce_scatter', 'all_to_all', 'permute', 'broadcast')
DEFAULT_TIMEOUT = 120.0  # seconds the launcher lets a collective wait for its peers


@dataclasses.dataclass(frozen=True)
class CollectiveRecord:
  """One emitted collective, as later stages count and report it.

  `groups` is a [G, k] array of partition ids (the replica groups); for a
  permute it is the [M, 2] array of (source, target) pairs.
  """

  index: int
  kind: str
  name: str
  axes: Tuple[str, ...]
  shape: Tuple[int, ...]
  dtype: tf.DType
  bytes: int
  group_size: int
  groups: np.ndarray = dataclasses.field(repr=False, compare=False)
  params: Tuple[Tuple[str, object], ...] = ()

  def group_of(self, partition: int) -> Tuple[int, ...]:
    """The partitions `partition` talks to in this collective (itself included)."""
    if self.kind == 'permute':
      peers = {int(v) for s, t in self.groups for v in (s, t) if partition in (s, t)}
      return tuple(sorted(peers | {int(partition)}))
    rows = np.nonzero((self.groups == partition).any(axis=1))[0]
    return tuple(int(p) for p in self.groups[rows[0]]) if len(rows) else (int(partition),)

  def describe(self) -> str:
    params = ''.join(f', {k}={v!r}' for k, v in self.params)
    dims = ','.join(str(d) for d in self.shape)
    return (
      f"{self.kind} '{self.name}' over mesh axes {self.axes}{params} on {self.dtype.name}[{dims}]"
    )


# Local reductions of gathered pieces (`reduces_by_gather`).
_LOCAL_REDUCE = {
  'sum': tf.reduce_sum,
  'prod': tf.reduce_prod,
  'max': tf.reduce_max,
  'min': tf.reduce_min,
}


def _check_op(op: str, kind: str, axes) -> str:
  if op not in REDUCTIONS:
    scope = tf.get_current_name_scope()
    raise ValueError(
      f'{kind} over mesh axes {tuple(axes)}'
      + (f" in '{scope}'" if scope else '')
      + f': unknown reduction {op!r}; expected one of {REDUCTIONS}.'
    )
  return op


def _static_shape(x: tf.Tensor, what: str) -> Tuple[int, ...]:
  if not x.shape.is_fully_defined():
    raise ValueError(
      f'{what}: the local operand must have a static shape, got {x.shape}. '
      'Per-partition programs are traced with static shard shapes.'
    )
  return tuple(int(d) for d in x.shape)


def _scaled(shape, dim, factor):
  """`shape` with dim `dim` multiplied by `factor`."""
  return shape[:dim] + (shape[dim] * factor,) + shape[dim + 1 :]


def _check_dim(dim: int, rank: int, what: str) -> int:
  if not -rank <= dim < rank:
    raise ValueError(f'{what}: dim {dim} is out of range for a rank-{rank} operand.')
  return dim % rank


def pad_dim(x: tf.Tensor, dim: int, size: int) -> tf.Tensor:
  """Zero-pad static dim `dim` of `x` at its end up to `size`."""
  have = int(x.shape[dim])
  if have == size:
    return x
  paddings = [[0, 0]] * x.shape.rank
  paddings[dim] = [0, size - have]
  return tf.pad(x, paddings)


def slice_dim(x: tf.Tensor, dim: int, start, size: int) -> tf.Tensor:
  """x[..., start:start+size, ...] along `dim`; `start` may be a scalar tensor."""
  rank = x.shape.rank
  if isinstance(start, int):
    if start == 0 and size == int(x.shape[dim]):
      return x
    begin = [0] * rank
    begin[dim] = start
  else:
    begin = tf.one_hot(dim, rank, dtype=tf.int32) * tf.cast(start, tf.int32)
  # Static sizes where known, not -1: XLA lowers a slice at a run-time `begin` (a partition's
  # table entry) only when every size is a constant it need not work out from `begin`.
  sizes = [-1 if d is None else int(d) for d in x.shape.as_list()]
  sizes[dim] = size
  return tf.slice(x, begin, sizes)


def merge_leading_into(y: tf.Tensor, dim: int) -> tf.Tensor:
  """[k, d0, ..., d_dim, ...] -> [d0, ..., k * d_dim, ...]: stack the k pieces along `dim`."""
  shape = [int(d) for d in y.shape]
  k, piece = shape[0], shape[1:]
  if dim:
    perm = list(range(1, dim + 1)) + [0] + list(range(dim + 1, len(shape)))
    y = tf.transpose(y, perm)
  merged = piece[:dim] + [k * piece[dim]] + piece[dim + 1 :]
  return tf.reshape(y, merged)


def split_leading_from(x: tf.Tensor, dim: int, k: int) -> tf.Tensor:
  """[d0, ..., k * c, ...] -> [k, d0, ..., c, ...]: cut `dim` into k chunks, chunk index first."""
  shape = [int(d) for d in x.shape]
  c = shape[dim] // k
  y = tf.reshape(x, shape[:dim] + [k, c] + shape[dim + 1 :])
  if dim:
    perm = [dim] + list(range(dim)) + list(range(dim + 1, len(shape) + 1))
    y = tf.transpose(y, perm)
  return y


def no_autograph(cls):
  """Keep autograph out of library code: only the user's per-partition function is converted.

  Every `Collectives` subclass gets it by itself (`Collectives.__init_subclass__`).
  """
  for attr, value in list(vars(cls).items()):
    if callable(value) and not isinstance(value, type) and not attr.startswith('__'):
      setattr(cls, attr, tf.autograph.experimental.do_not_convert(value))
  return cls


class _no_dependencies:
  """Build ops outside any enclosing control-dependency scope (shared table rows)."""

  def __enter__(self):
    self._scope = tf.control_dependencies(None)
    return self._scope.__enter__()

  def __exit__(self, *exc):
    return self._scope.__exit__(*exc)


@no_autograph
class Collectives(abc.ABC):
  """Collectives over mesh axes, called inside the per-partition program.

  Subclasses emit the communication (`_all_reduce`, `_all_gather`, ...); this
  base class validates arguments, handles trivial groups (size 1: no op),
  padding of uneven dims, dtypes the backends refuse (`carrier_for`), naming and recording.
  """

  backend = 'abstract'
  # Device types whose kernels its programs may run beyond CPU and GPU ones (an XLA JIT's).
  kernel_device_types: frozenset = frozenset()

  def __init_subclass__(cls, **kwargs):
    # Every backend's collectives keep autograph out, without remembering a decorator.
    super().__init_subclass__(**kwargs)
    no_autograph(cls)

  def __init__(self, mesh: Mesh, partition_id, *, name: str = 'gspmd'):
    tables.check_mesh(mesh)
    self.mesh = mesh
    self.partition_id = tf.convert_to_tensor(partition_id, dtype=tf.int32)
    self.name = name
    self.records = []
    self._counts = collections.Counter()
    self._rows = {}  # (graph, table bytes) -> this partition's row, one per table per graph

  def with_mesh(self, mesh: Mesh) -> 'Collectives':
    """The same backend over `mesh` (same devices, other axes: a refined mesh's sub-axes)."""
    raise NotImplementedError(f'{type(self).__name__} cannot run collectives on another mesh.')

  # --- where this partition is ---------------------------------------------------
  @property
  def num_partitions(self) -> int:
    return self.mesh.size

  def axis_size(self, axes) -> int:
    return self.mesh.axes_size(tables.normalize_axes(self.mesh, axes))

  def table(self, values, name: str = 'table') -> tf.Tensor:
    """Row `partition_id` of `values` (first dim: one entry per partition id)."""
    values = np.asarray(values)
    if values.shape[:1] != (self.num_partitions,):
      raise ValueError(
        f'table {name!r}: expected one row per partition ({self.num_partitions}), '
        f'got shape {values.shape}.'
      )
    # One constant per distinct table and graph: a program's many collectives share a
    # few tables (group keys, positions), and each holds one row per partition, so
    # copies would make the program grow with the number of partitions.
    graph = tf.compat.v1.get_default_graph()
    key = (graph, values.dtype.str, values.shape, values.tobytes())
    if key not in self._rows:
      with _no_dependencies():
        self._rows[key] = tf.gather(tf.constant(values), self.partition_id, name=name)
    return self._rows[key]

  def axis_index(self, axes) -> tf.Tensor:
    """This partition's row-major position along `axes` (int32 scalar; 0 for no axes)."""
    axes = tables.normalize_axes(self.mesh, axes)
    if not axes:
      return tf.constant(0, tf.int32)
    return self.table(tables.positions(self.mesh, axes), name='axis_index')

  def shard_offsets(self, sharding: Sharding, shape: Sequence[int]) -> tf.Tensor:
    """Start of this partition's shard of a tensor of global `shape` (int32 [rank])."""
    return self.table(
      tables.shard_offset_table(sharding, shape, self.num_partitions), name='shard_offsets'
    )

  # --- the collectives ---------------------------------------------------------------
  def all_reduce(self, x, axes, op: str = 'sum') -> tf.Tensor:
    """Reduce `x` elementwise over each group along `axes`; every member gets the result."""
    x, axes = tf.convert_to_tensor(x), tables.normalize_axes(self.mesh, axes)
    op = _check_op(op, 'all_reduce', axes)
    _static_shape(x, 'all_reduce')
    if self.mesh.axes_size(axes) == 1:
      return x
    if reduces_by_gather(x.dtype, op):
      return self._reduce_by_gather(x, axes, op)
    return self._emit(
      'all_reduce', x, axes, dict(op=op), lambda v: self._all_reduce(v, axes, op), op=op
    )

  def all_reduce_many(self, values: Sequence, axes, op: str = 'sum', note=None) -> list:
    """`all_reduce` of each of `values` (one bucket of pending sums), as one collective: their
    flattened blocks concatenated, reduced once and split back (a backend running one
    collective per call pays its latency once). `note(indices)` is told each collective
    emitted and which values it reduces."""
    if note is not None:
      note(list(range(len(values))))
    sizes = [int(v.shape.num_elements()) for v in values]
    flat = tf.concat([tf.reshape(v, [-1]) for v in values], 0, name='concat')
    pieces = tf.split(self.all_reduce(flat, axes, op), sizes, name='split')
    return [tf.reshape(piece, v.shape) for piece, v in zip(pieces, values)]

  def all_gather(self, x, axes, dim: int, size: Optional[int] = None) -> tf.Tensor:
    """Concatenate the members' `x` along `dim` in position order.

    With `size`, keep only the first `size` entries of `dim`: the global value
    when the members held ceil-sized shards of a dim of that size.
    """
    x, axes = tf.convert_to_tensor(x), tables.normalize_axes(self.mesh, axes)
    shape = _static_shape(x, 'all_gather')
    dim = _check_dim(dim, len(shape), 'all_gather')
    k = self.mesh.axes_size(axes)
    if size is not None and not 0 <= size <= k * shape[dim]:
      raise ValueError(
        f'all_gather over {axes}: size {size} does not fit {k} shards of {shape[dim]} along '
        f'dim {dim}.'
      )
    y = (
      x
      if k == 1
      else self._emit(
        'all_gather',
        x,
        axes,
        dict(dim=dim),
        lambda v: self._all_gather(v, axes, dim),
        out_shape=_scaled(shape, dim, k),
      )
    )
    return y if size is None else slice_dim(y, dim, 0, size)

  def reduce_scatter(self, x, axes, dim: int, op: str = 'sum') -> tf.Tensor:
    """Reduce over the group, then keep chunk `axis_index(axes)` of ceil(n/k) along `dim`."""
    x, axes = tf.convert_to_tensor(x), tables.normalize_axes(self.mesh, axes)
    op = _check_op(op, 'reduce_scatter', axes)
    shape = _static_shape(x, 'reduce_scatter')
    dim = _check_dim(dim, len(shape), 'reduce_scatter')
    k = self.mesh.axes_size(axes)
    if k == 1:
      return x
    chunk = -(-shape[dim] // k)
    x = pad_dim(x, dim, k * chunk)
    if reduces_by_gather(x.dtype, op):
      reduced = self._reduce_by_gather(x, axes, op)
      mine = slice_dim(reduced, dim, self.axis_index(axes) * chunk, chunk)
      mine.set_shape(shape[:dim] + (chunk,) + shape[dim + 1 :])
      return mine
    return self._emit(
      'reduce_scatter',
      x,
      axes,
      dict(dim=dim, op=op),
      lambda v: self._reduce_scatter(v, axes, dim, op),
      op=op,
      out_shape=shape[:dim] + (chunk,) + shape[dim + 1 :],
    )

  def all_to_all(
    self, x, axes, split_dim: int, concat_dim: int, concat_size: Optional[int] = None
  ) -> tf.Tensor:
    """Send chunk j of `split_dim` (ceil-sized) to member j; concatenate arrivals on `concat_dim`.

    With `concat_size`, keep only the first `concat_size` entries of the concat dim.
    """
    x, axes = tf.convert_to_tensor(x), tables.normalize_axes(self.mesh, axes)
    shape = _static_shape(x, 'all_to_all')
    split_dim = _check_dim(split_dim, len(shape), 'all_to_all split_dim')
    concat_dim = _check_dim(concat_dim, len(shape), 'all_to_all concat_dim')
    k = self.mesh.axes_size(axes)
    if k == 1:
      y = x
    else:
      chunk = -(-shape[split_dim] // k)
      x = pad_dim(x, split_dim, k * chunk)
      out_shape = list(shape)
      out_shape[split_dim] = chunk
      out_shape[concat_dim] *= k
      y = self._emit(
        'all_to_all',
        x,
        axes,
        dict(split_dim=split_dim, concat_dim=concat_dim),
        lambda v: self._all_to_all(v, axes, split_dim, concat_dim),
        out_shape=out_shape,
      )
    if concat_size is not None:
      if not 0 <= concat_size <= int(y.shape[concat_dim]):
        raise ValueError(
          f'all_to_all over {axes}: concat_size {concat_size} exceeds '
          f'{int(y.shape[concat_dim])} along dim {concat_dim}.'
        )
      y = slice_dim(y, concat_dim, 0, concat_size)
    return y

  def permute(self, x, pairs) -> tf.Tensor:
    """Collective permute: partition `dst` gets `x` of `src` for each (src, dst); others get zeros.

    Each partition may appear at most once as a source and once as a target.
    """
    x = tf.convert_to_tensor(x)
    _static_shape(x, 'permute')
    pairs = self._check_pairs(pairs)
    family = ('pairs', pairs.tobytes())
    return self._emit_permute(x, pairs, (), family, dict(pairs=len(pairs)))

  def shift(self, x, axis: str, offset: int, cyclic: bool = False) -> tf.Tensor:
    """Neighbour exchange along one mesh axis: position i gets `x` of position i - offset.

    Positions without a source (off the end of the axis) get zeros unless
    `cyclic`. `shift(edge, axis, 1)` hands each partition its left
    neighbour's `edge`: the halo of a convolution window.
    """
    x = tf.convert_to_tensor(x)
    _static_shape(x, 'shift')
    (axis,) = tables.normalize_axes(self.mesh, (axis,))
    size = self.mesh.axis_size(axis)
    offset = int(offset)
    if offset % size == 0 and (cyclic or offset == 0):
      return x
    pairs = _shift_pairs(self.mesh, axis, offset, cyclic)
    family = ('shift', axis, offset, bool(cyclic))
    return self._emit_permute(x, pairs, (axis,), family, dict(offset=offset, cyclic=bool(cyclic)))

  def broadcast(self, x, axes, root_index: int = 0) -> tf.Tensor:
    """Every member of each group along `axes` gets `x` of the member at position `root_index`."""
    x, axes = tf.convert_to_tensor(x), tables.normalize_axes(self.mesh, axes)
    _static_shape(x, 'broadcast')
    k = self.mesh.axes_size(axes)
    if not 0 <= int(root_index) < k:
      raise ValueError(f'broadcast over {axes}: root_index {root_index} is not in [0, {k}).')
    if k == 1:
      return x
    root = int(root_index)
    return self._emit(
      'broadcast', x, axes, dict(root_index=root), lambda v: self._broadcast(v, axes, root)
    )

  # --- backend hooks ---------------------------------------------------------------------
  @abc.abstractmethod
  def _all_reduce(self, x, axes, op): ...

  @abc.abstractmethod
  def _all_gather(self, x, axes, dim): ...

  @abc.abstractmethod
  def _reduce_scatter(self, x, axes, dim, op):
    """`x`'s `dim` is a multiple of the group size here."""

  @abc.abstractmethod
  def _all_to_all(self, x, axes, split_dim, concat_dim):
    """`x`'s `split_dim` is a multiple of the group size here."""

  @abc.abstractmethod
  def _permute(self, x, pairs, family):
    """`pairs` is a validated [M, 2] array; `family` names the pair set for key allocation."""

  @abc.abstractmethod
  def _broadcast(self, x, axes, root): ...

  def _around(self, record: CollectiveRecord, build):
    """Run `build()`; a backend may wrap it (the TF backend adds progress markers)."""
    return build()

  # --- shared plumbing ---------------------------------------------------------------------
  def _reduce_by_gather(self, x, axes, op):
    """Every member's `x` gathered along a new leading dim, then reduced here (in position
    order): for reductions no carrier computes exactly. One all-gather, k times the bytes."""
    stacked = self.all_gather(x[tf.newaxis], axes, 0)
    return _LOCAL_REDUCE[op](stacked, axis=0)

  def _emit_permute(self, x, pairs, axes, family, params):
    if not len(pairs):
      return tf.zeros_like(x)
    if np.all(pairs[:, 0] == pairs[:, 1]) and len(pairs) == self.num_partitions:
      return x
    return self._emit(
      'permute',
      x,
      axes,
      params,
      lambda v: self._permute(v, pairs, family),
      groups=pairs,
      group_size=2,
    )

  def _emit(
    self, kind, x, axes, params, build, op=None, groups=None, group_size=None, out_shape=None
  ):
    """Name, record and emit one collective; its result gets the static `out_shape` (default: x's).

    `op` is the reduction (None for data movement); it decides how a dtype the backends
    refuse is carried (`carrier_for`).
    """
    dims = ','.join(str(int(d)) for d in x.shape)
    scope = tf.get_current_name_scope()
    carrier = carrier_for(
      x.dtype,
      op,
      f'{kind} over mesh axes {tuple(axes)} of {x.dtype.name}'
      f'[{dims}]' + (f" in '{scope}'" if scope else ''),
    )
    if carrier is not None:
      params = dict(params, carried_as=carrier.dtype.name)
    index = len(self.records)
    count = self._counts[kind]
    self._counts[kind] += 1
    with tf.name_scope(f'{self.name}/{kind}_{count}') as scope:
      shape = tuple(int(d) for d in x.shape)
      record = CollectiveRecord(
        index=index,
        kind=kind,
        name=scope.rstrip('/'),
        axes=tuple(axes),
        shape=shape,
        dtype=x.dtype,
        bytes=int(np.prod(shape, dtype=np.int64)) * x.dtype.size,
        group_size=group_size or self.mesh.axes_size(axes),
        groups=tables.groups(self.mesh, tuple(axes)) if groups is None else groups,
        params=tuple(params.items()),
      )
      self.records.append(record)
      if carrier is None:
        result = self._around(record, lambda: build(x))
      else:
        encoded = carrier.encode(x)
        result = carrier.decode(self._around(record, lambda: build(encoded)))
      result.set_shape(shape if out_shape is None else out_shape)
      return result

  def _check_pairs(self, pairs) -> np.ndarray:
    arr = (
      np.asarray(pairs, dtype=np.int64).reshape(-1, 2) if len(pairs) else np.zeros((0, 2), np.int64)
    )
    n = self.num_partitions
    bad = arr[(arr < 0).any(axis=1) | (arr >= n).any(axis=1)]
    if len(bad):
      raise ValueError(f'permute: pairs {bad.tolist()} name partitions outside 0..{n - 1}.')
    for column, role in ((0, 'source'), (1, 'target')):
      values, counts = np.unique(arr[:, column], return_counts=True)
      if (counts > 1).any():
        raise ValueError(
          f'permute: partition(s) {values[counts > 1].tolist()} appear more than once as a '
          f'{role}; a collective permute sends and receives at most once per partition.'
        )
    arr.setflags(write=False)
    return arr


def _shift_pairs(mesh: Mesh, axis: str, offset: int, cyclic: bool) -> np.ndarray:
  """(source, target) pairs moving data `offset` steps along `axis`."""
  a = mesh.axis_index(axis)
  size = mesh.axis_size(axis)
  ids = mesh.device_ids
  target = np.roll(ids, offset, axis=a)  # target[i] = ids[i - offset]: who sends to position i
  if cyclic:
    src, dst = target.reshape(-1), ids.reshape(-1)
  else:
    pos = np.arange(size) - offset
    keep = (pos >= 0) & (pos < size)
    src = np.compress(keep, target, axis=a).reshape(-1)
    dst = np.compress(keep, ids, axis=a).reshape(-1)
  pairs = np.stack([src, dst], axis=1).astype(np.int64)
  pairs.setflags(write=False)
  return pairs
