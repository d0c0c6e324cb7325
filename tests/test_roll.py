"""Roll along split dims moves shards and shard edges with permutes, never a gather.

Each case runs partitioned on 8 logical CPUs against the unpartitioned function,
with its collectives counted: a shift by whole shards is one cyclic permute, any
other shift two (the edge rows, then the rest); a dim split unevenly is kept whole
(Roll's rule chosen with that factor whole), and the gradient of a roll is the
roll back: one permute the other way.
"""

import collections

import pytest
import tensorflow as tf

import tf_gspmd as tg
from tf_gspmd.testing import assert_close

from helpers import randn

MESH = tg.Mesh.create((4, 2), ('stage', 'data'))


def counts(pf):
  return collections.Counter((c['kind'], tuple(c['axes'])) for c in pf.collectives())


def run(fn, *args):
  pf = tg.partition(fn, MESH)
  assert_close(pf(*args), fn(*args), name='rolled')
  return counts(pf)


@pytest.mark.parametrize(
  'shift, permutes', [(1, 1), (-2, 1), (4, 1), (8, 0), (3, 2), (-5, 2), (7, 1)]
)
def test_roll_of_a_split_dim(shift, permutes):
  # 8 rows, 2 per stage: a shift by whole shards is one permute; 3 or -5 (= 3) are an edge row
  # from two stages back and a row from one stage back; 7 (= -1) takes a row of its own shard.
  @tf.function
  def f(x):
    x = tg.shard(x, MESH, tg.P('stage', 'data'))
    return tf.roll(x, shift, axis=0) + 1.0

  got = run(f, randn(0, 8, 6))  # dim 0: 2 rows on each of the 4 stages
  assert got == ({('permute', ('stage',)): permutes} if permutes else {})


def test_roll_over_two_mesh_axes_and_two_dims():
  @tf.function
  def f(x):
    x = tg.shard(x, MESH, tg.P(('stage', 'data'), None))
    return tf.roll(x, [3, -1], axis=[0, 1])

  assert run(f, randn(1, 16, 5)) == {('permute', ('stage', 'data')): 2}


def test_an_unevenly_split_rolled_dim_is_kept_whole():
  @tf.function
  def f(x):
    x = tg.shard(x, MESH, tg.P('stage', None))
    return tf.roll(x, 2, axis=0)

  got = run(f, randn(2, 6, 3))  # 6 rows over 4: shards of 2, 2, 2, 0
  assert ('permute', ('stage',)) not in got


def test_gradient_of_a_roll_is_the_roll_back():
  w = tf.Variable(randn(3, 8, 6))
  tg.shard_variable(w, MESH, tg.P('stage', 'data'))
  w_ref = tf.Variable(w.numpy())

  def make(var):
    @tf.function
    def step(x):
      with tf.GradientTape() as tape:
        loss = tf.reduce_sum(tf.roll(var * x, 2, axis=0) * x)
      var.assign_sub(0.1 * tape.gradient(loss, var))
      return loss

    return step

  x = randn(4, 8, 6)
  pf = tg.partition(make(w), MESH)
  ref = make(w_ref)
  for k in range(2):
    assert_close(pf(x), ref(x), name=f'loss {k}')
  assert_close(w.numpy(), w_ref.numpy(), name='w')
  whys = [c['why'] for c in pf.collectives() if c['kind'] == 'permute']
  assert len(whys) == 2 and any('by 2' in w for w in whys) and any('by -2' in w for w in whys)


def test_shifted_windows_over_a_height_split_image():
  # Swin-style: roll the image by half a window over H and W; H split over 'stage'.
  @tf.function
  def f(img):
    img = tg.shard(img, MESH, tg.P('data', 'stage', None, None))
    return tf.nn.relu(tf.roll(img, [-2, -2], axis=[1, 2]))

  got = run(f, randn(5, 2, 16, 8, 3))  # H: 4 rows per stage; 2 own rows, 2 from the next
  assert got == {('permute', ('stage',)): 1}
