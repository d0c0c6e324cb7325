"""Convolutions, pooling and batch normalization (NHWC and NCHW).

Spatial dims are windowed pass-through factors: a spatially split image stays
split through Conv2D and pooling, and the rule records the window (size,
stride, dilation, padding) from which the partitioner computes halos. A
convolution's input-channel dim is a reduction; the filter's spatial dims must
be whole. BatchNorm's statistics are reduced over batch and spatial dims,
which still pass through to its normalized output.
"""

from __future__ import annotations

from tf_gspmd.propagation.halo import WindowDim, same_padding
from tf_gspmd.propagation.registry import RuleError, attr, declare, op_types_of, register
from tf_gspmd.propagation.rule import NEED_REPLICATION, REDUCTION
from tf_gspmd.propagation.rule_builders import make_rule


def _layout(node, rank=4):
  """Positions of (batch, spatial dims..., channel) for the node's data_format."""
  fmt = attr(node, 'data_format', 'NHWC')
  if fmt.startswith('NC'):
    return 0, list(range(2, rank)), 1
  return 0, list(range(1, rank - 1)), rank - 1


def _windows(node, in_shape, kernel, spatial, names):
  """WindowDim of each spatial factor from strides, dilations, padding."""
  strides = attr(node, 'strides', [1] * len(in_shape))
  dilations = attr(node, 'dilations', [1] * len(in_shape)) or [1] * len(in_shape)
  padding = attr(node, 'padding', 'VALID')
  explicit = attr(node, 'explicit_paddings', []) or []
  out = {}
  for k, (d, name) in enumerate(zip(spatial, names)):
    size = in_shape[d]
    if size is None:
      raise RuleError(f'{node.op} {node.name}: spatial dim {d} has unknown size.')
    if padding == 'SAME':
      lo, hi = same_padding(size, kernel[k], strides[d], dilations[d])
    elif padding == 'EXPLICIT':
      lo, hi = explicit[2 * d], explicit[2 * d + 1]
    else:
      lo, hi = 0, 0
    out[name] = WindowDim(size, kernel[k], strides[d], dilations[d], lo, hi)
  return out


def _conv_dims(node, data_shape):
  b, spatial, c = _layout(node, len(data_shape))
  names = ['h', 'w', 'd'][: len(spatial)]
  return b, spatial, c, names


def _with(rank, b, spatial, c, names, batch, chan):
  dims = [None] * rank
  dims[b] = batch
  for d, n in zip(spatial, names):
    dims[d] = n
  dims[c] = chan
  return tuple(dims)


def conv(node, ctx):
  """Conv2D/Conv3D(input, filter[kh, kw, c, o]) -> [b, h', w', o]."""
  x_shape, f_shape = ctx.shape(node.inputs[0]), ctx.shape(node.inputs[1])
  b, spatial, c, names = _conv_dims(node, x_shape)
  kern = ['kh', 'kw', 'kd'][: len(spatial)]
  windows = _windows(node, x_shape, f_shape[: len(spatial)], spatial, names)
  x = _with(len(x_shape), b, spatial, c, names, 'b', 'c')
  out = _with(len(x_shape), b, spatial, c, names, 'b', 'o')
  kinds = {'c': REDUCTION, **{k: NEED_REPLICATION for k in kern}}
  return make_rule(
    [x, tuple(kern) + ('c', 'o')],
    [out],
    [x_shape, f_shape],
    [ctx.out_shape(node)],
    kinds=kinds,
    windows=windows,
  )


def _depthwise_factors(node, image_shape, f_shape):
  """(image dims, filter dims, output-gradient/output dims, sizes) of a depthwise conv.

  Output channel c * m + j is input channel c times multiplier j: the
  output's channel dim holds the factors (c, m), c major; with a multiplier
  of 1 it is plain c.
  """
  b, spatial, c, names = _conv_dims(node, image_shape)
  multiplier = f_shape[3]
  image = _with(4, b, spatial, c, names, 'b', 'c')
  out = _with(4, b, spatial, c, names, 'b', ('c', 'm') if multiplier != 1 else 'c')
  filt = ('kh', 'kw', 'c', None if multiplier == 1 else 'm')
  windows = _windows(node, image_shape, f_shape[:2], spatial, names)
  return image, filt, out, windows, {'c': image_shape[c], 'm': multiplier}, names


