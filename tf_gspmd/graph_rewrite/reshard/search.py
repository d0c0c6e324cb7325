"""The reshard search: which steps turn one sharding of a tensor into another.

`route_reshard(src, dst, shape)` returns a `ReshardRoute`: a list of steps (the
classes of `reshard.moves`) that `graph_rewrite.lower_reshard` maps onto a
collective interface whose methods take mesh axes (`all_gather(x, axes,
dim)`, `all_to_all(x, axes, split_dim, concat_dim)`, `reduce_scatter(x, axes,
dim, op)`, `all_reduce(x, axes, op)`, `permute(x, pairs)`) plus local ops
(pad, dynamic slice at this partition's row-major index along some axes,
reshape, static slice). Pure Python: no TensorFlow.

Search. Routes follow the memory-efficient "valley" form of Rink et al. 2021:
local slices and reductions first, then all-to-alls, permutes and repads, then
gathers, so buffers shrink, stay, then grow to the target. A Dijkstra search
over states (axes, geometry and pending reductions per dim, plus the phase)
finds the route with the fewest bytes received per device, then the fewest
non-valley steps, then the fewest steps, pruning any step whose buffers exceed
`bound_bytes` (see `ReshardRoute`). Which moves a state allows, and what each
does and costs, is up to the move's class (`moves.MOVE_KINDS`). Pending
reductions become reduce-scatters onto the dim the target shards over that
axis, or all-reduces (after slicing, on the smaller buffer). Slicing later
(after an all-to-all, or after gathers as the naive route does) is explored too
but wins only when strictly cheaper; with uneven sizes that happens for tiny
dims where padding dominates. When every dim divides evenly the route is a
valley route whose buffers never exceed max(source shard, target shard), and
it never moves more bytes than the naive gather-then-slice route; with uneven
sizes the naive route can be cheaper only when it breaks the memory bound,
which the search keeps instead. Uneven dims may need a `Repad` (see
`reshard.geometry`): the search puts it at the bottom of the valley (where
buffers are smallest) by re-laying out to the target-refined geometry that
the remaining gathers turn into the target exactly.

Sub-axes. `route_reshard` also routes on `refined_mesh(mesh)`, where every
composite axis is split into prime-factor sub-axes ('y' of size 4 becomes
'y#0', 'y#1'; same devices, same row-major order, so a dim over y is a dim
over ('y#0', 'y#1')), and keeps that route when it is cheaper: P('x', 'y') ->
P('y', 'x') on a 2x4 mesh becomes an all-to-all over y#1 and one permute (half
the bytes of whole-axis routes, as XLA does it). The steps' axes then name the
route's `mesh` (`ReshardRoute.mesh`), which a lowering must use to form groups
and indices; `src.mesh` and `dst.mesh` stay the caller's.

Device orders. `src` and `dst` may live on two device orders of one mesh
(`Mesh.is_reordering_of`: same axis names and sizes, devices in another
order), as tile assignments in a TPU program's own device order do. The route
then runs on one of the two orders and adds one `Permute` of whole shards
(`reorder_pairs`), first or last, whichever moves fewer bytes; the steps'
axes name that order's mesh (`ReshardRoute.mesh`).

A route's `bytes_moved` is the maximum over devices of the sum over steps of
the bytes each step's class says the device receives.
"""

from __future__ import annotations

import heapq
import itertools
import math
from typing import Dict, List, Mapping, Optional, Sequence, Tuple, Type

from tf_gspmd.graph_rewrite.reshard.exchange import Permute, Repad
from tf_gspmd.graph_rewrite.reshard.geometry import (
  canonical_levels,
  ceil_div,
  levels_chunk,
  prod,
  refined_mesh,
  same_geometry,
)
from tf_gspmd.graph_rewrite.reshard.moves import (
  PHASE_SLICE,
  AllGather,
  AllReduce,
  AllToAll,
  Axes,
  Dims,
  Move,
  ReduceScatter,
  SearchState,
  Slice,
  Step,
)
from tf_gspmd.graph_rewrite.reshard.route import ReshardRoute, collective_count
from tf_gspmd.mesh import Mesh
from tf_gspmd.sharding import NamedSharding

# The order the search tries moves in (it decides between routes of equal cost).
MOVE_KINDS: Tuple[Type[Step], ...] = (
  Slice,
  ReduceScatter,
  AllReduce,
  AllToAll,
  Permute,
  Repad,
  AllGather,
)


