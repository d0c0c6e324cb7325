"""The library functions reachable from a captured graph, converted to `ir.Graph`s.

If/While branches and bodies, called functions and any other op's `func` attrs, each with
static shapes (and handle data of resource arguments) taken from its call sites; see
tf_gspmd/graph/capture.py.
"""

from __future__ import annotations

import dataclasses
import heapq
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf
from tensorflow.core.framework import attr_value_pb2, graph_pb2, node_def_pb2

from tf_gspmd.graph import ir, static_values
from tf_gspmd.graph.from_ops import graph_from_ops, handle_data_of, make_placeholder
from tf_gspmd.tf_private import FuncGraph, function_def_to_graph, handle_data_util

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


@dataclasses.dataclass(frozen=True, eq=False)
class _Held:
  """What an optional (a variant) is known to hold: a small integer `value`, or the handle
  data of a resource or variant (a while loop's TensorList accumulator: the shape of what
  its gradient pops). cond_v2 hands a branch's intermediates to the branch's gradient
  wrapped so (`OptionalFromValue` in the forward branch, an If output, `OptionalGetValue` in
  the gradient branch); a backward function needs their shapes."""

  value: Optional[np.ndarray] = None
  handle: Any = None


# An optional holding nothing (`OptionalNone`: the slot of the other branch's intermediate).
# Never read by a run that succeeds, so it agrees with any value (`_same_value`).
_EMPTY = 'an empty optional'


