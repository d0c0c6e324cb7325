"""TF ops -> `ir.Graph`: each op with its inputs, attrs, device, output shapes and the
shardings written on it (an `XlaSharding` op, or the `_XlaSharding` attr on any op).

Used by `capture` for the top-level graph and by `library` for each library function body.
"""

from __future__ import annotations

import heapq
from typing import Any, Dict, List, Optional, Sequence

import tensorflow as tf
from tensorflow.core.framework import attr_value_pb2

from tf_gspmd import op_sharding
from tf_gspmd.graph import ir
from tf_gspmd.sharding import Sharding
from tf_gspmd.tf_private import handle_data_util

# Attr holding the serialized OpSharding of an XlaSharding op, and the attr any
# op may carry with the sharding of its output(s).
_SHARDING_OP = 'XlaSharding'
_SHARDING_OP_ATTR = 'sharding'
_SHARDING_ATTR = '_XlaSharding'


def graph_from_ops(
  name: str,
  operations: Sequence[tf.Operation],
  inputs: Sequence[tf.Tensor],
  outputs: Sequence[tf.Tensor],
  control_outputs: Sequence[tf.Operation],
  attrs: Optional[Dict[str, Any]] = None,
  output_names: Sequence[str] = (),
) -> ir.Graph:
  """An `ir.Graph` holding `operations` (any order; stored topologically sorted)."""
  nodes = [_node_from_op(op) for op in _topological_order(operations)]
  return ir.Graph(
    name=name,
    nodes=nodes,
    inputs=[t.name for t in inputs],
    outputs=[t.name for t in outputs],
    attrs=dict(attrs or {}),
    control_outputs=[op.name for op in control_outputs],
    output_names=list(output_names),
  )


def _node_from_op(op: tf.Operation) -> ir.Node:
  node_def = op.node_def
  attrs = {}
  for key in node_def.attr:
    value = attr_value_pb2.AttrValue()
    value.CopyFrom(node_def.attr[key])
    attrs[key] = value
  return ir.Node(
    name=op.name,
    op=op.type,
    inputs=[t.name for t in op.inputs],
    outputs=[_tensor_from(op.name, i, t) for i, t in enumerate(op.outputs)],
    attrs=attrs,
    control_inputs=[c.name for c in op.control_inputs],
    device=op.device,
    annotations=annotations_of(op.name, op.type, attrs, len(op.outputs)),
  )


def _tensor_from(node: str, index: int, t: tf.Tensor) -> ir.Tensor:
  data = handle_data_of(t)
  handle = None
  if data is not None:
    handle = tuple(
      (tf.as_dtype(st.dtype), _shape_tuple(tf.TensorShape(st.shape))) for st in data.shape_and_type
    )
  return ir.Tensor(
    node=node,
    index=index,
    dtype=t.dtype,
    shape=_shape_tuple(t.shape),
    handle_data=handle,
    handle_proto=data,
  )


def _shape_tuple(shape: tf.TensorShape):
  return None if shape.rank is None else tuple(shape.as_list())


def _topological_order(operations: Sequence[tf.Operation]) -> List[tf.Operation]:
  """`operations` sorted so every op follows its data and control inputs.

  Ties keep the given order.
  """
  position = {op.name: i for i, op in enumerate(operations)}
  waiting_on = {}
  users: Dict[str, List[str]] = {}
  for op in operations:
    deps = {t.op.name for t in op.inputs} | {c.name for c in op.control_inputs}
    deps = {d for d in deps if d in position}
    waiting_on[op.name] = len(deps)
    for d in deps:
      users.setdefault(d, []).append(op.name)
  ready = [position[name] for name, n in waiting_on.items() if n == 0]
  heapq.heapify(ready)
  ordered = []
  while ready:
    op = operations[heapq.heappop(ready)]
    ordered.append(op)
    for user in users.get(op.name, ()):
      waiting_on[user] -= 1
      if waiting_on[user] == 0:
        heapq.heappush(ready, position[user])
  if len(ordered) != len(operations):
    stuck = sorted(name for name, n in waiting_on.items() if n > 0)[:5]
    raise ValueError(f'capture: the graph has a cycle through {stuck}.')
  return ordered


def annotations_of(
  name: str, op_type: str, attrs: Dict[str, Any], num_outputs: int
) -> Dict[int, Sharding]:
  """{output index: Sharding} written on a node by an XlaSharding op or the `_XlaSharding` attr."""
  if op_type == _SHARDING_OP and _SHARDING_OP_ATTR in attrs and attrs[_SHARDING_OP_ATTR].s:
    serialized = attrs[_SHARDING_OP_ATTR].s
  elif _SHARDING_ATTR in attrs:
    serialized = attrs[_SHARDING_ATTR].s
  elif op_type == _SHARDING_OP:
    serialized = b''  # an XlaSharding op with an empty sharding: replicated
  else:
    return {}
  return _shardings_from_bytes(name, serialized, num_outputs)


def _shardings_from_bytes(name: str, serialized: bytes, num_outputs: int) -> Dict[int, Sharding]:
  if not serialized:
    return {i: Sharding.replicated() for i in range(num_outputs)}
  proto = op_sharding._pb().OpSharding.FromString(serialized)  # noqa: SLF001
  try:
    if proto.type == proto.TUPLE:
      if len(proto.tuple_shardings) != num_outputs:
        raise ValueError(
          f'a TUPLE sharding of {len(proto.tuple_shardings)} elements on an op with '
          f'{num_outputs} outputs'
        )
      return {i: op_sharding.from_proto(proto, i) for i in range(num_outputs)}
    sharding = op_sharding.from_proto(proto)
  except ValueError as e:
    raise ValueError(f'capture: cannot read the sharding of node {name!r}: {e}') from e
  return {i: sharding for i in range(num_outputs)}


def make_placeholder(name: str, dtype: tf.DType, shape, handle_data=None) -> tf.Tensor:
  """A Placeholder named exactly `name` in the current graph, with handle data for resources."""
  placeholder = tf.compat.v1.placeholder(dtype, shape=shape, name=name)
  if placeholder.op.name != name:
    raise ValueError(
      f'placeholder {name!r} came out as {placeholder.op.name!r}: the name is taken.'
    )
  if handle_data is not None:
    handle_data_util.set_handle_data(placeholder, handle_data)
  return placeholder


def handle_data_of(t: tf.Tensor):
  if t.dtype not in (tf.resource, tf.variant):
    return None
  data = handle_data_util.get_resource_handle_data(t)
  return data if data.is_set and data.shape_and_type else None


def as_str(name) -> str:
  return name.decode() if isinstance(name, bytes) else str(name)
