"""Turn an `ir.Program` (edited or not) back into runnable TensorFlow.

`rebuild(program)` gives a `tf.function` taking the same arguments as the
captured function and returning the same structure. `import_program(program,
inputs)` re-creates the program inside the graph being traced right now (an
outer `tf.function`) and returns its output tensors: the partitioner uses it
to place a per-partition program inside a larger function, with variable
placeholders mapped to other handles.

Every library function is rebuilt under a new name made of its original name
and a hash of its rebuilt FunctionDef (which includes the new names of the
functions it calls). An edited body therefore always gets a name of its own,
so it can never be silently replaced by the original body of the same name;
an unedited body rebuilt twice gets the same name and is registered once.

Variables: the rebuilt graph reads and updates the live variables through
their handles, captured into the graph being traced, and the traced function
lists them in its `variables`. The imported ops are not recorded on a
GradientTape: differentiate inside the program (capture the whole training
step), not through it.
"""

from __future__ import annotations

import hashlib
import inspect
import re
from typing import Any, Dict, List, Optional, Sequence

import tensorflow as tf
from tensorflow.core.framework import attr_value_pb2, function_pb2, graph_pb2, node_def_pb2

from tf_gspmd.graph import ir
from tf_gspmd.graph.from_ops import as_str, make_placeholder
from tf_gspmd.tf_private import (
  FuncGraph,
  atomic_function,
  c_api_util,
  context,
  cpp_shape_inference_pb2,
  function_type_utils,
  handle_data_util,
  importer,
  pywrap_tf_session,
)

# FunctionDef attrs that describe one runtime registration, not the body.
_RUNTIME_FUNCTION_ATTRS = ('_construction_context',)
# The suffix `_rebuild_name` adds; stripped before adding a new one so names
# do not grow over repeated capture/rebuild rounds.
_HASH_SUFFIX = re.compile(r'_g[0-9a-f]{16}$')


def rebuild(
  program: ir.Program, name: Optional[str] = None, autograph: bool = False, **function_kwargs
):
  """A `tf.function` running `program`, called like the function it was captured from.

  Its arguments are bound and flattened with the captured FunctionType, so
  positional/keyword forms and nested structures work as for the original;
  Python (non-tensor) arguments must equal the ones the program was traced
  with. Extra keyword arguments go to `tf.function`.
  """
  function_type = program.function_type
  if function_type is None:
    raise ValueError(
      f'rebuild: program {program.name!r} has no function_type; '
      'use import_program inside a traced function instead.'
    )

  def rebuilt(*args, **kwargs):
    kwargs = _with_defaults(function_type, program.default_values, args, kwargs)
    bound = function_type_utils.canonicalize_function_inputs(args, kwargs, function_type)
    outputs = import_program(program, function_type.unpack_inputs(bound))
    return function_type.pack_output(outputs)

  rebuilt.__name__ = _function_name(name or program.main.name or 'program')
  return tf.function(rebuilt, autograph=autograph, **function_kwargs)


def _with_defaults(function_type, defaults: Dict[str, Any], args, kwargs) -> Dict[str, Any]:
  """`kwargs` plus the Python default of every parameter the call leaves out.

  A traced FunctionType marks every parameter required (its value is part of
  the trace), so the defaults the original tf.function knew are filled in here.
  """
  if not defaults:
    return kwargs
  kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
  positional = [name for name, p in function_type.parameters.items() if p.kind in kinds]
  given = set(positional[: len(args)]) | set(kwargs)
  filled = dict(kwargs)
  for name, value in defaults.items():
    if name in function_type.parameters and name not in given:
      filled[name] = value
  return filled


