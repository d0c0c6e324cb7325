"""Halo geometry checked against a direct numpy evaluation of windowed sums (no TensorFlow).

Halos wider than a neighbour's shard are assembled from several neighbours
(`HaloPiece`s, one collective-permute per hop); the simulation below runs
exactly that shard by shard, with NaN in every row a partition must not read.
"""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tf_gspmd.propagation.halo import (
  HaloPiece,
  WindowDim,
  halo_geometry,
  halo_pieces,
  input_gradient_geometry,
  same_padding,
)


def windowed_sum(x, dim):
  """Reference: 1-D windowed sum with zero padding."""
  padded = np.concatenate([np.zeros(dim.pad_lo), x, np.zeros(dim.pad_hi)])
  return np.array(
    [
      sum(padded[r * dim.stride + t * dim.dilation] for t in range(dim.window))
      for r in range(dim.output_size)
    ]
  )


def borrowed(local, i, pieces, side):
  """Shard i's halo on `side`, piece by piece from the shards `hop` away (NaN where none)."""
  shards = len(local)
  parts = []
  for piece in pieces:
    j = i - piece.hop if side == 'left' else i + piece.hop
    parts.append(
      local[j, piece.start : piece.start + piece.rows]
      if 0 <= j < shards
      else np.full(piece.rows, np.nan)
    )
  return np.concatenate(parts) if parts else np.zeros(0)


def simulate(x, dim, shards):
  """Run the halo geometry shard by shard and stitch the outputs."""
  halo = halo_geometry(dim, shards)
  ci, n = halo.input_chunk, dim.input_size
  padded = np.concatenate([x, np.full(ci * shards - n, np.nan)])  # padding is garbage
  local = padded.reshape(shards, ci)
  out = []
  for i in range(shards):
    ext = np.concatenate(
      [
        borrowed(local, i, halo.left_pieces, 'left'),
        local[i],
        borrowed(local, i, halo.right_pieces, 'right'),
      ]
    )
    # [left | local | right] holds global rows [i*ci - left, (i+1)*ci + right) in order.
    rows_held = i * ci - halo.left + np.arange(len(ext))
    real = (rows_held >= 0) & (rows_held < n)
    np.testing.assert_array_equal(ext[real], x[rows_held[real]])
    start = halo.window_starts[i]
    window = ext[start : start + halo.span].copy()
    if len(window) < halo.span:  # trailing shards without output rows may read past the end
      window = np.concatenate([window, np.zeros(halo.span - len(window))])
    rows = halo.window_global_starts[i] + np.arange(halo.span)
    window[(rows < 0) | (rows >= n)] = 0.0  # mask outside the image and padding
    sub = WindowDim(halo.span, dim.window, dim.stride, dim.dilation)
    out.append(windowed_sum(window, sub)[: halo.output_chunk])
  return np.concatenate(out)[: dim.output_size], halo


@settings(max_examples=300, deadline=None)
@given(
  n=st.integers(1, 40),
  window=st.integers(1, 7),
  stride=st.integers(1, 3),
  dilation=st.integers(1, 3),
  shards=st.integers(1, 8),
  same=st.booleans(),
)
def test_halo_geometry_reproduces_windowed_sum(n, window, stride, dilation, shards, same):
  lo, hi = same_padding(n, window, stride, dilation) if same else (0, 0)
  dim = WindowDim(n, window, stride, dilation, lo, hi)
  if dim.output_size == 0:
    return
  x = np.arange(1, n + 1, dtype=np.float64)
  got, halo = simulate(x, dim, shards)
  # Exact, so no real output row read garbage (NaN), whatever the number of hops.
  np.testing.assert_array_equal(got, windowed_sum(x, dim), err_msg=str(halo))


