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

import contextlib
import functools
import threading
from typing import Any, Dict, Iterator, Optional, Sequence, Tuple

import tensorflow as tf

from tf_gspmd import op_sharding
from tf_gspmd.graph import ir, static_values
from tf_gspmd.graph.from_ops import as_str, graph_from_ops
from tf_gspmd.graph.library import LibraryConverter
from tf_gspmd.graph.prune import prune_dead
from tf_gspmd.sharding import Sharding
from tf_gspmd.tf_private import (
  FuncGraph,
  TFFunction,
  fast_graph_building,
  without_op_tracebacks,
)

# Set while a function is traced to be partitioned: a variable whose value lives only as its
# shards (program/held.py) then reads and writes its own handle, which the partitioner maps to
# the shards; outside such a trace it reads and writes the shards themselves.
_PARTITION_TRACE = threading.local()


def tracing_for_partition() -> bool:
  """True while `capture` traces a function (its variable reads are the partitioner's to map)."""
  return getattr(_PARTITION_TRACE, 'depth', 0) > 0


@contextlib.contextmanager
def partition_trace() -> Iterator[None]:
  depth = getattr(_PARTITION_TRACE, 'depth', 0)
  if depth == 0:
    _PARTITION_TRACE.copies = {}  # id(tf.function) -> (it, its copy for this capture)
  _PARTITION_TRACE.depth = depth + 1
  try:
    yield
  finally:
    _PARTITION_TRACE.depth -= 1
    if _PARTITION_TRACE.depth == 0:
      _PARTITION_TRACE.copies = {}


def capture(fn, *args, input_signature: Optional[Sequence[Any]] = None, **kwargs) -> ir.Program:
  """The IR of `fn` traced on `args`/`kwargs` (example values or TensorSpecs).

  `fn` may be a `tf.function`, a ConcreteFunction (then args are ignored) or a
  plain Python function (wrapped in `tf.function`). With `input_signature`
  (a sequence of TensorSpecs) `fn` is traced on it instead of on `args`.
  Tracing must not create variables: build models and optimizers first.

  A tf.function is traced afresh (a copy of it, inside `partition_trace`): its own cached
  traces are the user's, reading variables as plain calls read them (held variables: their
  shards), and the partition trace must not become one of them.
  """
  fn = _as_tf_function(fn)
  concrete = trace(fn, *args, input_signature=input_signature, **kwargs)
  # A tf.function knows its Python defaults; a ConcreteFunction does not.
  defaults = getattr(fn, '_default_values', None) if concrete is not fn else None
  return capture_concrete(concrete, default_values=defaults)


def trace(fn, *args, input_signature: Optional[Sequence[Any]] = None, **kwargs):
  """The ConcreteFunction `capture` captures: `fn` traced afresh inside `partition_trace` (a
  ConcreteFunction as it is). Tracing is the slow part of a capture; `capture(concrete)`
  of its result captures again without tracing (the variables' annotations read anew), as
  `tg.auto_shard` does for every layout it plans."""
  fn = _as_tf_function(fn)
  # The trace only becomes IR (never a function TF runs): its ops need no Python stacks, which
  # TF records per op and converts when it registers the function (`without_op_tracebacks`).
  with partition_trace(), without_op_tracebacks(), fast_graph_building():
    return concrete_function_of(_fresh(fn), args, kwargs, input_signature)


def concrete_function_of(fn, args=(), kwargs=None, input_signature=None):
  """The ConcreteFunction `capture` works on."""
  fn = _as_tf_function(fn)
  if isinstance(fn, tf.types.experimental.ConcreteFunction):
    return fn
  if input_signature is not None:
    return fn.get_concrete_function(*input_signature)
  return fn.get_concrete_function(*args, **(kwargs or {}))


def _fresh(fn):
  """A tf.function with `fn`'s options and none of its traces (a ConcreteFunction as it is).

  `_clone` is the tf.function's own copy constructor (what binding it to an instance uses);
  no public API copies a tf.function's options (autograph, jit_compile, input signature).
  """
  clone = getattr(fn, '_clone', None)
  return clone(None) if clone is not None else fn


def _call_traced_apart(original_call):
  """`tf.function.__call__`, which inside a partition trace calls a fresh copy of the function.

  A nested tf.function called while `capture` traces for the partitioner must trace there,
  reading variables as the partitioner needs (a SplitVariable's handle), and that trace must
  never serve a plain call later (nor a plain trace, reading shards, the partitioner): TF's
  cache key has nothing to tell the two apart. The copy's cache dies with this capture.
  """

  @functools.wraps(original_call)
  def call(self, *args, **kwargs):
    if tracing_for_partition() and not tf.executing_eagerly():
      return original_call(_copy_for_this_capture(self), *args, **kwargs)
    return original_call(self, *args, **kwargs)

  return call


def _copy_for_this_capture(fn):
  """`fn`'s fresh copy, one per capture (a function called twice traces once there)."""
  copies = _PARTITION_TRACE.copies
  entry = copies.get(id(fn))
  if entry is None or entry[0] is not fn:
    entry = copies[id(fn)] = (fn, _fresh(fn))
  return entry[1]


TFFunction.__call__ = _call_traced_apart(TFFunction.__call__)


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
  converter = LibraryConverter(library)
  converter.visit(graph)

  variables, captures = _captured_values(graph)
  main = graph_from_ops(
    graph.name, graph.get_operations(), graph.inputs, graph.outputs, graph.control_outputs
  )
  static_values.substitute(main, converter.known_results(graph))
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
    name=as_str(concrete.name),
  )
  _record_variable_shardings(program)
  return program


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