def import_program(
  program: ir.Program,
  inputs: Sequence[Any],
  variables: Optional[Dict[str, Any]] = None,
  captures: Optional[Dict[str, Any]] = None,
  name: str = 'program',
  return_control_outputs: bool = False,
):
  """Re-create `program` in the graph being traced; its output tensors, in `main.outputs` order.

  `inputs` feed `program.arg_inputs` in order. `variables` maps variable
  placeholder names to what replaces them (a resource tensor of the current
  graph, or a variable/any value whose handle is captured); placeholders not
  listed take the handle of `program.variables[name]`. `captures` does the
  same for the other captured placeholders. Library functions are registered
  in the eager context and added to the current graph. Nodes are named
  `<scope>/<original name>`, the scope being `name` made unique in the graph.
  The enclosing `tf.device` scope applies to the imported nodes as to any op
  created there (a node's own device fields win).

  Stateful ops that no output depends on (the main graph's control outputs)
  are picked up by the automatic control dependencies of the enclosing
  `tf.function`; with `return_control_outputs=True` they are also returned:
  `(outputs, control_output_ops)`.
  """
  graph = tf.compat.v1.get_default_graph()
  if tf.executing_eagerly() or not isinstance(graph, FuncGraph):
    raise RuntimeError(
      'import_program must run while a tf.function is being traced '
      '(inside its Python function); use rebuild() to get a callable.'
    )
  if len(inputs) != len(program.arg_inputs):
    raise ValueError(
      f'import_program: program {program.name!r} takes {len(program.arg_inputs)} inputs '
      f'({program.arg_inputs}), got {len(inputs)}.'
    )
  fed = {}
  for placeholder, value in zip(program.arg_inputs, inputs):
    fed[placeholder] = _as_input(graph, placeholder, value, capture=False)
  variables = variables or {}
  for placeholder, variable in program.variables.items():
    value = _tf_variable_or_value(variables.get(placeholder, variable))
    fed[placeholder] = _as_input(graph, placeholder, value, capture=True)
    if isinstance(value, tf.Variable):
      graph.watch_variable(value)  # so the traced function lists it, like the original did
  captures = captures or {}
  for placeholder, value in program.captures.items():
    fed[placeholder] = _as_input(graph, placeholder, captures.get(placeholder, value), capture=True)
  unknown = set(variables) - set(program.variables) | set(captures) - set(program.captures)
  if unknown:
    raise ValueError(
      f'import_program: {sorted(unknown)} are not captured placeholders of '
      f'program {program.name!r}.'
    )
  missing = [t for t in program.main.inputs if t not in fed]
  if missing:
    raise ValueError(
      f'import_program: main graph inputs {missing} are neither arguments, '
      'variables nor captures of the program.'
    )

  new_names = add_library_to_graph(program, graph)
  args = {}
  for placeholder, value in fed.items():
    node, index = ir.split_tensor_name(placeholder)
    if index != 0:
      raise ValueError(f'import_program: input {placeholder} is not output 0 of a placeholder.')
    args[node] = value
  graph_def = graph_def_of(program.main, new_names, skip=set(args))
  wanted = [t for t in program.main.outputs if ir.split_tensor_name(t)[0] not in args]
  wanted += list(program.main.control_outputs)
  with graph.name_scope(name) as scope:  # a fresh scope: `name`, `name_1`, ...
    pass
  imported = import_nodes(
    graph_def, args, prefix=scope, what=f'program {program.name}', return_elements=wanted
  )
  found = dict(zip(wanted, imported or ()))
  prefix = scope.rstrip('/')
  _restore_handle_data(program.main, graph, prefix=prefix, skip=set(args))
  for node in graph_def.node:  # as for ops created here: the device scope fills unset fields
    graph._apply_device_functions(graph.get_operation_by_name(f'{prefix}/{node.name}'))  # noqa: SLF001
  outputs = []
  for t in program.main.outputs:
    node, _ = ir.split_tensor_name(t)
    outputs.append(args[node] if node in args else found[t])
  if return_control_outputs:
    return outputs, [found[n] for n in program.main.control_outputs]
  return outputs


def _tf_variable_or_value(value):
  """The tf.Variable behind a Keras 3 variable (its `.value`); anything else unchanged."""
  if isinstance(value, (tf.Tensor, tf.Variable)):
    return value
  inner = getattr(value, 'value', None)
  return inner if isinstance(inner, tf.Variable) else value


def _as_input(graph: FuncGraph, placeholder: str, value, capture: bool) -> tf.Tensor:
  """`value` as a tensor of `graph`: variables give their handle; outer tensors are captured."""
  handle = getattr(value, 'handle', None)
  if handle is not None and not isinstance(value, tf.Tensor):
    value = handle
  if isinstance(value, tf.Tensor) and getattr(value, 'graph', None) is graph:
    return value
  if capture or isinstance(value, tf.Tensor):
    return graph.capture(value)
  try:
    return tf.convert_to_tensor(value)
  except (TypeError, ValueError) as e:
    raise TypeError(
      f'import_program: the input for {placeholder} must be a tensor, got {value!r}.'
    ) from e


