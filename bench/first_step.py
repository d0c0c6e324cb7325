"""Time to first step, phase by phase: tf_gspmd against TF unpartitioned (and Keras on JAX).

Models (Keras 3, built here):
  resnet       a residual CNN: a 3x3 stem conv, `--blocks` residual blocks of
               conv-BN-ReLU-conv-BN + skip + ReLU (2 convs each; 24 blocks = 50 layers
               with the stem and the Dense head), global average pooling, a Dense head;
               64x64x3 images, batch 32, data parallel over 8 devices (mesh data=8).
  transformer  a transformer encoder classifier (examples/keras/transformer.py): seq 64,
               d_model 128, 4 heads, ff 512, 2 layers, vocab 256, batch 32, data
               parallel over 8.

Each is trained by Keras `train_on_batch`: once under `tf_gspmd.partition_model`
on 8 logical CPU devices, once unpartitioned on TF (same process, fresh models).
For tf_gspmd the first step is split into phases by timing the pipeline's stages
(hooks around the stage functions, no change to what runs):
  capture      tracing the Keras train_step to a FuncGraph and reading it into the IR
  propagate    sharding propagation
  build        layouts, sharded variables made and scattered to the devices
  partition    the partitioner walking the IR, emitting the per-partition ops
  trace        the rest of tracing the per-partition tf.function (autograph, FuncGraph)
  launch trace tracing the outer launch function (split, N calls, assemble)
  instantiate  TF's function instantiation and first run (first call of the outer
               function minus a steady-state step)
  other        the rest of the first train_on_batch (Keras, mirror of variables)
Keras on JAX runs in a subprocess with /work/main/.jaxenv/bin/python when that
environment has Keras; otherwise it is reported as skipped, with the reason.

The machine is shared: the tf_gspmd and TF runs are taken side by side per
repeat (--repeats, each in a fresh subprocess so nothing is cached), and the
medians are printed.

  .venv/bin/python bench/first_step.py [--models resnet,transformer] [--blocks 24]
                                       [--repeats 3] [--json PATH]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')  # before TensorFlow is first imported
os.environ.setdefault('KERAS_BACKEND', 'tensorflow')

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
NUM_DEVICES = 8
JAX_PYTHON = os.path.join(ROOT, '.jaxenv', 'bin', 'python')
RESULT_PREFIX = 'FIRST_STEP_RESULT '
PHASES = ('capture', 'propagate', 'build', 'partition', 'trace', 'launch trace', 'instantiate')
CONFIGS = {
  'resnet': dict(batch=32, image=64, channels=3, filters=16, blocks=24, classes=10),
  'transformer': dict(batch=32, vocab=256, seq=64, d_model=128, heads=4, ff=512, layers=2),
}


# ---------------------------------------------------------------- models (any Keras backend)
def build_model(name: str, cfg: dict, seed: int = 0):
  """The compiled Keras model and one batch (x, y) for it."""
  import keras
  import numpy as np

  keras.utils.set_random_seed(seed)
  rng = np.random.RandomState(1)
  if name == 'resnet':
    model = residual_cnn(cfg)
    x = rng.randn(cfg['batch'], cfg['image'], cfg['image'], cfg['channels']).astype(np.float32)
    y = rng.randint(0, cfg['classes'], cfg['batch']).astype(np.int32)
  else:
    model = transformer_classifier(cfg)
    x = rng.randint(0, cfg['vocab'], (cfg['batch'], cfg['seq'])).astype(np.int32)
    y = rng.randint(0, cfg['vocab'], cfg['batch']).astype(np.int32)
  model.compile(
    optimizer=keras.optimizers.Adam(1e-3),
    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
  )
  return model, x, y


def residual_cnn(cfg: dict):
  import keras

  layers = keras.layers
  inputs = keras.Input((cfg['image'], cfg['image'], cfg['channels']))
  f = cfg['filters']
  x = layers.ReLU()(layers.BatchNormalization()(layers.Conv2D(f, 3, padding='same')(inputs)))
  for i in range(cfg['blocks']):
    h = layers.Conv2D(f, 3, padding='same', name=f'block{i}_conv_a')(x)
    h = layers.ReLU()(layers.BatchNormalization(name=f'block{i}_bn_a')(h))
    h = layers.Conv2D(f, 3, padding='same', name=f'block{i}_conv_b')(h)
    h = layers.BatchNormalization(name=f'block{i}_bn_b')(h)
    x = layers.ReLU()(layers.Add()([x, h]))
  x = layers.GlobalAveragePooling2D()(x)
  return keras.Model(inputs, layers.Dense(cfg['classes'], name='head')(x))


def transformer_classifier(cfg: dict):
  import keras

  layers = keras.layers
  tokens = keras.Input((cfg['seq'],), dtype='int32')
  x = layers.Embedding(cfg['vocab'], cfg['d_model'], name='embed')(tokens)
  for i in range(cfg['layers']):
    attn = layers.MultiHeadAttention(
      cfg['heads'], cfg['d_model'] // cfg['heads'], name=f'attn_{i}'
    )(x, x)
    x = layers.LayerNormalization(name=f'norm_attn_{i}')(x + attn)
    hidden = layers.Dense(cfg['ff'], activation='relu', name=f'ffn_in_{i}')(x)
    x = layers.LayerNormalization(name=f'norm_ffn_{i}')(
      x + layers.Dense(cfg['d_model'], name=f'ffn_out_{i}')(hidden)
    )
  logits = layers.Dense(cfg['vocab'], name='head')(layers.GlobalAveragePooling1D()(x))
  return keras.Model(tokens, logits)


# ---------------------------------------------------------------- phase timing (tf_gspmd)
class PhaseTimer:
  """Wraps the pipeline's stage functions to add up the seconds spent in each phase."""

  def __init__(self):
    self.seconds = collections.Counter()
    self.cpu = collections.Counter()  # process CPU seconds: robust to other processes' load
    self._depth = collections.Counter()
    self._undo = []

  def _wrap(self, owner, attr: str, phase: str):
    original = getattr(owner, attr)
    timer = self

    def timed(*args, **kwargs):
      timer._depth[phase] += 1
      start, start_cpu = time.perf_counter(), time.process_time()
      try:
        return original(*args, **kwargs)
      finally:
        timer._depth[phase] -= 1
        if timer._depth[phase] == 0:  # outermost only (the partitioner recurses)
          timer.seconds[phase] += time.perf_counter() - start
          timer.cpu[phase] += time.process_time() - start_cpu

    setattr(owner, attr, timed)
    self._undo.append((owner, attr, original))

  @contextlib.contextmanager
  def installed(self):
    from tf_gspmd import partitioned
    from tf_gspmd.graph import capture
    from tf_gspmd.graph_rewrite import partitioner
    from tf_gspmd.propagation import api
    from tf_gspmd.runtime import launcher

    self._wrap(capture, 'capture', 'capture')
    self._wrap(api, 'propagate_captured', 'propagate')
    self._wrap(partitioned.PartitionedFunction, '_build', 'build')
    self._wrap(partitioner.Partitioner, 'run_graph', 'partition')
    self._wrap(launcher, 'trace_per_partition', 'partition+trace')
    self._wrap_outer(launcher.SpmdProgram)
    try:
      yield self
    finally:
      for owner, attr, original in reversed(self._undo):
        setattr(owner, attr, original)
      self._undo.clear()

  def _wrap_outer(self, spmd_cls):
    """The outer launch function: its tracing, then its first call (instantiate + run)."""
    original = spmd_cls._outer_function  # noqa: SLF001
    timer = self

    def outer_function(program_self, *args, **kwargs):
      outer = original(program_self, *args, **kwargs)
      return _FirstCallTimer.wrap(outer, timer)

    spmd_cls._outer_function = outer_function  # noqa: SLF001
    self._undo.append((spmd_cls, '_outer_function', original))

  def phases(self, steady: float, cpu: bool = False) -> dict:
    """Seconds per phase (wall clock, or process CPU with `cpu`); `steady`: one later step."""
    s = dict(self.cpu if cpu else self.seconds)
    out = {p: s.get(p, 0.0) for p in ('capture', 'propagate', 'partition')}
    out['build'] = s.get('build', 0.0)  # _build traces nothing: it makes layouts and shards
    out['trace'] = s.get('partition+trace', 0.0) - s.get('partition', 0.0)
    out['launch trace'] = s.get('launch trace', 0.0)
    out['instantiate'] = max(0.0, s.get('first call', 0.0) - steady)
    return out