class LibraryConverter:
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
    # Per function, the value every call site passes an argument where it is the same small
    # integer constant (None elsewhere): its body reads a constant there (`_convert`).
    self._arg_values: Dict[str, List[Optional[np.ndarray]]] = {}
    # Call results whose value is such a constant of the callee's (a shape the forward function
    # of a gradient returns for the backward function to take), by tensor; for an optional, a
    # `_Held` (or `_EMPTY`).
    self._values: Dict[Any, Any] = {}
    # Every tensor's `_small_int_value` once computed (None too): a call's operands are asked
    # once per call site, and evaluating a value TF's own folding misses runs a scratch graph.
    self._small_values: Dict[Any, Optional[np.ndarray]] = {}
    self._graphs: Dict[str, FuncGraph] = {}
    self._order: List[str] = []

  def converted_names(self) -> List[str]:
    return list(self._order)

  def visit(self, graph: tf.Graph) -> None:
    """Convert every function the ops of `graph` (the top level) reach."""
    for op in graph.get_operations():
      for name, specs, values in self._call_sites(op.type, op.node_def.attr, list(op.inputs)):
        self._reach(name, specs, values)
      self._record_call_values(op)

  def _reach(
    self, name: str, specs: Optional[List[ArgSpec]], values: Optional[List] = None
  ) -> None:
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
    values = values if values is not None else [None] * len(specs)
    old = self._specs.get(name)
    old_values = self._arg_values.get(name)
    merged = specs if old is None else [_merge_spec(a, b) for a, b in zip(old, specs)]
    merged_values = (
      values if old_values is None else [_same_value(a, b) for a, b in zip(old_values, values)]
    )
    if (
      old is not None
      and _same_specs(old, merged)
      and _same_values(old_values, merged_values)
      and name in self._graphs
    ):
      return
    self._specs[name] = merged
    self._arg_values[name] = merged_values
    self._graphs[name] = self._convert(fdef, merged, merged_values)
    if name not in self._order:
      self._order.append(name)

  def _call_sites(self, op_type: str, attrs, inputs: Sequence[tf.Tensor]):
    """(function name, argument specs or None when the call site says nothing, argument values
    or None) per function."""
    if op_type in self._fdefs:  # a function called by name as the op type
      yield op_type, [_spec_of(t) for t in inputs], [self._value_of(t) for t in inputs]
    if op_type in _WHILE_OPS:  # a loop variable changes from one iteration to the next
      specs = _while_specs(attrs, inputs)
      for attr in ('cond', 'body'):
        yield attrs[attr].func.name, specs, None
      return
    known = _CALL_OPERANDS.get(op_type)
    specs = values = None
    if known is not None:
      specs = [_spec_of(t) for t in inputs[known[1] :]]
      values = [self._value_of(t) for t in inputs[known[1] :]]
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
          called = known is not None and attr in known[0]
          yield name, (specs if called else None), (values if called else None)

  def _convert(self, fdef, specs: List[ArgSpec], values: List) -> FuncGraph:
    """`fdef` as a FuncGraph whose arguments have `specs`; where every call site passes the
    same small integer constant (`values`), the body reads that constant instead of the
    argument (the argument stays, unread), so that TF's shape inference and
    `static_values.fold` see it: a backward function slices, pads and sums by shapes its
    forward function computed and passed on."""
    with self._scratch.as_default():
      graph_def, flat_names = function_def_to_graph.function_def_to_graph_def(fdef)
      func_graph = FuncGraph(fdef.signature.name)
    arg_names = {a.name for a in fdef.signature.input_arg}
    substitutes: Dict[str, tf.Tensor] = {}
    with func_graph.as_default():
      placeholders = [
        make_placeholder(arg.name, tf.as_dtype(arg.type), shape, handle)
        for arg, (shape, handle) in zip(fdef.signature.input_arg, specs)
      ]
      for arg, placeholder, value in zip(fdef.signature.input_arg, placeholders, values):
        if isinstance(value, np.ndarray):
          substitutes[f'{arg.name}:0'] = _static_constant(value, tf.as_dtype(arg.type), arg.name)
        elif value is not None:  # an optional's: read where the body unwraps it
          self._values[placeholder.ref()] = value
      for node_def in _topological_node_defs(graph_def.node, arg_names, fdef.signature.name):
        self._create_op(func_graph, node_def, substitutes)
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

  def _create_op(self, graph: FuncGraph, node_def, substitutes: Dict[str, tf.Tensor]):
    """Create `node_def` in `graph` (exact name, attrs and device), callees converted first;
    an input named in `substitutes` (an argument or call result of known value) reads the
    constant there."""
    names = [i if ':' in i else f'{i}:0' for i in node_def.input if not i.startswith('^')]
    inputs = [substitutes[n] if n in substitutes else graph.get_tensor_by_name(n) for n in names]
    controls = [graph.get_operation_by_name(i[1:]) for i in node_def.input if i.startswith('^')]
    callees = list(self._call_sites(node_def.op, node_def.attr, inputs))
    for name, specs, values in callees:
      self._reach(name, specs, values)
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
    self._record_call_values(op)
    self._record_optional_values(op)
    for out in op.outputs:
      value = self._values.get(out.ref())
      if isinstance(value, np.ndarray):
        substitutes[out.name] = _static_constant(value, out.dtype, op.name)
    return op

  def _callees(self, op: tf.Operation) -> List[str]:
    """The functions a call op (not a While: its results are the last iteration's) runs."""
    if op.type in self._fdefs:
      return [op.type]
    if op.type not in _CALL_OPERANDS:
      return []
    names: List[str] = []
    for attr in _CALL_OPERANDS[op.type][0]:
      value = op.node_def.attr[attr]
      names += [value.func.name] if value.HasField('func') else [f.name for f in value.list.func]
    return names

  def _record_call_values(self, op: tf.Operation) -> None:
    """A call's results that every callee returns as one small integer constant."""
    graphs = [self._graphs.get(n) for n in self._callees(op)]
    if not graphs or any(g is None for g in graphs):
      return
    for i, out in enumerate(op.outputs):
      found = [self._value_of(g.outputs[i]) if i < len(g.outputs) else None for g in graphs]
      value = found[0]
      for other in found[1:]:
        value = _same_value(value, other)
      if value is not None:
        self._values[out.ref()] = value

  def _record_optional_values(self, op: tf.Operation) -> None:
    """An optional made of a known value holds it; unwrapped, it is that value again."""
    if op.type == 'OptionalNone':
      self._values[op.outputs[0].ref()] = _EMPTY
    elif op.type == 'OptionalFromValue' and len(op.inputs) == 1:
      value = self._value_of(op.inputs[0])
      handle = handle_data_of(op.inputs[0])
      if isinstance(value, np.ndarray) or handle is not None:
        self._values[op.outputs[0].ref()] = _Held(_array_or_none(value), handle)
    elif op.type == 'OptionalGetValue' and len(op.outputs) == 1:
      held = self._values.get(op.inputs[0].ref())
      if not isinstance(held, _Held):
        return
      out = op.outputs[0]
      if held.value is not None:
        self._values[out.ref()] = held.value
      if held.handle is not None and out.dtype in (tf.resource, tf.variant):
        handle_data_util.set_handle_data(out, held.handle)

  def known_results(self, graph: tf.Graph) -> Dict[str, np.ndarray]:
    """The call results of `graph` (the top level, after `visit`) whose value is known: by
    tensor name, for `static_values.substitute`."""
    found = {}
    for op in graph.get_operations():
      for out in op.outputs:
        value = self._values.get(out.ref())
        if isinstance(value, np.ndarray):
          found[out.name] = value
    return found

  def _value_of(self, t: tf.Tensor):
    """`t`'s value where it is a small integer constant known before run time (for an
    optional, what it holds: `_Held`, `_EMPTY`), else None."""
    known = self._values.get(t.ref())
    if known is not None:
      return known
    if t.ref() not in self._small_values:
      self._small_values[t.ref()] = _small_int_value(t)
    return self._small_values[t.ref()]

  def _refine_call_outputs(self, op: tf.Operation) -> None:
    """Give a call's outputs the static shapes (and handle data) of the callee's outputs.

    An If/Case output takes the most specific shape all branches agree on.
    A While keeps the loop shapes its `output_shapes` attr already gave it, and takes the
    handle data its body gives a loop-carried resource or variant (a TensorList accumulator of
    a gradient's forward loop: its element shape is what the gradient loop pops).
    """
    if op.type in _WHILE_OPS:
      self._refine_while_handles(op)
      return
    bodies = self._callees(op)
    if not bodies:
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
      if out.dtype in (tf.resource, tf.variant) and handle_data_of(out) is None:
        handles = [handle_data_of(r) for r in results]
        if handles[0] is not None and all(_same_handle_data(handles[0], h) for h in handles):
          handle_data_util.set_handle_data(out, handles[0])

  def _refine_while_handles(self, op: tf.Operation) -> None:
    body = self._graphs.get(op.node_def.attr['body'].func.name)
    if body is None:
      return
    for out, result, carried in zip(op.outputs, body.outputs, op.inputs):
      if out.dtype not in (tf.resource, tf.variant) or handle_data_of(out) is not None:
        continue
      handle = handle_data_of(result)
      entering = handle_data_of(carried)
      if handle is not None and (entering is None or _same_handle_data(handle, entering)):
        handle_data_util.set_handle_data(out, handle)

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


