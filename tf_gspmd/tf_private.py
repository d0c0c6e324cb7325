"""TensorFlow's private API (`tensorflow.python...`), imported in this one module.

Each symbol keeps its TF name (a module under its module name), so a caller
writes `from tf_gspmd.tf_private import context` where it would have written
`from tensorflow.python.eager import context`; tests/test_private_api.py fails on
a `tensorflow.python` import anywhere else in tf_gspmd. Each one says why no
public API serves. A TF upgrade that moves one of them breaks here, in one place.

Not here, because a public API serves (use it instead):
  tensor_util.MakeNdarray                           -> tf.make_ndarray
  errors.DEADLINE_EXCEEDED                          -> tf.errors.DEADLINE_EXCEEDED
  gen_functional_ops.stateful_partitioned_call      -> tf.raw_ops.StatefulPartitionedCall
  gen_resource_variable_ops.resource_scatter_update -> tf.raw_ops.ResourceScatterUpdate
  context.executing_eagerly                         -> tf.executing_eagerly
  ops.get_default_graph                             -> tf.compat.v1.get_default_graph
  ops.Operation                                     -> tf.Operation
  importer.import_graph_def                         -> tf.graph_util.import_graph_def
  array_ops.placeholder                             -> tf.compat.v1.placeholder
  concrete_function.ConcreteFunction                -> tf.types.experimental.ConcreteFunction
  versions.GRAPH_DEF_VERSION(_MIN_CONSUMER)         -> tf.version.GRAPH_DEF_VERSION(...)
  compat.as_str / as_bytes                          -> tf.compat.as_str / as_bytes
"""

# One import per symbol, each under the comment saying why it is needed (not sorted by isort,
# which would merge the imports of one package and move their comments apart).
# ruff: noqa: I001

import contextlib
import sys
import threading
from typing import Optional

import numpy as np

# The eager context: aborting collectives on a hung step (the watchdog), per-call function
# options (Grappler off), waiting for async writes (`async_wait`), the cluster's ServerDef
# (`get_server_def`) and registering a rebuilt function (`context().add_function_def`).
# tf.config and tf.experimental expose none of these.
from tensorflow.python.eager import context

# An AtomicFunction is the callable one FunctionDef becomes; a rebuilt function is made as
# one directly, without tracing Python again (tf.function only builds them by tracing).
from tensorflow.python.eager.polymorphic_function import atomic_function

# The FunctionType of a rebuilt function (derived from its FuncGraph) and the binding of
# call arguments to it; no public API derives a FunctionType from a graph.
from tensorflow.python.eager.polymorphic_function import function_type_utils

# The TF C API's graph-to-FunctionDef conversion, and the buffer it writes into: the only way to
# turn a FuncGraph built op by op into a FunctionDef with chosen output names.
from tensorflow.python.client import pywrap_tf_session
from tensorflow.python.framework import c_api_util

# The class of every tf.function (`tf.function` returns one; tf.types.experimental has only its
# abstract base): graph/capture.py wraps its `__call__` so that a nested tf.function called
# during a partition trace traces afresh, apart from the traces plain calls reuse.
from tensorflow.python.eager.polymorphic_function.polymorphic_function import (
  Function as TFFunction,
)

# The graph a tf.function body is traced into: rebuilt and captured bodies are built in one
# (captures, handle data, control outputs); tf.Graph has none of that.
from tensorflow.python.framework.func_graph import FuncGraph

# FunctionDef -> GraphDef with the names of its outputs resolved: the public importers take a
# GraphDef only, and a function's body refers to its outputs as `op:output_arg:index`.
from tensorflow.python.framework import function_def_to_graph

# `_import_graph_def_internal` imports a function body into the graph being traced with its
# devices kept (`propagate_device_spec`) and colocation left unchecked
# (`validate_colocation_constraints`); the public tf.graph_util.import_graph_def takes neither.
from tensorflow.python.framework import importer

