"""Reshard benchmark: bytes moved and peak per-device memory, searched vs naive (vs XLA).

Cases: the shared list in `bench/reshard_cases.py` (the same names as
`bench/xla_reference.py`, so results join by name) plus a few of tf_gspmd's
own below (uneven swaps, a pending max). For each case the search's route
(`route_reshard`) is compared with the naive route (all-reduce pending
reductions, all-gather to replicated, slice), and both are run through the
numpy simulator and checked shard by shard against the global array (skip with
--no-check).

Columns (per device, bytes): `bytes` = max over devices of bytes received over
the route; `peak` = the largest single buffer a device holds (source shard
included); `bound` = the search's memory bound (max of source and target
shard, plus ceil padding for uneven sizes). The cost rules are those of the
`graph_rewrite.reshard` package docstrings, the same rules `xla_reference.py` applies to
XLA's collectives.

Hooks for later measurements:
- `--xla PATH` reads the JSON that `bench/xla_reference.py` prints and fills
  the `xla` (bytes received) and `xla_peak` columns by case name.
- `register_column(name, fn)` adds a column computed as fn(case, route, naive).

Wall time (`wall_ms`, `naive_ms`; skip with --no-wall): the route, and the
naive route, lowered by `tf_gspmd.graph_rewrite.lower_reshard` into a
per-partition program and run by `tf_gspmd.runtime.SpmdProgram` on 8 logical
CPU devices (this machine: 2 cores) at the case's full size. Inputs are
per-device shards already on their devices, outputs stay sharded, so a call
is the reshard plus the launch of 8 partition calls (`launch_ms`: the same
program with no reshard in it). Each is the median of --reps calls after one
warm-up call (which traces and sets up the collectives), the three programs
timed in interleaved rounds so that load from other processes hits them
alike. The warm-up call's result is checked against numpy, valid regions
exactly, so the column is also an end-to-end test of the lowering at full
size.

  .venv/bin/python bench/reshard.py [--xla PATH] [--json PATH] [--no-check] [--no-wall]
                                    [--reps N] [--case SUBSTRING]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from typing import Callable, Dict, Optional

import numpy as np

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')  # before TensorFlow is first imported
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import reshard_cases  # noqa: E402  (sibling module, pure Python)

from tf_gspmd.graph_rewrite.reshard import ReshardRoute, naive_route, route_reshard, sim  # noqa: E402
from tf_gspmd.mesh import Mesh  # noqa: E402
from tf_gspmd.sharding import NamedSharding, P  # noqa: E402

_MESH_2X4 = reshard_cases.MESH_2X4
_MESH_2X2X2 = reshard_cases.MESH_2X2X2


def _extra(name, mesh, src_spec, dst_spec, shape, src_partial=(), reduction='sum'):
  case = reshard_cases._case(name, mesh, src_spec, dst_spec, shape, src_partial)
  case['reduction'] = reduction
  return case


# tf_gspmd's own cases (not in the XLA reference list: names start with 'tg_').
EXTRA_CASES = [
  _extra('tg_2x4_xy_to_yx_uneven', _MESH_2X4, ('x', 'y'), ('y', 'x'), (1000, 1000)),
  _extra('tg_2x4_y_to_x_uneven', _MESH_2X4, ('y', None), ('x', None), (1000, 1024)),
  _extra('tg_2x4_xy_minor_to_x_uneven', _MESH_2X4, (('x', 'y'), None), ('x', None), (1000, 512)),
  _extra(
    'tg_2x4_batch_to_model_3d', _MESH_2X4, ('x', None, None), (None, None, 'y'), (64, 128, 256)
  ),
  _extra(
    'tg_2x4_partial_max_uneven', _MESH_2X4, (None, 'y'), ('x', 'y'), (999, 1000), ('x',), 'max'
  ),
  _extra('tg_3d_uneven_swap', _MESH_2X2X2, ('a', ('b', 'c')), (('c', 'b'), 'a'), (1001, 999)),
]

CASES = list(reshard_cases.CASES) + EXTRA_CASES

# name -> fn(case, route, naive) -> number or None; None: not measured in this run.
EXTRA_COLUMNS: Dict[str, Optional[Callable]] = {
  'wall_ms': None,
  'naive_ms': None,
  'launch_ms': None,
}


def register_column(name: str, fn: Callable) -> None:
  """Add (or fill) a result column computed as fn(case, route, naive)."""
  EXTRA_COLUMNS[name] = fn


def shardings(case: dict):
  """(source, target) NamedShardings of a case dict in the reshard_cases form."""
  mesh = Mesh.create(case['mesh_shape'], case['axis_names'])
  reduction = case.get('reduction', 'sum')
  return (
    NamedSharding(mesh, P(*case['src_spec']), case['src_partial'], reduction=reduction),
    NamedSharding(mesh, P(*case['dst_spec'])),
  )


def check_route(case: dict, route: ReshardRoute, seed: int = 0) -> None:
  """Simulate `route` on random data and compare every device's valid region (raises if wrong)."""
  src, _ = shardings(case)
  rng = np.random.default_rng(seed)
  x = rng.integers(1, 100, size=case['shape']).astype(np.float64)
  sim.check_shards(x, route.dst, sim.simulate(route, sim.make_shards(x, src, rng)))


