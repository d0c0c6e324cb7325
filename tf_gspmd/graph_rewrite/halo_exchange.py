"""Halo exchange for windowed ops: the geometry of split spatial dims and the neighbour
exchanges that give each partition its input window (`gather_window`), send window
gradients back (`scatter_window`) and compute an image gradient's own rows
(`own_rows_gradient`).

A spatial dim split over mesh axes stays split: each partition borrows the
rows its output window reaches beyond its own shard from its neighbours
(collective-permutes along those axes, one per hop when a halo is wider than a
neighbour's shard), concatenates [left | local | right] and cuts out its window
with a slice whose start comes from a table indexed by partition id. The
geometry is `trimmed_halo`: `halo.halo_geometry` with halos cut to the rows that real
output rows read. `windowed.py` runs the ops on these windows.
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf
from tensorflow.core.framework import attr_value_pb2

from tf_gspmd.collectives import slice_dim
from tf_gspmd.graph import emit
from tf_gspmd.graph_rewrite.partitioner import Local
from tf_gspmd.propagation.halo import (
  HaloGeometry,
  InputGradientGeometry,
  WindowDim,
  halo_geometry,
  input_gradient_geometry,
)
from tf_gspmd.sharding import NamedSharding, P

Axes = Tuple[str, ...]


class NotHaloable(ValueError):
  """The op's form is outside what halo exchange handles (rank, data format, padding,
  pooling over batch or channels): it is computed on replicated operands instead."""


# --- op geometry ------------------------------------------------------------------------
def node_attr(node, name, default=None):
  from tf_gspmd.propagation.registry import attr

  return attr(node, name, default)


@dataclasses.dataclass(frozen=True)
class ImageDims:
  """Where batch, spatial and channel dims sit in a rank-4 image (NHWC or NCHW)."""

  batch: int
  spatial: Tuple[int, ...]
  channel: int

  @classmethod
  def of(cls, node) -> 'ImageDims':
    fmt = node_attr(node, 'data_format', 'NHWC')
    if fmt in ('NCHW',):
      return cls(0, (2, 3), 1)
    if fmt in ('NHWC',):
      return cls(0, (1, 2), 3)
    raise NotHaloable(
      f'{node.op} {node.name}: data_format {fmt!r} is not supported by the '
      'halo-exchange partitioner (NHWC or NCHW).'
    )


def trimmed_halo(window: WindowDim, shards: int) -> Tuple[HaloGeometry, int]:
  """`halo_geometry(window, shards)` with halos cut to the rows that real output rows read.

  Output shards are ceil-sized, so trailing shards hold output rows past the
  end (padding) or none at all; their windows may reach far past their
  neighbours (a 3x3/2 pooling of 10 rows over 4 shards). What they compute
  is padding, so only shards holding real output rows decide the halo
  widths; the others read any window. Returns (halo, tail): `tail` zero rows
  appended after the right halo keep every window inside the extended shard.
  """
  halo = halo_geometry(window, shards)
  m, co, ci, s = window.output_size, halo.output_chunk, halo.input_chunk, window.stride
  real = [i for i in range(shards) if i * co < m]
  if not real:
    return halo, 0
  lefts, rights = {}, {}
  for i in real:
    rows = min(co, m - i * co)
    need = (rows - 1) * s + window.effective_window
    start = halo.window_global_starts[i]
    lefts[i], rights[i] = i * ci - start, start + need - (i + 1) * ci
  left, right = max(0, max(lefts.values())), max(0, max(rights.values()))
  starts = tuple(left - lefts[i] if i in lefts else 0 for i in range(shards))
  tail = max(0, max(st + halo.span for st in starts) - (left + ci + right))
  return dataclasses.replace(halo, left=left, right=right, window_starts=starts), tail


@dataclasses.dataclass(frozen=True)
class SpatialDim:
  """One spatial dim as partitioned: its tensor dim, the mesh axes splitting it, its halo.

  With no axes the dim is whole on every partition and `halo` is the
  one-shard geometry (explicit padding, no neighbours). `tail` zero rows follow
  the right halo (see `trimmed_halo`).
  """

  dim: int
  axes: Axes
  window: WindowDim
  halo: HaloGeometry
  tail: int = 0


def spatial_dims(
  p, node, spec: P, layout: ImageDims, windows: List[WindowDim], tensor: str
) -> List[SpatialDim]:
  """The halos of the spatial dims as `spec` splits them; a split dim that yields no
  output rows is taken whole (the caller gathers it) with a warning."""
  dims = []
  for d, window in zip(layout.spatial, windows):
    axes = spec.axes_of(d)
    halo, tail = trimmed_halo(window, p.mesh.axes_size(axes))
    if axes and window.output_size == 0:
      p.warn_once(
        f'halo:{node.name}:{d}',
        f'tf_gspmd: {node.op} {node.name}: dim {d} of {tensor} (size '
        f'{window.input_size}, split {halo.shards} ways over mesh axes {axes}; window '
        f'{window.window}, stride {window.stride}, dilation {window.dilation}) gives '
        'no output rows; that dim is all-gathered to compute the op.',
      )
      (halo, tail), axes = trimmed_halo(window, 1), ()
    dims.append(SpatialDim(d, axes, window, halo, tail))
  return dims


def _positions(sharding: NamedSharding, dim: int) -> np.ndarray:
  """Shard index along `dim` of each partition id."""
  return np.array([sharding.tile_index(pid)[dim] for pid in range(sharding.mesh.size)])


def _per_partition(p, sd: SpatialDim, sharding: NamedSharding, per_shard: Sequence[int], name: str):
  """This partition's entry of `per_shard` (one value per shard of the dim): an int when
  every partition has the same, else an int32 scalar read from a table."""
  values = np.asarray(per_shard, dtype=np.int32)
  if not sd.axes or np.all(values == values[0]):
    return int(values[0])
  return p.backend.table(values[_positions(sharding, sd.dim)], name=name)


def valid_rows(p, sd: SpatialDim, sharding: NamedSharding):
  """Bool [span] vector: rows of this partition's window inside the image; None if all are."""
  halo, n = sd.halo, sd.window.input_size
  starts = np.asarray(halo.window_global_starts)
  if np.all(starts >= 0) and np.all(starts + halo.span <= n):
    return None
  start = _per_partition(p, sd, sharding, starts, f'window_global_start_dim{sd.dim}')
  rows = tf.range(halo.span, dtype=tf.int32) + start
  return tf.logical_and(rows >= 0, rows < n)


