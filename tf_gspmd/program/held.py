"""One state per variable: a tf.Variable whose value lives only as its shards.

`hold(variable, holder)` makes a user's `tf.Variable` a view of `holder` (a
`runtime.ShardedVariable`, an `xla_bridge.XlaShardedVariable` or a TPU strategy's
`ReplicaVariable`: anything with `sharding`, `shape`, `dtype`, `assemble()` and
`scatter(value)`) and releases the variable's own storage, so no whole copy of a split
variable stays anywhere. The variable keeps its Python identity, name, shape, dtype and
trackable place, so Keras, checkpoints, `tf.function`s and the user keep using it:

* a read (`numpy()`, `value()`, `read_value()`, a plain `tf.function`, `tf.train.Checkpoint`
  saving) assembles the whole value from the shards, on demand, and drops it after use;
  gradient tapes see it as a read of the variable (identity gradient);
* a write (`assign*`, `scatter_*`, `tf.train.Checkpoint.restore`, Keras' `set_weights`)
  scatters the new value to the shards;
* while `graph.capture` traces a function to partition it (`tracing_for_partition()`) the
  variable reads and writes its own handle, as any variable would: the partitioner maps that
  handle to the shards, which the per-partition program reads and writes in place.

Every partitioned function over the variable finds the same holder (`holder_of`), so a train
and an evaluation step, a checkpoint and the user all see one state. A program built for
another layout, device list or backend moves the state to its own (`move_to`: assembled on the
host one variable at a time, split again); programs of the same mesh reuse the held layout
(`held_sharding`), so they agree and nothing moves.

The variable's whole value is never kept: a `tf.function` traced before the variable was held
read its handle directly, and its next call fails naming the variable (trace it again: a new
`tf.function`); one traced afterwards reads the shards.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Dict, Iterator, List, Optional

import numpy as np
import tensorflow as tf

from tf_gspmd.graph.capture import tracing_for_partition
from tf_gspmd.tf_private import (
  VARIABLE_VALUE_KEY,
  BaseResourceVariable,
  ResourceVariable,
  record,
  variable_accessed,
)

_HOLDER = '_tf_gspmd_holder'
_RELEASED = '_tf_gspmd_released'
_ANNOTATION = '_tf_gspmd_annotation_when_held'
_CLASS = '_tf_gspmd_class_before_held'
_MISSING_COUNT = [0]
# id(variable) -> weak reference to every held variable (for `held_variables`, the memory tests).
_LIVE: Dict[int, weakref.ref] = {}


def holder_of(variable) -> Optional[Any]:
  """The holder of `variable`'s shards, or None when it holds its own value."""
  return getattr(variable, '__dict__', {}).get(_HOLDER)


def is_held(variable) -> bool:
  return holder_of(variable) is not None


def held_sharding(variable):
  """The sharding `variable`'s shards have (None when it is not held)."""
  holder = holder_of(variable)
  return None if holder is None else holder.sharding


def held_variables() -> List[tf.Variable]:
  """Every live variable whose value lives as shards."""
  out = []
  for key, ref in list(_LIVE.items()):
    variable = ref()
    if variable is None:
      _LIVE.pop(key, None)
    else:
      out.append(variable)
  return out


def hold(variable: tf.Variable, holder, annotation=None) -> tf.Variable:
  """Make `variable` a view of `holder`'s shards; returns it.

  `holder` must already hold the variable's current value (made from it, or from the value
  the variable is to start with). The variable's own buffer stays until `release`.
  `annotation`: the layout the user annotated it with then (None: none), so an annotation
  changed afterwards can be refused instead of ignored.
  """
  if not isinstance(variable, tf.Variable) or not hasattr(variable, 'handle'):
    raise TypeError(f'hold: {variable!r} is not a resource tf.Variable.')
  if tuple(holder.shape) != tuple(variable.shape) or holder.dtype != variable.dtype:
    raise ValueError(
      f'hold: variable {variable.name} is {variable.dtype.name}{list(variable.shape)}, its '
      f'shards hold {holder.dtype.name}{list(holder.shape)}.'
    )
  if not is_held(variable):
    variable.__dict__[_CLASS] = type(variable)
    variable.__class__ = HeldVariable
  variable.__dict__[_HOLDER] = holder
  variable.__dict__[_ANNOTATION] = annotation
  key = id(variable)
  _LIVE[key] = weakref.ref(variable, lambda _: _LIVE.pop(key, None))
  return variable


