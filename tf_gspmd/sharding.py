"""Sharding value types: `P` (a partition spec), `Sharding` and `NamedSharding`.

A `Sharding` says everything XLA's `OpSharding` can say about one tensor:
replicated, maximal (one device), tiled by any tile assignment, partially
replicated (trailing "subgroup" tile dims of kind replicated or manual), and
manual. It adds one internal subgroup kind, a pending reduction
(`partial_sum`, ...), which the partitioner uses for partial results.

Equality and hashing are by meaning: two shardings are equal when every device
holds the same piece of the tensor, however they were written down.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import numpy as np

from tf_gspmd.mesh import Mesh

REPLICATED = 'replicated'
MANUAL = 'manual'
PARTIAL_PREFIX = 'partial_'
REDUCTIONS = ('sum', 'max', 'min', 'prod')
SUBGROUP_KINDS = (REPLICATED, MANUAL) + tuple(PARTIAL_PREFIX + r for r in REDUCTIONS)
# Sharding kinds; a tiled sharding may add subgroup dims of the kinds above.
_KINDS = ('replicated', 'manual', 'maximal', 'tiled')


class P(tuple):
  """A partition spec: per tensor dim, `None`, a mesh axis name, or a tuple of names.

  >>> P('data', None)
  P('data', None)
  >>> P(('x', 'y'), None)[0]
  ('x', 'y')

  As for `tuple`, one list argument is the list of entries:
  `P(['data', None]) == P('data', None)`. Generic code rebuilds tuple
  subclasses that way (tf.nest, Keras 3's attribute tracking when a layer
  stores a P), so a P survives being stored on a Keras layer.
  """

  def __new__(cls, *entries):
    if len(entries) == 1 and isinstance(entries[0], list):
      entries = tuple(entries[0])
    norm = []
    for e in entries:
      if e is None or isinstance(e, str):
        norm.append(e)
      elif isinstance(e, (tuple, list)):
        if not all(isinstance(a, str) for a in e):
          raise TypeError(f'P: a tuple entry must hold axis names, got {e!r}.')
        norm.append(None if not e else (e[0] if len(e) == 1 else tuple(e)))
      else:
        raise TypeError(f'P: each entry must be None, an axis name or a tuple of names; got {e!r}.')
    return super().__new__(cls, norm)

  def axes_of(self, dim: int) -> tuple:
    """The mesh axes that split `dim`, major to minor (empty when not split)."""
    e = self[dim]
    return () if e is None else ((e,) if isinstance(e, str) else e)

  def used_axes(self) -> tuple:
    return tuple(a for d in range(len(self)) for a in self.axes_of(d))

  def __repr__(self):
    return 'P(' + ', '.join(repr(e) for e in self) + ')'

  __str__ = __repr__

  def __getnewargs__(self):
    return tuple(self)


def shard_bounds(size: int, num_shards: int, index: int) -> tuple:
  """[start, stop) of shard `index` when `size` is split in `num_shards` ceil-sized shards."""
  chunk = -(-size // num_shards) if num_shards else size
  start = min(index * chunk, size)
  return start, min(start + chunk, size)


class Sharding:
  """How one tensor is laid out over devices. Immutable and hashable.

  Build one with `Sharding.replicated()`, `Sharding.maximal(device)`,
  `Sharding.manual()`, `Sharding.tiled(tile_assignment, subgroups=...)`,
  `NamedSharding(mesh, P(...))` or `tf_gspmd.from_proto(op_sharding)`.

  >>> s = Sharding.tiled([[0, 1], [2, 3]])
  >>> s.shard_shape((10, 5))
  (5, 3)
  >>> s.shard_bounds((10, 5), 3)
  ((5, 10), (3, 5))
  """

  __slots__ = ('_kind', '_tile', '_subgroups', '_proto_style', '_key_cache', '_tile_index')

  def __init__(self, kind, tile=None, subgroups=(), proto_style=None):
    if kind not in _KINDS:
      raise ValueError(f'Sharding: kind must be one of {_KINDS}, got {kind!r}.')
    _init_slots(
      self,
      _kind=kind,
      _tile=tile,  # np.ndarray of device ids (read-only) or None
      _subgroups=tuple(subgroups),
      # How the proto spelled it (iota or explicit, replicate_on_last_tile_dim
      # or last_tile_dims); kept only so to_proto round-trips exactly. Not meaning.
      _proto_style=proto_style,
      _key_cache=None,
      _tile_index=None,
    )

  def __setattr__(self, name, value):
    raise AttributeError(
      f'{type(self).__name__} is immutable; build a new one instead of setting {name!r}.'
    )

  def __reduce__(self):
    return (Sharding, (self._kind, self._tile, self._subgroups, self._proto_style))

  # --- constructors --------------------------------------------------------
  @classmethod
  def replicated(cls) -> 'Sharding':
    return cls('replicated')

  @classmethod
  def manual(cls) -> 'Sharding':
    return cls('manual')

  @classmethod
  def maximal(cls, device: int) -> 'Sharding':
    return cls('maximal', _frozen(np.array([int(device)])))

  @classmethod
  def tiled(cls, tile_assignment, subgroups: Sequence[str] = (), proto_style=None) -> 'Sharding':
    """A tiled sharding; the last len(subgroups) dims of `tile_assignment` are subgroup dims."""
    tile = np.array(tile_assignment, dtype=np.int64)
    subgroups = tuple(subgroups)
    for k in subgroups:
      if k not in SUBGROUP_KINDS:
        raise ValueError(f'Unknown subgroup kind {k!r}; expected one of {SUBGROUP_KINDS}.')
    if tile.size == 0:
      raise ValueError(f'Sharding.tiled: the tile assignment {tile.tolist()} names no device.')
    if tile.ndim < len(subgroups):
      raise ValueError(
        f'Sharding.tiled: tile assignment of shape {tile.shape} cannot hold '
        f'{len(subgroups)} subgroup dims {subgroups}.'
      )
    partial_kinds = {k for k in subgroups if k.startswith(PARTIAL_PREFIX)}
    if len(partial_kinds) > 1:
      raise ValueError(
        f'Sharding.tiled: subgroups {subgroups} hold pending reductions of different kinds '
        f'{sorted(partial_kinds)}; a tensor can wait for one reduction only.'
      )
    flat = tile.reshape(-1).tolist()
    if len(set(flat)) != len(flat) or min(flat) < 0:
      raise ValueError(
        f'Sharding.tiled: device ids must be distinct and non-negative, got {flat} in a '
        f'tile assignment of shape {tile.shape}; name each device once.'
      )
    return cls('tiled', _frozen(tile), subgroups, proto_style)

  @classmethod
  def partial_tile(cls, tile_assignment) -> 'Sharding':
    """Tiled with the last tile dim replicated (XLA's replicate_on_last_tile_dim)."""
    return cls.tiled(tile_assignment, (REPLICATED,))

  # --- what it is ---------------------------------------------------------
  @property
  def kind(self) -> str:
    return self._kind

  @property
  def is_replicated(self) -> bool:
    return self._canonical()[0] == 'replicated'

  @property
  def is_maximal(self) -> bool:
    return self._canonical()[0] == 'maximal'

  @property
  def is_manual(self) -> bool:
    return self._kind == 'manual'

  @property
  def is_tiled(self) -> bool:
    return self._kind == 'tiled'

  @property
  def tile_assignment(self) -> Optional[np.ndarray]:
    return self._tile

  @property
  def subgroups(self) -> tuple:
    return self._subgroups

  @property
  def rank(self) -> Optional[int]:
    """Tensor rank this sharding is written for (None: any rank)."""
    if self._kind != 'tiled':
      return None
    return self._tile.ndim - len(self._subgroups)

  @property
  def tile_shape(self) -> Optional[tuple]:
    """Number of shards along each tensor dim (None for replicated/maximal/manual)."""
    if self._kind != 'tiled':
      return None
    return tuple(int(t) for t in self._tile.shape[: self.rank])

  @property
  def devices(self) -> tuple:
    """The device ids this sharding names (empty for replicated and manual)."""
    return () if self._tile is None else tuple(int(d) for d in self._tile.reshape(-1))

  @property
  def partial(self) -> Optional[str]:
    """The pending reduction ('sum', ...) when this holds partial results, else None."""
    for k in self._subgroups:
      if k.startswith(PARTIAL_PREFIX):
        return k[len(PARTIAL_PREFIX) :]
    return None

  def subgroup_size(self, kind: str) -> int:
    if self._kind != 'tiled':
      return 1
    return int(
      np.prod(
        [self._tile.shape[self.rank + i] for i, k in enumerate(self._subgroups) if k == kind],
        dtype=np.int64,
      )
    )

  def without_partial(self) -> 'Sharding':
    """The same layout with the pending reduction resolved (partial dims become replicated)."""
    if self.partial is None:
      return self
    return Sharding.tiled(
      self._tile, tuple(REPLICATED if k.startswith(PARTIAL_PREFIX) else k for k in self._subgroups)
    )

  # --- checks -------------------------------------------------------------
  def check_devices(self, num_devices: int, what: str = 'tensor') -> None:
    """Raise a ValueError naming `what` unless this sharding fits a program on devices 0..num_devices-1.

    A tiled sharding must use every one of those devices exactly once (as XLA
    requires of a tile assignment); a maximal one must name one of them.
    """
    num_devices = int(num_devices)
    used = sorted(self.devices)
    if not used:
      return  # replicated or manual without a device list: fits any device count
    if self._kind == 'maximal':
      if not 0 <= used[0] < num_devices:
        raise ValueError(
          f'{what}: sharding {self} puts the tensor on device {used[0]}, but the program runs '
          f'on {num_devices} devices (0..{num_devices - 1}); pick a device in that range.'
        )
      return
    if used != list(range(num_devices)):
      source = (
        f'mesh {self.mesh} of {self.mesh.size} devices'
        if isinstance(self, NamedSharding)
        else f'a tile assignment of shape {tuple(self._tile.shape)} ({len(used)} devices)'
      )
      raise ValueError(
        f'{what}: sharding {self} is built on {source} with device ids {_brief(used)}, but the '
        f'program runs on {num_devices} devices (0..{num_devices - 1}); build the '
        f'{"mesh" if isinstance(self, NamedSharding) else "tile assignment"} over exactly '
        f'those devices, each once.'
      )

  # --- geometry -----------------------------------------------------------
  def check_shape(self, shape: Sequence[int], what: str = 'tensor') -> None:
    """Raise a ValueError that names `what` when this sharding cannot apply to `shape`."""
    if self.rank is not None and len(shape) != self.rank:
      entry = 'spec entry' if isinstance(self, NamedSharding) else 'tile dim'
      raise ValueError(
        f'{what}: sharding {self} is written for rank {self.rank} but the tensor has '
        f'shape {tuple(shape)} (rank {len(shape)}); give one {entry} per tensor dim.'
      )

  def shard_shape(self, shape: Sequence[int]) -> tuple:
    """The padded (ceil-sized) per-device shard shape; the same on every device."""
    self.check_shape(shape)
    if self._kind != 'tiled':
      return tuple(int(s) for s in shape)
    return tuple(-(-int(s) // t) for s, t in zip(shape, self.tile_shape))

  def tile_index(self, device: int) -> Optional[tuple]:
    """Tile coordinates (one per tensor dim) of the shard `device` holds, None if it holds none."""
    if self._kind in ('replicated', 'manual'):
      return ()
    if self._tile_index is None:
      _init_slots(
        self,
        _tile_index={int(d): tuple(int(i) for i in idx) for idx, d in np.ndenumerate(self._tile)},
      )
    idx = self._tile_index.get(int(device))
    if idx is None:
      return None
    return idx[: self.rank] if self._kind == 'tiled' else ()

  def shard_bounds(self, shape: Sequence[int], device: int) -> Optional[tuple]:
    """Per-dim [start, stop) of the (unpadded) shard on `device`; None if it holds nothing."""
    self.check_shape(shape)
    index = self.tile_index(device)
    if index is None:
      return None
    if self._kind != 'tiled':
      return tuple((0, int(s)) for s in shape)
    return tuple(shard_bounds(int(s), t, i) for s, t, i in zip(shape, self.tile_shape, index))

  def shard_offsets(self, shape: Sequence[int], device: int) -> Optional[tuple]:
    bounds = self.shard_bounds(shape, device)
    return None if bounds is None else tuple(b[0] for b in bounds)

  def devices_for_tile(self, index: Sequence[int]) -> tuple:
    """Every device holding the shard at tile coordinates `index`."""
    if self._kind != 'tiled':
      return self.devices
    return tuple(int(d) for d in np.asarray(self._tile[tuple(index)]).reshape(-1))

  # --- meaning ---------------------------------------------------------------
  def _canonical(self) -> tuple:
    if self._key_cache is None:
      _init_slots(self, _key_cache=_canonical_key(self))
    return self._key_cache

  def __eq__(self, other):
    return isinstance(other, Sharding) and self._canonical() == other._canonical()

  def __hash__(self):
    return hash(self._canonical())

  def __repr__(self):
    if self._kind in ('replicated', 'manual'):
      return f'Sharding.{self._kind}()'
    if self._kind == 'maximal':
      return f'Sharding.maximal({self.devices[0]})'
    sub = f', subgroups={self._subgroups!r}' if self._subgroups else ''
    return f'Sharding.tiled({self._tile.tolist()!r}{sub})'

  def __str__(self):
    if self._kind in ('replicated', 'manual'):
      return '{' + self._kind + '}'
    if self._kind == 'maximal':
      return '{maximal device=%d}' % self.devices[0]
    dims = ','.join(str(d) for d in self._tile.shape)
    devs = ','.join(str(d) for d in self.devices)
    if self._subgroups == (REPLICATED,):
      sub = ' last_tile_dim_replicate'
    elif self._subgroups:
      sub = ' last_tile_dims={%s}' % ','.join(self._subgroups)
    else:
      sub = ''
    return '{devices=[%s]%s%s}' % (dims, devs, sub)


class NamedSharding(Sharding):
  """A sharding written against a named mesh: `NamedSharding(mesh, P('data', None))`.

  `partial` names mesh axes over which the tensor holds a pending reduction
  (partial results that must still be combined with `reduction`); it is an
  internal state of the partitioner, not something users annotate.

  >>> mesh = Mesh.create((2, 4), ('data', 'model'))
  >>> s = NamedSharding(mesh, P('data', None))
  >>> str(s), s.shard_shape((8, 3))
  ("P('data', None)", (4, 3))
  """

  __slots__ = ('_mesh', '_spec', '_partial_axes', '_reduction')

  def __init__(self, mesh: Mesh, spec, partial: Sequence[str] = (), reduction: str = 'sum'):
    spec = spec if isinstance(spec, P) else P(*spec)
    partial = (partial,) if isinstance(partial, str) else tuple(partial)
    _check_spec(mesh, spec, partial)
    if reduction not in REDUCTIONS:
      raise ValueError(f'NamedSharding: reduction must be one of {REDUCTIONS}, got {reduction!r}.')
    tile, subgroups = _named_tile(mesh, spec, partial, reduction)
    if tile is None:
      super().__init__('replicated')
    else:
      super().__init__('tiled', _frozen(tile), subgroups)
    _init_slots(self, _mesh=mesh, _spec=spec, _partial_axes=partial, _reduction=reduction)

  def __reduce__(self):
    return (NamedSharding, (self._mesh, self._spec, self._partial_axes, self._reduction))

  @property
  def mesh(self) -> Mesh:
    return self._mesh

  @property
  def spec(self) -> P:
    return self._spec

  @property
  def partial_axes(self) -> tuple:
    return self._partial_axes

  @property
  def rank(self) -> Optional[int]:
    return len(self._spec)

  @property
  def tile_shape(self) -> tuple:
    return tuple(self._mesh.axes_size(self._spec.axes_of(d)) for d in range(len(self._spec)))

  def tile_index(self, device):
    if int(device) not in self._mesh.devices:
      return None
    return tuple(
      self._mesh.linear_index(device, self._spec.axes_of(d)) for d in range(len(self._spec))
    )

  @property
  def devices(self) -> tuple:
    return self._mesh.devices

  def without_partial(self) -> 'NamedSharding':
    return NamedSharding(self._mesh, self._spec) if self._partial_axes else self

  def __repr__(self):
    extra = ''
    if self._partial_axes:
      extra = f', partial={self._partial_axes!r}'
      if self._reduction != 'sum':
        extra += f', reduction={self._reduction!r}'
    return f'NamedSharding({self._mesh!r}, {self._spec!r}{extra})'

  def __str__(self):
    if not self._partial_axes:
      return str(self._spec)
    axes = ', '.join(repr(a) for a in self._partial_axes)
    return f'{self._spec} partial_{self._reduction}({axes})'


def named(sharding: Sharding, mesh: Mesh, reorder: bool = True) -> Optional[NamedSharding]:
  """`sharding` re-expressed on `mesh` axes, or None when no spec on `mesh` means the same.

  A tile assignment in another device order than the mesh's (TPU code with a
  hand-ordered device mesh) comes back on `mesh.reordered(...)`: the same axis
  names and sizes, the devices in the order that reproduces the assignment.
  The device order is part of the layout; `reorder=False` refuses it (None).

  None also for shardings without a rank (replicated, maximal, manual): use
  `named_for_rank` for those. Raises a ValueError when `sharding` is tiled
  over other devices than the mesh's (a tile assignment of another size).

  >>> mesh = Mesh.create((2, 4), ('data', 'model'))
  >>> named(Sharding.partial_tile([[[0, 1, 2, 3]], [[4, 5, 6, 7]]]), mesh)
  NamedSharding(Mesh.create((2, 4), ('data', 'model')), P('data', None))
  """
  if isinstance(sharding, NamedSharding) and sharding.mesh == mesh:
    return sharding
  if sharding.rank is None:
    return None  # rank unknown: the caller knows it (named_for_rank)
  return named_for_rank(sharding, mesh, sharding.rank, reorder)


def named_for_rank(
  sharding: Sharding, mesh: Mesh, rank: int, reorder: bool = True
) -> Optional[NamedSharding]:
  """Like `named`, with the rank given so replicated shardings convert too.

  `reorder=False` accepts only specs on `mesh` itself (its device order).
  """
  if isinstance(sharding, NamedSharding) and sharding.mesh == mesh and sharding.rank == rank:
    return sharding
  if sharding.is_replicated or _whole_on_the_only_device(sharding, mesh):
    return NamedSharding(mesh, P(*([None] * rank)))
  if sharding.rank is not None and sharding.rank != rank:
    return None
  if sharding._canonical()[0] == 'tiled' and sorted(sharding.devices) != sorted(mesh.devices):
    raise ValueError(
      f'named: sharding {sharding} is tiled over {len(sharding.devices)} devices '
      f'{_brief(sorted(sharding.devices))}, but mesh {mesh} holds {mesh.size} devices '
      f'{_brief(sorted(mesh.devices))}; re-express it on a mesh of the same devices.'
    )
  found = _search_spec(sharding, mesh, rank)
  if found is None and reorder:
    found = _search_reordered(sharding, mesh, rank)
  return found


# --- internals -----------------------------------------------------------------
def _whole_on_the_only_device(sharding: Sharding, mesh: Mesh) -> bool:
  """On a mesh of one device, a tiling into one piece (`{devices=[1,1]0}`, what Keras'
  DataParallel writes on one device) or `{maximal device=0}` puts the whole tensor on every
  device of the mesh: it means replicated there (on a larger mesh it means one device)."""
  if mesh.size != 1 or sharding.is_manual or MANUAL in sharding.subgroups:
    return False
  return sharding.devices == tuple(mesh.devices)


def _init_slots(obj, **values) -> None:
  """Set slots of an immutable value (construction and lazily filled caches only)."""
  for name, value in values.items():
    object.__setattr__(obj, name, value)


def _frozen(a: np.ndarray) -> np.ndarray:
  a = np.array(a, dtype=np.int64)
  a.setflags(write=False)
  return a


def _check_spec(mesh: Mesh, spec: P, partial: tuple) -> None:
  """Raise a ValueError naming spec and mesh for unknown or repeated mesh axes."""
  what = f'NamedSharding({mesh}, {spec}' + (f', partial={partial})' if partial else ')')
  seen = []
  for axis in spec.used_axes() + partial:
    if axis not in mesh.axis_names:
      raise ValueError(
        f'{what}: unknown mesh axis {axis!r}; the mesh has axes {mesh.axis_names} with shape '
        f'{mesh.shape}. Use one of those names, or None for a dim that is not split.'
      )
    if axis in seen:
      raise ValueError(
        f'{what}: mesh axis {axis!r} is used twice; each mesh axis may split at most one '
        f'tensor dim, once. Drop one use, or split by another axis.'
      )
    seen.append(axis)


def _named_tile(mesh: Mesh, spec: P, partial: tuple, reduction: str):
  """Tile assignment and subgroup kinds equivalent to (mesh, spec, partial)."""
  used = spec.used_axes()
  rest = tuple(a for a in mesh.axis_names if a not in used and a not in partial)
  order = [mesh.axis_index(a) for a in used + partial + rest]
  dims = [mesh.axes_size(spec.axes_of(d)) for d in range(len(spec))]
  subgroups = []
  if mesh.axes_size(partial) > 1:
    dims.append(mesh.axes_size(partial))
    subgroups.append(PARTIAL_PREFIX + reduction)
  if mesh.axes_size(rest) > 1:
    dims.append(mesh.axes_size(rest))
    subgroups.append(REPLICATED)
  if not used and mesh.axes_size(partial) == 1:
    return None, ()
  return mesh.device_ids.transpose(order).reshape(dims), tuple(subgroups)


def _canonical_key(s: Sharding) -> tuple:
  """A key equal for two shardings exactly when every device holds the same piece.

  Subgroup dims are merged per kind into one dim each, in the order manual,
  pending reduction, replicated, and size-1 ones dropped. Device order carries
  no meaning inside a replicated group (sorted away) nor among the groups
  that hold parts of one pending reduction (rows sorted by first device).
  """
  if s._kind in ('replicated', 'manual'):
    return (s._kind,)
  if s._kind == 'maximal':
    return ('maximal', s.devices[0])
  rank, tile = s.rank, s._tile
  kinds = sorted(set(s._subgroups), key=_kind_order)
  order, sizes = list(range(rank)), list(tile.shape[:rank])
  for k in kinds:
    dims = [rank + i for i, kind in enumerate(s._subgroups) if kind == k]
    order += dims
    sizes.append(math.prod(tile.shape[d] for d in dims))
  arr = tile.transpose(order).reshape(sizes)
  kinds = [k for k, n in zip(kinds, sizes[rank:]) if n > 1]
  arr = arr.reshape(arr.shape[:rank] + tuple(n for n in sizes[rank:] if n > 1))
  if REPLICATED in kinds:
    arr = np.sort(arr, axis=-1)
  partial_dims = [rank + i for i, k in enumerate(kinds) if k.startswith(PARTIAL_PREFIX)]
  if partial_dims:
    p = partial_dims[0]
    rows = arr.reshape(-1, arr.shape[p], math.prod(arr.shape[p + 1 :]))
    first = np.argsort(rows[:, :, 0], axis=1)
    arr = np.take_along_axis(rows, first[:, :, None], axis=1).reshape(arr.shape)
  if all(t == 1 for t in arr.shape[:rank]):
    if not kinds:
      return ('maximal', int(arr.reshape(-1)[0]))
    if kinds in ([REPLICATED], [MANUAL]):
      return (kinds[0],)
  return ('tiled', rank, tuple(kinds), arr.shape, tuple(int(d) for d in arr.reshape(-1)))


def _kind_order(kind: str) -> int:
  """Manual subgroups first, then a pending reduction, then replication."""
  return 0 if kind == MANUAL else (2 if kind == REPLICATED else 1)


def _brief(devices: Sequence[int], limit: int = 16) -> str:
  """A device list for an error message, shortened when long."""
  devices = list(devices)
  if len(devices) <= limit:
    return str(devices)
  return str(devices[:limit])[:-1] + f', ... ({len(devices)} in all)]'


def _axis_choices(mesh: Mesh, tile_shape: Sequence[int], partial_size: int):
  """Every (axes per tensor dim, partial axes) on `mesh` whose sizes give `tile_shape` and
  `partial_size`; the mesh axes left over are the replicated ones."""

  def choose(size, free):
    """Ordered tuples of axes from `free` whose sizes multiply to `size`."""
    if size == 1:
      yield ()
      return
    for a in free:
      n = mesh.axis_size(a)
      if size % n == 0:
        for tail in choose(size // n, [b for b in free if b != a]):
          yield (a,) + tail

  def search(dim, free, chosen):
    if dim == len(tile_shape):
      for part in choose(partial_size, free):
        yield chosen, part
      return
    for pick in choose(tile_shape[dim], free):
      yield from search(dim + 1, [a for a in free if a not in pick], chosen + [pick])

  yield from search(0, [a for a in mesh.axis_names if mesh.axis_size(a) > 1], [])


def _search_spec(s: Sharding, mesh: Mesh, rank: int) -> Optional[NamedSharding]:
  """Find (spec, partial) on `mesh` with the meaning of `s` by search over axis splits."""
  target = s._canonical()
  tile_shape = s.tile_shape or (1,) * rank
  partial_size = s.subgroup_size(PARTIAL_PREFIX + s.partial) if s.partial else 1
  reduction = s.partial or 'sum'
  for chosen, part in _axis_choices(mesh, tile_shape, partial_size):
    cand = NamedSharding(mesh, P(*[c or None for c in chosen]), part, reduction)
    if cand._canonical() == target:
      return cand
  return None


def _merged_subgroups(s: Sharding) -> np.ndarray:
  """`s`'s tile assignment with its subgroup dims merged per kind (in `_kind_order`), size-1
  ones dropped, devices kept in the order given (so a reordered mesh reproduces it)."""
  rank, tile = s.rank, s.tile_assignment
  order, sizes = list(range(rank)), list(tile.shape[:rank])
  for k in sorted(set(s.subgroups), key=_kind_order):
    dims = [rank + i for i, kind in enumerate(s.subgroups) if kind == k]
    order += dims
    size = math.prod(tile.shape[d] for d in dims)
    sizes += [size] if size > 1 else []
  return tile.transpose(order).reshape(sizes[:rank] + [n for n in sizes[rank:]])


def _search_reordered(s: Sharding, mesh: Mesh, rank: int) -> Optional[NamedSharding]:
  """`s` as a spec on a reordering of `mesh` (same axis names and sizes, its own device order).

  Any grouping of the mesh axes whose sizes give the tile dims (and the pending
  reduction's subgroup) will do: the device order then comes from the tile
  assignment itself, read with each tile dim split over its axes and the
  replicated subgroup over the axes left over. The first grouping in
  `_axis_choices` order is taken (whole axes to dims in mesh order first).
  None when no grouping exists (a tile dim of 2 on a mesh of one axis of 4) or
  `s` has a manual subgroup.
  """
  key = s._canonical()
  if key[0] != 'tiled' or MANUAL in s.subgroups:
    return None
  grid = _merged_subgroups(s)  # tile dims, then partial, then replicated (size > 1 only)
  partial_size = s.subgroup_size(PARTIAL_PREFIX + s.partial) if s.partial else 1
  for chosen, part in _axis_choices(mesh, grid.shape[:rank], partial_size):
    used = [a for axes in chosen for a in axes] + list(part)
    rest = [a for a in mesh.axis_names if a not in used and mesh.axis_size(a) > 1]
    order = used + rest  # the grid's dims, each split over its axes, major first
    split = grid.reshape([mesh.axis_size(a) for a in order] or [1])
    big = [a for a in mesh.axis_names if mesh.axis_size(a) > 1]
    ids = split.transpose([order.index(a) for a in big]) if order else split
    cand = NamedSharding(
      mesh.reordered(ids), P(*[c or None for c in chosen]), part, s.partial or 'sum'
    )
    if cand._canonical() == key:
      return cand
  return None


def num_shards(sharding: Sharding) -> int:
  """How many distinct pieces the tensor is cut into."""
  return math.prod(sharding.tile_shape) if sharding.tile_shape else 1
