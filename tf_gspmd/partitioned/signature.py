"""What a call of a partitioned function is keyed by, and the name it goes by."""

import numpy as np
import tensorflow as tf


def is_tensor_like(value) -> bool:
  """Whether `value` is an argument the program takes as a tensor (not a Python constant)."""
  return isinstance(value, (tf.Tensor, tf.Variable, np.ndarray, np.generic)) or (
    hasattr(value, 'dtype') and hasattr(value, 'shape')
  )


def signature_key(args):
  """The key a compiled program is cached by: tensor shapes and dtypes, other values' reprs."""
  flat = tf.nest.flatten(args)
  return tuple(
    (tuple(np.shape(a)), str(getattr(a, 'dtype', type(a).__name__)))
    if is_tensor_like(a)
    else ('py', repr(a))
    for a in flat
  )


def name_of(fn) -> str:
  """`fn`'s name as an identifier (that of the Python function inside a tf.function)."""
  name = getattr(fn, '__name__', None) or getattr(
    getattr(fn, 'python_function', None), '__name__', 'fn'
  )
  return ''.join(c if c.isalnum() or c == '_' else '_' for c in name)