class _FirstCallTimer:
  """A tf.function stand-in timing its first call as tracing + (instantiation and one run)."""

  _seen = set()

  def __init__(self, outer, timer):
    self._outer, self._timer, self._done = outer, timer, False

  @classmethod
  def wrap(cls, outer, timer):
    return cls(outer, timer)

  def __call__(self, *args):
    if self._done or id(self._outer) in self._seen:
      return self._outer(*args)
    self._done = True
    self._seen.add(id(self._outer))
    start, start_cpu = time.perf_counter(), time.process_time()
    concrete = self._outer.get_concrete_function(*args)
    self._timer.seconds['launch trace'] += time.perf_counter() - start
    self._timer.cpu['launch trace'] += time.process_time() - start_cpu
    start, start_cpu = time.perf_counter(), time.process_time()
    out = self._outer(*args)
    for t in _flat(out):
      t.numpy()
    self._timer.seconds['first call'] += time.perf_counter() - start
    self._timer.cpu['first call'] += time.process_time() - start_cpu
    del concrete
    return out

  def __getattr__(self, name):
    return getattr(self._outer, name)


def _flat(out):
  import tensorflow as tf

  return [t for t in tf.nest.flatten(out) if hasattr(t, 'numpy')]


# ---------------------------------------------------------------- one run (a child process)
def configure_logical_cpus(n: int) -> None:
  import tensorflow as tf

  try:
    tf.config.set_logical_device_configuration(
      tf.config.list_physical_devices('CPU')[0], [tf.config.LogicalDeviceConfiguration()] * n
    )
  except RuntimeError:
    pass  # already initialized (pytest's conftest did it)