def import_nodes(
  graph_def,
  args: Dict[str, tf.Tensor],
  prefix: str,
  what: str,
  return_elements: Optional[Sequence[str]] = None,
):
  """Import `graph_def` into the current graph with nodes named in `args` replaced by those tensors.

  Those nodes (argument placeholders) are left out of the import; data and
  control inputs from them are remapped to the given tensors. Node devices are
  kept. Returns the imported `return_elements`.
  """
  body = graph_pb2.GraphDef()
  body.versions.CopyFrom(graph_def.versions)
  used = set()
  for node_def in graph_def.node:
    if node_def.name in args:
      continue
    body.node.add().CopyFrom(node_def)
    used.update(node_def.input)
  input_map = {}
  for name, tensor in args.items():
    for key in (name, f'{name}:0', f'^{name}'):
      if key in used:
        input_map[key if key != name else f'{name}:0'] = tensor
  try:
    return importer._import_graph_def_internal(  # noqa: SLF001
      body,
      input_map=input_map,
      return_elements=return_elements,
      name=prefix,
      validate_colocation_constraints=False,
      propagate_device_spec=True,
    )
  except ValueError as e:
    raise ValueError(f'importing {what} failed: {e}') from e


# ----------------------------------------------------------------------------
# ir.Graph -> GraphDef


def graph_def_of(graph: ir.Graph, new_names: Dict[str, str], skip=()) -> graph_pb2.GraphDef:
  """The NodeDefs of `graph` (without the nodes named in `skip`), library functions renamed."""
  graph_def = graph_pb2.GraphDef()
  graph_def.versions.producer = tf.version.GRAPH_DEF_VERSION
  graph_def.versions.min_consumer = tf.version.GRAPH_DEF_VERSION_MIN_CONSUMER
  for node in graph.nodes:
    if node.name in skip:
      continue
    graph_def.node.append(node_def_of(node, new_names))
  return graph_def


def node_def_of(node: ir.Node, new_names: Dict[str, str]) -> node_def_pb2.NodeDef:
  node_def = node_def_pb2.NodeDef(
    name=node.name, op=new_names.get(node.op, node.op), device=node.device
  )
  node_def.input.extend(node.inputs)
  node_def.input.extend('^' + c for c in node.control_inputs)
  for key, value in node.attrs.items():
    node_def.attr[key].CopyFrom(_renamed_attr(value, new_names))
  return node_def


def _renamed_attr(value: attr_value_pb2.AttrValue, new_names: Dict[str, str]):
  if value.HasField('func') and value.func.name in new_names:
    value = _copy(value)
    value.func.name = new_names[value.func.name]
  elif value.HasField('list') and any(f.name in new_names for f in value.list.func):
    value = _copy(value)
    for f in value.list.func:
      f.name = new_names.get(f.name, f.name)
  return value


def _copy(value):
  copied = type(value)()
  copied.CopyFrom(value)
  return copied


# ----------------------------------------------------------------------------
# Library functions


def add_library_to_graph(program: ir.Program, graph: tf.Graph) -> Dict[str, str]:
  """Rebuild and register every library function of `program` reachable from `main`.

  Each is added to `graph`.

  Returns original name -> new name.
  """
  built = build_library(program)
  for function in built.values():
    if not graph._is_function(function.name):  # noqa: SLF001
      graph._add_function(function)  # noqa: SLF001
  return {old: as_str(function.name) for old, function in built.items()}


def build_library(
  program: ir.Program, roots: Optional[Sequence[str]] = None
) -> Dict[str, atomic_function.AtomicFunction]:
  """Rebuild the library functions reachable from `roots` (default: from `main`), callees first.

  Each is registered in the eager context under its new name; the returned
  AtomicFunctions keep the registrations alive.
  """
  order = _reachable_functions(program, roots)
  built: Dict[str, atomic_function.AtomicFunction] = {}
  for name in order:
    built[name] = _build_function(program.function(name), built)
  return built


