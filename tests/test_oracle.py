"""The numerical oracle (tf_gspmd.testing.oracle): its rule, its messages, its examples.

That it catches broken partitioned programs is tests/test_oracle_catches.py.
"""

import doctest
import math

import keras
import ml_dtypes
import numpy as np
import pytest
import tensorflow as tf

from tf_gspmd.testing import oracle
from tf_gspmd.testing.oracle import (
  assert_close,
  assert_close_to_float64,
  bound,
  check,
  relative_error,
)


def test_docstring_examples_run():
  failed, attempted = doctest.testmod(oracle, raise_on_error=False, verbose=False)
  assert attempted >= 6 and failed == 0


def test_bounds_per_dtype():
  assert bound(np.float32) == 1e-5
  assert bound(np.float64) == 1e-12
  assert bound(ml_dtypes.bfloat16) == 4 * 2.0**-7
  assert bound(np.float16) == 4 * 2.0**-10
  assert bound(np.int32) == bound(np.bool_) == 0.0


def test_normwise_not_elementwise():
  # The case: one prediction near zero off by 1e-6 absolute, the tensor agrees.
  rng = np.random.RandomState(0)
  want = rng.randn(64, 4).astype(np.float32)
  want[3, 1] = -0.0039239
  got = want.copy()
  got[3, 1] = -0.0039229
  assert check(got, want).ok
  # Element-wise rtol=1e-5 would have failed it: that is what the oracle replaces.
  assert not np.allclose(got, want, rtol=1e-5, atol=1e-7)


def test_wrong_blocks_fail_by_orders_of_magnitude():
  want = np.random.RandomState(1).randn(8, 16).astype(np.float32)
  halved = want.copy()
  halved[:4] *= 0.5  # a sum missing half its terms
  swapped = np.concatenate([want[4:], want[:4]])  # two shards swapped
  shifted = np.roll(want, 1, axis=0)  # a halo off by one row
  for got in (halved, swapped, shifted):
    verdict = check(got, want, 'y')
    assert not verdict.ok and verdict.error > 1e3 * bound(np.float32), verdict


def test_integers_and_booleans_exact():
  assert check(np.int64([5, 7]), np.int64([5, 7])).ok
  assert not check(np.int64([5, 8]), np.int64([5, 7])).ok
  assert not check(np.array([True, False]), np.array([True, True])).ok


def test_shape_dtype_and_special_values():
  want = np.array([1.0, -300.0, np.nan, np.inf], np.float32)
  assert check(want + np.float32(1e-3), want).ok  # NaN and inf unchanged by + 1e-3
  assert not check(np.array([1.0, -300.0, 0.0, np.inf], np.float32), want).ok  # NaN lost
  assert not check(np.array([1.0, -300.0, np.nan, -np.inf], np.float32), want).ok
  assert not check(np.zeros((2, 1), np.float32), np.zeros((2,), np.float32)).ok
  assert not check(np.zeros(2, np.float64), np.zeros(2, np.float32)).ok
  assert relative_error(np.float32([np.inf, 1]), np.float32([0, 1])) == math.inf


def test_zero_reference_is_measured_absolutely():
  zero = np.zeros(3, np.float32)
  assert relative_error(zero, zero) == 0.0
  assert check(np.float32([0, 1e-7, 0]), zero).ok
  assert not check(np.float32([0, 1e-3, 0]), zero).ok


def test_bfloat16_bound_from_its_epsilon():
  rng = np.random.RandomState(2)
  exact = rng.randn(256).astype(np.float32)
  # Two roundings of slightly different f32 sums: a one-ulp flip here and there.
  a = exact.astype(ml_dtypes.bfloat16)
  b = (exact * np.float32(1 + 2**-9)).astype(ml_dtypes.bfloat16)
  assert check(b, a).ok
  assert not check((exact * 1.1).astype(ml_dtypes.bfloat16), a).ok


def test_message_names_tensor_errors_and_bound():
  want = {'dense/kernel': np.ones((2, 2), np.float32), 'step': np.int64(3)}
  got = {'dense/kernel': np.full((2, 2), 1.5, np.float32), 'step': np.int64(3)}
  with pytest.raises(AssertionError) as info:
    assert_close(got, want, 'weights')
  text = str(info.value)
  assert "weights['dense/kernel']" in text and '0.5' in text and 'bound 1e-05' in text
  assert "'step'" not in text