_KERNEL_WHOLE = {'kh': NEED_REPLICATION, 'kw': NEED_REPLICATION}


def depthwise_conv(node, ctx):
  """DepthwiseConv2dNative(input, filter[kh, kw, c, m]) -> [b, h', w', c*m]."""
  x_shape, f_shape = ctx.shape(node.inputs[0]), ctx.shape(node.inputs[1])
  x, filt, out, windows, sizes, _ = _depthwise_factors(node, x_shape, f_shape)
  return make_rule(
    [x, filt],
    [out],
    [x_shape, f_shape],
    [ctx.out_shape(node)],
    kinds=_KERNEL_WHOLE,
    windows=windows,
    sizes=sizes,
  )


def depthwise_backprop_input(node, ctx):
  """DepthwiseConv2dNativeBackpropInput(input_sizes, filter, out_backprop) -> [b, h, w, c].

  Each input channel sums the gradients of its m output channels: m is a reduction.
  """
  f_shape, g_shape = ctx.shape(node.inputs[1]), ctx.shape(node.inputs[2])
  out_shape = ctx.out_shape(node)
  x, filt, g, windows, sizes, _ = _depthwise_factors(node, out_shape, f_shape)
  return make_rule(
    [None, filt, g],
    [x],
    [None, f_shape, g_shape],
    [out_shape],
    kinds={**_KERNEL_WHOLE, 'm': REDUCTION},
    windows=windows,
    sizes=sizes,
  )


def depthwise_backprop_filter(node, ctx):
  """DepthwiseConv2dNativeBackpropFilter(input, filter_sizes, out_backprop) -> [kh, kw, c, m]:
  a sum over batch and spatial rows."""
  x_shape, g_shape = ctx.shape(node.inputs[0]), ctx.shape(node.inputs[2])
  out_shape = ctx.out_shape(node)
  x, filt, g, windows, sizes, names = _depthwise_factors(node, x_shape, out_shape)
  kinds = {**_KERNEL_WHOLE, 'b': REDUCTION, **{n: REDUCTION for n in names}}
  return make_rule(
    [x, None, g],
    [filt],
    [x_shape, None, g_shape],
    [out_shape],
    kinds=kinds,
    windows=windows,
    sizes=sizes,
  )


def conv_backprop_input(node, ctx):
  """Conv2DBackpropInput(input_sizes, filter, out_backprop) -> input gradient [b, h, w, c]."""
  f_shape, g_shape = ctx.shape(node.inputs[1]), ctx.shape(node.inputs[2])
  out_shape = ctx.out_shape(node)
  b, spatial, c, names = _conv_dims(node, out_shape)
  windows = _windows(node, out_shape, f_shape[: len(spatial)], spatial, names)
  kern = ['kh', 'kw', 'kd'][: len(spatial)]
  g = _with(len(out_shape), b, spatial, c, names, 'b', 'o')
  x = _with(len(out_shape), b, spatial, c, names, 'b', 'c')
  kinds = {'o': REDUCTION, **{k: NEED_REPLICATION for k in kern}}
  return make_rule(
    [None, tuple(kern) + ('c', 'o'), g],
    [x],
    [None, f_shape, g_shape],
    [out_shape],
    kinds=kinds,
    windows=windows,
  )


def conv_backprop_filter(node, ctx):
  """Conv2DBackpropFilter(input, filter_sizes, out_backprop) -> filter gradient [kh, kw, c, o]."""
  x_shape, g_shape = ctx.shape(node.inputs[0]), ctx.shape(node.inputs[2])
  out_shape = ctx.out_shape(node)
  b, spatial, c, names = _conv_dims(node, x_shape)
  windows = _windows(node, x_shape, out_shape[: len(spatial)], spatial, names)
  kern = ['kh', 'kw', 'kd'][: len(spatial)]
  x = _with(len(x_shape), b, spatial, c, names, 'b', 'c')
  g = _with(len(x_shape), b, spatial, c, names, 'b', 'o')
  kinds = {'b': REDUCTION, **{n: REDUCTION for n in names}, **{k: NEED_REPLICATION for k in kern}}
  return make_rule(
    [x, None, g],
    [tuple(kern) + ('c', 'o')],
    [x_shape, None, g_shape],
    [out_shape],
    kinds=kinds,
    windows=windows,
  )


