"""A small Keras 3 transformer encoder and its Megatron-style layout on a (data, model) mesh.

Plain Keras layers; the only tf_gspmd-specific lines are the `LayoutMap`
rules (attention heads and the MLP hidden dim split over 'model') and one
`shard` of the input batch over 'data'. Shared by the demo, the tests and
bench/step_time.py.
"""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

import tf_gspmd as tg
from tf_gspmd import P
from tf_gspmd.keras.layout import LayoutMap

VOCAB, SEQ, D_MODEL, HEADS, FF = 64, 8, 32, 4, 64


def build(
  seed: int = 0,
  layers: int = 2,
  vocab: int = VOCAB,
  seq: int = SEQ,
  d_model: int = D_MODEL,
  heads: int = HEADS,
  ff: int = FF,
):
  """A transformer encoder classifier and its Adam optimizer (built, so no variable is lazy)."""
  keras.utils.set_random_seed(seed)
  tokens = keras.Input((seq,), dtype='int32')
  x = keras.layers.Embedding(vocab, d_model, name='embed')(tokens)
  for i in range(layers):
    attn = keras.layers.MultiHeadAttention(heads, d_model // heads, name=f'attn_{i}')(x, x)
    x = keras.layers.LayerNormalization(name=f'norm_attn_{i}')(x + attn)
    hidden = keras.layers.Dense(ff, activation='relu', name=f'ffn_in_{i}')(x)
    hidden = keras.layers.Dropout(0.0, name=f'drop_{i}')(hidden)
    x = keras.layers.LayerNormalization(name=f'norm_ffn_{i}')(
      x + keras.layers.Dense(d_model, name=f'ffn_out_{i}')(hidden)
    )
  logits = keras.layers.Dense(vocab, name='head')(keras.layers.GlobalAveragePooling1D()(x))
  model = keras.Model(tokens, logits)
  optimizer = keras.optimizers.Adam(1e-3)
  optimizer.build(model.trainable_variables)
  return model, optimizer


def layout(mesh: tg.Mesh) -> LayoutMap:
  """Megatron style: heads and the MLP hidden dim on 'model'; everything else replicated."""
  rules = LayoutMap(mesh)
  rules[r'.*attn_\d+/(query|key|value)/kernel'] = P(None, 'model', None)
  rules[r'.*attn_\d+/(query|key|value)/bias'] = P('model', None)
  rules[r'.*attn_\d+/attention_output/kernel'] = P('model', None, None)
  rules[r'.*ffn_in_\d+/kernel'] = P(None, 'model')
  rules[r'.*ffn_in_\d+/bias'] = P('model')
  rules[r'.*ffn_out_\d+/kernel'] = P('model', None)
  return rules


def train_step(model, optimizer, mesh=None):
  """One training step as a tf.function; with `mesh`, the batch is annotated over 'data'."""
  loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

  @tf.function
  def step(tokens, labels):
    if mesh is not None:
      tokens = tg.shard(tokens, mesh, P('data', None))
    with tf.GradientTape() as tape:
      loss = loss_fn(labels, model(tokens, training=True))
    grads = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(grads, model.trainable_variables))
    return loss

  return step


def batch(seed: int, size: int = 8, vocab: int = VOCAB, seq: int = SEQ):
  rng = np.random.RandomState(seed)
  return (
    rng.randint(0, vocab, (size, seq)).astype(np.int32),
    rng.randint(0, vocab, (size,)).astype(np.int32),
  )
