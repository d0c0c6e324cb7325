"""Capture a `tf.function` into the graph IR (`ir.Program`).

`capture(fn, *args)` traces `fn` (or takes a ConcreteFunction as it is) and
records every op with its inputs, control inputs, attrs, device and the static
shape and dtype of each output; the sharding the user wrote on a tensor (an
`XlaSharding` op, or the `_XlaSharding` attr on any op); and every library
function reachable from the top level: If/While branches and bodies, called
functions, and any other op's `func` attrs.

Library functions are converted to the same `'node:index'` tensor naming as
the top level, with static shapes taken from their call sites: a While body's
arguments get the loop's shapes, an If branch's the If operands', a called
function's its call's operands'. Resource arguments also get the handle data
(the variable's dtype and shape) of the tensor passed in, so a
`ReadVariableOp` inside a body has a static shape too. A function reached
from call sites with different shapes gets their most specific common shape.

Captured tensors map back to what they stand for: `Program.variables` holds
the live `tf.Variable` behind each variable handle placeholder, and
`Program.captures` the value behind any other captured placeholder.
"""

from __future__ import annotations

import heapq
from typing import Any, Dict, List, Optional, Sequence, Tuple

import tensorflow as tf
from tensorflow.core.framework import attr_value_pb2, graph_pb2, node_def_pb2

from tf_gspmd import op_sharding
from tf_gspmd.graph import ir
from tf_gspmd.graph.prune import prune_dead
from tf_gspmd.sharding import Sharding
from tf_gspmd.tf_private import FuncGraph, function_def_to_graph, handle_data_util

# Attr holding the serialized OpSharding of an XlaSharding op, and the attr any
# op may carry with the sharding of its output(s).
_SHARDING_OP = 'XlaSharding'
_SHARDING_OP_ATTR = 'sharding'
_SHARDING_ATTR = '_XlaSharding'

# Call ops whose operands (after the first `skip`) are the called function's
# arguments, by op type: (function attrs, operands to skip).
_CALL_OPERANDS = {
  'If': (('then_branch', 'else_branch'), 1),
  'StatelessIf': (('then_branch', 'else_branch'), 1),
  'Case': (('branches',), 1),
  'StatelessCase': (('branches',), 1),
  'PartitionedCall': (('f',), 0),
  'StatefulPartitionedCall': (('f',), 0),
}
_WHILE_OPS = ('While', 'StatelessWhile')

# One argument of a library function as seen from a call site: static shape
# and, for a resource/variant, the handle data of what it points to.
ArgSpec = Tuple[tf.TensorShape, Any]


# ----------------------------------------------------------------------------
# Entry points


def capture(fn, *args, input_signature: Optional[Sequence[Any]] = None, **kwargs) -> ir.Program:
  """The IR of `fn` traced on `args`/`kwargs` (example values or TensorSpecs).

  `fn` may be a `tf.function`, a ConcreteFunction (then args are ignored) or a
  plain Python function (wrapped in `tf.function`). With `input_signature`
  (a sequence of TensorSpecs) `fn` is traced on it instead of on `args`.
  Tracing must not create variables: build models and optimizers first.
  """
  fn = _as_tf_function(fn)
  concrete = concrete_function_of(fn, args, kwargs, input_signature)
  # A tf.function knows its Python defaults; a ConcreteFunction does not.
  defaults = getattr(fn, '_default_values', None) if concrete is not fn else None
  return capture_concrete(concrete, default_values=defaults)


def concrete_function_of(fn, args=(), kwargs=None, input_signature=None):
  """The ConcreteFunction `capture` works on."""
  fn = _as_tf_function(fn)
  if isinstance(fn, tf.types.experimental.ConcreteFunction):
    return fn
  if input_signature is not None:
    return fn.get_concrete_function(*input_signature)
  return fn.get_concrete_function(*args, **(kwargs or {}))


def _as_tf_function(fn):
  """`fn` itself if it is a tf.function or ConcreteFunction, else `tf.function(fn)`."""
  if isinstance(fn, tf.types.experimental.ConcreteFunction) or hasattr(fn, 'get_concrete_function'):
    return fn
  if not callable(fn):
    raise TypeError(f'capture: expected a tf.function or a callable, got {fn!r}.')
  return tf.function(fn)


