"""Partitioning windowed ops (convolutions, pooling and their gradients) with halo exchange.

A spatial dim split over mesh axes stays split: each partition borrows the
rows its output window reaches beyond its own shard from its neighbours
(collective-permutes along those axes), concatenates [left | local | right],
cuts out its window with a slice whose start comes from a table indexed by
partition id, replaces the rows outside the image (padding of the op, the
padding of ceil-sized shards) by the op's identity (0 for sums, -inf for
max), and runs the op with VALID padding on the window. The geometry is
`trimmed_halo`: `halo.halo_geometry` with halos cut to the rows that real
output rows read. A spatial dim that is not split is padded explicitly the same way
(one shard, no neighbours), so every local op runs VALID.

Image gradients of convolutions (Conv2DBackpropInput, the depthwise one)
compute only this partition's own rows: an image row collects the
output-gradient rows whose windows cover it, so those rows come from the
neighbours (a halo exchange of the output gradient,
`halo.input_gradient_geometry`) and one backprop op with explicit padding
yields the shard directly -- not the gradient of the whole haloed input
window, a third more rows for a 3x3 convolution on 8-row shards. Pooling
gradients (MaxPoolGrad needs the forward window's argmax; AvgPoolGrad its real
counts) are the exact adjoint of the forward recipe: the backprop op VALID on
the local output-gradient rows gives the gradient of the input window; the own
rows are kept and the halo rows sent back to the neighbours they were borrowed
from, which add them to theirs (a reverse halo exchange). Filter gradients are
local contributions of the haloed input window and the local output-gradient
rows: a partial sum over the batch and spatial axes, resolved by the result's
reshard.

AvgPool with SAME padding divides by the number of real elements in each
window: that count is the pooling of a 0/1 mask of the window's valid rows,
pooled the same way, so edges stay exact after the image is cut.

A halo wider than a neighbour's shard (small late feature maps, wide
kernels, strides) is assembled from several neighbours: one permute per hop
(`HaloGeometry.left_pieces` / `right_pieces`), and its gradient goes back the
same hops; the buffer stays the local shard plus the halo. Only a split dim that
yields no output at all is gathered whole first (an all-gather) with one
warning.

The halo geometry and the neighbour exchanges are `halo_exchange.py`'s.
Every layout (batch, channel, spatial) comes from the op's propagation rule
(`factors.choose_layouts` with windowed factors allowed): this module only
says how to compute locally (halos, masks, local shapes).
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import tensorflow as tf
from tensorflow.core.framework import attr_value_pb2

from tf_gspmd.graph import emit
from tf_gspmd.graph_rewrite import uneven
from tf_gspmd.graph_rewrite.halo_exchange import (
  ImageDims,
  NotHaloable,
  SpatialDim,
  along,
  check_gradient_split,
  gather_window,
  gradient_dims,
  node_attr,
  own_rows_gradient,
  scatter_window,
  spatial_dims,
  valid_rows,
)
from tf_gspmd.graph_rewrite.handlers import (
  check_local_shape,
  computes,
  fallback_handler,
  global_shape,
  local_params,
)
from tf_gspmd.graph_rewrite.partitioner import Local
from tf_gspmd.sharding import NamedSharding


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


def _emit_filter_gradient(node, inputs, name: str, attrs: Optional[dict] = None) -> tf.Tensor:
  """Conv2DBackpropFilter(input, filter_sizes, out_backprop) as `node` says it, except a 1x1
  kernel with a stride: that is the strided rows of the input against the output gradient, a
  matmul, emitted so. TF 2.21's oneDNN kernel for that form corrupts the heap (a double free or
  a segfault, unpartitioned too: `tf.raw_ops.Conv2DBackpropFilter` with filter [1, 1, 12, 1],
  strides 2, on a [3, 10, 8, 12] input; fine with TF_ENABLE_ONEDNN_OPTS=0), and a shard shape
  must not meet it."""
  x, sizes, g = inputs
  if local_params(node).get('strided_pointwise_as_matmul') and _strided_pointwise(node, sizes):
    return _pointwise_filter_gradient(node, x, g, name)
  return emit.emit_node(node, inputs, attrs=attrs, name=name).outputs[0]


def _strided_pointwise(node, sizes: tf.Tensor) -> bool:
  """A 1x1 kernel with a stride above 1, NHWC, no explicit padding."""
  kernel = tf.get_static_value(sizes)
  strides = list(node.attrs['strides'].list.i)
  fmt = node.attrs['data_format'].s if 'data_format' in node.attrs else b'NHWC'
  explicit = node.attrs['explicit_paddings'].list.i if 'explicit_paddings' in node.attrs else []
  return (
    kernel is not None
    and list(kernel[:2]) == [1, 1]
    and fmt == b'NHWC'
    and max(strides) > 1
    and not any(explicit)
  )


def _pointwise_filter_gradient(node, x: tf.Tensor, g: tf.Tensor, name: str) -> tf.Tensor:
  """The filter gradient of a strided 1x1 convolution: every output row reads input row
  stride * i (SAME pads nothing for a 1x1 kernel), so it is those rows against the output
  gradient, summed over batch and positions."""
  _, sh, sw, _ = list(node.attrs['strides'].list.i)
  oh, ow = int(g.shape[1]), int(g.shape[2])
  rows = x[:, : (oh - 1) * sh + 1 : sh, : (ow - 1) * sw + 1 : sw, :]
  summed = tf.einsum('nhwc,nhwo->co', rows, g, name=name + '/pointwise')
  return tf.expand_dims(tf.expand_dims(summed, 0), 0, name=name)


def _count_fraction(
  p, node, dims: Sequence[SpatialDim], sharding: NamedSharding, dtype
) -> Optional[tf.Tensor]:
  """Per output element, (real elements in its window) / (window area), shaped to
  broadcast against the pooled block; None when no window reaches past the image."""
  if not any(sd.window.pad_lo or sd.window.pad_hi for sd in dims):
    return None
  mask = tf.ones([1, 1, 1, 1], dtype)
  for sd in dims:
    valid = valid_rows(p, sd, sharding)
    vector = tf.ones([sd.halo.span], dtype) if valid is None else tf.cast(valid, dtype)
    mask = mask * along(vector, sd.dim, 4)
  return _emit_valid(node, [mask], op_type='AvgPool')


def _mask(p, value: Local, tensor: tf.Tensor, dims: Sequence[int], fill=0) -> tf.Tensor:
  return uneven.mask_padding(
    tensor, value.sharding, value.shape, dims, fill, p.backend.partition_id
  )


# --- layouts from the rule ------------------------------------------------------------------
_SPATIAL_FACTORS = ('h', 'w')


def _image_is_result(node) -> bool:
  """Whether the op's image (the tensor whose spatial dims the halos split) is its
  result (image gradients), not its operand 0."""
  return bool(local_params(node).get('image_is_result'))


def _check_haloable(p, graph, node, operands) -> ImageDims:
  """The op's layout, or NotHaloable when its form is outside halo exchange."""
  from tf_gspmd.propagation.registry import RuleError

  image = global_shape(graph, node.outputs[0].name) if _image_is_result(node) else operands[0].shape
  if len(image) != 4:
    raise NotHaloable(
      f'{node.op} {node.name}: its image has shape {image}; halo exchange '
      'handles rank-4 (2-D spatial) ops.'
    )
  layout = ImageDims.of(node)
  padding = node_attr(node, 'padding', 'VALID')
  if padding not in ('SAME', 'VALID', 'EXPLICIT'):
    raise NotHaloable(f'{node.op} {node.name}: padding {padding!r} is not supported.')
  try:
    from tf_gspmd.graph_rewrite import factors

    factors.rule_for(p, node, graph)
  except RuleError as e:  # pooling over batch or channels
    raise NotHaloable(str(e)) from e
  return layout


