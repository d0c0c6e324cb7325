"""Constant tables indexed by partition id, and process-wide collective key allocation.

The per-partition program is the same on every device. Everything that differs
between partitions (a partition's position along some mesh axes, the group key
of its row, its neighbour along an axis, its shard offsets) is looked up at run
time in a small constant table with the partition id as index. The tables here
are built with vectorized numpy in O(N) and cached per (mesh, axes), so a trace
for N = 2048 partitions costs about what it costs for N = 8.

Partition ids are mesh device ids: partition `p` is device `p` of the mesh,
runs on the launcher's `devices[p]`, and holds the piece of every tensor that
the shardings assign to device `p`. So a mesh's device ids must be exactly
0..N-1 in some order (`check_mesh`).

Key allocation: TF collective V2 ops find their peers by (group key, instance
key). A group key names one fixed set of devices for the life of the process,
so keys are allocated per *family* -- (device assignment, mesh, axes) or
(device assignment, mesh, permutation pairs) -- as one contiguous block, one
key per group of the family. The same family always gets the same block, so
retracing a program reuses its keys; a different device assignment gets a
different block. Instance keys are a process-wide counter: every collective op
ever traced gets its own.
"""

from __future__ import annotations

import functools
import threading
from typing import Optional, Sequence, Tuple

import numpy as np

from tf_gspmd.mesh import Mesh
from tf_gspmd.sharding import Sharding

# Far from the small keys that tf.distribute strategies allocate from 1 upwards.
_FIRST_GROUP_KEY = 1_500_000_000
_FIRST_INSTANCE_KEY = 1_500_000_000
_INT32_MAX = 2**31 - 1


def check_mesh(mesh: Mesh) -> None:
  """Raise unless the mesh's device ids are 0..N-1 (they double as partition ids)."""
  ids = np.sort(mesh.device_ids.reshape(-1))
  if not np.array_equal(ids, np.arange(mesh.size)):
    raise ValueError(
      f'{mesh!r}: device ids double as partition ids and must be 0..{mesh.size - 1} in some '
      f'order; got {ids.tolist()}. Renumber the mesh (Mesh(np.argsort(...), names)).'
    )


def normalize_axes(mesh: Mesh, axes) -> Tuple[str, ...]:
  """`axes` as a tuple of distinct mesh axis names (a single name is accepted)."""
  if isinstance(axes, str):
    axes = (axes,)
  axes = tuple(axes)
  for a in axes:
    mesh.axis_index(a)  # raises naming the unknown axis
  if len(set(axes)) != len(axes):
    raise ValueError(f'Mesh axes {axes} name an axis twice; mesh is {mesh}.')
  return axes


def _frozen(a: np.ndarray) -> np.ndarray:
  a = np.ascontiguousarray(a)
  a.setflags(write=False)
  return a


@functools.lru_cache(maxsize=None)
def coords_by_partition(mesh: Mesh) -> np.ndarray:
  """[N, mesh.ndim] int64: the mesh coordinates of every partition id."""
  check_mesh(mesh)
  shape = mesh.device_ids.shape
  coords = np.empty((mesh.size, len(shape)), dtype=np.int64)
  coords[mesh.device_ids.reshape(-1)] = np.indices(shape).reshape(len(shape), -1).T
  return _frozen(coords)


def _row_major(coords: np.ndarray, sizes: Sequence[int]) -> np.ndarray:
  index = np.zeros(coords.shape[0], dtype=np.int64)
  for column, size in enumerate(sizes):
    index = index * size + coords[:, column]
  return index


@functools.lru_cache(maxsize=None)
def positions(mesh: Mesh, axes: Tuple[str, ...]) -> np.ndarray:
  """[N]: each partition's row-major position along `axes` (what `Mesh.linear_index` gives)."""
  cols = [mesh.axis_index(a) for a in axes]
  coords = coords_by_partition(mesh)
  return _frozen(_row_major(coords[:, cols], [mesh.axis_size(a) for a in axes]).astype(np.int32))


@functools.lru_cache(maxsize=None)
def group_ids(mesh: Mesh, axes: Tuple[str, ...]) -> np.ndarray:
  """[N]: index into `groups(mesh, axes)` of the group holding each partition."""
  rest = [a for a in mesh.axis_names if a not in axes]
  return positions(mesh, tuple(rest))


@functools.lru_cache(maxsize=None)
def groups(mesh: Mesh, axes: Tuple[str, ...]) -> np.ndarray:
  """[G, k] partition ids; the same groups, in the same order, as `Mesh.groups(axes)`."""
  idx = [mesh.axis_index(a) for a in axes]
  rest = [i for i in range(len(mesh.axis_names)) if i not in idx]
  arr = mesh.device_ids.transpose(rest + idx).reshape(-1, mesh.axes_size(axes))
  return _frozen(arr.astype(np.int64))


