"""Partitioning windowed ops (convolutions, pooling and their gradients) with halo exchange.

A spatial dim split over mesh axes stays split: each partition borrows the
rows its output window reaches beyond its own shard from its neighbours
(collective-permutes along those axes), concatenates [left | local | right],
cuts out its window with a slice whose start comes from a table indexed by
partition id, replaces the rows outside the image (padding of the op, the
padding of ceil-sized shards) by the op's identity (0 for sums, -inf for
max), and runs the op with VALID padding on the window. The geometry is
`trim_plan`: `halo.plan_halo` with halos cut to the rows that real output
rows read. A spatial dim that is not split is padded explicitly the same way
(one shard, no neighbours), so every local op runs VALID.

Image gradients of convolutions (Conv2DBackpropInput, the depthwise one)
compute only this partition's own rows: an image row collects the
output-gradient rows whose windows cover it, so those rows come from the
neighbours (a halo exchange of the output gradient, `halo.plan_input_gradient`)
and one backprop op with explicit padding yields the shard directly -- not
the gradient of the whole haloed input window, a third more rows for a 3x3
convolution on 8-row shards. Pooling gradients (MaxPoolGrad needs the
forward window's argmax; AvgPoolGrad its real counts) are the exact adjoint
of the forward recipe: the backprop op VALID on the local output-gradient
rows gives the gradient of the input window; the own rows are kept and the
halo rows sent back to the neighbours they were borrowed from, which add
them to theirs (a reverse halo exchange). Filter gradients are local
contributions of the haloed input window and the local output-gradient rows:
a partial sum over the batch and spatial axes, resolved by the result's
reshard.

AvgPool with SAME padding divides by the number of real elements in each
window: that count is the pooling of a 0/1 mask of the window's valid rows,
pooled the same way, so edges stay exact after the image is cut.

A halo wider than a neighbour's shard (small late feature maps, wide
kernels, strides) is assembled from several neighbours: one permute per hop
(`HaloPlan.left_pieces` / `right_pieces`), and its gradient goes back the same
hops; the buffer stays the local shard plus the halo. Only a split dim that
yields no output at all is gathered whole first (an all-gather) with one
warning.

Every layout (batch, channel, spatial) comes from the op's propagation rule
(`factors.choose_layouts` with windowed factors allowed): this module only
says how to compute locally (halos, masks, local shapes).
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf
from tensorflow.core.framework import attr_value_pb2

from tf_gspmd.collectives import slice_dim
from tf_gspmd.graph import emit
from tf_gspmd.graph_rewrite import uneven
from tf_gspmd.graph_rewrite.handlers import (
  check_local_shape,
  computes,
  fallback_handler,
  global_shape,
  local_params,
)
from tf_gspmd.graph_rewrite.partitioner import Local
from tf_gspmd.propagation.halo import (
  HaloPlan,
  InputGradientPlan,
  WindowDim,
  plan_halo,
  plan_input_gradient,
)
from tf_gspmd.sharding import NamedSharding, P

Axes = Tuple[str, ...]


class NotHaloable(ValueError):
  """The op's form is outside what halo exchange handles (rank, data format, padding,
  pooling over batch or channels): it is computed on replicated operands instead."""


# --- op geometry ------------------------------------------------------------------------
def _attr(node, name, default=None):
  from tf_gspmd.propagation.registry import attr

  return attr(node, name, default)


@dataclasses.dataclass(frozen=True)
class Layout:
  """Where batch, spatial and channel dims sit in a rank-4 image (NHWC or NCHW)."""

  batch: int
  spatial: Tuple[int, ...]
  channel: int

  @classmethod
  def of(cls, node) -> 'Layout':
    fmt = _attr(node, 'data_format', 'NHWC')
    if fmt in ('NCHW',):
      return cls(0, (2, 3), 1)
    if fmt in ('NHWC',):
      return cls(0, (1, 2), 3)
    raise NotHaloable(
      f'{node.op} {node.name}: data_format {fmt!r} is not supported by the '
      'halo-exchange partitioner (NHWC or NCHW).'
    )


def trim_plan(window: WindowDim, shards: int) -> Tuple[HaloPlan, int]:
  """`plan_halo(window, shards)` with halos cut to the rows that real output rows read.

  Output shards are ceil-sized, so trailing shards hold output rows past the
  end (padding) or none at all; their windows may reach far past their
  neighbours (a 3x3/2 pooling of 10 rows over 4 shards). What they compute
  is padding, so only shards holding real output rows decide the halo
  widths; the others read any window. Returns (plan, tail): `tail` zero rows
  appended after the right halo keep every window inside the extended shard.
  """
  plan = plan_halo(window, shards)
  m, co, ci, s = window.output_size, plan.output_chunk, plan.input_chunk, window.stride
  real = [i for i in range(shards) if i * co < m]
  if not real:
    return plan, 0
  lefts, rights = {}, {}
  for i in real:
    rows = min(co, m - i * co)
    need = (rows - 1) * s + window.effective_window
    start = plan.window_global_starts[i]
    lefts[i], rights[i] = i * ci - start, start + need - (i + 1) * ci
  left, right = max(0, max(lefts.values())), max(0, max(rights.values()))
  starts = tuple(left - lefts[i] if i in lefts else 0 for i in range(shards))
  tail = max(0, max(st + plan.span for st in starts) - (left + ci + right))
  return dataclasses.replace(plan, left=left, right=right, window_starts=starts), tail


@dataclasses.dataclass(frozen=True)
class SpatialDim:
  """One spatial dim as partitioned: its tensor dim, the mesh axes splitting it, its halo plan.

  With no axes the dim is whole on every partition and `plan` is the
  one-shard plan (explicit padding, no neighbours). `tail` zero rows follow
  the right halo (see `trim_plan`).
  """

  dim: int
  axes: Axes
  window: WindowDim
  plan: HaloPlan
  tail: int = 0


def _plan_dims(
  p, node, spec: P, layout: Layout, windows: List[WindowDim], tensor: str
) -> List[SpatialDim]:
  """Halo plans for the spatial dims as `spec` splits them; a split dim that yields no
  output rows is planned whole (the caller gathers it) with a warning."""
  dims = []
  for d, window in zip(layout.spatial, windows):
    axes = spec.axes_of(d)
    plan, tail = trim_plan(window, p.mesh.axes_size(axes))
    if axes and window.output_size == 0:
      p.warn_once(
        f'halo:{node.name}:{d}',
        f'tf_gspmd: {node.op} {node.name}: dim {d} of {tensor} (size '
        f'{window.input_size}, split {plan.shards} ways over mesh axes {axes}; window '
        f'{window.window}, stride {window.stride}, dilation {window.dilation}) gives '
        'no output rows; that dim is all-gathered to compute the op.',
      )
      (plan, tail), axes = trim_plan(window, 1), ()
    dims.append(SpatialDim(d, axes, window, plan, tail))
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


def _valid_rows(p, sd: SpatialDim, sharding: NamedSharding):
  """Bool [span] vector: rows of this partition's window inside the image; None if all are."""
  plan, n = sd.plan, sd.window.input_size
  starts = np.asarray(plan.window_global_starts)
  if np.all(starts >= 0) and np.all(starts + plan.span <= n):
    return None
  start = _per_partition(p, sd, sharding, starts, f'window_global_start_dim{sd.dim}')
  rows = tf.range(plan.span, dtype=tf.int32) + start
  return tf.logical_and(rows >= 0, rows < n)


