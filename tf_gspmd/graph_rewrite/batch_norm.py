"""FusedBatchNorm{,V2,V3} and FusedBatchNormGrad{,V2,V3}: local computation only.

The layouts come from the ops' propagation rule (`propagation/ops_nn.py`:
the image is (batch, spatial..., channel), every per-channel vector is the
channel factor) through `factors.choose_layouts`; this module says what to
compute on the local blocks.

- Inference (`is_training=False`) is elementwise per channel: the op runs as
  it is on any block. Its gradient's per-channel sums (scale and offset
  gradients) are partial sums over the axes splitting batch and spatial
  dims, combined by the result's reshard.
- Training with batch and spatial dims whole runs the op as it is.
- Training with a split batch or spatial dim uses the statistics of the
  GLOBAL batch, as GSPMD does: per-channel sums of the local block (padding
  masked) are all-reduced over the axes splitting the batch and spatial dims
  (vectors of one value per local channel, never the activations), then
  every partition normalizes its block locally. The forward pass takes the
  mean, then the sum of squared deviations from it (two small all-reduces,
  as accurate as the unpartitioned op); the gradient takes the sums of dy
  and dy * (x - mean) (one all-reduce of both stacked).
"""

from __future__ import annotations

import math
from typing import List, Sequence

import tensorflow as tf
from tensorflow.core.framework import attr_value_pb2

from tf_gspmd.graph import emit
from tf_gspmd.graph_rewrite import factors, uneven
from tf_gspmd.graph_rewrite.handlers import check_local_shape, computes, global_shape
from tf_gspmd.graph_rewrite.partitioner import Local, replicated
from tf_gspmd.propagation.registry import attr
from tf_gspmd.sharding import NamedSharding, P


def _channel_dim(node, rank: int) -> int:
  return 1 if attr(node, 'data_format', 'NHWC').startswith('NC') else rank - 1


def _operands(p, node, operands, chosen) -> List[Local]:
  """Operands resharded to the rule's layouts; auxiliary ones (empty running statistics,
  reserve space 3) whole."""
  out = []
  for i, (need, value) in enumerate(zip(chosen.operands, operands)):
    if need is None:
      out.append(p.replicate(value, f'auxiliary operand {i} of {node.op}'))
    else:
      out.append(p.reshard(value, need, f'operand {i} of {node.op}'))
  return out


def _statistic_axes(image: NamedSharding, channel: int) -> tuple:
  """Mesh axes splitting the dims the statistics reduce over (all but the channel)."""
  return tuple(a for d in range(len(image.spec)) if d != channel for a in image.spec.axes_of(d))


def _finish(p, graph, node, tensors: Sequence[tf.Tensor], layouts) -> List[Local]:
  """Wrap the local results with their layouts and move them to their targets; results of
  unknown shape (the reserve spaces TF leaves unshaped) are kept as they are."""
  out = []
  for t, tensor, layout in zip(node.outputs, tensors, layouts):
    if t.shape is None or None in t.shape:
      out.append(
        Local(
          tensor, replicated(p.mesh, 0 if t.shape is None else len(t.shape)), tuple(t.shape or ())
        )
      )
      continue
    value = Local(tensor, layout, global_shape(graph, t.name))
    check_local_shape(node, value)
    out.append(p.finish(graph, value, t.name))
  return out


def _all_reduce(p, local: tf.Tensor, spec: P, shape, over: tuple, why: str) -> tf.Tensor:
  """The sum over `over` of per-partition partial vectors laid out as `spec`."""
  partial = Local(local, NamedSharding(p.mesh, spec, over), tuple(shape))
  return p.reshard(partial, NamedSharding(p.mesh, spec), why).tensor


def _along_channel(v: tf.Tensor, rank: int, channel: int) -> tf.Tensor:
  shape = [1] * rank
  shape[channel] = -1
  return tf.reshape(v, shape)


@computes('batch_norm')
def fused_batch_norm_handler(p, graph, node, operands):
  chosen = factors.choose_layouts(p, graph, node, operands)
  x, scale, offset, mean, variance = _operands(p, node, operands, chosen)
  rank = len(x.shape)
  channel = _channel_dim(node, rank)
  over = _statistic_axes(x.sharding, channel)
  if not attr(node, 'is_training', True) or not over:
    op = emit.emit_node(node, [v.tensor for v in (x, scale, offset, mean, variance)])
    return _finish(p, graph, node, op.outputs, chosen.results)
  return _global_batch_statistics(
    p, graph, node, chosen, x, scale, offset, mean, variance, channel, over
  )


