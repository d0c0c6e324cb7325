"""Per-op partitioning helpers and the generic handlers.

Hand-written handlers (registered with `@handles`) cover ops whose attributes
or constant inputs carry global shapes, and values known statically; every
other op is partitioned from its propagation rule by `factors.factor_handler`,
or, when it has none, computed on replicated operands (`fallback_handler`)
with one warning naming it. `dispatch.lookup` picks among them.
"""

from __future__ import annotations

from typing import Callable, Dict, List

import numpy as np
import tensorflow as tf
from tensorflow.core.framework import attr_value_pb2

from tf_gspmd.graph import emit, ir
from tf_gspmd.graph_rewrite.partitioner import Local, Partitioner, replicated
from tf_gspmd.sharding import NamedSharding, P

Handler = Callable[[Partitioner, ir.Graph, ir.Node, List[Local]], List[Local]]
HANDLERS: Dict[str, Handler] = {}


def handles(*op_types: str):
  def register(fn):
    for t in op_types:
      HANDLERS[t] = fn
    return fn
  return register


# --- helpers ------------------------------------------------------------------
def global_shape(graph: ir.Graph, tensor: str) -> tuple:
  shape = graph.tensor(tensor).shape
  if shape is None or None in shape:
    raise ValueError(
        f'tensor {tensor} has no static shape ({shape}); tf_gspmd partitions static shapes only. '
        'Give the tf.function fully defined input shapes.')
  return tuple(int(d) for d in shape)


def emit_outputs(p: Partitioner, graph: ir.Graph, node: ir.Node, inputs, shardings,
                 attrs=None, finish=True, op_type=None) -> List[Local]:
  """Emit `node` (as `op_type` if given) on local `inputs`; wrap outputs with `shardings`."""
  op = emit.emit_node(node, inputs, attrs=attrs, op_type=op_type,
                      name=node.name + '/gspmd/local' if op_type else None)
  outs = []
  for t, tensor, sharding in zip(node.outputs, op.outputs, shardings):
    value = Local(tensor, sharding, global_shape(graph, t.name))
    check_local_shape(node, value)
    outs.append(p.finish(graph, value, t.name) if finish else value)
  return outs


def check_local_shape(node: ir.Node, value: Local) -> None:
  """Refuse a local result whose shape is not the shard shape its layout implies.

  A handler that got a shape-carrying input wrong would otherwise hand
  consumers a tensor that is silently not what its sharding says.
  """
  if value.tensor.dtype in (tf.resource, tf.variant):
    return
  expected = tuple(value.sharding.shard_shape(value.shape))
  if tuple(value.tensor.shape) != expected:
    raise ValueError(
        f'tf_gspmd: partitioning {node.op} {node.name} gave a local shape '
        f'{tuple(value.tensor.shape)}, but its global shape {value.shape} under '
        f'{value.sharding} needs {expected}. This is a bug in the partitioning rule for '
        f'{node.op}; please report it.')


def static_local(p: Partitioner, graph: ir.Graph, tensor: str, value: np.ndarray) -> Local:
  """A value known before run time, emitted as a replicated constant."""
  return Local(tf.constant(value), replicated(p.mesh, np.ndim(value)), tuple(np.shape(value)))


# --- values known statically, and pure data movement ------------------------------
@handles('Const', 'Shape', 'ShapeN', 'Size', 'Rank')
def static_handler(p, graph, node, operands):
  """Values known before run time (constants, shape arithmetic): the global value,
  then sliced to its sharding."""
  values = [p.static_value(graph, t.name) for t in node.outputs]
  if any(v is None for v in values):
    if node.op == 'Const':  # a non-foldable dtype (float, string): emit it as it is
      return emit_outputs(p, graph, node, [], [replicated(p.mesh, t.rank) for t in node.outputs])
    raise ValueError(f'{node.op} {node.name}: input shape is not static.')
  return [_finish_static(p, graph, static_local(p, graph, t.name, v), t.name)
          for t, v in zip(node.outputs, values)]


def _finish_static(p, graph, value: Local, tensor: str) -> Local:
  """A static value whose IR shape is unknown keeps its (replicated) layout."""
  shape = graph.tensor(tensor).shape
  if shape is None or None in shape:
    return value
  return p.finish(graph, value, tensor)


