"""Windowed ops (convolutions, pooling, their gradients) with split spatial dims.

Each partitioned function is compared with the unpartitioned tf.function
(by the oracle, tf_gspmd.testing), and its collectives are checked: a halo exchange
moves rows with permutes and never gathers the image, also when a halo is
wider than a neighbour's shard (it then comes from several neighbours, one
permute per hop). The halo geometry itself (trimmed halos, multi-hop pieces,
the reverse exchange of gradients) is checked against numpy.
"""

import logging

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import given, settings
from hypothesis import strategies as st

import tf_gspmd as tg
from tf_gspmd.graph_rewrite.halo_exchange import trimmed_halo
from tf_gspmd.partitioned import partition
from tf_gspmd.propagation.halo import WindowDim, input_gradient_geometry, same_padding
from tf_gspmd.runtime import trace_per_partition
from tf_gspmd.testing import assert_close

from helpers import randn


# --- halo geometry against numpy ------------------------------------------------------------
def taps(dim):
  """(output row, input row) of every window tap that lands inside the image."""
  return [
    (r, r * dim.stride - dim.pad_lo + t * dim.dilation)
    for r in range(dim.output_size)
    for t in range(dim.window)
    if 0 <= r * dim.stride - dim.pad_lo + t * dim.dilation < dim.input_size
  ]


def windowed_sum(x, dim):
  out = np.zeros(dim.output_size)
  for r, j in taps(dim):
    out[r] += x[j]
  return out


def windowed_sum_adjoint(g, dim):
  dx = np.zeros(dim.input_size)
  for r, j in taps(dim):
    dx[j] += g[r]
  return dx


def valid_taps_matrix(dim, span):
  """[output rows, span] 0/1 matrix of the VALID op on one window of `span` rows."""
  sub = WindowDim(span, dim.window, dim.stride, dim.dilation)
  matrix = np.zeros((sub.output_size, span))
  for r, j in taps(sub):
    matrix[r, j] += 1
  return matrix


def simulate(x, g, dim, shards):
  """The partitioner's recipe shard by shard: forward windows and reverse halo exchange."""
  geometry, tail = trimmed_halo(dim, shards)
  ci, co, n, m = geometry.input_chunk, geometry.output_chunk, dim.input_size, dim.output_size
  local_x = np.concatenate([x, np.full(ci * shards - n, np.nan)]).reshape(shards, ci)
  local_g = np.concatenate([g, np.full(co * shards - m, np.nan)]).reshape(shards, co)

  def rows_of(i):
    return geometry.window_global_starts[i] + np.arange(geometry.span)

  left_at = _laid_out(geometry.left_pieces, -1, 0)
  right_at = _laid_out(geometry.right_pieces, 1, geometry.left + ci)
  out, ext_grads = [], []
  for i in range(shards):

    def halo(laid, i=i):
      return [
        local_x[i + sign * pc.hop, pc.start : pc.start + pc.rows]
        if 0 <= i + sign * pc.hop < shards
        else np.full(pc.rows, np.nan)
        for pc, sign, _ in laid
      ]

    ext = np.concatenate(halo(left_at) + [local_x[i]] + halo(right_at) + [np.zeros(tail)])
    start = geometry.window_starts[i]
    assert 0 <= start and start + geometry.span <= len(ext)
    window = ext[start : start + geometry.span].copy()
    rows = rows_of(i)
    window[(rows < 0) | (rows >= n)] = 0.0
    matrix = valid_taps_matrix(dim, geometry.span)
    real = i * co + np.arange(co) < m
    # Row by row, so garbage (NaN) read by padding output rows stays in those rows.
    out.append(np.array([window[row > 0].sum() for row in matrix]))
    gi = np.where(real, local_g[i], 0.0)  # padding of the gradient is masked
    ext_grad = np.zeros(len(ext))
    ext_grad[start : start + geometry.span] = matrix.T @ gi
    ext_grads.append(ext_grad)
  dx = []
  for i in range(shards):  # reverse exchange: each halo piece back the hops it came
    own = ext_grads[i][geometry.left : geometry.left + ci].copy()
    for pc, sign, pos in left_at + right_at:
      j = i - sign * pc.hop  # the shard that borrowed these rows of mine
      if 0 <= j < shards:
        own[pc.start : pc.start + pc.rows] += ext_grads[j][pos : pos + pc.rows]
    dx.append(own)
  return np.concatenate(out)[:m], np.concatenate(dx)[:n], geometry