def along(vector: tf.Tensor, dim: int, rank: int) -> tf.Tensor:
  shape = [1] * rank
  shape[dim] = -1
  return tf.reshape(vector, shape)


def _slice(x: tf.Tensor, dim: int, start, size: int) -> tf.Tensor:
  """x[..., start:start+size, ...] along `dim` with a static shape (`start` may be a tensor)."""
  y = slice_dim(x, dim, start, size)
  shape = x.shape.as_list()
  shape[dim] = size
  y.set_shape(shape)
  return y


# --- neighbour exchange ------------------------------------------------------------------
def _exchange(p, x: tf.Tensor, axes: Axes, offset: int, why: str) -> tf.Tensor:
  """Position i along `axes` gets `x` of position i - offset (zeros where there is none)."""
  p.note_collective(
    {
      'kind': 'permute',
      'axes': tuple(axes),
      'shape': tuple(x.shape),
      'dtype': x.dtype.name,
      'bytes': int(x.shape.num_elements() or 0) * x.dtype.size,
      'why': why,
    }
  )
  if len(axes) == 1:
    return p.backend.shift(x, axes[0], offset)
  pairs = []
  for group in p.mesh.groups(axes):  # row-major over `axes`: the shard order of the dim
    for j, dst in enumerate(group):
      if 0 <= j - offset < len(group):
        pairs.append((group[j - offset], dst))
  return p.backend.permute(x, pairs)


def _zero_rows(x: tf.Tensor, dim: int, rows: int) -> tf.Tensor:
  shape = x.shape.as_list()
  shape[dim] = rows
  return tf.zeros(shape, x.dtype)


def _hop_text(hop: int) -> str:
  return '' if hop == 1 else f' {hop} shards away'