@handles('Identity', 'Snapshot', 'StopGradient', 'PreventGradient', 'EnsureShape',
         'CheckNumerics')
def identity_handler(p, graph, node, operands):
  """Pass-through: the output keeps the operand's layout, then moves to its own."""
  src = operands[0]
  attrs = {}
  if node.op == 'EnsureShape':
    attrs['shape'] = attr_value_pb2.AttrValue(
        shape=tf.TensorShape(src.tensor.shape).as_proto())
  return emit_outputs(p, graph, node, [src.tensor], [src.sharding], attrs=attrs)


@handles('IdentityN')
def identity_n_handler(p, graph, node, operands):
  return emit_outputs(p, graph, node, [o.tensor for o in operands], [o.sharding for o in operands])


@handles('XlaSharding')
def sharding_annotation_handler(p, graph, node, operands):
  """An annotation: move the value to the annotated layout; no op remains."""
  out = node.outputs[0]
  target = p.target(graph, out.name)
  moved = p.reshard(operands[0], target, f'annotation {node.name}')
  return [Local(tf.identity(moved.tensor, name=node.name), moved.sharding, moved.shape)]


@handles('NoOp')
def no_op_handler(p, graph, node, operands):
  emit.emit_node(node, [])
  return []


# --- values of dynamic shape: replicated ---------------------------------------------------
def is_dynamic(t: ir.Tensor) -> bool:
  return t.dtype not in (tf.resource, tf.variant) and (t.shape is None or None in t.shape)


def dynamic_handler(p, graph, node, operands):
  """A result whose shape is only known at run time (a loop's tf.range, a Where) is
  computed whole on every partition; it can only stay replicated."""
  inputs = [p.replicate(o, 'dynamic-shape op').tensor if o.dtype != tf.resource else o.tensor
            for o in operands]
  op = emit.emit_node(node, inputs)
  return [Local(t, replicated(p.mesh, 0 if out.shape is None else len(out.shape)),
                tuple(out.shape) if out.shape is not None else ())
          for t, out in zip(op.outputs, node.outputs)]


# --- no rule: compute on replicated operands ------------------------------------------
def fallback_handler(p, graph, node, operands):
  """Gather operands to replicated, compute, slice the result back. Never wrong."""
  p.warn_once(node.op, f'tf_gspmd: op type {node.op} (e.g. {node.name}) has no partitioning '
                       'rule; its operands are replicated (all-gathered) to compute it.')
  inputs = [p.replicate(o, f'{node.op} has no rule').tensor for o in operands]
  return emit_outputs(p, graph, node, inputs,
                      [replicated(p.mesh, t.rank or 0) for t in node.outputs])


@handles('RandomUniform', 'RandomStandardNormal', 'TruncatedNormal', 'RandomUniformInt',
         'StatelessRandomUniformV2', 'StatelessRandomNormalV2', 'StatelessTruncatedNormalV2',
         'StatelessRandomUniformIntV2', 'StatelessRandomUniformFullIntV2',
         'StatelessRandomGetKeyCounter', 'StatelessRandomGetKeyCounterAlg',
         'StatelessRandomGetAlg', 'RandomShuffle')
def random_handler(p, graph, node, operands):
  """Random values: generate the global tensor everywhere (same seeds give the same
  values on every partition), then keep this partition's shard."""
  inputs = [p.replicate(o).tensor for o in operands]
  return emit_outputs(p, graph, node, inputs,
                      [replicated(p.mesh, t.rank or 0) for t in node.outputs])


# --- shape-carrying ops ----------------------------------------------------------------
def _shape_input(p, graph, node, index) -> np.ndarray:
  value = p.static_value(graph, node.inputs[index])
  if value is None:
    raise ValueError(
        f'{node.op} {node.name}: its shape input {node.inputs[index]} is not known before run '
        'time; tf_gspmd needs static shapes to partition it.')
  return value


@handles('Fill')
def fill_handler(p, graph, node, operands):
  """Fill(dims, value): fill the local shard shape directly."""
  out = node.outputs[0].name
  target = p.target(graph, out)
  shape = global_shape(graph, out)
  local_dims = tf.constant(target.shard_shape(shape), dtype=operands[0].dtype)
  value = p.replicate(operands[1]).tensor
  return emit_outputs(p, graph, node, [local_dims, value], [target], finish=False)


