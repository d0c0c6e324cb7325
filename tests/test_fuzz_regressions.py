"""Programs the whole-program fuzzer (tf_gspmd/testing/fuzz.py) found wrong, as it shrank them.

Each `build_<seed>_<index>` is the fuzzer's printed program (`python -m tf_gspmd.testing.fuzz
--seed <seed> --start <index> --programs 1` draws the unshrunk one); its test names the bug and
its fix. A bug whose fix is not clear yet is a strict expected failure saying why.
"""

import warnings

import numpy as np
import pytest
import tensorflow as tf

import tf_gspmd as tg
from tf_gspmd.testing import fuzz


@pytest.fixture(autouse=True)
def _quiet():
  with warnings.catch_warnings():
    warnings.filterwarnings('ignore', message='tf_gspmd propagation: no sharding rule')
    yield


def build_2026_142(dtype=np.float32):
  """[2026:142] 3 ops mesh 2x2x2"""
  mesh = tg.Mesh(np.array([0, 1, 2, 3, 4, 5, 6, 7]).reshape((2, 2, 2)), ('a', 'b', 'c'))
  rng = np.random.RandomState(2168)
  v1_value = (rng.standard_normal((2, 1)) * 1.0).astype(dtype)
  v13_value = (rng.standard_normal((1, 1)) * 1.0).astype(dtype)
  x15 = (rng.standard_normal((1,)) * 1.0).astype(dtype)

  def make():
    v1 = tf.Variable(v1_value)
    v13 = tf.Variable(v13_value)

    @tf.function(autograph=False)
    def program(x15):
      x15 = tg.shard(x15, mesh, tg.P('c'))
      t12 = tf.reduce_mean(v1, axis=[1], keepdims=True)
      t12 = tg.shard(t12, mesh, tg.P('c', 'a'))
      t14 = tf.matmul(t12, v13)
      t16 = t14 * x15
      return [t16]

    return program, [v1, v13]

  return mesh, make, [x15]


def test_fuzz_2026_142_pending_sum_times_a_split_one_element_factor():
  """A pending sum (the matmul's contraction split by 'a') times a one-element tensor split by
  'c' (its element on one shard, the other empty): the linear path scaled each partial block
  by its local shard of the factor, so half the result rows came out 0. Fixed in
  graph_rewrite/coalesce.py linear_handler: the factor is replicated first."""
  fuzz.check(build_2026_142)


def build_2026_20(dtype=np.float32):
  """[2026:20] 1 ops mesh 8 (1 annotations, 32 input elements)"""
  mesh = tg.Mesh(np.array([0, 1, 2, 3, 4, 5, 6, 7]).reshape((8,)), ('x',))
  rng = np.random.RandomState(2046)
  x18 = (rng.standard_normal((1, 3, 1, 8)) * 1.0).astype(dtype)
  v19_value = (rng.standard_normal((1, 1, 8, 1)) * 0.1768).astype(dtype)

  def make():
    v19 = tf.Variable(v19_value)

    @tf.function(autograph=False)
    def program(x18):
      x18 = tg.shard(x18, mesh, tg.P(None, 'x', None, None))
      t20 = tf.nn.conv2d(x18, v19, strides=2, padding='SAME')
      return [t20]

    return program, [v19]

  return mesh, make, [x18]


@pytest.mark.parametrize('backend', ['tf', 'xla'])
def test_fuzz_2026_20_halo_window_at_a_per_partition_offset_on_xla(backend):
  """A strided conv over a height of 3 split 8 ways: each partition's window starts at its
  own offset (a table entry read at run time). The slice took it with sizes of -1, which XLA
  can only resolve from a constant begin: backend='xla' refused the program (XlaLoweringError
  'XLA could not compile it (nodes: Slice)'). Fixed in collectives/interface.py slice_dim:
  static sizes."""
  if backend == 'xla':
    pytest.importorskip('jax')
  fuzz.check(build_2026_20, backend)


def build_2026_195(dtype=np.float32):
  """[2026:195] 4 ops mesh 2x4 grad"""
  mesh = tg.Mesh(np.array([0, 1, 2, 3, 4, 5, 6, 7]).reshape((2, 4)), ('a', 'b'))
  rng = np.random.RandomState(2221)
  x2 = (rng.standard_normal((7, 1, 1, 1)) * 1.0).astype(dtype)
  p7 = np.asarray(rng.choice([-1.0, 1.0]), dtype)
  v11_value = (rng.standard_normal((2,)) * 1.0).astype(dtype)
  i13 = rng.randint(0, 9, size=(1,)).astype(np.int32)
  loss_weight_t14 = rng.standard_normal((1,)).astype(dtype)

  def make():
    v11 = tf.Variable(v11_value)

    @tf.function(autograph=False)
    def program(x2, p7, i13):
      with tf.GradientTape() as tape:
        tape.watch([x2])
        t6 = tf.reduce_mean(x2, axis=[1, 2, 3], keepdims=False)
        t6 = tg.shard(t6, mesh, tg.P('a'))
        t8 = tf.cond(p7 > 0, lambda: t6 - tf.reduce_mean(t6), lambda: t6 - tf.reduce_mean(t6))
        t12 = tf.concat([t8, v11], 0)
        t14 = tf.gather(t12, i13, axis=0)
        loss = tf.reduce_sum(t14 * loss_weight_t14)
      grads = tape.gradient(loss, [x2, v11], unconnected_gradients=tf.UnconnectedGradients.ZERO)
      grads = [tf.convert_to_tensor(g) for g in grads]
      return [t14, grads[0], grads[1]]

    return program, [v11]

  return mesh, make, [x2, p7, i13]


def test_fuzz_2026_195_gradient_of_a_gather_through_a_cond():
  """The gradient of a gather after a cond enters the cond's gradient branches as sparse parts
  (indices, values, dense shape); each branch sizes its dense gradient by the shape argument,
  which it cannot fold, so its ops have run-time shapes. A rule op there of static result and
  dynamic operand crashed laying out shapes with None (TypeError in the reshard planner), and a
  branch result of run-time shape failed the If's local shape check ('This is a bug'). Fixed in
  graph_rewrite/dispatch.py (such ops are replicated, as dynamic-shape ops are; handlers.
  dynamic_handler keeps the static result shape) and control_flow._run_body (a replicated body
  result takes the call's static shape)."""
  fuzz.check(build_2026_195)