def _laid_out(pieces, sign, first):
  """(piece, -1 for left / +1 for right, its first row in the extended buffer)."""
  out, pos = [], first
  for pc in pieces:
    out.append((pc, sign, pos))
    pos += pc.rows
  return out


@settings(max_examples=300, deadline=None)
@given(
  n=st.integers(1, 40),
  window=st.integers(1, 7),
  stride=st.integers(1, 3),
  dilation=st.integers(1, 3),
  shards=st.integers(1, 8),
  same=st.booleans(),
)
def test_trimmed_halo_and_reverse_exchange_match_numpy(n, window, stride, dilation, shards, same):
  lo, hi = same_padding(n, window, stride, dilation) if same else (0, 0)
  dim = WindowDim(n, window, stride, dilation, lo, hi)
  if dim.output_size == 0:
    return  # the partitioner gathers that dim
  x = np.arange(1, n + 1, dtype=np.float64)
  g = np.arange(1, dim.output_size + 1, dtype=np.float64) * 10
  y, dx, _ = simulate(x, g, dim, shards)
  np.testing.assert_array_equal(y, windowed_sum(x, dim))
  np.testing.assert_array_equal(dx, windowed_sum_adjoint(g, dim))


def test_trimmed_halo_ignores_windows_of_padding_output_rows():
  # ResNet's stem pooling (3x3, stride 2, SAME) of 10 rows over 4 shards: the last shard
  # holds no output row, so its far-reaching window must not widen the halo.
  dim = WindowDim(10, 3, 2, 1, *same_padding(10, 3, 2))
  halo, _ = trimmed_halo(dim, 4)
  assert halo.fits_neighbours and (halo.left, halo.right) == (0, 3)


# --- end to end -----------------------------------------------------------------------------
MESHES = {
  '4': tg.Mesh.create((4,), ('x',)),
  '8': tg.Mesh.create((8,), ('x',)),
  '2x2': tg.Mesh.create((2, 2), ('x', 'y')),
  '2x4': tg.Mesh.create((2, 4), ('x', 'y')),
}

# name -> (op, kernel, stride, dilation, padding)
FORWARD = {
  'conv_same': ('conv', 3, 1, 1, 'SAME'),
  'conv_valid_s2': ('conv', 3, 2, 1, 'VALID'),
  'conv_same_s2': ('conv', 3, 2, 1, 'SAME'),
  'conv_dilated': ('conv', 3, 1, 2, 'SAME'),
  'depthwise': ('depthwise', 3, 1, 1, 'SAME'),
  'max_pool': ('max', 3, 2, 1, 'SAME'),
  'avg_pool_same': ('avg', 3, 1, 1, 'SAME'),
  'avg_pool_valid': ('avg', 2, 2, 1, 'VALID'),
}


def apply(name, x, w, dw):
  kind, k, s, d, pad = FORWARD[name]
  if kind == 'conv':
    return tf.nn.conv2d(x, w, s, pad, dilations=d, name=name)
  if kind == 'depthwise':
    return tf.nn.depthwise_conv2d(x, dw, [1, s, s, 1], pad, name=name)
  pool = tf.nn.max_pool2d if kind == 'max' else tf.nn.avg_pool2d
  return pool(x, k, s, pad, name=name)


def halo_of(name, shape, mesh, spec):
  """(permutes the halos of op `name` on the image take: one per hop and side with a
  source, the largest number of hops) over its split spatial dims."""
  _, k, s, d, pad = FORWARD[name]
  permutes, hops = 0, 0
  for dim in (1, 2):
    axes = spec.axes_of(dim)
    if not axes:
      continue
    n = shape[dim]
    lo, hi = same_padding(n, k, s, d) if pad == 'SAME' else (0, 0)
    halo, _ = trimmed_halo(WindowDim(n, k, s, d, lo, hi), mesh.axes_size(axes))
    pieces = halo.left_pieces + halo.right_pieces
    permutes += sum(1 for piece in pieces if piece.hop < halo.shards)
    hops = max(hops, halo.hops)
  return permutes, hops


