"""One state per variable: `SplitVariable`, and the shards of adopted plain variables.

A variable reaches a partitioned program in one of two ways:

* **made as shards** (`tg.Variable`, `tg.sharded_variables`, a Keras variable under a
  tf_gspmd distribution): a `SplitVariable` from birth. Its value lives only in its holder (a
  `runtime.ShardedVariable`, an `xla_bridge.XlaShardedVariable`, a TPU strategy's
  `ReplicaVariable`: anything with `sharding`, `shape`, `dtype`, `assemble()` and
  `scatter(value)`); no whole copy is kept anywhere. It is a `tf.Variable` of its own class,
  the way tf.distribute's variables are, so TF and Keras use it as any variable:

  - a read (`numpy()`, `value()`, a plain `tf.function`, a checkpoint) assembles the whole
    value from the shards, on demand (in a traced function: as ops reading the shard
    variables, so the function captures them and a SavedModel exports them);
  - a write (`assign*`, `scatter_*` with dense or `IndexedSlices` updates, a checkpoint
    restore, Keras' `set_weights`) scatters the new value to the shards;
  - gradient tapes see a read of the variable (identity gradient), and a `tf.function` takes
    it as an argument by reference (it retraces per variable, reading the shards);
  - while `graph.capture` traces a function to partition it (`tracing_for_partition()`) it
    reads and writes its *logical handle* (an uninitialized variable of the whole shape that
    never allocates): the partitioner maps that handle to the shards, which the per-partition
    program reads and writes in place.

* **adopted** (a plain `tf.Variable` a partitioned function touches, annotated with
  `tg.shard_variable` or given a layout by propagation): it stays the plain variable it was,
  and stays its own state. A partitioned call splits its current value into the shards before
  running, when something wrote it since the last copy (`out_of_sync`: TF copies a buffer on
  write while another tensor holds it, so an unchanged variable reads back the very buffer
  recorded at the last copy), and assembles the new value back into it afterwards
  (`scatter_adopted`, `gather_adopted`), so every plain read and write, every function traced
  before or after, sees one value. The price is a whole copy beside the shards and a copy out
  per call that writes it: make a variable as shards to hold it once.

Every partitioned function over a variable finds the same holder (`holder_of`), so a train and
an evaluation step see one state. A program built for another layout, device list or backend
moves the shards to its own (`replace_holder`).
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Dict, Iterable, List, Optional

import numpy as np
import tensorflow as tf

from tf_gspmd.graph.capture import tracing_for_partition
from tf_gspmd.tf_private import (
  VARIABLE_VALUE_KEY,
  UninitializedVariable,
  handle_data_util,
  own_function,
  record,
  save_context,
  variable_accessed,
)

# id(plain tf.Variable) -> (weak reference to it, its holder, the annotation then).
_ADOPTED: Dict[int, tuple] = {}
# id(SplitVariable) -> weak reference (for `held_variables`, the memory tests).
_SPLIT: Dict[int, weakref.ref] = {}
# Predicates true while the graph being built only infers shapes and is never run (Keras'
# compute_output_spec scratch graph, registered by tf_gspmd.keras): a split variable read there
# needs a tensor of its shape, not its value, so it builds no TF mirror of PJRT buffers (a
# whole copy of the variable, refreshed on every later write).
_SHAPE_ONLY_GRAPHS: List[Callable[[], bool]] = []


def register_shape_only_graph(predicate: Callable[[], bool]) -> None:
  """Reads of split variables while `predicate()` holds give a shape, never a value."""
  if predicate not in _SHAPE_ONLY_GRAPHS:
    _SHAPE_ONLY_GRAPHS.append(predicate)


def _building_shape_only_graph() -> bool:
  return not tf.executing_eagerly() and any(holds() for holds in _SHAPE_ONLY_GRAPHS)


def holder_of(variable) -> Optional[Any]:
  """The holder of `variable`'s shards, or None when it has none."""
  if isinstance(variable, SplitVariable):
    return variable._holder  # noqa: SLF001
  entry = _ADOPTED.get(id(variable))
  if entry is None or entry[0]() is not variable:
    return None
  return entry[1]


def is_held(variable) -> bool:
  """Whether `variable` has shards (its own, or an adopted variable's copy)."""
  return holder_of(variable) is not None


