"""Data parallel over 8 logical CPUs against what this machine allows, and against Keras on JAX.

Two models, each trained by Keras `train_on_batch` (forward, backward, optimizer):
  resnet50     keras.applications.ResNet50 (weights=None), 64x64x3, 10 classes, batch 32, SGD.
  transformer  a 2-layer transformer encoder classifier (bench/first_step.py's): seq 64,
               d_model 128, 8 heads, ff 512, vocab 256, batch 32, Adam.

The limit. N partitions on this machine's cores cannot beat one device doing the same
work: the least a data-parallel step can cost is N times the unpartitioned step at the
per-device batch (batch/N) plus the all-reduce of the gradients. Both terms are measured
here, in the same process as the partitioned step and round-robin with it:
  unpartitioned at batch/N   the same model, TF unpartitioned, on batch/N examples;
  all-reduce alone           tf_gspmd's own all-reduce of the gradient bytes (one f32
                             vector of the trainable parameter count per device, summed
                             over 8 devices), a partitioned program doing nothing else.
  limit = N x (unpartitioned at batch/N) + all-reduce; ratio = partitioned step / limit.

Side by side (each system in a fresh subprocess, so first steps are cold):
  tf_gspmd      `tg.partition_model(model, Mesh((8,), ('data',)))`: first step (with the
                pipeline's phases, bench/first_step.py's PhaseTimer), then steady steps
                round-robin with the unpartitioned model at batch and at batch/N and with
                the all-reduce. The first loss is compared with the unpartitioned model's
                first loss (same weights, same batch) through the oracle and printed.
  tf            TF unpartitioned: first step and steady step (a fresh process: the first
                step of a process that already ran TF would be cheaper).
  keras_jax     Keras 3 on JAX (.jaxenv), `keras.distribution.DataParallel` over 8 host
                devices, and the same model on one device, round-robin: its first step and
                its own partitioned / unpartitioned ratio.
  tf_gspmd_xla  the XLA backend (`partition_model(..., backend='xla')`, XLA:CPU through
                PJRT) beside XLA:CPU unpartitioned (Keras' jit_compile=True) and TF
                unpartitioned: which backend CPU should use.
  tf_gspmd_keras_xla  keras_jax's own code on TF under `tf_gspmd.keras.enable('xla')` (the
                same `keras.distribution.DataParallel`; the model made under it, its
                variables split from birth): the Keras path against Keras on JAX.
  tf_xla        Keras on TF with jit_compile=True, one device, no partitioning: TF's own
                route from a Keras step to XLA (TF's trace, TF -> XLA, XLA's compile), the
                floor under backend='xla''s first step.

  .venv/bin/python bench/limit.py [--models resnet50,transformer] [--steps 5] [--profile]
                                  [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from typing import Dict

import quick_children  # sibling: --quick's children forked, TF imported once

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')  # before TensorFlow is first imported

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
N = 8
PROFILE = os.environ.get('LIMIT_PROFILE') == '1'  # set by --profile for the children
RESULT = 'LIMIT_RESULT '
CONFIGS = {
  'resnet50': dict(batch=32, image=64, classes=10),
  'transformer': dict(batch=32, vocab=256, seq=64, d_model=128, heads=8, ff=512, layers=2),
}
QUICK = {'transformer': dict(batch=16, vocab=32, seq=8, d_model=16, heads=2, ff=32, layers=1)}


def build(name: str, cfg: dict, batch: int, seed: int = 0, jit_compile='auto'):
  """The compiled Keras model and a batch of `batch` examples (the first `batch` of the
  full batch, so the per-device batch is the same data a partition sees)."""
  import keras
  import numpy as np

  keras.utils.set_random_seed(seed)
  rng = np.random.RandomState(1)
  if name == 'resnet50':
    model = keras.applications.ResNet50(
      weights=None, input_shape=(cfg['image'],) * 2 + (3,), classes=cfg['classes']
    )
    x = rng.randn(cfg['batch'], cfg['image'], cfg['image'], 3).astype(np.float32)
    y = rng.randint(0, cfg['classes'], cfg['batch']).astype(np.int32)
    optimizer = keras.optimizers.SGD(0.01)
  else:
    sys.path.insert(0, HERE)
    import first_step

    model = first_step.transformer_classifier(cfg)
    x = rng.randint(0, cfg['vocab'], (cfg['batch'], cfg['seq'])).astype(np.int32)
    y = rng.randint(0, cfg['vocab'], cfg['batch']).astype(np.int32)
    optimizer = keras.optimizers.Adam(1e-3)
  model.compile(
    optimizer=optimizer,
    jit_compile=jit_compile,
    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
  )
  return model, x[:batch], y[:batch]


def parameter_count(model) -> int:
  return int(sum(int(v.numpy().size) for v in model.trainable_variables))


def timed(fn) -> float:
  start = time.perf_counter()
  fn()
  return time.perf_counter() - start


def round_robin(calls: dict, steps: int) -> dict:
  """Median seconds of each call (wall, and process CPU as '<name>_cpu'), the calls taken in
  turn (load from other processes hits all alike)."""
  for fn in calls.values():  # warm-up: one untimed call each
    fn()
  times = {k: [] for k in calls}
  cpu = {k: [] for k in calls}
  for _ in range(steps):
    for k, fn in calls.items():
      start = time.process_time()
      times[k].append(timed(fn))
      cpu[k].append(time.process_time() - start)
  medians = {k: statistics.median(v) for k, v in times.items()}
  medians.update({f'{k}_cpu': statistics.median(v) for k, v in cpu.items()})
  return medians


# ---------------------------------------------------------------- children
def configure_logical_cpus(n: int) -> None:
  """n logical CPUs; with --tf-threads T (LIMIT_TF_THREADS in the children), as
  `tg.configure_cpu_devices(n, threads=T)` makes them (every TF system alike)."""
  threads = os.environ.get('LIMIT_TF_THREADS', 'default')
  if threads != 'default':
    sys.path.insert(0, ROOT)
    from tf_gspmd.runtime.cpu_devices import configure_cpu_devices

    configure_cpu_devices(n, threads=int(threads))
    return
  import tensorflow as tf

  tf.config.set_logical_device_configuration(
    tf.config.list_physical_devices('CPU')[0], [tf.config.LogicalDeviceConfiguration()] * n
  )


def all_reduce_program(mesh, count: int):
  """A partitioned program whose only work is one all-reduce of `count` f32 per device."""
  import tensorflow as tf

  import tf_gspmd as tg

  grads = tf.Variable(tf.ones([N, count]), name='stacked_gradients')
  tg.shard_variable(grads, mesh, tg.P('data', None))

  @tf.function
  def reduce():
    # max of the sum: not linear, so the whole summed vector must be all-reduced first.
    return tf.reduce_max(tf.reduce_sum(grads, 0))

  program = tg.partition(reduce, mesh)
  return lambda: program().numpy(), program


def child_tf_gspmd(name: str, cfg: dict, steps: int) -> dict:
  configure_logical_cpus(N)
  sys.path.insert(0, ROOT)
  sys.path.insert(0, HERE)
  import first_step

  import tf_gspmd as tg
  from tf_gspmd.testing import oracle

  mesh = tg.Mesh.create((N,), ('data',))
  model, x, y = build(name, cfg, cfg['batch'])
  tg.partition_model(model, mesh)
  timer = first_step.PhaseTimer()
  with timer.installed():
    start = time.perf_counter()
    first_loss = model.train_on_batch(x, y)
    first = time.perf_counter() - start
  whole, _, _ = build(name, cfg, cfg['batch'])
  whole_loss = whole.train_on_batch(x, y)
  part, xs, ys = build(name, cfg, cfg['batch'] // N)
  count = parameter_count(model)
  reduce, reduce_program = all_reduce_program(mesh, count)
  medians = round_robin(
    {
      'partitioned': lambda: model.train_on_batch(x, y),
      'unpartitioned': lambda: whole.train_on_batch(x, y),
      'per_device_batch': lambda: part.train_on_batch(xs, ys),
      'all_reduce': reduce,
    },
    steps,
  )
  kinds = [r['kind'] for r in reduce_program.collectives()]
  verdict = oracle.check(
    oracle.as_float32(first_loss), oracle.as_float32(whole_loss), name='first loss'
  )
  phases = timer.phases(medians['partitioned'])
  phases['other'] = max(0.0, first - sum(phases.values()))
  profile = profile_step(lambda: model.train_on_batch(x, y)) if PROFILE else None
  return {
    'first_s': first,
    'phases': phases,
    'parameters': count,
    'all_reduce_collectives': kinds,
    'first_loss_error': verdict.error,
    'first_loss_ok': verdict.ok,
    'profile': profile,
    **{f'{k}_s': v for k, v in medians.items()},
  }


def child_tf_gspmd_xla(name: str, cfg: dict, steps: int) -> dict:
  """The XLA backend (`partition_model(..., backend='xla')`: the per-partition program compiled
  by XLA, run through PJRT on 8 CPU devices) beside XLA:CPU unpartitioned (Keras'
  jit_compile=True) and TF unpartitioned, round-robin."""
  configure_logical_cpus(N)
  sys.path.insert(0, ROOT)
  import tf_gspmd as tg

  model, x, y = build(name, cfg, cfg['batch'])
  tg.partition_model(model, tg.Mesh.create((N,), ('data',)), backend='xla', progress=False)
  first = timed(lambda: model.train_on_batch(x, y))
  xla, _, _ = build(name, cfg, cfg['batch'], jit_compile=True)
  xla_first = timed(lambda: xla.train_on_batch(x, y))
  whole, _, _ = build(name, cfg, cfg['batch'])
  medians = round_robin(
    {
      'partitioned': lambda: model.train_on_batch(x, y),
      'xla_unpartitioned': lambda: xla.train_on_batch(x, y),
      'unpartitioned': lambda: whole.train_on_batch(x, y),
    },
    steps,
  )
  return {'first_s': first, 'xla_first_s': xla_first, **{f'{k}_s': v for k, v in medians.items()}}


def child_tf_gspmd_keras_xla(name: str, cfg: dict, steps: int) -> dict:
  """Keras-on-JAX's child (`child_keras_jax`, the same code) on Keras with TF under
  `tf_gspmd.keras.enable('xla')`: the same `keras.distribution.DataParallel`, the model made
  under it (its variables split from birth, nothing copied back after a step), beside TF
  unpartitioned, round-robin."""
  configure_logical_cpus(N)
  sys.path.insert(0, ROOT)
  import tf_gspmd

  tf_gspmd.keras.enable('xla')
  return child_keras_jax(name, cfg, steps)


def child_tf(name: str, cfg: dict, steps: int) -> dict:
  configure_logical_cpus(N)
  model, x, y = build(name, cfg, cfg['batch'])
  first = timed(lambda: model.train_on_batch(x, y))
  steady = round_robin({'step': lambda: model.train_on_batch(x, y)}, steps)['step']
  return {'first_s': first, 'step_s': steady}


def child_tf_xla(name: str, cfg: dict, steps: int) -> dict:
  """Keras on TF with `jit_compile=True` on one device, in a fresh process: TF's own route from
  a Keras step to XLA, without partitioning (the floor of backend='xla''s first step: the
  same TF trace, TF -> XLA conversion and XLA compile, and no partitioner)."""
  configure_logical_cpus(N)
  model, x, y = build(name, cfg, cfg['batch'], jit_compile=True)
  first = timed(lambda: model.train_on_batch(x, y))
  steady = round_robin({'step': lambda: model.train_on_batch(x, y)}, steps)['step']
  return {'first_s': first, 'step_s': steady}


def child_keras_jax(name: str, cfg: dict, steps: int) -> dict:
  import keras

  devices = keras.distribution.list_devices()[:N]
  distribution = keras.distribution.DataParallel(devices=devices)
  with distribution.scope():
    model, x, y = build(name, cfg, cfg['batch'])

    def step():
      with distribution.scope():
        return model.train_on_batch(x, y)

    first = timed(step)
  whole, _, _ = build(name, cfg, cfg['batch'])
  medians = round_robin(
    {'partitioned': step, 'unpartitioned': lambda: whole.train_on_batch(x, y)}, steps
  )
  return {'first_s': first, **{f'{k}_s': v for k, v in medians.items()}}


# Events of TF's executor and eager runtime, not ops: left out of the per-kind times.
_RUNTIME_EVENTS = {
  'Process',
  'Run',
  'Start',
  'Done',
  'RunClosure',
  'ExecuteAsync',
  'Loop',
  'CompleteParams',
  'ParallelFor',
  'FunctionRun',
  'ExecutorDoneCallback',
}
_COLLECTIVE_OPS = (
  'CollectiveReduceV2',
  'CollectiveGatherV2',
  'CollectiveBcastSendV2',
  'CollectiveBcastRecvV2',
  'CollectiveAllToAllV2',
)


def profile_step(step, steps: int = 2) -> dict:
  """Where a step's time goes, from TF's profiler: per op kind (summed over devices and
  threads, per step), the collectives (their time includes the wait for the slowest peer:
  idle at the barrier), and the wall time."""
  import glob
  import shutil
  import tempfile

  import tensorflow as tf

  # TF's own profile format; the module path is TF's (tsl), read here only, in a bench.
  from tensorflow.tsl.profiler.protobuf import xplane_pb2

  where = tempfile.mkdtemp(prefix='limit_profile_')
  tf.profiler.experimental.start(where)
  start = time.perf_counter()
  for _ in range(steps):
    step()
  wall = (time.perf_counter() - start) / steps
  tf.profiler.experimental.stop()
  space = xplane_pb2.XSpace()
  with open(glob.glob(where + '/**/*.xplane.pb', recursive=True)[-1], 'rb') as f:
    space.ParseFromString(f.read())
  shutil.rmtree(where, ignore_errors=True)
  kinds: Dict[str, float] = {}
  for plane in space.planes:
    for line in plane.lines:
      for event in line.events:
        name = plane.event_metadata[event.metadata_id].name
        if ':' not in name:
          continue  # Python and runtime scopes, not an op
        kind = name.rsplit(':', 1)[1].strip()
        if kind in _RUNTIME_EVENTS or kind.startswith('__inference'):
          continue
        kinds[kind] = kinds.get(kind, 0.0) + event.duration_ps / 1e9 / steps
  collectives = sum(kinds.pop(k, 0.0) for k in _COLLECTIVE_OPS)
  top = sorted(kinds.items(), key=lambda kv: -kv[1])
  return {
    'wall_ms': 1e3 * wall,
    'collectives_ms': collectives,
    'ops_ms': sum(kinds.values()),
    'top_kinds_ms': top[:12],
  }


CHILDREN = {
  'tf_gspmd': child_tf_gspmd,
  'tf': child_tf,
  'tf_xla': child_tf_xla,
  'keras_jax': child_keras_jax,
  'tf_gspmd_xla': child_tf_gspmd_xla,
  'tf_gspmd_keras_xla': child_tf_gspmd_keras_xla,
}


# ---------------------------------------------------------------- parent
def jax_python():
  for candidate in (
    os.environ.get('TF_GSPMD_JAX_PYTHON'),
    os.path.join(ROOT, '.jaxenv', 'bin', 'python'),
  ):
    if candidate and os.path.exists(candidate):
      return candidate
  return None


def spawn(
  system: str, name: str, cfg: dict, steps: int, timeout: float, quick: bool = False
) -> dict:
  python, env = sys.executable, dict(os.environ, KERAS_BACKEND='tensorflow')
  if system == 'keras_jax':
    python = jax_python()
    if python is None:
      return {'error': 'no JAX venv (.jaxenv or $TF_GSPMD_JAX_PYTHON)'}
    env = dict(
      os.environ, KERAS_BACKEND='jax', XLA_FLAGS=f'--xla_force_host_platform_device_count={N}'
    )
  cmd = [python, os.path.abspath(__file__), '--child', system, name, json.dumps(cfg), str(steps)]
  start = time.perf_counter()
  try:
    proc = quick_children.run(cmd, env, ROOT, timeout, quick)
  except subprocess.TimeoutExpired:
    return {'error': f'timed out after {timeout:.0f} s'}
  print(f'  {name} / {system}: {time.perf_counter() - start:.0f} s', file=sys.stderr)
  for line in proc.stdout.splitlines():
    if line.startswith(RESULT):
      return json.loads(line[len(RESULT) :])
  sys.stderr.write(proc.stderr[-3000:])
  tail = [t for t in proc.stderr.splitlines() if t.strip()][-1:] or ['no output']
  return {'error': f'exit {proc.returncode}: {tail[0][:120]}'}


def cpu_model() -> str:
  try:
    with open('/proc/cpuinfo') as f:
      for line in f:
        if line.startswith('model name'):
          return line.split(':', 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or 'unknown'


def ms(seconds) -> str:
  return '-' if seconds is None else f'{1e3 * seconds:.0f} ms'


def report(name: str, cfg: dict, r: dict) -> list:
  g, t, j = r.get('tf_gspmd', {}), r.get('tf', {}), r.get('keras_jax', {})
  ran = lambda result: bool(result) and 'error' not in result  # noqa: E731
  lines = [f'{name} {cfg}, data parallel over {N}']
  for system, res in (('tf_gspmd', g), ('tf', t), ('keras_jax', j)):
    if 'error' in res:
      lines.append(f'  {system}: error: {res["error"]}')
  if ran(g):
    limit = N * g['per_device_batch_s'] + g['all_reduce_s']
    lines += [
      f'  tf_gspmd step                    {ms(g["partitioned_s"])}',
      f'  TF unpartitioned step            {ms(g["unpartitioned_s"])}',
      f'  limit = {N} x {ms(g["per_device_batch_s"])} (TF at batch {cfg["batch"] // N}) '
      f'+ {ms(g["all_reduce_s"])} (all-reduce of {g["parameters"] * 4 / 1e6:.1f} MB, '
      f'{len(g["all_reduce_collectives"])} collective) = {ms(limit)}',
      f'  step / limit                     {g["partitioned_s"] / limit:.2f} (goal <= 1.2)'
      if name == 'resnet50'
      else f'  step / limit                     {g["partitioned_s"] / limit:.2f}',
      f'  CPU: the step uses {ms(g["partitioned_cpu_s"])}; {N} x {ms(g["per_device_batch_cpu_s"])}'
      f' (TF at batch {cfg["batch"] // N}) = {ms(N * g["per_device_batch_cpu_s"])} over '
      f'{os.cpu_count()} cores: no step below '
      f'{ms(N * g["per_device_batch_cpu_s"] / os.cpu_count())} on TF kernels (TF '
      f'unpartitioned: {ms(g["unpartitioned_s"])})',
      f'  step / TF unpartitioned step     {g["partitioned_s"] / g["unpartitioned_s"]:.2f}'
      + (' (goal <= 1.0)' if name == 'transformer' else ''),
      f'  first loss vs unpartitioned: normwise error {g["first_loss_error"]:.1e} '
      f'({"ok" if g["first_loss_ok"] else "MISMATCH"})',
      '  phases of the first step (s): '
      + ', '.join(f'{k} {v:.2f}' for k, v in g['phases'].items()),
    ]
    if g.get('profile'):
      prof = g['profile']
      lines.append(
        f'  profile of one step ({prof["wall_ms"]:.0f} ms wall x {os.cpu_count()} '
        f'cores): ops {prof["ops_ms"]:.0f} ms summed over devices, collectives '
        f'{prof["collectives_ms"]:.0f} ms (with the wait at each barrier); by kind: '
        + ', '.join(f'{k} {v:.0f}' for k, v in prof['top_kinds_ms'])
      )
  if ran(j):
    lines.append(
      f'  Keras-on-JAX step {ms(j["partitioned_s"])}, unpartitioned '
      f'{ms(j["unpartitioned_s"])}: its own ratio '
      f'{j["partitioned_s"] / j["unpartitioned_s"]:.2f}'
    )
    if ran(g):
      lines.append(
        f'  tf_gspmd step / Keras-on-JAX step  '
        f'{g["partitioned_s"] / j["partitioned_s"]:.2f} (goal < 1.0)'
      )
  x = r.get('tf_gspmd_xla', {})
  if 'error' in x:
    lines.append(f'  tf_gspmd_xla: error: {x["error"]}')
  elif ran(x):
    lines += [
      f'  XLA backend step {ms(x["partitioned_s"])} (first step {x["first_s"]:.2f} s); XLA:CPU '
      f'unpartitioned {ms(x["xla_unpartitioned_s"])} (first {x["xla_first_s"]:.2f} s); TF '
      f'unpartitioned {ms(x["unpartitioned_s"])}',
      f'  XLA:CPU / TF kernels, unpartitioned: '
      f'{x["xla_unpartitioned_s"] / x["unpartitioned_s"]:.2f}'
      + (
        f'; XLA backend / TF backend, partitioned: {x["partitioned_s"] / g["partitioned_s"]:.2f}'
        if ran(g)
        else ''
      ),
    ]
  k = r.get('tf_gspmd_keras_xla', {})
  if 'error' in k:
    lines.append(f'  tf_gspmd_keras_xla: error: {k["error"]}')
  elif ran(k):
    lines.append(
      f"  tf_gspmd.keras DataParallel, backend='xla': step {ms(k['partitioned_s'])} (first "
      f'{k["first_s"]:.2f} s), TF unpartitioned {ms(k["unpartitioned_s"])}'
    )
    if ran(j):
      lines.append(
        f'  tf_gspmd.keras xla / Keras-on-JAX: step '
        f'{k["partitioned_s"] / j["partitioned_s"]:.2f}, first step '
        f'{k["first_s"] / j["first_s"]:.2f}x (goal <= 1.0)'
      )
  tx = r.get('tf_xla', {})
  if 'error' in tx:
    lines.append(f'  tf_xla: error: {tx["error"]}')
  elif ran(tx) and ran(j):
    lines.append(
      f"  TF's own XLA route (Keras jit_compile=True, one device, no partitioning): first step "
      f"{tx['first_s']:.2f} s, {tx['first_s'] / j['first_s']:.2f}x Keras-on-JAX's "
      f'partitioned first step'
      + (f'; tf_gspmd.keras xla / it: {k["first_s"] / tx["first_s"]:.2f}' if ran(k) else '')
      + f' (step {ms(tx["step_s"])})'
    )
  if ran(g) and ran(t):
    lines.append(
      f'  first step: tf_gspmd {g["first_s"]:.2f} s, TF unpartitioned '
      f'{t["first_s"]:.2f} s: {g["first_s"] / t["first_s"]:.1f}x (goal <= 3x)'
    )
  if ran(g) and ran(j):
    lines.append(
      f'  first step: Keras-on-JAX {j["first_s"]:.2f} s: tf_gspmd / JAX '
      f'{g["first_s"] / j["first_s"]:.2f}x (goal <= 1.5x)'
    )
  return lines


def main(argv=None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  if argv and argv[0] == '--child':
    system, name, cfg, steps = argv[1], argv[2], json.loads(argv[3]), int(argv[4])
    print(RESULT + json.dumps(CHILDREN[system](name, cfg, steps)), flush=True)
    return 0
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--models', default='resnet50,transformer')
  parser.add_argument(
    '--systems',
    default='tf_gspmd,tf,keras_jax,tf_gspmd_xla,tf_gspmd_keras_xla,tf_xla',
    help='tf_gspmd, tf, keras_jax, tf_gspmd_xla (the XLA backend), tf_gspmd_keras_xla (the '
    'XLA backend under keras.distribution)',
  )
  parser.add_argument('--steps', type=int, default=5)
  parser.add_argument('--timeout', type=float, default=1800)
  parser.add_argument('--json')
  parser.add_argument(
    '--quick',
    action='store_true',
    help='a tiny transformer only, 2 steps: checks the bench runs, not speed',
  )
  parser.add_argument(
    '--profile',
    action='store_true',
    help="also profile one partitioned step (TF's profiler): time by op kind",
  )
  parser.add_argument(
    '--tf-threads',
    default='default',
    help="TF's inter-op and intra-op threads in the TF systems (tg.configure_cpu_devices' "
    "threads); 'default': TF's own pools, as the earlier sessions measured",
  )
  flags = parser.parse_args(argv)
  os.environ['LIMIT_TF_THREADS'] = flags.tf_threads
  if flags.profile:
    os.environ['LIMIT_PROFILE'] = '1'
  results, lines = {}, [f'cpu: {cpu_model()}, {os.cpu_count()} cores']
  configs = QUICK if flags.quick else CONFIGS
  models = list(QUICK) if flags.quick else flags.models.split(',')
  steps = 2 if flags.quick else flags.steps
  for name in models:
    cfg = configs[name]
    results[name] = {
      s: spawn(s, name, cfg, steps, flags.timeout, flags.quick) for s in flags.systems.split(',')
    }
    lines += report(name, cfg, results[name])
  print('\n'.join(lines))
  if flags.json:
    with open(flags.json, 'w') as f:
      json.dump(results, f, indent=1)
  mismatch = any(not r.get('tf_gspmd', {}).get('first_loss_ok', True) for r in results.values())
  return 1 if mismatch else 0


if __name__ == '__main__':
  sys.exit(main())