def _pool_windows(node, x_shape):
  b, spatial, c = _layout(node, len(x_shape))
  ksize = attr(node, 'ksize')
  names = ['h', 'w', 'd'][: len(spatial)]
  for d in (b, c):
    if ksize[d] != 1 or attr(node, 'strides')[d] != 1:
      raise RuleError(
        f'{node.op} {node.name}: pooling over batch or channel dims is not supported.'
      )
  windows = _windows(node, x_shape, [ksize[d] for d in spatial], spatial, names)
  dims = _with(len(x_shape), b, spatial, c, names, 'b', 'c')
  return dims, windows


def pool(node, ctx):
  """MaxPool/AvgPool: batch and channel pass through, spatial dims are windowed."""
  x_shape = ctx.shape(node.inputs[0])
  dims, windows = _pool_windows(node, x_shape)
  return make_rule([dims], [dims], [x_shape], [ctx.out_shape(node)], windows=windows)


def max_pool_grad(node, ctx):
  """MaxPoolGrad(orig_input, orig_output, grad) -> input gradient; MaxPoolGradGrad alike."""
  x_shape = ctx.shape(node.inputs[0])
  dims, windows = _pool_windows(node, x_shape)
  return make_rule(
    [dims, dims, dims],
    [dims],
    [ctx.shape(t) for t in node.inputs],
    [ctx.out_shape(node)],
    windows=windows,
  )


def avg_pool_grad(node, ctx):
  """AvgPoolGrad(orig_input_shape, grad) -> input gradient."""
  out_shape = ctx.out_shape(node)
  dims, windows = _pool_windows(node, out_shape)
  return make_rule(
    [None, dims], [dims], [None, ctx.shape(node.inputs[1])], [out_shape], windows=windows
  )


def _channel_vector(shape, channels):
  """A per-channel vector operand/result ([c]), or None for an empty reserve space."""
  return ('c',) if shape is not None and len(shape) == 1 and shape[0] == channels else None


def fused_batch_norm(node, ctx):
  """FusedBatchNorm{,V2,V3}(x, scale, offset, mean, var) -> y, batch stats, reserve spaces."""
  x_shape = ctx.shape(node.inputs[0])
  b, spatial, c, names = _conv_dims(node, x_shape)
  x = _with(len(x_shape), b, spatial, c, names, 'b', 'c')
  ch = x_shape[c]
  operands = [x] + [_channel_vector(ctx.shape(t), ch) for t in node.inputs[1:]]
  results = [x] + [_channel_vector(ctx.shape(o.name), ch) for o in node.outputs[1:]]
  return make_rule(
    operands,
    results,
    [ctx.shape(t) for t in node.inputs],
    [ctx.shape(o.name) for o in node.outputs],
  )


def fused_batch_norm_grad(node, ctx):
  """FusedBatchNormGrad{,V2,V3}(dy, x, scale, reserve...) -> dx, dscale, doffset, ..."""
  x_shape = ctx.shape(node.inputs[1])
  b, spatial, c, names = _conv_dims(node, x_shape)
  x = _with(len(x_shape), b, spatial, c, names, 'b', 'c')
  ch = x_shape[c]
  operands = [x, x] + [_channel_vector(ctx.shape(t), ch) for t in node.inputs[2:]]
  results = [x] + [_channel_vector(ctx.shape(o.name), ch) for o in node.outputs[1:]]
  return make_rule(
    operands,
    results,
    [ctx.shape(t) for t in node.inputs],
    [ctx.shape(o.name) for o in node.outputs],
  )


# --- examples ---------------------------------------------------------------------------
_CONV_ATTRS = {
  'strides': [1, 1, 1, 1],
  'padding': 'SAME',
  'data_format': 'NHWC',
  'dilations': [1, 1, 1, 1],
}


def _conv_example(b):
  x = b.placeholder('x', (2, 16, 16, 3))
  f = b.placeholder('filter', (3, 3, 3, 8))
  b.op('Conv2D', [x, f], [(2, 16, 16, 8)], name='y', attrs=_CONV_ATTRS)
  return 'y'