def is_split(variable) -> bool:
  """Whether `variable`'s shards are its only state (made as shards)."""
  return isinstance(variable, SplitVariable)


def held_sharding(variable):
  """The sharding `variable`'s shards have (None when it has none)."""
  holder = holder_of(variable)
  return None if holder is None else holder.sharding


def held_variables() -> List[tf.Variable]:
  """Every live variable whose value lives only as shards."""
  out = []
  for key, ref in list(_SPLIT.items()):
    variable = ref()
    if variable is None:
      _SPLIT.pop(key, None)
    else:
      out.append(variable)
  return out


def hold(variable, holder, annotation=None) -> tf.Variable:
  """Give `variable` the shards `holder` (made from its current value); returns it.

  A `SplitVariable` takes them as its state; a plain variable is adopted: it keeps its own
  value, and partitioned calls copy it into `holder` and back. `annotation`: the layout the
  user annotated it with then (None: none), so a changed annotation is refused, not ignored.
  """
  if not isinstance(variable, tf.Variable):
    raise TypeError(f'hold: {variable!r} is not a tf.Variable.')
  if tuple(holder.shape) != tuple(variable.shape) or holder.dtype != variable.dtype:
    raise ValueError(
      f'hold: variable {variable.name} is {variable.dtype.name}{list(variable.shape)}, its '
      f'shards hold {holder.dtype.name}{list(holder.shape)}.'
    )
  if isinstance(variable, SplitVariable):
    variable._holder = holder  # noqa: SLF001
    variable._annotation = annotation  # noqa: SLF001
    return variable
  key = id(variable)
  _ADOPTED[key] = (weakref.ref(variable, lambda _: _ADOPTED.pop(key, None)), holder, annotation)
  _IN_SYNC.pop(key, None)  # new shards: not known to hold its value until copied
  return variable


def annotation_when_held(variable):
  """The layout `variable` was annotated with when it got its shards (None: none)."""
  if isinstance(variable, SplitVariable):
    return variable._annotation  # noqa: SLF001
  entry = _ADOPTED.get(id(variable))
  return entry[2] if entry is not None and entry[0]() is variable else None


def replace_holder(variable, holder) -> None:
  """Give a variable with shards other shards (a program built for another layout or backend)."""
  if not is_held(variable):
    raise ValueError(f'replace_holder: variable {variable.name} has no shards.')
  hold(variable, holder, annotation_when_held(variable))


def unhold(variable) -> None:
  """Drop an adopted variable's shards (its own value is current). A `SplitVariable` keeps its
  shards: they are its value."""
  entry = _ADOPTED.get(id(variable))
  if entry is not None and entry[0]() is variable:
    _ADOPTED.pop(id(variable), None)
    _IN_SYNC.pop(id(variable), None)


# --- which adopted variables equal their shards -----------------------------------------------
# id(adopted variable) -> (weak references to it and its holder, the variable's value read when it
# and its shards last agreed, a numpy view of that value). Holding the read keeps the buffer the
# variable shares with it, and TF copies a buffer another tensor still holds before writing
# into it (copy on write): so the variable reads back that same buffer exactly as long as
# nothing wrote it. The view is kept so that its address cannot be reused by another buffer
# while the entry lives. (A variable read sparsely is in TF's copy-on-read mode: every read is
# a fresh buffer, so it is always copied, never skipped wrongly.)
_IN_SYNC: Dict[int, tuple] = {}


def note_in_sync(variables: Iterable) -> None:
  """Record that each adopted variable among `variables` equals its shards now (right after
  a copy between them)."""
  for variable in variables:
    holder = holder_of(variable)
    if holder is None or isinstance(variable, SplitVariable) or not _on_local_host(variable):
      continue
    value = tf.raw_ops.ReadVariableOp(resource=variable.handle, dtype=variable.dtype)
    key = id(variable)
    gone = lambda _, key=key: _IN_SYNC.pop(key, None)  # noqa: E731 (its buffer is let go)
    _IN_SYNC[key] = (weakref.ref(variable, gone), weakref.ref(holder), value, _host_view(value))


def forget_in_sync(variables: Iterable) -> None:
  """Drop the records of `variables`: their shards are about to be written (a call, a
  restore), so until the next copy nothing says they equal the variable."""
  for variable in variables:
    _IN_SYNC.pop(id(variable), None)


