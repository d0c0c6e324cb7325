"""How fast do the fuzzers judge? Programs (and Keras models) per second, before and after.

Runs the program fuzzer's CLI (`python -m tf_gspmd.testing.fuzz`) and the Keras fuzzer's on
the same seed and count from two trees, side by side in one run: an older commit (`--old`,
default the merge base with main, unpacked with `git archive` into a temporary directory)
and this checkout (with `--jobs` worker processes; the older one with `--old-jobs`, 1 by
default: an older CLI may have no --jobs). Shrinking is off (a failure's shrink
would time the shrinker). For each side: programs/s over the whole command (TF's import and
the workers' start included), the CPU seconds it used, and the outcome counts; then whether
every program got the same verdict line (status, float64 rule, message; times aside). A side
that printed fewer verdicts than it judged (its command failed) fails the comparison, with
the end of its error output.

  .venv/bin/python bench/fuzz_speed.py [--programs 60] [--models 12] [--jobs 2] [--old REV]
      [--old-jobs 1] [--xla-every 0] [--which fuzz,keras] [--rounds 1]

With `--rounds R` each side runs R times, alternating which goes first: the speedup is
over the sums, and each round's ratio is printed with their range and median (this
machine's speed drifts by 10-20% between runs minutes apart).
"""

from __future__ import annotations

import argparse
import collections
import os
import platform
import re
import resource
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from typing import Dict, List, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SEED = 20261128
# A verdict line: '[seed:index] ... tf: pass (float64 rule) 0.84s detail'.
VERDICT = re.compile(r'^(\[\d+:\d+\].*?) (tf|xla): (\w+)( \(float64 rule\))? [\d.]+s(.*)$')

# A Keras CLI without --max-layers (before ff29589): its campaign reads `generate` from its
# module.
OLD_KERAS = """
import functools, sys
from tf_gspmd.testing import keras_fuzz
keras_fuzz.generate = functools.partial(keras_fuzz.generate, max_layers={layers})
sys.exit(keras_fuzz.main({argv!r}))
"""


def cpu_model() -> str:
  try:
    with open('/proc/cpuinfo') as f:
      names = [line.split(':', 1)[1].strip() for line in f if line.startswith('model name')]
    return f'{names[0]} x{len(names)}' if names else platform.processor()
  except OSError:
    return platform.processor()


def unpack(rev: str, into: str) -> str:
  """The tree of commit `rev`, written under `into`."""
  archive = os.path.join(into, 'tree.tar')
  with open(archive, 'wb') as f:
    subprocess.run(['git', '-C', ROOT, 'archive', rev], stdout=f, check=True)
  tree = os.path.join(into, 'tree')
  with tarfile.open(archive) as tar:
    tar.extractall(tree, filter='data')
  return tree


def run(tree: str, command: List[str]) -> Tuple[float, float, List[str], str]:
  """(wall seconds, CPU seconds of it and its children, stdout lines, the end of stderr) of
  `command` in `tree`."""
  env = dict(os.environ, PYTHONPATH=tree, TF_CPP_MIN_LOG_LEVEL='2')
  before = resource.getrusage(resource.RUSAGE_CHILDREN)
  began = time.time()
  done = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True)
  wall = time.time() - began
  after = resource.getrusage(resource.RUSAGE_CHILDREN)
  cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
  if done.returncode not in (0, 1):  # 1: a failure was found, which the counts show
    raise RuntimeError(f'{command} failed ({done.returncode}):\n{done.stderr[-3000:]}')
  # 1 is also Python's exit on an uncaught exception: `compare` counts the verdicts.
  return wall, cpu, done.stdout.splitlines(), done.stderr[-3000:]


def verdicts(lines: List[str]) -> Dict[str, str]:
  """Each run's verdict (label and backend -> status, float64 rule, message)."""
  found = {}
  for line in lines:
    match = VERDICT.match(line)
    if match:
      label, backend, status, rule, detail = match.groups()
      # A program drawn to nest its body (from 58f87ac) is the same program otherwise: its
      # verdict is compared with the older tree's on the unnested one, and it costs more.
      label = re.sub(r' nested(-\w+)?', '', label)
      found[f'{label} {backend}'] = f'{status}{rule or ""}{detail}'
  return found


def counts(found: Dict[str, str]) -> collections.Counter:
  tally: collections.Counter = collections.Counter()
  for verdict in found.values():
    status = verdict.split(' ')[0].split('(')[0]
    tally[status] += 1
    tally['float64 rule'] += '(float64 rule)' in verdict
    if status == 'refusal':
      tally[f'refusal: {verdict[len("refusal") :].strip()[:70]}'] += 1
  return tally


