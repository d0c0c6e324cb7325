"""Partitioning variable ops: every partition reads and writes its own shard.

A variable's `Local` holds this partition's shard-variable handle, the
variable's sharding and its global shape. Reads yield shards in that
sharding; values assigned are first moved to it, so a variable never changes
layout between steps.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import tensorflow as tf

from tf_gspmd.errors import Unsupported
from tf_gspmd.graph import emit
from tf_gspmd.graph_rewrite.handlers import computes, emit_outputs, local_params
from tf_gspmd.graph_rewrite.partitioner import Local, replicated
from tf_gspmd.sharding import NamedSharding, P


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

  var, indices, updates = operands
  update = local_params(node)['update']
  summed = _summed_layouts(p, var, indices, updates) if update in _SUMMED else None
  if summed is not None and summed.cost < _rows_cost(p, var, indices, updates):
    return _scatter_summed(p, node, var, indices, updates, summed)
  spec = var.sharding.spec
  indices = p.replicate(indices, 'scatter indices')
  idx_rank = len(indices.shape)
  updates = p.reshard(
    updates, NamedSharding(p.mesh, P(*([None] * idx_rank), *spec[1:])), 'scatter updates'
  )
  dtype = tf.as_dtype(node.attrs['dtype'].type)
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


# --- linear row updates summed where the updates are --------------------------------------------
# Add and Sub: each partition may sum its own updates into rows, the sums reduce-scattered onto
# the variable's layout, in place of every partition seeing every index and update.
_SUMMED = {'add': tf.raw_ops.AssignAddVariableOp, 'sub': tf.raw_ops.AssignSubVariableOp}


@dataclasses.dataclass(frozen=True)
class _Summed:
  """Layouts of a scatter summed where the updates are, and the bytes it moves."""

  indices: NamedSharding
  updates: NamedSharding
  rows: NamedSharding  # the local sums: the variable's rows whole, partial over the index axes
  cost: int


def _rows_cost(p, var, indices, updates) -> int:
  """Bytes of the row-update path: indices replicated, updates in the variable's layout."""
  idx_rank = len(indices.shape)
  need = NamedSharding(p.mesh, P(*([None] * idx_rank), *var.sharding.spec[1:]))
  whole = NamedSharding(p.mesh, P(*([None] * idx_rank)))
  return _cost(p, indices, whole) + _cost(p, updates, need)


def _summed_layouts(p, var, indices, updates) -> Optional[_Summed]:
  """The summed path keeping the updates' index-dim axes (None if they have none)."""
  idx_rank = len(indices.shape)
  if len(updates.shape) != idx_rank + len(var.shape) - 1:
    return None  # a scalar update broadcast to every row: nothing split to keep
  idx_axes = [updates.sharding.spec.axes_of(d) for d in range(idx_rank)]
  taken = {a for axes in idx_axes for a in axes}
  if not taken:
    return None
  trailing = [
    _prefix_without(var.sharding.spec.axes_of(d), taken) for d in range(1, len(var.shape))
  ]
  idx_spec = NamedSharding(p.mesh, P(*(a or None for a in idx_axes)))
  upd_spec = NamedSharding(p.mesh, P(*(a or None for a in idx_axes + trailing)))
  rows = NamedSharding(p.mesh, P(None, *(a or None for a in trailing)), partial=tuple(taken))
  moved = p.reshard_cost(rows, var.sharding, var.shape, updates.dtype.size)[0]
  cost = _cost(p, indices, idx_spec) + _cost(p, updates, upd_spec) + moved
  return _Summed(idx_spec, upd_spec, rows, cost)


def _prefix_without(axes, taken) -> tuple:
  out = []
  for a in axes:
    if a in taken:
      break  # a dim's axes are major to minor: keep a prefix
    out.append(a)
  return tuple(out)


def _cost(p, value: Local, target: NamedSharding) -> int:
  return p.reshard_cost(value.sharding, target, value.shape, value.dtype.size)[0]


def _scatter_summed(p, node, var, indices, updates, summed: _Summed):
  """Each partition sums its updates into the variable's rows (ids in index padding dropped as
  -1), the sums are reduce-scattered onto the variable's layout and added in place."""
  from tf_gspmd.graph_rewrite import uneven

  indices = p.reshard(indices, summed.indices, 'scatter indices')
  updates = p.reshard(updates, summed.updates, 'scatter updates')
  ids = uneven.mask_padding(
    tf.cast(indices.tensor, tf.int32),
    indices.sharding,
    indices.shape,
    range(len(indices.shape)),
    -1,
    p.backend.partition_id,
  )
  sums = tf.math.unsorted_segment_sum(updates.tensor, ids, var.shape[0])
  sums = p.reshard(Local(sums, summed.rows, var.shape), var.sharding, f'{node.op} row sums')
  _SUMMED[local_params(node)['update']](resource=var.tensor, value=sums.tensor, name=node.name)
  return []
