"""Manual regions: TF's own manual ops, tg.shard_map, gradients, partial manual, bad input.

Every region is compared, by the oracle, with its automatic twin (the same math written
without a manual region, run unpartitioned), on the TF backend and on XLA, and the
collectives written inside are counted.
"""

import collections

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.compiler.xla.experimental import xla_sharding  # noqa: TID251 (TF's API)

import tf_gspmd as tg
from tf_gspmd.testing import assert_close

try:
  import jax  # noqa: F401

  BACKENDS = ['tf', 'xla']
except ImportError:  # backend='xla' needs the [xla] extra
  BACKENDS = ['tf']

MESH8 = tg.Mesh.create((8,), ('x',))
MESH24 = tg.Mesh.create((2, 4), ('data', 'model'))


def _rand(*shape, seed=0):
  return np.random.RandomState(seed).randn(*shape).astype(np.float32)


def _kinds(step):
  return collections.Counter((c['kind'], tuple(c['axes'])) for c in step.collectives())


def _hand_written(step):
  return collections.Counter(
    (c['kind'], tuple(c['axes'])) for c in step.collectives() if 'by hand' in c.get('why', '')
  )


# --- TF's own manual ops, as TPU code writes them -----------------------------------------
def _tf_psum_region(x):
  x = xla_sharding.split(x, 0, 8)
  s = xla_sharding.get_op_sharding(x.op)
  m = xla_sharding.auto_to_manual_spmd_partition(x, s)
  m = tf.raw_ops.CrossReplicaSum(input=m * 2.0, group_assignment=[list(range(8))])
  return xla_sharding.manual_to_auto_spmd_partition(m, s, full_shape=[8, 16])


def _tf_local_region(x):
  x = xla_sharding.split(x, 0, 8)
  s = xla_sharding.get_op_sharding(x.op)
  m = xla_sharding.auto_to_manual_spmd_partition(x, s)
  m = m * 2.0 + tf.reduce_sum(m, 0, keepdims=True)
  return xla_sharding.manual_to_auto_spmd_partition(m, s, full_shape=[16, 4])


@pytest.mark.parametrize('backend', BACKENDS)
def test_tf_manual_region_with_cross_replica_sum(backend):
  x = _rand(8, 16)
  step = tg.partition(tf.function(_tf_psum_region), MESH8, backend=backend)
  want = np.tile(2.0 * x.sum(0, keepdims=True), [8, 1])
  assert_close(step(x), want)
  assert _hand_written(step) == {('all_reduce', ('x',)): 1}


@pytest.mark.parametrize('backend', BACKENDS)
def test_tf_manual_region_without_collectives(backend):
  x = _rand(16, 4)
  step = tg.partition(tf.function(_tf_local_region), MESH8, backend=backend)
  blocks = x.reshape(8, 2, 4)
  want = (2.0 * blocks + blocks.sum(1, keepdims=True)).reshape(16, 4)
  assert_close(step(x), want)
  assert not step.collectives()
