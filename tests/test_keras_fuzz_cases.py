"""Cases found by the Keras-level fuzzer (tf_gspmd/testing/keras_fuzz.py), shrunk, each a bug
fixed: the partitioned model must train as plain Keras does (the fuzzer's judge).

Each case is the fuzzer's printed text (`keras_fuzz.render`); the docstring above each says
what was wrong.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_gspmd as tg
from tf_gspmd.testing import fuzz, keras_fuzz


@pytest.fixture(autouse=True, scope='module')
def _quiet():
  keras_fuzz.quiet()


# GroupQueryAttention with one key/value head and its key bias (1, 3) split P('model', 'data')
# on a 4x2 mesh: the key projection's Squeeze (no squeeze_dims: every dim of size 1) ran on a
# local block (1, 1) and removed both dims, where the global op removes one (crash "gave a
# local shape ()"). Squeeze now names the dims it removes (graph_rewrite/local_ops.py).
def build_35_153():
  """[35:153] gqa,dense mesh 4x2 2 layouts sgd [fit]"""

  def model(jit_compile=False):
    keras.utils.set_random_seed(188)
    x0 = keras.Input((6, 8), name='x0')
    l1 = keras.layers.GroupQueryAttention(3, 2, 1, name='l1')
    t_l1 = l1(x0, x0)
    l2 = keras.layers.Dense(2, name='l2')
    t_l2 = l2(t_l1)
    model = keras.Model(x0, t_l2, name='m')
    model.compile(
      optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
      loss='mse',
      steps_per_execution=1,
      jit_compile=jit_compile,
    )
    return model

  def distribution():
    devices = keras.distribution.list_devices()
    devices = [devices[i] for i in [0, 1, 2, 3, 4, 5, 6, 7]]
    mesh = keras.distribution.DeviceMesh((4, 2), ['data', 'model'], devices)
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map['l1/key/bias'] = ('model', 'data')
    layout_map['l1/value/bias'] = (None, 'model')
    return keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name='data')

  data = dict(seed=188, vocab=0)
  workflow = (('fit',),)
  return model, distribution, data, workflow


@pytest.mark.slow  # a Keras workflow partitioned, plain and in float64
def test_keras_fuzz_35_153():
  keras_fuzz.check(build_35_153)


# Not a bug: the judge. The key bias of an attention layer has a gradient that is 0 in exact
# arithmetic (softmax ignores a shift of a whole row of logits), so float64 gives ~1e-21 and
# each float32 run the rounding of the terms that cancel, in its own summation order: the
# partitioned momentum of 'l2/key/bias' landed 2.4x further from float64 than the plain run
# (5.8e-13 vs 2.4e-13), past the float64 rule's 2x. The rule now judges a tensor float32
# keeps no digit of by the rounding of its terms (oracle.CANCELLED_FACTOR), against more
# witnesses (XLA, starting weights rounded another way).
def build_20261128_3():
  """[20261128:3] embedding,mha,dense mesh 4x2* 1 layouts sgd [fit,checkpoint,evaluate,fit spe 3]"""

  def model(jit_compile=False):
    keras.utils.set_random_seed(20261131)
    x0 = keras.Input((12,), dtype='int32', name='x0')
    l1 = keras.layers.Embedding(16, 3, name='l1')
    t_l1 = l1(x0)
    l2 = keras.layers.MultiHeadAttention(1, 3, name='l2')
    t_l2 = l2(t_l1, t_l1)
    l3 = keras.layers.Dense(3, name='l3')
    t_l3 = l3(t_l2)
    model = keras.Model(x0, t_l3, name='m')
    model.compile(
      optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
      loss='mse',
      steps_per_execution=3,
      jit_compile=jit_compile,
    )
    return model

  def distribution():
    devices = keras.distribution.list_devices()
    devices = [devices[i] for i in [0, 5, 4, 3, 2, 6, 1, 7]]
    mesh = keras.distribution.DeviceMesh((4, 2), ['data', 'model'], devices)
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map['l1/embeddings'] = ('model', None)
    return keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name='data')

  data = dict(seed=20261131, vocab=16)
  workflow = (('fit',), ('checkpoint',), ('evaluate',), ('fit',))
  return model, distribution, data, workflow


@pytest.mark.slow  # Keras workflows partitioned, plain, in float64 and by XLA
def test_keras_fuzz_20261128_3():
  keras_fuzz.check(build_20261128_3)


def build_squeeze_of_a_split_size_one_dim(dtype=np.float32):
  """The TF program under case 35_153: Squeeze with no squeeze_dims of a (1, 3) value split
  P('b', 'a') on a 4x2 mesh (local blocks (1, 1))."""
  mesh = tg.Mesh(np.arange(8).reshape((4, 2)), ('a', 'b'))
  x = np.random.RandomState(0).standard_normal((5, 1, 3)).astype(dtype)

  def make():
    @tf.function(autograph=False)
    def program(x):
      y = tg.shard(tf.reduce_sum(x, axis=0), mesh, tg.P('b', 'a'))
      return [tf.squeeze(y) * 2.0]

    return program, []

  return mesh, make, [x]


def test_squeeze_of_a_split_size_one_dim():
  fuzz.check(build_squeeze_of_a_split_size_one_dim)
