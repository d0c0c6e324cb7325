"""Smoke test of bench/limit.py: --quick (a tiny transformer, 2 steps) prints every line.

It checks that the bench runs and reports, not its speed: the partitioned step, the limit
with its terms, the CPU floor, the first loss against the unpartitioned one (by the oracle;
the run exits 1 on a mismatch), the first step's phases and the profile, the XLA backend
beside XLA:CPU unpartitioned, and Keras-on-JAX's lines when a Python with jax is there
($TF_GSPMD_JAX_PYTHON: `make test` passes .venv's; or the bench's .jaxenv).
"""

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, 'bench'))
import limit  # noqa: E402


@pytest.mark.slow  # runs the bench in subprocesses: 45-60 s
def test_quick_run_prints_the_limit_and_the_ratios():
  proc = subprocess.run(
    [sys.executable, os.path.join(ROOT, 'bench', 'limit.py'), '--quick', '--profile'],
    capture_output=True,
    text=True,
    timeout=600,
    cwd=ROOT,
  )
  assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
  out = proc.stdout
  assert re.search(r'tf_gspmd step +\d+ ms', out), out
  assert re.search(
    r'limit = 8 x \d+ ms \(TF at batch 2\) \+ \d+ ms \(all-reduce of [\d.]+ MB, '
    r'1 collective\) = \d+ ms',
    out,
  ), out
  assert re.search(r'step / limit +[\d.]+', out), out
  assert re.search(r'no step below \d+ ms on TF kernels', out), out
  assert re.search(r'first loss vs unpartitioned: normwise error \S+ \(ok\)', out), out
  phases = re.search(r'phases of the first step \(s\): (.*)', out).group(1)
  for phase in ('capture', 'propagate', 'partition', 'build', 'instantiate', 'other'):
    assert phase in phases, phases
  assert re.search(r'profile of one step .* by kind: \S+ \d+', out), out
  assert re.search(r'first step: tf_gspmd [\d.]+ s, TF unpartitioned [\d.]+ s', out), out
  assert re.search(
    r'XLA backend step \d+ ms \(first step [\d.]+ s\); XLA:CPU unpartitioned '
    r'\d+ ms',
    out,
  ), out
  assert re.search(
    r'XLA:CPU / TF kernels, unpartitioned: [\d.]+; XLA backend / TF backend, '
    r'partitioned: [\d.]+',
    out,
  ), out
  # tf_gspmd's Keras path (keras.distribution.DataParallel) on backend='xla', run end to end.
  assert re.search(
    r"tf_gspmd.keras DataParallel, backend='xla': step \d+ ms \(first [\d.]+ s\)", out
  ), out
  if limit.jax_python() is not None:
    assert re.search(r'Keras-on-JAX step \d+ ms, unpartitioned \d+ ms', out), out
    assert re.search(r'first step: Keras-on-JAX [\d.]+ s', out), out
    assert re.search(r'tf_gspmd.keras xla / Keras-on-JAX: step [\d.]+', out), out
    # TF's own route to XLA (no partitioning): the floor under backend='xla''s first step.
    assert re.search(
      r"TF's own XLA route .*: first step [\d.]+ s, [\d.]+x Keras-on-JAX's partitioned first "
      r'step; tf_gspmd.keras xla / it: [\d.]+',
      out,
    ), out