def _along(vector: tf.Tensor, dim: int, rank: int) -> tf.Tensor:
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
  if piece.hop >= sd.plan.shards:
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
  d, plan = sd.dim, sd.plan
  if sd.axes:
    parts = (
      [_borrow(p, x, sd, piece, 'left', of) for piece in plan.left_pieces]
      + [x]
      + [_borrow(p, x, sd, piece, 'right', of) for piece in plan.right_pieces]
    )
    ext = tf.concat(parts, axis=d) if len(parts) > 1 else x
    if sd.tail:
      paddings = [[0, 0]] * x.shape.rank
      paddings[d] = [0, sd.tail]
      ext = tf.pad(ext, paddings)
  else:
    paddings = [[0, 0]] * x.shape.rank
    paddings[d] = [plan.left, plan.right + sd.tail]
    ext = tf.pad(x, paddings) if plan.left or plan.right or sd.tail else x
  start = _per_partition(p, sd, sharding, plan.window_starts, f'window_start_dim{d}')
  window = _slice(ext, d, start, plan.span)
  valid = _valid_rows(p, sd, sharding)
  if valid is None:
    return window
  fill_value = tf.cast(tf.constant(fill), window.dtype)
  return tf.where(_along(valid, d, window.shape.rank), window, fill_value)


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
  d, plan = sd.dim, sd.plan
  ci = plan.input_chunk
  length = plan.left + ci + plan.right + sd.tail
  start = _per_partition(p, sd, sharding, plan.window_starts, f'window_start_dim{d}')
  paddings = [[0, 0]] * w.shape.rank
  if isinstance(start, int):
    paddings[d] = [start, length - start - plan.span]
    ext = tf.pad(w, paddings)
  else:  # place the window at a per-partition offset: pad at the end, then rotate zeros in
    paddings[d] = [0, length - plan.span]
    ext = tf.roll(tf.pad(w, paddings), start, axis=d)
  local = _slice(ext, d, plan.left, ci)
  if not sd.axes:
    return local
  # Each halo piece goes back the hops it came (to the shard it was borrowed from), which
  # adds it to the rows it was cut from.
  for piece, side, pos in _laid_out(plan.left_pieces, 'left', 0) + _laid_out(
    plan.right_pieces, 'right', plan.left + ci
  ):
    if piece.hop >= plan.shards:
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
  the output gradient, rows outside it masked) and `plan` the local op's padding."""

  image: SpatialDim
  gradient: SpatialDim
  plan: InputGradientPlan


