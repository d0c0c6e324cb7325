"""`Sharding`: how one tensor is laid out over devices, as XLA's `OpSharding` says it.

A `Sharding` says everything XLA's `OpSharding` can say about one tensor:
replicated, maximal (one device), tiled by any tile assignment, partially
replicated (trailing "subgroup" tile dims of kind replicated or manual), and
manual. It adds one internal subgroup kind, a pending reduction
(`partial_sum`, ...), which the partitioner uses for partial results.

Equality and hashing are structural: two shardings are equal when they are
written down the same way (same type, tile assignment and subgroups; for a
`NamedSharding` the same mesh, spec and pending reduction). Whether two
shardings *mean* the same, every device holding the same piece of the
tensor however they were written down, is `is_equivalent_to`.
"""

from __future__ import annotations

import math
from typing import Any, Dict, Optional, Sequence, Tuple

import numpy as np

REPLICATED = 'replicated'
MANUAL = 'manual'
PARTIAL_PREFIX = 'partial_'
REDUCTIONS = ('sum', 'max', 'min', 'prod')
SUBGROUP_KINDS = (REPLICATED, MANUAL) + tuple(PARTIAL_PREFIX + r for r in REDUCTIONS)
# Sharding kinds; a tiled sharding may add subgroup dims of the kinds above.
_KINDS = ('replicated', 'manual', 'maximal', 'tiled')


