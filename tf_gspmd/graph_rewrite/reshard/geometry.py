"""Uneven per-dim geometry of sharded dims, and the local ops every reshard step shares.

A dim split over mesh axes (a, b) has shard index idx_a * size_b + idx_b.
Sizes that do not divide evenly are why the search keeps more than axes per
dim: it keeps the dim's *geometry*, a mixed-radix list of levels (k, c). The
shard index is decomposed over the levels' k (row-major); level j places its
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
  (k, c) is the same geometry as (k/h, h*c), (h, c).

Gathering the minor axes of a flat level therefore yields chunks of h*c rows,
which for uneven sizes is not the canonical ceil(n/(k/h)) geometry (10 rows over
2x2 gathered over the minor axis gives blocks [0,6), [6,10), not [0,5),
[5,10)); `repad_exchange` says how a short exchange among the devices of a
dim's group turns one geometry into another.

`refined_mesh` splits composite mesh axes into prime-factor sub-axes, the
finer grid the search may route on. Pure Python and numpy: no TensorFlow.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Dict, Iterable, List, Mapping, Sequence, Tuple

import numpy as np

from tf_gspmd.mesh import Mesh

Level = Tuple[int, int]  # (number of sub-blocks k, rows per sub-block c)
Levels = Tuple[Level, ...]


def ceil_div(a: int, b: int) -> int:
  return -(-a // b)


def prod(values: Iterable[int]) -> int:
  return int(math.prod(values))


def elems(shape: Iterable[int]) -> int:
  """Elements of a buffer of this shape."""
  return prod(shape)


def with_sizes(shape: Sequence[int], sizes: Mapping[int, int]) -> tuple:
  """`shape` with the sizes of some dims replaced ({dim: size})."""
  out = list(shape)
  for d, v in sizes.items():
    out[d] = v
  return tuple(out)


# --- per-dim geometry ---------------------------------------------------------------
def normalize_levels(levels: Sequence[Level]) -> Tuple[Level, ...]:
  """Drop one-way levels and merge a level into its parent when the two tile it evenly.

  (k1, c1), (k2, c2) with c1 == k2 * c2 place sub-blocks exactly like the flat
  level (k1 * k2, c2), so they are the same geometry.
  """
  out: List[Level] = []
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
  return ((count, ceil_div(n, count)),) if count > 1 else ()


def levels_chunk(n: int, levels: Sequence[Level]) -> int:
  """Rows each device holds (padded) for a dim of size n with this geometry."""
  return levels[-1][1] if levels else n


@lru_cache(maxsize=None)
def shard_intervals(n: int, levels: Tuple[Level, ...]) -> Tuple[Tuple[int, int], ...]:
  """Per shard index: (global start, valid length); the valid rows sit at local [0, length).

  Empty shards are reported as (0, 0) so that equal geometries compare equal.
  """
  cur = [(0, n)]
  for k, c in levels:
    cur = [(off + i * c, max(0, min(c, length - i * c))) for off, length in cur for i in range(k)]
  return tuple((s, ln) if ln else (0, 0) for s, ln in cur)


def same_geometry(n: int, a: Tuple[Level, ...], b: Tuple[Level, ...]) -> bool:
  """Whether two geometries put the same rows at the same local places with the same buffer."""
  return levels_chunk(n, a) == levels_chunk(n, b) and shard_intervals(n, a) == shard_intervals(n, b)


def split_trailing(levels: Sequence[Level], g: int):
  """(prefix, trailing) with the trailing levels' sizes multiplying to g, or None.

  Splits one level (k, c) into (k/h, h*c), (h, c) when the group covers only
  its minor part; returns None when the group size does not factor that way.
  """
  rest, need = list(levels), g
  trailing: List[Level] = []
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
def repad_exchange(n: int, levels_in: Tuple[Level, ...], levels_out: Tuple[Level, ...]):
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
  local = []
  by_shift: Dict[int, list] = {}
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


def slice_window(index: int, chunk: int, rows: int) -> Tuple[int, int]:
  """(start, shift) for `Slice`: window [start, start+chunk) of `rows`, then roll up by shift."""
  want = index * chunk
  start = max(0, min(want, rows - chunk))
  return start, want - start


def refined_mesh(mesh: Mesh):
  """`mesh` with every composite axis split into prime-factor sub-axes, and the split.

  Axis 'y' of size 4 becomes 'y#0' (major) and 'y#1' (minor), both of size 2:
  the same devices in the same row-major order, so a dim split over y is the
  same geometry as one split over ('y#0', 'y#1'). Searching on sub-axes finds
  routes such as an all-to-all over half of an axis. Returns (mesh, {axis:
  sub-axes}); the mesh itself when no axis is composite or a name would clash.
  """
  names: List[str] = []
  sizes: List[int] = []
  parts: Dict[str, Tuple[str, ...]] = {}
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
