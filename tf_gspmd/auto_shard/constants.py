"""The cost model's constants: collective latency and bandwidth per kind and group size, and
matmul flops, measured on this machine by `calibrate()` and stored in the user cache dir;
with the step model fit to measured steps of this CPU (`fit.load_step_fit`), they make this
machine's `HardwareProfile` (`Constants.profile()`)."""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import os
import platform
import time
from typing import Callable, Dict, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf

from tf_gspmd.mesh import Mesh
from tf_gspmd.sharding import NamedSharding, P
from tf_gspmd.step_cost import HardwareProfile

log = logging.getLogger('tf_gspmd')
KINDS = ('all_reduce', 'all_gather', 'reduce_scatter', 'all_to_all')
CALIBRATION_DEVICES = 8  # logical CPU devices `calibrate()` measures matmul flops over
# Shipped beside the package's modules (setup.py's package data), not inside this package.
DEFAULT_CONSTANTS_FILE = os.path.join(
  os.path.dirname(os.path.dirname(__file__)), 'auto_shard_constants.json'
)


# --- the cost model's constants ------------------------------------------------------------
@dataclasses.dataclass
class Constants:
  """Measured collective latency (s) and bandwidth (bytes/s) per kind and group size; flops/s."""

  collectives: Dict[str, Dict[int, Tuple[float, float]]]  # kind -> g -> (latency, bandwidth)
  matmul_flops: float  # one device's, while `CALIBRATION_DEVICES` multiply at once
  source: str = ''
  # The step model fit to measured steps (`fit.fit_profile`, its `FIT_KEYS`). Empty: not
  # fit (`profile` says how it prices then).
  step_fit: Dict[str, float] = dataclasses.field(default_factory=dict)

  def profile(self) -> HardwareProfile:
    """This machine as a `HardwareProfile`: the mesh's logical devices share its cores, the
    collectives are the measured table. Unfit, a core computes at the calibrated matmul rate
    and nothing else costs (the model before the fit)."""
    fit, cores = self.step_fit, os.cpu_count() or 1
    core_flops = fit.get('core_flops', self.matmul_flops * CALIBRATION_DEVICES / cores)
    table = tuple(
      (kind, g, lat, bw) for kind, rows in self.collectives.items() for g, (lat, bw) in rows.items()
    )
    return HardwareProfile(
      name=f'this CPU ({cpu_key()})',
      flops_per_s=(('float32', core_flops),),
      memory_bytes=_memory_bytes(),
      memory_bandwidth=fit.get('memory_bandwidth', math.inf),
      link_bandwidth=math.inf,
      link_latency=0.0,
      topology='shared memory',
      cores=cores,
      op_seconds=fit.get('op_seconds', 0.0),
      small_op_seconds=fit.get('small_op_seconds', 0.0),
      step_seconds=fit.get('step_seconds', 0.0),
      collective_table=table,
      collective_scale=fit.get('collective_scale', 1.0),
      part_collective_scale=fit.get('part_collective_scale'),
      source=self.source + ('; step model fit to measured steps' if fit else '; not fit'),
      vector_bytes=cpu_vector_bytes(),
    )

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


def cpu_key() -> str:
  """This machine's CPU as a cache key: its model name and core count."""
  model = platform.processor() or platform.machine()
  try:
    with open('/proc/cpuinfo') as f:
      names = [line.split(':', 1)[1].strip() for line in f if line.startswith('model name')]
    model = names[0] if names else model
  except OSError:
    pass
  return f'{model} x{os.cpu_count() or 1}'


@functools.lru_cache(maxsize=None)  # read once: every `Constants.profile()` asks
def cpu_vector_bytes() -> int:
  """This CPU's widest vector register in bytes, from its flags: 64 with AVX-512, 32 with
  AVX2, else 16 (SSE, NEON)."""
  try:
    with open('/proc/cpuinfo') as f:
      flags = next((line.split(':', 1)[1].split() for line in f if line.startswith('flags')), [])
  except OSError:
    flags = []
  return 64 if 'avx512f' in flags else 32 if 'avx2' in flags else 16