def test_variables_are_named_by_their_path():
  keras_var = keras.Variable(np.ones(3, np.float32), name='kernel')
  tf_var = tf.Variable(np.ones(3, np.float32), name='bias')
  with pytest.raises(AssertionError) as info:
    assert_close([keras_var, tf_var], [np.zeros(3, np.float32)] * 2)
  assert keras_var.path in str(info.value) and 'bias' in str(info.value)


def test_structures_must_match():
  with pytest.raises(AssertionError, match='1 vs 2 results'):
    assert_close([np.ones(1)], [np.ones(1), np.ones(1)])
  assert_close([1.5, 2.5], [1.5, 2.5])  # a list of numbers is one tensor (a loss history)


def test_float64_rule():
  exact = np.random.RandomState(3).randn(100)
  want = (exact * (1 + 1e-3)).astype(np.float32)  # float32 itself 1e-3 off (ill-conditioned)
  near = (exact * (1 + 1.5e-3)).astype(np.float32)  # partitioned: as far, other side of rounding
  assert_close_to_float64(near, want, exact)
  with pytest.raises(AssertionError, match='further from float64'):
    assert_close_to_float64((exact * 1.01).astype(np.float32), want, exact, 'loss')
  # Where float32 is exact to rounding the floor (the dtype's bound) still allows rounding.
  rounded = exact.astype(np.float32)
  assert_close_to_float64(rounded * np.float32(1 + 2e-6), rounded, exact)


# An attention key bias's momentum after two fits (keras fuzz seed 20261128, model 3): 0 in
# exact arithmetic (softmax ignores a shift of a whole row of logits), so float64 gives ~1e-21
# and each float32 run the rounding of the terms that cancel, in its own summation order.
KEY_BIAS_FLOAT64 = np.array([[6.055e-22, -4.717e-22, -4.458e-22]])
KEY_BIAS_PLAIN = np.float32([[1.3356e-13, 8.0045e-14, 1.1768e-13]])
KEY_BIAS_PARTITIONED = np.float32([[4.5783e-13, 9.1731e-15, -2.2919e-13]])


def test_float64_rule_judges_a_cancelled_tensor_by_the_rounding_of_its_terms():
  exact, want, got = KEY_BIAS_FLOAT64, KEY_BIAS_PLAIN, KEY_BIAS_PARTITIONED
  assert oracle.is_cancelled(want, exact) and not oracle.is_cancelled(exact, exact)
  assert relative_error(got, exact) > 2 * relative_error(want, exact)  # more than the 2x rule
  assert_close_to_float64(got, want, exact, 'momentum')
  assert_close_to_float64(np.float32([0.0]), np.float32([1e-13]), np.zeros(1))  # exact 0
  # Off by more than CANCELLED_FACTOR roundings (a real error would be the size of the terms,
  # ~1e7 roundings): still a failure, which says which bound it used.
  off = got + np.float32(oracle.CANCELLED_FACTOR * 3e-13)
  with pytest.raises(AssertionError, match=r'momentum: .* 16 x .*cancelled'):
    assert_close_to_float64(off, want, exact, 'momentum')
  # A tensor float32 keeps digits of (1.0 vs 1.5) is judged by the 2x rule alone.
  assert not oracle.is_cancelled(np.float32([1.5]), np.ones(1))
  with pytest.raises(AssertionError, match=r'2 x 0\.5 \+ 1e-05'):
    assert_close_to_float64(np.float32([2.2]), np.float32([1.5]), np.ones(1))


def test_python_floats_are_float64_and_the_message_says_how_to_state_float32():
  history = [0.6931471824645996, 0.5]  # a float32 loss carried as Python floats
  other = [float(np.float32(0.6931471824645996) * np.float32(1 + 2e-7)), 0.5]
  verdict = check(other, history, 'loss')
  assert not verdict.ok and 'as_float32' in verdict.why
  assert check(np.float32(other), np.float32(history), 'loss').ok