def out_of_sync(variables: Iterable) -> list:
  """The adopted variables among `variables` that may differ from their shards: written since
  the last copy, given new shards, or never copied."""
  return [v for v in variables if not _in_sync(v)]


def _in_sync(variable) -> bool:
  entry = _IN_SYNC.get(id(variable))
  if entry is None or entry[0]() is not variable or entry[1]() is not holder_of(variable):
    return False
  now = tf.raw_ops.ReadVariableOp(resource=variable.handle, dtype=variable.dtype)
  return _host_view(now).__array_interface__['data'][0] == entry[3].__array_interface__['data'][0]


def _host_view(value: tf.Tensor) -> np.ndarray:
  """`value` as a numpy array sharing its buffer (TF hands a CPU tensor's memory to numpy)."""
  return np.asarray(value)


def _on_local_host(variable) -> bool:
  """Whether `variable` lives in this process's CPU memory (elsewhere a read copies it here,
  and the check would cost the copy it saves)."""
  spec = tf.DeviceSpec.from_string(variable.device or '/device:CPU:0')
  return spec.job in (None, 'localhost') and (spec.device_type or 'CPU') == 'CPU'


def scatter_adopted(variables: Iterable) -> None:
  """Split the current value of each adopted variable among `variables` into its shards.

  In a traced copy (`adopted_copier`), only when some value differs from what its shards hold
  (a write since the last call): a replicated variable's check reads one shard, where its
  copy would write every device's. One condition for all of them: a branch per variable made
  the copier's first call (TF instantiating each branch) take seconds on a model of a hundred
  variables, and a write between calls is the rare case.
  """
  pairs = []
  for variable in variables:
    holder = None if isinstance(variable, SplitVariable) else holder_of(variable)
    if holder is not None:
      pairs.append((holder, variable.read_value()))
  if not tf.inside_function() or not pairs:
    _scattered(pairs)
    return
  same = tf.reduce_all(
    tf.stack([tf.reduce_all(tf.equal(value, holder.assemble())) for holder, value in pairs])
  )
  tf.cond(same, lambda: tf.constant(0), lambda: _scattered(pairs))


def _scattered(pairs) -> tf.Tensor:
  for holder, value in pairs:
    holder.scatter(value)
  return tf.constant(0)


def gather_adopted(variables: Iterable) -> None:
  """Assemble each adopted variable's shards back into the variable (after a call wrote them)."""
  for variable in variables:
    holder = None if isinstance(variable, SplitVariable) else holder_of(variable)
    if holder is not None:
      with tf.device(variable.device):
        variable.assign(holder.assemble(), read_value=False)


def adopted_copier(variables: Iterable, copy: Callable) -> Callable[[], None]:
  """`copy` (`scatter_adopted` or `gather_adopted`) of the adopted `variables`, made once: the
  copies of holders TF can read in a graph run as one traced function (one call instead of a
  few eager ops per variable and device, which dominated a small model's step), the others
  (PJRT buffers, a strategy's replicas) eagerly. Valid while the variables keep their holders."""
  adopted = [v for v in variables if not isinstance(v, SplitVariable) and is_held(v)]
  in_graph = [v for v in adopted if getattr(holder_of(v), 'assembles_in_graph', True)]
  eager = [v for v in adopted if not getattr(holder_of(v), 'assembles_in_graph', True)]
  traced = own_function(lambda: copy(in_graph), autograph=False) if in_graph else None

  def run() -> None:
    if traced is not None:
      traced()
    copy(eager)

  return run


def read_global(holder, dtype) -> tf.Tensor:
  """The whole value of `holder`'s shards (eagerly, or as ops in the graph being built)."""
  if tf.executing_eagerly() or getattr(holder, 'assembles_in_graph', True):
    return holder.assemble()
  mirror = getattr(holder, 'tf_mirror', None)
  if mirror is not None:  # PJRT buffers, mirrored in a TF variable a graph (and export) reads
    return tf.raw_ops.ReadVariableOp(resource=mirror().handle, dtype=dtype)
  # Shards outside TF's runtime (a strategy's replicas): fetched by a host call at run time.
  value = tf.py_function(lambda: holder.assemble(), [], dtype, name='assemble_held')
  value.set_shape(holder.shape)
  return value


