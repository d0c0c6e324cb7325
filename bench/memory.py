"""Memory of a model split over 8 devices: resident set above the process's baseline, in W.

The model (#31): 8 x Dense(H) without bias, SGD, batch 8, every kernel split by columns over
8 devices ('model' axis of a (1, 8) mesh: Keras `ModelParallel` with a LayoutMap, or
`tg.shard_variable`/`tg.sharded_variables` for the tf.function step). W = the weights' bytes
(8 H^2 x 4). All 8 logical devices' memory is this process's memory, so its resident set shows
what a layout costs. Each side runs in a fresh process:

  tf          plain Keras on TF, unpartitioned (one device)
  jax         Keras 3 on JAX (.jaxenv), the same ModelParallel (8 host devices)
  tg_keras    tf_gspmd through keras.distribution (tf_gspmd.keras.enable()), TF backend
  tg_step     a tf.function step under tg.partition, its variables made by tg.sharded_variables
  tg_xla      tf_gspmd through keras.distribution, backend='xla'

Per side: `steady` = RSS after two `train_on_batch` (or step calls) minus the baseline (RSS
after imports and device set-up, before the model; the two XLA sides, jax and tg_xla, start
XLA's runtime before it alike), each taken after glibc's malloc_trim so
that freed temporaries the allocator keeps do not count; `peak` = the process's high-water
mark (VmHWM) minus the baseline, both in W; `step` = the median of --steps more steps. Steps time
a memory-bound model: the goal is tf_gspmd within 1.2x of TF unpartitioned, its steady and
peak within TF's + 0.25 W and no more than Keras-on-JAX's. With several --sizes, each side's
steady and peak are also fitted as fixed MiB + slope x W: the slope is what the layout costs,
the fixed part the runtime's and the traces' own memory, the same at every model size.

  python bench/memory.py [--sizes 2048 4096] [--steps 5] [--sides tf jax tg_keras ...]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, 'bench'))
from limit import cpu_model  # noqa: E402  (sibling: stdlib only at import)

JAX_PYTHON = os.environ.get('TF_GSPMD_JAX_PYTHON', os.path.join(ROOT, '.jaxenv', 'bin', 'python'))
SIDES = ('tf', 'jax', 'tg_keras', 'tg_step', 'tg_xla')
LAYERS, BATCH, DEVICES = 8, 8, 8


def _trim() -> None:
  """Return freed heap pages to the OS (glibc's malloc_trim), so the resident set counts what
  is live, not what the allocator keeps cached from earlier temporaries; every side alike."""
  import ctypes
  import gc

  gc.collect()
  try:
    ctypes.CDLL('libc.so.6').malloc_trim(0)
  except (OSError, AttributeError):
    pass


def _status_mib(field: str) -> float:
  """A /proc/self/status memory field (VmRSS: resident now, VmHWM: its high-water mark)."""
  with open('/proc/self/status') as status:
    for line in status:
      if line.startswith(f'{field}:'):
        return int(line.split()[1]) / 1024
  return float('nan')


def _rss_mib() -> float:
  return _status_mib('VmRSS')


def _hwm_mib() -> float:
  return _status_mib('VmHWM')


# --- one side, in its own process -------------------------------------------------------------
def _keras_model(keras, hidden: int):
  keras.utils.set_random_seed(0)
  layers = [keras.Input((hidden,))]
  layers += [keras.layers.Dense(hidden, use_bias=False, name=f'd{i}') for i in range(LAYERS)]
  model = keras.Sequential(layers, name='mlp')
  model.compile(optimizer=keras.optimizers.SGD(1e-3), loss='mse')
  return model


def _model_parallel(keras):
  mesh = keras.distribution.DeviceMesh(
    (1, DEVICES), ['batch', 'model'], keras.distribution.list_devices()
  )
  layout_map = keras.distribution.LayoutMap(mesh)
  layout_map[r'.*/d\d+/kernel'] = (None, 'model')
  return keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name='batch')


def _set_up_devices(side: str):
  if side == 'jax':
    os.environ['KERAS_BACKEND'] = 'jax'
    os.environ['XLA_FLAGS'] = f'--xla_force_host_platform_device_count={DEVICES}'
    return
  os.environ['KERAS_BACKEND'] = 'tensorflow'
  import tensorflow as tf

  cpu = tf.config.list_physical_devices('CPU')[0]
  tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 8)
  tf.zeros([1])  # initialize the devices before the baseline


def _keras_steps(side: str, hidden: int, x, y):
  import keras

  if side in ('tg_keras', 'tg_xla'):
    import tf_gspmd

    tf_gspmd.keras.enable('xla' if side == 'tg_xla' else 'tf')
  if side != 'tf':
    keras.distribution.set_distribution(_model_parallel(keras))
  model = _keras_model(keras, hidden)
  return lambda: float(model.train_on_batch(x, y))


def _tf_function_steps(hidden: int, x, y):
  import tensorflow as tf

  import tf_gspmd as tg

  mesh = tg.Mesh.create((1, DEVICES), ('batch', 'model'))
  rng = tf.random.Generator.from_seed(0)
  with tg.sharded_variables(mesh, {r'd\d+': tg.P(None, 'model')}):
    kernels = [
      tf.Variable(lambda: rng.normal([hidden, hidden]) / hidden**0.5, name=f'd{i}')
      for i in range(LAYERS)
    ]

  @tf.function
  def step(x, y):
    with tf.GradientTape() as tape:
      h = x
      for k in kernels:
        h = tf.matmul(h, k)
      loss = tf.reduce_mean(tf.square(h - y))
    for k, g in zip(kernels, tape.gradient(loss, kernels)):
      k.assign_sub(1e-3 * g)
    return loss

  partitioned = tg.partition(step, mesh)
  return lambda: float(partitioned(x, y))


def run_side(side: str, hidden: int, steps: int) -> dict:
  _set_up_devices(side)
  import numpy as np

  rng = np.random.RandomState(0)
  x = rng.randn(BATCH, hidden).astype(np.float32)
  y = rng.randn(BATCH, hidden).astype(np.float32)
  if side in ('jax', 'tg_xla'):
    # Both XLA sides start their runtime before the baseline alike (jax's devices and one tiny
    # compiled program: XLA's CPU client and its compiler loaded), as the TF sides start TF's
    # devices: a fixed cost of the runtime, not of the model's layout.
    if side == 'tg_xla':
      from tf_gspmd.xla_bridge import pjrt

      pjrt.jax_devices(DEVICES)
    import jax

    jax.numpy.zeros([1]).block_until_ready()
  _trim()
  base = _rss_mib()
  step = _tf_function_steps(hidden, x, y) if side == 'tg_step' else _keras_steps(side, hidden, x, y)
  step(), step()
  _trim()
  steady = _rss_mib() - base
  times = []
  for _ in range(steps):
    start = time.perf_counter()
    step()
    times.append(time.perf_counter() - start)
  w_mib = LAYERS * hidden * hidden * 4 / 2**20
  peak = _hwm_mib() - base
  return {
    'side': side,
    'hidden': hidden,
    'W_MiB': w_mib,
    'steady_MiB': steady,
    'peak_MiB': peak,
    'steady_W': steady / w_mib,
    'peak_W': peak / w_mib,
    'step_ms': 1e3 * sorted(times)[len(times) // 2],
  }


# --- the driver -------------------------------------------------------------------------------
def _child(side: str, hidden: int, steps: int) -> dict:
  python = JAX_PYTHON if side == 'jax' else sys.executable
  if side == 'jax' and not os.path.exists(python):
    return {'side': side, 'hidden': hidden, 'error': f'{python} does not exist'}
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL='2', PYTHONPATH=ROOT, TF_GSPMD_PROGRESS='0')
  done = subprocess.run(
    [python, __file__, '--child', side, '--sizes', str(hidden), '--steps', str(steps)],
    capture_output=True,
    text=True,
    env=env,
    timeout=1800,
  )
  lines = [ln for ln in done.stdout.splitlines() if ln.startswith('{')]
  if done.returncode != 0 or not lines:
    return {'side': side, 'hidden': hidden, 'error': done.stderr.strip().splitlines()[-1:]}
  return json.loads(lines[-1])


def _fit(points: list) -> tuple:
  """(fixed MiB, per-W slope) of MiB = fixed + slope * W, least squares over the sizes: the
  slope is what the layout costs in units of the weights, the fixed part what the runtime and
  its traces cost whatever the model's size."""
  n = len(points)
  mean_w = sum(w for w, _ in points) / n
  mean_m = sum(m for _, m in points) / n
  spread = sum((w - mean_w) ** 2 for w, _ in points)
  slope = sum((w - mean_w) * (m - mean_m) for w, m in points) / spread
  return mean_m - slope * mean_w, slope


def _print_fits(all_results: list) -> None:
  """Per side, steady and peak as fixed MiB + slope W, when more than one size ran."""
  print('\nfit over the sizes, MiB = fixed + slope x W:')
  print(f'  {"side":10s} {"steady":>22s} {"peak":>22s}')
  for side in SIDES:
    rows = [r for r in all_results if r.get('side') == side and 'error' not in r]
    if len({r['hidden'] for r in rows}) < 2:
      continue
    cells = []
    for key in ('steady_MiB', 'peak_MiB'):
      fixed, slope = _fit([(r['W_MiB'], r[key]) for r in rows])
      cells.append(f'{fixed:6.0f} MiB + {slope:4.2f}W')
    print(f'  {side:10s} {cells[0]:>22s} {cells[1]:>22s}')


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--sizes', type=int, nargs='+', default=[2048, 4096])
  parser.add_argument('--steps', type=int, default=5)
  parser.add_argument('--sides', nargs='+', default=list(SIDES), choices=SIDES)
  parser.add_argument('--child', choices=SIDES)
  args = parser.parse_args()
  if args.child:
    print(json.dumps(run_side(args.child, args.sizes[0], args.steps)))
    return 0
  print(f'cpu: {cpu_model()}, {os.cpu_count()} cores; {DEVICES} logical devices')
  print(f'model: {LAYERS} x Dense(H) no bias, SGD, batch {BATCH}; kernels split by columns')
  all_results = []
  for hidden in args.sizes:
    results = {side: _child(side, hidden, args.steps) for side in args.sides}
    all_results += results.values()
    w = LAYERS * hidden * hidden * 4 / 2**20
    print(f'\nH = {hidden}: W = {w:.0f} MiB')
    print(f'  {"side":10s} {"steady":>8s} {"peak":>8s} {"step":>10s}')
    for side, r in results.items():
      if 'error' in r:
        print(f'  {side:10s} failed: {r["error"]}')
        continue
      print(f'  {side:10s} {r["steady_W"]:7.2f}W {r["peak_W"]:7.2f}W {r["step_ms"]:8.1f} ms')
    tf_side = results.get('tf', {})
    for side in ('tg_keras', 'tg_step', 'tg_xla'):
      r = results.get(side, {})
      if 'error' in r or not r or 'error' in tf_side or not tf_side:
        continue
      print(
        f'  {side}: step / TF {r["step_ms"] / tf_side["step_ms"]:.2f}x (goal <= 1.2), '
        f'steady - TF {r["steady_W"] - tf_side["steady_W"]:+.2f}W, '
        f'peak - TF {r["peak_W"] - tf_side["peak_W"]:+.2f}W (goal <= +0.25W)'
      )
  if len(args.sizes) > 1:
    _print_fits(all_results)
  return 0


if __name__ == '__main__':
  sys.exit(main())
