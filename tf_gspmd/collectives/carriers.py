"""How values of a dtype the backends' kernels refuse travel through a collective, exactly.

Any dtype of numbers (and bool) goes through every collective: a dtype the
kernels refuse travels as one they take (`carrier_for`): complex as pairs of
its float parts, uint64 bitcast to int64 (sums as 32-bit halves with their
carry, max/min with the top bit flipped), narrow integers, bool and bfloat16
widened. Products of complex or uint64 values are a gather and a local product
(`reduces_by_gather`). A reduction undefined for the dtype (max of complex,
sum of bool) or a dtype no number carries (string) is refused by name.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import tensorflow as tf

# --- dtypes the backends cannot carry ----------------------------------------------------------
# The dtypes TF's collective V2 kernels take for every kind (measured on CPU: all-reduce,
# all-gather, all-to-all, broadcast send/recv each refuse complex, uint*, int8/16 and bool or
# bfloat16 for some kind). Any other dtype travels as one of these, exactly, and in the
# backend-neutral layer so that every backend gets the same conversions.
CARRIED_NATIVELY = frozenset({tf.float16, tf.float32, tf.float64, tf.int32, tf.int64})
_WIDENED = {
  tf.bool: tf.int32,
  tf.int8: tf.int32,
  tf.uint8: tf.int32,
  tf.int16: tf.int32,
  tf.uint16: tf.int32,
  tf.uint32: tf.int64,
  tf.bfloat16: tf.float32,
}
_COMPLEX_PARTS = {tf.complex64: tf.float32, tf.complex128: tf.float64}
_LOW32 = 0xFFFFFFFF
_SIGN64 = 1 << 63


@dataclasses.dataclass(frozen=True)
class Carrier:
  """How a tensor of a dtype the backends refuse travels: `encode` before the collective, `decode`
  after. The encoded value may have a trailing dim of 2 (parts of one element); collectives
  only move or reduce leading dims, so that dim rides along."""

  dtype: tf.DType
  encode: Callable[[tf.Tensor], tf.Tensor]
  decode: Callable[[tf.Tensor], tf.Tensor]


def _widened(dtype, wide) -> Carrier:
  # Exact: every value of `dtype` is a value of `wide`; integer sums and products wrap
  # modulo 2^bits of `wide`, and casting back keeps the low bits, which is the wrapped
  # result in `dtype`; max/min keep their order.
  return Carrier(wide, lambda x: tf.cast(x, wide), lambda y: tf.cast(y, dtype))


def _complex_parts(dtype) -> Carrier:
  part = _COMPLEX_PARTS[dtype]
  return Carrier(part, lambda x: tf.bitcast(x, part), lambda y: tf.bitcast(y, dtype))


def _uint64_moved() -> Carrier:
  return Carrier(tf.int64, lambda x: tf.bitcast(x, tf.int64), lambda y: tf.bitcast(y, tf.uint64))


def _uint64_ordered() -> Carrier:
  """uint64 as int64 with the top bit flipped: an order-preserving map, so max/min are exact."""

  def sign():
    return tf.constant(_SIGN64, tf.uint64)

  return Carrier(
    tf.int64,
    lambda x: tf.bitcast(tf.bitwise.bitwise_xor(x, sign()), tf.int64),
    lambda y: tf.bitwise.bitwise_xor(tf.bitcast(y, tf.uint64), sign()),
  )


def _uint64_summed() -> Carrier:
  """uint64 as int64 pairs (low 32 bits, high 32 bits), each < 2^32.

  A group of k < 2^31 members sums each half without overflowing int64; the carry of the low
  half goes into the high half, which wraps modulo 2^32: the sum modulo 2^64, as uint64 adds.
  (Bitcasting to int64 and summing would give the same bits only through signed overflow.)
  """

  def encode(x):
    low = tf.bitwise.bitwise_and(x, tf.constant(_LOW32, tf.uint64))
    high = tf.bitwise.right_shift(x, tf.constant(32, tf.uint64))
    return tf.stack([tf.cast(low, tf.int64), tf.cast(high, tf.int64)], axis=-1)

  def decode(y):
    low, high = y[..., 0], y[..., 1]
    high = tf.bitwise.bitwise_and(high + tf.bitwise.right_shift(low, 32), _LOW32)
    low = tf.bitwise.bitwise_and(low, _LOW32)
    return tf.bitwise.bitwise_or(
      tf.bitwise.left_shift(tf.cast(high, tf.uint64), tf.constant(32, tf.uint64)),
      tf.cast(low, tf.uint64),
    )

  return Carrier(tf.int64, encode, decode)


def reduces_by_gather(dtype: tf.DType, op: Optional[str]) -> bool:
  """Whether reduction `op` of `dtype` is a gather and a local reduction: products whose
  carriers do not multiply like the values (complex numbers, uint64 modulo 2^64)."""
  return op == 'prod' and (dtype in _COMPLEX_PARTS or dtype == tf.uint64)


def carrier_for(dtype: tf.DType, op: Optional[str], what: str) -> Optional[Carrier]:
  """How `dtype` travels through a collective that reduces with `op` (None: moves data only).

  None when the backends take `dtype` as it is. Raises a TypeError naming `what` (the
  collective, its axes and operand) when `op` is undefined for `dtype` or no exact carrier
  exists.
  """
  if dtype in CARRIED_NATIVELY:
    return None
  if dtype == tf.bool and op in ('sum', 'prod'):
    raise TypeError(
      f"{what}: a '{op}' reduction of bool is ambiguous; use 'max' (any) or "
      "'min' (all), or cast first."
    )
  if dtype in _COMPLEX_PARTS and op in ('max', 'min'):
    raise TypeError(
      f"{what}: a '{op}' reduction of {dtype.name} is undefined (complex numbers "
      'have no order); reduce tf.abs or tf.math.real of the value instead.'
    )
  if reduces_by_gather(dtype, op):
    raise AssertionError(f'{what}: {op} of {dtype.name} is reduced after a gather.')
  if dtype in _WIDENED:
    return _widened(dtype, _WIDENED[dtype])
  if dtype in _COMPLEX_PARTS:
    return _complex_parts(dtype)  # moved, or summed part by part
  if dtype == tf.uint64:
    return {None: _uint64_moved, 'sum': _uint64_summed}.get(op, _uint64_ordered)()
  raise TypeError(
    f'{what}: collectives cannot carry {dtype.name} values (they carry numbers and bool); '
    f'keep this tensor replicated or on one device, or convert it to a number first.'
  )