def run(cases=CASES, check: bool = True, xla: Optional[dict] = None):
  """One row per case: the route's and the naive route's costs, XLA's when given."""
  rows = []
  for case in cases:
    src, dst = shardings(case)
    dtype_size = reshard_cases.DTYPE_SIZES[case['dtype']]
    t0 = time.perf_counter()
    route = route_reshard(src, dst, case['shape'], dtype_size)
    search_ms = (time.perf_counter() - t0) * 1e3
    naive = naive_route(src, dst, case['shape'], dtype_size)
    if check:
      check_route(case, route)
      check_route(case, naive)
    ref = (xla or {}).get(case['name'], {})
    row = {
      'case': case['name'],
      'mesh': str(src.mesh),
      'shape': list(case['shape']),
      'src': str(src),
      'dst': str(dst),
      'steps': [s.kind for s in route.steps],
      'bytes': route.bytes_moved,
      'naive_bytes': naive.bytes_moved,
      'xla_bytes': ref.get('xla_bytes'),
      'peak': route.peak_bytes,
      'naive_peak': naive.peak_bytes,
      'xla_peak': ref.get('xla_peak'),
      'bound': route.bound_bytes,
      'src_shard': route.src_shard_bytes,
      'dst_shard': route.dst_shard_bytes,
      'search_ms': round(search_ms, 2),
      'checked': check,
    }
    for name, fn in EXTRA_COLUMNS.items():
      row[name] = fn(case, route, naive) if fn else None
    rows.append(row)
  return rows


# --- wall time of the lowered routes --------------------------------------------------------
NUM_DEVICES = 8


def configure_devices(count: int = NUM_DEVICES) -> None:
  """`count` logical CPU devices; must run before TensorFlow initializes its devices."""
  import tensorflow as tf

  cpus = tf.config.list_physical_devices('CPU')
  try:
    tf.config.set_logical_device_configuration(
      cpus[0], [tf.config.LogicalDeviceConfiguration()] * count
    )
  except RuntimeError:
    pass  # already initialized; checked below
  have = len(tf.config.list_logical_devices('CPU'))
  if have < count:
    raise RuntimeError(f'wall time needs {count} logical CPU devices, TensorFlow has {have}.')


class _Partitioner:
  """What `lower_reshard` needs of the partitioner: mesh, backend, a collective log."""

  def __init__(self, mesh, backend):
    self.mesh, self.backend, self.collectives = mesh, backend, []

  def note_collective(self, record):
    self.collectives.append(record)