def capture_concrete(concrete, default_values: Optional[Dict[str, Any]] = None) -> ir.Program:
  """The IR of a ConcreteFunction; `default_values`: the Python defaults of its parameters."""
  graph = concrete.graph
  if graph.deferred_external_captures:
    raise ValueError(
      f'capture: {graph.name} has deferred (by-reference) captures '
      f'{graph.deferred_external_captures}; pass those values as arguments instead.'
    )
  library = graph.as_graph_def().library
  converter = _LibraryConverter(library)
  converter.visit(graph)

  variables, captures = _captured_values(graph)
  main = graph_from_ops(
    graph.name, graph.get_operations(), graph.inputs, graph.outputs, graph.control_outputs
  )
  functions = {name: converter.ir_graph(name) for name in converter.converted_names()}
  for g in [main] + list(functions.values()):
    prune_dead(g)  # what TF would not run must not be partitioned either
  program = ir.Program(
    main=main,
    functions=functions,
    variables=variables,
    captures=captures,
    arg_inputs=[t.name for t in graph.inputs if t.name not in variables and t.name not in captures],
    structured_outputs=concrete.structured_outputs,
    function_type=concrete.function_type,
    default_values=dict(default_values or {}),
    name=_as_str(concrete.name),
  )
  _record_variable_shardings(program)
  return program


# ----------------------------------------------------------------------------
# TF graph -> ir.Graph


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
  data = _handle_data_of(t)
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


# ----------------------------------------------------------------------------
# Annotations


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


def sharding_of_variable(variable) -> Optional[Sharding]:
  """The sharding set on a variable in Python, or None.

  Read from the `_tf_gspmd_sharding` attribute (a Sharding, an OpSharding or
  its bytes) first, then from TF's own `_xla_sharding` (an OpSharding set by
  `v._set_xla_sharding(proto)`).
  """
  value = getattr(variable, '_tf_gspmd_sharding', None)
  if value is None:
    value = getattr(variable, '_xla_sharding', None)
  if value is None:
    return None
  if isinstance(value, Sharding):
    return value
  if isinstance(value, (bytes, bytearray)) or hasattr(value, 'SerializeToString'):
    return op_sharding.from_proto(value)
  raise TypeError(
    f'capture: variable {getattr(variable, "name", variable)} carries sharding {value!r} of '
    f'type {type(value).__name__}; expected a Sharding or an OpSharding.'
  )


def _record_variable_shardings(program: ir.Program) -> None:
  for placeholder, variable in program.variables.items():
    sharding = sharding_of_variable(variable)
    if sharding is None:
      continue
    program.variable_shardings[placeholder] = sharding
    node, index = ir.split_tensor_name(placeholder)
    program.main.node(node).annotations[index] = sharding


# ----------------------------------------------------------------------------
# Captured values


def _captured_values(graph: FuncGraph) -> Tuple[Dict[str, Any], Dict[str, Any]]:
  """(placeholder name -> tf.Variable, placeholder name -> other captured value)."""
  by_handle = {}
  for v in graph.variables:
    handle = getattr(v, 'handle', None)
    if handle is not None:
      by_handle[id(handle)] = v
  variables, captures = {}, {}
  for external, internal in graph.captures:
    variable = by_handle.get(id(external))
    if variable is None and _used_as_variable(graph, internal):
      variable = _variable_owning(external)
      if variable is None:
        _refuse_untracked_variable_handle(graph, internal)
    if variable is not None:
      variables[internal.name] = variable
    else:
      captures[internal.name] = external
  return variables, captures


def _variable_owning(handle) -> Optional[tf.Variable]:
  """The live tf.Variable whose handle is `handle`, if any.

  A variable reached only through `v.handle` (as `tf.raw_ops.ResourceApply*(accum=slot.handle)`
  and tf_keras's legacy optimizers write it) is not in `graph.variables`. Python's own
  referrer lookup finds the variable holding that handle (its `_handle`), so such a slot is
  sharded like any variable instead of being one eager handle that every partition updates.
  """
  import gc

  for referrer in gc.get_referrers(handle):
    owner = referrer
    if isinstance(referrer, dict):  # the handle held in an instance __dict__
      owner = next(
        (
          o
          for o in gc.get_referrers(referrer)
          if isinstance(o, tf.Variable) and getattr(o, '__dict__', None) is referrer
        ),
        None,
      )
    if isinstance(owner, tf.Variable) and getattr(owner, 'handle', None) is handle:
      return owner
  return None


