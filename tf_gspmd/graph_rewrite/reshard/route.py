"""`ReshardRoute`: the steps of one reshard, with what they cost per device."""

from __future__ import annotations

import dataclasses
from functools import cached_property
from typing import Dict, Optional

from tf_gspmd.graph_rewrite.reshard.exchange import Repad
from tf_gspmd.graph_rewrite.reshard.geometry import elems
from tf_gspmd.graph_rewrite.reshard.moves import Slice
from tf_gspmd.mesh import Mesh
from tf_gspmd.sharding import NamedSharding


def _fmt_shape(shape) -> str:
  return '[' + ','.join(str(s) for s in shape) + ']'


@dataclasses.dataclass(frozen=True)
class ReshardRoute:
  """Steps that turn `src`-sharded shards of a `shape` tensor into `dst`-sharded shards.

  bound_bytes: the memory bound the search guarantees: max(source shard,
  target shard) bytes with each dim's global size first rounded up to a
  multiple of the product of the mesh axes that split it in the source or the
  target (the "ceil padding"); for sizes that divide evenly it is exactly
  max(source shard, target shard). peak_bytes: the largest single buffer
  (input, collective output before trimming, padded input, output) any step
  holds per device, the source shard included.
  """

  src: NamedSharding
  dst: NamedSharding
  shape: tuple
  dtype_size: int
  steps: tuple
  bound_bytes: int
  strategy: str = 'valley'
  step_mesh: Optional[Mesh] = None

  @property
  def mesh(self) -> Mesh:
    """The mesh the steps' axes name: `src.mesh`, or it with axes split into factors."""
    return self.step_mesh if self.step_mesh is not None else self.src.mesh

  def bytes_moved_per_device(self) -> Dict[int, int]:
    """Bytes each device receives over the whole route."""
    return {
      d: self.dtype_size * sum(s.received_elems(d) for s in self.steps) for d in self.mesh.devices
    }

  @cached_property  # asked for every candidate sharding of every op: 2048 devices each
  def bytes_moved(self) -> int:
    """Max over devices of the bytes that device receives over the whole route."""
    return max(self.bytes_moved_per_device().values(), default=0)

  @property
  def src_shard_bytes(self) -> int:
    return self.dtype_size * elems(self.src.shard_shape(self.shape))

  @property
  def dst_shard_bytes(self) -> int:
    return self.dtype_size * elems(self.dst.shard_shape(self.shape))

  @property
  def peak_bytes(self) -> int:
    return self.dtype_size * max(
      [elems(self.src.shard_shape(self.shape))] + [s.peak_elems for s in self.steps]
    )

  def collective_counts(self) -> Dict[str, int]:
    """Steps per kind (local slices included as 'slice')."""
    counts: Dict[str, int] = {}
    for s in self.steps:
      counts[s.kind] = counts.get(s.kind, 0) + 1
    return counts

  def __str__(self):
    head = (
      f'ReshardRoute[{self.strategy}] {_fmt_shape(self.shape)} x{self.dtype_size}B on '
      f'{self.src.mesh}: {self.src} -> {self.dst}'
    )
    if self.mesh != self.src.mesh:
      head += f' (steps on {self.mesh})'
    lines = [head]
    for i, s in enumerate(self.steps, 1):
      recv = max(s.received_elems(d) for d in self.mesh.devices) * self.dtype_size
      lines.append(
        f'  {i}. {s.describe():<58} {_fmt_shape(s.shape_in)} -> '
        f'{_fmt_shape(s.shape_out)}  recv {recv} B'
      )
    if not self.steps:
      lines.append('  (nothing to do)')
    lines.append(
      f'  bytes moved/device: {self.bytes_moved}  peak buffer/device: '
      f'{self.peak_bytes} B (bound {self.bound_bytes} B; src shard '
      f'{self.src_shard_bytes} B, dst shard {self.dst_shard_bytes} B)'
    )
    return '\n'.join(lines)


def collective_count(route: ReshardRoute) -> int:
  """Collectives a route runs: every step but local slices, a repad once per round."""
  return sum(
    len(s.rounds) if isinstance(s, Repad) else int(not isinstance(s, Slice)) for s in route.steps
  )
