"""Values known before the program runs: constants and shape arithmetic.

Reshape targets, Fill dims, BroadcastTo shapes and gradient reduction axes
are computed in the graph from `Shape` ops and constants. All shapes are
static here, so those values are fixed; the partitioner needs them as numbers
to turn global shapes into local ones. Rather than re-implementing each op in
numpy, the foldable part of the graph is copied into a scratch graph and
evaluated by TensorFlow itself, in one run.

Stateful ops are never folded, whatever their inputs: a random op with
constant inputs gives new values on every call, and folding it would freeze
one draw into a constant. Whether an op is stateful comes from its OpDef
(`is_stateful`), so no list of such ops is kept by hand.
"""

from __future__ import annotations

import functools
from typing import Dict, List, Optional

import numpy as np
import tensorflow as tf
from tensorflow.core.framework import attr_value_pb2

# Private: TF's public API has no lookup of an op type's OpDef (its attrs, is_stateful).
from tf_gspmd.graph import emit, ir
from tf_gspmd.tf_private import kernels, op_def_registry, op_is_pure, op_is_stateful

# Ops that read only the static shape of their input, never its value.
_SHAPE_OPS = ('Shape', 'ShapeN', 'Size', 'Rank')
# Small integer/bool/float results are folded; anything else stays dynamic.
_FOLDABLE_DTYPES = (tf.int32, tf.int64, tf.bool)
MAX_ELEMENTS = 1024
# Stateless ops whose value is only given at run time.
_FED = ('Placeholder', 'PlaceholderWithDefault')


def op_def(op_type: str):
  """TF's OpDef of `op_type`, or None for a type TF does not know."""
  return op_def_registry.get(op_type)


# Whether TF's OpDef marks an op type stateful (ops it does not know count as stateful).
is_stateful = op_is_stateful


def _static_shape_value(node: ir.Node, graph: ir.Graph):
  """Outputs of a Shape-like op whose input shapes are fully known, else None."""
  shapes = [graph.tensor(t).shape for t in node.inputs]
  if any(s is None or any(d is None for d in s) for s in shapes):
    return None
  dtype = node.attrs['out_type'].type if 'out_type' in node.attrs else tf.int32.as_datatype_enum
  np_dtype = tf.as_dtype(dtype).as_numpy_dtype
  if node.op == 'Shape':
    return [np.array(shapes[0], dtype=np_dtype)]
  if node.op == 'ShapeN':
    return [np.array(s, dtype=np_dtype) for s in shapes]
  if node.op == 'Size':
    return [np.array(int(np.prod(shapes[0], dtype=np.int64)), dtype=np_dtype)]
  return [np.array(len(shapes[0]), dtype=np.int32)]


@functools.lru_cache(maxsize=None)
def _runs_on_cpu(op_type: str) -> bool:
  """Whether TF has a CPU kernel for `op_type` (a TPU or XLA op has none: a collective, a
  per-partition value such as a manual region's axis index, is never folded)."""
  try:
    return any(
      k.device_type in ('CPU', 'DEFAULT')
      for k in kernels.get_registered_kernels_for_op(op_type).kernel
    )
  except Exception:  # noqa: BLE001 (TF knows no such op)
    return False


def _foldable(node: ir.Node) -> bool:
  if node.op in _FED or node.control_inputs or node.called_functions():
    return False
  if is_stateful(node.op):  # new values (or effects) on every call: never a constant
    return False
  if not _runs_on_cpu(node.op):
    return False
  if any(t.dtype not in _FOLDABLE_DTYPES for t in node.outputs):
    return False
  # Outputs of unknown shape (BroadcastGradientArgs, Where on constants) are
  # folded too: their inputs are known and small, so they are small as well.
  return all(
    t.shape is None or None in t.shape or int(np.prod(t.shape, dtype=np.int64)) <= MAX_ELEMENTS
    for t in node.outputs
  )