def _rule_layouts(p, graph, node, operands, layout: ImageDims):
  """The rule's layouts (`factors.choose_layouts`, spatial factors split with halos) and the
  halo of each spatial dim. A spatial dim `spatial_dims` cannot halo-partition (no
  output rows) is chosen whole instead (`spatial_dims` warns)."""
  from tf_gspmd.graph_rewrite import factors

  rule = factors.rule_for(p, node, graph)
  windows = [rule.windows[n] for n in _SPATIAL_FACTORS]
  on_result = _image_is_result(node)
  image = node.outputs[0].name if on_result else node.inputs[0]
  whole = []
  while True:
    chosen = factors.choose_layouts(p, graph, node, operands, rule, windowed=True, whole=whole)
    spec = (chosen.results[0] if on_result else chosen.operands[0]).spec
    dims = spatial_dims(p, node, spec, layout, windows, image)
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
    shape[sd.dim] = sd.halo.span
  return shape


def _unpartial(layout: NamedSharding) -> NamedSharding:
  return NamedSharding(layout.mesh, layout.spec)


# --- the local computation of each op -------------------------------------------------------
# Each takes the operands in the rule's layouts, the chosen layouts and the halos, and
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
  gdims = gradient_dims(dims)
  if gdims is None:
    window = _window_shape(local, dims)
    dwindow = _emit_valid(node, [_local_shape_const(sizes.dtype, window), ft, gt])
    return scatter_window(p, dwindow, result, dims)
  check_gradient_split(node, g, dims)
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
  inputs = [window, _local_shape_const(sizes.dtype, local), gt]
  return _emit_filter_gradient(node, inputs, node.name + '/gspmd/window', _valid_attrs(node))


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
  if local_params(node)['form'] == 'filter_gradient':
    return _emit_filter_gradient(node, inputs, node.name + '/gspmd/local')
  op = emit.emit_node(node, inputs, name=node.name + '/gspmd/local')
  return op.outputs[0]