def route_reshard(
  src: NamedSharding, dst: NamedSharding, shape: Sequence[int], dtype_size: int = 4
) -> ReshardRoute:
  """The cheapest valley route (bytes received per device) from `src` to `dst` within the bound.

  >>> from tf_gspmd.sharding import P
  >>> mesh = Mesh.create((2, 4), ('x', 'y'))
  >>> src, dst = NamedSharding(mesh, P('x', 'y')), NamedSharding(mesh, P('y', 'x'))
  >>> route = route_reshard(src, dst, (8, 8))
  >>> sorted(route.collective_counts())
  ['all_to_all', 'permute']
  """
  # Routes are immutable and a program asks the same questions many times (every layer of a
  # model, every candidate sharding's cost): one search each. Sharding equality is structural
  # (the mesh's axis names included), as a route's steps name the axes of its own mesh.
  key = (src, dst, tuple(int(s) for s in shape), dtype_size)
  route = _ROUTE_CACHE.get(key)
  if route is None:
    if len(_ROUTE_CACHE) >= 4096:
      _ROUTE_CACHE.clear()
    route = _ROUTE_CACHE[key] = _route_reshard(src, dst, shape, dtype_size)
  return route


_ROUTE_CACHE: dict = {}


def _route_reshard(src, dst, shape, dtype_size: int) -> ReshardRoute:
  if isinstance(src, NamedSharding) and isinstance(dst, NamedSharding) and src.mesh != dst.mesh:
    return _route_across_orders(src, dst, shape, dtype_size)
  searcher = _Search(src, dst, shape, dtype_size)
  best = searcher.build(searcher.search(), 'valley')
  refined = _Search(src, dst, shape, dtype_size, refine=True)
  if (
    refined.mesh != searcher.mesh
    and (refined.rank + 1) ** len(refined.axes) <= _MAX_REFINED_PLACEMENTS
  ):
    candidate = refined.build(refined.search(), 'valley')
    if _route_key(candidate) < _route_key(best):
      best = candidate
  return _no_more_collectives_than_even(best, src, dst, shape, dtype_size)


def _no_more_collectives_than_even(best: ReshardRoute, src, dst, shape, dtype_size) -> ReshardRoute:
  """`best`, or the naive route when best saves only padding with extra collectives.

  With short or empty shards (4 rows over 8 devices) the cheapest route in
  bytes can gather the non-empty shards first, repad and gather again: three
  or more collectives where the naive route runs one, to avoid receiving
  padding rows. The same reshard with every split dim padded to divide
  evenly moves as many bytes as that naive route (its padding is real data
  there), so the naive route is taken when it runs fewer collectives, moves no
  more bytes than that even reshard and stays within the memory bound: an
  uneven split then costs no more collectives than the even one.
  """
  padded = _evenly_padded(src, dst, shape)
  if padded == tuple(int(n) for n in shape):
    return best
  naive = naive_route(src, dst, shape, dtype_size)
  if collective_count(naive) >= collective_count(best) or naive.peak_bytes > best.bound_bytes:
    return best
  even = route_reshard(src, dst, padded, dtype_size)
  return naive if naive.bytes_moved <= even.bytes_moved else best


def _evenly_padded(src: NamedSharding, dst: NamedSharding, shape) -> tuple:
  """`shape` with each dim rounded up to a multiple of the devices splitting it in src or dst."""
  out = []
  for d, n in enumerate(shape):
    axes = set(src.spec.axes_of(d)) | set(dst.spec.axes_of(d))
    k = src.mesh.axes_size(tuple(axes))
    out.append(ceil_div(int(n), k) * k)
  return tuple(out)


def _route_across_orders(src: NamedSharding, dst: NamedSharding, shape, dtype_size) -> ReshardRoute:
  """A route between two device orders of one mesh (same axis names and sizes).

  The shardings differ in spec and in which device holds which piece. The route
  runs on one order and moves whole shards once, as a `Permute` (a
  collective-permute; each device receives at most one shard, so no buffer
  exceeds max(source, target)): either first (the source's spec onto the
  target's order, then route there) or last (route to the target's spec on the
  source's order, then move). The one moving fewer bytes wins: the smaller
  shard moves. Devices that already hold their piece in the other order (all
  of them when the orders agree on the axes the sharding uses) receive nothing.
  """
  if not dst.mesh.is_reordering_of(src.mesh):
    raise ValueError(
      f'route_reshard: source {src!r} and target {dst!r} use different meshes, not two '
      'device orders of one mesh (same axis names and sizes, same devices).'
    )
  shape = tuple(int(s) for s in shape)
  candidates = []
  src_there = _same_spec_on(src, dst.mesh)
  inner = route_reshard(src_there, dst, shape, dtype_size)
  candidates.append(_with_reorder(inner, src, dst, _reorder_step(src, src_there, shape), True))
  dst_here = _same_spec_on(dst, src.mesh)
  inner = route_reshard(src, dst_here, shape, dtype_size)
  candidates.append(_with_reorder(inner, src, dst, _reorder_step(dst_here, dst, shape), False))
  return min(candidates, key=_route_key)