def fold(graph: ir.Graph) -> Dict[str, np.ndarray]:
  """Every small int/bool tensor of `graph` computable from constants and static shapes."""
  known: Dict[str, np.ndarray] = {}
  to_evaluate = []  # nodes to evaluate in TF, in topological order
  pending = set()
  for node in graph.nodes:
    if node.op in _SHAPE_OPS:
      values = _static_shape_value(node, graph)
      if values is not None:
        known.update({ir.tensor_name(node.name, i): v for i, v in enumerate(values)})
      continue
    if node.op == 'Const' and node.outputs and node.outputs[0].dtype in _FOLDABLE_DTYPES:
      known[ir.tensor_name(node.name)] = tf.make_ndarray(node.attrs['value'].tensor)
      continue
    if not _foldable(node) or not node.outputs:
      continue
    if all(t in known or t in pending for t in node.inputs):
      to_evaluate.append(node)
      pending.update(t.name for t in node.outputs)
  if to_evaluate:
    known.update(_evaluate(to_evaluate, known))
  return known


def _evaluate(nodes, known) -> Dict[str, np.ndarray]:
  scratch = tf.Graph()
  read = {t for n in nodes for t in n.inputs}
  with scratch.as_default():
    env = {name: tf.constant(value) for name, value in known.items() if name in read}
    fetches = {}
    for node in nodes:
      op = emit.emit_node(node, [env[t] for t in node.inputs])
      for i, out in enumerate(op.outputs):
        env[ir.tensor_name(node.name, i)] = out
        fetches[ir.tensor_name(node.name, i)] = out
  with tf.compat.v1.Session(graph=scratch) as session:
    return session.run(fetches)


MAX_FOLDED_OPS = 64  # ops before a TF tensor `tensor_value` evaluates; more: not a small value


def tensor_value(t: tf.Tensor) -> Optional[np.ndarray]:
  """`t`'s value (a tensor of a TF graph being captured) where it is computed from constants
  and static shapes alone, by the rules `fold` uses: what `tf.get_static_value` knows, and
  also through the ops it does not follow (a softmax's forward function builds the
  permutation it returns for its gradient from `Range`, `Pack` and `ConcatV2`), which TF
  evaluates here in a scratch graph. None otherwise."""
  value = tf.get_static_value(t)
  if value is not None:
    return np.asarray(value)
  node_defs, known_shapes = _constant_ancestors(t)
  if node_defs is None:
    return None
  scratch = tf.Graph()
  with scratch.as_default():
    mapped = {name: tf.constant(v) for name, v in known_shapes.items()}
    graph_def = tf.compat.v1.GraphDef()
    graph_def.node.extend(node_defs)
    (out,) = tf.graph_util.import_graph_def(
      graph_def, input_map=mapped, return_elements=[t.name], name='folded'
    )
  with tf.compat.v1.Session(graph=scratch) as session:
    try:
      return np.asarray(session.run(out))
    except tf.errors.OpError:  # fails on these constants (a Range of bad limits): run time's
      return None


def _constant_ancestors(t: tf.Tensor):
  """(the NodeDefs `t` is computed by, without devices or control inputs; the values of the
  static-shape ops among them by tensor name), or (None, None) where something before `t` is
  fed, stateful, a call, not small, or more than `MAX_FOLDED_OPS` ops."""
  node_defs, known_shapes, seen, stack = [], {}, set(), [t.op]
  while stack:
    op = stack.pop()
    if op.name in seen:
      continue
    seen.add(op.name)
    if len(seen) > MAX_FOLDED_OPS or not _foldable_op(op):
      return None, None
    if op.type in _SHAPE_OPS:
      values = [tf.get_static_value(out) for out in op.outputs]
      if any(v is None for v in values):
        return None, None
      known_shapes.update({out.name: np.asarray(v) for out, v in zip(op.outputs, values)})
      continue
    node_def = tf.compat.v1.NodeDef()
    node_def.CopyFrom(op.node_def)
    node_def.device = ''
    node_def.ClearField('input')
    node_def.input.extend(i.name if i.value_index else i.op.name for i in op.inputs)
    for attr in ('_class', '_read_only_resource_inputs'):
      if attr in node_def.attr:
        del node_def.attr[attr]
    node_defs.append(node_def)
    stack.extend(i.op for i in op.inputs)
  return node_defs, known_shapes


