"""The bench's models, each twice: a Keras 3 model and the same model in plain TF.

The Keras 3 versions are what tf_gspmd partitions (Keras 3 runs on the TF
backend unchanged). TensorFlow's DTensor cannot run Keras 3, so each model
also exists as plain TF -- `tf.Variable`s in a dict keyed by the Keras
variable path, a forward function with the same math as the Keras layers,
and Adam written out as Keras 3 computes it -- which runs either
unpartitioned (ordinary variables) or under DTensor (`DVariable`s laid out
on a DTensor mesh). Its weights are copied from the Keras model's initial
weights, so all four runs start from the same point.

Models:
  mlp          Dense stack (relu) -> logits.
  transformer  examples/keras/transformer.py (plain-TF twin: `plain_transformer`).
  cnn          Conv2D -> BatchNorm -> ReLU -> MaxPool, twice; GlobalAveragePooling2D -> Dense.
"""

from __future__ import annotations

import math
from typing import Callable, Dict, List

import keras
import numpy as np
import tensorflow as tf

from tf_gspmd.testing.keras_steps import keras_train_step  # noqa: F401  (the benches share it)

LEARNING_RATE = 1e-3
BN_MOMENTUM, BN_EPSILON = 0.99, 1e-3  # Keras 3 BatchNormalization defaults
LN_EPSILON = 1e-3  # Keras 3 LayerNormalization default
ADAM_BETA_1, ADAM_BETA_2, ADAM_EPSILON = 0.9, 0.999, 1e-7  # Keras 3 Adam defaults


# --- Keras 3 models -----------------------------------------------------------------------------
def keras_mlp(seed: int, features: int, width: int, depth: int, classes: int):
  """An MLP classifier and its (built) Adam optimizer."""
  keras.utils.set_random_seed(seed)
  layers = [keras.Input((features,))]
  layers += [keras.layers.Dense(width, activation='relu', name=f'hidden_{i}') for i in range(depth)]
  layers.append(keras.layers.Dense(classes, name='logits'))
  return _with_adam(keras.Sequential(layers))


def keras_cnn(seed: int, image: int, channels: int, filters: List[int], classes: int):
  """Conv/BatchNorm/ReLU/MaxPool blocks, global average pooling, a Dense head; and Adam."""
  keras.utils.set_random_seed(seed)
  layers = [keras.Input((image, image, channels))]
  for i, f in enumerate(filters):
    layers += [
      keras.layers.Conv2D(f, 3, padding='same', name=f'conv_{i}'),
      keras.layers.BatchNormalization(name=f'bn_{i}'),
      keras.layers.ReLU(name=f'relu_{i}'),
      keras.layers.MaxPooling2D(2, name=f'pool_{i}'),
    ]
  layers += [
    keras.layers.GlobalAveragePooling2D(name='gap'),
    keras.layers.Dense(classes, name='head'),
  ]
  return _with_adam(keras.Sequential(layers))


def _with_adam(model):
  optimizer = keras.optimizers.Adam(LEARNING_RATE)
  optimizer.build(model.trainable_variables)
  return model, optimizer


def variable_key(model, variable) -> str:
  """A variable's Keras path without the model's own name (Sequential models prefix it)."""
  path = variable.path
  prefix = model.name + '/'
  return path[len(prefix) :] if path.startswith(prefix) else path


def initial_weights(model) -> Dict[str, np.ndarray]:
  """Keras variable path (see variable_key) -> value: what the plain-TF twin starts from."""
  return {variable_key(model, v): np.array(v.numpy()) for v in model.variables}


# --- plain-TF models ----------------------------------------------------------------------------
MakeVariable = Callable[[str, np.ndarray], tf.Variable]


def make_tf_variable(name: str, value: np.ndarray) -> tf.Variable:
  return tf.Variable(value, name=name.replace('/', '_'))


class PlainModel:
  """Weights (dict: Keras path -> variable) and a forward function with Keras 3's math.

  `forward(model, x)` returns logits and may assign non-trainable state
  (BatchNorm moving statistics).
  """

  def __init__(
    self,
    weights: Dict[str, np.ndarray],
    trainable: List[str],
    forward,
    make_variable: MakeVariable = make_tf_variable,
  ):
    self.variables = {name: make_variable(name, value) for name, value in weights.items()}
    self.trainable_names = list(trainable)
    self._forward = forward

  @property
  def trainable(self) -> List[tf.Variable]:
    return [self.variables[n] for n in self.trainable_names]

  def __call__(self, x):
    return self._forward(self.variables, x)


def _dense(v, name, x, activation=None):
  y = tf.matmul(x, v[f'{name}/kernel']) + v[f'{name}/bias']
  return activation(y) if activation is not None else y


def plain_mlp(weights, depth: int, make_variable: MakeVariable = make_tf_variable) -> PlainModel:
  def forward(v, x):
    for i in range(depth):
      x = _dense(v, f'hidden_{i}', x, tf.nn.relu)
    return _dense(v, 'logits', x)

  return PlainModel(weights, list(weights), forward, make_variable)


def _layer_norm(v, name, x):
  mean, variance = tf.nn.moments(x, axes=[-1], keepdims=True)
  return (x - mean) * tf.math.rsqrt(variance + LN_EPSILON) * v[f'{name}/gamma'] + v[f'{name}/beta']