@settings(max_examples=200, deadline=None)
@given(width=st.integers(0, 30), chunk=st.integers(1, 6), side=st.sampled_from(['left', 'right']))
def test_pieces_tile_the_halo(width, chunk, side):
  pieces = halo_pieces(width, chunk, side)
  assert sum(p.rows for p in pieces) == width
  assert all(0 < p.rows <= chunk and 0 <= p.start and p.start + p.rows <= chunk for p in pieces)
  # In buffer order, each piece's global rows follow the previous piece's (shard i at 0).
  glob = [(-p.hop if side == 'left' else p.hop) * chunk + p.start for p in pieces]
  first = -width if side == 'left' else chunk
  assert glob == [first + sum(p.rows for p in pieces[:k]) for k in range(len(pieces))]
  assert len(pieces) == -(-width // chunk)


def test_same_padding_matches_tf_formula():
  assert same_padding(10, 3, 1) == (1, 1)
  assert same_padding(10, 3, 2) == (0, 1)
  assert same_padding(7, 4, 1) == (1, 2)


def test_stride_one_same_conv_borrows_one_row_each_side():
  halo = halo_geometry(WindowDim(16, 3, 1, 1, 1, 1), 4)
  assert (halo.left, halo.right, halo.span) == (1, 1, 6)
  assert halo.fits_neighbours and halo.hops == 1


def test_five_by_five_on_one_row_shards_reaches_two_neighbours():
  halo = halo_geometry(WindowDim(8, 5, 1, 1, 2, 2), 8)
  assert (halo.left, halo.right, halo.input_chunk) == (2, 2, 1)
  assert not halo.fits_neighbours and halo.hops == 2
  assert halo.left_pieces == (HaloPiece(2, 0, 1), HaloPiece(1, 0, 1))
  assert halo.right_pieces == (HaloPiece(1, 0, 1), HaloPiece(2, 0, 1))


def test_wide_halo_takes_whole_shards_then_a_partial_one():
  assert halo_pieces(5, 2, 'left') == (HaloPiece(3, 1, 1), HaloPiece(2, 0, 2), HaloPiece(1, 0, 2))
  assert halo_pieces(5, 2, 'right') == (HaloPiece(1, 0, 2), HaloPiece(2, 0, 2), HaloPiece(3, 0, 1))
  assert halo_pieces(0, 2, 'left') == ()
  with pytest.raises(ValueError, match='side'):
    halo_pieces(1, 2, 'up')


@pytest.mark.parametrize(
  'n,window,stride,shards',
  [
    (10, 3, 1, 4),
    (7, 3, 1, 8),
    (1, 3, 1, 2),
    (8, 5, 1, 8),
    (5, 7, 1, 8),
    (6, 3, 2, 8),
    (4, 7, 2, 4),
  ],
)
def test_uneven_and_multi_hop_sizes(n, window, stride, shards):
  dim = WindowDim(n, window, stride, 1, *same_padding(n, window, stride))
  got, _ = simulate(np.arange(1.0, n + 1), dim, shards)
  np.testing.assert_array_equal(got, windowed_sum(np.arange(1.0, n + 1), dim))


# --- image gradients computed shard by shard ------------------------------------------------
def windowed_sum_adjoint(g, dim):
  """Reference: the image gradient of `windowed_sum` (every tap inside the image)."""
  dx = np.zeros(dim.input_size)
  for r in range(dim.output_size):
    for t in range(dim.window):
      j = r * dim.stride - dim.pad_lo + t * dim.dilation
      if 0 <= j < dim.input_size:
        dx[j] += g[r]
  return dx


def simulate_input_gradient(g, dim, shards):
  """`input_gradient_geometry` shard by shard: the output-gradient halo (NaN in every row a
  partition must not read), then the backprop of a local op with explicit padding that
  yields the shard's own rows."""
  grad = input_gradient_geometry(dim, shards)
  halo, ci, m = grad.halo, -(-dim.input_size // shards), dim.output_size
  assert halo.input_chunk == -(-m // shards) and halo.output_chunk == ci
  co = halo.input_chunk
  local = np.concatenate([g, np.full(co * shards - m, np.nan)]).reshape(shards, co)
  padded = grad.pad_lo + grad.rows + grad.pad_hi
  assert (padded - dim.effective_window) // dim.stride + 1 == halo.span  # the op's shape check
  assert min(grad.pad_lo, grad.pad_hi) >= 0 and 0 <= min(grad.offsets)
  out = []
  for i in range(shards):
    ext = np.concatenate(
      [
        borrowed(local, i, halo.left_pieces, 'left'),
        local[i],
        borrowed(local, i, halo.right_pieces, 'right'),
        np.zeros(grad.tail),
      ]
    )
    start = halo.window_starts[i]
    window = ext[start : start + halo.span].copy()
    assert len(window) == halo.span
    rows = halo.window_global_starts[i] + np.arange(halo.span)
    window[(rows < 0) | (rows >= m)] = 0.0  # outside the gradient (and its padding)
    dlocal = np.zeros(padded)
    for k in range(halo.span):
      for t in range(dim.window):
        dlocal[k * dim.stride + t * dim.dilation] += window[k]
    own = dlocal[grad.pad_lo : grad.pad_lo + grad.rows]
    out.append(own[grad.offsets[i] : grad.offsets[i] + ci])
  return np.concatenate(out)[: dim.input_size], grad


@settings(max_examples=400, deadline=None)
@given(
  n=st.integers(1, 40),
  window=st.integers(1, 7),
  stride=st.integers(1, 3),
  dilation=st.integers(1, 3),
  shards=st.integers(1, 8),
  same=st.booleans(),
)
def test_input_gradient_geometry_gives_each_shard_its_rows(
  n, window, stride, dilation, shards, same
):
  lo, hi = same_padding(n, window, stride, dilation) if same else (0, 0)
  dim = WindowDim(n, window, stride, dilation, lo, hi)
  if dim.output_size == 0:
    return
  g = np.arange(1, dim.output_size + 1, dtype=np.float64)
  got, grad = simulate_input_gradient(g, dim, shards)
  np.testing.assert_array_equal(got, windowed_sum_adjoint(g, dim), err_msg=str(grad))
  # Extra rows are computed only where a stride does not divide the shard.
  if stride == 1 or (-(-n // shards)) % stride == 0:
    assert grad.rows == -(-n // shards) and not any(grad.offsets)


def test_input_gradient_of_a_same_conv_reads_one_gradient_row_each_side():
  # The CNN's 3x3 SAME convolution of 32 rows over 4 shards: 10 gradient rows give the 8
  # own rows directly (the forward op's window would be 10 rows, then sliced to 8).
  grad = input_gradient_geometry(WindowDim(32, 3, 1, 1, 1, 1), 4)
  assert (grad.halo.left, grad.halo.right, grad.halo.span) == (1, 1, 10)
  assert (grad.pad_lo, grad.pad_hi, grad.rows, grad.offsets) == (2, 2, 8, (0, 0, 0, 0))
  whole = input_gradient_geometry(WindowDim(32, 3, 1, 1, 1, 1), 1)  # an unsplit dim: the op's own
  assert (whole.halo.span, whole.pad_lo, whole.pad_hi, whole.rows) == (32, 1, 1, 32)


def test_input_gradient_with_odd_shards_and_stride_two_starts_at_two_phases():
  grad = input_gradient_geometry(WindowDim(10, 3, 2, 1, *same_padding(10, 3, 2)), 2)  # ci = 5
  assert grad.rows == 6 and sorted(set(grad.offsets)) == [0, 1]
  got, _ = simulate_input_gradient(np.arange(1.0, 6), WindowDim(10, 3, 2, 1, 0, 1), 2)
  np.testing.assert_array_equal(
    got, windowed_sum_adjoint(np.arange(1.0, 6), WindowDim(10, 3, 2, 1, 0, 1))
  )


def test_input_gradient_of_a_strided_one_by_one_skips_uncovered_rows():
  dim = WindowDim(9, 1, 2)  # rows 1, 3, 5, 7 get no gradient
  got, grad = simulate_input_gradient(np.arange(1.0, 6), dim, 3)
  np.testing.assert_array_equal(got, windowed_sum_adjoint(np.arange(1.0, 6), dim))
  assert grad.pad_lo >= 0
