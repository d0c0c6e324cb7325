"""Per-call host overhead: an empty step and the demo transformer step, partitioned vs not.

Three programs, each called with global values, timed side by side (the calls taken
round-robin, so load from other processes on this shared machine hits all alike):

  empty        `x + 1` on a (8, 4) float32 input, batch split over 8 devices: what a
               call costs when the program does (almost) nothing -- the launch itself.
  empty_vars   the same plus reading 16 small variables and assigning them +1:
               the cost of V x N variable handles per call.
  transformer  examples/keras/demo.py's step (examples/keras/transformer.py, Megatron
               layout on a (data=2, model=4) mesh, batch 8, forward+GradientTape+Adam).

For each, "unpartitioned" is the same tf.function on one device. Reported: the median
ms per call over --steps calls (each ended by fetching the result to the host), and the
ratio partitioned / unpartitioned.

  .venv/bin/python bench/launch_overhead.py [--steps 50] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')  # before TensorFlow is first imported
os.environ.setdefault('KERAS_BACKEND', 'tensorflow')

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
NUM_DEVICES = 8


def configure_logical_cpus(n: int) -> None:
  """first_step's set-up (its module imports only the standard library), checked."""
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  import first_step
  import tensorflow as tf

  first_step.configure_logical_cpus(n)
  assert len(tf.config.list_logical_devices('CPU')) >= n


def _fetch(out):
  import tensorflow as tf

  for t in tf.nest.flatten(out):
    if hasattr(t, 'numpy'):
      t.numpy()


def empty_step(mesh, variables: int = 0):
  """(partitioned, unpartitioned, args): `x + 1`, optionally touching `variables` variables."""
  import numpy as np
  import tensorflow as tf

  import tf_gspmd as tg

  def make():
    vs = [tf.Variable(tf.zeros([4]), name=f'v{i}') for i in range(variables)]

    @tf.function
    def step(x):
      for v in vs:
        v.assign_add(tf.ones([4]))
      return x + 1.0

    return step

  x = np.ones((8, 4), np.float32)
  partitioned = tg.partition(make(), mesh, in_shardings=tg.P('data', None))
  return partitioned, make(), (x,)


def transformer_step(mesh):
  """(partitioned, unpartitioned, args): the demo's training step (examples/keras/demo.py)."""
  sys.path.insert(0, os.path.join(ROOT, 'examples', 'keras'))
  import transformer

  import tf_gspmd as tg

  model, optimizer = transformer.build(seed=0)
  ref_model, ref_optimizer = transformer.build(seed=0)
  transformer.layout(mesh).apply(model)
  partitioned = tg.partition(transformer.train_step(model, optimizer, mesh), mesh)
  return partitioned, transformer.train_step(ref_model, ref_optimizer), transformer.batch(seed=0)


def time_side_by_side(fns: dict, args, steps: int, warmup: int = 3) -> dict:
  """Median ms per call of each fn (called round-robin); the first call is timed apart."""
  first = {}
  for name, fn in fns.items():
    start = time.perf_counter()
    _fetch(fn(*args))
    first[name] = time.perf_counter() - start
  for _ in range(warmup):
    for fn in fns.values():
      _fetch(fn(*args))
  times = {name: [] for name in fns}
  cpu = {name: [] for name in fns}  # process CPU (all TF threads): robust to others' load
  for _ in range(steps):
    for name, fn in fns.items():
      start, start_cpu = time.perf_counter(), time.process_time()
      _fetch(fn(*args))
      times[name].append(time.perf_counter() - start)
      cpu[name].append(time.process_time() - start_cpu)
  return {
    name: {
      'median_ms': 1e3 * statistics.median(t),
      'min_ms': 1e3 * min(t),
      'cpu_ms': 1e3 * statistics.median(cpu[name]),
      'first_s': first[name],
    }
    for name, t in times.items()
  }


def measure(steps: int = 50, which=('empty', 'empty_vars', 'transformer')) -> dict:
  configure_logical_cpus(NUM_DEVICES)
  sys.path.insert(0, ROOT)
  import tf_gspmd as tg

  results = {}
  for name in which:
    if name == 'transformer':
      mesh = tg.Mesh.create((2, 4), ('data', 'model'))
      partitioned, plain, args = transformer_step(mesh)
    else:
      mesh = tg.Mesh.create((NUM_DEVICES,), ('data',))
      partitioned, plain, args = empty_step(mesh, 16 if name == 'empty_vars' else 0)
    r = time_side_by_side({'partitioned': partitioned, 'unpartitioned': plain}, args, steps)
    r['ratio'] = r['partitioned']['median_ms'] / r['unpartitioned']['median_ms']
    r['cpu_ratio'] = r['partitioned']['cpu_ms'] / r['unpartitioned']['cpu_ms']
    results[name] = r
  return results


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--steps', type=int, default=50)
  parser.add_argument('--only', default='empty,empty_vars,transformer')
  parser.add_argument('--json', default=None)
  flags = parser.parse_args(argv)
  results = measure(flags.steps, flags.only.split(','))
  print(
    f'{"program":<13}{"partitioned ms":>16}{"unpartitioned ms":>18}{"ratio":>8}'
    f'{"CPU ms (p / u)":>20}{"CPU ratio":>10}{"first call s (p / u)":>24}'
  )
  for name, r in results.items():
    p, u = r['partitioned'], r['unpartitioned']
    print(
      f'{name:<13}{p["median_ms"]:>16.2f}{u["median_ms"]:>18.2f}{r["ratio"]:>8.1f}'
      f'{p["cpu_ms"]:>11.2f} / {u["cpu_ms"]:<6.2f}{r["cpu_ratio"]:>10.1f}'
      f'{p["first_s"]:>14.2f} / {u["first_s"]:.2f}'
    )
  print(
    f'(medians of {flags.steps} calls, taken round-robin on a shared machine: '
    f'{os.cpu_count()} cores, load {os.getloadavg()[0]:.1f})'
  )
  if flags.json:
    with open(flags.json, 'w') as f:
      json.dump(results, f, indent=1)


if __name__ == '__main__':
  main()
