"""Partitioning gathers (embedding lookups) without gathering the table.

The layouts come from the gather's rule (`factors.choose_layouts`): the
table's gathered dim is a reduction factor, the indices' dims and the other
table dims pass through. When the table is split along the gathered axis,
each partition looks up the indices that fall in its rows, zeroes the others,
and the partial results are summed (a pending sum over the table's axes).
"""

from __future__ import annotations

from typing import List

import tensorflow as tf

from tf_gspmd.graph_rewrite import uneven
from tf_gspmd.graph_rewrite.handlers import check_local_shape, computes, global_shape
from tf_gspmd.graph_rewrite.partitioner import Local


def local_gather(
  p, params: Local, indices: Local, axis: int, batch_dims: int, name: str
) -> tf.Tensor:
  """This partition's gather of its table block: rows other partitions hold give zeros
  (their sum over the table's axes of `axis` is the gather)."""
  if not params.sharding.spec.axes_of(axis):
    # Padding of uneven index shards may hold anything: keep it in range.
    safe = tf.clip_by_value(indices.tensor, 0, params.shape[axis] - 1)
    return tf.gather(params.tensor, safe, axis=axis, batch_dims=batch_dims, name=name)
  rows = int(params.tensor.shape[axis])
  offset = uneven.shard_offset(params.sharding, params.shape, axis, p.backend.partition_id)
  local_idx = tf.cast(indices.tensor, tf.int32) - offset
  valid_rows = tf.minimum(rows, params.shape[axis] - offset)
  hit = tf.logical_and(local_idx >= 0, local_idx < valid_rows)
  picked = tf.gather(
    params.tensor,
    tf.where(hit, local_idx, tf.zeros_like(local_idx)),
    axis=axis,
    batch_dims=batch_dims,
  )
  # hit is [batch..., index dims...]; picked is [params[:axis], index dims, params[axis+1:]].
  lead = list(hit.shape[:batch_dims]) + [1] * (axis - batch_dims)
  mask_shape = lead + list(hit.shape[batch_dims:]) + [1] * (len(params.shape) - axis - 1)
  return tf.where(tf.reshape(hit, mask_shape), picked, tf.zeros_like(picked), name=name)


def rule_gather(p, graph, node, operands, axis: int, batch_dims: int = 0) -> List[Local]:
  """Gather / GatherV2 in the layouts of the op's rule (table, indices, result with a
  pending sum over the axes of the gathered dim)."""
  from tf_gspmd.graph_rewrite import factors

  chosen = factors.choose_layouts(p, graph, node, operands)
  params = p.reshard(operands[0], chosen.operands[0], f'table of {node.op}')
  indices = p.reshard(operands[1], chosen.operands[1], f'indices of {node.op}')
  local = local_gather(p, params, indices, axis, batch_dims, node.name)
  out = node.outputs[0].name
  value = Local(local, chosen.results[0], global_shape(graph, out))
  check_local_shape(node, value)
  return [p.finish(graph, value, out)]


@computes('gather_v2')
def gather_v2_handler(p, graph, node, operands):
  params = operands[0]
  axis = p.static_value(graph, node.inputs[2])
  if axis is None:
    from tf_gspmd.graph_rewrite.handlers import fallback_handler

    return fallback_handler(p, graph, node, operands)
  axis = int(axis) % len(params.shape)
  batch_dims = node.attrs['batch_dims'].i if 'batch_dims' in node.attrs else 0
  if batch_dims < 0:  # counted from the indices' rank, as TF does
    batch_dims += len(operands[1].shape)
  return rule_gather(p, graph, node, operands, axis, batch_dims)