def shard_bounds(size: int, num_shards: int, index: int) -> tuple:
  """[start, stop) of shard `index` when `size` is split in `num_shards` ceil-sized shards."""
  chunk = -(-size // num_shards) if num_shards else size
  start = min(index * chunk, size)
  return start, min(start + chunk, size)


class Sharding:
  """How one tensor is laid out over devices. Immutable and hashable.

  Build one with `Sharding.replicated()`, `Sharding.maximal(device)`,
  `Sharding.manual()`, `Sharding.tiled(tile_assignment, subgroups=...)`,
  `NamedSharding(mesh, P(...))` or `tf_gspmd.op_sharding.from_proto(op_sharding)`.

  >>> s = Sharding.tiled([[0, 1], [2, 3]])
  >>> s.shard_shape((10, 5))
  (5, 3)
  >>> s.shard_bounds((10, 5), 3)
  ((5, 10), (3, 5))
  """

  __slots__ = (
    '_kind',
    '_tile',
    '_subgroups',
    '_proto_style',
    '_key_cache',
    '_struct_cache',
    '_tile_index',
  )
  _kind: str
  _tile: Optional[np.ndarray]  # device ids (read-only) for maximal and tiled, else None
  _subgroups: Tuple[str, ...]
  _proto_style: Any
  _key_cache: Optional[tuple]
  _struct_cache: Optional[tuple]
  _tile_index: Optional[Dict[int, Tuple[int, ...]]]

  def __init__(self, kind, tile=None, subgroups=(), proto_style=None):
    if kind not in _KINDS:
      raise ValueError(f'Sharding: kind must be one of {_KINDS}, got {kind!r}.')
    init_slots(
      self,
      _kind=kind,
      _tile=tile,  # np.ndarray of device ids (read-only) or None
      _subgroups=tuple(subgroups),
      # How the proto spelled it (iota or explicit, replicate_on_last_tile_dim
      # or last_tile_dims); kept only so to_proto round-trips exactly. Not meaning.
      _proto_style=proto_style,
      _key_cache=None,
      _struct_cache=None,
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
    return cls('maximal', frozen_ids(np.array([int(device)])))

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
    return cls('tiled', frozen_ids(tile), subgroups, proto_style)

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
    return self.canonical_key()[0] == 'replicated'

  @property
  def is_maximal(self) -> bool:
    return self.canonical_key()[0] == 'maximal'

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
  def _grid(self) -> np.ndarray:
    """The tile assignment of a maximal or tiled sharding (callers check the kind first)."""
    assert self._tile is not None, f'a {self._kind} sharding has no tile assignment'
    return self._tile

  def _tiles(self) -> tuple:
    """`tile_shape` of a tiled sharding (callers check the kind first)."""
    tiles = self.tile_shape
    assert tiles is not None, f'a {self._kind} sharding has no tiles'
    return tiles

  @property
  def subgroups(self) -> tuple:
    return self._subgroups

  @property
  def rank(self) -> Optional[int]:
    """Tensor rank this sharding is written for (None: any rank)."""
    if self._kind != 'tiled':
      return None
    return self._grid.ndim - len(self._subgroups)

  @property
  def tile_shape(self) -> Optional[tuple]:
    """Number of shards along each tensor dim (None for replicated/maximal/manual)."""
    if self._kind != 'tiled':
      return None
    return tuple(int(t) for t in self._grid.shape[: self.rank])

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
    rank = self._grid.ndim - len(self._subgroups)
    return int(
      np.prod(
        [self._grid.shape[rank + i] for i, k in enumerate(self._subgroups) if k == kind],
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
    """Raise a ValueError naming `what` unless this sharding fits devices 0..num_devices-1.

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
      raise ValueError(
        f'{what}: sharding {self} is built on {self._device_source()} with device ids '
        f'{brief(used)}, but the program runs on {num_devices} devices '
        f'(0..{num_devices - 1}); build the {self._built_from} over exactly those devices, '
        f'each once.'
      )

  # What a sharding's devices come from, for error messages (a NamedSharding: its mesh).
  _built_from = 'tile assignment'
  _entry = 'tile dim'

  def _device_source(self) -> str:
    return f'a tile assignment of shape {tuple(self._grid.shape)} ({len(self.devices)} devices)'

  # --- geometry -----------------------------------------------------------
  def check_shape(self, shape: Sequence[int], what: str = 'tensor') -> None:
    """Raise a ValueError that names `what` when this sharding cannot apply to `shape`."""
    if self.rank is not None and len(shape) != self.rank:
      raise ValueError(
        f'{what}: sharding {self} is written for rank {self.rank} but the tensor has '
        f'shape {tuple(shape)} (rank {len(shape)}); give one {self._entry} per tensor dim.'
      )

  def shard_shape(self, shape: Sequence[int]) -> tuple:
    """The padded (ceil-sized) per-device shard shape; the same on every device."""
    self.check_shape(shape)
    if self._kind != 'tiled':
      return tuple(int(s) for s in shape)
    return tuple(-(-int(s) // t) for s, t in zip(shape, self._tiles()))

  def tile_index(self, device: int) -> Optional[tuple]:
    """Tile coordinates (one per tensor dim) of the shard `device` holds, None if it holds none."""
    if self._kind in ('replicated', 'manual'):
      return ()
    table = self._tile_index
    if table is None:
      table = {int(d): tuple(int(i) for i in idx) for idx, d in np.ndenumerate(self._grid)}
      init_slots(self, _tile_index=table)
    idx = table.get(int(device))
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
    return tuple(shard_bounds(int(s), t, i) for s, t, i in zip(shape, self._tiles(), index))

  def shard_offsets(self, shape: Sequence[int], device: int) -> Optional[tuple]:
    bounds = self.shard_bounds(shape, device)
    return None if bounds is None else tuple(b[0] for b in bounds)

  def devices_for_tile(self, index: Sequence[int]) -> tuple:
    """Every device holding the shard at tile coordinates `index`."""
    if self._kind != 'tiled':
      return self.devices
    return tuple(int(d) for d in np.asarray(self._grid[tuple(index)]).reshape(-1))

  # --- equality: structure (==, hash) and meaning (is_equivalent_to) ------------------
  def canonical_key(self) -> tuple:
    """A key equal for two shardings exactly when they are equivalent (`is_equivalent_to`)."""
    key = self._key_cache
    if key is None:
      key = _canonical_key(self)
      init_slots(self, _key_cache=key)
    return key

  def is_equivalent_to(self, other: object) -> bool:
    """Whether every device holds the same piece of the tensor under both, however they
    are written: a `NamedSharding` and the tile assignment it stands for, or two meshes with
    other axis names over the same devices. Needs no rank: a tiled layout's key holds its
    rank, and a replicated, maximal or manual one (however tiled) holds none, so it matches
    its like at any rank."""
    return isinstance(other, Sharding) and self.canonical_key() == other.canonical_key()

  def _structure(self) -> tuple:
    """What `==` compares: how the sharding is written (not how a proto spelled it)."""
    if self._tile is None:
      return (Sharding, self._kind)
    return (Sharding, self._kind, self._tile.shape, self._tile.tobytes(), self._subgroups)

  def _structure_key(self) -> tuple:
    key = self._struct_cache
    if key is None:
      key = self._structure()
      init_slots(self, _struct_cache=key)
    return key

  def __eq__(self, other):
    if self is other:
      return True
    return isinstance(other, Sharding) and self._structure_key() == other._structure_key()

  def __hash__(self):
    return hash(self._structure_key())

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


def init_slots(obj, **values) -> None:
  """Set slots of an immutable value (construction and lazily filled caches only)."""
  for name, value in values.items():
    object.__setattr__(obj, name, value)


def frozen_ids(a: np.ndarray) -> np.ndarray:
  a = np.array(a, dtype=np.int64)
  a.setflags(write=False)
  return a


def _canonical_key(s: Sharding) -> tuple:
  """A key equal for two shardings exactly when every device holds the same piece.

  Subgroup dims are merged per kind into one dim each, in the order manual,
  pending reduction, replicated, and size-1 ones dropped. Device order carries
  no meaning inside a replicated group (sorted away) nor among the groups
  that hold parts of one pending reduction (rows sorted by first device).
  """
  if s.kind in ('replicated', 'manual'):
    return (s.kind,)
  if s.kind == 'maximal':
    return ('maximal', s.devices[0])
  rank, tile = s.rank, s.tile_assignment
  assert rank is not None and tile is not None, s
  kinds = sorted(set(s.subgroups), key=kind_order)
  order, sizes = list(range(rank)), list(tile.shape[:rank])
  for k in kinds:
    dims = [rank + i for i, kind in enumerate(s.subgroups) if kind == k]
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


def kind_order(kind: str) -> int:
  """Manual subgroups first, then a pending reduction, then replication."""
  return 0 if kind == MANUAL else (2 if kind == REPLICATED else 1)


def brief(devices: Sequence[int], limit: int = 16) -> str:
  """A device list for an error message, shortened when long."""
  devices = list(devices)
  if len(devices) <= limit:
    return str(devices)
  return str(devices[:limit])[:-1] + f', ... ({len(devices)} in all)]'


def num_shards(sharding: Sharding) -> int:
  """How many distinct pieces the tensor is cut into."""
  return math.prod(sharding.tile_shape) if sharding.tile_shape else 1