@handles('BroadcastTo')
def broadcast_to_handler(p, graph, node, operands):
  out = node.outputs[0].name
  target = p.target(graph, out)
  shape = global_shape(graph, out)
  src = operands[0]
  offset = len(shape) - len(src.shape)
  spec = [target.spec[offset + d] if src.shape[d] == shape[offset + d] else None
          for d in range(len(src.shape))]
  src = p.reshard(src, NamedSharding(p.mesh, P(*spec)), 'broadcast operand')
  local = tf.constant(target.shard_shape(shape), dtype=operands[1].dtype)
  return emit_outputs(p, graph, node, [src.tensor, local], [target], finish=False)


def reshape_groups(in_shape, out_shape):
  """Split a reshape into groups of input and output dims with equal products."""
  groups, i, j = [], 0, 0
  while i < len(in_shape) or j < len(out_shape):
    gi, gj = [i], [j] if j < len(out_shape) else []
    if i >= len(in_shape):
      groups.append(([], [j]))
      j += 1
      continue
    if j >= len(out_shape):
      groups.append(([i], []))
      i += 1
      continue
    a, b = in_shape[i], out_shape[j]
    i, j = i + 1, j + 1
    while a != b:
      if a < b:
        a *= in_shape[i]
        gi.append(i)
        i += 1
      else:
        b *= out_shape[j]
        gj.append(j)
        j += 1
    groups.append((gi, gj))
  return groups


def reshape_layouts(mesh, in_shape, out_shape, target: NamedSharding):
  """(input spec, output spec) for which a local reshape is exact, close to `target`.

  Within a group of merged/split dims only the major-most dim may be sharded,
  by the same axes on both sides, and only where those axes divide both sizes
  evenly; a group of one dim on each side passes any sharding, uneven too.
  """
  in_spec, out_spec = [None] * len(in_shape), [None] * len(out_shape)
  for gi, gj in reshape_groups(list(in_shape), list(out_shape)):
    if not gi or not gj:
      continue
    # Size-1 dims hold no data: the group's layout is set by its first real dim.
    major_in = next((d for d in gi if in_shape[d] > 1), gi[0])
    major_out = next((d for d in gj if out_shape[d] > 1), gj[0])
    if [d for d in gi if in_shape[d] > 1] == [major_in] and \
        [d for d in gj if out_shape[d] > 1] == [major_out]:
      in_spec[major_in] = out_spec[major_out] = target.spec[major_out]  # one real dim each side
      continue
    axes = target.spec.axes_of(major_out)
    tiles = mesh.axes_size(axes)
    sharded_other = any(target.spec[d] is not None for d in gj if d != major_out)
    if axes and not sharded_other and in_shape[major_in] % tiles == 0 and \
        out_shape[major_out] % tiles == 0:
      in_spec[major_in] = out_spec[major_out] = target.spec[major_out]
  return NamedSharding(mesh, P(*in_spec)), NamedSharding(mesh, P(*out_spec))


@handles('Tile')
def tile_handler(p, graph, node, operands):
  """Tile(x, multiples): dims tiled once follow the target; tiling a size-1 dim gives
  the local row count directly; other tiled dims are computed whole."""
  out = node.outputs[0].name
  shape, src = global_shape(graph, out), operands[0]
  target = p.target(graph, out)
  multiples = _shape_input(p, graph, node, 1)
  in_spec, out_spec, local_multiples = [], [], []
  for d, m in enumerate(multiples):
    if m == 1:
      in_spec.append(target.spec[d])
      out_spec.append(target.spec[d])
      local_multiples.append(1)
    elif src.shape[d] == 1:
      in_spec.append(None)
      out_spec.append(target.spec[d])
      local_multiples.append(target.shard_shape(shape)[d])
    else:
      in_spec.append(None)
      out_spec.append(None)
      local_multiples.append(int(m))
  src = p.reshard(src, NamedSharding(p.mesh, P(*in_spec)), 'tile operand')
  local = tf.constant(local_multiples, dtype=operands[1].dtype)
  return emit_outputs(p, graph, node, [src.tensor, local], [NamedSharding(p.mesh, P(*out_spec))])


