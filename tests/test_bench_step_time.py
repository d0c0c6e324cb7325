"""Smoke test of bench/step_time.py: the --quick run (model (a), tiny sizes) prints its table.

All five systems run (tf_gspmd, DTensor, the XLA backend, Keras 3 on JAX, tf_gspmd's Keras
path on both backends); the
Keras-on-JAX child needs a Python with jax ($TF_GSPMD_JAX_PYTHON, which `make test` sets to
.venv's, or the bench's .jaxenv) and is left out of the check when there is none.

The run itself checks that tf_gspmd's losses equal the unpartitioned Keras
step's, and DTensor's the unpartitioned plain-TF step's (exit status 1 and
MISMATCH otherwise); here we also check the data-parallel MLP's collectives
(one all-reduce per gradient and one for the loss) and that every column holds
a number.
"""

import os
import subprocess
import sys

import pytest
from tensorflow.experimental import dtensor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, 'bench'))
import step_time  # noqa: E402


@pytest.mark.slow  # runs the bench in subprocesses: 25 s
def test_quick_run_prints_the_table():
  proc = subprocess.run(
    [sys.executable, os.path.join(ROOT, 'bench', 'step_time.py'), '--quick'],
    capture_output=True,
    text=True,
    timeout=240,
    cwd=ROOT,
  )
  assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
  lines = proc.stdout.splitlines()
  header = next(i for i, line in enumerate(lines) if line.startswith('model '))
  assert [c.strip() for c in lines[header].split('|')] == step_time.HEADER
  row = dict(zip(step_time.HEADER, (c.strip() for c in lines[header + 2].split('|'))))
  assert row['model'] == '(a) mlp' and row['mesh'] == '(data=8)'
  for column in (
    'build s',
    'step ms unpartitioned',
    'step ms tf_gspmd',
    'step ms plain-TF unpart.',
    'step ms DTensor',
  ):
    assert float(row[column]) > 0, (column, row)
  # 6 gradients + the loss, all over 'data', fused into buckets (graph_rewrite/coalesce.py)
  assert row['collectives/step'] == '2', row
  assert int(row['bytes/step'].replace(',', '')) > 0
  assert 'all_reduce(data) x2 (7 sums)' in proc.stdout
  assert 'MISMATCH' not in proc.stdout
  # The peers beside it: XLA backend (XLA-compiled unpartitioned step) and Keras 3 on JAX
  # (keras.distribution.DataParallel), each with its losses checked against Keras' above.
  for column in ('step ms XLA unpart.', 'step ms tf_gspmd xla'):
    assert float(row[column]) > 0, (column, row)
  assert 'tf_gspmd xla vs Keras unpartitioned' in proc.stdout
  # tf_gspmd's Keras path (keras.distribution, both backends), losses checked the same way.
  assert 'tf_gspmd.keras (TF backend) vs Keras unpartitioned' in proc.stdout
  assert 'tf_gspmd.keras (xla) vs Keras unpartitioned' in proc.stdout
  if step_time.jax_python() is not None:
    for column in ('step ms Keras-JAX unpart.', 'step ms Keras-JAX'):
      assert float(row[column]) > 0, (column, row)
    assert 'Keras-JAX vs Keras-JAX unpartitioned' in proc.stdout
    assert 'Keras-JAX unpartitioned vs Keras unpartitioned' in proc.stdout
    assert '(a) mlp: tf_gspmd (TF backend) / Keras-JAX = ' in proc.stdout


def test_dtensor_layouts_refuse_what_dtensor_cannot_express():
  mesh = dtensor.create_mesh([('data', 2), ('model', 4)], devices=[f'CPU:{i}' for i in range(8)])
  layout = step_time.dtensor_layout(dtensor, mesh, ('data', None), (8, 3), 'x')
  assert layout.sharding_specs == ['data', dtensor.UNSHARDED]
  with pytest.raises(ValueError, match='unsupported: uneven shards'):
    step_time.dtensor_layout(dtensor, mesh, (None, 'model'), (8, 30), 'kernel')
  with pytest.raises(ValueError, match='several mesh axes'):
    step_time.dtensor_layout(dtensor, mesh, (('data', 'model'),), (16,), 'bias')


def test_error_gist():
  error = RuntimeError('Graph execution error:\n\n  (0) INVALID_ARGUMENT:  5 nodes in a cycle\n')
  assert step_time.gist(error) == 'INVALID_ARGUMENT:  5 nodes in a cycle'
  mlir = RuntimeError('f.py:3:1: error: Halo exchange is only supported on TPU.\n  c = f()')
  assert step_time.dtensor_failure(mlir) == 'unsupported: Halo exchange is only supported on TPU.'


def test_loss_verdict_is_the_oracle():
  ok, error, _ = step_time.loss_verdict('loss', [2.0, 1.0], [2.0, 1.0])
  assert ok and error == 0.0
  assert not step_time.loss_verdict('loss', [2.0, 1.0], [2.0, 1.01])[0]
  assert step_time.loss_verdict('loss', [], [1.0]) is None
  # The float64 rule: as far from float64 as the reference (other side) passes, 10% off fails.
  assert step_time.loss_verdict('loss', [1.0 + 1e-4], [1.0 - 1e-4], [1.0])[0]
  assert not step_time.loss_verdict('loss', [1.1], [1.0 + 1e-4], [1.0])[0]