def _used_as_variable(graph: FuncGraph, internal: tf.Tensor) -> bool:
  return internal.dtype == tf.resource and bool(_variable_users(graph, internal))


def _variable_users(graph: FuncGraph, internal: tf.Tensor) -> list:
  users = [op for op in graph.get_operations() if any(t is internal for t in op.inputs)]
  return [
    op
    for op in users
    if op.type.startswith('Resource')
    or op.type
    in (
      'ReadVariableOp',
      'AssignVariableOp',
      'AssignAddVariableOp',
      'AssignSubVariableOp',
      'VariableShape',
    )
  ]


def _refuse_untracked_variable_handle(graph: FuncGraph, internal: tf.Tensor) -> None:
  """A resource handle used as a variable but owned by no live tf.Variable: tf_gspmd could
  not shard it, and handing every partition the one eager handle would update it N times."""
  variable_users = _variable_users(graph, internal)
  if variable_users:
    raise ValueError(
      f'capture: {graph.name} uses the handle of a variable it does not track ({internal.name}, '
      f'by {variable_users[0].type} {variable_users[0].name}); tf_gspmd cannot shard a variable it '
      'cannot see. Read the variable in the function or call '
      '`tf.compat.v1.get_default_graph().watch_variable(v)` before using `v.handle`.'
    )


# ----------------------------------------------------------------------------
# Library functions


