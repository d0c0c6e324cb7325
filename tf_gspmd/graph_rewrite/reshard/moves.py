"""The reshard search's moves: one class per kind of step, with its effect, cost and lowering data.

A route is a list of steps; each kind of step is one frozen dataclass: `Slice`,
`AllGather`, `AllToAll`, `ReduceScatter` and `AllReduce` here, `Permute` and
`Repad` (exchanges between devices) in `reshard.exchange`, all subclasses of
`Step`. A class holds everything about its kind:

- which moves of its kind a state allows (`choices`), as plain tuples of
  what the move picks (a dim and axes, say);
- what a move does to the state and what it costs (`effect`): the new
  `SearchState`, the elements the busiest device receives and the largest buffer;
- the concrete step a move becomes in a route (`build`): the instance's fields
  are exactly what a lowering needs (`graph_rewrite.lower_reshard` turns each
  class into ops; `reshard.sim` runs it on numpy arrays);
- per-device costs of a built step (`received_elems`, `peak_elems`).

The search (`reshard.search`) asks every class in its `MOVE_KINDS` for its
moves and never looks inside one; what a move needs of the search (the shape, the
target's axes, the mesh, ...) it reads from a `SearchContext`.

Layouts work in mesh-axis terms: per tensor dim an ordered tuple of mesh axes
(major to minor) with the dim's geometry (`reshard.geometry`), the set of axes
holding a pending reduction, and the phase of the valley route (local slices
and reductions first, then all-to-alls, permutes and repads, then gathers).

Costs are per device and assume bandwidth-optimal algorithms: all-gather and
all-to-all receive (g-1) blocks, reduce-scatter (g-1) pieces of the output
size, all-reduce 2(g-1) pieces of ceil(E/g) elements (ring reduce-scatter +
all-gather), a permute the whole buffer on devices that get a new one, a
repad the fixed-size messages of the rounds the device receives in.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import (
  ClassVar,
  Dict,
  FrozenSet,
  Iterator,
  List,
  Mapping,
  NamedTuple,
  Optional,
  Protocol,
  Sequence,
  Tuple,
  Type,
)

from tf_gspmd.graph_rewrite.reshard.geometry import (
  Levels,
  ceil_div,
  elems,
  levels_chunk,
  normalize_levels,
  split_trailing,
  with_sizes,
)
from tf_gspmd.mesh import Mesh

Axes = Tuple[str, ...]
DimLayout = Tuple[Axes, Levels]  # a dim's mesh axes (major to minor) and geometry
Dims = Tuple[DimLayout, ...]

# Phases of a valley route. A slice after the first phase, or a repad after the gathers,
# is allowed but moves the state out of the valley's order.
PHASE_SLICE, PHASE_MIDDLE, PHASE_GATHER, PHASE_RESLICE = 0, 1, 2, 3


class SearchState(NamedTuple):
  """A search state: per-dim (axes, levels), the axes with a pending reduction, the phase."""

  dims: Dims
  partial: FrozenSet[str]
  phase: int


class Effect(NamedTuple):
  """What a move does: the state after it, elements the busiest device receives, the
  largest buffer any device holds, and what `build` needs beyond the move's choice."""

  state: SearchState
  received: int
  peak: int
  details: tuple


class SearchContext(Protocol):
  """What moves ask of the search about the reshard being routed."""

  shape: Tuple[int, ...]
  rank: int
  mesh: Mesh
  op: str  # the pending reduction's op
  axes: List[str]  # the search mesh's axes of size > 1, in mesh order
  axis_order: Dict[str, int]
  dst_axes: Tuple[Axes, ...]
  dst_dim: Dict[str, int]  # target dim of each axis the target shards over
  goal_partial: FrozenSet[str]

  def count(self, axes: Sequence[str]) -> int: ...

  def local_shape(self, dims: Dims) -> tuple: ...

  def placements(self) -> Mapping[tuple, List[Tuple[Axes, ...]]]: ...


def fmt_axes(axes: Sequence[str]) -> str:
  return '(' + ','.join(axes) + ')'


def replace_dim(dims: Dims, d: int, value: DimLayout) -> Dims:
  return dims[:d] + (value,) + dims[d + 1 :]


def _ordered_subsets(items: Sequence[str]) -> Iterator[Axes]:
  for r in range(1, len(items) + 1):
    yield from itertools.permutations(items, r)


