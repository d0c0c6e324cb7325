"""Where a fuzz program's time goes: CPU seconds per phase of judging, in one process.

Judges programs start..start+N-1 of a seed as the program fuzzer does (`fuzz.judge_program`,
shrinking off, every `--xla-every`-th program on backend='xla' too, a full garbage collection
after each) and charges the process's CPU time to the phase running, each phase without the
phases it calls (so the rows add up to the total):

  drawing the program              generating it and printing it as Python
  the judge's own work             inputs, variables, partition(), reading results, the oracle
  unpartitioned reference         tracing and running the program plainly (2 calls)
  capture                          tracing the program for the partitioner
  propagation                      choosing every tensor's sharding
  build                            sharded variables, argument and output layouts
  per-partition trace              the partitioner writing the per-partition program
  launch trace                     the outer function (splits, 8 call ops, assembly)
  TF instantiation + first run     TF building the program on 8 devices, then its first call
  later calls                      the second call and the determinism check's calls
  variable copies                  plain variables copied into their shards and back
  float64 rule, witnesses          only where float32 is ill-conditioned
  backend='xla'                    the sampled XLA runs, whole (their phases included)
  garbage collection               the full collection after each program

The first program is judged before timing starts (TF's and tf_gspmd's first-use costs).

  .venv/bin/python bench/fuzz_profile.py [--programs 30] [--seed 20261128] [--max-ops 8]
      [--xla-every 10]
"""

from __future__ import annotations

import argparse
import collections
import functools
import os
import sys
import time
from typing import Callable, Dict, List

import numpy as np

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')

from tf_gspmd.testing import fuzz  # noqa: E402

SEED = 20261128
XLA = "backend='xla'"


class PhaseClock:
  """CPU seconds charged to the innermost phase running (`phase(label)` wraps a function),
  but for an XLA run, which is charged whole."""

  def __init__(self):
    self.seconds: collections.Counter = collections.Counter()
    self._stack: List[List] = []  # [label, CPU time at entry, CPU seconds of inner phases]
    self.launches: Dict[int, '_TimedLaunch'] = {}  # id(outer tf.function) -> its timer

  def enter(self, label: str) -> None:
    if any(entry[0] == XLA for entry in self._stack):
      label = XLA
    self._stack.append([label, time.process_time(), 0.0])

  def leave(self) -> None:
    label, began, inner = self._stack.pop()
    spent = time.process_time() - began
    self.seconds[label] += spent - inner
    if self._stack:
      self._stack[-1][2] += spent

  def phase(self, label: str, fn: Callable) -> Callable:
    @functools.wraps(fn)
    def timed(*args, **kwargs):
      self.enter(label)
      try:
        return fn(*args, **kwargs)
      finally:
        self.leave()

    return timed


def patch(owner, name: str, wrap: Callable) -> None:
  setattr(owner, name, wrap(getattr(owner, name)))


def instrument(clock: PhaseClock) -> None:
  """Wrap the fuzzer's and tf_gspmd's steps in phases (tf_gspmd's own functions only)."""
  from tf_gspmd.partitioned import compile as compile_lib
  from tf_gspmd.partitioned import front
  from tf_gspmd.propagation import api as propagation_api
  from tf_gspmd.runtime import launcher

  for name in ('generate', 'render', 'load'):
    patch(fuzz, name, lambda f: clock.phase('drawing the program', f))
  patch(fuzz, 'reference', lambda f: _reference_phase(clock, f))
  patch(fuzz, '_witnesses', lambda f: clock.phase('float64 rule, witnesses', f))
  patch(fuzz, 'by_witnesses', lambda f: clock.phase('float64 rule, witnesses', f))
  patch(fuzz, 'run', lambda f: _run_phase(clock, f))
  patch(compile_lib, 'capture_annotated', lambda f: clock.phase('capture', f))
  patch(propagation_api, 'propagate_captured', lambda f: clock.phase('propagation', f))
  patch(compile_lib, 'build', lambda f: clock.phase('build', f))
  patch(launcher, 'trace_per_partition', lambda f: clock.phase('per-partition trace', f))
  patch(front.PartitionedFunction, '_copy', lambda f: clock.phase('variable copies', f))
  patch(launcher.SpmdProgram, '_outer_function', lambda f: _outer_phases(clock, f))
  patch(fuzz.fuzz_pool, 'collect', lambda f: clock.phase('garbage collection', f))


def _reference_phase(clock: PhaseClock, reference: Callable) -> Callable:
  """float32 unpartitioned runs are the reference; float64 and XLA ones serve the rule."""

  def timed(build, dtype=np.float32, jit: bool = False):
    plain = dtype == np.float32 and not jit
    label = 'unpartitioned reference' if plain else 'float64 rule, witnesses'
    return clock.phase(label, reference)(build, dtype, jit)

  return timed


def _run_phase(clock: PhaseClock, run: Callable) -> Callable:
  def timed(program, backend: str = 'tf', *args, **kwargs):
    label = XLA if backend == 'xla' else "the judge's own work"
    return clock.phase(label, run)(program, backend, *args, **kwargs)

  return timed


def _outer_phases(clock: PhaseClock, outer_function: Callable) -> Callable:
  """The launch function traced (public `get_concrete_function`) apart from its calls: the
  first call is TF instantiating the program on every device, then running it."""

  def made(self, args_spec, program, args=None):
    outer = outer_function(self, args_spec, program, args)
    if args is None:
      return outer
    if id(outer) not in clock.launches:  # the timer holds `outer`: its id stays its own
      clock.launches[id(outer)] = _TimedLaunch(clock, outer)
    return clock.launches[id(outer)]

  return made


class _TimedLaunch:
  def __init__(self, clock: PhaseClock, outer):
    self.clock, self.outer = clock, outer
    self.calls = 0

  def __call__(self, *args):
    if self.calls == 0:
      self.clock.phase('launch trace', self.outer.get_concrete_function)(*args)
    label = 'TF instantiation + first run' if self.calls == 0 else 'later calls'
    self.calls += 1
    return self.clock.phase(label, self.outer)(*args)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--programs', type=int, default=30)
  parser.add_argument('--seed', type=int, default=SEED)
  parser.add_argument('--start', type=int, default=0)
  parser.add_argument('--max-ops', type=int, default=8)
  parser.add_argument('--xla-every', type=int, default=10)
  args = parser.parse_args(argv)
  fuzz._prepare()  # noqa: SLF001  (a campaign's process: 8 devices, the imports frozen)
  events: list = []
  fuzz.judge_program(args.start + args.programs, args.seed, args.max_ops, 0, (0, 0), events.append)
  clock = PhaseClock()
  instrument(clock)
  began, wall = time.process_time(), time.time()
  clock.enter('the rest')
  for index in range(args.start, args.start + args.programs):
    fuzz.judge_program(index, args.seed, args.max_ops, args.xla_every, (0, 0), events.append)
    fuzz.fuzz_pool.collect()
  clock.leave()
  total, wall = time.process_time() - began, time.time() - wall
  print(f'seed {args.seed}, programs {args.start}..{args.start + args.programs - 1}, ', end='')
  print(f'max ops {args.max_ops}, xla every {args.xla_every}: {total:.1f} CPU s ', end='')
  print(
    f'({total / args.programs:.2f} per program), {wall:.1f} s wall, load {os.getloadavg()[0]:.1f}'
  )
  for label, seconds in clock.seconds.most_common():
    print(f'  {label:<32} {seconds:7.2f} CPU s  {100 * seconds / total:5.1f}%')
  return 0


if __name__ == '__main__':
  sys.exit(main())
