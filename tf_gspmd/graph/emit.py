"""Re-create IR nodes as live ops inside the graph being traced.

The partitioner walks an `ir.Graph` and, inside the per-partition
`tf.function` being traced, re-creates each node on local shards with
`emit_node`; TensorFlow's own shape inference then gives every local tensor
its static local shape. Nested bodies (While/If branches) become new library
functions through `trace_function`, each under a fresh unique name so an
edited body can never be confused with the original.
"""

from __future__ import annotations

from typing import Callable, Dict, Optional, Sequence

import numpy as np
import tensorflow as tf
from tensorflow.core.framework import attr_value_pb2

from tf_gspmd.graph import ir

# Attributes that only describe where or how the original was placed/compiled;
# they are not copied onto re-emitted nodes.
_DROPPED_ATTRS = ('_class', '_XlaSharding', '_xla_compile_device_type', '_user_specified_name')


def emit_node(
  node: ir.Node,
  inputs: Sequence[tf.Tensor],
  attrs: Optional[Dict[str, attr_value_pb2.AttrValue]] = None,
  name: Optional[str] = None,
  op_type: Optional[str] = None,
) -> tf.Operation:
  """Create `node` (or `op_type`) in the current graph with `inputs` and its attrs.

  `attrs` overrides or adds attributes (e.g. a Reshape's local target, a
  While's partitioned body). Output dtypes and shapes come from TF's op
  registry and shape inference.
  """
  graph = tf.compat.v1.get_default_graph()
  merged = {k: v for k, v in node.attrs.items() if k not in _DROPPED_ATTRS}
  if attrs:
    merged.update(attrs)
  return graph._create_op_internal(  # noqa: SLF001
    op_type or node.op, list(inputs), attrs=merged, name=name or node.name
  )


# The attribute of a graph being traced holding its constants: (dtype, shape, bytes) -> the one
# Const op holding that value. On the graph itself, not in a table keyed by it: a constant
# refers to its graph, so a table entry (even a weak key's) kept every graph and its
# functions alive for the process's life (a campaign's processes grew by a program's graph
# each, and their full collections with them).
_CONSTANTS = '_tf_gspmd_constants'


def constant(value, dtype=None, name: str = 'Const') -> tf.Tensor:
  """`value` as a constant of the graph being traced, one op per distinct value and graph.

  A partitioned program reads the same small constants in many places (shapes, slice
  bounds, replica groups, a layer's epsilon once per variable): made once each, the
  per-partition graph of a small decoder has 1,178 Const ops of 120 values, and every op is
  paid for again in TF's tracing, XLA's lowering and, on the TF backend, each device's
  instantiation. Made outside any control dependencies, so a shared constant never orders
  one consumer after another's dependencies (a constant needs none of its own).
  """
  array = np.asarray(value, dtype=None if dtype is None else tf.as_dtype(dtype).as_numpy_dtype)
  if array.dtype.kind not in 'biufc':  # strings, objects: TF's own conversion, not cached
    return tf.constant(value, dtype=dtype, name=name)
  graph = tf.compat.v1.get_default_graph()
  made = getattr(graph, _CONSTANTS, None)
  if made is None:
    made = {}
    setattr(graph, _CONSTANTS, made)
  key = (array.dtype.str, array.shape, array.tobytes())
  if key not in made:
    with tf.control_dependencies(None):
      made[key] = tf.constant(array, name=name)
  return made[key]


def func_attr(function_name: str) -> attr_value_pb2.AttrValue:
  return attr_value_pb2.AttrValue(func=attr_value_pb2.NameAttrList(name=function_name))


def func_list_attr(function_names: Sequence[str]) -> attr_value_pb2.AttrValue:
  return attr_value_pb2.AttrValue(
    list=attr_value_pb2.AttrValue.ListValue(
      func=[attr_value_pb2.NameAttrList(name=n) for n in function_names]
    )
  )


def shapes_attr(shapes: Sequence[tf.TensorShape]) -> attr_value_pb2.AttrValue:
  return attr_value_pb2.AttrValue(
    list=attr_value_pb2.AttrValue.ListValue(shape=[tf.TensorShape(s).as_proto() for s in shapes])
  )


def trace_function(
  name_hint: str, arg_specs: Sequence[tf.TensorSpec], body: Callable[..., Sequence[tf.Tensor]]
) -> str:
  """Trace `body(*args)` into a new library function and add it to the current graph.

  Returns the function's name, ready for a call site's `func` attr. Every
  trace gets a fresh name from TensorFlow (`__inference_<hint>_<n>`), so a
  rewritten body never collides with the original. Resource arguments are
  given as `tf.TensorSpec([], tf.resource)`.
  """

  def traced(*args):
    return list(body(*args))

  traced.__name__ = _sanitize(name_hint)
  concrete = tf.function(traced, autograph=False).get_concrete_function(*arg_specs)
  concrete.add_to_graph(tf.compat.v1.get_default_graph())
  return concrete.name.decode() if isinstance(concrete.name, bytes) else concrete.name


def _sanitize(hint: str) -> str:
  return ''.join(c if c.isalnum() or c == '_' else '_' for c in hint) + '_gspmd'