def _onto_target_dims(ctx: SearchContext, candidates: Sequence[str]) -> Iterator[tuple]:
  """(dim, axes): every ordered choice of `candidates` the target puts on one dim, per dim."""
  for d in range(ctx.rank):
    for axes in _ordered_subsets([a for a in candidates if ctx.dst_dim.get(a) == d]):
      yield (d, axes)


def _free_axes(ctx: SearchContext, state: SearchState) -> List[str]:
  """Axes neither splitting a dim nor holding a pending reduction."""
  used = {a for axes, _ in state.dims for a in axes}
  return [a for a in ctx.axes if a not in used and a not in state.partial]


def _reducible(ctx: SearchContext, state: SearchState) -> List[str]:
  """Axes whose pending reduction the target resolves, in mesh order."""
  return sorted(state.partial - ctx.goal_partial, key=ctx.axis_order.__getitem__)


def _split(ctx: SearchContext, dims: Dims, d: int, axes: Axes) -> Tuple[Dims, int]:
  """Dim d split further over `axes` (a new minor level): the new dims and local rows."""
  cur_axes, lv = dims[d]
  g = ctx.count(axes)
  new_chunk = ceil_div(levels_chunk(ctx.shape[d], lv), g)
  return replace_dim(
    dims, d, (cur_axes + axes, normalize_levels(lv + ((g, new_chunk),)))
  ), new_chunk


def _unsplit(ctx: SearchContext, dims: Dims, d: int, axes: Axes):
  """Dim d with its trailing `axes` gathered: (new dims, blocks, out chunk), or None when
  the geometry's trailing levels do not match the group (see `split_trailing`)."""
  cur_axes, lv = dims[d]
  split = split_trailing(lv, ctx.count(axes))
  if split is None:
    return None
  prefix, blocks = split
  new_dims = replace_dim(dims, d, (cur_axes[: -len(axes)], normalize_levels(prefix)))
  return new_dims, blocks, levels_chunk(ctx.shape[d], prefix)


class Step:
  """A kind of move; its instances are the concrete steps of a route.

  Subclasses are frozen dataclasses whose fields are what a lowering needs.
  """

  kind: ClassVar[str]  # the name routes count steps by (`ReshardRoute.collective_counts`)
  shape_in: tuple
  shape_out: tuple

  @classmethod
  def choices(cls, ctx: SearchContext, state: SearchState) -> Iterator[tuple]:
    """The moves of this kind worth trying from `state`."""
    raise NotImplementedError

  @classmethod
  def effect(cls, ctx: SearchContext, state: SearchState, choice: tuple) -> Optional[Effect]:
    """The move's effect, or None when it does not apply to `state`."""
    raise NotImplementedError

  @classmethod
  def build(cls, ctx: SearchContext, state: SearchState, choice: tuple, details: tuple):
    """The step the move becomes in a route, or None when it moves nothing."""
    raise NotImplementedError

  @classmethod
  def off_valley(cls, state: SearchState) -> bool:
    """Whether the move breaks the valley order (counted, so valley routes win ties)."""
    return False

  @classmethod
  def copy_elems(cls, details: tuple) -> int:
    """Elements copied locally after the collective (the search's last tie-break)."""
    return 0

  def received_elems(self, device: int) -> int:
    raise NotImplementedError

  @property
  def peak_elems(self) -> int:
    raise NotImplementedError

  def describe(self) -> str:
    raise NotImplementedError


class Move(NamedTuple):
  """One move of the search: its kind and what it picks (arguments of the kind's methods)."""

  kind: Type[Step]
  choice: tuple

  def effect(self, ctx: SearchContext, state: SearchState) -> Optional[Effect]:
    return self.kind.effect(ctx, state, self.choice)