def _source_shards(case: dict, src: NamedSharding, seed: int = 0):
  """(global array, per-device input shards placed on their devices) for a case."""
  import tensorflow as tf

  rng = np.random.default_rng(seed)
  x = rng.integers(1, 100, size=case['shape']).astype(np.float64)
  shards = sim.make_shards(x, src, rng)
  placed = []
  for d in range(src.mesh.size):
    with tf.device(f'/device:CPU:{d}'):
      placed.append(tf.identity(tf.constant(shards[d].astype(np.float32))))
  return x, placed


def lowered_program(case: dict, route: Optional[ReshardRoute], check: bool = True):
  """A zero-argument callable running `route` lowered on logical CPUs (no route: launch only).

  Builds the per-partition program, makes the first call (trace and collective
  set-up) and, with `check`, compares its output with numpy.
  """
  from tf_gspmd.graph_rewrite import lower_reshard
  from tf_gspmd.graph_rewrite.partitioner import Local
  from tf_gspmd.runtime import ShardedValue, SpmdProgram

  src, dst = shardings(case)
  shape = tuple(case['shape'])
  target = dst if route is not None else src.without_partial()

  def per_partition(ctx, local):
    if route is None:
      return local
    stub = _Partitioner(src.mesh, ctx.collectives)
    return lower_reshard.apply_route(stub, Local(local, src, shape), route, case['name']).tensor

  program = SpmdProgram(
    src.mesh,
    per_partition,
    out_shardings=[target],
    out_shapes=[shape],
    keep_sharded=True,
    autograph=False,
    name='bench_reshard',
  )
  x, shards = _source_shards(case, src)
  value = ShardedValue(shards, src, shape)
  out = program(value)
  if check and route is not None:
    got = {d: s.numpy().astype(np.float64) for d, s in enumerate(out.shards)}
    sim.check_shards(x, dst, got)

  def call():
    program(value).shards[-1].numpy()  # the call has finished once its last output is readable

  return call


def time_lowered(
  case: dict, routes: Dict[str, Optional[ReshardRoute]], reps: int = 10, check: bool = True
) -> Dict[str, float]:
  """Median ms per call of each route, timed in interleaved rounds (load drifts hit all alike)."""
  calls = {name: lowered_program(case, route, check) for name, route in routes.items()}
  times = {name: [] for name in routes}
  for _ in range(reps):
    for name, call in calls.items():
      t0 = time.perf_counter()
      call()
      times[name].append((time.perf_counter() - t0) * 1e3)
  return {name: round(float(np.median(t)), 2) for name, t in times.items()}


def register_wall_columns(reps: int = 10, check: bool = True) -> None:
  """Fill wall_ms (the route), naive_ms (the naive route) and launch_ms (no reshard)."""
  configure_devices()
  measured = {}

  def column(which):
    def fn(case, route, naive):
      if case['name'] not in measured:
        measured[case['name']] = time_lowered(
          case, {'wall_ms': route, 'naive_ms': naive, 'launch_ms': None}, reps, check
        )
      return measured[case['name']][which]

    return fn

  for which in ('wall_ms', 'naive_ms', 'launch_ms'):
    register_column(which, column(which))


def load_xla(path: str) -> dict:
  """Records of bench/xla_reference.py's JSON output, by case name."""
  with open(path) as f:
    return {r['name']: r for r in json.load(f)}


_ABBREV = {
  'slice': 'slice',
  'all_gather': 'AG',
  'all_to_all': 'A2A',
  'reduce_scatter': 'RS',
  'all_reduce': 'AR',
  'permute': 'perm',
  'repad': 'repad',
}


def _size(b) -> str:
  """Bytes, compactly: 448, 3.5K, 1.12M."""
  if b is None:
    return '-'
  if b < 1024:
    return str(b)
  if b < 2**20:
    return f'{b / 1024:.1f}K'
  return f'{b / 2**20:.2f}M'


def _geomean(pairs) -> Optional[float]:
  """Geometric mean of other/ours over pairs with both non-zero."""
  logs = [math.log(o / b) for b, o in pairs if b and o]
  return math.exp(sum(logs) / len(logs)) if logs else None