def records_of(pf, op_name):
  return [r for r in pf.collectives() if r['op'] == op_name or r['op'].startswith(op_name + '/')]


def sums_over(pf, axes) -> int:
  """How many pending sums over (some of) `axes` were all-reduced, wherever that happened (a
  partial sum stays partial through linear ops and is reduced where first needed whole, alone
  or fused with others in a bucket)."""
  return sum(
    r.get('fused', 1)
    for r in pf.collectives()
    if r['kind'] == 'all_reduce' and set(r['axes']) & set(axes)
  )


FORWARD_CASES = [  # mesh, image spec, image shape
  ('4', tg.P(None, 'x', None, None), (2, 10, 6, 4)),  # height, uneven
  ('2x2', tg.P(None, 'x', 'y', None), (2, 8, 8, 4)),  # height and width, even
  ('2x4', tg.P(None, 'x', 'y', None), (1, 9, 11, 4)),  # height and width, uneven
  ('8', tg.P(None, 'x', None, None), (2, 7, 5, 4)),  # an empty shard
  ('8', tg.P(None, 'x', None, None), (2, 5, 5, 4)),  # three empty shards, 2 hops
  ('2x4', tg.P(None, ('x', 'y'), None, None), (2, 16, 5, 4)),  # height over two mesh axes
  ('2x4', tg.P('x', 'y', None, None), (3, 10, 6, 4)),  # batch and height, uneven
  ('2x2', tg.P(None, 'x', None, 'y'), (2, 10, 6, 4)),  # height and channels
]


@pytest.mark.parametrize(
  'mesh_name,spec,shape',
  FORWARD_CASES,
  ids=[f'{m}-{s}-{"x".join(map(str, sh))}' for m, s, sh in FORWARD_CASES],
)
def test_forward_ops_exchange_halos(mesh_name, spec, shape):
  mesh = MESHES[mesh_name]
  x, w, dw = randn(0, *shape), randn(1, 3, 3, shape[3], 5), randn(2, 3, 3, shape[3], 2)

  @tf.function
  def f(x, w, dw):
    x = tg.shard(x, mesh, spec)
    return [apply(name, x, w, dw) for name in FORWARD]

  pf = partition(f, mesh)
  got = pf(x, w, dw)
  for name, a, b in zip(FORWARD, got, f(x, w, dw)):
    assert_close(a, b, name=name)
  for name in FORWARD:
    records = records_of(pf, name)
    # Gathers of the image (not of a result propagation wants unsplit): never, also when
    # a halo spans several neighbours' shards.
    gathers = [r for r in records if r['kind'] == 'all_gather' and r['why'].startswith('image')]
    assert not gathers, (name, gathers)
    permutes, _ = halo_of(name, shape, mesh, spec)
    halo_records = [r for r in records if r['kind'] == 'permute' and r['why'].startswith('halo')]
    assert len(halo_records) == permutes, (name, records)
  if spec.axes_of(3):  # split input channels: partial sums, resolved by an all-reduce
    assert sums_over(pf, spec.axes_of(3)) >= 1


def test_wide_halo_comes_from_two_neighbours_by_permutes(caplog):
  mesh = MESHES['8']
  x, w = randn(3, 2, 8, 6, 2), randn(4, 5, 5, 2, 3)

  @tf.function
  def f(x, w):
    x = tg.shard(x, mesh, tg.P(None, 'x', None, None))
    return tf.nn.conv2d(x, w, 1, 'SAME', name='wide')  # 2-row halos, 1-row shards

  pf = partition(f, mesh)
  with caplog.at_level(logging.WARNING, logger='tf_gspmd'):
    assert_close(pf(x, w), f(x, w))
  records = records_of(pf, 'wide')
  # Two hops each side, one row each: four permutes of one shard row, nothing gathered.
  assert [r['kind'] for r in records] == ['permute'] * 4, records
  row_bytes = 2 * 1 * 6 * 2 * 4
  assert all(r['bytes'] == row_bytes for r in records)
  assert sorted(r['why'] for r in records) == sorted(
    [
      'halo of dim 1 from the left neighbour',
      'halo of dim 1 from the left neighbour 2 shards away',
      'halo of dim 1 from the right neighbour',
      'halo of dim 1 from the right neighbour 2 shards away',
    ]
  )
  assert not any('all-gathered' in m for m in caplog.messages)