def _memory_bytes() -> int:
  try:
    return int(os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES'))
  except (ValueError, OSError, AttributeError):
    return 0


def _nearest(table: dict, group: int) -> int:
  """The measured group size closest to `group` on a log scale (2048 uses the largest)."""
  return min(table, key=lambda g: abs(math.log(g) - math.log(max(group, 2))))


def _cache_dir() -> str:
  """$TF_GSPMD_CACHE or ~/.cache/tf_gspmd."""
  return os.environ.get('TF_GSPMD_CACHE') or os.path.join(
    os.path.expanduser('~'), '.cache', 'tf_gspmd'
  )


def constants_path() -> str:
  """Where `calibrate()` stores its measurement: $TF_GSPMD_CACHE or ~/.cache/tf_gspmd."""
  return os.path.join(_cache_dir(), 'auto_shard_constants.json')


def load_constants(fit: bool = True) -> Constants:
  """This machine's calibration when `calibrate()` ran here, else the shipped defaults, with
  the step model fit for this CPU (`fit.load_step_fit`; `fit=False`: without it)."""
  for path in (constants_path(), DEFAULT_CONSTANTS_FILE):
    if os.path.exists(path):
      with open(path) as f:
        constants = Constants.from_json(json.load(f))
      if fit:
        constants.step_fit = dict(load_step_fit())
      return constants
  raise FileNotFoundError(
    f'auto_shard: no constants at {constants_path()} or '
    f'{DEFAULT_CONSTANTS_FILE}; run tf_gspmd.auto_shard.calibrate().'
  )


# --- the step model's fit, cached per CPU (measured and fit by `fit.calibrate_steps`) ----------
DEFAULT_FIT_FILE = os.path.join(
  os.path.dirname(os.path.dirname(__file__)), 'auto_shard_step_fit.json'
)


def step_fit_path() -> str:
  """The user's cache of fits, one per CPU: in $TF_GSPMD_CACHE or ~/.cache/tf_gspmd."""
  return os.path.join(_cache_dir(), 'auto_shard_step_fit.json')


def step_fit_entry(key: Optional[str] = None) -> Optional[dict]:
  """The cached (else shipped) entry of CPU `key`: its 'fit', 'samples' and 'source'."""
  key = key or cpu_key()
  for source in (step_fit_path(), DEFAULT_FIT_FILE):
    entry = _read(source).get(key)
    if entry is not None:
      return entry
  return None


def _read(path: str) -> dict:
  if not os.path.exists(path):
    return {}
  with open(path) as f:
    return json.load(f)


_WARNED: set = set()  # CPUs whose missing fit was reported


def load_step_fit(
  path: Optional[str] = None,
  key: Optional[str] = None,
  recompute: Optional[Callable[[], dict]] = None,
) -> Dict[str, float]:
  """The fit for CPU `key` (default `cpu_key()`): from the cache at `path` (default
  `step_fit_path()`), else from the shipped file; when neither has it, `recompute()` (an
  entry as `calibrate_steps` makes it) is run and cached, and without `recompute` the
  shipped fit of another CPU is used, with a warning."""
  path, key = path or step_fit_path(), key or cpu_key()
  for source in (path, DEFAULT_FIT_FILE):
    entry = _read(source).get(key)
    if entry is not None:
      return entry['fit']
  if recompute is not None:
    entry = recompute()
    store_step_fit(entry, path, key)
    return entry['fit']
  shipped = _read(DEFAULT_FIT_FILE)
  if not shipped:
    return {}
  other = sorted(shipped)[0]
  if key not in _WARNED:  # once a process: every search loads the constants
    _WARNED.add(key)
    log.warning(
      'auto_shard: no step fit for CPU %r; using the one of %r '
      '(run tf_gspmd.auto_shard.fit.calibrate_steps() with 8 logical CPU devices).',
      key,
      other,
    )
  return shipped[other]['fit']


def store_step_fit(entry: dict, path: Optional[str] = None, key: Optional[str] = None) -> None:
  path, key = path or step_fit_path(), key or cpu_key()
  entries = _read(path)
  entries[key] = entry
  os.makedirs(os.path.dirname(path) or '.', exist_ok=True)
  with open(path, 'w') as f:
    json.dump(entries, f, indent=1, sort_keys=True)


def calibrate(
  groups: Sequence[int] = (2, 4, 8), path: Optional[str] = None, repeats: int = 9
) -> Constants:
  """Measure collective latency/bandwidth over `groups` logical CPU devices and matmul flops.

  Each kind runs `_CHAIN` times inside one SPMD program (as a step's
  collectives do), at a small and a large size, against the same program
  without the collective; the per-collective difference at the small size is
  the latency, the slope between the sizes the bandwidth (in the model's
  bytes * (g-1)/g). Needs max(groups, 8) logical devices. Stores JSON at `path`
  (default `constants_path()`) and returns the constants.
  """
  table = {kind: {g: _latency_and_bandwidth(kind, g, repeats) for g in groups} for kind in KINDS}
  flops = _matmul_flops(CALIBRATION_DEVICES)
  measured = Constants(table, flops, source=f'calibrate() {time.ctime()} on {cpu_key()}')
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
