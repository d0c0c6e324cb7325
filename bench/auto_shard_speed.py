"""How long does `tg.auto_shard` search, and what does it choose? Seconds and layouts per model.

Models (the searches tests/test_auto_shard.py and docs/auto_shard_and_pictures.md run):
  transformer1  examples/keras/transformer.py, 1 layer, mesh data=2 x model=4, budget 5%
                over the hand-written Megatron layout's bytes (the docs' search)
  transformer2  the same with 2 layers (the default of transformer.build)
  mlp           a Megatron-shaped MLP (d_model 132, hidden 1020), budget as above
  moe           examples/moe.py's layer (8 experts), budget 80% of the replicated layout's
  dense2048     the GSPMD paper's dense transformer, 1 layer, mesh X=64 x Y=32, budget 1.25x
                the paper's 2-D layout's bytes (tg.plan alone, no devices)

For each: the search's seconds, layouts it evaluated, and the chosen layout (each group's
spec and the inputs' batch axes) with its predicted cost and per-device bytes. Only the
public API is used, so the same script times any version of the search.

--measure: for transformer1, transformer2 and mlp, also the chosen layout's measured step
beside the hand-written Megatron layout's (fresh weights each, round-robin, 8 logical CPUs).

  .venv/bin/python bench/auto_shard_speed.py [model ...] [--measure]
"""

from __future__ import annotations

import importlib
import os
import sys
import time

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [ROOT, os.path.join(ROOT, 'examples'), os.path.join(ROOT, 'examples', 'keras')]

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_gspmd as tg  # noqa: E402
from tf_gspmd import Mesh, NamedSharding, P  # noqa: E402

auto = importlib.import_module('tf_gspmd.auto_shard')
MESH = Mesh.create((2, 4), ('data', 'model'))


def _estimate(step, specs, mesh, layouts, input_spec):
  """The cost model's Evaluation of `step` with `layouts` [(variable, P)] (then unannotated)."""
  for var, spec in layouts:
    tg.shard_variable(var, mesh, spec)
  shardings = [NamedSharding(mesh, P(input_spec, *[None] * (len(s.shape) - 1))) for s in specs]
  try:
    return auto.estimate(tg.plan(step, *specs, mesh=mesh, in_shardings=shardings))
  finally:
    for var, _ in layouts:
      _clear(var)


def _clear(var):
  from tf_gspmd.annotations import _VARIABLE_ATTR, _tf_variable

  var = _tf_variable(var)
  setattr(var, _VARIABLE_ATTR, None)
  if hasattr(var, '_set_xla_sharding'):
    var._set_xla_sharding(None)


def transformer(layers):
  step, specs, megatron, _ = transformer_parts(layers)
  budget = int(_estimate(step, specs, MESH, megatron, 'data').memory * 1.05)
  return step, specs, MESH, budget


def transformer_parts(layers):
  """(step, specs, the hand-written Megatron layout [(variable, P)], {name: variable})."""
  module = importlib.import_module('transformer')
  model, optimizer = module.build(seed=0, layers=layers)
  step = module.train_step(model, optimizer)
  specs = [tf.TensorSpec((8, 8), tf.int32), tf.TensorSpec((8,), tf.int32)]
  rules = module.layout(MESH)
  megatron = [(v, rules[v.path]) for v in model.variables if rules[v.path] is not None]
  return step, specs, megatron, _named(model.variables)


def _named(variables) -> dict:
  """Variables by the names auto_shard's result gives them (their TF name, and path)."""
  from tf_gspmd.annotations import _tf_variable

  named = {}
  for v in variables:
    named[_tf_variable(v).name.split(':')[0]] = v
    if hasattr(v, 'path'):
      named[v.path] = v
  return named


def mlp():
  step, specs, megatron, _ = mlp_parts()
  budget = int(_estimate(step, specs, MESH, megatron, 'data').memory * 1.05)
  return step, specs, MESH, budget


def mlp_parts():
  rng = np.random.RandomState(0)
  w1 = tf.Variable(rng.randn(132, 1020).astype(np.float32) * 0.1, name='w1')
  w2 = tf.Variable(rng.randn(1020, 132).astype(np.float32) * 0.1, name='w2')
  optimizer = keras.optimizers.Adam(0.01)
  optimizer.build([w1, w2])

  @tf.function
  def step(x, y):
    with tf.GradientTape() as tape:
      loss = tf.reduce_mean(tf.square(tf.matmul(tf.nn.relu(tf.matmul(x, w1)), w2) - y))
    grads = tape.gradient(loss, [w1, w2])
    optimizer.apply_gradients(zip(grads, [w1, w2]))
    return loss

  specs = [tf.TensorSpec((256, 132))] * 2
  megatron = [(w1, P(None, 'model')), (w2, P('model', None))]
  return step, specs, megatron, _named([w1, w2])


