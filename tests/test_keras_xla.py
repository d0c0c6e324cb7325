"""Keras on the XLA backend: `partition_model(..., backend='xla')` and
`tf_gspmd.keras.enable(backend='xla')`.

Each model's steps are exported to one per-replica StableHLO module, compiled by
XLA and run on 8 PJRT CPU devices, with the variables resident there between
calls. Everything is checked against the same model run by plain Keras
(histories, evaluations, predictions, weights) through the oracle
(tf_gspmd.testing), and the collectives are counted in the compiled module:
the guide's MLP under ModelParallel 2x4, DataParallel over 8, a BatchNorm CNN
(by the float64 rule), and a small keras_hub-style decoder (token embedding,
attention with rotary positions, RMSNorm, output tied to the embedding). The
Keras workflow of tests/test_keras_workflow.py (weight writes between calls,
steps_per_execution, uneven batches, callbacks, *_on_batch) runs again here on
this backend.
"""

import collections
import re

import keras
import numpy as np
import pytest
import tensorflow as tf

pytest.importorskip('jax')

import keras_workflows as workflow  # noqa: E402

import tf_gspmd as tg  # noqa: E402
from tf_gspmd.testing import as_float32, assert_close, assert_close_to_float64  # noqa: E402
from tf_gspmd.testing.float64 import float64_policy  # noqa: E402
from tf_gspmd.xla_bridge import XlaLoweringError, stablehlo_collectives  # noqa: E402

# Each model is exported, compiled by XLA and run on 8 PJRT devices: tens of seconds apiece.
pytestmark = pytest.mark.slow
from helpers import (  # noqa: E402
  FIT,
  X,
  Y,
  check_model_parallel_example,
  guide_distribution,
  guide_model,
  step_programs,
)

# Recorded collective kind -> the native XLA op it is exported as (tests/test_xla_backend.py).
NATIVE = {
  'all_reduce': 'all-reduce',
  'broadcast': 'all-reduce',
  'reduce_scatter': 'reduce-scatter',
  'all_gather': 'all-gather',
  'all_to_all': 'all-to-all',
  'permute': 'collective-permute',
}


@pytest.fixture
def enabled_xla():
  tg.keras.enable(backend='xla')
  yield
  keras.distribution.set_distribution(None)
  tg.keras.disable()


def compiled_collectives(pf):
  """The collectives of a step that ran: one native op in the module per recorded one, and
  what XLA compiled (its optimized HLO) by kind."""
  assert pf.backend == 'xla'
  run = pf._last.prepared  # noqa: SLF001
  module = run.export.module
  assert 'custom_call @tf_gspmd' not in module
  recorded = collections.Counter(NATIVE[r['kind']] for r in pf.collectives())
  assert collections.Counter(stablehlo_collectives(module)) == recorded
  return recorded, run.executable.collective_counts()


def the_train_step(model):
  (train,) = [
    p
    for p in step_programs(model.train_function)
    if p._last is not None and p.fn.__name__ == 'one_step'
  ]  # noqa: SLF001
  return train


# --- the workflow of tests/test_keras_workflow.py, on backend='xla' ---------------------------


def test_writes_between_calls_on_xla(tmp_path):
  model = workflow.writes_between_calls(tmp_path, backend='xla')
  pairs = model._tf_gspmd_store.pairs()  # noqa: SLF001
  assert pairs and all(type(s).__name__ == 'XlaShardedVariable' for _, s in pairs)
  kernel = next(s for v, s in pairs if 'h0/kernel' in v.name)
  assert kernel.local_shape == (16, 8)
  assert {b.device.id for b in kernel.shards} == set(range(8))  # resident on the 8 devices


def test_steps_per_execution_is_one_while_loop_on_xla():
  model = workflow.steps_per_execution(backend='xla')
  looped = model._tf_gspmd_launcher.functions['train_step_looped']  # noqa: SLF001
  module = looped._last.prepared.export.module  # noqa: SLF001
  assert module.count('stablehlo.while') == 1, 'k steps are one While loop in one module'
  recorded, compiled = compiled_collectives(looped)
  assert recorded['all-reduce'] >= 2 and compiled.get('all-reduce', 0) >= 1


def test_uneven_last_batch_on_xla():
  workflow.uneven_last_batch(backend='xla')


@pytest.mark.filterwarnings('ignore:Skipping variable loading for optimizer')
def test_callbacks_on_xla(tmp_path):
  workflow.callbacks_agree(tmp_path, backend='xla')


def test_on_batch_calls_on_xla():
  workflow.on_batch_calls(backend='xla')