# The registered OpDef of an op type (its input and output args, whether it is stateful): no
# public API reads it.
from tensorflow.python.framework import op_def_registry

# The HandleData proto of a resource tensor (the dtype and shape of the variable behind it);
# TF does not export this proto.
from tensorflow.python.framework import cpp_shape_inference_pb2

# Reads and copies a resource tensor's handle data (variable dtype and shape) across graphs;
# without it a placeholder standing for a variable handle reads as an unknown shape.
from tensorflow.python.ops import handle_data_util

# Which resource inputs of a function only read their variable (the attr automatic control
# dependencies use to let reads run in parallel); computed by TF's private helper only.
from tensorflow.python.framework import auto_control_deps_utils

# The builders of TF's collective V2 ops (group and instance keys, ordering token, timeout)
# that tf.distribute itself uses; tf.raw_ops.Collective*V2 are the bare ops without them.
from tensorflow.python.ops import collective_ops

# The registry of tf.py_function's Python callables, by the token their EagerPyFunc op carries:
# only the callable knows whether the op is a py_function's gradient, which TF pairs with the
# forward call through a tape kept per token (`is_py_function_gradient`); the op's attrs do not
# say so, and TF has no public registry of py_functions.
from tensorflow.python.ops import script_ops

# A resource variable that has a shape and dtype but never allocates its value (`tg.plan` of a
# model too large to build; a SplitVariable's logical handle, program/held.py); tf.Variable
# always initializes.
from tensorflow.python.ops.resource_variable_ops import UninitializedVariable


# The variable-access hook every TF read calls: it watches the variable on the active gradient
# tapes (and, in a FuncGraph, records it among the graph's variables). A SplitVariable
# (program/held.py) reads its shards instead of a handle and calls this itself, so
# `tf.GradientTape` still sees the read; no public API watches a variable from inside a read.
from tensorflow.python.ops.resource_variable_ops import variable_accessed

# `record_operation` ties a computed value to an input on the gradient tapes, with its gradient
# function: a SplitVariable's assembled value is tied to the variable's handle (identity
# gradient), as TF ties a ReadVariableOp's result; tf.custom_gradient cannot name a handle.
from tensorflow.python.eager import record

# Whether a SavedModel is being written (`in_save_context`): a SplitVariable (program/held.py)
# is exported as its shard variables only (the functions that read it capture them), not also
# as its whole value; TF tells a checkpoint's serialization from a SavedModel's no other way.
from tensorflow.python.saved_model import save_context

# The key a variable's value is saved under in a checkpoint ('VARIABLE_VALUE'): a SplitVariable
# serializes its assembled value under it, as a plain variable would.
from tensorflow.python.trackable.base import VARIABLE_VALUE_KEY

# TF's own XlaSharding annotation (an `XlaSharding` op carrying an OpSharding) and its reader;
# tf2xla reads exactly these ops, and TF exports no API writing them.
from tensorflow.python.compiler.xla.experimental import xla_sharding

# TF's XLA ops (XlaReduceScatter, XlaCustomCall, XlaAllReduce): tf.raw_ops lists none of them
# (XLA builds them in its own op library). tg.shard_map writes its psum_scatter, all_gather and
# axis_index as these ops, read back by the partitioner inside manual regions.
from tensorflow.compiler.tf2xla.ops import gen_xla_ops

# The kernels registered for an op type: a TPU-only op (no CPU kernel) is refused when a
# function is partitioned, naming it, rather than failing at run time. No public API lists them.
from tensorflow.python.framework import kernels

# Where a graph constant is made from a Python value (`constant_op` calls
# `ops._create_graph_constant`): `shared_values` answers a value it has made before without
# building its TensorProto again. TF exposes no hook there.
from tensorflow.python.framework import ops