def annotation_when_held(variable):
  """The layout `variable` was annotated with when it became held (None: none)."""
  return getattr(variable, '__dict__', {}).get(_ANNOTATION)


def unhold(variable) -> None:
  """Give a held variable its own whole value back and make it a plain variable again."""
  holder = holder_of(variable)
  if holder is None:
    return
  value = holder.assemble()
  variable.__class__ = variable.__dict__.pop(_CLASS)
  tf.raw_ops.AssignVariableOp(resource=variable.handle, value=value, validate_shape=False)
  for key in (_HOLDER, _RELEASED, _ANNOTATION):
    variable.__dict__.pop(key, None)
  _LIVE.pop(id(variable), None)


def replace_holder(variable, holder) -> None:
  """Give a held variable another holder (a program built for another layout or backend)."""
  if not is_held(variable):
    raise ValueError(f'replace_holder: variable {variable.name} is not held.')
  variable.__dict__[_HOLDER] = holder


def release(variables) -> None:
  """Free the own buffers of held `variables`: their values live in the shards now.

  An eager variable's resource belongs to its handle (TF frees it with the last reference),
  so it cannot be destroyed while the variable lives; its buffer is replaced by an empty one
  (the handle keeps its static shape). A `tf.function` traced before the variable was held
  captured that handle: its captured input is swapped for the handle of a never-initialized
  variable named after this one, so its next call fails naming the variable (trace it again)
  instead of computing on an empty or stale value.
  """
  variables = [v for v in variables if is_held(v) and not v.__dict__.get(_RELEASED)]
  if not variables or not tf.executing_eagerly():
    return
  _redirect_stale_traces(variables)
  for variable in variables:
    empty = tf.zeros([0] * max(variable.shape.rank or 0, 1), variable.dtype)
    tf.raw_ops.AssignVariableOp(resource=variable.handle, value=empty, validate_shape=False)
    variable.__dict__[_RELEASED] = True


def mark_released(variable) -> None:
  """Record that `variable` never had a buffer of its own (created as shards)."""
  variable.__dict__[_RELEASED] = True


def _redirect_stale_traces(variables) -> None:
  """Point the captured handles of functions traced before `variables` were held at handles
  that fail on read, naming the variable.

  One pass over the objects the garbage collector tracks, looking at ConcreteFunctions only
  (`gc.get_objects`, not `gc.get_referrers`: the latter calls every object's traverse
  function, and one of TF's crashed the process while another thread ran).
  """
  import gc

  by_handle = {id(v.handle): v for v in variables}
  poisoned: Dict[int, Any] = {}
  for owner in gc.get_objects():
    if type(owner).__name__ != 'ConcreteFunction':
      continue
    captured = getattr(owner, '_captured_inputs', None)  # what its calls pass: no public API
    if not isinstance(captured, list):
      continue
    for i, item in enumerate(captured):
      variable = by_handle.get(id(item))
      if variable is None or item is not variable.handle:
        continue
      if id(item) not in poisoned:
        poisoned[id(item)] = _missing_handle(variable)
      captured[i] = poisoned[id(item)]


def _missing_handle(variable) -> tf.Tensor:
  """A handle to a variable that does not exist, named so that its read error says why."""
  _MISSING_COUNT[0] += 1
  name = variable.name.split(':')[0]
  return tf.raw_ops.VarHandleOp(
    dtype=variable.dtype,
    shape=variable.shape,
    shared_name=(
      f'{name}_is_held_as_shards_by_tf_gspmd_so_trace_this_function_again_{_MISSING_COUNT[0]}'
    ),
  )


