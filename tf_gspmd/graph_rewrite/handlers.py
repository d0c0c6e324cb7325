"""Per-op partitioning helpers and the generic handlers.

Hand-written local computations (registered by name with `@computes`, named by
the op's registry entry) cover ops whose attributes or constant inputs carry
global shapes, and values known statically; every other op is partitioned
from its propagation rule by `factors.factor_handler`, or, when it has none,
computed on replicated operands (`fallback_handler`) with one warning naming
it. `dispatch.lookup` picks among them.
"""

from __future__ import annotations

import random
from typing import Any, Callable, Dict, List, Mapping

import numpy as np
import tensorflow as tf
from tensorflow.core.framework import attr_value_pb2

from tf_gspmd.errors import Unsupported
from tf_gspmd.graph import emit, ir
from tf_gspmd.graph_rewrite.partitioner import Local, Partitioner, replicated

Handler = Callable[[Partitioner, ir.Graph, ir.Node, List[Local]], List[Local]]
# Hand-written local computations by name; a registry entry names its own (`Entry.local`).
LOCAL: Dict[str, Handler] = {}


def computes(name: str):
  """Register the decorated function as the local computation called `name`."""

  def register(fn):
    if name in LOCAL:
      raise ValueError(f'two local computations are called {name!r}')
    LOCAL[name] = fn
    return fn

  return register


def hand_written() -> Dict[str, Handler]:
  """Op type -> its hand-written local computation, for every registry entry naming one."""
  from tf_gspmd.propagation import registry

  return {e.op_type: LOCAL[e.local] for e in registry.entries() if e.local is not None}


def local_params(node: ir.Node) -> Mapping[str, Any]:
  """What the registry entry of `node`'s op type tells its local computation."""
  from tf_gspmd.propagation import registry

  return registry.entry_of(node.op).local_params


# --- helpers ------------------------------------------------------------------
def global_shape(graph: ir.Graph, tensor: str) -> tuple:
  shape = graph.tensor(tensor).shape
  if shape is None or None in shape:
    raise Unsupported(
      f'tensor {tensor} has no static shape ({shape}); tf_gspmd partitions static shapes only. '
      'Give the tf.function fully defined input shapes.'
    )
  return tuple(int(d) for d in shape)


def emit_outputs(
  p: Partitioner,
  graph: ir.Graph,
  node: ir.Node,
  inputs,
  shardings,
  attrs=None,
  finish=True,
  op_type=None,
) -> List[Local]:
  """Emit `node` (as `op_type` if given) on local `inputs`; wrap outputs with `shardings`."""
  op = emit.emit_node(
    node, inputs, attrs=attrs, op_type=op_type, name=node.name + '/gspmd/local' if op_type else None
  )
  outs = []
  for t, tensor, sharding in zip(node.outputs, op.outputs, shardings):
    value = Local(tensor, sharding, global_shape(graph, t.name))
    if tensor.shape.rank is None and tensor.dtype not in (tf.resource, tf.variant):
      # An op TF cannot infer shapes of (EagerPyFunc): the captured graph knew its shape.
      tensor.set_shape(sharding.shard_shape(value.shape))
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
      f'{node.op}; please report it.'
    )


def static_local(p: Partitioner, graph: ir.Graph, tensor: str, value: np.ndarray) -> Local:
  """A value known before run time, emitted as a replicated constant."""
  return Local(emit.constant(value), replicated(p.mesh, np.ndim(value)), tuple(np.shape(value)))


# --- values known statically, and pure data movement ------------------------------
@computes('static')
def static_handler(p, graph, node, operands):
  """Values known before run time (constants, shape arithmetic): the global value,
  then sliced to its sharding."""
  values = [p.static_value(graph, t.name) for t in node.outputs]
  if any(v is None for v in values):
    if _float_constant(node):  # one op per value and graph (emit.constant)
      tensor = node.outputs[0].name
      value = tf.make_ndarray(node.attrs['value'].tensor)
      return [_finish_static(p, graph, static_local(p, graph, tensor, value), tensor)]
    if not node.inputs:  # a Const of a non-foldable dtype (string): emit it as it is
      return emit_outputs(p, graph, node, [], [replicated(p.mesh, t.rank) for t in node.outputs])
    raise Unsupported(f'{node.op} {node.name}: input shape is not static.')
  return [
    _finish_static(p, graph, static_local(p, graph, t.name, v), t.name)
    for t, v in zip(node.outputs, values)
  ]