def _depthwise_example(b):
  x = b.placeholder('x', (2, 16, 16, 3))
  f = b.placeholder('filter', (3, 3, 3, 2))
  b.op('DepthwiseConv2dNative', [x, f], [(2, 16, 16, 6)], name='y', attrs=_CONV_ATTRS)
  return 'y'


def _depthwise_bi_example(b):
  sizes = b.const([2, 16, 16, 3], name='input_sizes')
  f = b.placeholder('filter', (3, 3, 3, 2))
  g = b.placeholder('out_backprop', (2, 16, 16, 6))
  b.op(
    'DepthwiseConv2dNativeBackpropInput',
    [sizes, f, g],
    [(2, 16, 16, 3)],
    name='y',
    attrs=_CONV_ATTRS,
  )
  return 'y'


def _depthwise_bf_example(b):
  x = b.placeholder('x', (2, 16, 16, 3))
  sizes = b.const([3, 3, 3, 2], name='filter_sizes')
  g = b.placeholder('out_backprop', (2, 16, 16, 6))
  b.op(
    'DepthwiseConv2dNativeBackpropFilter',
    [x, sizes, g],
    [(3, 3, 3, 2)],
    name='y',
    attrs=_CONV_ATTRS,
  )
  return 'y'


def _conv_bi_example(b):
  sizes = b.const([2, 16, 16, 3], name='input_sizes')
  f = b.placeholder('filter', (3, 3, 3, 8))
  g = b.placeholder('out_backprop', (2, 16, 16, 8))
  b.op('Conv2DBackpropInput', [sizes, f, g], [(2, 16, 16, 3)], name='y', attrs=_CONV_ATTRS)
  return 'y'


def _conv_bf_example(b):
  x = b.placeholder('x', (2, 16, 16, 3))
  sizes = b.const([3, 3, 3, 8], name='filter_sizes')
  g = b.placeholder('out_backprop', (2, 16, 16, 8))
  b.op('Conv2DBackpropFilter', [x, sizes, g], [(3, 3, 3, 8)], name='y', attrs=_CONV_ATTRS)
  return 'y'


_POOL_ATTRS = {
  'ksize': [1, 2, 2, 1],
  'strides': [1, 2, 2, 1],
  'padding': 'VALID',
  'data_format': 'NHWC',
}


def _pool_example(op):
  def build(b):
    x = b.placeholder('x', (2, 16, 16, 8))
    b.op(op, [x], [(2, 8, 8, 8)], name='y', attrs=_POOL_ATTRS)
    return 'y'

  return build


def _max_pool_grad_example(b):
  x = b.placeholder('x', (2, 16, 16, 8))
  y = b.placeholder('y_out', (2, 8, 8, 8))
  g = b.placeholder('grad', (2, 8, 8, 8))
  b.op('MaxPoolGrad', [x, y, g], [(2, 16, 16, 8)], name='y', attrs=_POOL_ATTRS)
  return 'y'


def _avg_pool_grad_example(b):
  s = b.const([2, 16, 16, 8], name='orig_input_shape')
  g = b.placeholder('grad', (2, 8, 8, 8))
  b.op('AvgPoolGrad', [s, g], [(2, 16, 16, 8)], name='y', attrs=_POOL_ATTRS)
  return 'y'


def _bn_example(b):
  x = b.placeholder('x', (2, 8, 8, 4))
  vs = [b.placeholder(n, (4,)) for n in ('scale', 'offset', 'mean', 'variance')]
  b.op(
    'FusedBatchNormV3',
    [x] + vs,
    [(2, 8, 8, 4), (4,), (4,), (4,), (4,), (0,)],
    name='y',
    attrs={'data_format': 'NHWC', 'is_training': True},
  )
  return 'y'


def _bn_grad_example(b):
  dy = b.placeholder('dy', (2, 8, 8, 4))
  x = b.placeholder('x', (2, 8, 8, 4))
  vs = [b.placeholder(n, (4,)) for n in ('scale', 'reserve_1', 'reserve_2')]
  r3 = b.placeholder('reserve_3', (0,))
  b.op(
    'FusedBatchNormGradV3',
    [dy, x] + vs + [r3],
    [(2, 8, 8, 4), (4,), (4,), (0,), (0,)],
    name='y',
    attrs={'data_format': 'NHWC', 'is_training': True},
  )
  return 'y'


