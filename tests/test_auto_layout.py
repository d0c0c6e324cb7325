"""tf_gspmd.keras.auto_layout on Keras-written models shaped like Keras Hub's Mistral, Gemma3,
GPT-2 and BERT (plain Keras layers, tiny sizes, one block each).

Each model: the LayoutMap auto_layout returns has one anchored key per model variable, each
matching exactly that variable; `fit` under its `ModelParallel`, unchanged, trains the very
model auto_layout read as plain Keras trains a copy (the oracle: normwise relative error
<= 1e-5 in float32), with the shards laid out as chosen. Beside a Llama-style shipped map
(Keras Hub's `get_layout_map` shape) under the same budget, the search's layout is predicted
no worse.
"""

import importlib
import re

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras import layers, ops

import tf_gspmd as tg
from tf_gspmd.testing import as_float32, assert_close

pytestmark = pytest.mark.usefixtures('keras_enabled')  # conftest.py

auto_layout_module = importlib.import_module('tf_gspmd.keras.auto_layout')

VOCAB, SEQ, D, HEADS, HEAD_DIM, FF, CLASSES = 64, 8, 32, 4, 8, 64, 4
ROWS, BATCH = 32, 16
FIT = dict(batch_size=BATCH, epochs=1, shuffle=False, verbose=0)


