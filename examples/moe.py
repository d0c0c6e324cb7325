"""A GShard-style top-1 mixture-of-experts layer in plain TF, with its sharding annotations.

Tokens come in groups [G, S, M]; a gate picks one expert per token; tokens
are dispatched to [E, G, C, M] expert buffers (capacity C per group), each
expert runs a two-layer MLP, and the results are combined back to
[G, S, M]. Groups are split over 'model' and so are experts: the dispatch
and combine einsums move tokens between the two layouts, which is an
all-to-all (Lepikhin et al., 2020).

`Config` sizes the layer and says which expert-buffer dim 'model' splits
(experts, as GShard does, or capacity slots). Sizes need not divide the
mesh: 4 experts over 8 devices leave 4 devices with empty expert shards.
The module-level functions use `DEFAULT`, the layer the model tests train.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import tensorflow as tf

import tf_gspmd as tg
from tf_gspmd import P


@dataclasses.dataclass(frozen=True)
class Config:
  groups: int = 8
  tokens: int = 6
  d_model: int = 16
  experts: int = 4
  hidden: int = 32
  capacity: int = 3
  split: str = 'experts'  # the expert-buffer dim [E, G, C, M] 'model' splits: experts or capacity

  def __post_init__(self):
    if self.split not in ('experts', 'capacity'):
      raise ValueError(f"moe.Config: split must be 'experts' or 'capacity', got {self.split!r}.")

  @property
  def buffer_spec(self) -> P:
    """Sharding of the [E, G, C, M] expert buffers."""
    return P('model', None, None, None) if self.split == 'experts' else P(None, None, 'model', None)

  @property
  def weight_spec(self) -> P:
    """Sharding of the [E, ., .] expert weights: with the experts, else whole."""
    return P('model', None, None) if self.split == 'experts' else P(None, None, None)


DEFAULT = Config()
GROUPS, TOKENS, D_MODEL = DEFAULT.groups, DEFAULT.tokens, DEFAULT.d_model
EXPERTS, HIDDEN, CAPACITY = DEFAULT.experts, DEFAULT.hidden, DEFAULT.capacity


def weights(seed: int = 0, cfg: Config = DEFAULT):
  rng = np.random.RandomState(seed)
  m, e, h = cfg.d_model, cfg.experts, cfg.hidden
  return {
    'gate': tf.Variable(rng.randn(m, e).astype(np.float32) * 0.3, name='gate'),
    'w_in': tf.Variable(rng.randn(e, m, h).astype(np.float32) * 0.2, name='w_in'),
    'w_out': tf.Variable(rng.randn(e, h, m).astype(np.float32) * 0.2, name='w_out'),
  }


def annotate(w, mesh, cfg: Config = DEFAULT):
  tg.shard_variable(w['w_in'], mesh, cfg.weight_spec)
  tg.shard_variable(w['w_out'], mesh, cfg.weight_spec)


def moe_layer(x, w, mesh=None, cfg: Config = DEFAULT):
  """x: [G, S, M] -> [G, S, M]."""
  shard = (lambda t, spec: tg.shard(t, mesh, spec)) if mesh is not None else (lambda t, spec: t)
  x = shard(x, P('model', None, None))
  gates = tf.nn.softmax(tf.einsum('gsm,me->gse', x, w['gate']))
  expert = tf.argmax(gates, axis=-1, output_type=tf.int32)  # [G, S]
  chosen = tf.one_hot(expert, cfg.experts, dtype=tf.float32)  # [G, S, E]
  position = tf.cumsum(chosen, axis=1, exclusive=True) * chosen  # slot in its expert
  kept = chosen * tf.cast(position < cfg.capacity, tf.float32)
  slot = tf.one_hot(tf.cast(tf.reduce_sum(position, -1), tf.int32), cfg.capacity)  # [G, S, C]
  dispatch = tf.einsum('gse,gsc->gsec', kept, slot)  # [G, S, E, C]
  combine = dispatch * tf.reduce_sum(gates * kept, -1)[:, :, None, None]
  expert_in = shard(tf.einsum('gsec,gsm->egcm', dispatch, x), cfg.buffer_spec)
  hidden = tf.nn.relu(tf.einsum('egcm,emh->egch', expert_in, w['w_in']))
  expert_out = shard(tf.einsum('egch,ehm->egcm', hidden, w['w_out']), cfg.buffer_spec)
  return shard(tf.einsum('gsec,egcm->gsm', combine, expert_out), P('model', None, None))


def train_step(w, mesh=None, lr=0.1, cfg: Config = DEFAULT):
  @tf.function
  def step(x, target):
    with tf.GradientTape() as tape:
      loss = tf.reduce_mean(tf.square(moe_layer(x, w, mesh, cfg) - target))
    grads = tape.gradient(loss, list(w.values()))
    for var, grad in zip(w.values(), grads):
      var.assign_sub(lr * grad)
    return loss

  return step


def batch(seed: int, cfg: Config = DEFAULT):
  rng = np.random.RandomState(seed)
  shape = (cfg.groups, cfg.tokens, cfg.d_model)
  return rng.randn(*shape).astype(np.float32), rng.randn(*shape).astype(np.float32)