register('Conv2D', 'nn', conv, _conv_example)
register('DepthwiseConv2dNative', 'nn', depthwise_conv, _depthwise_example)
register(
  'DepthwiseConv2dNativeBackpropInput', 'nn', depthwise_backprop_input, _depthwise_bi_example
)
register(
  'DepthwiseConv2dNativeBackpropFilter', 'nn', depthwise_backprop_filter, _depthwise_bf_example
)
register('Conv2DBackpropInput', 'nn', conv_backprop_input, _conv_bi_example)
register('Conv2DBackpropFilter', 'nn', conv_backprop_filter, _conv_bf_example)
register(['MaxPool', 'AvgPool'], 'nn', pool, _pool_example('MaxPool'))
register(['MaxPoolGrad', 'MaxPoolGradGrad'], 'nn', max_pool_grad, _max_pool_grad_example)
register('AvgPoolGrad', 'nn', avg_pool_grad, _avg_pool_grad_example)
register(
  ['FusedBatchNorm', 'FusedBatchNormV2', 'FusedBatchNormV3'], 'nn', fused_batch_norm, _bn_example
)
register(
  ['FusedBatchNormGrad', 'FusedBatchNormGradV2', 'FusedBatchNormGradV3'],
  'nn',
  fused_batch_norm_grad,
  _bn_grad_example,
)


# --- properties ---------------------------------------------------------------------
# Windowed local computations (`graph_rewrite/windowed.py`): the form, whether the image
# (the tensor whose spatial dims are split with halos) is the result, the operand holding
# the result's shape, and per operand the dims whose padding must read as zero when the
# op runs on whole images ('c'/'o': only when that channel factor is split); whether a
# strided 1x1 kernel's form is computed as a matmul instead.
_ALL_DIMS = (0, 1, 2, 3)
_WINDOWED = {
  'Conv2D': dict(form='conv', whole_image_masks={0: ('c', 'channel'), 1: ('c', (2,))}),
  'MaxPool': dict(form='max_pool'),
  'AvgPool': dict(form='avg_pool'),
  'Conv2DBackpropInput': dict(
    form='conv_backprop_input',
    image_is_result=True,
    sizes_operand=0,
    whole_image_masks={1: ('o', (3,)), 2: (None, _ALL_DIMS)},
  ),
  'Conv2DBackpropFilter': dict(
    form='filter_gradient',
    # A 1x1 kernel with a stride: computed as a matmul of the strided rows (TF 2.21's oneDNN
    # kernel for that form corrupts the heap; graph_rewrite/windowed.py).
    strided_pointwise_as_matmul=True,
    sizes_operand=1,
    whole_image_masks={0: (None, 'batch'), 2: (None, _ALL_DIMS)},
  ),
  'MaxPoolGrad': dict(form='max_pool_grad', whole_image_masks={2: (None, _ALL_DIMS)}),
  'AvgPoolGrad': dict(
    form='avg_pool_grad',
    image_is_result=True,
    sizes_operand=0,
    whole_image_masks={1: (None, _ALL_DIMS)},
  ),
  'DepthwiseConv2dNative': dict(form='depthwise'),
  'DepthwiseConv2dNativeBackpropInput': dict(
    form='depthwise_backprop_input',
    image_is_result=True,
    sizes_operand=0,
    whole_image_masks={2: (None, _ALL_DIMS)},
  ),
  'DepthwiseConv2dNativeBackpropFilter': dict(
    form='filter_gradient',
    sizes_operand=1,
    whole_image_masks={0: (None, 'batch'), 2: (None, _ALL_DIMS)},
  ),
}
for _op, _params in _WINDOWED.items():
  declare(_op, local='windowed', local_params=_params)
# FusedBatchNormV3's reserve space is unshaped on CPU and read by nothing but its gradient.
declare(
  ['FusedBatchNorm', 'FusedBatchNormV2', 'FusedBatchNormV3'],
  local='batch_norm',
  unshaped_results_ok=True,
)
declare(
  ['FusedBatchNormGrad', 'FusedBatchNormGradV2', 'FusedBatchNormGradV3'],
  local='batch_norm_grad',
  unshaped_results_ok=True,
)

# --- sweep programs (testing/programs/nn.py) -----------------------------------
declare(op_types_of('nn'), sweep='nn')