def _float_constant(node) -> bool:
  """A constant (no inputs, its value an attr) of a float dtype, which folding leaves alone."""
  return not node.inputs and 'value' in node.attrs and node.outputs[0].dtype.is_floating


def _finish_static(p, graph, value: Local, tensor: str) -> Local:
  """A static value whose IR shape is unknown keeps its (replicated) layout."""
  shape = graph.tensor(tensor).shape
  if shape is None or None in shape:
    return value
  return p.finish(graph, value, tensor)


@computes('identity')
def identity_handler(p, graph, node, operands):
  """Pass-through: the output keeps the operand's layout, then moves to its own."""
  src = operands[0]
  attrs = {}
  shape = graph.tensor(node.outputs[0].name).shape
  if (
    'shape' in node.attrs
    and not is_dynamic(node.outputs[0])
    and tuple(src.shape) != tuple(shape)
    and src.sharding.is_replicated
  ):
    # EnsureShape giving a value of run-time shape (a tf.py_function's result, computed whole
    # on every partition) its static one: the value is the whole tensor, of that shape.
    src = Local(src.tensor, replicated(p.mesh, len(shape)), tuple(shape))
  if 'shape' in node.attrs:  # EnsureShape: the local block's shape
    attrs['shape'] = attr_value_pb2.AttrValue(shape=tf.TensorShape(src.tensor.shape).as_proto())
  return emit_outputs(p, graph, node, [src.tensor], [src.sharding], attrs=attrs)


@computes('identity_n')
def identity_n_handler(p, graph, node, operands):
  """Result k is operand k, emitted as one Identity per operand. An IdentityN waits for all of
  its operands: Keras' optimizer passes every gradient of a step through one (TF's
  `custom_gradient`), a barrier that keeps them all alive until the last is computed. A plain
  step loses it to Grappler; the per-partition program runs without Grappler (see
  runtime/grappler.py), so it is not emitted: measured on an 8-layer MLP under Keras, the peak
  of live tensors in a step fell from 2.05 W to that of the same step written by hand."""
  outs = []
  for k, (out, operand) in enumerate(zip(node.outputs, operands)):
    tensor = tf.identity(operand.tensor, name=f'{node.name}/{k}')
    value = Local(tensor, operand.sharding, global_shape(graph, out.name))
    check_local_shape(node, value)
    outs.append(p.finish(graph, value, out.name))
  return outs


@computes('sharding_annotation')
def sharding_annotation_handler(p, graph, node, operands):
  """An annotation: move the value to the annotated layout; no op remains."""
  out = node.outputs[0]
  target = p.target(graph, out.name)
  moved = p.reshard(operands[0], target, f'annotation {node.name}')
  return [Local(tf.identity(moved.tensor, name=node.name), moved.sharding, moved.shape)]


@computes('no_op')
def no_op_handler(p, graph, node, operands):
  emit.emit_node(node, [])
  return []


# --- values of dynamic shape: replicated ---------------------------------------------------
def is_dynamic(t: ir.Tensor) -> bool:
  return t.dtype not in (tf.resource, tf.variant) and (t.shape is None or None in t.shape)


def dynamic_handler(p, graph, node, operands):
  """A result whose shape is only known at run time (a loop's tf.range, a Where) is
  computed whole on every partition; it can only stay replicated."""
  inputs = [
    p.replicate(o, 'dynamic-shape op').tensor if o.dtype != tf.resource else o.tensor
    for o in operands
  ]
  op = emit.emit_node(node, inputs, attrs=shared_seed_attrs(node))  # a random op of dynamic shape
  for t, out in zip(op.outputs, node.outputs):
    if not is_dynamic(out) and t.dtype not in (tf.resource, tf.variant):
      t.set_shape(out.shape)  # a static result of dynamic operands: as the captured graph knew
  return [
    Local(
      t,
      replicated(p.mesh, 0 if out.shape is None else len(out.shape)),
      tuple(out.shape) if out.shape is not None else (),
    )
    for t, out in zip(op.outputs, node.outputs)
  ]


