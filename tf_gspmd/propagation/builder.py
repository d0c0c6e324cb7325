"""Build `ir.Program`s by hand: rule examples for the support table, and unit tests.

Real programs come from `graph_rewrite.capture`; this builder writes the same
IR directly (attrs as `AttrValue` protos, constants as `TensorProto`s) so a
rule can be shown or tested on one node without tracing TensorFlow.

>>> b = GraphBuilder()
>>> x = b.placeholder('x', (8, 16))
>>> w = b.placeholder('w', (16, 32))
>>> y = b.op('MatMul', [x, w], [(8, 32)], name='mm')
>>> y
'mm:0'
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import numpy as np

from tf_gspmd.graph import ir


class Func(str):
  """An attr value naming a library function (`then_branch=Func('f')`)."""


def attr_value(value):
  """A python value as an `AttrValue` proto (bool, int, float, str, bytes, DType, Func, lists)."""
  import tensorflow as tf
  from tensorflow.core.framework import attr_value_pb2

  av = attr_value_pb2.AttrValue()
  if isinstance(value, attr_value_pb2.AttrValue):
    return value
  if isinstance(value, Func):
    av.func.name = str(value)
  elif isinstance(value, bool):
    av.b = value
  elif isinstance(value, (int, np.integer)):
    av.i = int(value)
  elif isinstance(value, float):
    av.f = value
  elif isinstance(value, str):
    av.s = value.encode()
  elif isinstance(value, bytes):
    av.s = value
  elif isinstance(value, tf.DType):
    av.type = value.as_datatype_enum
  elif isinstance(value, np.ndarray):
    av.tensor.CopyFrom(tf.make_tensor_proto(value))
  elif isinstance(value, (list, tuple)):
    lst = av.list
    lst.SetInParent()
    for v in value:
      if isinstance(v, Func):
        lst.func.add().name = str(v)
      elif isinstance(v, bool):
        lst.b.append(v)
      elif isinstance(v, (int, np.integer)):
        lst.i.append(int(v))
      elif isinstance(v, float):
        lst.f.append(v)
      elif isinstance(v, str):
        lst.s.append(v.encode())
      elif isinstance(v, tf.DType):
        lst.type.append(v.as_datatype_enum)
      else:
        raise TypeError(f'attr_value: unsupported list element {v!r}.')
  else:
    raise TypeError(f'attr_value: unsupported attr value {value!r}.')
  return av


class GraphBuilder:
  """Appends nodes in topological order and returns tensor names."""

  def __init__(self, name: str = 'main'):
    self.name = name
    self.nodes: List[ir.Node] = []
    self._names = set()
    self.inputs: List[str] = []
    # Resource tensors -> shape of the variable value they refer to.
    self.resource_shapes: Dict[str, tuple] = {}

  def _unique(self, base: str) -> str:
    name, k = base, 0
    while name in self._names:
      k += 1
      name = f'{base}_{k}'
    self._names.add(name)
    return name

  def placeholder(self, name: str, shape, dtype=None, annotation=None, as_input=True) -> str:
    import tensorflow as tf

    dtype = dtype or tf.float32
    t = self.op(
      'Placeholder',
      [],
      [shape],
      name=name,
      attrs={'dtype': dtype},
      dtypes=[dtype],
      annotation=annotation,
    )
    if as_input:
      self.inputs.append(t)
    return t

  def resource(self, name: str, value_shape, annotation=None) -> str:
    """A resource placeholder standing for a variable of `value_shape`."""
    import tensorflow as tf

    t = self.placeholder(name, (), dtype=tf.resource, annotation=annotation)
    self.resource_shapes[t] = tuple(value_shape)
    return t

  def const(self, value, name: str = 'Const', dtype=None) -> str:
    import tensorflow as tf

    arr = np.asarray(value, dtype=dtype if dtype is not None else None)
    if arr.dtype == np.float64:
      arr = arr.astype(np.float32)
    if arr.dtype == np.int64 and dtype is None:
      arr = arr.astype(np.int32)
    tf_dtype = tf.as_dtype(arr.dtype)
    return self.op(
      'Const',
      [],
      [arr.shape],
      name=name,
      attrs={'value': arr, 'dtype': tf_dtype},
      dtypes=[tf_dtype],
    )

  def op(
    self,
    op: str,
    inputs: Sequence[str],
    out_shapes: Sequence[Optional[Sequence]],
    name: Optional[str] = None,
    attrs: Optional[Dict] = None,
    dtypes=None,
    annotation=None,
    control_inputs=(),
  ):
    """Add a node; returns its only output's name, or the list of names when it has several.

    `annotation` is a Sharding for output 0 or a {index: Sharding} dict.
    """
    import tensorflow as tf

    name = self._unique(name or op)
    dtypes = list(dtypes) if dtypes is not None else [tf.float32] * len(out_shapes)
    outputs = [
      ir.Tensor(name, i, dtypes[i], None if s is None else tuple(s))
      for i, s in enumerate(out_shapes)
    ]
    if annotation is not None and not isinstance(annotation, dict):
      annotation = {0: annotation}
    node = ir.Node(
      name=name,
      op=op,
      inputs=list(inputs),
      outputs=outputs,
      attrs={k: attr_value(v) for k, v in (attrs or {}).items()},
      control_inputs=list(control_inputs),
      annotations=dict(annotation or {}),
    )
    self.nodes.append(node)
    names = [t.name for t in outputs]
    return names[0] if len(names) == 1 else names

  def graph(self, outputs: Sequence[str] = (), inputs: Optional[Sequence[str]] = None) -> ir.Graph:
    return ir.Graph(
      self.name, list(self.nodes), list(self.inputs if inputs is None else inputs), list(outputs)
    )


def program(main: ir.Graph, functions: Sequence[ir.Graph] = (), variables=None) -> ir.Program:
  """A Program from built graphs; `variables` maps resource placeholder tensors to variables."""
  return ir.Program(
    main=main, functions={g.name: g for g in functions}, variables=dict(variables or {})
  )