def _global_batch_statistics(
  p, graph, node, chosen, x, scale, offset, mean, variance, channel, over
):
  """Training forward with batch or spatial dims split: global statistics, local normalize."""
  rank = len(x.shape)
  reduced = [d for d in range(rank) if d != channel]
  count = math.prod(x.shape[d] for d in reduced)
  vector_spec = P(x.sharding.spec[channel])
  vector_shape = (x.shape[channel],)
  u = scale.dtype  # statistics are kept in the scale's type (float32 for half images)
  xu = tf.cast(x.tensor, u)
  local_sum = tf.reduce_sum(_mask(p, x, xu, reduced), axis=reduced)
  batch_mean = (
    _all_reduce(p, local_sum, vector_spec, vector_shape, over, f'batch sum of {node.name}') / count
  )
  centered = xu - _along_channel(batch_mean, rank, channel)
  squares = tf.reduce_sum(_mask(p, x, centered * centered, reduced), axis=reduced)
  batch_var = (
    _all_reduce(
      p, squares, vector_spec, vector_shape, over, f'sum of squared deviations of {node.name}'
    )
    / count
  )
  # The normalization itself is per element: the op in inference mode on the local block.
  inference = {
    'is_training': attr_value_pb2.AttrValue(b=False),
    'exponential_avg_factor': attr_value_pb2.AttrValue(f=1.0),
  }
  if 'exponential_avg_factor' not in node.attrs:
    del inference['exponential_avg_factor']
  op = emit.emit_node(
    node,
    [x.tensor, scale.tensor, offset.tensor, batch_mean, batch_var],
    attrs=inference,
    name=node.name + '/gspmd/normalize',
  )
  unbiased = batch_var * (count / max(count - 1, 1))
  factor = attr(node, 'exponential_avg_factor', 1.0)
  if factor != 1.0:  # running averages: the op blends its mean and variance inputs in
    running_mean = (1.0 - factor) * mean.tensor + factor * batch_mean
    running_var = (1.0 - factor) * variance.tensor + factor * unbiased
  else:
    running_mean, running_var = batch_mean, unbiased
  tensors = [op.outputs[0], running_mean, running_var, batch_mean, batch_var] + list(op.outputs[5:])
  return _finish(p, graph, node, tensors, chosen.results)


@computes('batch_norm_grad')
def fused_batch_norm_grad_handler(p, graph, node, operands):
  chosen = factors.choose_layouts(p, graph, node, operands)
  values = _operands(p, node, operands, chosen)
  dy, x = values[0], values[1]
  rank = len(x.shape)
  channel = _channel_dim(node, rank)
  over = _statistic_axes(x.sharding, channel)
  if not over:
    op = emit.emit_node(node, [v.tensor for v in values])
    return _finish(p, graph, node, op.outputs, chosen.results)
  reduced = [d for d in range(rank) if d != channel]
  # Padding rows must not reach the per-channel sums: dy's are zeroed, and x's too, since a
  # padding row of x may hold inf or NaN (a max pool's -inf over a window of padding only),
  # and 0 * inf is NaN in the sum of dy * (x - mean).
  dy_masked = _mask(p, dy, dy.tensor, reduced)
  values = [values[0], Local(_mask(p, x, x.tensor, reduced), x.sharding, x.shape)] + values[2:]
  if not attr(node, 'is_training', True):
    # dx is per element; scale and offset gradients are sums: partial over `over`.
    op = emit.emit_node(node, [dy_masked] + [v.tensor for v in values[1:]])
    layouts = [chosen.results[0]] + [
      NamedSharding(p.mesh, r.spec, over) if k in (1, 2) else r
      for k, r in enumerate(chosen.results)
      if k > 0
    ]
    return _finish(p, graph, node, op.outputs, layouts)
  return _global_batch_gradient(p, graph, node, chosen, values, dy_masked, channel, over)


def _global_batch_gradient(p, graph, node, chosen, values, dy_masked, channel, over):
  """Training gradient with batch or spatial dims split: the per-channel sums of dy and of
  dy * (x - mean) over the global batch (one all-reduce), then dx locally."""
  dy, x, scale, mean, variance = values[:5]
  rank = len(x.shape)
  reduced = [d for d in range(rank) if d != channel]
  count = math.prod(x.shape[d] for d in reduced)
  u = scale.dtype
  dyu, xu = tf.cast(dy_masked, u), tf.cast(x.tensor, u)
  inv = tf.math.rsqrt(variance.tensor + tf.cast(attr(node, 'epsilon', 1e-4), u))
  centered = xu - _along_channel(mean.tensor, rank, channel)
  local = tf.stack([tf.reduce_sum(dyu, axis=reduced), tf.reduce_sum(dyu * centered, axis=reduced)])
  sums = _all_reduce(
    p,
    local,
    P(None, x.sharding.spec[channel]),
    (2, x.shape[channel]),
    over,
    f'per-channel gradient sums of {node.name}',
  )
  sum_dy, sum_dy_centered = sums[0], sums[1]
  along = lambda v: _along_channel(v, rank, channel)  # noqa: E731
  dx = along(scale.tensor * inv) * (
    tf.cast(dy.tensor, u)
    - along(sum_dy / count)
    - centered * along(inv * inv * sum_dy_centered / count)
  )
  dx = tf.cast(dx, x.dtype, name=node.name + '/gspmd/dx')
  d_scale = tf.identity(sum_dy_centered * inv, name=node.name + '/gspmd/scale_backprop')
  d_offset = tf.identity(sum_dy, name=node.name + '/gspmd/offset_backprop')
  tensors = [dx, d_scale, d_offset]
  for t in node.outputs[3:]:  # reserve spaces: empty on CPU
    shape = t.shape if t.shape is not None and None not in t.shape else (0,)
    tensors.append(tf.zeros(shape, t.dtype))
  return _finish(p, graph, node, tensors, chosen.results)


def _mask(p, value: Local, tensor: tf.Tensor, dims) -> tf.Tensor:
  return uneven.mask_padding(tensor, value.sharding, value.shape, dims, 0, p.backend.partition_id)
