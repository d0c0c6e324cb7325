"""FusedBatchNorm and its gradient on 8 devices: statistics over the GLOBAL batch.

With the batch or a spatial dim split, each partition sums its block per
channel and only those per-channel vectors are all-reduced; the activations
never move. Compared with the unpartitioned op (forward, running statistics,
gradients), collectives counted.
"""

import collections

import numpy as np
import pytest
import tensorflow as tf

import tf_gspmd as tg
from tf_gspmd.testing import assert_close

MESH_8 = tg.Mesh.create((8,), ('x',))
MESH_2x4 = tg.Mesh.create((2, 4), ('a', 'b'))


def _values(shape, channels, seed=0):
  rng = np.random.RandomState(seed)
  x = (rng.randn(*shape) * 2 + 1).astype(np.float32)
  scale = rng.uniform(0.5, 1.5, channels).astype(np.float32)
  offset = rng.randn(channels).astype(np.float32)
  dy = rng.randn(*shape).astype(np.float32)
  return x, scale, offset, dy


def _train_step(mesh, spec, data_format='NHWC', op='FusedBatchNormV3'):
  """Forward (y, batch mean, batch variance) and gradients of sum(y * dy)."""

  @tf.function(autograph=False)
  def f(x, scale, offset, dy):
    if spec is not None:
      x = tg.shard(x, mesh, tg.P(*spec))
    with tf.GradientTape() as tape:
      tape.watch([x, scale, offset])
      empty = tf.zeros([0], tf.float32)
      outs = getattr(tf.raw_ops, op)(
        x=x,
        scale=scale,
        offset=offset,
        mean=empty,
        variance=empty,
        epsilon=1e-3,
        is_training=True,
        data_format=data_format,
      )
      loss = tf.reduce_sum(outs[0] * dy)
    return tuple(outs[:3]) + tuple(tape.gradient(loss, [x, scale, offset]))

  return f


TRAIN_OUTPUTS = ('y', 'batch_mean', 'batch_variance', 'dx', 'dscale', 'doffset')


def _named(outputs, names=TRAIN_OUTPUTS):
  assert len(outputs) == len(names)
  return dict(zip(names, outputs))


def _kinds(pf, op_prefix='FusedBatchNorm'):
  """Collectives emitted for the batch norm nodes, as (kind, shape)."""
  return [
    (c['kind'], tuple(c['shape']))
    for r in pf.op_records()
    if r.op.startswith(op_prefix)
    for c in r.collectives
  ]


def _how(pf):
  return {r.op: r.how for r in pf.op_records() if r.op.startswith('FusedBatchNorm')}


@pytest.mark.parametrize(
  'mesh,spec,shape',
  [
    (MESH_8, ('x', None, None, None), (16, 5, 4, 3)),  # batch split
    (MESH_8, (None, 'x', None, None), (2, 16, 4, 3)),  # height split
    (MESH_2x4, ('a', 'b', None, None), (4, 8, 3, 3)),  # batch x height
    (MESH_8, ('x', None, None, None), (12, 3, 2, 5)),  # uneven: 12 rows over 8
    (MESH_2x4, ('b', 'a', None, None), (6, 5, 3, 3)),  # uneven on both dims
  ],
)
def test_training_uses_global_batch_statistics_with_vector_all_reduces_only(mesh, spec, shape):
  channels = shape[-1]
  args = _values(shape, channels)
  want = _train_step(None, None)(*args)
  pf = tg.partition(_train_step(mesh, spec), mesh)
  assert_close(_named(pf(*args)), _named(want))
  assert set(_how(pf).values()) == {'hand-written'}, _how(pf)
  # Forward: the sum, then the sum of squared deviations; gradient: both sums in one.
  assert collections.Counter(_kinds(pf)) == {
    ('all_reduce', (channels,)): 2,
    ('all_reduce', (2, channels)): 1,
  }