def _same_spec_on(s: NamedSharding, mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, s.spec, s.partial_axes, s.partial or 'sum')


def _with_reorder(inner: ReshardRoute, src, dst, step, first: bool) -> ReshardRoute:
  steps = inner.steps
  if step is not None and first:
    steps = _merge_permutes(step, steps[0]) + steps[1:] if steps else (step,)
  elif step is not None:
    steps = steps[:-1] + _merge_permutes(steps[-1], step) if steps else (step,)
  return ReshardRoute(
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
  senders: Dict[tuple, List[int]] = {}
  for d in devices:
    if have[d] != want[d]:
      senders.setdefault(have[d], []).append(d)
  return tuple((senders[want[d]].pop(0), d) for d in devices if have[d] != want[d])


def _route_key(route: ReshardRoute):
  return route.bytes_moved, route.peak_bytes, len(route.steps)


# Searching on factor sub-axes enumerates (rank+1)**axes placements for permutes;
# above this many it is skipped (the plain route is still optimal over whole axes).
_MAX_REFINED_PLACEMENTS = 2048


def naive_route(
  src: NamedSharding, dst: NamedSharding, shape: Sequence[int], dtype_size: int = 4
) -> ReshardRoute:
  """All-reduce pending reductions, all-gather every dim to replicated, then slice."""
  searcher = _Search(src, dst, shape, dtype_size)
  return searcher.build(searcher.naive_path(), 'naive')


# --- one search ------------------------------------------------------------------------------
class _Search:
  """One reshard's search over `SearchState`s; the `SearchContext` its moves read."""

  def __init__(self, src, dst, shape, dtype_size, refine=False):
    for name, s in (('src', src), ('dst', dst)):
      if not isinstance(s, NamedSharding):
        raise TypeError(f'route_reshard: {name} must be a NamedSharding, got {s!r}.')
    if src.mesh != dst.mesh:
      raise ValueError(f'route_reshard: source {src!r} and target {dst!r} use different meshes.')
    shape = tuple(int(s) for s in shape)
    src.check_shape(shape, 'route_reshard source')
    dst.check_shape(shape, 'route_reshard target')
    if any(s < 0 for s in shape):
      raise ValueError(f'route_reshard: negative size in shape {shape}.')
    mesh, parts = refined_mesh(src.mesh) if refine else (src.mesh, None)
    self.src, self.dst, self.mesh = src, dst, mesh
    self.shape, self.rank, self.dtype_size = shape, len(shape), int(dtype_size)
    self.size = mesh.shape
    self._counts: Dict[Tuple[str, ...], int] = {}
    self._last_dims: Optional[Dims] = None
    self._last_shape: tuple = ()
    big = [a for a in mesh.axis_names if self.size[a] > 1]  # size-1 axes change nothing

    def search_axes(axes) -> Axes:  # the search mesh's (sub-)axes, size-1 ones dropped
      return tuple(s for a in axes for s in (parts[a] if parts else (a,)) if s in big)

    self.axis_order = {a: i for i, a in enumerate(mesh.axis_names)}
    self.src_axes = tuple(search_axes(src.spec.axes_of(d)) for d in range(self.rank))
    self.dst_axes = tuple(search_axes(dst.spec.axes_of(d)) for d in range(self.rank))
    src_partial = frozenset(search_axes(src.partial_axes))
    goal_partial = frozenset(search_axes(dst.partial_axes))
    if not goal_partial <= src_partial or (goal_partial and src.partial != dst.partial):
      raise ValueError(
        f'route_reshard: target {dst} holds a pending reduction the source {src} does not; '
        f'a reshard can resolve pending reductions but not create them.'
      )
    self.src_partial, self.goal_partial = src_partial, goal_partial
    self.op = src.partial or 'sum'
    self.dst_dim = {a: d for d, axes in enumerate(self.dst_axes) for a in axes}
    self.axes = big
    self.start = SearchState(
      tuple((axes, canonical_levels(n, self.count(axes))) for axes, n in zip(self.src_axes, shape)),
      src_partial,
      PHASE_SLICE,
    )
    self.goal_levels = tuple(
      canonical_levels(n, self.count(axes)) for axes, n in zip(self.dst_axes, shape)
    )
    self.bound_elems = self._bound_elems()
    self._placements: Optional[Dict[tuple, List[Tuple[Axes, ...]]]] = None

  # --- what moves ask (SearchContext) -----------------------------------------------------
  def count(self, axes: Sequence[str]) -> int:
    # Asked several times per move: a table per search.
    key = tuple(axes)
    n = self._counts.get(key)
    if n is None:
      n = self._counts[key] = prod(self.size[a] for a in key)
    return n

  def local_shape(self, dims: Dims) -> tuple:
    # Every move from one state asks for the same shape: the last one is kept.
    if dims is not self._last_dims:
      self._last_dims = dims
      self._last_shape = tuple(levels_chunk(n, lv) for n, (_, lv) in zip(self.shape, dims))
    return self._last_shape

  def placements(self) -> Mapping[tuple, List[Tuple[Axes, ...]]]:
    """Every placement of the mesh axes on the dims (any dim, any order), by per-dim counts."""
    if self._placements is None:
      axes = self.axes
      table: Dict[tuple, List[Tuple[Axes, ...]]] = {}
      for where in itertools.product([None] + list(range(self.rank)), repeat=len(axes)):
        per_dim = [[a for a, w in zip(axes, where) if w == d] for d in range(self.rank)]
        for orders in itertools.product(*[itertools.permutations(p) for p in per_dim]):
          counts = tuple(self.count(o) for o in orders)
          table.setdefault(counts, []).append(tuple(orders))
      self._placements = table
    return self._placements

  # --- the search -------------------------------------------------------------------------
  def _bound_elems(self) -> int:
    padded = []
    for d, n in enumerate(self.shape):
      k = self.count(tuple(set(self.src_axes[d]) | set(self.dst_axes[d])))
      padded.append(ceil_div(n, k) * k)
    src = prod(p // self.count(a) for p, a in zip(padded, self.src_axes))
    dst = prod(p // self.count(a) for p, a in zip(padded, self.dst_axes))
    return max(src, dst)

  def _is_goal(self, state: SearchState) -> bool:
    return state.partial == self.goal_partial and all(
      axes == goal_axes and same_geometry(n, lv, goal_lv)
      for (axes, lv), goal_axes, goal_lv, n in zip(
        state.dims, self.dst_axes, self.goal_levels, self.shape
      )
    )

  def search(self) -> List[Move]:
    """Dijkstra over states; cost = (bytes received, non-valley steps, steps, elements
    copied after all-gathers)."""
    start = self.start
    best = {start: (0, 0, 0, 0)}
    parent: Dict[SearchState, Optional[Tuple[SearchState, Move]]] = {start: None}
    heap = [((0, 0, 0, 0), 0, start)]
    tie = itertools.count(1)
    while heap:
      cost, _, state = heapq.heappop(heap)
      if best.get(state) != cost:
        continue
      if self._is_goal(state):
        return self._path(parent, state)
      for kind in MOVE_KINDS:
        for choice in kind.choices(self, state):
          effect = kind.effect(self, state, choice)
          if effect is None or effect.peak > self.bound_elems:
            continue
          new_cost = (
            cost[0] + effect.received * self.dtype_size,
            cost[1] + int(kind.off_valley(state)),
            cost[2] + 1,
            cost[3] + kind.copy_elems(effect.details),
          )
          if new_cost < best.get(effect.state, (math.inf,)):
            best[effect.state] = new_cost
            parent[effect.state] = (state, Move(kind, choice))
            heapq.heappush(heap, (new_cost, next(tie), effect.state))
    raise ValueError(
      f'route_reshard: no route from {self.src} to {self.dst} for shape {self.shape} on '
      f'{self.mesh} keeps every buffer within {self.bound_elems * self.dtype_size} bytes.'
    )

  @staticmethod
  def _path(parent, state: SearchState) -> List[Move]:
    moves = []
    while parent[state] is not None:
      state, move = parent[state]
      moves.append(move)
    return moves[::-1]

  def naive_path(self) -> List[Move]:
    moves = []
    reducible = sorted(self.src_partial - self.goal_partial, key=self.axis_order.__getitem__)
    if reducible:
      moves.append(Move(AllReduce, (tuple(reducible),)))
    moves += [Move(AllGather, (d, axes)) for d, axes in enumerate(self.src_axes) if axes]
    moves += [Move(Slice, (d, axes)) for d, axes in enumerate(self.dst_axes) if axes]
    return moves

  # --- concrete steps -----------------------------------------------------------------
  def build(self, moves: Sequence[Move], strategy: str) -> ReshardRoute:
    state, steps = self.start, []
    for move in moves:
      effect = move.effect(self, state)
      if effect is None:
        raise AssertionError(f'route_reshard: move {move} does not apply to {state}')
      step = move.kind.build(self, state, move.choice, effect.details)
      if step is not None:
        steps.append(step)
      state = effect.state
    if not self._is_goal(state):
      raise AssertionError(f'route_reshard: {strategy} route ends in {state}, not the target')
    return ReshardRoute(
      self.src,
      self.dst,
      self.shape,
      self.dtype_size,
      tuple(steps),
      self.bound_elems * self.dtype_size,
      strategy,
      self.mesh,
    )