def write_global(holder, value: tf.Tensor):
  """Scatter `value` to `holder`'s shards; returns what orders the write in a graph."""
  if tf.executing_eagerly() or getattr(holder, 'assembles_in_graph', True):
    holder.scatter(value)
    return None
  mirror = getattr(holder, 'tf_mirror', None)
  if mirror is not None:
    # Written to the TF mirror first (ordered with the graph's reads of it), then to the
    # buffers by a host call.
    assign = tf.raw_ops.AssignVariableOp(resource=mirror().handle, value=value)
    with tf.control_dependencies([assign]):
      return tf.py_function(
        lambda v: (holder.take_from_mirror(v), np.int32(0))[1],
        [value],
        tf.int32,
        name='scatter_held',
      )

  def scatter(v):
    holder.scatter(v)
    return np.int32(0)

  return tf.py_function(scatter, [value], tf.int32, name='scatter_held')


_MISSING_COUNT = [0]


def _missing_handle(logical) -> tf.Tensor:
  """The handle a partition trace reads and writes (the partitioner maps it to the shards): a
  handle to a variable that is never created, of the whole shape and dtype, named so that a
  read of it anywhere else fails saying why (never an empty or stale value)."""
  _MISSING_COUNT[0] += 1
  name = logical.name.split(':')[0].replace('/', '_')
  handle = tf.raw_ops.VarHandleOp(
    dtype=logical.dtype,
    shape=logical.shape,
    shared_name=(
      f'{name}_is_split_by_tf_gspmd_and_this_function_was_traced_for_tg_partition_'
      f'{_MISSING_COUNT[0]}'
    ),
  )
  handle_data_util.copy_handle_data(logical.handle, handle)  # its shape and dtype, for traces
  return handle


class _ByReference(tf.types.experimental.TraceType):
  """How a `tf.function` sees a SplitVariable argument: this very variable, by reference (as a
  closure would), with no tensor passed; another variable traces again. Its shards' handles are
  then captured by the trace, as any variable read inside the body."""

  def __init__(self, variable):
    self._ref = weakref.ref(variable)
    self._id = id(variable)

  def is_subtype_of(self, other) -> bool:
    return self == other

  def most_specific_common_supertype(self, others):
    return self if all(self == other for other in others) else None

  def placeholder_value(self, placeholder_context):
    return self._ref()

  def to_tensors(self, value):
    return []

  def from_tensors(self, tensors):
    return self._ref()

  def flatten(self):
    return []

  def cast(self, value, cast_context):
    return value

  def __eq__(self, other) -> bool:
    return isinstance(other, _ByReference) and self._id == other._id and self._ref() is not None

  def __hash__(self) -> int:
    return hash(self._id)

  def __repr__(self) -> str:
    return f'SplitVariable#{self._id}'


# Sparse writes: TF's resource op (what a partition trace emits, for the partitioner) and the
# dense op computing the same on a whole value (a plain trace: read, update, write back).
_SCATTERS = {
  'scatter_add': ('ResourceScatterAdd', tf.tensor_scatter_nd_add),
  'scatter_sub': ('ResourceScatterSub', tf.tensor_scatter_nd_sub),
  'scatter_max': ('ResourceScatterMax', tf.tensor_scatter_nd_max),
  'scatter_min': ('ResourceScatterMin', tf.tensor_scatter_nd_min),
  'scatter_update': ('ResourceScatterUpdate', tf.tensor_scatter_nd_update),
  'scatter_mul': ('ResourceScatterMul', None),
  'scatter_div': ('ResourceScatterDiv', None),
}
_SCATTERS_ND = {
  'scatter_nd_add': ('ResourceScatterNdAdd', tf.tensor_scatter_nd_add),
  'scatter_nd_sub': ('ResourceScatterNdSub', tf.tensor_scatter_nd_sub),
  'scatter_nd_update': ('ResourceScatterNdUpdate', tf.tensor_scatter_nd_update),
  'scatter_nd_max': ('ResourceScatterNdMax', tf.tensor_scatter_nd_max),
  'scatter_nd_min': ('ResourceScatterNdMin', tf.tensor_scatter_nd_min),
}