def shard_offset_table(sharding: Sharding, shape: Sequence[int], num_partitions: int) -> np.ndarray:
  """[N, rank] int32: the start of every partition's shard (0 where it holds none)."""
  shape = tuple(int(s) for s in shape)
  sharding.check_shape(shape)
  offsets = np.zeros((num_partitions, len(shape)), dtype=np.int64)
  if sharding.kind != 'tiled':
    return _frozen(offsets.astype(np.int32))
  tile = sharding.tile_assignment
  tiles = sharding.tile_shape
  chunks = np.array([-(-s // t) for s, t in zip(shape, tiles)], dtype=np.int64)
  index = np.indices(tile.shape).reshape(tile.ndim, -1).T[:, : len(shape)]
  devices = tile.reshape(-1)
  inside = devices < num_partitions
  offsets[devices[inside]] = np.minimum(index[inside] * chunks, np.array(shape, dtype=np.int64))
  return _frozen(offsets.astype(np.int32))


def rank_orders(group_array: np.ndarray, rank_keys: np.ndarray) -> Optional[np.ndarray]:
  """Where TF's member order differs from position order: [G, k] TF rank of each position.

  TF's collectives order a group's members by device name (job, task, then
  device index), not by our row-major position along the axes. `rank_keys[p]`
  is partition p's place in that device-name order. Returns None when the two
  orders agree for every group, so no reordering is needed.
  """
  keys = np.asarray(rank_keys)[group_array]
  identity = np.arange(group_array.shape[1])
  order = np.argsort(keys, axis=1, kind='stable')  # order[g, r] = position holding rank r
  if np.all(order == identity):
    return None
  rank = np.empty_like(order)
  np.put_along_axis(rank, order, np.broadcast_to(identity, order.shape).copy(), axis=1)
  return _frozen(rank.astype(np.int32))


class KeyRegistry:
  """Process-wide, deterministic allocation of collective group keys and instance keys."""

  def __init__(self):
    self._lock = threading.Lock()
    self._families = {}
    self._assignments = {}
    self._next_group_key = _FIRST_GROUP_KEY
    self._next_instance_key = _FIRST_INSTANCE_KEY

  def assignment_id(self, device_names: Sequence[str]) -> int:
    """A small integer naming one partition -> device assignment."""
    key = tuple(device_names)
    with self._lock:
      return self._assignments.setdefault(key, len(self._assignments))

  def group_key_base(self, family, num_groups: int) -> int:
    """First key of the block of `num_groups` keys reserved for `family` (hashable)."""
    with self._lock:
      base = self._families.get(family)
      if base is None:
        base = self._next_group_key
        if base + num_groups > _INT32_MAX:
          raise RuntimeError('tf_gspmd ran out of int32 collective group keys in this process.')
        self._families[family] = base
        self._next_group_key += num_groups
      return base

  def instance_key(self) -> int:
    with self._lock:
      key = self._next_instance_key
      if key >= _INT32_MAX:
        raise RuntimeError('tf_gspmd ran out of int32 collective instance keys in this process.')
      self._next_instance_key += 1
      return key


KEYS = KeyRegistry()


def closed_cycle(pairs: np.ndarray, num_partitions: int):
  """A permutation's moving pairs (source != target) closed into one in which every partition
  sends exactly once and receives exactly once: `(edges, real)`, `edges[i]` a (source,
  target) pair and `real[i]` whether it is one of `pairs` (False: added, its value unused),
  or None when one partition alone would be left to pair (nothing to close it with).

  A permutation's pairs form chains and cycles; a partition that neither sends nor receives
  (or keeps its own value) is a chain of one. Each chain's end is joined to the next chain's
  start, the last end to the first start: one added pair per chain."""
  moving = np.asarray(pairs).reshape(-1, 2)
  moving = moving[moving[:, 0] != moving[:, 1]]
  target_of = {int(s): int(t) for s, t in moving}
  has_source = {int(t) for t in moving[:, 1]}
  chains = []
  for start in range(num_partitions):
    if start in has_source:
      continue  # inside a chain or a cycle; chains are walked from their starts
    chain = [start]
    while chain[-1] in target_of:
      chain.append(target_of[chain[-1]])
    chains.append(chain)
  if len(chains) == 1 and len(chains[0]) == 1:
    return None
  edges = [(int(s), int(t)) for s, t in moving]
  added = [(chain[-1], chains[(i + 1) % len(chains)][0]) for i, chain in enumerate(chains)]
  return edges + added, [True] * len(edges) + [False] * len(added)


def clear_caches() -> None:
  """Forget the cached tables (used by the compile-time benchmark to time cold builds)."""
  for fn in (coords_by_partition, positions, group_ids, groups):
    fn.cache_clear()