def _gradient_dims(dims: Sequence[SpatialDim]) -> Optional[List[GradientDim]]:
  """`plan_input_gradient` for each spatial dim; None when a dim yields no output rows
  (its gradient is all zeros: the reverse halo exchange of `scatter_window` handles it)."""
  out = []
  for sd in dims:
    if sd.window.output_size == 0:
      return None
    plan = plan_input_gradient(sd.window, sd.plan.shards)
    grad = SpatialDim(sd.dim, sd.axes, WindowDim(sd.window.output_size, 1), plan.halo, plan.tail)
    out.append(GradientDim(sd, grad, plan))
  return out


def _check_gradient_split(node, g: Local, dims: Sequence[SpatialDim]):
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
    sizes[d] = gd.plan.rows
    paddings[2 * d : 2 * d + 2] = [gd.plan.pad_lo, gd.plan.pad_hi]
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
    d, ci = gd.image.dim, gd.image.plan.input_chunk
    if gd.plan.rows != ci:
      start = _per_partition(p, gd.image, result, gd.plan.offsets, f'own_rows_start_dim{d}')
      dx = _slice(dx, d, start, ci)
  return dx


# --- emitting the local op ----------------------------------------------------------------
def _valid_attrs(node) -> dict:
  attrs = {'padding': attr_value_pb2.AttrValue(s=b'VALID')}
  if 'explicit_paddings' in node.attrs:
    attrs['explicit_paddings'] = attr_value_pb2.AttrValue(list=attr_value_pb2.AttrValue.ListValue())
  return attrs


def _emit_valid(node, inputs, op_type: Optional[str] = None) -> tf.Tensor:
  """`node` (or `op_type` with node's attrs) on local windows, with VALID padding."""
  op = emit.emit_node(
    node, inputs, attrs=_valid_attrs(node), op_type=op_type, name=node.name + '/gspmd/window'
  )
  return op.outputs[0]


def _count_fraction(
  p, node, dims: Sequence[SpatialDim], sharding: NamedSharding, dtype
) -> Optional[tf.Tensor]:
  """Per output element, (real elements in its window) / (window area), shaped to
  broadcast against the pooled block; None when no window reaches past the image."""
  if not any(sd.window.pad_lo or sd.window.pad_hi for sd in dims):
    return None
  mask = tf.ones([1, 1, 1, 1], dtype)
  for sd in dims:
    valid = _valid_rows(p, sd, sharding)
    vector = tf.ones([sd.plan.span], dtype) if valid is None else tf.cast(valid, dtype)
    mask = mask * _along(vector, sd.dim, 4)
  return _emit_valid(node, [mask], op_type='AvgPool')