def test_unsplit_image_follows_the_rule():
  mesh = MESHES['4']
  x, w = randn(5, 8, 6, 6, 2), randn(6, 3, 3, 2, 3)

  @tf.function
  def f(x, w):
    x = tg.shard(x, mesh, tg.P('x', None, None, None))
    return tf.nn.max_pool2d(tf.nn.conv2d(x, w, 1, 'SAME'), 2, 2, 'SAME')

  pf = partition(f, mesh)
  assert_close(pf(x, w), f(x, w))
  assert pf.collectives() == []  # batch-parallel: nothing moves


WINDOWED_OPS = (
  'Conv2D',
  'MaxPool',
  'AvgPool',
  'DepthwiseConv2dNative',
  'Conv2DBackpropInput',
  'Conv2DBackpropFilter',
  'MaxPoolGrad',
  'AvgPoolGrad',
  'DepthwiseConv2dNativeBackpropInput',
  'DepthwiseConv2dNativeBackpropFilter',
)


# Batch split: the windowed ops move nothing; the loss and filter gradients' sums over the
# batch go out in one fused all-reduce. Channel split: Conv2D's partial sum over input
# channels is reduce-scattered, the two gradients that need every channel read one all-gather
# of them (one reshard per value and target).
@pytest.mark.parametrize(
  'spec,batch,kinds',
  [
    (tg.P('x', None, None, None), 8, ['all_reduce']),
    (tg.P('x', None, None, None), 5, ['all_reduce']),  # uneven batch
    (
      tg.P(None, None, None, 'x'),
      3,  # channels
      ['reduce_scatter', 'all_gather', 'all_reduce'],
    ),
  ],
)
def test_whole_images_keep_the_ops_own_padding(spec, batch, kinds):
  """With no spatial dim split each windowed op and its gradients run as written (SAME
  padding, no Pad copy): TF's oneDNN rewrite has no kernel for an EXPLICIT-padded image
  gradient, and the Eigen one it fell back to made ResNet50's data-parallel step 2.5x
  slower."""
  mesh = MESHES['4']
  x, w, dw = randn(30, batch, 8, 6, 4), randn(31, 3, 3, 4, 4), randn(32, 3, 3, 4, 1)

  @tf.function
  def step(x, w, dw):
    x = tg.shard(x, mesh, spec)
    with tf.GradientTape() as tape:
      tape.watch([x, w, dw])
      y = tf.nn.conv2d(x, w, 1, 'SAME') + tf.nn.depthwise_conv2d(x, dw, [1, 1, 1, 1], 'SAME')
      z = tf.nn.max_pool2d(y, 3, 2, 'SAME') + tf.nn.avg_pool2d(y, 3, 2, 'SAME')
      loss = tf.reduce_sum(tf.sin(z))
    return [loss] + tape.gradient(loss, [x, w, dw])

  pf = partition(step, mesh)
  for name, got, want in zip(('loss', 'dx', 'dw', 'ddw'), pf(x, w, dw), step(x, w, dw)):
    assert_close(got, want, name=name)
  assert [r['kind'] for r in pf.collectives()] == kinds, pf.collectives()
  compiled = pf.get_program(x, w, dw)
  program = trace_per_partition(mesh, compiled.per_partition, compiled.local_specs)
  ops = program.function.graph.get_operations()
  windowed = [o for o in ops if o.type in WINDOWED_OPS]
  assert sorted({o.type for o in windowed}) == sorted(WINDOWED_OPS)
  assert all(o.get_attr('padding') == b'SAME' for o in windowed), [
    (o.name, o.get_attr('padding')) for o in windowed
  ]
  assert not [o for o in ops if o.type in ('Pad', 'PadV2', 'MirrorPad')]


