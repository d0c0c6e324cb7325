"""Reshard planner: which collectives turn one sharding of a tensor into another.

`plan_reshard(src, dst, shape)` returns a `ReshardPlan`: a list of steps, each
a small frozen dataclass that a separate lowering module maps onto a collective
interface whose methods take mesh axes (`all_gather(x, axes, dim)`,
`all_to_all(x, axes, split_dim, concat_dim)`, `reduce_scatter(x, axes, dim,
op)`, `all_reduce(x, axes, op)`, `permute(x, pairs)`) plus local ops (pad,
dynamic slice at this partition's row-major index along some axes, reshape,
static slice). This module is pure Python: no TensorFlow.

Layout model. Work is in mesh-axis terms: per tensor dim an ordered tuple of
mesh axes (major to minor) and a set of axes holding a pending reduction. A dim
split over axes (a, b) has shard index idx_a * size_b + idx_b. Sizes that do
not divide evenly are the reason this module keeps more than axes per dim: it
also keeps the dim's *geometry*, a mixed-radix list of levels (k, c). The shard
index is decomposed over the levels' k (row-major); level j places its
sub-block i_j at offset i_j * c_j inside the chunk of the level above, and a
position is valid when it lies inside every enclosing chunk and below the
dim's global size. A freshly sharded dim is one flat level (k, ceil(n/k)),
matching `NamedSharding.shard_bounds`. Every step keeps the geometry exact:

- slicing (and reduce-scattering, and the split side of an all-to-all) adds a
  level (g, ceil(c/g)) after padding the local dim to g * ceil(c/g);
- gathering (and the concat side of an all-to-all) removes the trailing levels
  whose sizes multiply to the group size, then `regroup_blocks` moves each
  received block to its offset and drops the padding (a static reshape+slice);
- a flat level splits into two whenever a gather takes only its minor axes:
  (k, c) is the same layout as (k/h, h*c), (h, c).

Gathering the minor axes of a flat level therefore yields chunks of h*c rows,
which for uneven sizes is not the canonical ceil(n/(k/h)) layout (10 rows over
2x2 gathered over the minor axis gives blocks [0,6), [6,10), not [0,5),
[5,10)). Such dims get a `Repad` step: a short exchange among the devices of
that dim's group (a few rows to neighbours, as rounds of permutes) that turns
one geometry into another. The planner puts it at the bottom of the valley
(where buffers are smallest) by re-laying out to the target-refined geometry
that the remaining gathers turn into the target exactly.

Search. Plans follow the memory-efficient "valley" form of Rink et al. 2021:
local slices and reductions first, then all-to-alls, permutes and repads, then
gathers, so buffers shrink, stay, then grow to the target. A Dijkstra search
over layouts (axes, geometry and pending reductions per dim, plus the phase)
finds the plan with the fewest bytes received per device, then the fewest
non-valley steps, then the fewest steps, pruning any step whose buffers exceed
`bound_bytes` (see `ReshardPlan`). Slices only add target axes to their target
dim, all-to-alls only move axes to their target dim, permutes may place any
axis on any dim (swapping two axes between dims with one permute is often the
cheapest move). Pending reductions become reduce-scatters onto the dim the
target shards over that axis, or all-reduces (after slicing, on the smaller
buffer). Slicing later (after an all-to-all, or after gathers as the naive
plan does) is explored too but wins only when strictly cheaper; with uneven
sizes that happens for tiny dims where padding dominates. When every dim
divides evenly the plan is a valley plan whose buffers never exceed
max(source shard, target shard), and it never moves more bytes than the
naive gather-then-slice plan; with uneven sizes the naive plan can be cheaper
only when it breaks the memory bound, which the planner keeps instead.

Sub-axes. `plan_reshard` also plans on `refined_mesh(mesh)`, where every
composite axis is split into prime-factor sub-axes ('y' of size 4 becomes
'y#0', 'y#1'; same devices, same row-major order, so a dim over y is a dim
over ('y#0', 'y#1')), and keeps that plan when it is cheaper: P('x', 'y') ->
P('y', 'x') on a 2x4 mesh becomes an all-to-all over y#1 and one permute (half
the bytes of whole-axis plans, as XLA does it). The steps' axes then name the
plan's `mesh` (`ReshardPlan.mesh`), which a lowering must use to form groups
and indices; `src.mesh` and `dst.mesh` stay the caller's.

Device orders. `src` and `dst` may live on two device orders of one mesh
(`Mesh.is_reordering_of`: same axis names and sizes, devices in another
order), as tile assignments in a TPU program's own device order do. The plan
then runs on one of the two orders and adds one `Permute` of whole shards
(`reorder_pairs`), first or last, whichever moves fewer bytes; the steps'
axes name that order's mesh (`ReshardPlan.mesh`).

Costs are per device. `bytes received` for each step assumes the usual
bandwidth-optimal algorithms: all-gather and all-to-all receive (g-1) blocks,
reduce-scatter (g-1) pieces of the output size, all-reduce 2(g-1) pieces of
ceil(E/g) elements (ring reduce-scatter + all-gather), a permute the whole
buffer on devices that get a new one, a repad the fixed-size messages of the
rounds the device receives in. A plan's `bytes_moved` is the maximum over
devices of the sum over steps.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
from functools import cached_property, lru_cache
from typing import ClassVar, Dict, Sequence, Tuple

import numpy as np

from tf_gspmd.mesh import Mesh
from tf_gspmd.sharding import NamedSharding

Level = Tuple[int, int]  # (number of sub-blocks k, rows per sub-block c)


def _ceil(a: int, b: int) -> int:
  return -(-a // b)


def _prod(values) -> int:
  return int(math.prod(values))


# --- per-dim geometry ---------------------------------------------------------------
def normalize_levels(levels: Sequence[Level]) -> Tuple[Level, ...]:
  """Drop one-way levels and merge a level into its parent when the two tile it evenly.

  (k1, c1), (k2, c2) with c1 == k2 * c2 place sub-blocks exactly like the flat
  level (k1 * k2, c2), so they are the same geometry.
  """
  out = []
  for k, c in levels:
    if k == 1:
      continue
    if out and out[-1][1] == k * c:
      out[-1] = (out[-1][0] * k, c)
    else:
      out.append((k, c))
  return tuple(out)


def canonical_levels(n: int, count: int) -> Tuple[Level, ...]:
  """The geometry of a dim of size n freshly split `count` ways: one flat ceil level."""
  return ((count, _ceil(n, count)),) if count > 1 else ()


def levels_chunk(n: int, levels: Sequence[Level]) -> int:
  """Rows each device holds (padded) for a dim of size n with this geometry."""
  return levels[-1][1] if levels else n


@lru_cache(maxsize=None)
def shard_intervals(n: int, levels: Tuple[Level, ...]) -> Tuple[Tuple[int, int], ...]:
  """Per shard index: (global start, valid length); the valid rows sit at local [0, length).

  Empty shards are reported as (0, 0) so that equal layouts compare equal.
  """
  cur = [(0, n)]
  for k, c in levels:
    cur = [(off + i * c, max(0, min(c, length - i * c))) for off, length in cur for i in range(k)]
  return tuple((s, ln) if ln else (0, 0) for s, ln in cur)


def same_layout(n: int, a: Tuple[Level, ...], b: Tuple[Level, ...]) -> bool:
  """Whether two geometries put the same rows at the same local places with the same buffer."""
  return levels_chunk(n, a) == levels_chunk(n, b) and shard_intervals(n, a) == shard_intervals(n, b)


def split_trailing(levels: Sequence[Level], g: int):
  """(prefix, trailing) with the trailing levels' sizes multiplying to g, or None.

  Splits one level (k, c) into (k/h, h*c), (h, c) when the group covers only
  its minor part; returns None when the group size does not factor that way.
  """
  rest, trailing, need = list(levels), [], g
  while need > 1:
    if not rest:
      return None
    k, c = rest.pop()
    if need % k == 0:
      trailing.insert(0, (k, c))
      need //= k
    elif k % need == 0:
      rest.append((k // need, need * c))
      trailing.insert(0, (need, c))
      need = 1
    else:
      return None
  return tuple(rest), tuple(trailing)


@lru_cache(maxsize=None)
def _repad_exchange(n: int, levels_in: Tuple[Level, ...], levels_out: Tuple[Level, ...]):
  """How to turn geometry `levels_in` into `levels_out` by moving rows between shards.

  Returns (local, rounds, max_rows_received):
    local: ((shard, src_off, dst_off, length), ...): rows a shard keeps;
    rounds: ((size, ((src_shard, dst_shard, start, msg_off, dst_off, length), ...)), ...),
      one round per shard distance, so each shard sends and receives at most
      once per round. Every message is `size` rows (the round's longest
      transfer), taken from the sender's buffer at `start` (clamped so the
      window stays inside the buffer); the receiver keeps message rows
      [msg_off, msg_off+length) at its output rows [dst_off, dst_off+length).
  """
  have = shard_intervals(n, levels_in)
  want = shard_intervals(n, levels_out)
  chunk_in = levels_chunk(n, levels_in)
  local, by_shift = [], {}
  for dst, (ws, wl) in enumerate(want):
    if not wl:
      continue
    for src, (hs, hl) in enumerate(have):
      lo, hi = max(ws, hs), min(ws + wl, hs + hl)
      if lo >= hi:
        continue
      if src == dst:
        local.append((dst, lo - hs, lo - ws, hi - lo))
      else:
        by_shift.setdefault(dst - src, []).append((src, dst, lo - hs, lo - ws, hi - lo))
  rounds, received = [], [0] * len(want)
  for shift in sorted(by_shift, key=lambda s: (abs(s), s)):
    size = max(item[4] for item in by_shift[shift])  # <= chunk_in: a transfer fits its source
    items = []
    for src, dst, src_off, dst_off, length in by_shift[shift]:
      start = min(src_off, chunk_in - size)
      items.append((src, dst, start, src_off - start, dst_off, length))
      received[dst] += size
    rounds.append((size, tuple(items)))
  return tuple(local), tuple(rounds), max(received, default=0)


# --- local ops shared by lowerings and the simulator -----------------------------------
def regroup_blocks(x, dim: int, blocks: Sequence[Level], out_chunk: int, reshape=np.reshape):
  """Place gathered blocks at their geometric offsets and drop padding (static reshape+slice).

  `x` holds, along `dim`, prod(k) blocks of `blocks[-1][1]` rows in group order
  (the output of all_gather or the concat side of all_to_all). Level j of
  `blocks` is (k_j, c_j): sub-block i_j belongs at offset i_j * c_j inside the
  chunk of the level above, whose size is c_{j-1} (`out_chunk` for the first).
  Works on numpy arrays and on TF tensors (pass tf.reshape).
  """
  shape = [int(s) for s in x.shape]
  lead, tail = shape[:dim], shape[dim + 1 :]
  ks = [k for k, _ in blocks]
  cur = blocks[-1][1]
  y = reshape(x, lead + ks + [cur] + tail)
  for j in range(len(blocks) - 1, -1, -1):
    keep = blocks[j - 1][1] if j else out_chunk
    y = reshape(y, lead + ks[:j] + [ks[j] * cur] + tail)
    if keep != ks[j] * cur:
      y = y[(slice(None),) * (dim + j) + (slice(0, keep),)]
    cur = keep
  return y


def pad_dim(x, dim: int, size: int, pad=np.pad):
  """Pad `x` with zeros at the end of `dim` up to `size` rows (no-op when already there)."""
  have = int(x.shape[dim])
  if have == size:
    return x
  if have > size:
    raise ValueError(f'pad_dim: dim {dim} has {have} rows, more than the {size} asked for.')
  widths = [[0, 0] for _ in range(len(x.shape))]
  widths[dim][1] = size - have
  return pad(x, widths)


def _elems(shape) -> int:
  return _prod(shape)


def _set(shape, sizes) -> tuple:
  """`shape` with the sizes of some dims replaced ({dim: size})."""
  out = list(shape)
  for d, v in sizes.items():
    out[d] = v
  return tuple(out)


def _fmt_shape(shape) -> str:
  return '[' + ','.join(str(s) for s in shape) + ']'


def _fmt_axes(axes) -> str:
  return '(' + ','.join(axes) + ')'


# --- steps -------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Slice:
  """Local dynamic slice: keep rows [idx*chunk, idx*chunk + chunk) of `dim`, padded.

  idx is this partition's row-major index along `axes`. No padding of the
  input is needed: with L rows in the buffer, take the window of `chunk` rows
  at start = min(idx*chunk, L - chunk) and roll it up by idx*chunk - start, so
  the wanted rows come first and rows past the end of the buffer land in the
  shard's padding (`slice_window` computes start and shift).
  """

  kind: ClassVar[str] = 'slice'
  dim: int
  axes: tuple
  chunk: int
  shape_in: tuple
  shape_out: tuple

  def received_elems(self, device: int) -> int:
    return 0

  @property
  def peak_elems(self) -> int:
    return max(_elems(self.shape_in), _elems(self.shape_out))

  def describe(self) -> str:
    return f'slice dim={self.dim} axes={_fmt_axes(self.axes)}'


def _gather_copy_elems(move, details) -> int:
  """Elements an all-gather on a dim behind a non-trivial leading one moves again: the
  gathered pieces arrive stacked in front and are transposed into place. Between plans
  equal in bytes and steps this prefers gathering minor dims first, while the buffer is
  small, so the last and largest gather lands in place."""
  if move[0] != 'all_gather':
    return 0
  d = move[1]
  shape_in, shape_out = details[2], details[3]
  return _elems(shape_out) if _elems(shape_in[:d]) > 1 else 0


def slice_window(index: int, chunk: int, rows: int) -> Tuple[int, int]:
  """(start, shift) for `Slice`: window [start, start+chunk) of `rows`, then roll up by shift."""
  want = index * chunk
  start = max(0, min(want, rows - chunk))
  return start, want - start


@dataclasses.dataclass(frozen=True)
class AllGather:
  """all_gather(x, axes, dim), then regroup_blocks(y, dim, blocks, out_chunk)."""

  kind: ClassVar[str] = 'all_gather'
  dim: int
  axes: tuple
  group_size: int
  blocks: tuple
  out_chunk: int
  shape_in: tuple
  shape_out: tuple

  def received_elems(self, device: int) -> int:
    return (self.group_size - 1) * _elems(self.shape_in)

  @property
  def peak_elems(self) -> int:
    return max(_elems(self.shape_in) * self.group_size, _elems(self.shape_out))

  def describe(self) -> str:
    return f'all_gather dim={self.dim} axes={_fmt_axes(self.axes)}'


@dataclasses.dataclass(frozen=True)
class AllToAll:
  """pad split_dim to split_padded; all_to_all(x, axes, split_dim, concat_dim);
  then regroup_blocks(y, concat_dim, blocks, out_chunk)."""

  kind: ClassVar[str] = 'all_to_all'
  split_dim: int
  concat_dim: int
  axes: tuple
  group_size: int
  split_padded: int
  blocks: tuple
  out_chunk: int
  shape_in: tuple
  shape_out: tuple

  @property
  def _padded_elems(self) -> int:
    return _elems(_set(self.shape_in, {self.split_dim: self.split_padded}))

  def received_elems(self, device: int) -> int:
    return (self.group_size - 1) * (self._padded_elems // self.group_size)

  @property
  def peak_elems(self) -> int:
    return max(_elems(self.shape_in), self._padded_elems, _elems(self.shape_out))

  def describe(self) -> str:
    return (
      f'all_to_all axes={_fmt_axes(self.axes)} split_dim={self.split_dim} '
      f'concat_dim={self.concat_dim}'
    )


@dataclasses.dataclass(frozen=True)
class ReduceScatter:
  """pad `dim` to `padded`; reduce_scatter(x, axes, dim, op)."""

  kind: ClassVar[str] = 'reduce_scatter'
  dim: int
  axes: tuple
  op: str
  group_size: int
  padded: int
  shape_in: tuple
  shape_out: tuple

  def received_elems(self, device: int) -> int:
    return (self.group_size - 1) * _elems(self.shape_out)

  @property
  def peak_elems(self) -> int:
    return max(_elems(self.shape_in), _elems(_set(self.shape_in, {self.dim: self.padded})))

  def describe(self) -> str:
    return f'reduce_scatter dim={self.dim} axes={_fmt_axes(self.axes)} op={self.op}'


@dataclasses.dataclass(frozen=True)
class AllReduce:
  """all_reduce(x, axes, op)."""

  kind: ClassVar[str] = 'all_reduce'
  axes: tuple
  op: str
  group_size: int
  shape_in: tuple

  @property
  def shape_out(self) -> tuple:
    return self.shape_in

  def received_elems(self, device: int) -> int:
    g = self.group_size
    return 2 * (g - 1) * _ceil(_elems(self.shape_in), g)

  @property
  def peak_elems(self) -> int:
    return _elems(self.shape_in)

  def describe(self) -> str:
    return f'all_reduce axes={_fmt_axes(self.axes)} op={self.op}'


@dataclasses.dataclass(frozen=True)
class Permute:
  """permute(x, pairs): device dst gets src's buffer; devices that are no dst keep theirs.

  `from_axes`/`to_axes` give the per-dim mesh axes before and after (same local shape).
  """

  kind: ClassVar[str] = 'permute'
  pairs: tuple
  from_axes: tuple
  to_axes: tuple
  shape_in: tuple

  @property
  def shape_out(self) -> tuple:
    return self.shape_in

  @cached_property
  def destinations(self) -> frozenset:
    return frozenset(dst for _, dst in self.pairs)

  def received_elems(self, device: int) -> int:
    return _elems(self.shape_in) if device in self.destinations else 0

  @property
  def peak_elems(self) -> int:
    return _elems(self.shape_in)

  def describe(self) -> str:
    moves = [
      f'd{d}:{_fmt_axes(a)}->{_fmt_axes(b)}'
      for d, (a, b) in enumerate(zip(self.from_axes, self.to_axes))
      if a != b
    ]
    return f'permute {" ".join(moves) or "device order"} ({len(self.pairs)} pairs)'


@dataclasses.dataclass(frozen=True)
class RepadRound:
  """One permute of `size`-row messages (along the repad's dim).

  sends: ((device, start), ...): the message is the sender's rows
  [start, start+size); recvs: ((device, msg_off, dst_off, length), ...): the
  receiver writes message rows [msg_off, msg_off+length) to its output rows
  [dst_off, dst_off+length). pairs: ((src_device, dst_device), ...).
  """

  size: int
  pairs: tuple
  sends: tuple
  recvs: tuple


@dataclasses.dataclass(frozen=True)
class Repad:
  """Change the geometry of `dim` (same axes): rows move between devices of a dim group.

  Lowering: out = zeros(shape_out); for this device's entry (device, src_off,
  dst_off, length) in `local`: out rows [dst_off, +length) = x rows [src_off,
  +length); then for each round: message = x rows [start, +size) (from
  `sends`), received = permute(message, pairs), and for this device's entry in
  `recvs`: out rows [dst_off, +length) = received rows [msg_off, +length).
  Offsets and lengths differ per device: constant tables indexed by the
  partition id (length 0 where a device has no entry). Every window lies
  inside its buffer, so no padding is needed.
  """

  kind: ClassVar[str] = 'repad'
  dim: int
  axes: tuple
  levels_in: tuple
  levels_out: tuple
  local: tuple
  rounds: tuple
  shape_in: tuple
  shape_out: tuple

  @cached_property
  def received_rows(self) -> Dict[int, int]:
    """device -> rows it receives over all rounds (a round's message counted once)."""
    rows: Dict[int, int] = {}
    for message in self.rounds:
      for device in {entry[0] for entry in message.recvs}:
        rows[device] = rows.get(device, 0) + message.size
    return rows

  def received_elems(self, device: int) -> int:
    return _elems(_set(self.shape_in, {self.dim: 1})) * self.received_rows.get(device, 0)

  @property
  def peak_elems(self) -> int:
    return max(_elems(self.shape_in), _elems(self.shape_out))

  def describe(self) -> str:
    return (
      f'repad dim={self.dim} axes={_fmt_axes(self.axes)} {list(self.levels_in)}->'
      f'{list(self.levels_out)} ({len(self.rounds)} rounds)'
    )


STEP_TYPES = (Slice, AllGather, AllToAll, ReduceScatter, AllReduce, Permute, Repad)


# --- plans -------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ReshardPlan:
  """Steps that turn `src`-sharded shards of a `shape` tensor into `dst`-sharded shards.

  bound_bytes: the memory bound the planner guarantees: max(source shard,
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
  step_mesh: Mesh = None

  @property
  def mesh(self) -> Mesh:
    """The mesh the steps' axes name: `src.mesh`, or it with axes split into factors."""
    return self.step_mesh if self.step_mesh is not None else self.src.mesh

  def bytes_moved_per_device(self) -> Dict[int, int]:
    """Bytes each device receives over the whole plan."""
    return {
      d: self.dtype_size * sum(s.received_elems(d) for s in self.steps) for d in self.mesh.devices
    }

  @cached_property  # asked for every candidate layout of every op: 2048 devices each
  def bytes_moved(self) -> int:
    """Max over devices of the bytes that device receives over the whole plan."""
    return max(self.bytes_moved_per_device().values(), default=0)

  @property
  def src_shard_bytes(self) -> int:
    return self.dtype_size * _elems(self.src.shard_shape(self.shape))

  @property
  def dst_shard_bytes(self) -> int:
    return self.dtype_size * _elems(self.dst.shard_shape(self.shape))

  @property
  def peak_bytes(self) -> int:
    return self.dtype_size * max(
      [_elems(self.src.shard_shape(self.shape))] + [s.peak_elems for s in self.steps]
    )

  def collective_counts(self) -> Dict[str, int]:
    """Steps per kind (local slices included as 'slice')."""
    counts = {}
    for s in self.steps:
      counts[s.kind] = counts.get(s.kind, 0) + 1
    return counts

  def __str__(self):
    head = (
      f'ReshardPlan[{self.strategy}] {_fmt_shape(self.shape)} x{self.dtype_size}B on '
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


def plan_reshard(
  src: NamedSharding, dst: NamedSharding, shape: Sequence[int], dtype_size: int = 4
) -> ReshardPlan:
  """The cheapest valley plan (bytes received per device) from `src` to `dst` within the bound.

  >>> from tf_gspmd.sharding import P
  >>> mesh = Mesh.create((2, 4), ('x', 'y'))
  >>> src, dst = NamedSharding(mesh, P('x', 'y')), NamedSharding(mesh, P('y', 'x'))
  >>> plan = plan_reshard(src, dst, (8, 8))
  >>> sorted(plan.collective_counts())
  ['all_to_all', 'permute']
  """
  # Plans are immutable and a program asks the same questions many times (every layer of a
  # model, every candidate layout's cost): one search each. Keyed by repr: shardings compare
  # equal across meshes with other axis names, but a plan names the axes of its own mesh.
  key = (repr(src), repr(dst), tuple(int(s) for s in shape), dtype_size)
  plan = _PLAN_CACHE.get(key)
  if plan is None:
    if len(_PLAN_CACHE) >= 4096:
      _PLAN_CACHE.clear()
    plan = _PLAN_CACHE[key] = _plan_reshard(src, dst, shape, dtype_size)
  return plan


_PLAN_CACHE: dict = {}


def _plan_reshard(src, dst, shape, dtype_size: int) -> ReshardPlan:
  if isinstance(src, NamedSharding) and isinstance(dst, NamedSharding) and src.mesh != dst.mesh:
    return _plan_across_orders(src, dst, shape, dtype_size)
  planner = _Planner(src, dst, shape, dtype_size)
  best = planner.build(planner.search(), 'valley')
  refined = _Planner(src, dst, shape, dtype_size, refine=True)
  if (
    refined.mesh != planner.mesh
    and (refined.rank + 1) ** len(refined.axes) <= _MAX_REFINED_PLACEMENTS
  ):
    candidate = refined.build(refined.search(), 'valley')
    if _plan_key(candidate) < _plan_key(best):
      best = candidate
  return _no_more_collectives_than_even(best, src, dst, shape, dtype_size)


def collective_count(plan: ReshardPlan) -> int:
  """Collectives a plan runs: every step but local slices, a repad once per round."""
  return sum(
    len(s.rounds) if isinstance(s, Repad) else int(not isinstance(s, Slice)) for s in plan.steps
  )


def _no_more_collectives_than_even(best: ReshardPlan, src, dst, shape, dtype_size) -> ReshardPlan:
  """`best`, or the naive plan when best saves only padding with extra collectives.

  With short or empty shards (4 rows over 8 devices) the cheapest plan in
  bytes can gather the non-empty shards first, repad and gather again: three
  or more collectives where the naive plan runs one, to avoid receiving
  padding rows. The same reshard with every split dim padded to divide
  evenly moves as many bytes as that naive plan (its padding is real data
  there), so the naive plan is taken when it runs fewer collectives, moves no
  more bytes than that even reshard and stays within the memory bound: an
  uneven split then costs no more collectives than the even one.
  """
  padded = _evenly_padded(src, dst, shape)
  if padded == tuple(int(n) for n in shape):
    return best
  naive = naive_plan(src, dst, shape, dtype_size)
  if collective_count(naive) >= collective_count(best) or naive.peak_bytes > best.bound_bytes:
    return best
  even = plan_reshard(src, dst, padded, dtype_size)
  return naive if naive.bytes_moved <= even.bytes_moved else best


def _evenly_padded(src: NamedSharding, dst: NamedSharding, shape) -> tuple:
  """`shape` with each dim rounded up to a multiple of the devices splitting it in src or dst."""
  out = []
  for d, n in enumerate(shape):
    axes = set(src.spec.axes_of(d)) | set(dst.spec.axes_of(d))
    k = src.mesh.axes_size(tuple(axes))
    out.append(_ceil(int(n), k) * k)
  return tuple(out)


def _plan_across_orders(src: NamedSharding, dst: NamedSharding, shape, dtype_size) -> ReshardPlan:
  """A plan between two device orders of one mesh (same axis names and sizes).

  The layouts differ in spec and in which device holds which piece. The plan
  runs on one order and moves whole shards once, as a `Permute` (a
  collective-permute; each device receives at most one shard, so no buffer
  exceeds max(source, target)): either first (the source's spec onto the
  target's order, then plan there) or last (plan to the target's spec on the
  source's order, then move). The one moving fewer bytes wins: the smaller
  shard moves. Devices that already hold their piece in the other order (all
  of them when the orders agree on the axes the layout uses) receive nothing.
  """
  if not dst.mesh.is_reordering_of(src.mesh):
    raise ValueError(
      f'plan_reshard: source {src!r} and target {dst!r} use different meshes, not two '
      'device orders of one mesh (same axis names and sizes, same devices).'
    )
  shape = tuple(int(s) for s in shape)
  candidates = []
  src_there = _same_spec_on(src, dst.mesh)
  inner = plan_reshard(src_there, dst, shape, dtype_size)
  candidates.append(_with_reorder(inner, src, dst, _reorder_step(src, src_there, shape), True))
  dst_here = _same_spec_on(dst, src.mesh)
  inner = plan_reshard(src, dst_here, shape, dtype_size)
  candidates.append(_with_reorder(inner, src, dst, _reorder_step(dst_here, dst, shape), False))
  return min(candidates, key=_plan_key)


def _same_spec_on(s: NamedSharding, mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, s.spec, s.partial_axes, s.partial or 'sum')


def _with_reorder(inner: ReshardPlan, src, dst, step, first: bool) -> ReshardPlan:
  steps = inner.steps
  if step is not None and first:
    steps = _merge_permutes(step, steps[0]) + steps[1:] if steps else (step,)
  elif step is not None:
    steps = steps[:-1] + _merge_permutes(steps[-1], step) if steps else (step,)
  return ReshardPlan(
    src, dst, inner.shape, inner.dtype_size, steps, inner.bound_bytes, inner.strategy, inner.mesh
  )


def _merge_permutes(a, b) -> tuple:
  """(a, b) as steps; one Permute when both are permutes (a then b moves each buffer once)."""
  if not (isinstance(a, Permute) and isinstance(b, Permute)):
    return (a, b)
  sender_a, sender_b = dict((t, s) for s, t in a.pairs), dict((t, s) for s, t in b.pairs)
  devices = sorted(set(sender_a) | set(sender_b))
  pairs = []
  for d in devices:  # d ends with the buffer that a's step gave the device b takes from
    via = sender_b.get(d, d)
    origin = sender_a.get(via, via)
    if origin != d:
      pairs.append((origin, d))
  if not pairs:
    return ()
  return (Permute(tuple(pairs), a.from_axes, b.to_axes, a.shape_in),)


def _reorder_step(src: NamedSharding, dst: NamedSharding, shape):
  """The Permute taking `src`'s shards to the devices that hold them in `dst` (same spec)."""
  pairs = reorder_pairs(src, dst)
  if not pairs:
    return None
  axes = tuple(src.spec.axes_of(d) for d in range(len(shape)))
  return Permute(pairs, axes, axes, tuple(src.shard_shape(shape)))


def reorder_pairs(src: NamedSharding, dst: NamedSharding) -> tuple:
  """(sender, receiver) pairs moving whole shards from `src`'s device order to `dst`'s.

  Both have the same spec and pending-reduction axes on two orders of one mesh.
  A device's piece is its tile index and its place among the partial terms; a
  device that holds its piece already receives nothing, and each sender sends
  once (the pairs are a partial permutation).
  """

  def piece(s, device):
    return s.tile_index(device), s.mesh.linear_index(device, s.partial_axes)

  devices = src.mesh.devices
  have = {d: piece(src, d) for d in devices}
  want = {d: piece(dst, d) for d in devices}
  senders = {}
  for d in devices:
    if have[d] != want[d]:
      senders.setdefault(have[d], []).append(d)
  return tuple((senders[want[d]].pop(0), d) for d in devices if have[d] != want[d])


def _plan_key(plan: ReshardPlan):
  return plan.bytes_moved, plan.peak_bytes, len(plan.steps)


# Planning on factor sub-axes enumerates (rank+1)**axes placements for permutes;
# above this many it is skipped (the plain plan is still optimal over whole axes).
_MAX_REFINED_PLACEMENTS = 2048


def refined_mesh(mesh: Mesh):
  """`mesh` with every composite axis split into prime-factor sub-axes, and the split.

  Axis 'y' of size 4 becomes 'y#0' (major) and 'y#1' (minor), both of size 2:
  the same devices in the same row-major order, so a dim split over y is the
  same layout as one split over ('y#0', 'y#1'). Planning on sub-axes finds
  plans such as an all-to-all over half of an axis. Returns (mesh, {axis:
  sub-axes}); the mesh itself when no axis is composite or a name would clash.
  """
  names, sizes, parts = [], [], {}
  for a in mesh.axis_names:
    factors = _prime_factors(mesh.axis_size(a))
    sub = (a,) if len(factors) <= 1 else tuple(f'{a}#{i}' for i in range(len(factors)))
    names += sub
    sizes += factors if len(factors) > 1 else [mesh.axis_size(a)]
    parts[a] = sub
  new_names = [n for sub in parts.values() if len(sub) > 1 for n in sub]
  if not new_names or set(new_names) & set(mesh.axis_names):
    return mesh, {a: (a,) for a in mesh.axis_names}
  return Mesh(mesh.device_ids.reshape(sizes), names), parts


def _prime_factors(n: int) -> list:
  out, p = [], 2
  while p * p <= n:
    while n % p == 0:
      out.append(p)
      n //= p
    p += 1
  return out + ([n] if n > 1 else [])


def naive_plan(
  src: NamedSharding, dst: NamedSharding, shape: Sequence[int], dtype_size: int = 4
) -> ReshardPlan:
  """All-reduce pending reductions, all-gather every dim to replicated, then slice."""
  planner = _Planner(src, dst, shape, dtype_size)
  return planner.build(planner.naive_path(), 'naive')


# --- planner -------------------------------------------------------------------------------
_PHASE_SLICE, _PHASE_MIDDLE, _PHASE_GATHER, _PHASE_RESLICE = 0, 1, 2, 3


class _Planner:
  """Search state: (dims, partial, phase); dims[d] = (axes, levels)."""

  def __init__(self, src, dst, shape, dtype_size, refine=False):
    for name, s in (('src', src), ('dst', dst)):
      if not isinstance(s, NamedSharding):
        raise TypeError(f'plan_reshard: {name} must be a NamedSharding, got {s!r}.')
    if src.mesh != dst.mesh:
      raise ValueError(f'plan_reshard: source {src!r} and target {dst!r} use different meshes.')
    shape = tuple(int(s) for s in shape)
    src.check_shape(shape, 'plan_reshard source')
    dst.check_shape(shape, 'plan_reshard target')
    if any(s < 0 for s in shape):
      raise ValueError(f'plan_reshard: negative size in shape {shape}.')
    mesh, parts = refined_mesh(src.mesh) if refine else (src.mesh, None)
    self.src, self.dst, self.mesh = src, dst, mesh
    self.shape, self.rank, self.dtype_size = shape, len(shape), int(dtype_size)
    self.size = mesh.shape
    big = [a for a in mesh.axis_names if self.size[a] > 1]  # size-1 axes change nothing

    def plan_axes(axes):  # the planning mesh's (sub-)axes, size-1 ones dropped
      return tuple(s for a in axes for s in (parts[a] if parts else (a,)) if s in big)

    self.axis_order = {a: i for i, a in enumerate(mesh.axis_names)}
    self.src_axes = tuple(plan_axes(src.spec.axes_of(d)) for d in range(self.rank))
    self.dst_axes = tuple(plan_axes(dst.spec.axes_of(d)) for d in range(self.rank))
    src_partial = frozenset(plan_axes(src.partial_axes))
    goal_partial = frozenset(plan_axes(dst.partial_axes))
    if not goal_partial <= src_partial or (goal_partial and src.partial != dst.partial):
      raise ValueError(
        f'plan_reshard: target {dst} holds a pending reduction the source {src} does not; '
        f'a reshard can resolve pending reductions but not create them.'
      )
    self.src_partial, self.goal_partial = src_partial, goal_partial
    self.op = src.partial or 'sum'
    self.src_dim = {a: d for d, axes in enumerate(self.src_axes) for a in axes}
    self.dst_dim = {a: d for d, axes in enumerate(self.dst_axes) for a in axes}
    self.axes = big
    self.start = (
      tuple(
        (axes, canonical_levels(n, self._count(axes))) for axes, n in zip(self.src_axes, shape)
      ),
      src_partial,
      _PHASE_SLICE,
    )
    self.goal_levels = tuple(
      canonical_levels(n, self._count(axes)) for axes, n in zip(self.dst_axes, shape)
    )
    self.bound_elems = self._bound_elems()
    self._specs_by_counts = None

  # --- geometry helpers ---------------------------------------------------------------
  def _count(self, axes) -> int:
    return _prod(self.size[a] for a in axes)

  def _local_shape(self, dims) -> tuple:
    return tuple(levels_chunk(n, lv) for n, (_, lv) in zip(self.shape, dims))

  def _bound_elems(self) -> int:
    padded = []
    for d, n in enumerate(self.shape):
      k = self._count(set(self.src_axes[d]) | set(self.dst_axes[d]))
      padded.append(_ceil(n, k) * k)
    src = _prod(p // self._count(a) for p, a in zip(padded, self.src_axes))
    dst = _prod(p // self._count(a) for p, a in zip(padded, self.dst_axes))
    return max(src, dst)

  def _is_goal(self, state) -> bool:
    dims, partial, _ = state
    return partial == self.goal_partial and all(
      axes == goal_axes and same_layout(n, lv, goal_lv)
      for (axes, lv), goal_axes, goal_lv, n in zip(
        dims, self.dst_axes, self.goal_levels, self.shape
      )
    )

  def _specs(self):
    """Every placement of the mesh axes on the dims (any dim, any order), by per-dim counts."""
    if self._specs_by_counts is None:
      axes = self.axes
      table = {}
      for where in itertools.product([None] + list(range(self.rank)), repeat=len(axes)):
        per_dim = [[a for a, w in zip(axes, where) if w == d] for d in range(self.rank)]
        for orders in itertools.product(*[itertools.permutations(p) for p in per_dim]):
          counts = tuple(self._count(o) for o in orders)
          table.setdefault(counts, []).append(tuple(orders))
      self._specs_by_counts = table
    return self._specs_by_counts

  # --- moves ------------------------------------------------------------------------------
  def _effect(self, state, move):
    """(new_state, received elems per device (max), peak elems, details) or None if invalid."""
    dims, partial, phase = state
    kind = move[0]
    shape_in = self._local_shape(dims)
    e_in = _elems(shape_in)
    if kind in ('slice', 'reduce_scatter'):
      _, d, axes = move
      g = self._count(axes)
      n, (cur_axes, lv) = self.shape[d], dims[d]
      chunk = levels_chunk(n, lv)
      new_chunk = _ceil(chunk, g)
      new_dims = _replace(dims, d, (cur_axes + axes, normalize_levels(lv + ((g, new_chunk),))))
      shape_out = _set(shape_in, {d: new_chunk})
      if kind == 'slice':  # a windowed slice: no buffer larger than its input
        new_phase = _PHASE_RESLICE if phase >= _PHASE_GATHER else phase
        return (new_dims, partial, new_phase), 0, e_in, (shape_in, shape_out)
      padded = _elems(_set(shape_in, {d: g * new_chunk}))  # equal pieces for the collective
      recv = (g - 1) * _elems(shape_out)
      return (
        (new_dims, partial - set(axes), phase),
        recv,
        max(e_in, padded),
        (g * new_chunk, shape_in, shape_out),
      )
    if kind == 'all_reduce':
      g = self._count(move[1])
      return ((dims, partial - set(move[1]), phase), 2 * (g - 1) * _ceil(e_in, g), e_in, shape_in)
    if kind == 'all_gather':
      _, d, axes = move
      g = self._count(axes)
      n, (cur_axes, lv) = self.shape[d], dims[d]
      split = split_trailing(lv, g)
      if split is None:
        return None
      prefix, blocks = split
      out_chunk = levels_chunk(n, prefix)
      new_dims = _replace(dims, d, (cur_axes[: -len(axes)], normalize_levels(prefix)))
      shape_out = _set(shape_in, {d: out_chunk})
      peak = max(e_in * g, _elems(shape_out))
      return (
        (new_dims, partial, _PHASE_GATHER),
        (g - 1) * e_in,
        peak,
        (blocks, out_chunk, shape_in, shape_out),
      )
    if kind == 'all_to_all':
      _, s, c, axes = move
      g = self._count(axes)
      (s_axes, s_lv), (c_axes, c_lv) = dims[s], dims[c]
      split = split_trailing(c_lv, g)
      if split is None:
        return None
      prefix, blocks = split
      out_chunk = levels_chunk(self.shape[c], prefix)
      s_chunk = _ceil(levels_chunk(self.shape[s], s_lv), g)
      new_dims = _replace(dims, s, (s_axes + axes, normalize_levels(s_lv + ((g, s_chunk),))))
      new_dims = _replace(new_dims, c, (c_axes[: -len(axes)], normalize_levels(prefix)))
      padded = _elems(_set(shape_in, {s: g * s_chunk}))
      shape_out = _set(shape_in, {s: s_chunk, c: out_chunk})
      peak = max(e_in, padded, _elems(shape_out))
      return (
        (new_dims, partial, _PHASE_MIDDLE),
        (g - 1) * (padded // g),
        peak,
        (g * s_chunk, blocks, out_chunk, shape_in, shape_out),
      )
    if kind == 'permute':
      new_axes = move[1]
      new_dims = tuple((a, lv) for a, (_, lv) in zip(new_axes, dims))
      return (new_dims, partial, _PHASE_MIDDLE), e_in, e_in, shape_in
    if kind == 'repad':
      _, d, new_lv = move
      n, (axes, lv) = self.shape[d], dims[d]
      local, rounds, rows = _repad_exchange(n, lv, new_lv)
      row = _elems(_set(shape_in, {d: 1}))
      shape_out = _set(shape_in, {d: levels_chunk(n, new_lv)})
      peak = max(e_in, _elems(shape_out))
      new_phase = _PHASE_MIDDLE if phase <= _PHASE_MIDDLE else phase
      return (
        (_replace(dims, d, (axes, new_lv)), partial, new_phase),
        rows * row,
        peak,
        (local, rounds, shape_in, shape_out),
      )
    raise AssertionError(f'unknown move {move!r}')

  def _moves(self, state):
    dims, partial, phase = state
    used = {a for axes, _ in dims for a in axes}
    free = [a for a in self.axes if a not in used and a not in partial]
    # Slices belong to the valley's first phase; later ones count as non-valley
    # steps (see search) and win only when strictly cheaper.
    for d in range(self.rank):
      for axes in _ordered_subsets([a for a in free if self.dst_dim.get(a) == d]):
        yield ('slice', d, axes)
    if phase <= _PHASE_MIDDLE:
      reducible = sorted(partial - self.goal_partial, key=self.axis_order.get)
      for d in range(self.rank):
        for axes in _ordered_subsets([a for a in reducible if self.dst_dim.get(a) == d]):
          yield ('reduce_scatter', d, axes)
      for r in range(1, len(reducible) + 1):
        for axes in itertools.combinations(reducible, r):
          yield ('all_reduce', axes)
      for c, (c_axes, _) in enumerate(dims):
        for length in range(1, len(c_axes) + 1):
          axes = c_axes[-length:]
          targets = {self.dst_dim.get(a) for a in axes}
          if len(targets) == 1 and None not in targets and c not in targets:
            yield ('all_to_all', targets.pop(), c, axes)
      cur = tuple(axes for axes, _ in dims)
      for spec in self._specs().get(tuple(self._count(a) for a in cur), ()):
        if spec != cur and not any(a in partial for axes in spec for a in axes):
          yield ('permute', spec)
    for d, (axes, lv) in enumerate(dims):
      for new_lv in self._repad_targets(d, axes):
        if new_lv != lv:  # the same layout under other levels is a free relabel
          yield ('repad', d, new_lv)
    if phase <= _PHASE_GATHER and partial == self.goal_partial:
      for d, (axes, _) in enumerate(dims):
        for length in range(1, len(axes) + 1):
          yield ('all_gather', d, axes[-length:])

  def _repad_targets(self, d, axes):
    """Geometries worth re-laying dim d out to: flat over its axes, and target-refined.

    Target-refined (when the target's axes are a prefix of the current ones):
    the target's flat level, then one level for the extra minor axes, so that
    gathering those axes yields exactly the target shards.
    """
    n, goal = self.shape[d], self.dst_axes[d]
    options = {canonical_levels(n, self._count(axes))}
    if len(axes) > len(goal) and axes[: len(goal)] == goal:
      kt, ke = self._count(goal), self._count(axes[len(goal) :])
      options.add(normalize_levels(canonical_levels(n, kt) + ((ke, _ceil(_ceil(n, kt), ke)),)))
    return sorted(options)

  def search(self):
    """Dijkstra over layouts; cost = (bytes received, non-valley steps, steps, elements
    copied by all-gathers off the leading dim)."""
    start = self.start
    best = {start: (0, 0, 0, 0)}
    parent = {start: None}
    heap = [((0, 0, 0, 0), 0, start)]
    tie = itertools.count(1)
    while heap:
      cost, _, state = heapq.heappop(heap)
      if best.get(state) != cost:
        continue
      if self._is_goal(state):
        return self._path(parent, state)
      for move in self._moves(state):
        effect = self._effect(state, move)
        if effect is None:
          continue
        new_state, recv, peak, _ = effect
        if peak > self.bound_elems:
          continue
        nonvalley = 1 if move[0] == 'slice' and state[2] != _PHASE_SLICE else 0
        new_cost = (
          cost[0] + recv * self.dtype_size,
          cost[1] + nonvalley,
          cost[2] + 1,
          cost[3] + _gather_copy_elems(move, effect[3]),
        )
        if new_cost < best.get(new_state, (math.inf,)):
          best[new_state] = new_cost
          parent[new_state] = (state, move)
          heapq.heappush(heap, (new_cost, next(tie), new_state))
    raise ValueError(
      f'plan_reshard: no plan from {self.src} to {self.dst} for shape {self.shape} on '
      f'{self.mesh} keeps every buffer within {self.bound_elems * self.dtype_size} bytes.'
    )

  @staticmethod
  def _path(parent, state):
    moves = []
    while parent[state] is not None:
      state, move = parent[state]
      moves.append(move)
    return moves[::-1]

  def naive_path(self):
    moves = []
    reducible = sorted(self.src_partial - self.goal_partial, key=self.axis_order.get)
    if reducible:
      moves.append(('all_reduce', tuple(reducible)))
    moves += [('all_gather', d, axes) for d, axes in enumerate(self.src_axes) if axes]
    moves += [('slice', d, axes) for d, axes in enumerate(self.dst_axes) if axes]
    return moves

  # --- concrete steps -----------------------------------------------------------------
  def build(self, moves, strategy) -> ReshardPlan:
    state, steps = self.start, []
    for move in moves:
      effect = self._effect(state, move)
      if effect is None:
        raise AssertionError(f'plan_reshard: move {move} does not apply to {state}')
      new_state, _, _, details = effect
      step = self._step(state, move, details)
      if step is not None:
        steps.append(step)
      state = new_state
    if not self._is_goal(state):
      raise AssertionError(f'plan_reshard: {strategy} plan ends in {state}, not the target')
    return ReshardPlan(
      self.src,
      self.dst,
      self.shape,
      self.dtype_size,
      tuple(steps),
      self.bound_elems * self.dtype_size,
      strategy,
      self.mesh,
    )

  def _step(self, state, move, details):
    dims, partial, _ = state
    kind = move[0]
    if kind == 'slice':
      shape_in, shape_out = details
      return Slice(move[1], move[2], shape_out[move[1]], shape_in, shape_out)
    if kind == 'reduce_scatter':
      padded, shape_in, shape_out = details
      return ReduceScatter(
        move[1], move[2], self.op, self._count(move[2]), padded, shape_in, shape_out
      )
    if kind == 'all_reduce':
      return AllReduce(move[1], self.op, self._count(move[1]), details)
    if kind == 'all_gather':
      blocks, out_chunk, shape_in, shape_out = details
      return AllGather(
        move[1], move[2], self._count(move[2]), blocks, out_chunk, shape_in, shape_out
      )
    if kind == 'all_to_all':
      split_padded, blocks, out_chunk, shape_in, shape_out = details
      return AllToAll(
        move[1],
        move[2],
        move[3],
        self._count(move[3]),
        split_padded,
        blocks,
        out_chunk,
        shape_in,
        shape_out,
      )
    if kind == 'permute':
      pairs = self._permute_pairs(dims, move[1], partial)
      if not pairs:
        return None
      return Permute(pairs, tuple(a for a, _ in dims), move[1], details)
    if kind == 'repad':
      if same_layout(self.shape[move[1]], dims[move[1]][1], move[2]):
        return None  # same rows in the same places: only the bookkeeping changes
      return self._repad_step(dims, move[1], move[2], details)
    raise AssertionError(kind)

  def _permute_pairs(self, dims, new_axes, partial):
    """A device permutation, most devices keeping their buffer, that realizes the new axes."""
    partial_axes = tuple(sorted(partial, key=self.axis_order.get))

    def piece(axes_per_dim, device):
      return tuple(self.mesh.linear_index(device, axes) for axes in axes_per_dim) + (
        self.mesh.linear_index(device, partial_axes),
      )

    old_axes = tuple(a for a, _ in dims)
    have = {d: piece(old_axes, d) for d in self.mesh.devices}
    want = {d: piece(new_axes, d) for d in self.mesh.devices}
    senders = {}
    for d in self.mesh.devices:
      if have[d] != want[d]:
        senders.setdefault(have[d], []).append(d)
    pairs = []
    for d in self.mesh.devices:
      if have[d] != want[d]:
        pool = senders.get(want[d])
        if not pool:
          raise AssertionError(f'permute: no device holds piece {want[d]} for device {d}')
        pairs.append((pool.pop(0), d))
    return tuple(pairs)

  def _repad_step(self, dims, d, new_lv, details):
    local, rounds, shape_in, shape_out = details
    axes = dims[d][0]
    groups = self.mesh.groups(axes)
    local_table = tuple((g[shard], src, dst, ln) for g in groups for shard, src, dst, ln in local)
    built = []
    for size, items in rounds:
      pairs = tuple((g[s], g[t]) for g in groups for s, t, _, _, _, _ in items)
      sends = tuple((g[s], start) for g in groups for s, _, start, _, _, _ in items)
      recvs = tuple((g[t], mo, do, ln) for g in groups for _, t, _, mo, do, ln in items)
      built.append(RepadRound(size, pairs, sends, recvs))
    return Repad(d, axes, dims[d][1], new_lv, local_table, tuple(built), shape_in, shape_out)


def _replace(dims, d, value):
  return dims[:d] + (value,) + dims[d + 1 :]


def _ordered_subsets(items):
  for r in range(1, len(items) + 1):
    yield from itertools.permutations(items, r)