# Where TF records the Python stack that made each graph op (`ops._create_c_op` calls its
# `extract_stack`): the per-partition program's ops are made without one
# (`without_op_tracebacks`). TF exposes no switch for it.
from tensorflow.python.util import tf_stack

# TF's process-wide switches of its C++ fast paths (`tensorflow/core/config/flag_defs.h`):
# `fast_graph_building` turns on `graph_building_optimization` while tf_gspmd traces. TF's
# public API sets none of them.
from tensorflow.core.config import flags as tf_flags

# TF's stack extraction itself, with a filter of its own: the one-frame stack ops made inside
# `without_op_tracebacks` share names only this module's line (tf_stack filters by TF's
# thread-local scopes only).
from tensorflow.python.util import _tf_stack


def set_op_attr(op, name: str, value) -> None:
  """Set attr `name` (an AttrValue) on a graph op: `Operation._set_attr`, TF's only way to add
  an attr to an op already built (xla_sharding writes `_XlaSharding` the same way)."""
  op._set_attr(name, value)  # noqa: SLF001


def is_py_function_gradient(token: str) -> bool:
  """Whether the EagerPyFunc op of `token` runs a tf.py_function's gradient (`_is_grad_func`
  of the registered `EagerFunc`; a private attribute, set by TF's EagerPyFunc gradient)."""
  func = script_ops._py_funcs.get(token)  # noqa: SLF001
  return bool(getattr(func, '_is_grad_func', False))


def runtime_started() -> bool:
  """Whether TF's runtime (the eager context's C++ side: devices, thread pools) has started in
  this process. Until it has, TF has no thread of its own, so a forked child starts with a
  TF it can configure afresh (`testing/fuzz_pool.py` forks its workers then, instead of
  spawning interpreters that import TF again). `Context._context_handle` is private; no
  public API says whether the context was initialized without initializing it."""
  return context.context()._context_handle is not None  # noqa: SLF001


def iterators_without_autotuning() -> None:
  """Every tf.data iterator made from now on in this process runs without autotuning.

  tf.data's autotuning thread sleeps between its rounds, longer the longer a pipeline has
  lived (seconds once a partitioned `fit` spent its first step building the program), and an
  iterator's destruction waits for that sleep to end: a Keras fuzz model's `fit` idled a fifth
  of its time there. Autotuning picks parallelism and buffer sizes, never the elements nor
  their order. `_apply_debug_options` is the private step every iterator's dataset passes
  through (tf.data has no process-wide default options); the Keras fuzzer calls this once
  per process (`testing/keras_fuzz.py`)."""
  import tensorflow as tf
  from tensorflow.python.data.ops import dataset_ops

  apply = dataset_ops.DatasetV2._apply_debug_options  # noqa: SLF001
  if getattr(apply, 'without_autotuning', False):
    return

  def applied(dataset):
    options = tf.data.Options()
    options.autotune.enabled = False
    return apply(dataset).with_options(options)

  applied.without_autotuning = True  # type: ignore[attr-defined]
  dataset_ops.DatasetV2._apply_debug_options = applied  # noqa: SLF001