def _small_int_value(t: tf.Tensor) -> Optional[np.ndarray]:
  """`t`'s value where TF knows it statically and it is an integer tensor as small as the
  values `static_values` folds (shapes, offsets, permutations), else None."""
  if t.dtype not in (tf.int32, tf.int64) or not t.shape.is_fully_defined():
    return None
  if t.shape.num_elements() > static_values.MAX_ELEMENTS:
    return None
  return static_values.tensor_value(t)


def _array_or_none(value) -> Optional[np.ndarray]:
  return value if isinstance(value, np.ndarray) else None


def _static_constant(value: np.ndarray, dtype: tf.DType, name: str) -> tf.Tensor:
  return tf.constant(value, dtype=dtype, name=f'{name.replace(":", "_")}_static_value')


def _same_value(a, b):
  """`a` where `b` is the same value, else None (call sites that disagree pass no constant);
  an empty optional agrees with anything (`_EMPTY`), and optionals agree on what they hold."""
  if a is _EMPTY or b is _EMPTY:
    return b if a is _EMPTY else a
  if isinstance(a, _Held) and isinstance(b, _Held):
    value = _same_value(a.value, b.value)
    same_handle = a.handle is not None and b.handle is not None
    handle = a.handle if same_handle and _same_handle_data(a.handle, b.handle) else None
    return None if value is None and handle is None else _Held(value, handle)
  if not isinstance(a, np.ndarray) or not isinstance(b, np.ndarray):
    return None
  if a.shape != b.shape or a.dtype != b.dtype:
    return None
  return a if np.array_equal(a, b) else None


def _same_values(a: Optional[List], b: List) -> bool:
  if a is None:
    return False
  return all((x is None) == (y is None) for x, y in zip(a, b))


def _while_specs(attrs, inputs: Sequence[tf.Tensor]) -> List[ArgSpec]:
  """A While's loop-variable specs: its `output_shapes` (the loop's shape invariants) if given."""
  shapes = list(attrs['output_shapes'].list.shape) if 'output_shapes' in attrs else []
  if len(shapes) != len(inputs):
    return [_spec_of(t) for t in inputs]
  return [(tf.TensorShape(s), handle_data_of(t)) for s, t in zip(shapes, inputs)]


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


def _spec_of(t: tf.Tensor) -> ArgSpec:
  return t.shape, handle_data_of(t)


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
