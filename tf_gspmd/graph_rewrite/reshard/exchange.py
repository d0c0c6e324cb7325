"""Moves that exchange whole buffers or rows between devices: `Permute` and `Repad`.

Like the kinds in `reshard.moves`, each class holds its moves' choices, effect,
cost and the data its lowering needs.
"""

from __future__ import annotations

import dataclasses
from functools import cached_property
from typing import ClassVar, Dict, List

from tf_gspmd.graph_rewrite.reshard.geometry import (
  Levels,
  canonical_levels,
  ceil_div,
  elems,
  levels_chunk,
  normalize_levels,
  repad_exchange,
  same_geometry,
  with_sizes,
)
from tf_gspmd.graph_rewrite.reshard.moves import (
  PHASE_MIDDLE,
  Axes,
  Effect,
  SearchContext,
  SearchState,
  Step,
  fmt_axes,
  replace_dim,
)


# --- exchanges between devices ---------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Permute(Step):
  """permute(x, pairs): device dst gets src's buffer; devices that are no dst keep theirs.

  `from_axes`/`to_axes` give the per-dim mesh axes before and after (same local shape).
  """

  kind: ClassVar[str] = 'permute'
  pairs: tuple
  from_axes: tuple
  to_axes: tuple
  shape_in: tuple

  @classmethod
  def choices(cls, ctx, state):
    # Any axis onto any dim with the same local shape: swapping two axes between dims
    # with one permute is often the cheapest move.
    if state.phase > PHASE_MIDDLE:
      return
    cur = tuple(axes for axes, _ in state.dims)
    for spec in ctx.placements().get(tuple(ctx.count(a) for a in cur), ()):
      if spec != cur and not any(a in state.partial for axes in spec for a in axes):
        yield (spec,)

  @classmethod
  def effect(cls, ctx, state, choice):
    (new_axes,) = choice
    new_dims = tuple((a, lv) for a, (_, lv) in zip(new_axes, state.dims))
    shape_in = ctx.local_shape(state.dims)
    e_in = elems(shape_in)
    return Effect(SearchState(new_dims, state.partial, PHASE_MIDDLE), e_in, e_in, (shape_in,))

  @classmethod
  def build(cls, ctx, state, choice, details):
    (new_axes,) = choice
    pairs = _permute_pairs(ctx, state, new_axes)
    if not pairs:
      return None
    return cls(pairs, tuple(a for a, _ in state.dims), new_axes, details[0])

  @property
  def shape_out(self) -> tuple:  # type: ignore[override]
    return self.shape_in

  @cached_property
  def destinations(self) -> frozenset:
    return frozenset(dst for _, dst in self.pairs)

  def received_elems(self, device: int) -> int:
    return elems(self.shape_in) if device in self.destinations else 0

  @property
  def peak_elems(self) -> int:
    return elems(self.shape_in)

  def describe(self) -> str:
    moves = [
      f'd{d}:{fmt_axes(a)}->{fmt_axes(b)}'
      for d, (a, b) in enumerate(zip(self.from_axes, self.to_axes))
      if a != b
    ]
    return f'permute {" ".join(moves) or "device order"} ({len(self.pairs)} pairs)'