def _reachable_functions(program: ir.Program, roots: Optional[Sequence[str]]) -> List[str]:
  """Library functions reachable from `roots`, every function after the ones it calls."""
  if roots is None:
    roots = _calls_of(program.main, program)
  order, state = [], {}

  def visit(name, path):
    if state.get(name) == 'done':
      return
    if state.get(name) == 'active':
      raise ValueError(f'rebuild: library functions call each other in a cycle: {path + [name]}.')
    state[name] = 'active'
    for callee in _calls_of(program.function(name), program):
      visit(callee, path + [name])
    state[name] = 'done'
    order.append(name)

  for root in roots:
    visit(root, [])
  return order


def _calls_of(graph: ir.Graph, program: ir.Program) -> List[str]:
  """Library functions of `program` that `graph` names; other names must already exist in TF."""
  names = []
  for node in graph.nodes:
    names.append(node.op)
    names.extend(node.function_refs())
  seen = set()
  return [n for n in names if n in program.functions and not (n in seen or seen.add(n))]


def _build_function(
  graph: ir.Graph, built: Dict[str, atomic_function.AtomicFunction]
) -> atomic_function.AtomicFunction:
  """One library function, rebuilt from the IR, registered under a content-derived name."""
  new_names = {old: as_str(f.name) for old, f in built.items()}
  callees = [built[n] for n in _callee_names(graph, built)]
  func_graph = FuncGraph(graph.name)
  with func_graph.as_default():
    for callee in callees:
      func_graph._add_function(callee)  # noqa: SLF001
    args = {}
    for tensor_name in graph.inputs:
      node, index = ir.split_tensor_name(tensor_name)
      if index != 0 or graph.node(node).op != 'Placeholder':
        raise ValueError(
          f'rebuild: input {tensor_name} of function {graph.name} is not output 0 of a Placeholder.'
        )
      args[node] = make_placeholder(
        node,
        graph.tensor(tensor_name).dtype,
        graph.tensor(tensor_name).shape,
        _handle_data_proto(graph.tensor(tensor_name)),
      )
    import_nodes(
      graph_def_of(graph, new_names, skip=set(args)), args, prefix='', what=f'function {graph.name}'
    )
    _restore_handle_data(graph, func_graph, prefix='', skip=set(args))
  missing = [n.name for n in graph.nodes if not _has_op(func_graph, n.name)]
  if missing:
    raise ValueError(
      f'rebuild: nodes {missing[:5]} of function {graph.name} were renamed on import.'
    )
  func_graph.inputs = [args[ir.split_tensor_name(t)[0]] for t in graph.inputs]
  func_graph.outputs = [func_graph.get_tensor_by_name(t) for t in graph.outputs]
  func_graph.control_outputs = [func_graph.get_operation_by_name(n) for n in graph.control_outputs]
  fdef = _function_def(func_graph, graph)
  fdef.signature.name = _rebuild_name(graph.name, fdef)
  return _register(fdef, func_graph, callees)


def _callee_names(graph: ir.Graph, built) -> List[str]:
  names = [n.op for n in graph.nodes if n.op in built]
  names += [f for n in graph.nodes for f in n.function_refs() if f in built]
  seen = set()
  return [n for n in names if not (n in seen or seen.add(n))]


def _has_op(graph: tf.Graph, name: str) -> bool:
  try:
    graph.get_operation_by_name(name)
    return True
  except KeyError:
    return False


def _restore_handle_data(graph: ir.Graph, tf_graph: tf.Graph, prefix: str, skip) -> None:
  """Give imported resource/variant outputs the handle data the IR recorded, where TF lost it.

  Shape inference does not carry a variable's shape through every op (a
  While's resource outputs, for one); the IR knows it from capture time.
  """
  for node in graph.nodes:
    if node.name in skip:
      continue
    for tensor in node.outputs:
      if not tensor.handle_data:
        continue
      imported = tf_graph.get_tensor_by_name(f'{prefix}/{tensor.name}' if prefix else tensor.name)
      current = handle_data_util.get_resource_handle_data(imported)
      if not (current.is_set and current.shape_and_type):
        handle_data_util.set_handle_data(imported, _handle_data_proto(tensor))


