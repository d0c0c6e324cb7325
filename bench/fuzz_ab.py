"""What one change does to the fuzzer's CPU, measured paired: A and B in one process.

This machine's speed drifts by 10-20% between runs a minute apart, more than most single
changes to the fuzzer's cost (bench/fuzz_speed.py and bench/fuzz_profile.py compare whole
runs). Here one process judges each program twice, once with a switch off (A) and once on
(B), in alternating order, and sums the CPU seconds of each side: drift falls on both. Each
repetition's ratio is printed too, so the spread shows what the total can resolve (about
+-3% for 30 programs on the Intel Xeon x2).

The switches (each B is the named change made, A the code without it):

  markers           the TF backend's progress markers left out (`_around` builds bare)
  tracebacks        per-partition, launch and capture traces made without Python stacks
                    (as shipped; A: with them, as TF makes every op)
  shared-constants  constants answered from `shared_values`' cache (as shipped; A: built
                    again, then merged by the op-level dedupe)
  grappler          Grappler off for every function (the partitioned ones already are; this
                    changes the unpartitioned reference's)
  closed-cycles     permutes on a permutation closed into cycles, no `If` (as shipped; A:
                    every permute's send and receive under `If`s)
  graph-building    TF's C++ op building (`tf_private.fast_graph_building`) in tf_gspmd's
                    traces and, as a campaign's process sets it, everywhere (as shipped; A:
                    TF's Python path throughout)

  .venv/bin/python bench/fuzz_ab.py --switch markers [--programs 30] [--reps 2] [--seed S]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Callable, Dict, List

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')

from tf_gspmd.testing import fuzz  # noqa: E402

SEED = 20261128


def _markers() -> Callable[[bool], None]:
  from tf_gspmd.runtime import collectives

  around = collectives.TFCollectives._around

  def switch(on: bool) -> None:
    collectives.TFCollectives._around = (lambda self, record, build: build()) if on else around

  return switch


def _tracebacks() -> Callable[[bool], None]:
  from tf_gspmd import tf_private

  def switch(on: bool) -> None:
    stack = tf_private._extract_stack if on else tf_private._with_stack
    tf_private.tf_stack.extract_stack = stack

  return switch


def _shared_constants() -> Callable[[bool], None]:
  from tf_gspmd import tf_private

  def switch(on: bool) -> None:
    made = tf_private._graph_constant if on else tf_private._make_graph_constant
    tf_private.ops._create_graph_constant = made

  return switch


def _grappler() -> Callable[[bool], None]:
  import tensorflow as tf

  def switch(on: bool) -> None:
    tf.config.optimizer.set_experimental_options({'disable_meta_optimizer': on})

  return switch


def _graph_building() -> Callable[[bool], None]:
  from tf_gspmd import tf_private

  real = tf_private.tf_flags
  flag = real.config().graph_building_optimization

  class _Off:  # TF's flags as `fast_graph_building` reads them, one that stays off
    graph_building_optimization = None

    def config(self):
      return self

    def value(self) -> bool:
      return False

    def reset(self, value: bool) -> None:
      del value

  off = _Off()
  off.graph_building_optimization = off

  def switch(on: bool) -> None:
    tf_private.tf_flags = real if on else off
    flag.reset(on)  # the campaign's own setting (`fuzz._prepare`): on for the references too

  return switch


def _closed_cycles() -> Callable[[bool], None]:
  from tf_gspmd.runtime import collectives

  shipped = collectives.TFCollectives._permute

  def branches(self, x, pairs, family):
    return self._permute_by_branches(x, pairs, family)

  def switch(on: bool) -> None:
    collectives.TFCollectives._permute = shipped if on else branches

  return switch


SWITCHES: Dict[str, Callable[[], Callable[[bool], None]]] = {
  'markers': _markers,
  'tracebacks': _tracebacks,
  'shared-constants': _shared_constants,
  'grappler': _grappler,
  'graph-building': _graph_building,
  'closed-cycles': _closed_cycles,
}


def judged(index: int, seed: int, max_ops: int, verdicts: List) -> float:
  """CPU seconds of judging program `index` (and the collection after it)."""
  began = time.process_time()
  fuzz.judge_program(index, seed, max_ops, 0, (0, 0), verdicts.append)
  fuzz.fuzz_pool.collect()
  return time.process_time() - began


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--switch', required=True, choices=sorted(SWITCHES))
  parser.add_argument('--programs', type=int, default=30)
  parser.add_argument('--reps', type=int, default=2)
  parser.add_argument('--seed', type=int, default=SEED)
  parser.add_argument('--max-ops', type=int, default=8)
  args = parser.parse_args(argv)
  fuzz._prepare()  # noqa: SLF001  (a campaign's process: 8 devices, the imports frozen)
  switch = SWITCHES[args.switch]()
  verdicts: Dict[bool, List] = {False: [], True: []}
  for on in (False, True):  # first-use costs (TF's and tf_gspmd's) paid before timing
    switch(on)
    judged(args.programs, args.seed, args.max_ops, [])
  totals = {False: 0.0, True: 0.0}
  for rep in range(args.reps):
    spent = {False: 0.0, True: 0.0}
    for index in range(args.programs):
      for on in (False, True) if (index + rep) % 2 == 0 else (True, False):
        switch(on)
        spent[on] += judged(index, args.seed, args.max_ops, verdicts[on])
    totals = {on: totals[on] + spent[on] for on in totals}
    print(f'rep {rep}: A {spent[False]:.2f} CPU s, B {spent[True]:.2f} CPU s, ', end='')
    print(f'B/A {spent[True] / spent[False]:.3f}', flush=True)
  print(f'{args.switch}, seed {args.seed}, {args.programs} programs x {args.reps}: ', end='')
  print(f'A {totals[False]:.2f} CPU s, B {totals[True]:.2f} CPU s, ', end='')
  print(f'B/A {totals[True] / totals[False]:.3f}')
  same = [_verdict(e) for e in verdicts[False]] == [_verdict(e) for e in verdicts[True]]
  print(f'every verdict the same on both sides: {same}')
  return 0 if same else 1


def _verdict(event) -> tuple:
  if event[0] != 'record':
    return event[:1]
  _, label, backend, outcome, _ = event
  return (label, backend, outcome.status, outcome.float64, outcome.message)


if __name__ == '__main__':
  sys.exit(main())
