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
class HaloGeometry:
  """How each partition assembles the input window of its output shard: the rows it borrows
  from its neighbours (`left`, `right`) and where its window lies (`span`, starts)."""

  shards: int
  input_chunk: int  # ci: padded input rows per shard
  output_chunk: int  # co: padded output rows per shard
  left: int  # rows borrowed from the left neighbour (max over shards)
  right: int  # rows borrowed from the right neighbour (max over shards)
  span: int  # input rows one output shard reads
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


def halo_geometry(dim: WindowDim, shards: int) -> HaloGeometry:
  """The halo exchange that lets each of `shards` partitions compute its output rows."""
  ci = -(-dim.input_size // shards)
  co = -(-dim.output_size // shards)
  span = (co - 1) * dim.stride + dim.effective_window if co else 0
  starts = [i * co * dim.stride - dim.pad_lo for i in range(shards)]
  lefts = [i * ci - s for i, s in enumerate(starts)]
  rights = [s + span - (i + 1) * ci for i, s in enumerate(starts)]
  left, right = max(0, max(lefts)), max(0, max(rights))
  window_starts = tuple(left - lo for lo in lefts)
  return HaloGeometry(shards, ci, co, left, right, span, window_starts, tuple(starts))


@dataclasses.dataclass(frozen=True)
class InputGradientGeometry:
  """How one partition computes the image gradient of its own shard rows directly.

  The image gradient of a windowed op is a transposed window op: input row x
  collects the output-gradient rows whose windows cover it. Shard i reads
  output-gradient rows [halo.window_global_starts[i], + halo.span) (a halo
  exchange of the output gradient, chunk co: `halo` is a `HaloGeometry` over the
  gradient's shards) and runs the backprop of a local forward op with
  explicit padding (`pad_lo`, `pad_hi`) over `rows` image rows; its own rows
  are rows [offsets[i], offsets[i] + ci) of that result. `rows` exceeds ci
  (and `offsets` are non-zero) only when a stride does not divide ci, so that
  shards start at different phases of the stride.
  """

  halo: HaloGeometry
  pad_lo: int
  pad_hi: int
  rows: int
  offsets: tuple
  tail: int  # zero rows after the gradient's right halo (trailing shards' windows)


def input_gradient_geometry(dim: WindowDim, shards: int) -> InputGradientGeometry:
  """The output-gradient halo and local padding that give each shard its own image rows.

  Output row r covers image rows [r*s - pad_lo, r*s - pad_lo + window). For
  shard i (own rows from a = i*ci) the first covering row is
  r_min = ceil((a + pad_lo - window + 1) / s); a local forward op whose padded
  input starts `pad_lo'` rows before the local window has its first output
  row at r_min when (window start + pad_lo - pad_lo') = r_min * s. `pad_lo'`
  must be the same on every shard (an attribute), so shards whose phase
  (r_min * s - a - pad_lo + window - 1) is smaller start their local window
  earlier (`offsets`). Only shards holding real image rows decide the halo
  widths (as in the forward `trimmed_halo`). One shard reads the whole gradient
  with the op's own padding.
  """
  n, m, s, eff = dim.input_size, dim.output_size, dim.stride, dim.effective_window
  if m == 0:
    raise ValueError(f'input_gradient_geometry: {dim} has no output rows.')
  ci, co = -(-n // shards), -(-m // shards)
  real = [i for i in range(shards) if i * ci < n]
  if shards == 1:
    starts, pad_lo = {0: 0}, dim.pad_lo
    offsets: Tuple[int, ...] = (0,)
  else:
    first = {i: i * ci + dim.pad_lo - eff + 1 for i in real}  # r_min * s before rounding up
    phase = {i: (-x) % s for i, x in first.items()}
    top = max(phase.values())
    pad_lo = eff - 1 - top
    while pad_lo < 0:  # stride > window: start one gradient row earlier (it covers nothing)
      pad_lo += s
    offsets = tuple(top - phase[i] if i in phase else 0 for i in range(shards))
    starts = {i: (i * ci - offsets[i] + dim.pad_lo - pad_lo) // s for i in real}
  rows = ci + max(offsets)
  # Gradient rows each real shard needs: up to the last window starting in its own rows.
  last = {i: min(m - 1, (min(n, (i + 1) * ci) - 1 + dim.pad_lo) // s) for i in real}
  span = max(max(last[i] - starts[i] + 1 for i in real), (pad_lo + rows - eff) // s + 1)
  pad_hi = max(0, (span - 1) * s + eff - pad_lo - rows)
  lefts = {i: i * co - starts[i] for i in real}
  rights = {i: starts[i] + span - (i + 1) * co for i in real}
  left, right = max(0, max(lefts.values())), max(0, max(rights.values()))
  window_starts = tuple(left - lefts[i] if i in lefts else 0 for i in range(shards))
  global_starts = tuple(starts[i] if i in starts else i * co - left for i in range(shards))
  tail = max(0, max(st + span for st in window_starts) - (left + co + right))
  halo = HaloGeometry(shards, co, ci, left, right, span, window_starts, global_starts)
  return InputGradientGeometry(halo, pad_lo, pad_hi, rows, offsets, tail)