def commands(which: str, args, python: str, tree: str, jobs: int) -> List[str]:
  """The campaign command of `which` fuzzer in `tree` (`--jobs` only when `jobs` > 1: an
  older CLI may not have it)."""
  parallel = ['--jobs', str(jobs)] if jobs > 1 else []
  if which == 'fuzz':
    command = [python, '-m', 'tf_gspmd.testing.fuzz', '--programs', str(args.programs)]
    command += ['--seed', str(args.seed), '--max-ops', str(args.max_ops), '--shrink-budget', '0']
    command += ['--xla-every', str(args.xla_every)] if args.xla_every else []
    return command + parallel
  argv = ['--models', str(args.models), '--seed', str(args.seed), '--shrink-budget', '0']
  with open(os.path.join(tree, 'tf_gspmd', 'testing', 'keras_fuzz.py')) as f:
    if '--max-layers' not in f.read():
      return [python, '-c', OLD_KERAS.format(layers=args.max_layers, argv=argv)]
  command = [python, '-m', 'tf_gspmd.testing.keras_fuzz'] + argv
  return command + ['--max-layers', str(args.max_layers)] + parallel


def compare(which: str, args, old_tree: str) -> bool:
  count = args.programs if which == 'fuzz' else args.models
  what = 'programs' if which == 'fuzz' else 'models'
  sides = (('before', old_tree, args.old_jobs), ('after', ROOT, args.jobs))
  totals = {'before': [0.0, 0.0], 'after': [0.0, 0.0]}  # wall, CPU over the rounds
  seen: Dict[str, Dict[str, str]] = {}
  ratios = []
  for round_ in range(args.rounds):
    # Each round runs both sides; every other round in the other order, so that the
    # machine's drift over a round falls on each side alike.
    walls = {}
    for side, tree, jobs in sides if round_ % 2 == 0 else sides[::-1]:
      load = os.getloadavg()[0]
      wall, cpu, lines, errors = run(tree, commands(which, args, sys.executable, tree, jobs))
      found = verdicts(lines)
      if len(found) < count:
        print(f'{which} {side}: {len(found)} verdicts of {count}; its stderr ends:\n{errors}')
      if side in seen and found != seen[side]:
        print(f'{which} {side}: round {round_ + 1} gave other verdicts than round 1')
      seen.setdefault(side, found)
      walls[side] = wall
      totals[side][0] += wall
      totals[side][1] += cpu
      print(
        f'{which} {side}: {count} {what} in {wall:.1f} s = {count / wall:.3f} {what}/s '
        f'({cpu:.1f} CPU s, {cpu / count:.2f} CPU s per {what[:-1]}; load {load:.1f} at start)',
        flush=True,
      )
    ratios.append(walls['before'] / walls['after'])
    if args.rounds > 1:
      print(f'{which}: round {round_ + 1} speedup {ratios[-1]:.2f}x', flush=True)
  (wall0, cpu0), (wall1, cpu1) = totals['before'], totals['after']
  print(
    f'{which}: speedup {wall0 / wall1:.2f}x in {what}/s, {cpu0 / cpu1:.2f}x in CPU seconds', end=''
  )
  if args.rounds > 1:
    middle = statistics.median(ratios)
    print(
      f' (over {args.rounds} rounds; the rounds {min(ratios):.2f}x-{max(ratios):.2f}x, '
      f'median {middle:.2f}x)',
      end='',
    )
  print()
  found0, found1 = seen['before'], seen['after']
  tally0, tally1 = counts(found0), counts(found1)
  for key in sorted(set(tally0) | set(tally1)):
    print(f'  {key:<80} {tally0[key]:>4} {tally1[key]:>4}')
  same = found0 == found1 and len(found0) >= count
  differ = [k for k in found0 if found1.get(k) != found0[k]] + sorted(set(found1) - set(found0))
  note = f' (differ: {differ[:5]})' if differ else ''
  print(f'{which}: every verdict identical: {same}{note}')
  return same


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--old', default='', help='the commit to compare with (default: merge base)')
  parser.add_argument('--seed', type=int, default=SEED)
  parser.add_argument('--programs', type=int, default=60)
  parser.add_argument('--max-ops', type=int, default=8, help="tests/test_fuzz.py's SMALL")
  parser.add_argument('--models', type=int, default=12)
  parser.add_argument('--max-layers', type=int, default=4, help='tests/test_keras_fuzz.py SMALL')
  parser.add_argument('--jobs', type=int, default=2, help='worker processes of the new side')
  parser.add_argument('--old-jobs', type=int, default=1, help='worker processes of the old side')
  parser.add_argument('--xla-every', type=int, default=0, help='also backend=xla every K-th')
  parser.add_argument('--which', default='fuzz,keras')
  parser.add_argument(
    '--rounds', type=int, default=1, help='runs of each side, alternating (drift falls on both)'
  )
  args = parser.parse_args(argv)
  old = (
    args.old
    or subprocess.run(
      ['git', '-C', ROOT, 'merge-base', 'HEAD', 'main'], capture_output=True, text=True, check=True
    ).stdout.strip()
  )
  print(f'CPU: {cpu_model()}; {os.cpu_count()} logical CPUs; before: {old[:10]}, after: this tree')
  print(f'seed {args.seed}; --jobs {args.old_jobs} before, {args.jobs} after')
  with tempfile.TemporaryDirectory() as scratch:
    tree = unpack(old, scratch)
    same = [compare(which, args, tree) for which in args.which.split(',')]
  return 0 if all(same) else 1


if __name__ == '__main__':
  sys.exit(main())