class SplitVariable(tf.Variable):
  """A `tf.Variable` whose value lives only as shards over devices (see the module docstring).

  Made by `tg.Variable`, `tg.sharded_variables` and Keras under a tf_gspmd distribution; not
  to be confused with tf.distribute's `ShardedVariable` (row partitions on parameter servers).
  """

  _should_act_as_resource_variable = True  # TF's is_resource_variable(): read it as one

  def __init__(self, holder, *, name: str, trainable: bool = True, annotation=None):
    with tf.init_scope():
      # Its name, shape and dtype as TF's variables keep them, and what a SavedModel writes
      # for it; never allocated (TF reads an uninitialized eager variable as an empty
      # tensor, so its handle is not the one a trace reads).
      self._logical = UninitializedVariable(
        shape=tf.TensorShape(holder.shape),
        dtype=holder.dtype,
        trainable=trainable,
        name=name,
      )
      self._handle = _missing_handle(self._logical)
    self._holder = holder
    self._annotation = annotation
    key = id(self)
    _SPLIT[key] = weakref.ref(self, lambda _: _SPLIT.pop(key, None))

  # --- what it is ------------------------------------------------------------------------
  name = property(lambda self: self._logical.name)
  dtype = property(lambda self: self._logical.dtype)
  shape = property(lambda self: self._logical.shape)
  handle = property(lambda self: self._handle)
  trainable = property(lambda self: self._logical.trainable)
  device = property(lambda self: self._logical.device)
  graph = property(lambda self: self._logical.graph)
  op = property(lambda self: self._logical.op)
  synchronization = property(lambda self: self._logical.synchronization)
  aggregation = property(lambda self: self._logical.aggregation)
  constraint = property(lambda self: None)
  _shared_name = property(lambda self: self._logical._shared_name)  # noqa: SLF001
  _unique_id = property(lambda self: self._logical._unique_id)  # noqa: SLF001
  _handle_name = property(lambda self: self._logical._handle_name)  # noqa: SLF001
  _in_graph_mode = False

  @property
  def initializer(self):
    return None  # made with its value: nothing to run (as an eager variable)

  @property
  def initial_value(self):
    raise RuntimeError(f'SplitVariable {self.name}: its initial value was split and dropped.')

  @property
  def logical(self) -> tf.Variable:
    """The uninitialized variable behind its handle (no buffer: it never holds a value)."""
    return self._logical

  @property
  def sharding(self):
    """The sharding its shards have."""
    return self._holder.sharding

  def get_shape(self) -> tf.TensorShape:
    return self.shape

  def __repr__(self) -> str:
    if tf.executing_eagerly():
      return (
        f"<tg.SplitVariable '{self.name}' shape={self.shape} dtype={self.dtype.name}, "
        f'{self._holder.sharding}, numpy={self.numpy()!r}>'
      )
    return f"<tg.SplitVariable '{self.name}' shape={self.shape} dtype={self.dtype.name}>"

  # --- reads -----------------------------------------------------------------------------
  def value(self):
    return self._read_variable_op()

  def read_value(self):
    return tf.identity(self._read_variable_op())

  def _read_variable_op(self, no_copy=False):
    del no_copy
    variable_accessed(self)  # gradient tapes watch it, as for any variable read
    if tracing_for_partition():
      value = tf.raw_ops.ReadVariableOp(resource=self.handle, dtype=self.dtype)
    elif _building_shape_only_graph():
      value = tf.zeros(self.shape, self.dtype, name='shape_only_read')
    else:
      value = read_global(self._holder, self.dtype)
    record.record_operation(
      'ReadVariableOp',
      [value],
      [self.handle],
      backward_function=lambda x: [x],
      forward_function=lambda x: [x],
    )
    return value

  def numpy(self) -> np.ndarray:
    if not tf.executing_eagerly():
      raise NotImplementedError('numpy() is only available when eager execution is enabled.')
    return self.read_value().numpy()

  def __array__(self, dtype=None, copy=None):
    del copy  # numpy() is always a fresh array
    value = self.numpy()
    return value if dtype is None else value.astype(dtype)

  def _dense_var_to_tensor(self, dtype=None, name=None, as_ref=False):
    del name, as_ref
    if dtype is not None and not dtype.is_compatible_with(self.dtype):
      raise ValueError(
        f'Incompatible type conversion requested to type {dtype.name} for variable of type '
        f'{self.dtype.name} (Variable: {self.name}).'
      )
    return self.value()

  def _as_graph_element(self):
    return None

  def is_initialized(self, name=None):
    del name
    lost = getattr(self._holder, 'lost', None)
    return tf.constant(not (lost() if callable(lost) else False))

  def sparse_read(self, indices, name=None):
    if tracing_for_partition():
      variable_accessed(self)
      return tf.raw_ops.ResourceGather(
        resource=self.handle, indices=indices, dtype=self.dtype, name=name
      )
    return tf.gather(self.value(), indices, name=name)

  def gather_nd(self, indices, name=None):
    if tracing_for_partition():
      variable_accessed(self)
      return tf.raw_ops.ResourceGatherNd(
        resource=self.handle, indices=indices, dtype=self.dtype, name=name
      )
    return tf.gather_nd(self.value(), indices, name=name)

  def __tf_tracing_type__(self, signature_context):
    del signature_context
    return _ByReference(self)

  # --- writes ----------------------------------------------------------------------------
  def _write(self, op_name: str, value, read_value: bool, name=None):
    value = tf.convert_to_tensor(value, dtype=self.dtype)
    if op_name == 'AssignVariableOp' and not self.shape.is_compatible_with(value.shape):
      raise ValueError(
        f"Cannot assign value to variable '{self.name}': Shape mismatch. The variable shape "
        f'{self.shape}, and the assigned value shape {value.shape} are incompatible.'
      )
    if tracing_for_partition():
      variable_accessed(self)
      op = getattr(tf.raw_ops, op_name)(resource=self.handle, value=value, name=name)
    else:
      if op_name != 'AssignVariableOp':
        now = read_global(self._holder, self.dtype)
        value = now + value if op_name == 'AssignAddVariableOp' else now - value
      op = write_global(self._holder, value)
    if not read_value:
      return op
    if tf.executing_eagerly():
      return self
    with tf.control_dependencies([op] if op is not None else []):
      return self.read_value()

  def assign(self, value, use_locking=None, name=None, read_value=True):
    return self._write('AssignVariableOp', value, read_value, name)

  def assign_add(self, delta, use_locking=None, name=None, read_value=True):
    return self._write('AssignAddVariableOp', delta, read_value, name)

  def assign_sub(self, delta, use_locking=None, name=None, read_value=True):
    return self._write('AssignSubVariableOp', delta, read_value, name)

  def _scatter(self, method: str, sparse_delta, use_locking=None, name=None):
    """A sparse write (`IndexedSlices`): TF's resource op in a partition trace, else the new
    whole value computed and scattered to the shards."""
    del use_locking
    if not isinstance(sparse_delta, tf.IndexedSlices):
      raise TypeError(f'{method}: sparse_delta is not IndexedSlices: {sparse_delta}')
    resource_op, dense = _SCATTERS[method]
    updates = tf.convert_to_tensor(sparse_delta.values, self.dtype)
    if tracing_for_partition():
      variable_accessed(self)
      getattr(tf.raw_ops, resource_op)(
        resource=self.handle, indices=sparse_delta.indices, updates=updates, name=name
      )
      return self if tf.executing_eagerly() else self.read_value()
    indices = tf.expand_dims(sparse_delta.indices, -1)
    whole = self.value()
    if dense is None:  # multiply / divide: by a tensor of ones updated where indexed
      ones = tf.ones_like(whole)
      factor = tf.tensor_scatter_nd_update(ones, indices, updates)
      new = whole * factor if method == 'scatter_mul' else whole / factor
    else:
      new = dense(whole, indices, updates)
    return self._write('AssignVariableOp', new, True, name)

  def _scatter_nd(self, method: str, indices, updates, name=None):
    resource_op, dense = _SCATTERS_ND[method]
    updates = tf.convert_to_tensor(updates, self.dtype)
    if tracing_for_partition():
      variable_accessed(self)
      getattr(tf.raw_ops, resource_op)(ref=self.handle, indices=indices, updates=updates, name=name)
      return self if tf.executing_eagerly() else self.read_value()
    return self._write('AssignVariableOp', dense(self.value(), indices, updates), True, name)

  def batch_scatter_update(self, sparse_delta, use_locking=None, name=None):
    del use_locking
    new = tf.compat.v1.batch_scatter_update  # TF's own composition works on any variable
    return new(self, sparse_delta.indices, sparse_delta.values, name=name)

  def _strided_slice_assign(self, begin, end, strides, value, name, *masks):
    """`variable[...].assign(value)`: TF's op in a partition trace; else the whole value with
    the slice replaced, computed on a temporary variable and scattered."""
    names = ('begin_mask', 'end_mask', 'ellipsis_mask', 'new_axis_mask', 'shrink_axis_mask')
    kwargs = dict(zip(names, masks))
    if tracing_for_partition():
      variable_accessed(self)
      return tf.raw_ops.ResourceStridedSliceAssign(
        ref=self.handle, begin=begin, end=end, strides=strides, value=value, name=name, **kwargs
      )
    whole = tf.Variable(self.value(), trainable=False)
    whole._strided_slice_assign(begin, end, strides, value, name, *masks)  # noqa: SLF001
    return self._write('AssignVariableOp', whole.read_value(), True)

  # --- checkpoints and SavedModels -------------------------------------------------------
  def _serialize_to_tensors(self):
    if save_context.in_save_context():
      return {}  # a SavedModel holds the shard variables (`saved_model_children`) instead
    with tf.device('/device:CPU:0'):
      return {VARIABLE_VALUE_KEY: tf.identity(read_global(self._holder, self.dtype))}

  def _restore_from_tensors(self, restored_tensors):
    value = tf.convert_to_tensor(restored_tensors[VARIABLE_VALUE_KEY], self.dtype)
    if not self.shape.is_compatible_with(value.shape):
      raise ValueError(
        f'Received incompatible tensor with shape {value.shape} when attempting to restore '
        f'variable with shape {self.shape} and name {self.name}.'
      )
    return write_global(self._holder, value)

  def saved_model_children(self) -> Dict[str, tf.Variable]:
    """The shard variables a traced read captures, by name: a SavedModel exports them with the
    functions that read this variable (a checkpoint saves the whole value only)."""
    shards = getattr(self._holder, 'shards', ())
    found = {f'shard_{p}': s for p, s in enumerate(shards) if isinstance(s, tf.Variable)}
    mirror = getattr(self._holder, 'mirror', None)  # PJRT buffers: the TF copy traces read
    return dict(found, whole=mirror) if isinstance(mirror, tf.Variable) else found

  def _trackable_children(self, save_type='checkpoint', **kwargs):
    children = dict(super()._trackable_children(save_type, **kwargs))
    if str(getattr(save_type, 'value', save_type)) == 'savedmodel':
      children.update(self.saved_model_children())
    return children

  def _export_to_saved_model_graph(self, object_map, tensor_map, options, **kwargs):
    resources = self._logical._export_to_saved_model_graph(  # noqa: SLF001
      object_map, tensor_map, options, **kwargs
    )
    object_map[self] = object_map[self._logical]
    return resources

  def _write_object_proto(self, proto, options):
    """A plain object in a SavedModel, its shard variables its children: a loaded variable
    would have no children, and the shards (what the exported functions read) would be left
    unrestored."""
    del options
    proto.user_object.identifier = '_generic_user_object'
    proto.user_object.version.producer = 1
    proto.user_object.version.min_consumer = 1

  def _copy_trackable_to_cpu(self, object_map):
    object_map[self] = tf.Variable(self.read_value(), name=self._handle_name.split(':')[0])

  def to_proto(self, export_scope=None):
    raise NotImplementedError('SplitVariable: TF1 VariableDef protos are not supported.')


def _scatter_method(method: str):
  def run(self, sparse_delta, use_locking=None, name=None):
    return self._scatter(method, sparse_delta, use_locking, name)  # noqa: SLF001

  run.__name__ = method
  return run


def _scatter_nd_method(method: str):
  def run(self, indices, updates, name=None):
    return self._scatter_nd(method, indices, updates, name)  # noqa: SLF001

  run.__name__ = method
  return run


for _method in _SCATTERS:
  setattr(SplitVariable, _method, _scatter_method(_method))
for _method in _SCATTERS_ND:
  setattr(SplitVariable, _method, _scatter_nd_method(_method))


def _convert(value, dtype=None, name=None, as_ref=False):
  return value._dense_var_to_tensor(dtype=dtype, name=name, as_ref=as_ref)  # noqa: SLF001


tf.register_tensor_conversion_function(SplitVariable, _convert)