def format_table(rows) -> str:
  extra = list(EXTRA_COLUMNS)
  head = (
    f'{"case":<32} {"steps":<22} {"bytes":>7} {"naive":>7} {"xla":>7} {"peak":>7} '
    f'{"naive":>7} {"xla":>7} {"bound":>7}' + ''.join(f' {n:>8}' for n in extra)
  )
  lines = [head, '-' * len(head)]
  for r in rows:
    steps = ','.join(_ABBREV.get(k, k) for k in r['steps']) or '-'
    line = (
      f'{r["case"]:<32} {steps:<22} {_size(r["bytes"]):>7} {_size(r["naive_bytes"]):>7} '
      f'{_size(r["xla_bytes"]):>7} {_size(r["peak"]):>7} {_size(r["naive_peak"]):>7} '
      f'{_size(r["xla_peak"]):>7} {_size(r["bound"]):>7}'
    )
    line += ''.join(f' {"-" if r[n] is None else r[n]:>8}' for n in extra)
    lines.append(line)
  lines.append(
    f'{len(rows)} cases (bytes received / peak buffer, per device); '
    f'every peak within its bound: {all(r["peak"] <= r["bound"] for r in rows)}; '
    f'bytes <= naive in {sum(r["bytes"] <= r["naive_bytes"] for r in rows)}/{len(rows)}'
  )
  for other in ('naive', 'xla'):
    key = f'{other}_bytes'
    both = [r for r in rows if r[key] is not None]
    moved = _geomean([(r['bytes'], r[key]) for r in both])
    peak = _geomean([(r['peak'], r[f'{other}_peak']) for r in both])
    if both:
      lines.append(
        f'  vs {other} on {len(both)} cases: bytes {other}/ours geometric mean '
        f'{moved:.2f}x (cases that move data), peak {other}/ours {peak:.2f}x; ours '
        f'moves no more in {sum(r["bytes"] <= r[key] for r in both)}, peaks no '
        f'higher in {sum(r["peak"] <= r[f"{other}_peak"] for r in both)}'
      )
  timed = [r for r in rows if r.get('wall_ms') and r.get('naive_ms')]
  if timed:
    launch = [r['launch_ms'] for r in timed if r.get('launch_ms')]
    speedup = _geomean([(r['wall_ms'], r['naive_ms']) for r in timed])
    lines.append(
      f'  wall time on {len(timed)} cases: naive/ours geometric mean {speedup:.2f}x; '
      f'ours no slower in {sum(r["wall_ms"] <= r["naive_ms"] for r in timed)}'
      + (f'; launch without reshard median {float(np.median(launch)):.2f} ms' if launch else '')
    )
  missing = [n for n, fn in EXTRA_COLUMNS.items() if fn is None]
  if not any(r['xla_bytes'] is not None for r in rows):
    missing.insert(0, 'xla (pass --xla with the output of bench/xla_reference.py)')
  if missing:
    lines.append(f'  not measured in this run: {", ".join(missing)}')
  return '\n'.join(lines)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--xla', help='JSON printed by bench/xla_reference.py (joins by case name)')
  parser.add_argument('--json', help='also write the rows as JSON to this path')
  parser.add_argument('--no-check', action='store_true', help='skip the numpy simulation check')
  parser.add_argument(
    '--no-wall',
    action='store_true',
    help='skip running the lowered routes on 8 logical CPUs (wall_ms)',
  )
  parser.add_argument('--reps', type=int, default=15, help='timed calls per route (median)')
  parser.add_argument('--case', default='', help='only cases whose name contains this')
  args = parser.parse_args(argv)
  cases = [c for c in CASES if args.case in c['name']]
  if not args.no_wall:
    register_wall_columns(args.reps, check=not args.no_check)
  rows = run(cases, check=not args.no_check, xla=load_xla(args.xla) if args.xla else None)
  print(format_table(rows))
  if args.json:
    with open(args.json, 'w') as f:
      json.dump(rows, f, indent=1)
  return 0


if __name__ == '__main__':
  sys.exit(main())
