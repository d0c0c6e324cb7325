"""Partitioning variable ops: every partition reads and writes its own shard.

A variable's `Local` holds this partition's shard-variable handle, the
variable's sharding and its global shape. Reads yield shards in that
sharding; values assigned are first moved to it, so a variable never changes
layout between steps.
"""

from __future__ import annotations

import tensorflow as tf

from tf_gspmd.errors import Unsupported
from tf_gspmd.graph import emit
from tf_gspmd.graph_rewrite.handlers import computes, emit_outputs, local_params
from tf_gspmd.graph_rewrite.partitioner import Local, replicated


@computes('read_variable')
def read_handler(p, graph, node, operands):
  var = operands[0]
  return emit_outputs(p, graph, node, [var.tensor], [var.sharding])


@computes('assign_variable')
def assign_handler(p, graph, node, operands):
  var, value = operands
  value = p.reshard(value, var.sharding, f'value assigned to {node.inputs[0]}')
  emit.emit_node(node, [var.tensor, value.tensor])
  return []


@computes('apply_update')
def apply_handler(p, graph, node, operands):
  """Fused optimizer updates: tensors shaped like the variable follow its layout."""
  var = operands[0]
  inputs = []
  for name, value in zip(node.inputs, operands):
    if value.dtype == tf.resource:
      if not value.sharding.is_equivalent_to(var.sharding):  # a handle cannot be resharded
        raise Unsupported(
          f'{node.op} {node.name}: slot variable {name} is sharded {value.sharding} but its '
          f'variable {node.inputs[0]} is sharded {var.sharding}; shard optimizer slots like '
          'their variables (shard_variable the slot, or leave it to propagation).'
        )
      inputs.append(value.tensor)
    elif tuple(value.shape) == tuple(var.shape) and value.shape:
      inputs.append(p.reshard(value, var.sharding, 'optimizer operand').tensor)
    else:
      inputs.append(p.replicate(value, 'optimizer scalar').tensor)
  emit.emit_node(node, inputs)
  return []


@computes('resource_gather')
def resource_gather_handler(p, graph, node, operands):
  """Embedding lookup from a variable: read the local shard, then gather like GatherV2 (in the
  layouts of the rule priced by bytes: the table all-gathered when that moves less than the
  indices or the result would)."""
  from tf_gspmd.graph_rewrite import gather

  var, indices = operands
  table = tf.raw_ops.ReadVariableOp(resource=var.tensor, dtype=node.attrs['dtype'].type)
  params = Local(table, var.sharding, var.shape)
  batch_dims = node.attrs['batch_dims'].i if 'batch_dims' in node.attrs else 0
  if batch_dims:
    raise Unsupported(f'ResourceGather {node.name}: batch_dims={batch_dims} is not supported.')
  return gather.rule_gather(p, graph, node, [params, indices], axis=0)


@computes('var_is_initialized')
def initialized_handler(p, graph, node, operands):
  return emit_outputs(p, graph, node, [operands[0].tensor], [replicated(p.mesh, 0)])


# tf.tensor_scatter_nd_* flavour of each kind of row update (the registry entry's
# `local_params['update']`); 'mul' and 'div' have none and run as the op itself with
# neutral updates for rows this partition does not hold.
_SCATTER_ND = {
  'add': tf.tensor_scatter_nd_add,
  'sub': tf.tensor_scatter_nd_sub,
  'update': tf.tensor_scatter_nd_update,
  'max': tf.tensor_scatter_nd_max,
  'min': tf.tensor_scatter_nd_min,
}


@computes('resource_scatter')
def resource_scatter_handler(p, graph, node, operands):
  """Row updates of a variable: each partition applies those that land in its rows.

  Indices are replicated; updates follow the variable on its trailing dims. When
  the variable's first dim is split, an index outside this partition's rows is
  sent to a spare row past the end of a local copy (or, for Mul/Div, given a
  neutral update), so no partition writes a row it does not hold.
  """
  from tf_gspmd.graph_rewrite import uneven
  from tf_gspmd.sharding import NamedSharding, P

  var, indices, updates = operands
  spec = var.sharding.spec
  indices = p.replicate(indices, 'scatter indices')
  idx_rank = len(indices.shape)
  updates = p.reshard(
    updates, NamedSharding(p.mesh, P(*([None] * idx_rank), *spec[1:])), 'scatter updates'
  )
  dtype = tf.as_dtype(node.attrs['dtype'].type)
  update = local_params(node)['update']
  if update in ('mul', 'div'):
    # Padding of unevenly split trailing dims would multiply or divide by zero.
    updates = Local(
      uneven.mask_padding(
        updates.tensor,
        updates.sharding,
        updates.shape,
        range(len(updates.shape)),
        1,
        p.backend.partition_id,
      ),
      updates.sharding,
      updates.shape,
    )
  if not spec.axes_of(0):
    emit.emit_node(node, [var.tensor, indices.tensor, updates.tensor])
    return []
  rows = int(var.sharding.shard_shape(var.shape)[0])
  offset = uneven.shard_offset(var.sharding, var.shape, 0, p.backend.partition_id)
  local = tf.cast(indices.tensor, tf.int32) - offset
  mine = tf.logical_and(local >= 0, tf.logical_and(local < rows, local < var.shape[0] - offset))
  if update in _SCATTER_ND:
    current = tf.raw_ops.ReadVariableOp(resource=var.tensor, dtype=dtype)
    spare = tf.zeros([1] + list(current.shape[1:]), dtype)
    target = tf.where(mine, local, rows)[..., None]
    new = _SCATTER_ND[update](tf.concat([current, spare], 0), target, updates.tensor)[:rows]
    tf.raw_ops.AssignVariableOp(resource=var.tensor, value=new, name=node.name)
    return []
  neutral = tf.ones_like(updates.tensor)
  shape = list(mine.shape) + [1] * (len(updates.shape) - idx_rank)
  masked = tf.where(tf.reshape(mine, shape), updates.tensor, neutral)
  emit.emit_node(node, [var.tensor, tf.where(mine, local, 0), masked])
  return []
