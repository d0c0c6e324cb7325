"""The hand-written Keras training step the tests and the benchmarks share.

A Keras model and optimizer stepped by a `tf.function` the way a user writes one outside
`model.fit`: forward under a `GradientTape`, sparse cross-entropy on logits, the optimizer's
`apply_gradients`. `annotate(x)` marks the input's sharding (`tg.shard`) when given.
"""

from __future__ import annotations

from typing import Callable, Optional

import keras
import tensorflow as tf


def keras_train_step(model, optimizer, annotate: Optional[Callable] = None):
  """forward + GradientTape + `optimizer` as one tf.function of (x, labels) returning the loss."""
  loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

  @tf.function
  def step(x, labels):
    if annotate is not None:
      x = annotate(x)
    with tf.GradientTape() as tape:
      loss = loss_fn(labels, model(x, training=True))
    grads = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(grads, model.trainable_variables))
    return loss

  return step
