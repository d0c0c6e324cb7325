"""The fuzzers' shrinker: the smallest failing program a greedy search finds.

`shrink(program, fails)` tries smaller candidates, biggest cuts first, and keeps each that
still `fails`, restarting from it. `candidates` are a program's smaller versions (ops deleted
or bypassed, the gradient, the assign, the nesting, annotations and the device order dropped,
input dims shrunk); the Keras fuzzer passes its own candidates and validity check.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Callable, Optional

from tf_gspmd.testing.fuzz_ops import Op
from tf_gspmd.testing.fuzz_program import Input, Program, is_valid, tidy


def shrink(
  program: Program,
  fails: Callable[[Program], bool],
  budget: int = 150,
  log: Callable[[str], None] = lambda _: None,
  seconds: float = math.inf,
  smaller: Optional[Callable] = None,
  valid: Optional[Callable] = None,
) -> Program:
  """The smallest program found (greedily) that still `fails`: each accepted change restarts
  the candidate list; at most `budget` candidates are run, for at most `seconds`.
  `smaller` and `valid` replace `candidates` and `is_valid` (the Keras fuzzer's cases)."""
  smaller, valid = smaller or candidates, valid or is_valid
  best, tried = program, 0
  deadline = time.time() + seconds
  progress = True
  while progress and tried < budget:
    progress = False
    for candidate in smaller(best):
      if tried >= budget or time.time() > deadline:
        break
      if candidate == best or not valid(candidate):
        continue
      tried += 1
      if fails(candidate):
        best, progress = candidate, True
        log(f'  shrunk to {best.label()}')
        break
  return best


def candidates(p: Program):
  """Smaller programs, the biggest cuts first."""
  for op in reversed(p.ops):
    yield tidy(_without(p, op.name))
  for op in reversed(p.ops):
    for source in op.inputs:
      yield tidy(_bypass(p, op, source))
  if p.grad:
    yield dataclasses.replace(p, grad=False)
  if p.assign:
    yield dataclasses.replace(p, assign='')
  if p.nested:
    yield dataclasses.replace(p, nested='')
  for k, op in enumerate(p.ops):
    if op.spec is not None:
      yield _replace_op(p, k, dataclasses.replace(op, spec=None))
  for k, i in enumerate(p.inputs):
    if i.spec is not None:
      yield _replace_input(p, k, dataclasses.replace(i, spec=None))
  if p.devices != tuple(range(8)):
    yield dataclasses.replace(p, devices=tuple(range(8)))
  for k, i in enumerate(p.inputs):
    for d, size in enumerate(i.shape):
      for smaller in sorted({1, size // 2, size - 1} - {0, size}):
        shape = i.shape[:d] + (smaller,) + i.shape[d + 1 :]
        yield _replace_input(p, k, dataclasses.replace(i, shape=shape))


def _without(p: Program, name: str) -> Program:
  """`name`'s op and every op reading it, directly or not."""
  gone = {name}
  ops = []
  for op in p.ops:
    if op.name in gone or gone.intersection(op.inputs):
      gone.add(op.name)
    else:
      ops.append(op)
  return dataclasses.replace(p, ops=tuple(ops))


def _bypass(p: Program, op: Op, source: str) -> Program:
  """`op` removed, its readers reading `source` instead (valid when the shapes agree)."""
  ops = tuple(
    dataclasses.replace(o, inputs=tuple(source if n == op.name else n for n in o.inputs))
    for o in p.ops
    if o is not op
  )
  return dataclasses.replace(p, ops=ops)


def _replace_op(p: Program, k: int, op: Op) -> Program:
  return dataclasses.replace(p, ops=p.ops[:k] + (op,) + p.ops[k + 1 :])


def _replace_input(p: Program, k: int, i: Input) -> Program:
  return dataclasses.replace(p, inputs=p.inputs[:k] + (i,) + p.inputs[k + 1 :])