def read_global(holder, dtype) -> tf.Tensor:
  """The whole value of `holder`'s shards (eagerly, or as ops in the graph being built)."""
  if tf.executing_eagerly() or getattr(holder, 'assembles_in_graph', True):
    return holder.assemble()
  # Shards outside TF's runtime (PJRT buffers): fetched by a host call at run time.
  value = tf.py_function(lambda: holder.assemble(), [], dtype, name='assemble_held')
  value.set_shape(holder.shape)
  return value


def write_global(holder, value: tf.Tensor):
  """Scatter `value` to `holder`'s shards; returns what orders the write in a graph."""
  if tf.executing_eagerly() or getattr(holder, 'assembles_in_graph', True):
    holder.scatter(value)
    return None

  def scatter(v):
    holder.scatter(v)
    return np.int32(0)

  return tf.py_function(scatter, [value], tf.int32, name='scatter_held')


def _base(name: str) -> Callable:
  """TF's own implementation of a variable method (for reads and writes inside a partition
  trace, where a held variable behaves as the variable it was)."""
  return _TF_METHODS[name]


class _HeldView:
  """The methods that make a variable read and write its shards (see the module docstring)."""

  _should_act_as_resource_variable = True  # tf's is_resource_variable(): it still is one

  @property
  def _tf_gspmd_holder(self):
    return self.__dict__[_HOLDER]

  # --- reads -----------------------------------------------------------------------------
  def _read_variable_op(self, no_copy=False):
    if tracing_for_partition():
      return _base('_read_variable_op')(self, no_copy)
    variable_accessed(self)  # gradient tapes watch it, as for any variable read
    value = read_global(self._tf_gspmd_holder, self.dtype)
    record.record_operation(
      'ReadVariableOp',
      [value],
      [self.handle],
      backward_function=lambda x: [x],
      forward_function=lambda x: [x],
    )
    return value

  def is_initialized(self, name=None):
    if tracing_for_partition():
      return _base('is_initialized')(self, name)
    return tf.constant(True)

  def sparse_read(self, indices, name=None):
    if tracing_for_partition():
      return _base('sparse_read')(self, indices, name)
    return tf.gather(self.value(), indices, name=name)

  def gather_nd(self, indices, name=None):
    if tracing_for_partition():
      return _base('gather_nd')(self, indices, name)
    return tf.gather_nd(self.value(), indices, name=name)

  def __tf_tracing_type__(self, signature_context):
    raise TypeError(
      f'Variable {self.name} lives as shards (tf_gspmd); a tf.function reads it from its '
      'closure, not as an argument: use it inside the function instead of passing it.'
    )

  # --- writes ----------------------------------------------------------------------------
  def assign(self, value, use_locking=None, name=None, read_value=True):
    if tracing_for_partition():
      return _base('assign')(self, value, use_locking, name, read_value)
    value = tf.convert_to_tensor(value, dtype=self.dtype)
    if not self.shape.is_compatible_with(value.shape):
      raise ValueError(
        f"Cannot assign value to variable '{self.name}': Shape mismatch. The variable shape "
        f'{self.shape}, and the assigned value shape {value.shape} are incompatible.'
      )
    op = write_global(self._tf_gspmd_holder, value)
    return self if read_value else op

  def assign_add(self, delta, use_locking=None, name=None, read_value=True):
    if tracing_for_partition():
      return _base('assign_add')(self, delta, use_locking, name, read_value)
    now = read_global(self._tf_gspmd_holder, self.dtype)
    return self.assign(now + tf.convert_to_tensor(delta, self.dtype), read_value=read_value)

  def assign_sub(self, delta, use_locking=None, name=None, read_value=True):
    if tracing_for_partition():
      return _base('assign_sub')(self, delta, use_locking, name, read_value)
    now = read_global(self._tf_gspmd_holder, self.dtype)
    return self.assign(now - tf.convert_to_tensor(delta, self.dtype), read_value=read_value)

  # --- checkpoints -----------------------------------------------------------------------
  def _serialize_to_tensors(self):
    if tracing_for_partition():
      return _base('_serialize_to_tensors')(self)
    with tf.device('/device:CPU:0'):
      return {VARIABLE_VALUE_KEY: tf.identity(read_global(self._tf_gspmd_holder, self.dtype))}

  def _restore_from_tensors(self, restored_tensors):
    if tracing_for_partition():
      return _base('_restore_from_tensors')(self, restored_tensors)
    value = tf.convert_to_tensor(restored_tensors[VARIABLE_VALUE_KEY], self.dtype)
    if not self.shape.is_compatible_with(value.shape):
      raise ValueError(
        f'Received incompatible tensor with shape {value.shape} when attempting to restore '
        f'variable with shape {self.shape} and name {self.name}.'
      )
    return write_global(self._tf_gspmd_holder, value)