def _mask(p, value: Local, tensor: tf.Tensor, dims: Sequence[int], fill=0) -> tf.Tensor:
  return uneven.mask_padding(
    tensor, value.sharding, value.shape, dims, fill, p.backend.partition_id
  )


# --- layouts from the rule ------------------------------------------------------------------
_SPATIAL_FACTORS = ('h', 'w')


def _image_is_result(node) -> bool:
  """Whether the op's image (the tensor whose spatial dims the halo plan splits) is its
  result (image gradients), not its operand 0."""
  return bool(local_params(node).get('image_is_result'))


def _check_haloable(p, graph, node, operands) -> Layout:
  """The op's layout, or NotHaloable when its form is outside halo exchange."""
  from tf_gspmd.propagation.registry import RuleError

  image = global_shape(graph, node.outputs[0].name) if _image_is_result(node) else operands[0].shape
  if len(image) != 4:
    raise NotHaloable(
      f'{node.op} {node.name}: its image has shape {image}; halo exchange '
      'handles rank-4 (2-D spatial) ops.'
    )
  layout = Layout.of(node)
  padding = _attr(node, 'padding', 'VALID')
  if padding not in ('SAME', 'VALID', 'EXPLICIT'):
    raise NotHaloable(f'{node.op} {node.name}: padding {padding!r} is not supported.')
  try:
    from tf_gspmd.graph_rewrite import factors

    factors.rule_for(p, node, graph)
  except RuleError as e:  # pooling over batch or channels
    raise NotHaloable(str(e)) from e
  return layout


def _rule_layouts(p, graph, node, operands, layout: Layout):
  """The rule's layouts (`factors.choose_layouts`, spatial factors split with halos) and the
  halo plan of each spatial dim. A spatial dim `_plan_dims` cannot halo-partition (no
  output rows) is chosen whole instead (`_plan_dims` warns)."""
  from tf_gspmd.graph_rewrite import factors

  rule = factors.rule_for(p, node, graph)
  windows = [rule.windows[n] for n in _SPATIAL_FACTORS]
  on_result = _image_is_result(node)
  image = node.outputs[0].name if on_result else node.inputs[0]
  whole = []
  while True:
    chosen = factors.choose_layouts(p, graph, node, operands, rule, windowed=True, whole=whole)
    spec = (chosen.results[0] if on_result else chosen.operands[0]).spec
    dims = _plan_dims(p, node, spec, layout, windows, image)
    unfit = [n for n, sd in zip(_SPATIAL_FACTORS, dims) if sd.axes != chosen.axes(n)]
    if not unfit:
      return chosen, dims
    whole += unfit


def _resharded(p, node, operands, chosen) -> List[Local]:
  """Operands in the rule's layouts; auxiliary ones (sizes vectors) as they are."""
  return [
    value if need is None else p.reshard(value, need, f'operand {i} of {node.op}')
    for i, (need, value) in enumerate(zip(chosen.operands, operands))
  ]


def _finish(p, graph, node, tensor, layout: NamedSharding) -> List[Local]:
  out = node.outputs[0].name
  value = Local(tensor, layout, global_shape(graph, out))
  check_local_shape(node, value)
  return [p.finish(graph, value, out)]


def _local_shape_const(dtype, shape) -> tf.Tensor:
  return tf.constant([int(s) for s in shape], dtype=dtype)


def _window_shape(local_shape, dims: Sequence[SpatialDim]) -> list:
  shape = [int(s) for s in local_shape]
  for sd in dims:
    shape[sd.dim] = sd.plan.span
  return shape


def _unpartial(layout: NamedSharding) -> NamedSharding:
  return NamedSharding(layout.mesh, layout.spec)