# --- the models -----------------------------------------------------------------------------------
class CausalAttention(layers.Layer):
  """Causal grouped-query attention from EinsumDense projections: `kv_heads` key/value heads
  shared by groups of query heads (Mistral: 2 of 4; Gemma3: 1, multi-query), kernels
  (model, heads, head) or, `heads_first`, (heads, model, head) as Gemma's; `qk_norm`
  normalizes queries and keys per head (Gemma3)."""

  def __init__(self, kv_heads, heads_first=False, qk_norm=False, **kwargs):
    super().__init__(**kwargs)
    self.kv_heads, self.heads_first, self.qk_norm = kv_heads, heads_first, qk_norm

  def _projection(self, heads, name):
    kernel = 'ndh' if self.heads_first else 'dnh'
    return layers.EinsumDense(f'btd,{kernel}->btnh', (None, heads, HEAD_DIM), name=name)

  def build(self, shape):
    self.query = self._projection(HEADS, 'query')
    self.key = self._projection(self.kv_heads, 'key')
    self.value = self._projection(self.kv_heads, 'value')
    self.attention_output = layers.EinsumDense('btnh,nhd->btd', (None, D), name='attention_output')
    for projection in (self.query, self.key, self.value):
      projection.build(shape)
    self.attention_output.build((None, None, HEADS, HEAD_DIM))
    if self.qk_norm:
      self.query_norm = layers.RMSNormalization(name='query_norm')
      self.key_norm = layers.RMSNormalization(name='key_norm')
      self.query_norm.build((None, None, HEADS, HEAD_DIM))
      self.key_norm.build((None, None, self.kv_heads, HEAD_DIM))

  def call(self, x):
    q, k, v = self.query(x), self.key(x), self.value(x)
    if self.qk_norm:
      q, k = self.query_norm(q), self.key_norm(k)
    k, v = ops.repeat(k, HEADS // self.kv_heads, axis=2), ops.repeat(v, HEADS // self.kv_heads, 2)
    scores = ops.einsum('btnh,bsnh->bnts', q, k) * HEAD_DIM**-0.5
    scores = ops.where(ops.tril(ops.ones((SEQ, SEQ), 'bool')), scores, -1e9)
    return self.attention_output(ops.einsum('bnts,bsnh->btnh', ops.softmax(scores, -1), v))


class PositionEmbedding(layers.Layer):
  """Learned positions (GPT-2, BERT): one vector per position, added."""

  def build(self, shape):
    self.embeddings = self.add_weight((SEQ, D), 'random_normal', name='embeddings')

  def call(self, x):
    return x + self.embeddings


class TiedLogits(layers.Layer):
  """Logits against the token embedding's own matrix (Gemma ties them)."""

  def __init__(self, embedding, **kwargs):
    super().__init__(**kwargs)
    self.embedding = embedding

  def call(self, x):
    return ops.matmul(x, ops.transpose(self.embedding.embeddings))


def gated_mlp(x, name, activation):
  gate = layers.Dense(FF, use_bias=False, activation=activation, name=f'{name}_gate')(x)
  up = layers.Dense(FF, use_bias=False, name=f'{name}_intermediate')(x)
  return layers.Dense(D, use_bias=False, name=f'{name}_output')(gate * up)


def mistral():
  """Mistral-shaped decoder: GQA (2 key/value heads for 4), RMSNorm, SiLU-gated MLP, untied
  head."""
  tokens = keras.Input((SEQ,), dtype='int32', name='token_ids')
  x = layers.Embedding(VOCAB, D, name='token_embedding')(tokens)
  x = x + CausalAttention(2, name='layer_0_attention')(
    layers.RMSNormalization(name='layer_0_attention_norm')(x)
  )
  x = x + gated_mlp(layers.RMSNormalization(name='layer_0_ffw_norm')(x), 'layer_0_ffw', 'silu')
  logits = layers.Dense(VOCAB, use_bias=False, name='lm_head')(
    layers.RMSNormalization(name='final_norm')(x)
  )
  return keras.Model(tokens, logits, name='mistral')


def gemma3():
  """Gemma3-shaped decoder: scaled and tied embeddings, multi-query attention with
  heads-first kernels and query/key norms, norms before and after each sub-block, GeGLU."""
  tokens = keras.Input((SEQ,), dtype='int32', name='token_ids')
  embedding = layers.Embedding(VOCAB, D, name='token_embedding')
  x = embedding(tokens) * D**0.5
  attention = CausalAttention(1, heads_first=True, qk_norm=True, name='layer_0_attention')
  h = attention(layers.RMSNormalization(name='layer_0_pre_attention_norm')(x))
  x = x + layers.RMSNormalization(name='layer_0_post_attention_norm')(h)
  h = gated_mlp(layers.RMSNormalization(name='layer_0_pre_ffw_norm')(x), 'layer_0_ffw', 'gelu')
  x = x + layers.RMSNormalization(name='layer_0_post_ffw_norm')(h)
  logits = TiedLogits(embedding, name='tied_logits')(layers.RMSNormalization(name='final_norm')(x))
  return keras.Model(tokens, logits, name='gemma3')


def gpt2():
  """GPT-2-shaped decoder: learned positions, LayerNorm before each sub-block, causal
  MultiHeadAttention, GELU MLP."""
  tokens = keras.Input((SEQ,), dtype='int32', name='token_ids')
  x = PositionEmbedding(name='position_embedding')(
    layers.Embedding(VOCAB, D, name='token_embedding')(tokens)
  )
  h = layers.LayerNormalization(name='layer_0_attention_norm')(x)
  attention = layers.MultiHeadAttention(HEADS, HEAD_DIM, name='layer_0_attention')
  x = x + attention(h, h, use_causal_mask=True)
  h = layers.LayerNormalization(name='layer_0_ffw_norm')(x)
  h = layers.Dense(FF, activation='gelu', name='layer_0_ffw_intermediate')(h)
  x = x + layers.Dense(D, name='layer_0_ffw_output')(h)
  logits = layers.Dense(VOCAB, name='lm_head')(layers.LayerNormalization(name='final_norm')(x))
  return keras.Model(tokens, logits, name='gpt2')


def bert():
  """BERT-shaped encoder classifier: token, position and segment embeddings, post-LayerNorm
  block, a tanh pooler on the first token."""
  tokens = keras.Input((SEQ,), dtype='int32', name='token_ids')
  segments = keras.Input((SEQ,), dtype='int32', name='segment_ids')
  x = PositionEmbedding(name='position_embedding')(
    layers.Embedding(VOCAB, D, name='token_embedding')(tokens)
  )
  x = x + layers.Embedding(2, D, name='segment_embedding')(segments)
  x = layers.LayerNormalization(name='embeddings_norm')(x)
  attention = layers.MultiHeadAttention(HEADS, HEAD_DIM, name='layer_0_attention')
  x = layers.LayerNormalization(name='layer_0_attention_norm')(x + attention(x, x))
  h = layers.Dense(FF, activation='gelu', name='layer_0_ffw_intermediate')(x)
  x = layers.LayerNormalization(name='layer_0_ffw_norm')(
    x + layers.Dense(D, name='layer_0_ffw_output')(h)
  )
  pooled = layers.Dense(D, activation='tanh', name='pooler')(x[:, 0])
  logits = layers.Dense(CLASSES, name='classifier')(pooled)
  return keras.Model({'token_ids': tokens, 'segment_ids': segments}, logits, name='bert')


MODELS = {'mistral': mistral, 'gemma3': gemma3, 'gpt2': gpt2, 'bert': bert}


def compiled(name, seed=0):
  keras.utils.set_random_seed(seed)
  model = MODELS[name]()
  model.compile(
    optimizer=keras.optimizers.Adam(1e-2),
    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
  )
  return model


def data(name):
  rng = np.random.RandomState(7)
  tokens = rng.randint(0, VOCAB, (ROWS, SEQ)).astype(np.int32)
  if name == 'bert':
    segments = (np.arange(SEQ) >= SEQ // 2).astype(np.int32) * np.ones((ROWS, 1), np.int32)
    x = {'token_ids': tokens, 'segment_ids': segments}
    return x, rng.randint(0, CLASSES, ROWS).astype(np.int32)
  return tokens, np.roll(tokens, -1, axis=1)


def device_mesh():
  return keras.distribution.DeviceMesh(
    (2, 4), ['batch', 'model'], keras.distribution.list_devices()
  )


def parameter_bytes(model) -> int:
  return sum(int(np.prod(v.shape)) * 4 for v in model.variables)


# --- the tests ------------------------------------------------------------------------------------
def assert_one_variable_per_key(layout_map, model):
  """Every key matches exactly one variable of the model, its optimizer and its metrics, by
  Keras' own lookup and by re.search alike, and every model variable has its key."""
  paths = [v.path for v in model.variables + model.optimizer.variables]
  assert len(set(paths)) == len(paths)
  keys = list(layout_map.keys())
  for key in keys:
    assert [p for p in paths if re.search(key, p)] == [re.sub(r'\\(.)', r'\1', key[1:-1])], key
  for variable in model.variables:
    assert [k for k in keys if re.search(k, variable.path)] == [f'^{re.escape(variable.path)}$']
    assert layout_map[variable.path] is not None


def llama_style_map(mesh):
  """Keras Hub's Llama/Gemma `get_layout_map` shape on the Mistral-shaped model ('batch' the
  data axis): projections split over both axes, the model dim on 'batch' (FSDP-like)."""
  shipped = keras.distribution.LayoutMap(mesh)
  shipped['token_embedding/embeddings'] = ('model', 'batch')
  shipped['layer_.*attention/(query|key|value)/kernel'] = ('model', 'batch', None)
  shipped['layer_.*attention/attention_output/kernel'] = ('model', None, 'batch')
  shipped['layer_.*ffw_(gate|intermediate)/kernel'] = ('batch', 'model')
  shipped['layer_.*ffw_output/kernel'] = ('model', 'batch')
  shipped['lm_head/kernel'] = ('batch', 'model')
  return keras.distribution.ModelParallel(layout_map=shipped, batch_dim_name='batch')


SEARCHED = {}  # model name -> (model, auto_layout's result): one search serves two tests


def searched(name):
  """The compiled model and auto_layout's choice for it (the Mistral-shaped one priced beside
  the Llama-style map), under a budget below data parallelism's: the parameters and Adam's
  two slots whole on every device do not fit, so the search must split weights."""
  if name not in SEARCHED:
    model = compiled(name)
    x, y = data(name)
    budget = 2 * parameter_bytes(model) + 120_000
    mesh = device_mesh()
    baseline = llama_style_map(mesh) if name == 'mistral' else None
    chosen = tg.keras.auto_layout(
      model, mesh, memory_budget=budget, x=x, y=y, batch_size=BATCH, baseline=baseline
    )
    SEARCHED[name] = model, chosen
  return SEARCHED[name]


# make test runs a decoder (Mistral-shaped, also priced against the Llama-style map) and an
# encoder (BERT-shaped); the Gemma3- and GPT-2-shaped ones run with the full sweep.
FIT_CASES = [
  pytest.param(name, marks=() if name in ('mistral', 'bert') else pytest.mark.sweep)
  for name in MODELS
]


@pytest.mark.slow  # model-level: a search and a partitioned fit each, 15-40 s on 2 shared cores
@pytest.mark.parametrize('name', FIT_CASES)
def test_auto_layout_map_runs_fit_under_model_parallel_unchanged(name):
  model, chosen = searched(name)
  reference = compiled(name)
  x, y = data(name)
  print(chosen.report())
  assert chosen.memory <= chosen.result.budget and chosen.cost > 0
  assert chosen.batch_dim_name in ('batch', 'model')
  split = {p: s for p, s in chosen.specs.items() if any(e is not None for e in s)}
  assert split, 'the budget leaves no room for replicated weights: something must be split'
  assert not model.optimizer.built  # traced with a copy: its slots are made under the layout

  with chosen.distribution().scope():
    history = model.fit(x, y, **FIT).history
  want = reference.fit(x, y, **FIT).history
  assert_close(as_float32(history), as_float32(want), 'history')
  # Softmax ignores key/bias (a bias on every key shifts each query's scores alike): its
  # gradient is rounding noise, which Adam scales to +-lr steps in both runs alike, so its
  # value compares no programs (tests/test_models.py holds it to float64's cancellation rule).
  compared = [
    (got, want)
    for got, want in zip(model.weights, reference.weights)
    if not got.path.endswith('key/bias')
  ]
  assert len(compared) >= len(model.weights) - 1  # one attention layer: one key/bias at most
  assert_close([g for g, _ in compared], [w for _, w in compared], 'weights')

  assert_one_variable_per_key(chosen.layout_map, model)
  held = tg.keras.shard_layouts(model)
  for path, spec in chosen.specs.items():
    assert held[path][0] == spec, path
  first = next(iter(split))  # Adam's slots follow their variable
  assert held[f'{model.optimizer.name}/{first.replace("/", "_")}_momentum'][0] == split[first]


@pytest.mark.slow  # the Mistral-shaped search, when the fit test has not run it
def test_the_search_is_no_worse_than_a_llama_style_shipped_map():
  _, chosen = searched('mistral')
  searched_end, shipped = chosen.result.best, chosen.baseline.best
  print(chosen.report())
  assert shipped.memory <= chosen.result.budget  # the shipped map fits the same budget
  assert not chosen.kept_baseline
  assert searched_end.cost <= shipped.cost, (searched_end.cost, shipped.cost)
  assert 'the search is no worse' in chosen.report()
  assert chosen.baseline.best.report is not None  # both planned with tg.plan, not only priced


class TwinProjections(layers.Layer):
  """Two sub-layers given one name: their variables share a path, so no key can tell them."""

  def build(self, shape):
    self.a, self.b = layers.Dense(4, name='proj'), layers.Dense(4, name='proj')
    self.a.build(shape)
    self.b.build(shape)

  def call(self, x):
    return self.a(x) + self.b(x)


def test_a_key_matching_two_variables_is_refused_before_searching():
  inputs = keras.Input((8,))
  model = keras.Model(inputs, TwinProjections(name='twins')(inputs), name='twins')
  model.compile(optimizer='adam', loss='mse')
  assert [v.path for v in model.variables].count('twins/proj/kernel') == 2
  x, y = np.zeros((16, 8), np.float32), np.zeros((16, 4), np.float32)
  with pytest.raises(
    ValueError,
    match=r"key '\^twins/proj/kernel\$' matches \['twins/proj/kernel', 'twins/proj/kernel'\]",
  ):
    tg.keras.auto_layout(model, device_mesh(), memory_budget=10**6, x=x, y=y)


def test_a_tf_gspmd_mesh_serves_as_a_device_mesh():
  mesh = tg.Mesh.create((2, 4), ('batch', 'model'))
  device_mesh, same = auto_layout_module._meshes(mesh)  # noqa: SLF001
  assert same is mesh and list(device_mesh.axis_names) == ['batch', 'model']
  assert np.ravel(device_mesh.devices).tolist() == [f'cpu:{i}' for i in range(8)]
  with pytest.raises(TypeError, match='DeviceMesh or a tf_gspmd.Mesh'):
    auto_layout_module._meshes((2, 4))  # noqa: SLF001


def test_a_model_it_cannot_search_is_refused_saying_why():
  x, y = np.zeros((16, 8), np.float32), np.zeros((16, 4), np.float32)
  inputs = keras.Input((8,))
  model = keras.Model(inputs, layers.Dense(4, name='d')(inputs), name='small')
  with pytest.raises(ValueError, match=r'compile small first'):
    tg.keras.auto_layout(model, device_mesh(), memory_budget=10**6, x=x, y=y)
  model.compile(optimizer='adam', loss='mse')
  with keras.distribution.DataParallel().scope():
    with pytest.raises(ValueError, match='outside any distribution scope'):
      tg.keras.auto_layout(model, device_mesh(), memory_budget=10**6, x=x, y=y)


def test_the_search_offers_only_layouts_keras_can_say():
  """auto_shard's two options auto_layout sets: one mesh axis a dim (a TensorLayout names one),
  and the batch over one axis that divides it, never unsplit (ModelParallel always splits it)."""
  groups = importlib.import_module('tf_gspmd.auto_shard.groups')
  mesh = tg.Mesh.create((2, 4), ('batch', 'model'))
  every = groups.spec_candidates((32, 4, 8), mesh)
  single = groups.spec_candidates((32, 4, 8), mesh, axes_per_dim=1)
  assert any(isinstance(e, tuple) for spec in every for e in spec)
  assert not any(isinstance(e, tuple) for spec in single for e in spec)
  assert set(single) == {s for s in every if not any(isinstance(e, tuple) for e in s)}
  batch_of_6 = [tf.TensorSpec((6, 3))]
  assert groups.input_candidates(batch_of_6, mesh) == [None, ('batch',)]
  assert groups.input_candidates(batch_of_6, mesh, [('batch',), ('model',)]) == [('batch',)]


def test_the_batch_is_shaped_as_fit_batches_it():
  batch_specs = auto_layout_module._batch_specs  # noqa: SLF001
  x, y = data('bert')
  got = batch_specs(x, y, 16)
  assert got == (
    {
      'segment_ids': tf.TensorSpec((16, SEQ), tf.int32),
      'token_ids': tf.TensorSpec((16, SEQ), tf.int32),
    },
    tf.TensorSpec((16,), tf.int32),
  )
  floats = batch_specs(np.zeros((8, 3)), np.zeros((8,), np.int64), 32)  # float64 -> floatx
  assert floats == (tf.TensorSpec((8, 3), tf.float32), tf.TensorSpec((8,), tf.int64))
  dataset = tf.data.Dataset.from_tensor_slices((x['token_ids'], y)).batch(16)
  assert batch_specs(dataset, None, 32) == (
    tf.TensorSpec((16, SEQ), tf.int32),
    tf.TensorSpec((16,), tf.int32),
  )