def _handle_data_proto(tensor: ir.Tensor):
  """The HandleData proto of an IR tensor, or None.

  Made from `handle_data` (which a later stage may have edited), keeping the
  full types of the captured proto (`handle_proto`) where there is one.
  """
  if not tensor.handle_data:
    return None
  captured = list(tensor.handle_proto.shape_and_type) if tensor.handle_proto is not None else []
  data = cpp_shape_inference_pb2.CppShapeInferenceResult.HandleData(is_set=True)
  for i, (dtype, shape) in enumerate(tensor.handle_data):
    entry = data.shape_and_type.add()
    entry.dtype = tf.as_dtype(dtype).as_datatype_enum
    entry.shape.CopyFrom(tf.TensorShape(shape).as_proto())
    if i < len(captured) and captured[i].HasField('type'):
      entry.type.CopyFrom(captured[i].type)
  return data


def _function_def(func_graph: FuncGraph, graph: ir.Graph) -> function_pb2.FunctionDef:
  """The FunctionDef of `func_graph` (inputs, outputs, control outputs set), with `graph.attrs`."""
  input_ops = {t.op.name for t in func_graph.inputs}
  operations = [op for op in func_graph.get_operations() if op.name not in input_ops]
  output_names = list(graph.output_names)
  if len(output_names) != len(graph.outputs) or len(set(output_names)) != len(output_names):
    output_names = []
  with func_graph._c_graph.get() as c_graph:  # noqa: SLF001
    c_func = pywrap_tf_session.TF_GraphToFunction_wrapper(
      c_graph,
      tf.compat.as_str(graph.name),
      False,
      [op._c_op for op in operations],  # noqa: SLF001
      [t._as_tf_output() for t in func_graph.inputs],  # noqa: SLF001
      [t._as_tf_output() for t in func_graph.outputs],  # noqa: SLF001
      [tf.compat.as_bytes(n) for n in output_names],
      [op._c_op for op in func_graph.control_outputs],  # noqa: SLF001
      [],
      None,
      '',
    )
  try:
    with c_api_util.tf_buffer() as buffer:
      pywrap_tf_session.TF_FunctionToFunctionDef(c_func, buffer)
      fdef = function_pb2.FunctionDef.FromString(
        tf.compat.as_bytes(pywrap_tf_session.TF_GetBuffer(buffer))
      )
  finally:
    pywrap_tf_session.TF_DeleteFunction(c_func)
  for key, value in graph.attrs.items():
    if key in _RUNTIME_FUNCTION_ATTRS:
      continue
    if key == '_input_shapes':  # keep it true to the (possibly edited) argument shapes
      value = attr_value_pb2.AttrValue(
        list=attr_value_pb2.AttrValue.ListValue(
          shape=[t.shape.as_proto() for t in func_graph.inputs]
        )
      )
    fdef.attr[key].CopyFrom(value)
  return fdef


def _rebuild_name(original: str, fdef: function_pb2.FunctionDef) -> str:
  """`<original>_g<hash>`: the hash covers the whole FunctionDef except its name."""
  nameless = function_pb2.FunctionDef()
  nameless.CopyFrom(fdef)
  nameless.signature.name = ''
  digest = hashlib.sha256(nameless.SerializeToString(deterministic=True)).hexdigest()[:16]
  return f'{_HASH_SUFFIX.sub("", original)}_g{digest}'


def _register(
  fdef: function_pb2.FunctionDef,
  func_graph: FuncGraph,
  callees: List[atomic_function.AtomicFunction],
) -> atomic_function.AtomicFunction:
  """Add `fdef` to the eager context (once per name) and wrap it in an AtomicFunction."""
  ctx = context.context()
  name = fdef.signature.name
  if not ctx.has_function(name):
    ctx.add_function_def(fdef)
  return atomic_function.AtomicFunction(
    name,
    ctx,
    function_type_utils.derive_from_graph(func_graph),
    children=callees,
    call_options=atomic_function.CallOptions(is_stateful=fdef.signature.is_stateful),
  )


def _function_name(hint: str) -> str:
  cleaned = re.sub(r'[^A-Za-z0-9_]', '_', hint)
  return cleaned if cleaned and not cleaned[0].isdigit() else f'f_{cleaned}'
