"""What a call of a partitioned function is keyed by, and the name it goes by."""

import inspect

import numpy as np
import tensorflow as tf


def is_tensor_like(value) -> bool:
  """Whether `value` is an argument the program takes as a tensor (not a Python constant)."""
  return isinstance(value, (tf.Tensor, tf.Variable, np.ndarray, np.generic)) or (
    hasattr(value, 'dtype') and hasattr(value, 'shape')
  )


def signature_key(args):
  """The key a compiled program is cached by: tensor shapes and dtypes, other values' reprs,
  a variable argument by its identity (it is part of the program, as a captured one is)."""
  flat = tf.nest.flatten(args)
  return tuple(
    ('variable', id(a))
    if isinstance(a, tf.Variable)
    else (tuple(np.shape(a)), str(getattr(a, 'dtype', type(a).__name__)))
    if is_tensor_like(a)
    else ('py', repr(a))
    for a in flat
  )


def tensor_arguments(args) -> list:
  """The flat arguments a program takes as tensors (a variable argument is captured instead)."""
  return [a for a in tf.nest.flatten(args) if is_tensor_like(a) and not isinstance(a, tf.Variable)]


def with_variables_bound(fn, args):
  """`(fn, args)` with every tf.Variable among `fn`'s arguments (given, or a parameter's
  default) bound into a function of the rest: a variable a step takes as an argument is its
  state as a captured one is, held as shards and updated in place, not a tensor to split.
  Unchanged when no argument is a variable."""
  python_fn = getattr(fn, 'python_function', fn)
  try:
    call = inspect.signature(python_fn).bind(*args)
  except (TypeError, ValueError):  # not a Python signature (a ConcreteFunction): as given
    return fn, args
  call.apply_defaults()
  given = (tuple(call.args), dict(call.kwargs))
  flat = tf.nest.flatten(given)
  variables = {i: a for i, a in enumerate(flat) if isinstance(a, tf.Variable)}
  if not variables:
    return fn, args
  if call.kwargs:
    raise TypeError(
      f'partition({name_of(fn)!r}): a variable argument of a function with keyword-only '
      'parameters; capture the variable in the function instead of passing it.'
    )
  rest = [None if i in variables else a for i, a in enumerate(flat)]

  def bound(*positional):  # the positions of `flat`: `given`'s keyword half is empty
    restored = [variables.get(i, a) for i, a in enumerate(tf.nest.flatten(positional))]
    return python_fn(*tf.nest.pack_sequence_as(positional, restored))

  bound.__name__ = name_of(fn)
  return tf.function(bound), tf.nest.pack_sequence_as(given, rest)[0]


def name_of(fn) -> str:
  """`fn`'s name as an identifier (that of the Python function inside a tf.function)."""
  name = getattr(fn, '__name__', None) or getattr(
    getattr(fn, 'python_function', None), '__name__', 'fn'
  )
  return ''.join(c if c.isalnum() or c == '_' else '_' for c in name)
