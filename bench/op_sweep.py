"""The op sweep in full: every registered op type under every sharding of its operands.

    .venv/bin/python bench/op_sweep.py                  # full sweep, both meshes
    .venv/bin/python bench/op_sweep.py --slice 7/48     # CI's rotating slice 7 of 48
    .venv/bin/python bench/op_sweep.py --sample 5       # 5 cases per program and mesh (~6 min)
    .venv/bin/python bench/op_sweep.py --ops 'Slice|Pad' --meshes 2d
    .venv/bin/python bench/op_sweep.py --jsonl out.jsonl   # keep every case result

The full sweep is about 19,000 cases (every sharding of every operand, each
operand alone and all alike, a seeded sample of combinations past --budget
per program and mesh, and every sharding of each output); with 2 workers on
2 cores it takes roughly 2-3 hours. Every case runs twice (state carried
across calls is checked). A failure whose error signature (exception type and
message regex) is a known issue's (see `op_sweep.KNOWN_ISSUES`) is listed as
FAIL with the issue's name; any other failure is unexpected. `--slice k/K`
runs every K-th case of the full sweep from case k on (the slice CI runs).

Prints the op x result table (passes per mesh, collective counts, every
failure with its shardings and error) and a summary (cases, passed, known
failures, unexpected failures); exits 1 if any failure is unexpected or not
every case ran.

Cases run in a worker subprocess with 8 logical CPU devices. A failed or
timed-out collective poisons a TensorFlow process (every later collective
fails), so when a worker reports one the parent records that case and starts
a fresh worker on the remaining cases.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')


def _cases(sweep, names, meshes, sample, budget, slice_text=''):
  from tf_gspmd.testing import op_sweep

  if sample:
    out = [c for name in names for m in meshes for c in sweep.sample(name, m, sample)]
  else:
    out = op_sweep.full_cases(sweep, names, meshes, budget)
  if slice_text:
    out = op_sweep.rotating_slice(out, *op_sweep.parse_slice(slice_text))
  return out


def worker(args) -> int:
  """Run this worker's share of the cases from position `start` on; one JSON line per result."""
  from tf_gspmd.testing import op_sweep

  op_sweep.configure_devices(8)
  op_sweep.fast_first_runs()
  import logging

  logging.getLogger('tf_gspmd').setLevel(logging.ERROR)
  sweep = op_sweep.Sweep(timeout=args.timeout)
  names = _select(sweep.specs, args.ops)
  cases = _cases(sweep, names, args.meshes.split(','), args.sample, args.budget, args.slice)
  mine = list(range(args.shard, len(cases), args.jobs))
  with open(args.results, 'a') as f:
    print(json.dumps({'total': len(mine)}), file=f, flush=True)
    for position in range(args.start, len(mine)):
      case = cases[mine[position]]
      try:
        result = sweep.run(case)
      except op_sweep.Poisoned as poisoned:
        result = op_sweep.CaseResult.from_json(str(poisoned))
        print(
          json.dumps(
            {'index': mine[position], 'position': position, 'result': json.loads(result.to_json())}
          ),
          file=f,
          flush=True,
        )
        return 3
      print(
        json.dumps(
          {'index': mine[position], 'position': position, 'result': json.loads(result.to_json())}
        ),
        file=f,
        flush=True,
      )
  return 0


def _select(specs, pattern):
  names = sorted(specs)
  if pattern:
    rx = re.compile(pattern)
    names = [n for n in names if rx.search(n) or rx.search(specs[n].op_type)]
  return names


class _Shard:
  """One worker's share of the cases, restarted after a poisoned collective."""

  def __init__(self, index, args, directory):
    self.index, self.args = index, args
    self.path = os.path.join(directory, f'shard{index}.jsonl')
    open(self.path, 'w').close()
    self.total, self.done, self.restarts, self.proc = None, 0, 0, None

  def start(self):
    a = self.args
    cmd = [
      sys.executable,
      os.path.abspath(__file__),
      '--worker',
      '--results',
      self.path,
      '--start',
      str(self.done),
      '--meshes',
      a.meshes,
      '--sample',
      str(a.sample),
      '--budget',
      str(a.budget),
      '--timeout',
      str(a.timeout),
      '--jobs',
      str(a.jobs),
      '--shard',
      str(self.index),
    ]
    if a.ops:
      cmd += ['--ops', a.ops]
    if a.slice:
      cmd += ['--slice', a.slice]
    self.proc = subprocess.Popen(cmd)

  def results(self):
    out = {}
    with open(self.path) as f:
      for line in f:
        item = json.loads(line)
        if 'total' in item:
          self.total = item['total']
        else:
          out[item['index']] = item
    self.done = max([i['position'] for i in out.values()], default=-1) + 1
    return out

  def finished(self) -> bool:
    """Poll; restart after a poisoned collective. True when this shard is done."""
    code = self.proc.poll()
    if code is None:
      return False
    self.results()
    if code == 0 or self.total is None or self.done >= self.total:
      return True
    if code != 3:
      print(
        f'op sweep: worker {self.index} exited with {code} at case {self.done}; stopping it.',
        file=sys.stderr,
      )
      return True
    self.restarts += 1
    self.start()
    return False


def parent(args) -> int:
  from tf_gspmd.testing.op_sweep import CaseResult, format_table

  directory = tempfile.mkdtemp(prefix='op_sweep_')
  began = time.time()
  shards = [_Shard(i, args, directory) for i in range(args.jobs)]
  for s in shards:
    s.start()
  pending = list(shards)
  while pending:
    time.sleep(1.0)
    pending = [s for s in pending if not s.finished()]
  results = {}
  for s in shards:
    results.update({i: CaseResult(**item['result']) for i, item in s.results().items()})
  ordered = [results[i] for i in sorted(results)]
  if args.jsonl:
    with open(args.jsonl, 'w') as f:
      for r in ordered:
        print(r.to_json(), file=f)
  print(format_table(ordered, args.meshes.split(',')))
  total = sum(s.total or 0 for s in shards)
  print(
    f'{time.time() - began:.0f} s wall on {args.jobs} worker(s), '
    f'{sum(s.restarts for s in shards)} restart(s) after poisoned collectives'
  )
  complete = all(s.total is not None for s in shards) and len(ordered) == total
  if not complete:
    print(f'op sweep: only {len(ordered)} of {total} cases ran.', file=sys.stderr)
  return 0 if complete and all(r.status == 'pass' or r.known for r in ordered) else 1


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument('--ops', default='', help='regex on program names / op types')
  p.add_argument('--meshes', default='1d,2d')
  p.add_argument(
    '--sample',
    type=int,
    default=0,
    help='cases per program and mesh (0: every combination up to --budget)',
  )
  p.add_argument('--slice', default='', help='k/K: every K-th case of the sweep from case k on')
  p.add_argument(
    '--budget',
    type=int,
    default=64,
    help='operand-sharding combinations per program and mesh before subsetting',
  )
  p.add_argument('--timeout', type=float, default=60.0, help='seconds a collective may wait')
  p.add_argument('--jsonl', default='', help='keep per-case results in this file')
  p.add_argument('--jobs', type=int, default=2, help='worker processes (each 8 logical CPUs)')
  p.add_argument('--worker', action='store_true', help=argparse.SUPPRESS)
  p.add_argument('--results', help=argparse.SUPPRESS)
  p.add_argument('--start', type=int, default=0, help=argparse.SUPPRESS)
  p.add_argument('--shard', type=int, default=0, help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  return worker(args) if args.worker else parent(args)


if __name__ == '__main__':
  sys.exit(main())