# --- keras.distribution with enable(backend='xla') ----------------------------------------------


def test_model_parallel_guide_code_on_xla(enabled_xla):
  assert tg.keras.backend() == 'xla'
  distribution = guide_distribution()
  reference = guide_model()
  with distribution.scope():
    model = guide_model()
    got = model.fit(X, Y, **FIT).history
    got_eval = model.evaluate(X, Y, batch_size=16, verbose=0)
    predicted = model.predict(X[:40], batch_size=16, verbose=0)  # 16, 16 and 8
  want = reference.fit(X, Y, **FIT).history
  assert_close(as_float32(got), as_float32(want), 'history')
  assert_close(
    as_float32(got_eval), as_float32(reference.evaluate(X, Y, batch_size=16, verbose=0)), 'evaluate'
  )
  assert_close(predicted, reference.predict(X[:40], batch_size=16, verbose=0), 'predict')
  assert_close(model.weights, reference.weights, 'weights')
  assert tg.keras.shard_layouts(model)['d1/kernel'] == (tg.P(None, 'model'), (16, 8))

  recorded, compiled = compiled_collectives(the_train_step(model))
  # e1's contraction over the split hidden dim and the batch gradients: all-reduces.
  assert recorded['all-reduce'] >= 2 and compiled.get('all-reduce', 0) >= 1, (recorded, compiled)


def test_data_parallel_over_8_on_xla(enabled_xla):
  distribution = keras.distribution.DataParallel()
  reference = guide_model()
  with distribution.scope():
    model = guide_model()
    got = model.fit(X, Y, **FIT).history
  assert_close(as_float32(got), as_float32(reference.fit(X, Y, **FIT).history), 'history')
  assert_close(model.weights, reference.weights, 'weights')
  train = the_train_step(model)
  kinds = {(c['kind'], c['axes']) for c in train.collectives()}
  assert kinds == {('all_reduce', ('batch',))}, kinds  # gradients and metrics, nothing else
  recorded, _ = compiled_collectives(train)
  assert set(recorded) == {'all-reduce'}


def test_a_model_keeps_its_backend(enabled_xla):
  distribution = keras.distribution.DataParallel()
  with distribution.scope():
    model = guide_model()
    model.fit(X, Y, **FIT_ONE)
  tg.keras.enable(backend='tf')
  with distribution.scope(), pytest.raises(ValueError, match=r"backend='xla'.*unpartition_model"):
    model.fit(X, Y, **FIT_ONE)
  trained = [np.asarray(w) for w in model.get_weights()]
  tg.unpartition_model(model)  # the trained values come back into the model ...
  for w, v in zip(trained, model.get_weights()):
    np.testing.assert_array_equal(w, v)
  with distribution.scope():
    model.fit(X, Y, **FIT_ONE)  # ... and it runs on the TF backend now
  assert model._tf_gspmd_launcher.kwargs['backend'] == 'tf'  # noqa: SLF001


FIT_ONE = dict(batch_size=16, epochs=1, shuffle=False, verbose=0)


# --- a BatchNorm CNN, by the float64 rule -------------------------------------------------------


def bn_cnn():
  keras.utils.set_random_seed(1)
  inputs = keras.Input((8, 8, 3))
  y = keras.layers.Conv2D(8, 3, padding='same', name='c1')(inputs)
  y = keras.layers.BatchNormalization(name='bn1')(y)
  y = keras.layers.ReLU()(y)
  y = keras.layers.Conv2D(8, 3, strides=2, padding='same', name='c2')(y)
  y = keras.layers.BatchNormalization(name='bn2')(y)
  y = keras.layers.GlobalAveragePooling2D()(keras.layers.ReLU()(y))
  model = keras.Model(inputs, keras.layers.Dense(4, name='head')(y))
  model.compile(
    optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
  )
  return model


def test_batch_norm_cnn_on_xla(enabled_xla):
  rng = np.random.RandomState(2)
  x, y = rng.randn(32, 8, 8, 3).astype(np.float32), rng.randint(0, 4, 32).astype(np.int32)
  kw = dict(batch_size=16, epochs=2, shuffle=False, verbose=0)
  reference = bn_cnn()
  with float64_policy():
    exact = bn_cnn()
  exact.set_weights([np.float64(w) for w in reference.get_weights()])
  with keras.distribution.DataParallel().scope():
    model = bn_cnn()
    got = model.fit(x, y, **kw).history
  want, truth = reference.fit(x, y, **kw).history, exact.fit(np.float64(x), y, **kw).history
  assert_close_to_float64(
    as_float32(got['loss']), as_float32(want['loss']), as_float32(truth['loss']), 'loss history'
  )
  weights = [np.asarray(w) for w in model.get_weights()]
  assert_close_to_float64(weights, reference.get_weights(), exact.get_weights(), 'weights')
  moving = [w for v, w in zip(model.weights, weights) if 'moving' in v.path]
  assert len(moving) == 4 and all(np.any(w != 0) for w in moving)  # statistics were gathered
  recorded, _ = compiled_collectives(the_train_step(model))
  assert set(recorded) == {'all-reduce'}  # batch statistics and gradients