def _attention(v, name, x):
  """keras.layers.MultiHeadAttention(x, x) without masks or dropout, einsum for einsum."""

  def project(part):
    return tf.einsum('abc,cde->abde', x, v[f'{name}/{part}/kernel']) + v[f'{name}/{part}/bias']

  query, key, value = project('query'), project('key'), project('value')
  query = query * (1.0 / math.sqrt(float(query.shape[-1])))
  scores = tf.nn.softmax(tf.einsum('aecd,abcd->acbe', key, query), axis=-1)
  heads = tf.einsum('acbe,aecd->abcd', scores, value)
  return (
    tf.einsum('abcd,cde->abe', heads, v[f'{name}/attention_output/kernel'])
    + v[f'{name}/attention_output/bias']
  )


def plain_transformer(
  weights, layers: int, make_variable: MakeVariable = make_tf_variable
) -> PlainModel:
  """The twin of examples/keras/transformer.build(): embedding, encoder layers, pooled head."""

  def forward(v, tokens):
    x = tf.gather(v['embed/embeddings'], tokens)
    for i in range(layers):
      x = _layer_norm(v, f'norm_attn_{i}', x + _attention(v, f'attn_{i}', x))
      hidden = _dense(v, f'ffn_in_{i}', x, tf.nn.relu)
      x = _layer_norm(v, f'norm_ffn_{i}', x + _dense(v, f'ffn_out_{i}', hidden))
    return _dense(v, 'head', tf.reduce_mean(x, axis=1))

  return PlainModel(weights, list(weights), forward, make_variable)


def plain_cnn(weights, blocks: int, make_variable: MakeVariable = make_tf_variable) -> PlainModel:
  """The twin of keras_cnn: BatchNorm in training mode (batch moments, moving statistics)."""

  def forward(v, x):
    for i in range(blocks):
      x = tf.nn.conv2d(x, v[f'conv_{i}/kernel'], 1, 'SAME') + v[f'conv_{i}/bias']
      mean, variance = tf.nn.moments(x, axes=[0, 1, 2])
      for stat, batch_value in (('moving_mean', mean), ('moving_variance', variance)):
        moving = v[f'bn_{i}/{stat}']
        moving.assign(moving * BN_MOMENTUM + batch_value * (1.0 - BN_MOMENTUM))
      x = tf.nn.batch_normalization(
        x, mean, variance, v[f'bn_{i}/beta'], v[f'bn_{i}/gamma'], BN_EPSILON
      )
      x = tf.nn.max_pool2d(tf.nn.relu(x), 2, 2, 'VALID')
    return _dense(v, 'head', tf.reduce_mean(x, axis=[1, 2]))

  trainable = [n for n in weights if 'moving_' not in n]
  return PlainModel(weights, trainable, forward, make_variable)


class PlainAdam:
  """Adam exactly as Keras 3 updates: slots laid out like their variables (via make_variable)."""

  def __init__(
    self,
    model: PlainModel,
    make_variable: MakeVariable = make_tf_variable,
    scalar_variable: MakeVariable = make_tf_variable,
  ):
    self.iterations = scalar_variable('adam/iteration', np.zeros((), np.float32))
    self.slots = [
      (
        make_variable(name, np.zeros(model.variables[name].shape, np.float32)),
        make_variable(name, np.zeros(model.variables[name].shape, np.float32)),
      )
      for name in model.trainable_names
    ]

  def apply(self, grads, variables) -> None:
    step = self.iterations + 1.0
    alpha = (
      LEARNING_RATE * tf.sqrt(1.0 - tf.pow(ADAM_BETA_2, step)) / (1.0 - tf.pow(ADAM_BETA_1, step))
    )
    for grad, var, (m, v) in zip(grads, variables, self.slots):
      # New slot values flow by data into the update, not through a second read of the slot:
      # under DTensor (TF 2.21, CPU) a read after an assign in the same function can see the
      # old value (measured: every weight but one kept its initial value).
      grad, squared = _dense_and_square(grad)
      old_m, old_v = tf.identity(m), tf.identity(v)
      new_m = old_m + (grad - old_m) * (1.0 - ADAM_BETA_1)
      new_v = old_v + (squared - old_v) * (1.0 - ADAM_BETA_2)
      m.assign(new_m)
      v.assign(new_v)
      var.assign_sub((new_m * alpha) / (tf.sqrt(new_v) + ADAM_EPSILON))
    self.iterations.assign(step)


def _dense_and_square(grad):
  """The gradient and its square as Keras 3 Adam takes them.

  For an embedding's IndexedSlices gradient Keras squares each slice before
  duplicate rows are summed (keras.ops.square maps over the slices), so a
  token seen twice adds g1^2 + g2^2 to the second moment, not (g1 + g2)^2.
  """
  if isinstance(grad, tf.IndexedSlices):
    rows = grad.dense_shape[0]
    return (
      tf.math.unsorted_segment_sum(grad.values, grad.indices, rows),
      tf.math.unsorted_segment_sum(tf.square(grad.values), grad.indices, rows),
    )
  return grad, tf.square(grad)


def plain_train_step(model: PlainModel, optimizer: PlainAdam):
  """The plain-TF training step: mean sparse softmax cross-entropy, GradientTape, Adam."""

  @tf.function
  def step(x, labels):
    with tf.GradientTape() as tape:
      logits = model(x)
      loss = tf.reduce_mean(
        tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits)
      )
    grads = tape.gradient(loss, model.trainable)
    optimizer.apply(grads, model.trainable)
    return loss

  return step