# --- the local computation of each op -------------------------------------------------------
# Each takes the operands in the rule's layouts, the chosen layouts and the halo plans, and
# returns the local result (in layout `chosen.results[0]`).
def _conv(p, node, values, chosen, dims, layout, out_shape):
  """Conv2D: the haloed input window, VALID. Split input channels sum partially: their
  padding must not take part."""
  x, f = values
  xt, ft = x.tensor, f.tensor
  if chosen.axes('c'):
    xt, ft = _mask(p, x, xt, [layout.channel]), _mask(p, f, ft, [2])
  return _emit_valid(node, [gather_window(p, xt, x.sharding, dims, 0), ft])


def _pool(p, node, values, chosen, dims, layout, out_shape):
  """MaxPool / AvgPool: rows outside the image are -inf for max; AvgPool divides by the
  real count of each window."""
  (x,) = values
  is_max = local_params(node)['form'] == 'max_pool'
  fill = uneven.identity_value('max', x.dtype) if is_max else 0
  y = _emit_valid(node, [gather_window(p, x.tensor, x.sharding, dims, fill)])
  if not is_max:
    count = _count_fraction(p, node, dims, x.sharding, y.dtype)
    if count is not None:  # y holds sum/area; the op wants sum/count
      y = tf.math.divide_no_nan(y, count)
  return y


def _conv_backprop_input(p, node, values, chosen, dims, layout, out_shape):
  """The image gradient of the own rows (`own_rows_gradient`: a halo exchange of the
  output gradient, one backprop op with explicit padding). Split output channels ('o')
  sum partially."""
  sizes, f, g = values
  gt = _mask(p, g, g.tensor, range(4))  # padding rows would reach real input rows
  ft = _mask(p, f, f.tensor, [3]) if chosen.axes('o') else f.tensor
  return _image_gradient(p, node, sizes, ft, g, gt, chosen, dims, out_shape)


def _image_gradient(p, node, sizes, ft, g: Local, gt, chosen, dims, out_shape):
  """A convolution's image gradient (inputs: sizes, filter, output gradient) of the own
  rows; when a dim yields no output rows, the window's gradient scattered back."""
  result = _unpartial(chosen.results[0])
  local = result.shard_shape(out_shape)
  gdims = _gradient_dims(dims)
  if gdims is None:
    window = _window_shape(local, dims)
    dwindow = _emit_valid(node, [_local_shape_const(sizes.dtype, window), ft, gt])
    return scatter_window(p, dwindow, result, dims)
  _check_gradient_split(node, g, dims)
  return own_rows_gradient(
    p,
    node,
    gt,
    g.sharding,
    result,
    local,
    gdims,
    lambda shape, window: [_local_shape_const(sizes.dtype, shape), ft, window],
  )


def _filter_gradient(p, node, values, chosen, dims, layout, out_shape):
  """The filter gradient (Conv2D and depthwise alike): the haloed input window against the
  local output-gradient rows, a partial sum over the batch and spatial axes."""
  x, sizes, g = values
  # Both sides are summed over batch and spatial rows: no padding may take part.
  xt = _mask(p, x, x.tensor, [layout.batch])
  gt = _mask(p, g, g.tensor, range(4))
  window = gather_window(p, xt, x.sharding, dims, 0)
  local = chosen.results[0].shard_shape(out_shape)
  return _emit_valid(node, [window, _local_shape_const(sizes.dtype, local), gt])


def _max_pool_grad(p, node, values, chosen, dims, layout, out_shape):
  """Route the local gradient rows through the haloed input window (-inf outside the
  image), then add the halo rows back into the neighbours."""
  x, y, g = values
  window = gather_window(p, x.tensor, x.sharding, dims, uneven.identity_value('max', x.dtype))
  gt = _mask(p, g, g.tensor, range(4))
  dwindow = _emit_valid(node, [window, y.tensor, gt])
  return scatter_window(p, dwindow, x.sharding, dims)


def _avg_pool_grad(p, node, values, chosen, dims, layout, out_shape):
  """Spread the local gradient rows over the window (divided by the real count for SAME),
  then the reverse halo exchange."""
  sizes, g = values
  result = _unpartial(chosen.results[0])
  gt = _mask(p, g, g.tensor, range(4))
  count = _count_fraction(p, node, dims, result, gt.dtype)
  if count is not None:  # the forward divided by the real count, not the area
    gt = tf.math.divide_no_nan(gt, count)
  local = _window_shape(result.shard_shape(out_shape), dims)
  dwindow = _emit_valid(node, [_local_shape_const(sizes.dtype, local), gt])
  return scatter_window(p, dwindow, result, dims)