def _timed_steps(model, x, y, steps: int) -> tuple:
  """(seconds of the first train_on_batch, median seconds of the next `steps`, and the same
  two in process CPU seconds)."""
  start, start_cpu = time.perf_counter(), time.process_time()
  model.train_on_batch(x, y)
  first, first_cpu = time.perf_counter() - start, time.process_time() - start_cpu
  times, cpu = [], []
  for _ in range(steps):
    start, start_cpu = time.perf_counter(), time.process_time()
    model.train_on_batch(x, y)
    times.append(time.perf_counter() - start)
    cpu.append(time.process_time() - start_cpu)
  median = lambda t: statistics.median(t) if t else 0.0  # noqa: E731
  return first, median(times), first_cpu, median(cpu)


def run_tf(name: str, cfg: dict, steps: int = 3) -> dict:
  """TF unpartitioned: first train_on_batch and a steady step."""
  model, x, y = build_model(name, cfg)
  first, steady, first_cpu, steady_cpu = _timed_steps(model, x, y, steps)
  return {'first_s': first, 'step_s': steady, 'first_cpu_s': first_cpu, 'step_cpu_s': steady_cpu}


def run_tf_gspmd(name: str, cfg: dict, steps: int = 3) -> dict:
  """tf_gspmd (partition_model over data=8): first step, its phases, a steady step."""
  sys.path.insert(0, ROOT)
  import tf_gspmd as tg

  model, x, y = build_model(name, cfg)
  tg.partition_model(model, tg.Mesh.create((NUM_DEVICES,), ('data',)))
  timer = PhaseTimer()
  with timer.installed():
    start, start_cpu = time.perf_counter(), time.process_time()
    model.train_on_batch(x, y)
    first, first_cpu = time.perf_counter() - start, time.process_time() - start_cpu
  _, steady, _, steady_cpu = _timed_steps(model, x, y, steps)
  # The launch's steady share is the whole step's; the instantiate phase is first call - step.
  phases = timer.phases(steady)
  phases['other'] = max(0.0, first - sum(phases.values()))
  phases_cpu = timer.phases(steady_cpu, cpu=True)
  phases_cpu['other'] = max(0.0, first_cpu - sum(phases_cpu.values()))
  return {
    'first_s': first,
    'step_s': steady,
    'phases': phases,
    'first_cpu_s': first_cpu,
    'step_cpu_s': steady_cpu,
    'phases_cpu': phases_cpu,
  }


def run_jax(name: str, cfg: dict, steps: int = 3) -> dict:
  """Keras 3 on JAX (one device, jit): first train_on_batch and a steady step."""
  model, x, y = build_model(name, cfg)
  first, steady, first_cpu, steady_cpu = _timed_steps(model, x, y, steps)
  return {'first_s': first, 'step_s': steady, 'first_cpu_s': first_cpu, 'step_cpu_s': steady_cpu}


def child(system: str, name: str, cfg: dict) -> None:
  if system != 'jax':
    configure_logical_cpus(NUM_DEVICES)
  run = {'tf_gspmd': run_tf_gspmd, 'tf': run_tf, 'jax': run_jax}[system]
  print(RESULT_PREFIX + json.dumps(run(name, cfg)), flush=True)


# ---------------------------------------------------------------- parent
def jax_keras_missing() -> str:
  """Why Keras on JAX cannot run here ('' when it can)."""
  if not os.path.exists(JAX_PYTHON):
    return f'{JAX_PYTHON} does not exist'
  probe = subprocess.run(
    [JAX_PYTHON, '-c', 'import keras, jax'],
    capture_output=True,
    text=True,
    check=False,
    env=dict(os.environ, KERAS_BACKEND='jax'),
  )
  if probe.returncode != 0:
    return (
      ".jaxenv has jax but no keras (not installed, to keep tests/test_xla_reference.py's "
      'environment as it is)'
    )
  return ''