def _permute_pairs(ctx: SearchContext, state: SearchState, new_axes) -> tuple:
  """A device permutation, most devices keeping their buffer, that realizes the new axes."""
  mesh = ctx.mesh
  partial_axes = tuple(sorted(state.partial, key=ctx.axis_order.__getitem__))

  def piece(axes_per_dim, device):
    return tuple(mesh.linear_index(device, axes) for axes in axes_per_dim) + (
      mesh.linear_index(device, partial_axes),
    )

  old_axes = tuple(a for a, _ in state.dims)
  have = {d: piece(old_axes, d) for d in mesh.devices}
  want = {d: piece(new_axes, d) for d in mesh.devices}
  senders: Dict[tuple, List[int]] = {}
  for d in mesh.devices:
    if have[d] != want[d]:
      senders.setdefault(have[d], []).append(d)
  pairs = []
  for d in mesh.devices:
    if have[d] != want[d]:
      pool = senders.get(want[d])
      if not pool:
        raise AssertionError(f'permute: no device holds piece {want[d]} for device {d}')
      pairs.append((pool.pop(0), d))
  return tuple(pairs)


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
class Repad(Step):
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

  @classmethod
  def choices(cls, ctx, state):
    for d, (axes, lv) in enumerate(state.dims):
      for new_lv in _repad_targets(ctx, d, axes):
        if new_lv != lv:  # the same state under other levels is a free relabel
          yield (d, new_lv)

  @classmethod
  def effect(cls, ctx, state, choice):
    d, new_lv = choice
    n, (axes, lv) = ctx.shape[d], state.dims[d]
    local, rounds, rows = repad_exchange(n, lv, new_lv)
    shape_in = ctx.local_shape(state.dims)
    row = elems(with_sizes(shape_in, {d: 1}))
    shape_out = with_sizes(shape_in, {d: levels_chunk(n, new_lv)})
    phase = PHASE_MIDDLE if state.phase <= PHASE_MIDDLE else state.phase
    return Effect(
      SearchState(replace_dim(state.dims, d, (axes, new_lv)), state.partial, phase),
      rows * row,
      max(elems(shape_in), elems(shape_out)),
      (local, rounds, shape_in, shape_out),
    )

  @classmethod
  def build(cls, ctx, state, choice, details):
    """The exchange's shard-level tables turned into device-level ones, group by group."""
    d, new_lv = choice
    axes, lv = state.dims[d]
    if same_geometry(ctx.shape[d], lv, new_lv):
      return None  # same rows in the same places: only the bookkeeping changes
    local, rounds, shape_in, shape_out = details
    groups = ctx.mesh.groups(axes)
    local_table = tuple((g[shard], src, dst, ln) for g in groups for shard, src, dst, ln in local)
    built = []
    for size, items in rounds:
      pairs = tuple((g[s], g[t]) for g in groups for s, t, _, _, _, _ in items)
      sends = tuple((g[s], start) for g in groups for s, _, start, _, _, _ in items)
      recvs = tuple((g[t], mo, do, ln) for g in groups for _, t, _, mo, do, ln in items)
      built.append(RepadRound(size, pairs, sends, recvs))
    return cls(d, axes, lv, new_lv, local_table, tuple(built), shape_in, shape_out)

  @cached_property
  def received_rows(self) -> Dict[int, int]:
    """device -> rows it receives over all rounds (a round's message counted once)."""
    rows: Dict[int, int] = {}
    for message in self.rounds:
      for device in {entry[0] for entry in message.recvs}:
        rows[device] = rows.get(device, 0) + message.size
    return rows

  def received_elems(self, device: int) -> int:
    return elems(with_sizes(self.shape_in, {self.dim: 1})) * self.received_rows.get(device, 0)

  @property
  def peak_elems(self) -> int:
    return max(elems(self.shape_in), elems(self.shape_out))

  def describe(self) -> str:
    return (
      f'repad dim={self.dim} axes={fmt_axes(self.axes)} {list(self.levels_in)}->'
      f'{list(self.levels_out)} ({len(self.rounds)} rounds)'
    )


def _repad_targets(ctx: SearchContext, d: int, axes: Axes) -> List[Levels]:
  """Geometries worth re-laying dim d out to: flat over its axes, and target-refined.

  Target-refined (when the target's axes are a prefix of the current ones):
  the target's flat level, then one level for the extra minor axes, so that
  gathering those axes yields exactly the target shards. The search puts such
  a repad at the bottom of the valley, where buffers are smallest.
  """
  n, goal = ctx.shape[d], ctx.dst_axes[d]
  options = {canonical_levels(n, ctx.count(axes))}
  if len(axes) > len(goal) and axes[: len(goal)] == goal:
    kt, ke = ctx.count(goal), ctx.count(axes[len(goal) :])
    refined = canonical_levels(n, kt) + ((ke, ceil_div(ceil_div(n, kt), ke)),)
    options.add(normalize_levels(refined))
  return sorted(options)