def _foldable_op(op: tf.Operation) -> bool:
  """`_foldable`'s rules for an op of a TF graph (its control inputs dropped: a stateless
  op's value does not depend on them)."""
  if op.type in _FED or not op_is_pure(op.type, op.node_def.attr) or not _runs_on_cpu(op.type):
    return False
  return all(
    out.dtype in _FOLDABLE_DTYPES
    and out.shape.is_fully_defined()
    and out.shape.num_elements() <= MAX_ELEMENTS
    for out in op.outputs
  )


def substitute(graph: ir.Graph, values: Dict[str, np.ndarray]) -> None:
  """Read each tensor of `values` (a call result known before run time: capture's
  `LibraryConverter.known_results`) as a constant node of that value, then give the nodes
  after it the shapes TF infers from it (`refine_shapes`).

  The top level is TF's own traced graph, whose shape inference ran before capture knew what
  the calls return: the gradient of a called gather sums its slices into as many rows as the
  backward function's result says (`UnsortedSegmentSum`), a dim TF left unknown."""
  if not values:
    return
  nodes: List[ir.Node] = []
  renamed: Dict[str, str] = {}
  for node in graph.nodes:
    nodes.append(node)
    for tensor in node.outputs:
      if tensor.name in values:
        name = f'{node.name}_{tensor.index}_static_value'
        nodes.append(_constant_node(name, values[tensor.name], tensor.dtype))
        renamed[tensor.name] = ir.tensor_name(name)
  for node in nodes:
    node.inputs = [renamed.get(t, t) for t in node.inputs]
  graph.nodes = nodes
  graph.outputs = [renamed.get(t, t) for t in graph.outputs]
  graph.reindex()
  refine_shapes(graph, set(renamed.values()))


def _constant_node(name: str, value: np.ndarray, dtype) -> ir.Node:
  proto = tf.make_tensor_proto(value, dtype=dtype)
  return ir.Node(
    name=name,
    op='Const',
    inputs=[],
    outputs=[ir.Tensor(name, 0, tf.as_dtype(dtype), tuple(value.shape))],
    attrs={
      'dtype': attr_value_pb2.AttrValue(type=tf.as_dtype(dtype).as_datatype_enum),
      'value': attr_value_pb2.AttrValue(tensor=proto),
    },
  )


def refine_shapes(graph: ir.Graph, changed: set) -> None:
  """Shapes TF infers anew for the nodes reading `changed` tensors (and their readers in
  turn), from the values `fold` now knows: where a node's output dims were unknown."""
  known = fold(graph)
  changed = set(changed)
  for node in graph.nodes:
    if not any(t in changed for t in node.inputs):
      continue
    changed.update(t.name for t in node.outputs if t.name in known)  # values passed on
    if _fully_shaped(node):
      continue
    inferred = _inferred_shapes(node, graph, known)
    for tensor, shape in zip(node.outputs, inferred or ()):
      if shape is not None and _more_specific(shape, tensor.shape):
        tensor.shape = shape
        changed.add(tensor.name)


def _fully_shaped(node: ir.Node) -> bool:
  return all(t.shape is not None and None not in t.shape for t in node.outputs)


def _more_specific(new, old) -> bool:
  if old is None:
    return True
  return len(new) == len(old) and new != old and all(o is None or o == n for n, o in zip(new, old))


def _inferred_shapes(node: ir.Node, graph: ir.Graph, known):
  """The output shapes TF's shape function gives `node` on its inputs' shapes and known
  values, or None where it cannot say (a stateful op, a call, a handle)."""
  if is_stateful(node.op) or node.called_functions() or node.op in _FED:
    return None
  scratch = tf.Graph()
  with scratch.as_default():
    inputs = []
    for name in node.inputs:
      tensor = graph.tensor(name)
      if tensor.dtype in (tf.resource, tf.variant):
        return None
      if name in known:
        inputs.append(tf.constant(known[name], dtype=tensor.dtype))
      else:
        inputs.append(tf.compat.v1.placeholder(tensor.dtype, tensor.shape))
    try:
      op = emit.emit_node(node, inputs)
    except (ValueError, TypeError, tf.errors.OpError):
      return None
  return [None if o.shape.rank is None else tuple(o.shape.as_list()) for o in op.outputs]
