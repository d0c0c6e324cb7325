"""The cost model's constants: collective latency and bandwidth per kind and group size, and
matmul flops, measured on this machine by `calibrate()` and stored in the user cache dir."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from typing import Dict, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf

from tf_gspmd.mesh import Mesh
from tf_gspmd.sharding import NamedSharding, P

KINDS = ('all_reduce', 'all_gather', 'reduce_scatter', 'all_to_all')
# Shipped beside the package's modules (setup.py's package data), not inside this package.
DEFAULT_CONSTANTS_FILE = os.path.join(
  os.path.dirname(os.path.dirname(__file__)), 'auto_shard_constants.json'
)


# --- the cost model's constants ------------------------------------------------------------
@dataclasses.dataclass
class Constants:
  """Measured collective latency (s) and bandwidth (bytes/s) per kind and group size; flops/s."""

  collectives: Dict[str, Dict[int, Tuple[float, float]]]  # kind -> g -> (latency, bandwidth)
  matmul_flops: float
  source: str = ''

  def collective_seconds(self, kind: str, group: int, nbytes: int) -> float:
    table = self.collectives.get(kind) or self.collectives['all_to_all']
    latency, bandwidth = table[_nearest(table, group)]
    return latency + nbytes * (group - 1) / group / bandwidth

  def to_json(self) -> dict:
    return {
      'collectives': {
        k: {str(g): list(v) for g, v in t.items()} for k, t in self.collectives.items()
      },
      'matmul_flops': self.matmul_flops,
      'source': self.source,
    }

  @classmethod
  def from_json(cls, data: dict) -> 'Constants':
    table = {k: {int(g): tuple(v) for g, v in t.items()} for k, t in data['collectives'].items()}
    return cls(table, float(data['matmul_flops']), data.get('source', ''))


def _nearest(table: dict, group: int) -> int:
  """The measured group size closest to `group` on a log scale (2048 uses the largest)."""
  return min(table, key=lambda g: abs(math.log(g) - math.log(max(group, 2))))


def constants_path() -> str:
  """Where `calibrate()` stores its measurement: $TF_GSPMD_CACHE or ~/.cache/tf_gspmd."""
  root = os.environ.get('TF_GSPMD_CACHE') or os.path.join(
    os.path.expanduser('~'), '.cache', 'tf_gspmd'
  )
  return os.path.join(root, 'auto_shard_constants.json')


def load_constants() -> Constants:
  """This machine's calibration when `calibrate()` ran here, else the shipped defaults."""
  for path in (constants_path(), DEFAULT_CONSTANTS_FILE):
    if os.path.exists(path):
      with open(path) as f:
        return Constants.from_json(json.load(f))
  raise FileNotFoundError(
    f'auto_shard: no constants at {constants_path()} or '
    f'{DEFAULT_CONSTANTS_FILE}; run tf_gspmd.auto_shard.calibrate().'
  )


def calibrate(
  groups: Sequence[int] = (2, 4, 8), path: Optional[str] = None, repeats: int = 9
) -> Constants:
  """Measure collective latency/bandwidth over `groups` logical CPU devices and matmul flops.

  Each kind runs `_CHAIN` times inside one SPMD program (as a step's
  collectives do), at a small and a large size, against the same program
  without the collective; the per-collective difference at the small size is
  the latency, the slope between the sizes the bandwidth (in the model's
  bytes * (g-1)/g). Needs max(groups) logical devices. Stores JSON at `path`
  (default `constants_path()`) and returns the constants.
  """
  table = {kind: {g: _latency_and_bandwidth(kind, g, repeats) for g in groups} for kind in KINDS}
  measured = Constants(table, _matmul_flops(max(groups)), source=f'calibrate() {time.ctime()}')
  path = path or constants_path()
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, 'w') as f:
    json.dump(measured.to_json(), f, indent=1)
  return measured


_CHAIN = 8  # collectives per measured program
_SIZES = (64, 256 * 1024)  # float32 elements of one device's operand: 256 B, 1 MB


def _latency_and_bandwidth(kind: str, group: int, repeats: int) -> Tuple[float, float]:
  seconds = {n: _collective_seconds(kind, group, n, repeats) for n in _SIZES}
  small, large = _SIZES
  latency = max(seconds[small], 1e-7)
  moved = (large - small) * 4 * (group - 1) / group
  bandwidth = moved / max(seconds[large] - seconds[small], 1e-9)
  return latency, bandwidth


def _collective_seconds(kind: str, group: int, elements: int, repeats: int) -> float:
  """Seconds one collective of `kind` adds to a program, operand `elements` floats per device."""
  from tf_gspmd.runtime import ShardedValue, SpmdProgram, split
  from tf_gspmd.runtime.launcher import default_devices

  mesh = Mesh.create((group,), ('d',))
  sharding = NamedSharding(mesh, P('d'))
  with_it = SpmdProgram(mesh, _chained(kind, True), [sharding], keep_sharded=True)
  without = SpmdProgram(mesh, _chained(kind, False), [sharding], keep_sharded=True)
  value = np.ones(elements * group, np.float32)
  x = ShardedValue(split(value, sharding, default_devices(group)), sharding, value.shape)
  return (_median_call(with_it, x, repeats) - _median_call(without, x, repeats)) / _CHAIN


def _chained(kind: str, collective: bool):
  def run(ctx, x):
    c, total = ctx.collectives, tf.zeros([])
    for i in range(_CHAIN):
      y = x + float(i)
      if collective:
        y = _one(c, kind, y)
      total += y[0]
    return total

  return run


def _one(c, kind: str, y):
  if kind == 'all_reduce':
    return c.all_reduce(y, ('d',))
  if kind == 'all_gather':
    return c.all_gather(y, ('d',), 0)
  if kind == 'reduce_scatter':
    return c.reduce_scatter(y, ('d',), 0)
  return c.all_to_all(y, ('d',), 0, 0)


def _median_call(program, x, repeats: int) -> float:
  program(x)  # build and warm up
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    out = program(x)
    np.asarray(out.shards[0] if hasattr(out, 'shards') else out)
    times.append(time.perf_counter() - start)
  return float(np.median(times))


def _matmul_flops(devices: int, n: int = 256, chain: int = 16, repeats: int = 9) -> float:
  """Flops/s of one device while all `devices` multiply at once (logical CPU devices share
  the machine's cores: what a device computes costs what the whole step pays for it)."""
  from tf_gspmd.runtime import SpmdProgram

  mesh = Mesh.create((devices,), ('d',))

  def run(ctx, x):
    del ctx
    for _ in range(chain):
      x = tf.matmul(x, x) * (1.0 / n)
    return x[0, 0]

  program = SpmdProgram(mesh, run, [None], keep_sharded=True)
  x = np.eye(n, dtype=np.float32)
  return 2.0 * n**3 * chain / _median_call(program, x, repeats)
