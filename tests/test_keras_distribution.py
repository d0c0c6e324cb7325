"""Keras 3's own keras.distribution API on the TF backend (tf_gspmd.keras), against plain Keras.

Each model trains partitioned under a distribution and, beside it, the same
model (same seed) with no distribution: histories, evaluations, predictions
and weights agree by the numerical oracle (tf_gspmd.testing: normwise relative
error per tensor <= 1e-5 in float32), and the collectives of the partitioned
training step are counted.
"""

import pathlib
import re

import keras
import numpy as np
import pytest

import tf_gspmd as tg
from tf_gspmd.keras import distribution_lib, hooks
from tf_gspmd.testing import as_float32, assert_close, bound

import helpers
from helpers import (
  FIT,
  X,
  Y,
  check_model_parallel_example,
  guide_distribution,
  guide_model,
  run_python_output,
  step_programs,
)

ROOT = pathlib.Path(__file__).resolve().parent.parent
# Read when pytest imports this file: importing tf_gspmd must leave Keras as it was.
BACKEND_HAD_DISTRIBUTE_TENSOR_AT_IMPORT = hasattr(hooks.backend_module(), 'distribute_tensor')
ENABLED_AT_IMPORT = tg.keras.is_enabled()

FIT_SHORT = dict(batch_size=16, epochs=1, shuffle=False, verbose=0)


pytestmark = pytest.mark.usefixtures('keras_enabled')  # conftest.py


def assert_same_training(model, reference, distribution):
  """fit (with validation) and evaluate under `distribution` equal plain Keras."""
  with distribution.scope():
    got = model.fit(X, Y, **FIT).history
    got_eval = model.evaluate(X, Y, batch_size=16, verbose=0)
  want, want_eval = (
    reference.fit(X, Y, **FIT).history,
    reference.evaluate(X, Y, batch_size=16, verbose=0),
  )
  assert len(want['loss']) == 2 and 'val_loss' in want
  assert_close(as_float32(got), as_float32(want), 'history')
  assert_close(as_float32(got_eval), as_float32(want_eval), 'evaluate')
  assert_close(model.weights, reference.weights, 'weights')


def test_importing_tf_gspmd_leaves_keras_alone():
  assert not ENABLED_AT_IMPORT and not BACKEND_HAD_DISTRIBUTE_TENSOR_AT_IMPORT


@pytest.mark.slow  # a page or a fresh interpreter: `make test` runs it, the edit loop not
def test_model_parallel_guide_code_matches_plain_keras():
  distribution = guide_distribution()
  reference = guide_model()
  keras.distribution.set_distribution(distribution)
  model = guide_model()
  keras.distribution.set_distribution(None)
  assert_same_training(model, reference, distribution)

  got = tg.keras.shard_layouts(model)
  assert got['d1/kernel'] == (tg.P(None, 'model'), (16, 8))
  assert got['d1/bias'] == (tg.P('model'), (8,))
  assert got['e1/kernel'] == (tg.P('model', None), (8, 24))
  assert got['d2/kernel'] == (tg.P(None, None), (24, 4))  # no rule matches: replicated
  slots = [k for k in got if 'd1_kernel' in k]  # Adam's slots inherit the layout
  assert len(slots) == 2 and all(got[k][0] == tg.P(None, 'model') for k in slots)

  (train,) = step_programs(model.train_function)
  kinds = [(c['kind'], c['axes']) for c in train.collectives()]
  # e1's contraction over the split hidden dim: one all-reduce over 'model' (and its gradient's)
  assert ('all_reduce', ('model',)) in kinds
  assert any(axes == ('data',) for _, axes in kinds)  # gradients summed over the batch
  assert all(set(axes) <= {'data', 'model'} for _, axes in kinds)

  with distribution.scope():
    predicted = model.predict(X, batch_size=16, verbose=0)
    got_batch = model.train_on_batch(X[:16], Y[:16])
  assert_close(predicted, reference.predict(X, batch_size=16, verbose=0), 'predict')
  assert_close(
    as_float32(got_batch), as_float32(reference.train_on_batch(X[:16], Y[:16])), 'train_on_batch'
  )
  assert_close(model.weights, reference.weights, 'weights')


@pytest.mark.slow  # a Keras fit and its twin (the edit loop: test_keras_fit)
def test_data_parallel_replicates_weights_and_splits_the_batch():
  distribution = keras.distribution.DataParallel()  # all 8 devices, axis 'batch'
  reference = guide_model()
  with distribution.scope():
    model = guide_model()
  assert_same_training(model, reference, distribution)
  got = tg.keras.shard_layouts(model)
  assert all(spec == tg.P(*([None] * len(spec))) for spec, _ in got.values()), got
  (train,) = step_programs(model.train_function)
  axes = {c['axes'] for c in train.collectives()}
  assert axes == {('batch',)}, axes  # nothing over any model axis
  # the loss, the metric and the 6 gradients are summed over the batch
  # (sums fused into one bucket count one each: graph_rewrite/coalesce.py)
  assert sum(c.get('fused', 1) for c in train.collectives() if c['kind'] == 'all_reduce') >= 7


