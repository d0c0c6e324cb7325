"""Plan two of the GSPMD paper's configurations (in kind) at 2048 devices, without devices.

1. A dense transformer with 2-D weight sharding (GSPMD paper, section 5):
   mesh X x Y = 64 x 32, activations [B, S, M] batch over X and model dim over
   Y, every weight split over both axes (its model dim over X, its heads or
   hidden dim over Y), so one device holds 1/2048 of every weight and of its
   Adam slots; 8 layers of attention + feed-forward, ~26 GB of f32 weights.
2. A GShard mixture of experts (examples/moe.py's layer): 2048 experts, one
   per device along a single axis of 2048, groups of tokens over the same
   axis (dispatch and combine are all-to-alls), ~137 GB of expert weights.

Each is one Adam training step; weights and slots are `tg.abstract_variable`s
(nothing allocated), arguments `tf.TensorSpec`s. `tg.plan` captures,
propagates and partitions the step and prints its per-device bytes and
collectives. The same builders with real variables at small sizes are what
tests/test_planning.py partitions and runs on 8 devices.

Run: .venv/bin/python examples/plan_2048.py
"""

from __future__ import annotations

import dataclasses
import os
import resource
import sys
import time

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import moe  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_gspmd as tg  # noqa: E402
from tf_gspmd import Mesh, NamedSharding, P  # noqa: E402
from tf_gspmd.auto_shard.fit import adam_step  # noqa: E402  (one Adam step, no bias correction)


# --- variables: abstract (planning) or real (running) ----------------------------------------
def abstract_variables(name, shape, sharding, trainable=True):
  return tg.abstract_variable(shape, tf.float32, sharding, name=name, trainable=trainable)


def real_variables(seed: int = 0):
  """A factory of small random (zero for slots) variables annotated like the abstract ones."""
  rng = np.random.RandomState(seed)

  def make(name, shape, sharding, trainable=True):
    value = (
      (rng.randn(*shape) / np.sqrt(shape[0])).astype(np.float32)
      if trainable
      else np.zeros(shape, np.float32)
    )
    return tg.shard_variable(tf.Variable(value, name=name, trainable=trainable), sharding)

  return make


def with_adam_slots(make, params: dict, shardings: dict) -> dict:
  """Adam's two slots (first and second moments) per parameter, laid out like it."""
  return {
    name: (
      make(f'{name}_m', p.shape, shardings[name], trainable=False),
      make(f'{name}_v', p.shape, shardings[name], trainable=False),
    )
    for name, p in params.items()
  }


@dataclasses.dataclass
class Built:
  """A training step to plan or partition: the step, its argument specs and shardings."""

  step: object
  arg_specs: list
  in_shardings: list
  params: dict
  slots: dict


# --- 1. dense transformer, 2-D weight sharding ------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Dense:
  layers: int = 8
  batch: int = 256
  seq: int = 1024
  d_model: int = 8192
  heads: int = 64
  d_head: int = 128
  hidden: int = 32768
  compute_dtype: str = 'float32'  # 'bfloat16': f32 weights cast for the layer, as the paper ran

  def parameter_count(self) -> int:
    """The closed form: 4 attention projections [M, N, D] and 2 feed-forward [M, H] per layer."""
    return self.layers * (
      4 * self.d_model * self.heads * self.d_head + 2 * self.d_model * self.hidden
    )