def test_pooling_over_channels_is_computed_replicated(caplog):
  mesh = MESHES['4']
  x = randn(11, 2, 8, 6, 4)

  @tf.function
  def f(x):
    x = tg.shard(x, mesh, tg.P(None, 'x', None, None))
    return tf.nn.max_pool(x, [1, 1, 1, 2], [1, 1, 1, 2], 'VALID', name='depth_pool')

  pf = partition(f, mesh)
  with caplog.at_level(logging.WARNING, logger='tf_gspmd'):
    assert_close(pf(x), f(x))
  assert [r['kind'] for r in records_of(pf, 'depth_pool')] == ['all_gather']
  assert any('depth_pool' in m and 'replicated' in m for m in caplog.messages)


# --- gradients ------------------------------------------------------------------------------
GRAD_OPS = (
  'Conv2DBackpropInput',
  'Conv2DBackpropFilter',
  'MaxPoolGrad',
  'AvgPoolGrad',
  'DepthwiseConv2dNativeBackpropInput',
  'DepthwiseConv2dNativeBackpropFilter',
)

GRAD_CASES = [
  ('4', tg.P(None, 'x', None, None), (2, 10, 9, 3)),
  ('2x2', tg.P(None, 'x', 'y', None), (2, 12, 10, 3)),
  ('2x4', tg.P(None, 'x', 'y', None), (1, 9, 13, 3)),  # uneven both ways: the slowest case
]


@pytest.mark.parametrize(
  'mesh_name,spec,shape',
  [
    pytest.param(
      *case,
      id=f'{case[0]}-{case[1]}-{"x".join(map(str, case[2]))}',
      marks=[pytest.mark.slow] if case[0] == '2x4' else [],
    )
    for case in GRAD_CASES
  ],
)
def test_gradients_exchange_halos_both_ways(mesh_name, spec, shape):
  mesh = MESHES[mesh_name]
  x = randn(7, *shape)
  w1, dw, w2 = randn(8, 3, 3, shape[3], 4), randn(9, 3, 3, 4, 2), randn(10, 3, 3, 8, 3)

  @tf.function
  def step(x, w1, dw, w2):
    x = tg.shard(x, mesh, spec)
    with tf.GradientTape() as tape:
      tape.watch([x, w1, dw, w2])
      y = tf.nn.relu(tf.nn.conv2d(x, w1, 1, 'SAME'))
      z = tf.nn.depthwise_conv2d(y, dw, [1, 1, 1, 1], 'SAME')
      p = tf.nn.max_pool2d(z, 3, 2, 'SAME')
      a = tf.nn.avg_pool2d(p, 3, 1, 'SAME')
      v = tf.nn.avg_pool2d(z, 2, 2, 'VALID')
      c = tf.nn.conv2d(a, w2, 2, 'VALID')
      loss = tf.reduce_sum(c * c) + tf.reduce_sum(v * v)
    return [loss] + tape.gradient(loss, [x, w1, dw, w2])

  pf = partition(step, mesh)
  for name, a, b in zip(
    ('loss', 'dx', 'dw1', 'ddw', 'dw2'), pf(x, w1, dw, w2), step(x, w1, dw, w2)
  ):
    assert_close(a, b, name=name)
  by_type = {}
  for r in pf.collectives():
    by_type.setdefault(r['op_type'], []).append(r)
  for op in GRAD_OPS:
    records = by_type.get(op, [])
    assert any(r['kind'] == 'permute' for r in records), (op, records)
    operand_gathers = [
      r for r in records if r['kind'] == 'all_gather' and not r['why'].startswith('result')
    ]
    assert not operand_gathers, (op, operand_gathers)
  # The three filter gradients are partial sums over the split rows, each summed once.
  split = [a for d in (1, 2) for a in spec.axes_of(d)]
  assert sums_over(pf, split) == 3 + 1  # and the loss


@pytest.mark.parametrize('spec', [(None, None, None, 'x'), ('x', None, None, 'y')])
def test_pool_gradient_with_batch_and_channel_splits_stays_local(spec):
  mesh = tg.Mesh.create((2, 2), ('x', 'y'))

  @tf.function
  def f(img):
    img = tg.shard(img, mesh, tg.P(*spec))
    with tf.GradientTape() as tape:
      tape.watch(img)
      out = tf.reduce_sum(tf.nn.avg_pool2d(img, 3, 1, 'SAME') ** 2)
    return tape.gradient(out, img)

  img = np.random.RandomState(0).randn(4, 8, 6, 4).astype(np.float32)
  pf = tg.partition(f, mesh)
  assert_close(pf(img), f(img), name='d_img')
  pool = [r for r in pf.op_records() if r.op in ('AvgPool', 'AvgPoolGrad')]
  assert pool and not any(r.collectives for r in pool)