@contextlib.contextmanager
def shared_values(graph, seeds=()):
  """While active, a `Const` made in `graph` with the dtype and value of one made before in
  it is that one, and so is a stateless op (by its TF OpDef, calling no function) of the same
  type, attrs and inputs when its inputs are such constants, `seeds` (the partition id) or
  values made so: one node, not one per use.
  A Reshape of a Reshape that no control input orders reshapes the first one's input.

  A per-partition program's body is half constants and values computed from them and the
  partition id alone (shapes, slice bounds, offsets, masks of padding, group keys; 60 of one
  program's 200 nodes were the scalar 0, and a fuzz program's offsets were looked up from
  the partition id up to four times each), and TF places, optimizes and partitions every
  node of it once per device before its first run; TF's own common-subexpression pass merges
  them only after that. Every graph op is made through `Graph._create_op_internal` (private;
  `ops._create_graph_constant` and `op_def_library` call it), overridden here on this graph
  object only. An op made under a device or colocation scope is left alone (its placement
  is its own). A shared value asked for under control dependencies is made without them: it
  has no effect to order, and every other op made there keeps its own control inputs (a
  collective's markers wrap its ops in control dependencies: its keys, sizes and slice
  bounds were one node per collective)."""
  original = graph._create_op_internal  # noqa: SLF001
  made: dict = {}
  shared = {id(t) for t in seeds}
  constants: dict = {}  # (value key, dtype, shape, ...) -> the Const made for it here

  def create(op_type, inputs, dtypes=None, input_types=None, name=None, attrs=None, **kwargs):
    if _placed(graph):
      return original(op_type, inputs, dtypes, input_types, name, attrs, **kwargs)
    inputs = list(inputs or ())
    if op_type == 'Reshape' and _plain_reshape(inputs[0], graph):
      inputs[0] = inputs[0].op.inputs[0]
    if op_type == 'Const' and not inputs and attrs:
      key = ('Const', attrs['value'].SerializeToString())  # its proto holds dtype and shape
    elif inputs and all(id(t) in shared for t in inputs) and op_is_pure(op_type, attrs):
      key = (op_type, tuple(id(t) for t in inputs), _attrs_key(attrs))
    else:
      return original(op_type, inputs, dtypes, input_types, name, attrs, **kwargs)
    if key not in made:
      with graph.control_dependencies(None):
        op = original(op_type, inputs, dtypes, input_types, name, attrs, **kwargs)
      made[key] = op
      shared.update(id(t) for t in op.outputs)
      keep_alive.append(op)  # the ids above stay its outputs' for the scope's life
    return made[key]

  keep_alive: list = list(seeds)
  graph._create_op_internal = create  # noqa: SLF001
  scope = _ConstantScope(graph, constants)
  _constant_caches.append(scope)
  try:
    yield
  finally:
    _constant_caches.remove(scope)
    del graph._create_op_internal  # noqa: SLF001  (the class's method again)


class _ConstantScope:
  """One active `shared_values` scope, as its constants see it: the scope's graph and its
  constants, and those of the function graphs traced inside it by the same thread (the
  branches and bodies of a per-partition program's conds, loops and calls, a third of its
  nodes and half of them constants, traced while the scope is active)."""

  def __init__(self, graph, constants: dict):
    self.graph, self.constants = graph, constants
    self.thread = threading.get_ident()
    self.nested: dict = {}  # id(function graph) -> (graph, its constants)

  def constants_of(self, graph) -> Optional[dict]:
    if graph is self.graph:
      return self.constants
    if self.thread != threading.get_ident() or not isinstance(graph, FuncGraph):
      return None
    if graph._get_control_flow_context() is not None:  # noqa: SLF001  (TF1 control flow)
      return None
    entry = self.nested.setdefault(id(graph), (graph, {}))
    return entry[1]


# Each active `shared_values` scope; a Python value's constant is looked up before TF builds
# its TensorProto (a fifth of a per-partition trace made constants, most of them a value
# made before).
_constant_caches: list = []
_make_graph_constant = ops._create_graph_constant  # noqa: SLF001


def _graph_constant(value, dtype, shape, name, verify_shape, allow_broadcast):
  graph = ops.get_default_graph()
  cache = _active_constants(graph)
  key = None if cache is None else _constant_key(value)
  if key is None:
    return _make_graph_constant(value, dtype, shape, name, verify_shape, allow_broadcast)
  key = (key, dtype, None if shape is None else tuple(shape), verify_shape, allow_broadcast)
  if key not in cache:
    # Made without the control inputs around it, as `shared_values` makes its constants: a
    # constant has no effect to order, and it serves every later use in its graph.
    with graph.control_dependencies(None):
      cache[key] = _make_graph_constant(value, dtype, shape, name, verify_shape, allow_broadcast)
  return cache[key]


