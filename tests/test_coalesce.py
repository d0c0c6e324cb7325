"""Fewer, larger collectives (graph_rewrite/coalesce.py): pending sums resolved late, kept
partial through linear ops, and fused per group into bucketed all-reduces. Every case runs
partitioned on 8 logical CPUs against the same function unpartitioned, collectives counted."""

import collections

import numpy as np
import pytest
import tensorflow as tf

import tf_gspmd as tg
from tf_gspmd.graph_rewrite import coalesce
from tf_gspmd.testing import assert_close

DATA8 = tg.Mesh.create((8,), ('data',))


def all_reduces(pf, axes=('data',)):
  return [c for c in pf.collectives() if c['kind'] == 'all_reduce' and tuple(c['axes']) == axes]


def mlp_step(rng):
  """A 2-layer MLP with SGD: 4 weight gradients and the loss, each a pending sum over 'data'."""
  shapes = {'w1': (16, 32), 'b1': (32,), 'w2': (32, 8), 'b2': (8,)}
  params = {
    n: tf.Variable(rng.randn(*s).astype(np.float32) * 0.2, name=n) for n, s in shapes.items()
  }

  @tf.function
  def step(x, y):
    with tf.GradientTape() as tape:
      h = tf.nn.relu(x @ params['w1'] + params['b1'])
      loss = tf.reduce_mean(tf.square(h @ params['w2'] + params['b2'] - y))
    grads = tape.gradient(loss, params)
    for n, v in params.items():
      v.assign_sub(0.1 * grads[n])
    return loss

  return step, params


def run_mlp(partitioned: bool):
  rng = np.random.RandomState(0)
  step, params = mlp_step(rng)
  x = rng.randn(64, 16).astype(np.float32)
  y = rng.randn(64, 8).astype(np.float32)
  fn = (
    tg.partition(step, DATA8, in_shardings=[tg.P('data', None), tg.P('data', None)])
    if partitioned
    else step
  )
  losses = np.array([fn(x, y).numpy() for _ in range(2)])  # float32, one per step
  return fn, losses, {n: v.numpy() for n, v in params.items()}


def test_mlp_gradient_all_reduces_become_one_bucket(monkeypatch):
  _, ref_losses, ref_params = run_mlp(False)
  monkeypatch.setenv('TF_GSPMD_COALESCE', '0')
  separate, _, _ = run_mlp(True)
  monkeypatch.setenv('TF_GSPMD_COALESCE', '1')
  fused, losses, got = run_mlp(True)
  assert len(all_reduces(separate)) == 5  # 4 gradients and the loss, one each
  (bucket,) = all_reduces(fused)
  assert bucket['fused'] == 5
  assert bucket['bytes'] == sum(r['bytes'] for r in all_reduces(separate))
  assert len(fused.collectives()) == 1
  assert_close(losses, ref_losses, name='losses')
  assert_close(got, ref_params, name='params')


def test_buckets_respect_their_size_limit(monkeypatch):
  monkeypatch.setattr(coalesce, 'BUCKET_BYTES', 1200)  # w1 (16x32 f32 = 2048 B) alone
  _, ref_losses, ref_params = run_mlp(False)
  pf, losses, got = run_mlp(True)
  reduces = all_reduces(pf)
  assert 1 < len(reduces) < 5
  assert all(r['bytes'] <= 1200 for r in reduces if r.get('fused', 1) > 1)
  assert sum(r.get('fused', 1) for r in reduces) == 5
  assert_close(losses, ref_losses, name='losses')
  assert_close(got, ref_params, name='params')


def test_linear_ops_keep_sums_pending_and_products_do_not():
  x = np.random.RandomState(1).randn(64, 12).astype(np.float32)

  def f(x):
    a = tf.reduce_sum(x, axis=0)  # pending sums over 'data'
    b = tf.reduce_sum(x * 3.0, axis=0)
    c = tf.reduce_sum(x * x, axis=0)
    d = tf.reduce_sum(x + 1.0, axis=0)
    e = tf.reduce_sum(x - 2.0, axis=0)
    linear = tf.reshape(-(a - b) * 2.0 / 4.0 + tf.add_n([c, d, 0.5 * e]), [3, 4])
    product = tf.reduce_sum(x, axis=0) * tf.reduce_sum(x * 2.0, axis=0)  # not linear
    return linear, product

  pf = tg.partition(tf.function(f), DATA8, in_shardings=[tg.P('data', None)])
  assert_close(
    dict(zip(('linear', 'product'), pf(x))), dict(zip(('linear', 'product'), f(tf.constant(x))))
  )
  linear_types = {r.op for r in pf.op_records() if r.how == 'linear on pending sums'}
  assert linear_types == {'Sub', 'Neg', 'Mul', 'RealDiv', 'AddN', 'AddV2', 'Reshape'}
  # The product's two factors are resolved before it (not linear in them), and the whole
  # linear combination, still one pending sum, goes with them: one all-reduce of 3.
  (bucket,) = all_reduces(pf)
  assert bucket['fused'] == 3 and bucket['op_type'] == 'Mul', bucket['why']
  assert bucket['shape'] == (12 + 12 + 12,)


def test_a_collective_that_depends_on_another_is_not_fused_with_it():
  x = np.random.RandomState(2).randn(64, 12).astype(np.float32)

  def f(x):
    first = tf.reduce_sum(x, axis=0, name='first')  # pending
    gate = tf.nn.relu(first)  # needs it reduced
    second = tf.reduce_sum(x * gate[tf.newaxis], axis=0, name='second')  # depends on it
    return second

  pf = tg.partition(tf.function(f), DATA8, in_shardings=[tg.P('data', None)])
  assert_close(pf(x), f(tf.constant(x)), name='second')
  reduces = all_reduces(pf)
  assert len(reduces) == 2
  assert all('fused' not in r for r in reduces)
  # The first is resolved where Relu needs it, the second at the end of the program.
  assert [r['op_type'] for r in reduces] == ['Relu', 'outputs']