# --- no rule: compute on replicated operands ------------------------------------------
def fallback_handler(p, graph, node, operands):
  """Gather operands to replicated, compute, slice the result back. Never wrong."""
  from tf_gspmd.propagation import registry

  if registry.lookup(node.op) is not None:  # else propagation said it already, for the op type
    p.warn_once(
      node.op,
      f'tf_gspmd: op type {node.op} (e.g. {node.name}) has no partitioning '
      'rule; its operands are replicated (all-gathered) to compute it (said once per op type).',
      per_process=True,
    )
  inputs = [p.replicate(o, f'{node.op} has no rule').tensor for o in operands]
  return emit_outputs(
    p, graph, node, inputs, [replicated(p.mesh, t.rank or 0) for t in node.outputs]
  )


def _removed(op_def) -> bool:
  """Op types TF removed (RandomCrop, RandomPoisson): no graph of this TF can hold them."""
  return (
    op_def.HasField('deprecation') and op_def.deprecation.version <= tf.version.GRAPH_DEF_VERSION
  )


def _seeded_stateful_ops() -> tuple:
  """Op types TF marks stateful that draw from a seed (`seed`, `seed2` attrs), from their OpDefs."""
  from tf_gspmd.graph import static_values

  found = []
  for op_type in dir(tf.raw_ops):
    op_def = None if op_type.startswith('_') else static_values.op_def(op_type)
    if op_def is None or not op_def.is_stateful or _removed(op_def):
      continue
    outputs_data = not any(
      a.type in (tf.resource.as_datatype_enum, tf.string.as_datatype_enum)
      for a in op_def.output_arg
    )  # queues hand out handles, not draws
    if outputs_data and {'seed', 'seed2'} <= {a.name for a in op_def.attr}:
      found.append(op_type)
  return tuple(found)


SEEDED_STATEFUL_OPS = _seeded_stateful_ops()


def shared_seed_attrs(node: ir.Node) -> Dict[str, attr_value_pb2.AttrValue]:
  """Seeds that make every partition's copy of a stateful random op draw the same stream.

  TF gives a stateful random op with seed = seed2 = 0 a fresh random seed per
  kernel, and each partition runs its own kernel: unchanged, the partitions
  would hold pieces of different random tensors. Each such op gets one random
  (seed, seed2) pair here, drawn when the program is built and shared by the
  per-partition program every device runs: the partitions draw one global
  stream, and the kernels' state still advances from call to call, as TF's
  does. Ops the user seeded (op or global seed) keep their seeds: their values
  match the unpartitioned function exactly.
  """
  if node.op not in SEEDED_STATEFUL_OPS or 'seed' not in node.attrs:
    return {}
  if node.attrs['seed'].i or node.attrs['seed2'].i:
    return {}
  draw = random.SystemRandom()
  return {k: attr_value_pb2.AttrValue(i=draw.randrange(1, 2**31)) for k in ('seed', 'seed2')}


@computes('random')
def random_handler(p, graph, node, operands):
  """Random values: generate the global tensor on every partition, then keep this
  partition's shard. Stateless ops give the same values everywhere from the same
  seed; stateful ones draw one stream on all partitions (`shared_seed_attrs`).

  This is what the ops' rules say (`propagation/ops_random.py`): operands read
  whole, results free (each takes its users' layout, a local slice of the
  draw), so the handler makes no layout decision that `factors.choose_layouts`
  could make differently (which it cannot import: factors imports this module).
  """
  inputs = [p.replicate(o, f'{node.op} reads its operands whole').tensor for o in operands]
  return emit_outputs(
    p,
    graph,
    node,
    inputs,
    [replicated(p.mesh, t.rank or 0) for t in node.outputs],
    attrs=shared_seed_attrs(node),
  )


# --- shape-carrying ops ----------------------------------------------------------------
def _shape_input(p, graph, node, index) -> np.ndarray:
  value = p.static_value(graph, node.inputs[index])
  if value is None:
    raise Unsupported(
      f'{node.op} {node.name}: its shape input {node.inputs[index]} is not known before run '
      'time; tf_gspmd needs static shapes to partition it.'
    )
  return value