ops._create_graph_constant = _graph_constant  # noqa: SLF001


def _active_constants(graph) -> Optional[dict]:
  """The constants `graph` shares now, within the innermost `shared_values` scope that
  covers it (None: none does, or a device scope or op callbacks are active)."""
  if not _constant_caches:
    return None
  for scope in reversed(_constant_caches):
    cache = scope.constants_of(graph)
    if cache is not None:
      if _placed(graph) or ops.op_callbacks.should_invoke_op_callbacks():
        return None
      return cache
  return None


def _constant_key(value):
  """A hashable key telling `value` from every other Python or NumPy value (types included:
  True, 1 and 1.0 are three constants), or None for values not worth keying."""
  if isinstance(value, (bool, int, float)):
    return (type(value), value)
  if isinstance(value, (list, tuple)) and len(value) <= 64:
    keys = tuple(_constant_key(v) for v in value)
    return None if any(k is None for k in keys) else (type(value), keys)
  if isinstance(value, (np.ndarray, np.generic)) and np.size(value) <= 1024:
    return ('ndarray', value.dtype.str, np.shape(value), np.asarray(value).tobytes())
  return None


_untraced = threading.local()  # .depth > 0: this thread's graph ops record no Python stack
_with_stack = tf_stack.extract_stack


def _one_frame() -> 'tf_stack.StackTrace':
  """A stack of one frame, this module's line that made it: what an op made inside
  `without_op_tracebacks` records. Not an empty one: TF's lowering to XLA reads an op's
  innermost frame and crashes on a stack without any (`get_compiler_ir`, a segfault)."""
  elsewhere, frame = set(), sys._getframe()  # noqa: SLF001  (Python's own frame access)
  while frame is not None:
    elsewhere.add(frame.f_code.co_filename)
    frame = frame.f_back
  elsewhere.discard(__file__)
  files = _tf_stack.PyBindFileSet()
  files.update_to(elsewhere)
  return _tf_stack.extract_stack(_tf_stack.PyBindSourceMap(), files, 1)  # 1: skip this frame


_ONE_FRAME = _one_frame()


def _extract_stack(stacklevel=1):
  if getattr(_untraced, 'depth', 0):
    return _ONE_FRAME  # one frame for every op (TF holds it shared and never changes it)
  return _with_stack(stacklevel=stacklevel + 1)


# Installed once: outside `without_op_tracebacks` it records the stack TF would (one frame up).
tf_stack.extract_stack = _extract_stack


@contextlib.contextmanager
def without_op_tracebacks():
  """While active, graph ops this thread makes keep no Python stack of their making (one
  frame, this module's, shared by all of them).

  TF records every op's stack, and every time TF partitions a function over devices (once
  per device for each of the 8 calls of a per-partition program, on its first run) it turns
  each op's frames into file and line numbers (`GraphDebugInfoBuilder`, in `Partition`):
  11-17% of a fuzz campaign's CPU, measured paired (`bench/fuzz_ab.py --switch tracebacks`).
  A per-partition op's stack points into tf_gspmd's partitioner, never into the user's
  code, so TF's error messages lose nothing a user wrote; tf_gspmd's own errors name the
  op, its tensors and their shardings."""
  _untraced.depth = getattr(_untraced, 'depth', 0) + 1
  try:
    yield
  finally:
    _untraced.depth -= 1


_fast_building_lock = threading.Lock()
_fast_building = {'depth': 0, 'before': False}