@pytest.mark.slow  # builds a pipelined step (make test runs it)
def test_pipeline_data_all_reduces_are_reduced_once():
  mesh = tg.Mesh.create((2, 4), ('stage', 'data'))
  stages, microbatches, width, hidden = 2, 4, 8, 16

  def stage(p, h):
    return h + tf.matmul(tf.nn.gelu(tf.matmul(h, p['w_in']) + p['b_in']), p['w_out'])

  def make(piped):
    rng = np.random.RandomState(0)
    params = {
      'w_in': tf.Variable(rng.randn(stages, width, hidden).astype(np.float32) * 0.1),
      'b_in': tf.Variable(np.zeros([stages, hidden], np.float32)),
      'w_out': tf.Variable(rng.randn(stages, hidden, width).astype(np.float32) * 0.1),
    }
    if piped:
      for v in params.values():
        tg.shard_variable(v, mesh, tg.P('stage', *([None] * (v.shape.rank - 1))))

    @tf.function
    def step(x, y):
      x = tg.shard(x, mesh, tg.P('data', None))
      with tf.GradientTape() as tape:
        if piped:
          h = tg.pipeline(stage, params, x, mesh, num_microbatches=microbatches)
        else:
          h = x
          for s in range(stages):
            h = stage({n: v[s] for n, v in params.items()}, h)
        loss = tf.reduce_mean(tf.square(h - y))
      grads = tape.gradient(loss, params)
      for n, v in params.items():
        v.assign_sub(0.1 * grads[n])
      return loss

    return step, params

  rng = np.random.RandomState(1)
  x = rng.randn(32, width).astype(np.float32)
  y = rng.randn(32, width).astype(np.float32)
  piped, params = make(True)
  sequential, ref = make(False)
  pf = tg.partition(piped, mesh)
  assert_close(pf(x, y), sequential(x, y), name='loss')
  assert_close(
    {n: v.numpy() for n, v in params.items()}, {n: v.numpy() for n, v in ref.items()}, name='params'
  )
  kinds = collections.Counter((c['kind'], tuple(c['axes'])) for c in pf.collectives())
  # Without coalescing: one per weight per iteration (3 x 5) and the loss.
  assert kinds[('all_reduce', ('data',))] <= 4, kinds


def test_transformer_weight_gradients_share_one_bucket():
  """Weight gradients whose first use is inside the backward pass (Keras' reshape of an
  attention kernel's gradient) stay pending: the update math that reads them is emitted
  after the rest of the step, so every dense weight gradient joins one 'data' bucket."""
  import os
  import sys

  sys.path.insert(0, os.path.join(os.path.dirname(__file__), '..', 'examples', 'keras'))
  import transformer

  mesh = tg.Mesh.create((2, 4), ('data', 'model'))
  model, optimizer = transformer.build(seed=0, layers=1)
  ref_model, ref_optimizer = transformer.build(seed=0, layers=1)
  transformer.layout(mesh).apply(model)
  pf = tg.partition(transformer.train_step(model, optimizer, mesh), mesh)
  reference = transformer.train_step(ref_model, ref_optimizer)
  for seed in range(2):
    tokens, labels = transformer.batch(seed)
    assert_close(pf(tokens, labels), reference(tokens, labels), name=f'loss {seed}')
  # Softmax ignores key/bias: its gradient is rounding noise, which Adam scales to +-lr steps
  # in both runs alike, so its value is no comparison of the two programs.
  pairs = [
    (got, want)
    for got, want in zip(model.trainable_variables, ref_model.trainable_variables)
    if 'key/bias' not in got.path
  ]
  assert_close([g for g, _ in pairs], [w for _, w in pairs], name='weights')
  data = all_reduces(pf)
  buckets = [r for r in data if r.get('fused', 1) > 1]
  dense = [v for v in model.trainable_variables if 'embed' not in v.path]
  assert len(buckets) == 1 and buckets[0]['fused'] == len(dense), [r.get('why') for r in data]
  # Besides it: the loss, and the embedding's two row sums inside Adam's sparse update.
  assert len(data) == 4, [r.get('why') for r in data]


def test_a_sum_over_unsharded_dims_keeps_the_sum_pending():
  x = np.random.RandomState(3).randn(64, 4, 3).astype(np.float32)

  def f(x):
    rows = tf.reduce_sum(tf.reduce_sum(x, axis=0), axis=1)  # a pending [4, 3], summed: [4]
    kept = tf.reduce_sum(tf.reduce_sum(x * 2.0, axis=0), axis=[0], keepdims=True)  # [1, 3]
    return tf.nn.relu(rows), tf.nn.relu(kept)

  pf = tg.partition(tf.function(f), DATA8, in_shardings=[tg.P('data', None, None)])
  assert_close(dict(zip(('rows', 'kept'), pf(x))), dict(zip(('rows', 'kept'), f(tf.constant(x)))))
  linear = [r for r in pf.op_records() if r.how == 'linear on pending sums' and r.op == 'Sum']
  assert len(linear) == 2, linear
  (bucket,) = all_reduces(pf)
  assert bucket['fused'] == 2 and bucket['shape'] == (4 + 3,), bucket['why']
