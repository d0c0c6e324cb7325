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
"""

from __future__ import annotations

import dataclasses


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
    """Whether each halo comes from the adjacent shard alone."""
    return self.left <= self.input_chunk and self.right <= self.input_chunk


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