def _depthwise(p, node, values, chosen, dims, layout, out_shape):
  """Output channel c * m + j stays with input channel c when channel blocks are whole,
  which the rule's compound (c, m) dim ensures."""
  x, f = values
  return _emit_valid(node, [gather_window(p, x.tensor, x.sharding, dims, 0), f.tensor])


def _depthwise_backprop_input(p, node, values, chosen, dims, layout, out_shape):
  """As `_conv_backprop_input` (channel blocks stay whole, see `_depthwise`)."""
  sizes, f, g = values
  # Padding rows of the gradient would reach real input rows; padding multipliers the sum.
  gt = _mask(p, g, g.tensor, range(4))
  return _image_gradient(p, node, sizes, f.tensor, g, gt, chosen, dims, out_shape)


# The windowed local computation of each form (the registry entry's `local_params['form']`).
_LOCAL = {
  'conv': _conv,
  'max_pool': _pool,
  'avg_pool': _pool,
  'conv_backprop_input': _conv_backprop_input,
  'filter_gradient': _filter_gradient,
  'max_pool_grad': _max_pool_grad,
  'avg_pool_grad': _avg_pool_grad,
  'depthwise': _depthwise,
  'depthwise_backprop_input': _depthwise_backprop_input,
}


@computes('windowed')
def windowed_handler(p, graph, node, operands):
  """A convolution, pooling or one of their gradients, in the layouts its rule gives.

  The rule decides every layout (batch, channel and spatial factors; reduction
  factors leave partial sums). Split spatial dims exchange halos: forward ops
  and filter gradients read the haloed input window; convolutions' image
  gradients read the output gradient's halo and compute the own rows
  (`own_rows_gradient`); pooling gradients run VALID on the local
  output-gradient rows and send the borrowed rows back (`scatter_window`).
  With a spatial dim split, the unsplit ones are padded explicitly the same way,
  so the local op runs VALID (image gradients: the op's own padding, explicit);
  with none split, the op runs as written on the local blocks (`_whole_images`).
  An op of another form (rank, data format, pooling over batch or channels) is
  computed on replicated operands with a warning.
  """
  try:
    layout = _check_haloable(p, graph, node, operands)
  except NotHaloable as e:
    p.warn_once(f'not-haloable:{node.name}', f'tf_gspmd: {e} Its operands are replicated.')
    return fallback_handler(p, graph, node, operands)
  chosen, dims = _rule_layouts(p, graph, node, operands, layout)
  values = _resharded(p, node, operands, chosen)
  out_shape = global_shape(graph, node.outputs[0].name)
  if any(sd.axes for sd in dims):
    local = _LOCAL[local_params(node)['form']](p, node, values, chosen, dims, layout, out_shape)
  else:
    local = _whole_images(p, node, values, chosen, layout, out_shape)
  return _finish(p, graph, node, local, chosen.results[0])


def _whole_images(p, node, values, chosen, layout, out_shape) -> tf.Tensor:
  """No spatial dim split (batch or channels only): the op itself, with its own padding,
  on the local blocks. No halo and no Pad copy, and the op keeps the form TF's oneDNN
  rewrite knows: its backprop-input kernels take SAME/VALID, not EXPLICIT padding, and the
  explicit form fell back to Eigen, 7x slower on ResNet50's image gradients."""
  inputs = [value.tensor if value is not None else None for value in values]
  params = local_params(node)
  for i, (factor, dims) in params.get('whole_image_masks', {}).items():
    if factor is not None and not chosen.axes(factor):
      continue
    dims = [getattr(layout, dims)] if isinstance(dims, str) else dims
    inputs[i] = _mask(p, values[i], inputs[i], dims)
  sizes = params.get('sizes_operand')
  if sizes is not None:
    local = _unpartial(chosen.results[0]).shard_shape(out_shape)
    inputs[sizes] = _local_shape_const(values[sizes].tensor.dtype, local)
  op = emit.emit_node(node, inputs, name=node.name + '/gspmd/local')
  return op.outputs[0]