@contextlib.contextmanager
def fast_graph_building():
  """While active (in any thread), TF builds graph ops whose inputs are all tensors through
  its C++ path (`graph_building_optimization`, TF's flag, off by default in TF 2.21; TF's own
  test suite runs with it on and off) instead of `op_def_library`'s Python one, which, among
  others, formats every op's list of allowed dtypes even when the op's dtype is allowed.
  Measured on this machine: 243 -> 181 us per op; the fuzzer's CPU 0.966 of what it is
  without (`bench/fuzz_ab.py --switch graph-building`, which also covers the unpartitioned
  reference). The flag is process-wide: the first scope entered turns it on, the last one
  left puts back what it was."""
  config = tf_flags.config().graph_building_optimization
  with _fast_building_lock:
    if _fast_building['depth'] == 0:
      _fast_building['before'] = config.value()
      config.reset(True)
    _fast_building['depth'] += 1
  try:
    yield
  finally:
    with _fast_building_lock:
      _fast_building['depth'] -= 1
      if _fast_building['depth'] == 0:
        config.reset(_fast_building['before'])


def _plain_reshape(t, graph) -> bool:
  """Whether `t` is a Reshape's result in `graph` that no control input orders (a reshape of
  it reshapes its input alike, and orders nothing it did)."""
  return t.op.type == 'Reshape' and t.graph is graph and not t.op.control_inputs


def op_is_stateful(op_type: str) -> bool:
  """Whether TF's OpDef marks `op_type` stateful (ops it does not know count as stateful).
  `op_def_registry` is TF's private table of the OpDefs its Python wrappers are built from."""
  definition = op_def_registry.get(op_type)
  return definition is None or definition.is_stateful


def op_is_pure(op_type: str, attrs) -> bool:
  """Whether an op of `op_type` gives equal results on equal inputs: TF's OpDef says it is
  not stateful (TF's own common-subexpression pass merges such ops), and it calls no function."""
  if op_is_stateful(op_type):
    return False
  return not any(v.HasField('func') or v.list.func for v in (attrs or {}).values())


def _attrs_key(attrs) -> tuple:
  return tuple(sorted((k, v.SerializeToString()) for k, v in (attrs or {}).items()))


def _placed(graph) -> bool:
  """Whether an op made now in `graph` would get a device or a colocation of a scope."""
  return bool(
    len(graph._device_function_stack)  # noqa: SLF001
    or len(graph._colocation_stack)  # noqa: SLF001
  )


class _PerProgram:
  """A Python function as a callable object of its own (see `own_function`)."""

  def __init__(self, fn):
    self.fn = fn
    self.__name__ = getattr(fn, '__name__', 'function')

  def __call__(self, *args, **kwargs):
    return self.fn(*args, **kwargs)


def own_function(fn, **function_kwargs):
  """`tf.function(fn, **function_kwargs)`, counted by TF's retracing warning on its own.

  TF warns that "N out of the last N calls ... triggered tf.function retracing" by counting
  traces per Python code object (`Function._get_key_for_call_stats`, private). tf_gspmd makes
  one launcher and one copier function per partitioned program from the same code, so a user
  with five programs read a warning about retracing they never did. An object with no
  `__code__` is counted by itself: one count per program, so tf_gspmd's own retracing of one
  program still warns."""
  import tensorflow as tf

  return tf.function(_PerProgram(fn), **function_kwargs)


__all__ = [
  'FuncGraph',
  'fast_graph_building',
  'op_is_pure',
  'op_is_stateful',
  'own_function',
  'runtime_started',
  'shared_values',
  'without_op_tracebacks',
  'TFFunction',
  'UninitializedVariable',
  'VARIABLE_VALUE_KEY',
  'atomic_function',
  'auto_control_deps_utils',
  'c_api_util',
  'collective_ops',
  'context',
  'cpp_shape_inference_pb2',
  'function_def_to_graph',
  'function_type_utils',
  'gen_xla_ops',
  'handle_data_util',
  'importer',
  'is_py_function_gradient',
  'iterators_without_autotuning',
  'kernels',
  'op_def_registry',
  'pywrap_tf_session',
  'record',
  'save_context',
  'script_ops',
  'set_op_attr',
  'variable_accessed',
  'xla_sharding',
]
