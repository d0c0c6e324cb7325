"""Which device holds which block of a tensor: the plain data every picture is drawn from.

`tiling_of(sharding, shape, mesh)` turns a sharding into a `Tiling`: per tensor
dim, how it is cut (`DimSplit`), and per block (a tile index), the devices that
hold it (`Block.parts`: one tuple of replicas per part of a pending reduction).
`Tiling.grid_dims` picks the two dims a 2-D picture shows; the text grid and
the HTML page both draw from here, so they cannot disagree.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from tf_gspmd.mesh import Mesh
from tf_gspmd.sharding import PARTIAL_PREFIX, NamedSharding, Sharding, named_for_rank, shard_bounds

# A dim cut into more blocks than this shows its first and last ones around an ellipsis:
# a terminal line, or a card of the page, holds about eight labelled blocks.
MAX_SHOWN = 8


@dataclasses.dataclass(frozen=True)
class DimSplit:
  """How one tensor dim is cut: the [start, stop) of every block, and the mesh axes cutting it."""

  size: int
  bounds: Tuple[Tuple[int, int], ...]
  axes: Tuple[str, ...] = ()

  @property
  def blocks(self) -> int:
    return len(self.bounds)

  @property
  def sizes(self) -> List[int]:
    return [stop - start for start, stop in self.bounds]


@dataclasses.dataclass(frozen=True)
class Block:
  """One block of the tensor: its [start, stop) per dim and the devices holding it.

  `parts` has one tuple of devices per part of a pending reduction (the block's
  value is their sum, max, ...); the devices of one tuple hold the same values.
  """

  bounds: Tuple[Tuple[int, int], ...]
  parts: Tuple[Tuple[int, ...], ...]

  @property
  def empty(self) -> bool:
    return any(stop == start for start, stop in self.bounds)

  @property
  def devices(self) -> Tuple[int, ...]:
    return tuple(sorted(d for part in self.parts for d in part))


@dataclasses.dataclass(frozen=True)
class Tiling:
  """A tensor's blocks over devices; see the module docstring."""

  shape: Tuple[int, ...]
  sharding: Sharding
  mesh: Optional[Mesh]
  dims: Tuple[DimSplit, ...]
  blocks: Dict[Tuple[int, ...], Block]
  replica_axes: Tuple[str, ...] = ()  # mesh axes holding copies (NamedSharding only)

  @property
  def kind(self) -> str:
    return self.sharding.kind

  @property
  def partial(self) -> Optional[str]:
    return self.sharding.partial

  @property
  def partial_axes(self) -> Tuple[str, ...]:
    return getattr(self.sharding, 'partial_axes', ())

  @property
  def copies(self) -> int:
    """How many devices hold the same values of a block (1: none repeats)."""
    parts = next(iter(self.blocks.values())).parts
    return len(parts[0]) if parts else 0

  @property
  def shard_shape(self) -> Tuple[int, ...]:
    return tuple(self.sharding.shard_shape(self.shape))

  @property
  def grid_dims(self) -> Tuple[Optional[int], Optional[int]]:
    """(row dim, column dim) of a 2-D picture; None where the picture has a single row/column.

    Rank 2 shows both dims; rank 1 one row; rank > 2 the two dims cut into the
    most blocks (then the largest), in tensor order.
    """
    rank = len(self.shape)
    if rank <= 2:
      return (None,) * (2 - rank) + tuple(range(rank))
    by_cut = sorted(range(rank), key=lambda d: (-self.dims[d].blocks, -self.shape[d], d))
    rows, cols = sorted(by_cut[:2])
    return rows, cols

  @property
  def other_dims(self) -> Tuple[int, ...]:
    """The dims a 2-D picture folds into each cell (rank > 2)."""
    shown = set(self.grid_dims)
    return tuple(d for d in range(len(self.shape)) if d not in shown)

  def cell(self, row: Optional[int], col: Optional[int]) -> List[Block]:
    """The blocks at grid position (row, col), one per block of the other dims (row-major)."""
    rows, cols = self.grid_dims
    others = self.other_dims
    out = []
    for rest in itertools.product(*(range(self.dims[d].blocks) for d in others)):
      index = [0] * len(self.shape)
      for d, i in zip(others, rest):
        index[d] = i
      if rows is not None:
        index[rows] = row
      if cols is not None:
        index[cols] = col
      out.append(self.blocks[tuple(index)])
    return out