# --- local ---------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Slice(Step):
  """Local dynamic slice: keep rows [idx*chunk, idx*chunk + chunk) of `dim`, padded.

  idx is this partition's row-major index along `axes`. No padding of the
  input is needed: with L rows in the buffer, take the window of `chunk` rows
  at start = min(idx*chunk, L - chunk) and roll it up by idx*chunk - start, so
  the wanted rows come first and rows past the end of the buffer land in the
  shard's padding (`geometry.slice_window` computes start and shift).
  """

  kind: ClassVar[str] = 'slice'
  dim: int
  axes: tuple
  chunk: int
  shape_in: tuple
  shape_out: tuple

  @classmethod
  def choices(cls, ctx, state):
    # Only target axes, onto their target dim. Slices belong to the valley's first
    # phase; later ones count as off-valley and win only when strictly cheaper.
    yield from _onto_target_dims(ctx, _free_axes(ctx, state))

  @classmethod
  def effect(cls, ctx, state, choice):
    d, axes = choice
    shape_in = ctx.local_shape(state.dims)
    new_dims, new_chunk = _split(ctx, state.dims, d, axes)
    phase = PHASE_RESLICE if state.phase >= PHASE_GATHER else state.phase
    shape_out = with_sizes(shape_in, {d: new_chunk})
    # A windowed slice: no buffer larger than its input.
    return Effect(
      SearchState(new_dims, state.partial, phase), 0, elems(shape_in), (shape_in, shape_out)
    )

  @classmethod
  def build(cls, ctx, state, choice, details):
    d, axes = choice
    shape_in, shape_out = details
    return cls(d, axes, shape_out[d], shape_in, shape_out)

  @classmethod
  def off_valley(cls, state):
    return state.phase != PHASE_SLICE

  def received_elems(self, device: int) -> int:
    return 0

  @property
  def peak_elems(self) -> int:
    return max(elems(self.shape_in), elems(self.shape_out))

  def describe(self) -> str:
    return f'slice dim={self.dim} axes={fmt_axes(self.axes)}'


# --- reductions ----------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ReduceScatter(Step):
  """pad `dim` to `padded`; reduce_scatter(x, axes, dim, op)."""

  kind: ClassVar[str] = 'reduce_scatter'
  dim: int
  axes: tuple
  op: str
  group_size: int
  padded: int
  shape_in: tuple
  shape_out: tuple

  @classmethod
  def choices(cls, ctx, state):
    # Onto the dim the target shards over the reduced axes.
    if state.phase > PHASE_MIDDLE:
      return
    yield from _onto_target_dims(ctx, _reducible(ctx, state))

  @classmethod
  def effect(cls, ctx, state, choice):
    d, axes = choice
    g = ctx.count(axes)
    shape_in = ctx.local_shape(state.dims)
    new_dims, new_chunk = _split(ctx, state.dims, d, axes)
    shape_out = with_sizes(shape_in, {d: new_chunk})
    padded = elems(with_sizes(shape_in, {d: g * new_chunk}))  # equal pieces for the collective
    return Effect(
      SearchState(new_dims, state.partial - set(axes), state.phase),
      (g - 1) * elems(shape_out),
      max(elems(shape_in), padded),
      (g * new_chunk, shape_in, shape_out),
    )

  @classmethod
  def build(cls, ctx, state, choice, details):
    d, axes = choice
    padded, shape_in, shape_out = details
    return cls(d, axes, ctx.op, ctx.count(axes), padded, shape_in, shape_out)

  def received_elems(self, device: int) -> int:
    return (self.group_size - 1) * elems(self.shape_out)

  @property
  def peak_elems(self) -> int:
    return max(elems(self.shape_in), elems(with_sizes(self.shape_in, {self.dim: self.padded})))

  def describe(self) -> str:
    return f'reduce_scatter dim={self.dim} axes={fmt_axes(self.axes)} op={self.op}'


@dataclasses.dataclass(frozen=True)
class AllReduce(Step):
  """all_reduce(x, axes, op)."""

  kind: ClassVar[str] = 'all_reduce'
  axes: tuple
  op: str
  group_size: int
  shape_in: tuple

  @classmethod
  def choices(cls, ctx, state):
    if state.phase > PHASE_MIDDLE:
      return
    reducible = _reducible(ctx, state)
    for r in range(1, len(reducible) + 1):
      for axes in itertools.combinations(reducible, r):
        yield (axes,)

  @classmethod
  def effect(cls, ctx, state, choice):
    (axes,) = choice
    g = ctx.count(axes)
    shape_in = ctx.local_shape(state.dims)
    e_in = elems(shape_in)
    new_state = SearchState(state.dims, state.partial - set(axes), state.phase)
    return Effect(new_state, 2 * (g - 1) * ceil_div(e_in, g), e_in, (shape_in,))

  @classmethod
  def build(cls, ctx, state, choice, details):
    (axes,) = choice
    return cls(axes, ctx.op, ctx.count(axes), details[0])

  @property
  def shape_out(self) -> tuple:  # type: ignore[override]
    return self.shape_in

  def received_elems(self, device: int) -> int:
    g = self.group_size
    return 2 * (g - 1) * ceil_div(elems(self.shape_in), g)

  @property
  def peak_elems(self) -> int:
    return elems(self.shape_in)

  def describe(self) -> str:
    return f'all_reduce axes={fmt_axes(self.axes)} op={self.op}'