def _through_whole(method: str) -> Callable:
  """A write method TF implements on the handle (`scatter_*`, slice assignment), run on a
  temporary whole copy whose new value is then scattered (eagerly; in a graph: refused)."""

  def run(self, *args, **kwargs):
    if tracing_for_partition():
      return _base(method)(self, *args, **kwargs)
    if not tf.executing_eagerly():
      raise NotImplementedError(
        f'{method} on variable {self.name}, whose value lives as shards, runs eagerly or '
        'inside a partitioned function; inside a plain tf.function, compute the new value '
        'and assign() it.'
      )
    whole = tf.Variable(read_global(self._tf_gspmd_holder, self.dtype), trainable=False)
    getattr(whole, method)(*args, **kwargs)
    write_global(self._tf_gspmd_holder, whole.read_value())
    return self

  run.__name__ = method
  return run


_WHOLE_WRITES = (
  'scatter_sub',
  'scatter_add',
  'scatter_max',
  'scatter_min',
  'scatter_mul',
  'scatter_div',
  'scatter_update',
  'batch_scatter_update',
  'scatter_nd_sub',
  'scatter_nd_add',
  'scatter_nd_update',
  'scatter_nd_max',
  'scatter_nd_min',
  '_strided_slice_assign',
)
for _method in _WHOLE_WRITES:
  setattr(_HeldView, _method, _through_whole(_method))

# TF's variable methods, by name: a held variable's class carries them (it is no longer a
# BaseResourceVariable, see tf_private), and its overrides call them inside partition traces.
_TF_METHODS: Dict[str, Any] = {}
for _cls in (BaseResourceVariable, ResourceVariable):
  for _name, _value in vars(_cls).items():
    if _name not in ('__dict__', '__weakref__', '__module__', '__init__', '__doc__'):
      _TF_METHODS[_name] = _value
_TF_METHODS.pop('_type_spec', None)  # not a CompositeTensor any more
_TF_METHODS.pop('_shape_invariant_to_type_spec', None)
_TENSOR_BASES = tuple(
  c for c in BaseResourceVariable.__mro__ if c.__name__ == 'Tensor' and c is not tf.Tensor
)

# Python functions, properties and plain values: what a class body may hold.
HeldVariable = type(
  'HeldVariable',
  (tf.Variable,) + _TENSOR_BASES,
  {
    **_TF_METHODS,
    **{k: v for k, v in vars(_HeldView).items() if k not in ('__dict__', '__weakref__')},
    '__module__': __name__,
    '__doc__': 'A tf.Variable whose value lives as shards (tf_gspmd.program.held).',
  },
)


def _convert(value, dtype=None, name=None, as_ref=False):
  return value._dense_var_to_tensor(dtype=dtype, name=name, as_ref=as_ref)  # noqa: SLF001


tf.register_tensor_conversion_function(HeldVariable, _convert)


def iter_holders() -> Iterator[tuple]:
  """(variable, holder) for every live held variable."""
  for variable in held_variables():
    yield variable, holder_of(variable)
