"""Any `Sharding` re-expressed as a `NamedSharding` on a given mesh, by search over specs.

`named` and `named_for_rank` look for a spec on the mesh with the same meaning
(`Sharding.is_equivalent_to`); a tile assignment in another device order than
the mesh's comes back on a reordering of the mesh (`Mesh.reordered`).
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import numpy as np

from tf_gspmd.mesh import Mesh
from tf_gspmd.sharding.core import MANUAL, PARTIAL_PREFIX, Sharding, brief, kind_order
from tf_gspmd.sharding.named import NamedSharding
from tf_gspmd.sharding.spec import P


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
  if sharding.canonical_key()[0] == 'tiled' and sorted(sharding.devices) != sorted(mesh.devices):
    raise ValueError(
      f'named: sharding {sharding} is tiled over {len(sharding.devices)} devices '
      f'{brief(sorted(sharding.devices))}, but mesh {mesh} holds {mesh.size} devices '
      f'{brief(sorted(mesh.devices))}; re-express it on a mesh of the same devices.'
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
  target = s.canonical_key()
  tile_shape = s.tile_shape or (1,) * rank
  partial_size = s.subgroup_size(PARTIAL_PREFIX + s.partial) if s.partial else 1
  reduction = s.partial or 'sum'
  for chosen, part in _axis_choices(mesh, tile_shape, partial_size):
    cand = NamedSharding(mesh, P(*[c or None for c in chosen]), part, reduction)
    if cand.canonical_key() == target:
      return cand
  return None


def _merged_subgroups(s: Sharding) -> np.ndarray:
  """`s`'s tile assignment with its subgroup dims merged per kind (in `kind_order`), size-1
  ones dropped, devices kept in the order given (so a reordered mesh reproduces it)."""
  rank, tile = s.rank, s.tile_assignment
  assert rank is not None and tile is not None, s
  order, sizes = list(range(rank)), list(tile.shape[:rank])
  for k in sorted(set(s.subgroups), key=kind_order):
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
  key = s.canonical_key()
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
    if cand.canonical_key() == key:
      return cand
  return None
