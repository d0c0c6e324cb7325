"""Halo geometry for windowed ops (convolution, pooling) on a sharded spatial dim.

Pure arithmetic, no TensorFlow: the partitioner asks how many rows each
partition must borrow from its neighbours, then exchanges them with
collective-permutes (see `partitioner`).

Notation for one spatial dim split in k ceil-sized shards: the input has n
rows, shard i holds input rows [i*ci, (i+1)*ci) (padded); the output has m
rows, shard i produces output rows [i*co, (i+1)*co). Output row r reads
input rows [r*s - pad_lo, r*s - pad_lo + window) where window = (size-1)*dilation + 1.
So output shard i needs input rows [i*co*s - pad_lo, i*co*s - pad_lo + span),
span = (co-1)*s + window. The rows it lacks on each side are affine in i.

A halo may be wider than a neighbour's shard (a 5x5 kernel on 1-row shards,
late small feature maps): it is then assembled from several neighbours,
`HaloPiece`s of hop 1, 2, ... shards away, each one collective-permute. The
pieces tile the halo exactly, so the extended buffer is the local shard plus
the halo rows, never the whole dim.
"""

from __future__ import annotations

import dataclasses
from typing import Tuple


@dataclasses.dataclass(frozen=True)
class WindowDim:
  """One spatial dim of a windowed op, in global (unpartitioned) terms."""
  input_size: int
  window: int
  stride: int = 1
  dilation: int = 1
  pad_lo: int = 0
  pad_hi: int = 0

  @property
  def effective_window(self) -> int:
    return (self.window - 1) * self.dilation + 1

  @property
  def output_size(self) -> int:
    padded = self.input_size + self.pad_lo + self.pad_hi
    return max(0, (padded - self.effective_window) // self.stride + 1)


def same_padding(input_size: int, window: int, stride: int, dilation: int = 1) -> tuple:
  """(pad_lo, pad_hi) of TF's SAME padding."""
  eff = (window - 1) * dilation + 1
  out = -(-input_size // stride)
  total = max((out - 1) * stride + eff - input_size, 0)
  return total // 2, total - total // 2


@dataclasses.dataclass(frozen=True)
class HaloPiece:
  """Rows one partition borrows from the shard `hop` positions away on one side.

  Shard i gets rows [start, start + rows) of shard i - hop (left halo) or
  i + hop (right halo). A piece whose hop reaches past every shard
  (hop >= shards) lies outside the image for every partition: it is zeros,
  with no exchange.
  """
  hop: int
  start: int
  rows: int


def halo_pieces(width: int, chunk: int, side: str) -> Tuple[HaloPiece, ...]:
  """The pieces of a `width`-row halo over shards of `chunk` rows, in buffer order.

  Left: the farthest neighbour first, so [pieces | local] is contiguous;
  the nearest gives its last rows. Right: the nearest first, each giving its
  first rows.
  """
  if side not in ('left', 'right'):
    raise ValueError(f'halo_pieces: side must be "left" or "right", got {side!r}.')
  if width <= 0:
    return ()
  if chunk <= 0:
    raise ValueError(f'halo_pieces: a {width}-row halo over empty shards (chunk {chunk}).')
  hops = -(-width // chunk)
  pieces = []
  for hop in range(1, hops + 1):
    rows = min(chunk, width - (hop - 1) * chunk)
    start = chunk - rows if side == 'left' else 0
    pieces.append(HaloPiece(hop, start, rows))
  return tuple(reversed(pieces)) if side == 'left' else tuple(pieces)


@dataclasses.dataclass(frozen=True)
class HaloPlan:
  """How one partition assembles the input window for its output shard."""
  shards: int
  input_chunk: int    # ci: padded input rows per shard
  output_chunk: int   # co: padded output rows per shard
  left: int           # rows borrowed from the left neighbour (max over shards)
  right: int          # rows borrowed from the right neighbour (max over shards)
  span: int           # input rows one output shard reads
  window_starts: tuple  # per shard: first row of its span inside [left | local | right]
  window_global_starts: tuple  # per shard: global input row of that first row

  @property
  def fits_neighbours(self) -> bool:
    """Whether each halo comes from the adjacent shard alone (one hop per side)."""
    return self.left <= self.input_chunk and self.right <= self.input_chunk

  @property
  def left_pieces(self) -> Tuple[HaloPiece, ...]:
    return halo_pieces(self.left, self.input_chunk, 'left')

  @property
  def right_pieces(self) -> Tuple[HaloPiece, ...]:
    return halo_pieces(self.right, self.input_chunk, 'right')

  @property
  def hops(self) -> int:
    """Neighbours reached on the farther side (1 when each halo fits the adjacent shard)."""
    return max([p.hop for p in self.left_pieces + self.right_pieces], default=0)


def plan_halo(dim: WindowDim, shards: int) -> HaloPlan:
  """The halo exchange that lets each of `shards` partitions compute its output rows."""
  ci = -(-dim.input_size // shards)
  co = -(-dim.output_size // shards)
  span = (co - 1) * dim.stride + dim.effective_window if co else 0
  starts = [i * co * dim.stride - dim.pad_lo for i in range(shards)]
  lefts = [i * ci - s for i, s in enumerate(starts)]
  rights = [s + span - (i + 1) * ci for i, s in enumerate(starts)]
  left, right = max(0, max(lefts)), max(0, max(rights))
  window_starts = tuple(left - l for l in lefts)
  return HaloPlan(shards, ci, co, left, right, span, window_starts, tuple(starts))