@pytest.mark.slow  # a whole Keras fit or several (make test-fast leaves it to CI)
def test_scope_and_set_distribution_agree_and_the_model_keeps_its_distribution():
  def distribution():
    mesh = keras.distribution.DeviceMesh((2, 4), ['data', 'model'])
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map['.*d1.*kernel'] = (None, 'model')
    layout_map['.*d2.*kernel'] = ('model', None)
    return keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name='data')

  scoped = distribution()
  with scoped.scope():  # built, compiled, fitted inside
    by_scope = guide_model()
    by_scope.fit(X, Y, **FIT_SHORT)
  assert keras.distribution.distribution() is None
  keras.distribution.set_distribution(distribution())
  by_global = guide_model()
  by_global.fit(X, Y, **FIT_SHORT)
  keras.distribution.set_distribution(None)
  assert_close(by_scope.weights, by_global.weights, 'weights')
  # Outside the scope the model still runs under the distribution its variables were made under.
  assert tg.keras.distribution_of(by_scope) is scoped
  reference = guide_model()
  reference.fit(X, Y, **FIT_SHORT)
  assert_close(by_scope.weights, reference.weights, 'weights')
  launches = by_scope._tf_gspmd_launcher.launches
  assert_close(
    as_float32(by_scope.train_on_batch(X[:16], Y[:16])),  # the step compiled in fit
    as_float32(reference.train_on_batch(X[:16], Y[:16])),
    'train_on_batch',
  )
  assert by_scope._tf_gspmd_launcher.launches == launches + 1
  assert tg.keras.shard_layouts(by_scope)['d1/kernel'][0] == tg.P(None, 'model')


class Hidden(keras.layers.Layer):
  """A layer that lays out its activation itself with keras.distribution.distribute_tensor."""

  def build(self, shape):
    self.w = self.add_weight(shape=(shape[-1], 32), name='w')

  def call(self, x):
    h = keras.ops.matmul(x, self.w)
    return keras.distribution.distribute_tensor(
      h, keras.distribution.TensorLayout(('data', 'model'))
    )


def hidden_model():
  keras.utils.set_random_seed(0)
  inputs = keras.Input((16,))
  y = keras.layers.Dense(4, name='d2')(keras.ops.relu(Hidden(name='hidden')(inputs)))
  model = keras.Model(inputs, y)
  model.compile(optimizer='sgd', loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  return model


def test_distribute_tensor_in_a_layer_lays_out_the_activation():
  mesh = keras.distribution.DeviceMesh((2, 4), ['data', 'model'])
  distribution = keras.distribution.ModelParallel(
    layout_map=keras.distribution.LayoutMap(mesh), batch_dim_name='data'
  )
  reference = hidden_model()
  with distribution.scope():
    model = hidden_model()
  assert_same_training(model, reference, distribution)
  (train,) = step_programs(model.train_function)
  explained = train.explain()
  # The activation's annotation is honoured: the matmul producing it is split on both axes.
  assert re.search(
    r"^\S*hidden\S*/XlaSharding +XlaSharding +0 +P\('data', 'model'\) +annotation", explained, re.M
  ), explained
  assert re.search(r"^\S*hidden\S*/MatMul +MatMul +0 +P\('data', 'model'\)", explained, re.M)
  assert ('all_reduce', ('model',)) in [(c['kind'], c['axes']) for c in train.collectives()]


def test_a_layout_of_the_wrong_rank_is_refused_by_name():
  mesh = keras.distribution.DeviceMesh((2, 4), ['data', 'model'])
  layout_map = keras.distribution.LayoutMap(mesh)
  layout_map['d1/kernel'] = ('model',)
  with keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name='data').scope():
    with pytest.raises(ValueError, match=r'd1/kernel.*\(16, 32\).*rank 2'):
      guide_model()


def test_disable_restores_keras_own_behaviour():
  module = hooks.backend_module()
  assert module.distribute_tensor is distribution_lib.distribute_tensor
  tg.keras.disable()
  assert not tg.keras.is_enabled() and not hasattr(module, 'distribute_tensor')
  assert module._to_backend_mesh.__module__ == module.__name__  # Keras' DTensor prototype again
  from keras.src.backend.common.variables import Variable
  from keras.src.backend.tensorflow.trainer import TensorFlowTrainer

  for function in (TensorFlowTrainer.fit, TensorFlowTrainer.predict, Variable.__init__):
    assert 'tf_gspmd' not in function.__code__.co_filename
  with keras.distribution.DataParallel().scope():  # Keras' own TF path: no tf_gspmd
    model = guide_model()
    model.fit(X, Y, batch_size=16, epochs=1, verbose=0)
  assert '_tf_gspmd_store' not in model.__dict__
  assert getattr(model.weights[0], '_layout', None) is None
  tg.keras.enable()
  assert module.distribute_tensor is distribution_lib.distribute_tensor


@pytest.mark.slow  # a page or a fresh interpreter: `make test` runs it, the edit loop not
def test_example_trains_model_parallel_with_keras_progress_bar(tmp_path):
  check_model_parallel_example(tmp_path)