class _LibraryConverter:
  """Converts the library functions reachable from a graph, with call-site shapes.

  A body is rebuilt op by op, so that when it reaches a call (a nested While,
  If or function call) the callee is converted first, with the shapes of the
  operands at hand, and the call's outputs then take the callee's output
  shapes before anything downstream is shape-inferred. Shapes only ever relax
  (a second call site with other shapes widens a function's argument shapes
  to the common shape and reconverts it), so the walk ends.
  """

  def __init__(self, library):
    self._fdefs = {f.signature.name: f for f in library.function}
    # A graph holding every library function, so the FunctionDef -> GraphDef
    # conversion can look up the functions called inside a body.
    self._scratch = tf.Graph()
    with self._scratch.as_default():
      tf.graph_util.import_graph_def(graph_pb2.GraphDef(library=library), name='')
    self._specs: Dict[str, List[ArgSpec]] = {}
    self._graphs: Dict[str, FuncGraph] = {}
    self._order: List[str] = []

  def converted_names(self) -> List[str]:
    return list(self._order)

  def visit(self, graph: tf.Graph) -> None:
    """Convert every function the ops of `graph` (the top level) reach."""
    for op in graph.get_operations():
      for name, specs in self._call_sites(op.type, op.node_def.attr, list(op.inputs)):
        self._reach(name, specs)

  def _reach(self, name: str, specs: Optional[List[ArgSpec]]) -> None:
    if name not in self._fdefs:
      raise ValueError(f'capture: function {name!r} is called but not in the graph library.')
    fdef = self._fdefs[name]
    if specs is None:
      if name in self._graphs:
        return
      specs = _specs_from_fdef(fdef)
    if len(specs) != len(fdef.signature.input_arg):
      raise ValueError(
        f'capture: function {name!r} takes {len(fdef.signature.input_arg)} arguments but a '
        f'call site passes {len(specs)}.'
      )
    old = self._specs.get(name)
    merged = specs if old is None else [_merge_spec(a, b) for a, b in zip(old, specs)]
    if old is not None and _same_specs(old, merged) and name in self._graphs:
      return
    self._specs[name] = merged
    self._graphs[name] = self._convert(fdef, merged)
    if name not in self._order:
      self._order.append(name)

  def _call_sites(self, op_type: str, attrs, inputs: Sequence[tf.Tensor]):
    """(function name, argument specs, or None when the call site says nothing) per function."""
    if op_type in self._fdefs:  # a function called by name as the op type
      yield op_type, [_spec_of(t) for t in inputs]
    if op_type in _WHILE_OPS:
      specs = _while_specs(attrs, inputs)
      for attr in ('cond', 'body'):
        yield attrs[attr].func.name, specs
      return
    known = _CALL_OPERANDS.get(op_type)
    specs = None
    if known is not None:
      specs = [_spec_of(t) for t in inputs[known[1] :]]
    for attr in sorted(attrs):
      value = attrs[attr]
      names = (
        [value.func.name]
        if value.HasField('func')
        else [f.name for f in value.list.func]
        if value.HasField('list')
        else []
      )
      for name in names:
        if name:
          yield name, (specs if known is not None and attr in known[0] else None)

  def _convert(self, fdef, specs: List[ArgSpec]) -> FuncGraph:
    with self._scratch.as_default():
      graph_def, flat_names = function_def_to_graph.function_def_to_graph_def(fdef)
      func_graph = FuncGraph(fdef.signature.name)
    arg_names = {a.name for a in fdef.signature.input_arg}
    with func_graph.as_default():
      placeholders = [
        make_placeholder(arg.name, tf.as_dtype(arg.type), shape, handle)
        for arg, (shape, handle) in zip(fdef.signature.input_arg, specs)
      ]
      for node_def in _topological_node_defs(graph_def.node, arg_names, fdef.signature.name):
        self._create_op(func_graph, node_def)
    func_graph.inputs = placeholders
    func_graph.outputs = [
      func_graph.get_tensor_by_name(flat_names[fdef.ret[arg.name]])
      for arg in fdef.signature.output_arg
    ]
    func_graph.control_outputs = [
      func_graph.get_operation_by_name(fdef.control_ret[ret])
      for ret in fdef.signature.control_output
    ]
    return func_graph

  def _create_op(self, graph: FuncGraph, node_def) -> tf.Operation:
    """Create `node_def` in `graph` (exact name, attrs and device), callees converted first."""
    inputs = [
      graph.get_tensor_by_name(i if ':' in i else f'{i}:0')
      for i in node_def.input
      if not i.startswith('^')
    ]
    controls = [graph.get_operation_by_name(i[1:]) for i in node_def.input if i.startswith('^')]
    callees = list(self._call_sites(node_def.op, node_def.attr, inputs))
    for name, specs in callees:
      self._reach(name, specs)
    if node_def.op in self._fdefs and not graph._is_function(node_def.op):  # noqa: SLF001
      graph._add_function(self._scratch._get_function(node_def.op))  # noqa: SLF001
    bare = node_def_pb2.NodeDef()
    bare.CopyFrom(node_def)
    del bare.input[:]
    try:
      op = tf.Operation.from_node_def(bare, graph, inputs=inputs, control_inputs=controls)
    except (ValueError, TypeError, tf.errors.InvalidArgumentError) as e:
      raise ValueError(
        f'capture: cannot re-create node {node_def.name!r} ({node_def.op}) '
        f'of function {graph.name}: {e}'
      ) from e
    graph._create_op_helper(op, compute_device=False)  # noqa: SLF001
    self._refine_call_outputs(op)
    return op

  def _refine_call_outputs(self, op: tf.Operation) -> None:
    """Give a call's outputs the static shapes (and handle data) of the callee's outputs.

    An If/Case output takes the most specific shape all branches agree on.
    A While keeps the loop shapes its `output_shapes` attr already gave it.
    """
    if op.type in self._fdefs:
      bodies = [op.type]
    elif op.type in _CALL_OPERANDS:
      attrs = op.node_def.attr
      bodies = []
      for attr in _CALL_OPERANDS[op.type][0]:
        value = attrs[attr]
        bodies += [value.func.name] if value.HasField('func') else [f.name for f in value.list.func]
    else:
      return
    graphs = [self._graphs[n] for n in bodies]
    for i, out in enumerate(op.outputs):
      results = [g.outputs[i] for g in graphs if i < len(g.outputs)]
      if len(results) != len(graphs) or not results:
        continue
      shape = results[0].shape
      for r in results[1:]:
        shape = shape.most_specific_compatible_shape(r.shape)
      if out.shape.is_compatible_with(shape):
        out.set_shape(shape)
      if out.dtype in (tf.resource, tf.variant) and _handle_data_of(out) is None:
        handles = [_handle_data_of(r) for r in results]
        if handles[0] is not None and all(_same_handle_data(handles[0], h) for h in handles):
          handle_data_util.set_handle_data(out, handles[0])

  def ir_graph(self, name: str) -> ir.Graph:
    fdef, func_graph = self._fdefs[name], self._graphs[name]
    attrs = {}
    for key in fdef.attr:
      value = attr_value_pb2.AttrValue()
      value.CopyFrom(fdef.attr[key])
      attrs[key] = value
    return graph_from_ops(
      name,
      func_graph.get_operations(),
      func_graph.inputs,
      func_graph.outputs,
      func_graph.control_outputs,
      attrs=attrs,
      output_names=[arg.name for arg in fdef.signature.output_arg],
    )