# --- a keras_hub-style decoder ------------------------------------------------------------------


VOCAB, SEQ, WIDTH, HEADS = 32, 8, 16, 4


class Rotary(keras.layers.Layer):
  """Rotary position embedding on the last dim of [batch, seq, heads, head_dim]."""

  def call(self, x):
    half = x.shape[-1] // 2
    position = keras.ops.arange(x.shape[1], dtype=x.dtype)
    inverse = 1.0 / (10000.0 ** (keras.ops.arange(half, dtype=x.dtype) / half))
    angle = keras.ops.einsum('s,f->sf', position, inverse)[None, :, None, :]
    cos, sin = keras.ops.cos(angle), keras.ops.sin(angle)
    first, second = x[..., :half], x[..., half:]
    return keras.ops.concatenate([first * cos - second * sin, second * cos + first * sin], -1)


class Attention(keras.layers.Layer):
  def __init__(self, **kw):
    super().__init__(**kw)
    self.query = keras.layers.EinsumDense(
      'bsd,dhk->bshk', (SEQ, HEADS, WIDTH // HEADS), name='query'
    )
    self.key = keras.layers.EinsumDense('bsd,dhk->bshk', (SEQ, HEADS, WIDTH // HEADS), name='key')
    self.value = keras.layers.EinsumDense(
      'bsd,dhk->bshk', (SEQ, HEADS, WIDTH // HEADS), name='value'
    )
    self.out = keras.layers.EinsumDense('bshk,hkd->bsd', (SEQ, WIDTH), name='attention_output')
    self.rotary = Rotary()

  def call(self, x):
    q, k, v = self.rotary(self.query(x)), self.rotary(self.key(x)), self.value(x)
    scores = keras.ops.einsum('bqhk,bthk->bhqt', q, k) / float(np.sqrt(WIDTH // HEADS))
    causal = keras.ops.triu(keras.ops.ones((SEQ, SEQ), dtype=scores.dtype), 1) * -1e9
    weights = keras.ops.softmax(scores + causal, axis=-1)
    return self.out(keras.ops.einsum('bhqt,bthk->bqhk', weights, v))


class TiedOutput(keras.layers.Layer):
  """Logits from the token embedding's own matrix (keras_hub's ReversibleEmbedding, reversed)."""

  def __init__(self, embedding, **kw):
    super().__init__(**kw)
    self.embedding = embedding

  def call(self, h):
    return keras.ops.einsum('bsd,vd->bsv', h, self.embedding.embeddings)


def decoder():
  keras.utils.set_random_seed(3)
  tokens = keras.Input((SEQ,), dtype='int32')
  embedding = keras.layers.Embedding(VOCAB, WIDTH, name='token_embedding')
  h = embedding(tokens)
  a = Attention(name='attention')(keras.layers.RMSNormalization(name='attention_norm')(h))
  h = h + a
  f = keras.layers.RMSNormalization(name='ffn_norm')(h)
  f = keras.layers.Dense(32, activation='gelu', name='ffn_in')(f)
  h = h + keras.layers.Dense(WIDTH, name='ffn_out')(f)
  logits = TiedOutput(embedding, name='tied_output')(
    keras.layers.RMSNormalization(name='final_norm')(h)
  )
  model = keras.Model(tokens, logits)
  model.compile(
    optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
  )
  return model


def test_decoder_with_rotary_attention_and_tied_output_on_xla(enabled_xla):
  """SGD: under Adam, g / sqrt(v) of the embedding rows a batch barely touches amplifies
  float32 rounding (plain Keras itself ends 1.2e-5 from float64 after 8 steps, 1e-5 between
  two summation orders); with SGD both runs stay within 5e-7 of float64, so the plain
  oracle applies."""
  rng = np.random.RandomState(4)
  tokens = rng.randint(0, VOCAB, (32, SEQ)).astype(np.int32)
  targets = np.roll(tokens, -1, axis=1)
  mesh = keras.distribution.DeviceMesh(
    (2, 4), ['data', 'model'], devices=keras.distribution.list_devices()
  )
  layout_map = keras.distribution.LayoutMap(mesh)
  layout_map['token_embedding/embeddings'] = (None, 'model')
  layout_map['attention/(query|key|value)/kernel'] = (None, 'model', None)
  layout_map['attention/attention_output/kernel'] = ('model', None, None)
  layout_map['ffn_in/kernel'] = (None, 'model')
  layout_map['ffn_out/kernel'] = ('model', None)
  distribution = keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name='data')
  reference = decoder()
  kw = dict(
    batch_size=8, epochs=2, shuffle=False, verbose=0, validation_data=(tokens[:16], targets[:16])
  )
  with distribution.scope():
    model = decoder()
    got = model.fit(tokens, targets, **kw).history
    predicted = model.predict(tokens[:12], batch_size=8, verbose=0)  # 8, then 4
  want = reference.fit(tokens, targets, **kw).history
  assert_close(as_float32(got), as_float32(want), 'history')
  assert_close(predicted, reference.predict(tokens[:12], batch_size=8, verbose=0), 'predict')
  assert_close(model.weights, reference.weights, 'weights')
  layouts = tg.keras.shard_layouts(model)
  assert layouts['attention/query/kernel'] == (tg.P(None, 'model', None), (16, 1, 4))
  assert layouts['token_embedding/embeddings'] == (tg.P(None, 'model'), (32, 4))
  recorded, compiled = compiled_collectives(the_train_step(model))
  assert recorded['all-reduce'] >= 4 and compiled.get('all-reduce', 0) >= 1, (recorded, compiled)


# --- export and bad input -----------------------------------------------------------------------


def test_save_xla_of_a_keras_model_reloads_and_equals_predict(tmp_path):
  from tf_gspmd.xla_bridge import pjrt

  model = workflow.workflow_partitioned(workflow.workflow_model(), backend='xla')
  x, y = workflow.workflow_data()
  model.fit(x, y, **FIT_ONE)
  want = model.predict(x[:16], batch_size=16, verbose=0)
  export = tg.saved_model.save_xla(model, str(tmp_path / 'xla'), x[:16])
  assert {a.kind for a in export.args} == {'argument', 'variable'}
  loaded, values = tg.saved_model.load_xla(str(tmp_path / 'xla'))
  executable = pjrt.PjrtExecutable(loaded)
  inputs = [pjrt.put_global(x[:16], loaded.args[0], executable.devices)]
  inputs += [
    pjrt.put_global(values[i], loaded.args[i], executable.devices)
    for i in range(1, len(loaded.args))
  ]
  out = executable.run(inputs)[0]
  got = pjrt.assemble_global(out, loaded.results[0].sharding, loaded.results[0].shape, 'logits')
  assert_close(got.numpy(), want, 'reloaded module vs predict')
  kernel = next(a for a in loaded.args if 'h0/kernel' in a.name)
  assert kernel.local_shape == (16, 8)


class StringOp(keras.layers.Layer):
  def call(self, x):
    text = tf.strings.as_string(x)
    return x + tf.cast(tf.strings.length(text), x.dtype) * 0.0


class PyFunction(keras.layers.Layer):
  def call(self, x):
    y = tf.py_function(lambda t: t * 2.0, [x], x.dtype)
    y.set_shape(x.shape)
    return y


@pytest.mark.parametrize('layer,op', [(StringOp, 'AsString'), (PyFunction, 'EagerPyFunc')])
def test_a_layer_xla_cannot_compile_is_named(layer, op):
  keras.utils.set_random_seed(0)
  inputs = keras.Input((16,))
  h = keras.layers.Dense(8, name='h0')(inputs)
  out = keras.layers.Dense(4, name='out')(layer(name='odd_layer')(h))
  model = keras.Model(inputs, out)
  model.compile(optimizer='sgd', loss='mse')
  tg.partition_model(model, tg.Mesh.create((8,), ('data',)), backend='xla')
  x = np.ones((16, 16), np.float32)
  with pytest.raises(XlaLoweringError, match=rf"op type {op} .* In Keras layer 'odd_layer'"):
    model.fit(x, np.ones((16, 4), np.float32), **FIT_ONE)


def test_example_model_parallel_with_backend_xla(tmp_path):
  out = check_model_parallel_example(tmp_path, '--backend', 'xla')
  assert re.search(
    r'XLA compiled the training step for 8 PJRT devices; its collectives: '
    r'all-reduce x[1-9]',
    out,
  ), out