def moe():
  module = importlib.import_module('moe')
  cfg = module.Config(groups=8, tokens=8, d_model=16, experts=8, hidden=64, capacity=2)
  step = module.train_step(module.weights(0, cfg), MESH, cfg=cfg)
  spec = tf.TensorSpec((cfg.groups, cfg.tokens, cfg.d_model))
  budget = int(_estimate(step, [spec, spec], MESH, [], 'data').memory * 0.8)
  return step, [spec, spec], MESH, budget


def dense2048():
  plan_2048 = importlib.import_module('plan_2048')
  mesh = Mesh.create((64, 32), ('X', 'Y'))
  cfg = plan_2048.Dense(layers=1)
  paper = plan_2048.dense_transformer(mesh, cfg, plan_2048.abstract_variables)
  paper = auto.estimate(
    tg.plan(paper.step, *paper.arg_specs, mesh=mesh, in_shardings=paper.in_shardings)
  )
  print(f"  the paper's 2-D layout: predicted {paper.cost:.3f} s, {paper.memory:,} bytes")

  def unannotated(name, shape, sharding, trainable=True):
    del sharding  # auto_shard chooses
    return tg.abstract_variable(shape, tf.float32, name=name, trainable=trainable)

  built = plan_2048.dense_transformer(mesh, cfg, unannotated)
  return built.step, built.arg_specs, mesh, int(paper.memory * 1.25)


MODELS = {
  'transformer1': lambda: transformer(1),
  'transformer2': lambda: transformer(2),
  'mlp': mlp,
  'moe': moe,
  'dense2048': dense2048,
}


def run(name: str) -> None:
  print(f'{name}:', flush=True)
  step, specs, mesh, budget = MODELS[name]()
  start = time.perf_counter()
  result = tg.auto_shard(step, *specs, mesh=mesh, memory_budget=budget)
  seconds = time.perf_counter() - start
  best = result.best
  print(
    f'  searched in {seconds:.1f} s, {result.evaluations} layouts evaluated; budget '
    f'{budget:,}; chosen: predicted {best.cost * 1e3:.3f} ms, {best.memory:,} bytes, '
    f'collective bytes {best.report.collective_bytes:,}'
  )
  for group, spec in zip(result.groups, best.choice):
    print(f'    {group.key:<44} {spec}')
  print(f'    {"<inputs: batch dim>":<44} {best.choice[-1]}', flush=True)
  return result


# Models whose chosen layout --measure times against the hand-written Megatron layout.
PARTS = {
  'transformer1': lambda: transformer_parts(1),
  'transformer2': lambda: transformer_parts(2),
  'mlp': mlp_parts,
}


def measure(name: str, result, steps: int = 15) -> None:
  """Time the chosen layout's step and the hand-written Megatron one (batch over 'data'),
  each on fresh weights, round-robin after two warm-up steps: medians in ms."""
  step, specs, _, named = PARTS[name]()
  # The model's variables; optimizer slots (not made yet in a fresh copy) follow their
  # variables by propagation, as in the search's plan.
  for var_name, sharding in result.model_shardings.items():
    if var_name in named:
      tg.shard_variable(named[var_name], result.mesh, sharding.spec)
  chosen = tg.partition(step, result.mesh, in_shardings=result.input_shardings, progress=False)
  step, specs, megatron, _ = PARTS[name]()
  for var, spec in megatron:
    tg.shard_variable(var, MESH, spec)
  by_data = [NamedSharding(MESH, P('data', *[None] * (s.shape.rank - 1))) for s in specs]
  written = tg.partition(step, MESH, in_shardings=by_data, progress=False)
  rng = np.random.RandomState(0)
  data = [
    rng.randn(*s.shape).astype(np.float32)
    if s.dtype == tf.float32
    else rng.randint(0, 64, s.shape).astype(s.dtype.as_numpy_dtype)
    for s in specs
  ]
  times: dict = {'chosen': [], 'megatron': []}
  for i in range(steps + 2):
    for label, fn in (('chosen', chosen), ('megatron', written)):
      start = time.perf_counter()
      np.asarray(fn(*data))
      if i >= 2:
        times[label].append(time.perf_counter() - start)
  ms = {k: 1e3 * float(np.median(v)) for k, v in times.items()}
  print(
    f'  measured ({steps} steps each, round-robin): chosen {ms["chosen"]:.1f} ms, hand-written '
    f'Megatron {ms["megatron"]:.1f} ms: chosen / Megatron {ms["chosen"] / ms["megatron"]:.2f}',
    flush=True,
  )


def main():
  names = [a for a in sys.argv[1:] if not a.startswith('--')] or list(MODELS)
  if '--measure' in sys.argv:
    tg.configure_cpu_devices(8, threads=1)  # as the step model of this CPU was fit
  for name in names:
    result = run(name)
    if '--measure' in sys.argv and name in PARTS:
      measure(name, result)


if __name__ == '__main__':
  main()