@handles('Reshape')
def reshape_handler(p, graph, node, operands):
  out = node.outputs[0].name
  in_shape, out_shape = operands[0].shape, global_shape(graph, out)
  target = p.target(graph, out)
  in_layout, out_layout = reshape_layouts(p.mesh, in_shape, out_shape, target)
  src = p.reshard(operands[0], in_layout, 'reshape operand')
  local = tf.constant(out_layout.shard_shape(out_shape), dtype=operands[1].dtype)
  return emit_outputs(p, graph, node, [src.tensor, local], [out_layout])


@handles('BiasAddGrad')
def bias_add_grad_handler(p, graph, node, operands):
  """BiasAddGrad as the sum it is: over every dim but the channel, in dy's layout.

  Emitted as a Sum rather than a BiasAddGrad on purpose: TF's oneDNN graph
  rewrite fuses a BiasAddGrad into a Conv2DBackpropFilter reading the same
  gradient, and when collectives sit between the two (a bias gradient's
  all-reduce before the filter gradient's halo exchange) the fused node
  closes a cycle and the program cannot run.
  """
  from tf_gspmd.graph_rewrite import uneven  # pylint: disable=g-import-not-at-top
  dy = operands[0]
  rank = len(dy.shape)
  fmt = node.attrs['data_format'].s.decode() if 'data_format' in node.attrs else 'NHWC'
  channel = 1 if fmt.startswith('NC') and rank > 2 else rank - 1
  reduced = [d for d in range(rank) if d != channel]
  partial = tuple(a for d in reduced for a in dy.sharding.spec.axes_of(d))
  local = uneven.mask_padding(dy.tensor, dy.sharding, dy.shape, reduced, 0,
                              p.backend.partition_id)
  total = tf.reduce_sum(local, axis=reduced, name=node.name)
  value = Local(total, NamedSharding(p.mesh, P(dy.sharding.spec[channel]), partial),
                global_shape(graph, node.outputs[0].name))
  check_local_shape(node, value)
  return [p.finish(graph, value, node.outputs[0].name)]


@handles('FusedBatchNorm', 'FusedBatchNormV2', 'FusedBatchNormV3', 'FusedBatchNormGrad',
         'FusedBatchNormGradV2', 'FusedBatchNormGradV3')
def fused_batch_norm_handler(p, graph, node, operands):
  """Fused batch norm and its gradient with channels split and N, H, W whole.

  In training the op reduces over N, H and W itself, so those dims must be
  whole on each partition; per-channel work splits freely over the channel dim.
  """
  fmt = node.attrs['data_format'].s.decode() if 'data_format' in node.attrs else 'NHWC'
  image_rank = len(operands[0].shape)
  channel = 1 if fmt.startswith('NC') else image_rank - 1
  axes = operands[0].sharding.spec.axes_of(channel)
  if axes and operands[0].shape[channel] % p.mesh.axes_size(axes):
    axes = ()  # uneven channel shards would feed padding into the op's statistics
  image = NamedSharding(p.mesh, P(*[axes or None if d == channel else None
                                    for d in range(image_rank)]))
  vector = NamedSharding(p.mesh, P(axes or None))
  inputs = []
  for value in operands:
    layout = image if len(value.shape) == image_rank else (
        vector if len(value.shape) == 1 and value.shape[0] == operands[0].shape[channel]
        else replicated(p.mesh, len(value.shape)))
    inputs.append(p.reshard(value, layout, f'{node.op} operand').tensor)
  outs = [image if (t.shape is not None and len(t.shape) == image_rank) else
          (vector if t.shape is not None and len(t.shape) == 1 and
           t.shape[0] == operands[0].shape[channel] else replicated(p.mesh, len(t.shape or ())))
          for t in node.outputs]
  op = emit.emit_node(node, inputs)
  results = []
  for t, tensor, layout in zip(node.outputs, op.outputs, outs):
    if t.shape is None or None in t.shape:  # reserve spaces of unknown shape: kept as they are
      results.append(Local(tensor, replicated(p.mesh, 0 if t.shape is None else len(t.shape)),
                           tuple(t.shape or ())))
      continue
    value = Local(tensor, layout, global_shape(graph, t.name))
    check_local_shape(node, value)
    results.append(p.finish(graph, value, t.name))
  return results