# --- gathers -------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class AllGather(Step):
  """all_gather(x, axes, dim), then regroup_blocks(y, dim, blocks, out_chunk)."""

  kind: ClassVar[str] = 'all_gather'
  dim: int
  axes: tuple
  group_size: int
  blocks: tuple
  out_chunk: int
  shape_in: tuple
  shape_out: tuple

  @classmethod
  def choices(cls, ctx, state):
    # The last phase, once every pending reduction the target does not keep is resolved.
    if state.phase > PHASE_GATHER or state.partial != ctx.goal_partial:
      return
    for d, (axes, _) in enumerate(state.dims):
      for length in range(1, len(axes) + 1):
        yield (d, axes[-length:])

  @classmethod
  def effect(cls, ctx, state, choice):
    d, axes = choice
    unsplit = _unsplit(ctx, state.dims, d, axes)
    if unsplit is None:
      return None
    new_dims, blocks, out_chunk = unsplit
    shape_in = ctx.local_shape(state.dims)
    e_in, g = elems(shape_in), ctx.count(axes)
    shape_out = with_sizes(shape_in, {d: out_chunk})
    return Effect(
      SearchState(new_dims, state.partial, PHASE_GATHER),
      (g - 1) * e_in,
      max(e_in * g, elems(shape_out)),
      (d, blocks, out_chunk, shape_in, shape_out),
    )

  @classmethod
  def build(cls, ctx, state, choice, details):
    d, axes = choice
    _, blocks, out_chunk, shape_in, shape_out = details
    return cls(d, axes, ctx.count(axes), blocks, out_chunk, shape_in, shape_out)

  @classmethod
  def copy_elems(cls, details):
    """The gathered pieces arrive stacked in front of the dim and are transposed into place
    when a dim before it is not trivial. Between routes equal in bytes and steps this prefers
    gathering minor dims first, while the buffer is small, so the last and largest gather
    lands in place."""
    d, _, _, shape_in, shape_out = details
    return elems(shape_out) if elems(shape_in[:d]) > 1 else 0

  def received_elems(self, device: int) -> int:
    return (self.group_size - 1) * elems(self.shape_in)

  @property
  def peak_elems(self) -> int:
    return max(elems(self.shape_in) * self.group_size, elems(self.shape_out))

  def describe(self) -> str:
    return f'all_gather dim={self.dim} axes={fmt_axes(self.axes)}'


@dataclasses.dataclass(frozen=True)
class AllToAll(Step):
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

  @classmethod
  def choices(cls, ctx, state):
    # Minor axes of a dim, all bound for one other dim of the target.
    if state.phase > PHASE_MIDDLE:
      return
    for c, (c_axes, _) in enumerate(state.dims):
      for length in range(1, len(c_axes) + 1):
        axes = c_axes[-length:]
        targets = {ctx.dst_dim.get(a) for a in axes}
        if len(targets) == 1 and None not in targets and c not in targets:
          yield (targets.pop(), c, axes)

  @classmethod
  def effect(cls, ctx, state, choice):
    s, c, axes = choice
    unsplit = _unsplit(ctx, state.dims, c, axes)
    if unsplit is None:
      return None
    new_dims, blocks, out_chunk = unsplit
    new_dims, s_chunk = _split(ctx, new_dims, s, axes)
    g = ctx.count(axes)
    shape_in = ctx.local_shape(state.dims)
    padded = elems(with_sizes(shape_in, {s: g * s_chunk}))
    shape_out = with_sizes(shape_in, {s: s_chunk, c: out_chunk})
    return Effect(
      SearchState(new_dims, state.partial, PHASE_MIDDLE),
      (g - 1) * (padded // g),
      max(elems(shape_in), padded, elems(shape_out)),
      (g * s_chunk, blocks, out_chunk, shape_in, shape_out),
    )

  @classmethod
  def build(cls, ctx, state, choice, details):
    s, c, axes = choice
    split_padded, blocks, out_chunk, shape_in, shape_out = details
    return cls(s, c, axes, ctx.count(axes), split_padded, blocks, out_chunk, shape_in, shape_out)

  @property
  def _padded_elems(self) -> int:
    return elems(with_sizes(self.shape_in, {self.split_dim: self.split_padded}))

  def received_elems(self, device: int) -> int:
    return (self.group_size - 1) * (self._padded_elems // self.group_size)

  @property
  def peak_elems(self) -> int:
    return max(elems(self.shape_in), self._padded_elems, elems(self.shape_out))

  def describe(self) -> str:
    return (
      f'all_to_all axes={fmt_axes(self.axes)} split_dim={self.split_dim} '
      f'concat_dim={self.concat_dim}'
    )
