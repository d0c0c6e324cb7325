"""Random sequences over the same variables, with tf_gspmd and without (#39 point 3).

Partitioned and plain functions, a nested tf.function, eager writes (dense and sparse),
checkpoints saved and restored: drawn in a random order from a fixed seed, run on variables
tf_gspmd splits (one made as shards, one plain tf.Variable it adopts) and on plain twins.
After every operation each result and every variable agree through the oracle: a read of a
split variable anywhere is its current value.
"""

import numpy as np
import pytest
import tensorflow as tf

import tf_gspmd as tg
from tf_gspmd.testing import assert_close

SEEDS = {'tf': (11, 12), 'xla': (13,)}
OPERATIONS = 14


def _values():
  rng = np.random.RandomState(0)
  return rng.randn(8, 6).astype(np.float32), rng.randn(6, 4).astype(np.float32)


class _World:
  """One set of variables and the functions over them (partitioned when `mesh` is given)."""

  def __init__(self, mesh=None, backend='tf'):
    a, b = _values()
    if mesh is None:
      self.a, self.b = tf.Variable(a, name='a'), tf.Variable(b, name='b')
    else:
      self.a = tg.Variable(
        a, tg.NamedSharding(mesh, tg.P('model', None)), name='a', backend=backend
      )
      self.b = tf.Variable(b, name='b')
      tg.shard_variable(self.b, mesh, tg.P(None, 'model'))
    self.checkpoint = tf.train.Checkpoint(a=self.a, b=self.b)
    self.saved = None

    @tf.function
    def nested():
      return tf.reduce_sum(self.a) * 0.01

    def step(x):
      hidden = tf.tanh(tf.matmul(x, self.a))
      out = tf.matmul(hidden, self.b)
      self.a.assign_sub(0.01 * tf.matmul(tf.transpose(x), tf.matmul(out, tf.transpose(self.b))))
      self.b.assign_add(0.01 * tf.matmul(tf.transpose(hidden), out) + nested())
      return tf.reduce_sum(out * out)

    def evaluate(x):
      return tf.reduce_mean(tf.matmul(tf.tanh(tf.matmul(x, self.a)), self.b))

    self.nested = nested
    self.plain_step = tf.function(step)
    self.plain_eval = tf.function(evaluate)
    if mesh is None:
      self.step, self.eval = self.plain_step, self.plain_eval
    else:
      self.step = tg.partition(tf.function(step), mesh, backend=backend)
      self.eval = tg.partition(tf.function(evaluate), mesh, backend=backend)

  def run(self, op: str, x, rng_value):
    if op == 'partitioned step':
      return self.step(x)
    if op == 'partitioned eval':
      return self.eval(x)
    if op == 'plain step':
      return self.plain_step(x)
    if op == 'plain eval':
      return self.plain_eval(x)
    if op == 'nested':
      return self.nested()
    if op == 'assign':
      self.a.assign(self.a * 0.5 + rng_value)
      return self.a.read_value()
    if op == 'scatter':
      rows = tf.IndexedSlices(tf.fill([2, 6], rng_value), tf.constant([1, 6]), [8, 6])
      self.a.scatter_add(rows)
      return self.a.read_value()
    if op == 'save':
      self.saved = self.checkpoint.write(self.directory)
      return tf.constant(0.0)
    if op == 'restore':
      if self.saved is not None:
        self.checkpoint.read(self.saved).assert_consumed()
      return tf.constant(0.0)
    raise ValueError(op)


OPS = (
  'partitioned step',
  'partitioned eval',
  'plain step',
  'plain eval',
  'nested',
  'assign',
  'scatter',
  'save',
  'restore',
)


@pytest.mark.parametrize(
  'backend,seed', [(b, s) for b, seeds in SEEDS.items() for s in seeds], ids=str
)
def test_random_sequences_agree_with_plain_tensorflow(backend, seed, tmp_path):
  mesh = tg.Mesh.create((2, 4), ('data', 'model'))
  ours, theirs = _World(mesh, backend), _World()
  ours.directory, theirs.directory = str(tmp_path / 'ours'), str(tmp_path / 'theirs')
  rng = np.random.RandomState(seed)
  x = rng.randn(8, 8).astype(np.float32)
  order = [OPS[i] for i in rng.randint(0, len(OPS), OPERATIONS)]
  for i, op in enumerate(order):
    value = float(rng.randn())
    what = f'seed {seed}, operation {i} ({op}); sequence {order}'
    assert_close(ours.run(op, x, value), theirs.run(op, x, value), what)
    assert_close(ours.a.numpy(), theirs.a.numpy(), f'a after {what}')
    assert_close(ours.b.numpy(), theirs.b.numpy(), f'b after {what}')