# --- halos that span several neighbours' shards ---------------------------------------------
WINDOWED_TYPES = (
  'Conv2D',
  'MaxPool',
  'AvgPool',
  'Conv2DBackpropInput',
  'Conv2DBackpropFilter',
  'MaxPoolGrad',
  'AvgPoolGrad',
)

# Windows stay within the image size: TF's CPU AvgPoolGrad with SAME padding is not the
# adjoint of AvgPool when a window is larger than the whole dim (it clamps the window
# start, then sizes the window from the full kernel), and the partitioned gradient is.
MULTI_HOP_CASES = [  # mesh, mesh axes splitting the height, image shape, kernel, stride
  ('8', 'x', (2, 8, 6, 3), 5, 1),  # 5x5 on 1-row shards: 2 hops each side
  ('8', 'x', (1, 5, 7, 2), 5, 1),  # uneven, 3 empty shards
  ('4', 'x', (1, 7, 7, 2), 7, 1),  # uneven, 7x7 on 2-row shards: whole + partial
  ('4', 'x', (2, 4, 6, 3), 3, 2),  # stride 2 on a small late map: 3 hops right
  ('2x4', ('x', 'y'), (1, 8, 5, 2), 5, 1),  # hops across the boundary of two mesh axes
]


@pytest.mark.parametrize(
  'mesh_name,axes,shape,k,s',
  [  # across two mesh axes: one more build (7 s); `make test` runs it, the edit loop not
    pytest.param(*case, marks=pytest.mark.slow) if case[0] == '2x4' else case
    for case in MULTI_HOP_CASES
  ],
  ids=[f'{m}-{"x".join(map(str, sh))}-k{k}s{s}' for m, _, sh, k, s in MULTI_HOP_CASES],
)
def test_multi_hop_halos_forward_and_gradients_use_only_permutes(mesh_name, axes, shape, k, s):
  mesh = MESHES[mesh_name]
  x = randn(12, *shape)
  w1, w2 = randn(13, k, k, shape[3], 3), randn(14, 3, 3, 3, 2)

  @tf.function
  def step(x, w1, w2):
    x = tg.shard(x, mesh, tg.P(None, axes, None, None))
    with tf.GradientTape() as tape:
      tape.watch([x, w1, w2])
      y = tf.nn.relu(tf.nn.conv2d(x, w1, s, 'SAME'))
      m = tf.nn.max_pool2d(y, k, 1, 'SAME')
      a = tf.nn.avg_pool2d(m, k, 1, 'SAME')
      c = tf.nn.conv2d(a, w2, 1, 'SAME')
      loss = tf.reduce_sum(c * c)
    return [loss] + tape.gradient(loss, [x, w1, w2])

  pf = partition(step, mesh)
  for name, a, b in zip(('loss', 'dx', 'dw1', 'dw2'), pf(x, w1, w2), step(x, w1, w2)):
    assert_close(a, b, name=name)
  records = [r for r in pf.collectives() if r['op_type'] in WINDOWED_TYPES]
  operand_gathers = [
    r for r in records if r['kind'] == 'all_gather' and not r['why'].startswith('result')
  ]
  assert not operand_gathers, operand_gathers
  halos = [r for r in records if r['kind'] == 'permute']
  assert any('shards away' in r['why'] for r in halos), halos  # several hops were needed
  assert any('gradient' in r['why'] and 'shards away' in r['why'] for r in halos), halos
  # Each piece is at most one source shard: the extended buffer is shard + halo rows.
  for r in halos:
    assert r['shape'][1] <= -(-shape[1] // mesh.axes_size(tuple(axes))), r


# --- image gradients of the own rows only -----------------------------------------------------
IMAGE_GRAD_CASES = [  # mesh, image spec, image shape, kernel, stride, padding
  ('4', tg.P(None, 'x', None, None), (2, 16, 6, 3), 3, 1, 'SAME'),  # the CNN's form
  ('4', tg.P(None, 'x', None, None), (2, 12, 6, 3), 3, 2, 'VALID'),  # stride 2, ci = 3
  ('4', tg.P(None, 'x', None, None), (2, 10, 7, 3), 3, 2, 'SAME'),  # uneven, two phases
  ('4', tg.P(None, 'x', None, None), (1, 9, 5, 2), 1, 2, 'VALID'),  # 1x1/2: uncovered rows
  ('8', tg.P(None, 'x', None, None), (1, 8, 5, 2), 5, 1, 'SAME'),  # 2 hops each side
  ('2x2', tg.P(None, 'x', 'y', None), (2, 9, 11, 3), 3, 2, 'SAME'),  # both dims, uneven
]


def _spatial_windows(shape, mesh, spec, k, s, pad):
  out = []
  for d in (1, 2):
    lo, hi = same_padding(shape[d], k, s) if pad == 'SAME' else (0, 0)
    window = WindowDim(shape[d], k, s, 1, lo, hi)
    shards = mesh.axes_size(spec.axes_of(d)) if spec.axes_of(d) else 1
    out.append((d, window, shards))
  return out


@pytest.mark.parametrize(
  'mesh_name,spec,shape,k,s,pad',
  IMAGE_GRAD_CASES,
  ids=[f'{m}-{"x".join(map(str, sh))}-k{k}s{s}{p}' for m, _, sh, k, s, p in IMAGE_GRAD_CASES],
)
def test_image_gradients_compute_only_the_own_rows(mesh_name, spec, shape, k, s, pad):
  mesh = MESHES[mesh_name]
  x, w, dw = randn(20, *shape), randn(21, k, k, shape[3], 4), randn(22, k, k, shape[3], 2)

  @tf.function
  def step(x, w, dw):
    x = tg.shard(x, mesh, spec)
    with tf.GradientTape() as tape:
      tape.watch(x)
      y = tf.nn.conv2d(x, w, s, pad, name='conv')
      z = tf.nn.depthwise_conv2d(x, dw, [1, s, s, 1], pad, name='depthwise')
      loss = tf.reduce_sum(y * y) + tf.reduce_sum(tf.sin(z))
    return loss, tape.gradient(loss, x)

  pf = partition(step, mesh)
  for name, got, want in zip(('loss', 'dx'), pf(x, w, dw), step(x, w, dw)):
    assert_close(got, want, name=name)
  windows = _spatial_windows(shape, mesh, spec, k, s, pad)
  for op in ('Conv2DBackpropInput', 'DepthwiseConv2dNativeBackpropInput'):
    records = [r for r in pf.collectives() if r['op_type'] == op]
    assert all(r['kind'] == 'permute' and 'of the output gradient' in r['why'] for r in records), (
      records
    )
    # One permute per halo piece of the output gradient; never more than the reverse
    # exchange of the forward window's halo took.
    want, before = 0, 0
    for _, window, shards in windows:
      if shards == 1:
        continue
      halo = input_gradient_geometry(window, shards).halo
      want += sum(1 for pc in halo.left_pieces + halo.right_pieces if pc.hop < shards)
      fwd, _ = trimmed_halo(window, shards)
      before += sum(1 for pc in fwd.left_pieces + fwd.right_pieces if pc.hop < shards)
    assert len(records) == want <= before, (op, records)
  # The local backprop ops produce the shard's rows (a stride that does not divide the
  # shard adds the rows aligning its phase), not a halo-padded window.
  compiled = pf.get_program(x, w, dw)
  program = trace_per_partition(mesh, compiled.per_partition, compiled.local_specs)
  local = [
    o
    for o in program.function.graph.get_operations()
    if o.type in ('Conv2DBackpropInput', 'DepthwiseConv2dNativeBackpropInput')
  ]
  assert len(local) == 2 and all(o.name.endswith('/gspmd/own_rows') for o in local), local
  for o in local:
    for d, window, shards in windows:
      assert o.outputs[0].shape[d] == input_gradient_geometry(window, shards).rows, (o, d)
    assert o.get_attr('padding') == b'EXPLICIT'