def tiling_of(sharding: Sharding, shape: Sequence[int], mesh: Optional[Mesh] = None) -> Tiling:
  """The blocks of a tensor of `shape` laid out by `sharding`.

  `mesh` names the axes of a plain `Sharding` (when some spec on it says the
  same) and the devices of a replicated one; a `NamedSharding` brings its own.
  """
  shape = tuple(int(s) for s in shape)
  sharding.check_shape(shape, 'visualize')
  sharding = _on_mesh(sharding, mesh, len(shape))
  mesh = sharding.mesh if isinstance(sharding, NamedSharding) else mesh
  tiles = sharding.tile_shape if sharding.is_tiled else (1,) * len(shape)
  dims = tuple(
    DimSplit(size, tuple(shard_bounds(size, n, i) for i in range(n)), _axes(sharding, d))
    for d, (size, n) in enumerate(zip(shape, tiles))
  )
  holders = _holders(sharding, mesh, len(shape))
  blocks = {
    index: Block(tuple(dims[d].bounds[i] for d, i in enumerate(index)), parts)
    for index, parts in holders.items()
  }
  return Tiling(shape, sharding, mesh, dims, blocks, _replica_axes(sharding))


def device_label(parts: Sequence[Sequence[int]]) -> str:
  """Devices of a block: replicas joined by ',' (runs of 3 or more as 'a-b'), parts of a
  pending reduction by '+'."""
  return '+'.join(_runs(sorted(part)) for part in parts) if parts else 'all'


def shown(count: int, limit: int = MAX_SHOWN) -> List[Optional[int]]:
  """Block indices a picture draws along a dim of `count` blocks; None marks the elided run."""
  if count <= limit:
    return list(range(count))
  head = limit // 2
  return list(range(head)) + [None] + list(range(count - (limit - head - 1), count))


def range_text(bounds: Tuple[int, int]) -> str:
  return f'{bounds[0]}:{bounds[1]}'


# --- internals ---------------------------------------------------------------------
def _on_mesh(sharding: Sharding, mesh: Optional[Mesh], rank: int) -> Sharding:
  """`sharding` as a spec on `mesh` when one says the same (for axis names), else itself."""
  if mesh is None or isinstance(sharding, NamedSharding) or sharding.is_manual:
    return sharding
  if sharding.is_maximal and mesh.size > 1:
    return sharding  # one device of several: no spec says that
  try:
    named = named_for_rank(sharding, mesh, rank)
  except ValueError:
    named = None
  return sharding if named is None else named


def _axes(sharding: Sharding, dim: int) -> Tuple[str, ...]:
  return sharding.spec.axes_of(dim) if isinstance(sharding, NamedSharding) else ()


def _replica_axes(sharding: Sharding) -> Tuple[str, ...]:
  if not isinstance(sharding, NamedSharding):
    return ()
  taken = set(sharding.spec.used_axes()) | set(sharding.partial_axes)
  return tuple(
    a for a in sharding.mesh.axis_names if a not in taken and sharding.mesh.axis_size(a) > 1
  )


def _holders(sharding: Sharding, mesh: Optional[Mesh], rank: int) -> Dict[tuple, tuple]:
  """tile index -> the block's parts (tuples of replica devices), read off the tile assignment."""
  if not sharding.is_tiled:
    # Replicated or manual: every device holds the whole tensor (the mesh's devices, when known).
    devices = sharding.devices or (mesh.devices if mesh is not None else ())
    return {(0,) * rank: (tuple(sorted(devices)),) if devices else ()}
  partial_dims = [i for i, k in enumerate(sharding.subgroups) if k.startswith(PARTIAL_PREFIX)]
  found: Dict[tuple, Dict[tuple, list]] = {}
  for index, device in np.ndenumerate(sharding.tile_assignment):
    sub = index[rank:]
    part = tuple(sub[i] for i in partial_dims)
    found.setdefault(index[:rank], {}).setdefault(part, []).append(int(device))
  return {
    index: tuple(sorted((tuple(sorted(ds)) for ds in parts.values()), key=lambda p: p[0]))
    for index, parts in sorted(found.items())
  }


def _runs(devices: Sequence[int]) -> str:
  """'0,1,2,3,6' -> '0-3,6': runs of three or more consecutive ids shortened."""
  out, start = [], 0
  while start < len(devices):
    stop = start
    while stop + 1 < len(devices) and devices[stop + 1] == devices[stop] + 1:
      stop += 1
    if stop - start >= 2:
      out.append(f'{devices[start]}-{devices[stop]}')
    else:
      out.extend(str(d) for d in devices[start : stop + 1])
    start = stop + 1
  return ','.join(out)