def spawn(system: str, name: str, cfg: dict, timeout: float = 1800) -> dict:
  python = JAX_PYTHON if system == 'jax' else sys.executable
  env = dict(os.environ, KERAS_BACKEND='jax' if system == 'jax' else 'tensorflow')
  proc = subprocess.run(
    [python, os.path.abspath(__file__), '--child', system, name, json.dumps(cfg)],
    capture_output=True,
    text=True,
    timeout=timeout,
    env=env,
    check=False,
  )
  for line in proc.stdout.splitlines():
    if line.startswith(RESULT_PREFIX):
      return json.loads(line[len(RESULT_PREFIX) :])
  return {'error': (proc.stderr.strip().splitlines() or ['no output'])[-1]}


def measure(models, repeats: int, cfg_overrides: dict) -> dict:
  skip_jax = jax_keras_missing()
  results = {}
  for name in models:
    cfg = dict(CONFIGS[name], **{k: v for k, v in cfg_overrides.items() if k in CONFIGS[name]})
    runs = collections.defaultdict(list)
    for _ in range(repeats):  # side by side: one of each per repeat
      for system in ('tf_gspmd', 'tf') + (() if skip_jax else ('jax',)):
        runs[system].append(spawn(system, name, cfg))
    results[name] = {'config': cfg, 'jax_skipped': skip_jax or None}
    for system, rs in runs.items():
      ok = [r for r in rs if 'error' not in r]
      if not ok:
        results[name][system] = {'error': rs[0]['error']}
        continue
      summary = {
        k: statistics.median(r[k] for r in ok)
        for k in ('first_s', 'step_s', 'first_cpu_s', 'step_cpu_s')
      }
      summary['runs'] = len(ok)
      for phases in ('phases', 'phases_cpu'):
        if phases in ok[0]:
          summary[phases] = {p: statistics.median(r[phases][p] for r in ok) for p in ok[0][phases]}
      results[name][system] = summary
  return results


def report(results: dict) -> None:
  for name, r in results.items():
    print(f'\n{name} {r["config"]}')
    g, t = r.get('tf_gspmd', {}), r.get('tf', {})
    for system in ('tf_gspmd', 'tf', 'jax'):
      s = r.get(system)
      if s is None:
        continue
      if 'error' in s:
        print(f'  {system:<9} error: {s["error"]}')
        continue
      print(
        f'  {system:<9} first step {s["first_s"]:7.2f} s ({s["first_cpu_s"]:6.2f} CPU s)   '
        f'steady step {1e3 * s["step_s"]:8.1f} ms ({1e3 * s["step_cpu_s"]:7.1f} CPU ms)   '
        f'(median of {s["runs"]})'
      )
    for phases, unit in (('phases', 's'), ('phases_cpu', 'CPU s')):
      if phases in g:
        print(
          f'  tf_gspmd phases ({unit}): ' + ', '.join(f'{p} {v:.2f}' for p, v in g[phases].items())
        )
    if 'first_s' in g and 'first_s' in t:
      print(
        f'  first step tf_gspmd / tf: {g["first_s"] / t["first_s"]:.1f}x wall, '
        f'{g["first_cpu_s"] / t["first_cpu_s"]:.1f}x CPU (goal <= 3x)'
      )
    if r.get('jax_skipped'):
      print(f'  Keras on JAX skipped: {r["jax_skipped"]}')
    elif 'first_s' in g and 'first_s' in r.get('jax', {}):
      print(
        f'  first step tf_gspmd / Keras-on-JAX: {g["first_s"] / r["jax"]["first_s"]:.1f}x '
        '(goal <= 1.5x)'
      )
  print(f'\n(shared machine: {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}; medians)')


def main(argv=None):
  argv = sys.argv[1:] if argv is None else argv
  if argv and argv[0] == '--child':
    child(argv[1], argv[2], json.loads(argv[3]))
    return
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--models', default='resnet,transformer')
  parser.add_argument('--blocks', type=int, default=None, help='residual blocks of resnet')
  parser.add_argument('--layers', type=int, default=None, help='layers of the transformer')
  parser.add_argument('--repeats', type=int, default=3)
  parser.add_argument('--json', default=None)
  flags = parser.parse_args(argv)
  overrides = {
    k: v for k, v in (('blocks', flags.blocks), ('layers', flags.layers)) if v is not None
  }
  results = measure(flags.models.split(','), flags.repeats, overrides)
  report(results)
  if flags.json:
    with open(flags.json, 'w') as f:
      json.dump(results, f, indent=1)


if __name__ == '__main__':
  main()