def _borrow(p, x: tf.Tensor, sd: SpatialDim, piece, side: str, of: str = '') -> tf.Tensor:
  """One halo piece: rows of the shard `piece.hop` positions away on `side` (zeros when no
  shard is that far away: those rows lie outside the image everywhere)."""
  d = sd.dim
  if piece.hop >= sd.halo.shards:
    return _zero_rows(x, d, piece.rows)
  offset = piece.hop if side == 'left' else -piece.hop
  return _exchange(
    p,
    _slice(x, d, piece.start, piece.rows),
    sd.axes,
    offset,
    f'halo of dim {d}{of} from the {side} neighbour{_hop_text(piece.hop)}',
  )


def _extend(
  p, x: tf.Tensor, sd: SpatialDim, sharding: NamedSharding, fill, of: str = ''
) -> tf.Tensor:
  """This partition's input window along `sd`: halo rows borrowed (from as many neighbours
  as the halo spans), rows outside the image replaced by `fill`."""
  d, halo = sd.dim, sd.halo
  if sd.axes:
    parts = (
      [_borrow(p, x, sd, piece, 'left', of) for piece in halo.left_pieces]
      + [x]
      + [_borrow(p, x, sd, piece, 'right', of) for piece in halo.right_pieces]
    )
    ext = tf.concat(parts, axis=d) if len(parts) > 1 else x
    if sd.tail:
      paddings = [[0, 0]] * x.shape.rank
      paddings[d] = [0, sd.tail]
      ext = tf.pad(ext, paddings)
  else:
    paddings = [[0, 0]] * x.shape.rank
    paddings[d] = [halo.left, halo.right + sd.tail]
    ext = tf.pad(x, paddings) if halo.left or halo.right or sd.tail else x
  start = _per_partition(p, sd, sharding, halo.window_starts, f'window_start_dim{d}')
  window = _slice(ext, d, start, halo.span)
  valid = valid_rows(p, sd, sharding)
  if valid is None:
    return window
  fill_value = tf.cast(tf.constant(fill), window.dtype)
  return tf.where(along(valid, d, window.shape.rank), window, fill_value)


def gather_window(
  p, x: tf.Tensor, sharding: NamedSharding, dims: Sequence[SpatialDim], fill, of: str = ''
) -> tf.Tensor:
  """The input window of this partition's output block: every spatial dim extended by its
  halo (dims one after another, so corner blocks come along with the second exchange).
  `of` names the tensor in the collectives' records when it is not the op's input."""
  for sd in dims:
    x = _extend(p, x, sd, sharding, fill, of)
  return x


def _retract(p, w: tf.Tensor, sd: SpatialDim, sharding: NamedSharding) -> tf.Tensor:
  """Adjoint of `_extend`: window rows back to this shard, halo rows added into the
  neighbours' shards they were borrowed from."""
  d, halo = sd.dim, sd.halo
  ci = halo.input_chunk
  length = halo.left + ci + halo.right + sd.tail
  start = _per_partition(p, sd, sharding, halo.window_starts, f'window_start_dim{d}')
  paddings = [[0, 0]] * w.shape.rank
  if isinstance(start, int):
    paddings[d] = [start, length - start - halo.span]
    ext = tf.pad(w, paddings)
  else:  # place the window at a per-partition offset: pad at the end, then rotate zeros in
    paddings[d] = [0, length - halo.span]
    ext = tf.roll(tf.pad(w, paddings), start, axis=d)
  local = _slice(ext, d, halo.left, ci)
  if not sd.axes:
    return local
  # Each halo piece goes back the hops it came (to the shard it was borrowed from), which
  # adds it to the rows it was cut from.
  for piece, side, pos in _laid_out(halo.left_pieces, 'left', 0) + _laid_out(
    halo.right_pieces, 'right', halo.left + ci
  ):
    if piece.hop >= halo.shards:
      continue  # rows outside the image everywhere: their gradient is dropped
    offset = -piece.hop if side == 'left' else piece.hop
    got = _exchange(
      p,
      _slice(ext, d, pos, piece.rows),
      sd.axes,
      offset,
      f'halo gradient of dim {d} back to the {side} neighbour{_hop_text(piece.hop)}',
    )
    paddings[d] = [piece.start, ci - piece.start - piece.rows]
    local = local + tf.pad(got, paddings)
  return local