@pytest.mark.slow  # a page or a fresh interpreter: `make test` runs it, the edit loop not
def test_readme_keras_distribution_section_runs(tmp_path):
  readme = (ROOT / 'docs' / 'keras.md').read_text()
  section = readme.split("## Keras 3's keras.distribution on TF", 1)[1]
  code = re.search(r'```python\n(.*?)```', section, re.S).group(1)
  out = run_python_output(code, tmp_path)
  assert re.search(r"^d1/kernel P\(None, 'model'\) \(784, 50\)$", out, re.M), out
  # The page prints the oracle's measure (tf_gspmd.testing.relative_error), worst weight.
  error = re.search(r'^max relative error to plain Keras: (\S+)$', out, re.M)
  assert error and float(error.group(1)) <= bound(np.float32), out


def test_column_split_kernels_take_their_layout_into_the_optimizer_without_all_to_alls():
  """Dense kernels all split by columns (bench/memory.py's model): each layer's input is
  all-gathered (a small activation), and every weight gradient is made in its kernel's layout.
  Before, Keras' optimizer IdentityN was not a pass-through op, the weight-gradient dots chose
  a row split first, and half the gradients were all-to-all'd at the IdentityN (a weight-sized
  exchange, and those gradients kept alive to the end of the step)."""
  devices = keras.distribution.list_devices()
  mesh = keras.distribution.DeviceMesh((1, 8), ['batch', 'model'], devices)
  layout_map = keras.distribution.LayoutMap(mesh)
  layout_map[r'.*/d\d+/kernel'] = (None, 'model')
  distribution = keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name='batch')

  def model():
    keras.utils.set_random_seed(0)
    layers = [keras.Input((256,))]
    layers += [keras.layers.Dense(256, use_bias=False, name=f'd{i}') for i in range(4)]
    m = keras.Sequential(layers, name='columns')
    m.compile(optimizer=keras.optimizers.SGD(0.1), loss='mse')
    return m

  reference = model()
  keras.distribution.set_distribution(distribution)
  try:
    split = model()
    x, y = helpers.randn(0, 8, 256), helpers.randn(1, 8, 256)
    got = [float(split.train_on_batch(x, y)) for _ in range(2)]
  finally:
    keras.distribution.set_distribution(None)
  want = [float(reference.train_on_batch(x, y)) for _ in range(2)]
  assert_close(as_float32(got), as_float32(want), 'losses')
  assert_close(
    [np.asarray(w) for w in split.weights], [np.asarray(w) for w in reference.weights], 'kernels'
  )
  (train,) = step_programs(split.train_function)
  kinds = {c['kind'] for c in train.collectives()}
  assert 'all_to_all' not in kinds, [(c['kind'], c['shape'], c['op']) for c in train.collectives()]
  moved = sum(c['bytes'] for c in train.collectives())
  assert moved <= 40_000, moved  # 30,724; before: 174,084 (forward kernels and gradients exchanged)


def _attention_model(num_heads):
  keras.utils.set_random_seed(0)
  tokens = keras.Input((8, 16))
  # No biases: the key bias's gradient is 0 in exact arithmetic (a softmax does not change when
  # a row moves by one amount), so its value is round-off, judged elsewhere by the float64 rule.
  attention = keras.layers.MultiHeadAttention(num_heads, 4, use_bias=False, name='mha')
  model = keras.Model(tokens, keras.layers.Dense(4, name='head')(attention(tokens, tokens)[:, 0]))
  model.compile(optimizer=keras.optimizers.SGD(0.05), loss='mse')
  return model


def test_attention_heads_split_unevenly_train_as_plain_keras():
  """6 heads over a 'model' axis of 4: the head dim is split unevenly (padded, as GSPMD pads),
  and fit, evaluate and the weights equal plain Keras (this was refused by name; the Keras
  fuzz campaign's ten such models all passed without the refusal)."""
  rng = np.random.RandomState(2)
  x, y = rng.randn(32, 8, 16).astype(np.float32), rng.randn(32, 4).astype(np.float32)
  mesh = keras.distribution.DeviceMesh((2, 4), ['data', 'model'], keras.distribution.list_devices())
  layout_map = keras.distribution.LayoutMap(mesh)
  layout_map['mha/(query|key|value)/kernel'] = (None, 'model', None)
  distribution = keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name='data')
  reference = _attention_model(6)
  with distribution.scope():
    model = _attention_model(6)
    got = model.fit(x, y, **FIT_SHORT).history
    got_eval = model.evaluate(x, y, batch_size=16, verbose=0)
  want = reference.fit(x, y, **FIT_SHORT).history
  want_eval = reference.evaluate(x, y, batch_size=16, verbose=0)
  assert tg.keras.shard_layouts(model)['mha/query/kernel'] == (
    tg.P(None, 'model', None),
    (16, 2, 4),
  )
  assert_close(as_float32(got), as_float32(want), 'history')
  assert_close(as_float32(got_eval), as_float32(want_eval), 'evaluate')
  assert_close(model.weights, reference.weights, 'weights')