def dense_transformer(mesh: Mesh, cfg: Dense, make) -> Built:
  """Mesh axes ('X', 'Y'); batch over X, every weight over X and Y."""
  m, n, d, h = cfg.d_model, cfg.heads, cfg.d_head, cfg.hidden
  specs = {
    'wq': P('X', 'Y', None),
    'wk': P('X', 'Y', None),
    'wv': P('X', 'Y', None),
    'wo': P('Y', None, 'X'),
    'w1': P('X', 'Y'),
    'w2': P('Y', 'X'),
  }
  shapes = {
    'wq': (m, n, d),
    'wk': (m, n, d),
    'wv': (m, n, d),
    'wo': (n, d, m),
    'w1': (m, h),
    'w2': (h, m),
  }
  params, shardings = {}, {}
  for layer in range(cfg.layers):
    for key, spec in specs.items():
      name = f'layer{layer}_{key}'
      shardings[name] = NamedSharding(mesh, spec)
      params[name] = make(name, shapes[key], shardings[name])
  slots = with_adam_slots(make, params, shardings)
  act = P('X', None, 'Y')
  dtype = tf.as_dtype(cfg.compute_dtype)

  def loss_fn(x, target):
    x = tf.cast(x, dtype)
    for layer in range(cfg.layers):
      w = {key: tf.cast(params[f'layer{layer}_{key}'], dtype) for key in specs}
      q = tf.einsum('bsm,mnd->bsnd', x, w['wq'])
      k = tf.einsum('bsm,mnd->bsnd', x, w['wk'])
      v = tf.einsum('bsm,mnd->bsnd', x, w['wv'])
      scale = tf.constant(1.0 / np.sqrt(d), dtype)
      probs = tf.nn.softmax(tf.einsum('bsnd,btnd->bnst', q, k) * scale)
      attended = tf.einsum('bnst,btnd->bsnd', probs, v)
      x = tg.shard(x + tf.einsum('bsnd,ndm->bsm', attended, w['wo']), mesh, act)
      hid = tf.nn.relu(tf.einsum('bsm,mh->bsh', x, w['w1']))
      x = tg.shard(x + tf.einsum('bsh,hm->bsm', hid, w['w2']), mesh, act)
    return tf.reduce_mean(tf.square(tf.cast(x, tf.float32) - target))

  spec = tf.TensorSpec([cfg.batch, cfg.seq, m], tf.float32)
  return Built(
    adam_step(loss_fn, params, slots), [spec, spec], [NamedSharding(mesh, act)] * 2, params, slots
  )


# --- 2. GShard MoE, experts over one axis ------------------------------------------------------
def moe_config(devices: int) -> moe.Config:
  """GShard's layer in kind: one expert and one group of 1024 tokens per device, M=1024, H=8192."""
  return moe.Config(
    groups=devices,
    tokens=1024,
    d_model=1024,
    experts=devices,
    hidden=8192,
    capacity=2 * 1024 // devices or 1,
  )


def moe_parameter_count(cfg: moe.Config) -> tuple:
  """(replicated gate parameters, expert parameters split over the experts)."""
  return cfg.d_model * cfg.experts, 2 * cfg.experts * cfg.d_model * cfg.hidden


def gshard_moe(mesh: Mesh, cfg: moe.Config, make) -> Built:
  """Mesh axis ('model',): experts and groups over it; the gate replicated."""
  shardings = {
    'gate': NamedSharding(mesh, P(None, None)),
    'w_in': NamedSharding(mesh, cfg.weight_spec),
    'w_out': NamedSharding(mesh, cfg.weight_spec),
  }
  shapes = {
    'gate': (cfg.d_model, cfg.experts),
    'w_in': (cfg.experts, cfg.d_model, cfg.hidden),
    'w_out': (cfg.experts, cfg.hidden, cfg.d_model),
  }
  params = {name: make(name, shapes[name], shardings[name]) for name in shapes}
  slots = with_adam_slots(make, params, shardings)

  def loss_fn(x, target):
    return tf.reduce_mean(tf.square(moe.moe_layer(x, params, mesh, cfg) - target))

  spec = tf.TensorSpec([cfg.groups, cfg.tokens, cfg.d_model], tf.float32)
  groups = NamedSharding(mesh, P('model', None, None))
  return Built(adam_step(loss_fn, params, slots), [spec, spec], [groups, groups], params, slots)


def plan(built: Built, mesh: Mesh) -> tg.PlanReport:
  return tg.plan(built.step, *built.arg_specs, mesh=mesh, in_shardings=built.in_shardings)


def main():
  start = time.perf_counter()
  dense_mesh = Mesh.create((64, 32), ('X', 'Y'))
  dense = Dense()
  report = plan(dense_transformer(dense_mesh, dense, abstract_variables), dense_mesh)
  print(report)
  print(
    f'closed form: {dense.parameter_count() * 4:,} parameter bytes / 2048 = '
    f'{dense.parameter_count() * 4 // 2048:,} per device; Adam slots twice that\n'
  )

  moe_mesh = Mesh.create((2048,), ('model',))
  cfg = moe_config(2048)
  report = plan(gshard_moe(moe_mesh, cfg, abstract_variables), moe_mesh)
  print(report)
  gate, experts = moe_parameter_count(cfg)
  print(
    f'closed form: gate {gate * 4:,} bytes on every device + experts '
    f'{experts * 4:,} bytes / 2048 = {(gate + experts // 2048) * 4:,} per device\n'
  )
  rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
  print(f'both planned in {time.perf_counter() - start:.1f} s, peak RSS {rss:.0f} MB')


if __name__ == '__main__':
  main()