def _laid_out(pieces, side: str, first: int) -> list:
  """(piece, side, its first row in the extended buffer) for pieces laid out from `first`."""
  out, pos = [], first
  for piece in pieces:
    out.append((piece, side, pos))
    pos += piece.rows
  return out


def scatter_window(
  p, w: tf.Tensor, sharding: NamedSharding, dims: Sequence[SpatialDim]
) -> tf.Tensor:
  """Adjoint of `gather_window`: the gradient of a window, summed into the local shards."""
  for sd in reversed(dims):
    w = _retract(p, w, sd, sharding)
  return w


# --- image gradients of the own rows --------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class GradientDim:
  """One spatial dim of an image gradient computed directly on the own rows: `image` is the
  dim as the result is split, `gradient` the output-gradient halo (as a `SpatialDim` of
  the output gradient, rows outside it masked) and `geometry` the local op's padding."""

  image: SpatialDim
  gradient: SpatialDim
  geometry: InputGradientGeometry


def gradient_dims(dims: Sequence[SpatialDim]) -> Optional[List[GradientDim]]:
  """`input_gradient_geometry` for each spatial dim; None when a dim yields no output rows
  (its gradient is all zeros: the reverse halo exchange of `scatter_window` handles it)."""
  out = []
  for sd in dims:
    if sd.window.output_size == 0:
      return None
    geometry = input_gradient_geometry(sd.window, sd.halo.shards)
    grad = SpatialDim(
      sd.dim, sd.axes, WindowDim(sd.window.output_size, 1), geometry.halo, geometry.tail
    )
    out.append(GradientDim(sd, grad, geometry))
  return out


def check_gradient_split(node, g: Local, dims: Sequence[SpatialDim]):
  """The rule splits the output gradient's spatial dims as the image's (same factor)."""
  for sd in dims:
    if g.sharding.spec.axes_of(sd.dim) != sd.axes:
      raise ValueError(
        f'{node.op} {node.name}: the output gradient {node.inputs[2]} is '
        f'split {g.sharding.spec} but the image gradient splits dim {sd.dim} '
        f'over {sd.axes}; the rule gives both the same spatial factor.'
      )


def own_rows_gradient(
  p,
  node,
  g: tf.Tensor,
  g_sharding: NamedSharding,
  result: NamedSharding,
  local_shape,
  gdims: Sequence[GradientDim],
  make_inputs,
) -> tf.Tensor:
  """The image gradient of this partition's own rows, computed directly (the transposed
  window op, as a backprop op with explicit padding): the output-gradient rows whose
  windows cover those rows come from the neighbours (a halo exchange of the gradient),
  then one local backprop op yields the shard (plus, when a stride does not divide the
  shard, the few rows before it that align the stride's phase, sliced off).
  `make_inputs(sizes, g_window)` gives the op's inputs."""
  window = gather_window(
    p, g, g_sharding, [gd.gradient for gd in gdims], 0, of=' of the output gradient'
  )
  sizes = [int(s) for s in local_shape]
  paddings = [0] * (2 * len(sizes))
  for gd in gdims:
    d = gd.image.dim
    sizes[d] = gd.geometry.rows
    paddings[2 * d : 2 * d + 2] = [gd.geometry.pad_lo, gd.geometry.pad_hi]
  attrs = {
    'padding': attr_value_pb2.AttrValue(s=b'EXPLICIT'),
    'explicit_paddings': attr_value_pb2.AttrValue(
      list=attr_value_pb2.AttrValue.ListValue(i=paddings)
    ),
  }
  dx = emit.emit_node(
    node, make_inputs(sizes, window), attrs=attrs, name=node.name + '/gspmd/own_rows'
  ).outputs[0]
  for gd in gdims:
    d, ci = gd.image.dim, gd.image.halo.input_chunk
    if gd.geometry.rows != ci:
      start = _per_partition(p, gd.image, result, gd.geometry.offsets, f'own_rows_start_dim{d}')
      dx = _slice(dx, d, start, ci)
  return dx
