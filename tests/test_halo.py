"""Halo geometry checked against a direct numpy evaluation of windowed sums."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from tf_gspmd.propagation.halo import WindowDim, plan_halo, same_padding


def windowed_sum(x, dim):
  """Reference: 1-D windowed sum with zero padding."""
  padded = np.concatenate([np.zeros(dim.pad_lo), x, np.zeros(dim.pad_hi)])
  taps = [r * dim.stride + t * dim.dilation for r in range(dim.output_size) for t in range(dim.window)]
  return np.array([sum(padded[r * dim.stride + t * dim.dilation] for t in range(dim.window))
                   for r in range(dim.output_size)]) if taps else np.zeros(0)


def simulate(x, dim, shards):
  """Run the halo plan shard by shard and stitch the outputs."""
  plan = plan_halo(dim, shards)
  ci, n = plan.input_chunk, dim.input_size
  padded = np.concatenate([x, np.full(ci * shards - n, np.nan)])  # padding is garbage
  local = padded.reshape(shards, ci)
  out = []
  for i in range(shards):
    left = local[i - 1, ci - plan.left:] if i > 0 else np.full(plan.left, np.nan)
    right = local[i + 1, :plan.right] if i + 1 < shards else np.full(plan.right, np.nan)
    if plan.left == 0:
      left = np.zeros(0)
    ext = np.concatenate([left, local[i], right])
    start = plan.window_starts[i]
    window = ext[start:start + plan.span].copy()
    rows = plan.window_global_starts[i] + np.arange(plan.span)
    window[(rows < 0) | (rows >= n)] = 0.0  # mask outside the image and padding
    sub = WindowDim(plan.span, dim.window, dim.stride, dim.dilation)
    out.append(windowed_sum(window, sub)[:plan.output_chunk])
  return np.concatenate(out)[:dim.output_size], plan


@settings(max_examples=300, deadline=None)
@given(n=st.integers(1, 40), window=st.integers(1, 5), stride=st.integers(1, 3),
       dilation=st.integers(1, 3), shards=st.integers(1, 8), same=st.booleans())
def test_halo_plan_reproduces_windowed_sum(n, window, stride, dilation, shards, same):
  lo, hi = same_padding(n, window, stride, dilation) if same else (0, 0)
  dim = WindowDim(n, window, stride, dilation, lo, hi)
  if dim.output_size == 0:
    return
  if not plan_halo(dim, shards).fits_neighbours:
    return  # the partitioner gathers to replicated in that case
  x = np.arange(1, n + 1, dtype=np.float64)
  got, _ = simulate(x, dim, shards)
  np.testing.assert_array_equal(got, windowed_sum(x, dim))


def test_same_padding_matches_tf_formula():
  assert same_padding(10, 3, 1) == (1, 1)
  assert same_padding(10, 3, 2) == (0, 1)
  assert same_padding(7, 4, 1) == (1, 2)


def test_stride_one_same_conv_borrows_one_row_each_side():
  plan = plan_halo(WindowDim(16, 3, 1, 1, 1, 1), 4)
  assert (plan.left, plan.right, plan.span) == (1, 1, 6)


@pytest.mark.parametrize('n,shards', [(10, 4), (7, 8), (1, 2)])
def test_uneven_sizes(n, shards):
  dim = WindowDim(n, 3, 1, 1, 1, 1)
  if plan_halo(dim, shards).fits_neighbours:
    got, _ = simulate(np.arange(1.0, n + 1), dim, shards)
    np.testing.assert_array_equal(got, windowed_sum(np.arange(1.0, n + 1), dim))
