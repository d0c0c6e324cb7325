"""Ops with a rule whose local computation is not the op itself on local blocks.

Their layouts come from their propagation rule (`factors.choose_layouts`,
the same choice `factors.factor_handler` makes); only the local computation
is written here:

- Reshape: its shape operand holds the global shape; locally it reshapes to
  this partition's block of the result.
- Squeeze: the dims it removes named (a block of a split dim may be 1 where the dim is not).
- BiasAddGrad: emitted as the Sum it is (see `bias_add_grad_handler`).
- Fill, BroadcastTo, Tile: their shape operands hold global shapes; locally
  they fill, broadcast or tile to this partition's block of the result.
"""

from __future__ import annotations

import tensorflow as tf
from tensorflow.core.framework import attr_value_pb2

from tf_gspmd.graph import emit
from tf_gspmd.graph_rewrite import factors, uneven
from tf_gspmd.graph_rewrite.handlers import check_local_shape, computes, emit_outputs, global_shape
from tf_gspmd.graph_rewrite.partitioner import Local
from tf_gspmd.propagation.rule import REDUCTION


@computes('reshape')
def reshape_handler(p, graph, node, operands):
  """Reshape: layouts from its rule (the factors both shapes share), so a sharded dim stays
  sharded wherever the split lines up with shard boundaries; locally a reshape to this
  partition's block of the result."""
  chosen = factors.choose_layouts(p, graph, node, operands)
  src = p.reshard(operands[0], chosen.operands[0], 'reshape operand')
  out_shape = global_shape(graph, node.outputs[0].name)
  local = emit.constant(chosen.results[0].shard_shape(out_shape), dtype=operands[1].dtype)
  return emit_outputs(p, graph, node, [src.tensor, local], list(chosen.results))


@computes('squeeze')
def squeeze_handler(p, graph, node, operands):
  """Squeeze on the local blocks, naming the dims it removes: without `squeeze_dims` it
  removes every dim of size 1, and a block of a split dim can be 1 where the dim is not
  (3 columns over 4 devices), which would go too."""
  chosen = factors.choose_layouts(p, graph, node, operands)
  src = p.reshard(operands[0], chosen.operands[0], 'squeeze operand')
  removed = list(node.attrs['squeeze_dims'].list.i) if 'squeeze_dims' in node.attrs else []
  if not removed:
    removed = [d for d, size in enumerate(operands[0].shape) if size == 1]
  dims = attr_value_pb2.AttrValue(list=attr_value_pb2.AttrValue.ListValue(i=removed))
  return emit_outputs(p, graph, node, [src.tensor], list(chosen.results), {'squeeze_dims': dims})


@computes('bias_add_grad')
def bias_add_grad_handler(p, graph, node, operands):
  """BiasAddGrad as the sum it is: over every dim but the channel, partial over the axes
  splitting them (the rule's reduction factors).

  Emitted as a Sum rather than a BiasAddGrad on purpose: TF's oneDNN graph
  rewrite fuses a BiasAddGrad into a Conv2DBackpropFilter reading the same
  gradient, and when collectives sit between the two (a bias gradient's
  all-reduce before the filter gradient's halo exchange) the fused node
  closes a cycle and the program cannot run.
  """
  chosen = factors.choose_layouts(p, graph, node, operands)
  dy = p.reshard(operands[0], chosen.operands[0], f'operand of {node.op}')
  (dims,) = chosen.rule.operands
  reduced = [d for d, e in enumerate(dims) if e is None or chosen.rule.kind(e) == REDUCTION]
  local = uneven.mask_padding(dy.tensor, dy.sharding, dy.shape, reduced, 0, p.backend.partition_id)
  total = tf.reduce_sum(local, axis=reduced, name=node.name)
  value = Local(total, chosen.results[0], global_shape(graph, node.outputs[0].name))
  check_local_shape(node, value)
  return [p.finish(graph, value, node.outputs[0].name)]


def _local_shape(chosen, graph, node, dtype) -> tf.Tensor:
  """This partition's shard shape of the result, as a shape operand of `dtype`."""
  shape = global_shape(graph, node.outputs[0].name)
  return tf.constant(chosen.results[0].shard_shape(shape), dtype=dtype)


@computes('fill')
def fill_handler(p, graph, node, operands):
  """Fill(dims, value): the result's layout from its rule (its users decide); fill the
  local shard shape directly."""
  chosen = factors.choose_layouts(p, graph, node, operands)
  value = p.replicate(operands[1], 'fill value').tensor
  return emit_outputs(
    p, graph, node, [_local_shape(chosen, graph, node, operands[0].dtype), value], chosen.results
  )


@computes('broadcast_to')
def broadcast_to_handler(p, graph, node, operands):
  """BroadcastTo(x, shape) in the layouts of its (broadcasting) rule: x's dims split like
  the result dims they become; broadcast to the local shard shape."""
  chosen = factors.choose_layouts(p, graph, node, operands)
  src = p.reshard(operands[0], chosen.operands[0], 'broadcast operand')
  local = _local_shape(chosen, graph, node, operands[1].dtype)
  return emit_outputs(p, graph, node, [src.tensor, local], chosen.results)


@computes('tile')
def tile_handler(p, graph, node, operands):
  """Tile(x, multiples) in the layouts of its rule.

  A tiled result dim is (copies, x's dim), copies major: a partition holds whole
  copies of x's block, or (copies split into single copies) x's own shard of
  the dim; a tiled size-1 dim is copies only. Either way the local multiple is
  the result's shard rows over x's.
  """
  chosen = factors.choose_layouts(p, graph, node, operands)
  src = p.reshard(operands[0], chosen.operands[0], 'tile operand')
  out_local = chosen.results[0].shard_shape(global_shape(graph, node.outputs[0].name))
  local_multiples = [o // s if s else 1 for o, s in zip(out_local, src.tensor.shape)]
  local = tf.constant(local_multiples, dtype=operands[1].dtype)
  return emit_outputs(p, graph, node, [src.tensor, local], chosen.results)
