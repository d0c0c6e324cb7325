"""End-to-end: partitioned tf.functions on 8 logical CPUs equal the unpartitioned run."""

import numpy as np
import pytest
import tensorflow as tf

import tf_gspmd as tg
from tf_gspmd.partitioned import partition
from tf_gspmd.testing import assert_close

from helpers import loop_training, randn, variable_mlp


def kinds(pf):
  return sorted((r['kind'], r['axes']) for r in pf.collectives())


def test_megatron_mlp_on_2x4_mesh():
  mesh = tg.Mesh.create((2, 4), ('data', 'model'))
  w1, w2 = tf.Variable(randn(0, 16, 32)), tf.Variable(randn(1, 32, 8))
  tg.shard_variable(w1, mesh, tg.P(None, 'model'))
  tg.shard_variable(w2, mesh, tg.P('model', None))

  @tf.function
  def f(x):
    x = tg.shard(x, mesh, tg.P('data', None))
    h = tf.nn.relu(tf.matmul(x, w1))
    y = tf.matmul(h, w2)
    return tf.reduce_sum(y * y), y

  x = randn(2, 10, 16)
  pf = partition(f, mesh)
  for name, got, want in zip(('loss', 'y'), pf(x), f(x)):
    assert_close(got, want, name=name)
  # One all-reduce resolves the row-parallel matmul, one the batch sum: nothing else moves.
  assert kinds(pf) == [('all_reduce', ('data',)), ('all_reduce', ('model',))]


def _linear_model(seed):
  return tf.Variable(randn(seed, 16, 4)), tf.Variable(np.zeros(4, np.float32))


def _sgd_step(mesh, w, b):
  @tf.function
  def step(x, y):
    x = tg.shard(x, mesh, tg.P('data', None))
    with tf.GradientTape() as tape:
      logits = tf.matmul(x, w) + b
      loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits))
    gw, gb = tape.gradient(loss, [w, b])
    w.assign_sub(0.1 * gw)
    b.assign_sub(0.1 * gb)
    return loss

  return step


@pytest.mark.parametrize('batch,devices', [(16, 8), (10, 4), (7, 8)])
def test_data_parallel_training_step_uneven_batches(batch, devices):
  mesh = tg.Mesh.create((devices,), ('data',))
  w, b = _linear_model(0)
  w_ref, b_ref = _linear_model(0)
  step = partition(_sgd_step(mesh, w, b), mesh)
  reference = _sgd_step(mesh, w_ref, b_ref)
  x = randn(2, batch, 16)
  y = np.random.RandomState(3).randint(0, 4, size=batch).astype(np.int32)
  for k in range(3):
    assert_close(step(x, y), reference(x, y), name=f'loss {k}')
  assert_close({'w': w.numpy(), 'b': b.numpy()}, {'w': w_ref.numpy(), 'b': b_ref.numpy()})
  if batch >= devices:
    # The gradient all-reduces appear without being written; nothing is gathered.
    assert {k for k, _ in kinds(step)} == {'all_reduce'}
    # The loss mean, the bias and the kernel gradients: three sums in one bucket.
    assert len(step.collectives()) == 1 and step.collectives()[0]['fused'] == 3


def test_training_loop_inside_one_function_keeps_collectives_in_the_loop():
  mesh = tg.Mesh.create((2, 4), ('data', 'model'))
  w, w_ref = variable_mlp(0), variable_mlp(0)
  tg.shard_variable(w[0], mesh, tg.P(None, 'model'))
  tg.shard_variable(w[1], mesh, tg.P('model', None))
  train = partition(loop_training(mesh, *w, annotate=True), mesh)
  reference = loop_training(mesh, *w_ref, annotate=False)
  x, y = randn(2, 10, 16), np.random.RandomState(3).randint(0, 4, 10).astype(np.int32)
  assert_close(train(x, y, tf.constant(5)), reference(x, y, tf.constant(5)), name='loss')
  assert_close([a.numpy() for a in w], [b.numpy() for b in w_ref], name='[w1, w2]')
  in_loop = [
    r
    for r in train.collectives()
    if r['graph'] != train.get_program(x, y, tf.constant(5)).program.main.name
  ]
  # Three sums over 'data' (in one bucket) and one over 'model', all in the loop body.
  assert sorted((r['kind'], r['axes'], r.get('fused', 1)) for r in in_loop) == [
    ('all_reduce', ('data',), 3),
    ('all_reduce', ('model',), 1),
  ]


def test_cond_branches_partitioned_alike():
  mesh = tg.Mesh.create((8,), ('x',))

  @tf.function
  def f(a, flag):
    a = tg.shard(a, mesh, tg.P('x', None))
    return tf.cond(flag, lambda: tf.reduce_sum(a * 2.0, axis=0), lambda: tf.reduce_max(a, axis=0))

  pf = partition(f, mesh)
  a = randn(5, 12, 3)
  for flag in (True, False):
    assert_close(pf(a, tf.constant(flag)), f(a, tf.constant(flag)), name=f'flag={flag}')


def test_decorator_form_with_in_and_out_shardings():
  mesh = tg.Mesh.create((8,), ('x',))
  rows = tg.NamedSharding(mesh, tg.P('x', None))

  @partition(mesh=mesh, in_shardings=[rows], out_shardings=[rows])
  @tf.function
  def double_rows(a):
    return a * 2.0

  a = randn(0, 12, 5)
  assert_close(double_rows(a), a * 2.0)
  assert double_rows.collectives() == []  # elementwise on shards laid out alike
  program = double_rows.get_program(a)
  assert program.arg_shardings == [rows]


def test_switch_case_branches_partitioned_alike():
  mesh = tg.Mesh.create((4,), ('x',))

  @tf.function
  def f(a, i):
    a = tg.shard(a, mesh, tg.P('x', None))
    return tf.switch_case(
      i, [lambda: tf.reduce_sum(a, 0), lambda: tf.reduce_max(a, 0), lambda: a[0] * 3.0]
    )

  pf = partition(f, mesh)
  a = randn(1, 10, 3)  # 10 rows over 4: the max must not see padding
  for k in range(3):
    assert_close(pf(a, tf.constant(k)), f(a, tf.constant(k)), name=f'branch {k}')


@pytest.mark.parametrize('spec', [tg.P('data', None, None), tg.P(None, 'model', 'data')])
def test_matrix_band_part_keeps_the_band_of_whole_matrices(spec):
  """MatrixBandPart needs its two matrix dims whole (which elements it keeps depends on their
  global row and column); a batch split passes through."""
  mesh = tg.Mesh.create((2, 4), ('data', 'model'))

  @tf.function
  def band(x):
    return tf.linalg.band_part(tg.shard(x, mesh, spec), 2, 1) * 3.0

  x = randn(0, 6, 10, 7)
  assert_close(partition(band, mesh)(x), band(x), name='band')