def test_nchw_with_channels_and_batch_split():
  shape, channels = (8, 4, 5, 3), 4
  args = _values(shape, channels)
  want = _train_step(None, None, 'NCHW')(*args)
  pf = tg.partition(_train_step(MESH_2x4, ('b', 'a', None, None), 'NCHW'), MESH_2x4)
  assert_close(_named(pf(*args)), _named(want))
  # Channels split over 'a': each vector is half the channels, reduced over 'b' only.
  assert collections.Counter(_kinds(pf)) == {('all_reduce', (2,)): 2, ('all_reduce', (2, 2)): 1}


@pytest.mark.parametrize('op', ['FusedBatchNorm', 'FusedBatchNormV2'])
def test_older_versions_alike(op):
  shape = (8, 3, 4, 2)
  args = _values(shape, 2, seed=3)
  want = _train_step(None, None, op=op)(*args)
  pf = tg.partition(_train_step(MESH_8, ('x', None, None, None), op=op), MESH_8)
  assert_close(_named(pf(*args)), _named(want))
  assert collections.Counter(_kinds(pf)) == {('all_reduce', (2,)): 2, ('all_reduce', (2, 2)): 1}


def test_running_averages_blend_the_global_statistics():
  shape = (8, 4, 2, 3)
  x, scale, offset, _ = _values(shape, 3, seed=1)
  mean, var = np.full(3, 0.5, np.float32), np.full(3, 2.0, np.float32)

  def step(spec):
    @tf.function(autograph=False)
    def f(x, scale, offset, mean, var):
      if spec is not None:
        x = tg.shard(x, MESH_8, tg.P(*spec))
      outs = tf.raw_ops.FusedBatchNormV3(
        x=x,
        scale=scale,
        offset=offset,
        mean=mean,
        variance=var,
        epsilon=1e-3,
        is_training=True,
        exponential_avg_factor=0.3,
      )
      return outs[0], outs[1], outs[2]

    return f

  want = step(None)(x, scale, offset, mean, var)
  pf = tg.partition(step(('x', None, None, None)), MESH_8)
  names = ('y', 'running_mean', 'running_variance')
  assert_close(_named(pf(x, scale, offset, mean, var), names), _named(want, names))
  assert collections.Counter(_kinds(pf)) == {('all_reduce', (3,)): 2}


def test_inference_is_elementwise_and_its_gradient_sums_are_partial():
  shape = (12, 5, 4, 3)
  x, scale, offset, dy = _values(shape, 3, seed=2)
  mean, var = np.full(3, 0.5, np.float32), np.full(3, 2.0, np.float32)

  def step(spec):
    @tf.function(autograph=False)
    def f(x, scale, offset, dy):
      if spec is not None:
        x = tg.shard(x, MESH_2x4, tg.P(*spec))
      with tf.GradientTape() as tape:
        tape.watch([x, scale, offset])
        y = tf.raw_ops.FusedBatchNormV3(
          x=x, scale=scale, offset=offset, mean=mean, variance=var, epsilon=1e-3, is_training=False
        )[0]
        loss = tf.reduce_sum(y * dy)
      return (y,) + tuple(tape.gradient(loss, [x, scale, offset]))

    return f

  want = step(None)(x, scale, offset, dy)
  pf = tg.partition(step(('b', 'a', None, None)), MESH_2x4)
  names = ('y', 'dx', 'dscale', 'doffset')
  assert_close(_named(pf(x, scale, offset, dy), names), _named(want, names))
  forward = [r for r in pf.op_records() if r.op == 'FusedBatchNormV3']
  assert [c for r in forward for c in r.collectives] == []
  # The scale and offset gradients are partial sums, resolved by all-reduces of [3] vectors
  # (at the function's end, both in one bucket: graph_rewrite/coalesce.py).
  found = [
    c
    for r in pf.op_records()
    if r.op.startswith('FusedBatchNorm') or r.op == 'outputs'
    for c in r.collectives
  ]
  assert found and all(c['kind'] == 'all_reduce' for c in found), found
  assert sorted(b for c in found for b in c.get('member_bytes', [c['bytes']])) == [12, 12]