def _while_specs(attrs, inputs: Sequence[tf.Tensor]) -> List[ArgSpec]:
  """A While's loop-variable specs: its `output_shapes` (the loop's shape invariants) if given."""
  shapes = list(attrs['output_shapes'].list.shape) if 'output_shapes' in attrs else []
  if len(shapes) != len(inputs):
    return [_spec_of(t) for t in inputs]
  return [(tf.TensorShape(s), _handle_data_of(t)) for s, t in zip(shapes, inputs)]


def _topological_node_defs(node_defs, skip, where: str):
  """`node_defs` (minus the names in `skip`) ordered so each follows its inputs; ties keep order."""
  names = [n.name for n in node_defs if n.name not in skip]
  position = {name: i for i, name in enumerate(names)}
  by_name = {n.name: n for n in node_defs}
  waiting_on, users = {}, {}
  for name in names:
    deps = {i.lstrip('^').split(':')[0] for i in by_name[name].input}
    deps = {d for d in deps if d in position}
    waiting_on[name] = len(deps)
    for d in deps:
      users.setdefault(d, []).append(name)
  ready = [position[n] for n in names if waiting_on[n] == 0]
  heapq.heapify(ready)
  ordered = []
  while ready:
    name = names[heapq.heappop(ready)]
    ordered.append(by_name[name])
    for user in users.get(name, ()):
      waiting_on[user] -= 1
      if waiting_on[user] == 0:
        heapq.heappush(ready, position[user])
  if len(ordered) != len(names):
    stuck = sorted(n for n in names if waiting_on[n] > 0)[:5]
    raise ValueError(f'capture: function {where} has a cycle through {stuck}.')
  return ordered


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


def _spec_of(t: tf.Tensor) -> ArgSpec:
  return t.shape, _handle_data_of(t)


def _handle_data_of(t: tf.Tensor):
  if t.dtype not in (tf.resource, tf.variant):
    return None
  data = handle_data_util.get_resource_handle_data(t)
  return data if data.is_set and data.shape_and_type else None


def _specs_from_fdef(fdef) -> List[ArgSpec]:
  """Argument shapes a FunctionDef records about itself (`_input_shapes`, arg `_output_shapes`)."""
  recorded = fdef.attr['_input_shapes'].list.shape if '_input_shapes' in fdef.attr else []
  specs = []
  for i, _ in enumerate(fdef.signature.input_arg):
    shape = tf.TensorShape(None)
    if i < len(recorded):
      shape = tf.TensorShape(recorded[i])
    elif i in fdef.arg_attr and '_output_shapes' in fdef.arg_attr[i].attr:
      listed = fdef.arg_attr[i].attr['_output_shapes'].list.shape
      if listed:
        shape = tf.TensorShape(listed[0])
    specs.append((shape, None))
  return specs


def _merge_spec(a: ArgSpec, b: ArgSpec) -> ArgSpec:
  shape = a[0].most_specific_compatible_shape(b[0])
  handle = a[1] if _same_handle_data(a[1], b[1]) else None
  return shape, handle


def _same_handle_data(a, b) -> bool:
  if a is None or b is None:
    return a is None and b is None
  return a.SerializeToString(deterministic=True) == b.SerializeToString(deterministic=True)


def _same_specs(a: List[ArgSpec], b: List[ArgSpec]) -> bool:
  return all(
    x[0].as_proto() == y[0].as_proto() and _same_handle_data(x[1], y[1]) for x, y in zip(a, b)
  )


def _as_str(name) -> str:
  return name.decode() if isinstance(name, bytes) else str(name)
