"""Our propagated shardings against XLA's, on the same computations written in JAX.

The JAX side (tests/jax_reference/propagation_cases.py) runs in a Python that
has jax: $TF_GSPMD_JAX_PYTHON, else this interpreter if it can import jax; the
test is skipped when neither can. Differences we accept are listed in
docs/propagation.md and in KNOWN_DIFFERENCES below, which the test checks too.
"""

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import tensorflow as tf

import tf_gspmd
from tf_gspmd import Mesh, P
from tf_gspmd.propagation import propagate

MESH = Mesh.create((2, 4), ('data', 'model'))
SCRIPT = os.path.join(
  os.path.dirname(os.path.abspath(__file__)), 'jax_reference', 'propagation_cases.py'
)
# (case, tensor) -> (our spec, XLA's spec, why). Keep in sync with docs/propagation.md.
KNOWN_DIFFERENCES = {
  ('concat_softmax_reverse', 'concat'): (
    [['data'], []],
    [['data'], ['model']],
    'the concatenated dim is need_replication in our rule; XLA keeps it sharded and '
    'pays a halo-like exchange in its partitioner',
  ),
  ('concat_softmax_reverse', 'softmax'): (
    [[], []],
    [[], ['model']],
    'TF Softmax is one op whose class dim must be whole; XLA sees the max/exp/sum '
    'decomposition and keeps the dim sharded with all-reduces',
  ),
}


def _jax_python():
  python = os.environ.get('TF_GSPMD_JAX_PYTHON')
  if python:
    return python
  if importlib.util.find_spec('jax') is not None:
    return sys.executable
  return None


@pytest.fixture(scope='module')
def xla_shardings():
  python = _jax_python()
  if python is None:
    pytest.skip('no Python with jax: set TF_GSPMD_JAX_PYTHON (see docs/propagation.md)')
  env = dict(os.environ, XLA_FLAGS='--xla_force_host_platform_device_count=8', JAX_PLATFORMS='cpu')
  out = subprocess.run(
    [python, SCRIPT], capture_output=True, text=True, env=env, timeout=300, check=False
  )
  assert out.returncode == 0, out.stderr[-3000:]
  return json.loads(out.stdout)


def shard(x, *spec):
  return tf_gspmd.shard(x, MESH, P(*spec))


def mlp_forward():
  @tf.function
  def f(x, w1, w2):
    x, w1, w2 = shard(x, 'data', None), shard(w1, None, 'model'), shard(w2, 'model', None)
    h = tf.matmul(x, w1, name='hidden')
    r = tf.nn.relu(h, name='relu')
    return tf.matmul(r, w2, name='out')

  return f, [tf.zeros((8, 16)), tf.zeros((16, 32)), tf.zeros((32, 16))]


def mlp_gradients():
  @tf.function
  def f(x, w1, w2):
    x, w1, w2 = shard(x, 'data', None), shard(w1, None, 'model'), shard(w2, 'model', None)
    with tf.GradientTape() as tape:
      tape.watch([w1, w2])
      loss = tf.reduce_mean(tf.square(tf.matmul(tf.nn.relu(tf.matmul(x, w1)), w2)))
    g1, g2 = tape.gradient(loss, [w1, w2])
    return tf.identity(g1, name='grad_w1'), tf.identity(g2, name='grad_w2')

  return f, [tf.zeros((8, 16)), tf.zeros((16, 32)), tf.zeros((32, 16))]


def conv_spatial():
  @tf.function
  def f(x, k):
    x, k = shard(x, None, 'data', None, None), shard(k, None, None, None, None)
    y = tf.nn.conv2d(x, k, 1, 'SAME', name='conv')
    mean = tf.reduce_mean(y, axis=[0, 1, 2], keepdims=True)
    n = tf.multiply(y - mean, 2.0, name='norm')
    return tf.nn.max_pool2d(tf.nn.relu(n), 2, 2, 'VALID', name='pool')

  return f, [tf.zeros((4, 16, 16, 3)), tf.zeros((3, 3, 3, 8))]


def while_loop():
  @tf.function
  def f(x, w):
    x, w = shard(x, 'data', None), shard(w, None, None)
    _, y = tf.while_loop(
      lambda i, x: i < 3, lambda i, x: (i + 1, tf.tanh(tf.matmul(x, w))), (tf.constant(0), x)
    )
    y = tf.identity(y, name='loop')
    return tf.multiply(y, 2.0, name='after')

  return f, [tf.zeros((8, 16)), tf.zeros((16, 16))]


def bias_and_reshape():
  @tf.function
  def f(x, b, z):
    x, b, z = shard(x, 'data', None), shard(b, 'model'), shard(z, 'data', None, 'model')
    return (
      tf.add(x, b, name='biased'),
      tf.reshape(z, (32, 16), name='flat'),
      tf.reduce_sum(z, axis=1, name='summed'),
    )

  return f, [tf.zeros((8, 16)), tf.zeros((16,)), tf.zeros((8, 4, 16))]


def backward_from_constraint():
  @tf.function
  def f(x, w):
    h = tf.matmul(x, w, name='hidden')
    c = shard(h, 'data', 'model')
    return tf.multiply(c, 2.0, name='scaled')

  return f, [tf.zeros((8, 16)), tf.zeros((16, 32))]


def concat_softmax_reverse():
  @tf.function
  def f(x, y, z):
    x, y, z = shard(x, 'data', 'model'), shard(y, 'data', None), shard(z, None, 'model')
    return (
      tf.concat([x, y], axis=1, name='concat'),
      tf.reverse(z, [0], name='reverse'),
      tf.nn.softmax(z, axis=1, name='softmax'),
    )

  return f, [tf.zeros((8, 16)), tf.zeros((8, 8)), tf.zeros((8, 16))]


CASES = {
  f.__name__: f
  for f in (
    mlp_forward,
    mlp_gradients,
    conv_spatial,
    while_loop,
    bias_and_reshape,
    backward_from_constraint,
    concat_softmax_reverse,
  )
}


def _as_lists(sharding):
  spec = sharding.spec
  return [list(spec.axes_of(d)) for d in range(len(spec))]


@pytest.mark.parametrize('case', sorted(CASES))
def test_matches_xla_propagation(case, xla_shardings):
  fn, args = CASES[case]()
  propagation = propagate(fn, *args, mesh=MESH)
  expected = xla_shardings[case]
  ours = {name: _as_lists(propagation.sharding(name + ':0')) for name in expected}
  for name, spec in expected.items():
    if (case, name) in KNOWN_DIFFERENCES:
      our_spec, xla_spec, _ = KNOWN_DIFFERENCES[(case, name)]
      assert (ours[name], spec) == (our_spec, xla_spec), (
        case,
        name,
        'documented difference changed: update docs/propagation.md',
      )
      continue
    assert ours[name] == spec, (case, name, ours[name], spec, propagation.provenance(name + ':0'))
