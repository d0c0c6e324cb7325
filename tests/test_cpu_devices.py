"""`tg.configure_cpu_devices`: N logical CPUs and TF's pools, set in a fresh interpreter
(TF fixes both at its first use, and the test session's TF is already running), and a
partitioned step on them equal to the unpartitioned one through the oracle."""

import os
import subprocess
import sys
import textwrap

import pytest

import tf_gspmd as tg

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_CHILD = textwrap.dedent(
  """
  import numpy as np
  import tensorflow as tf
  import tf_gspmd as tg
  from tf_gspmd.testing import oracle

  devices = tg.configure_cpu_devices(4, threads=1)
  assert len(devices) == 4 and devices[-1].endswith('CPU:3'), devices
  pools = tf.config.threading
  assert pools.get_inter_op_parallelism_threads() == 1
  assert pools.get_intra_op_parallelism_threads() == 1
  assert tg.configure_cpu_devices(4, threads=1) == devices  # the same again: nothing to change
  assert tg.configure_cpu_devices(4) == devices  # TF's pools asked for: whatever they are
  try:
    tg.configure_cpu_devices(2)
  except RuntimeError as error:
    assert 'already initialized with 4 logical CPU devices' in str(error), error
  else:
    raise AssertionError('configure_cpu_devices(2) after TF started did not raise')

  mesh = tg.Mesh.create((4,), ('data',))
  w = tf.Variable(np.random.RandomState(0).randn(8, 8).astype(np.float32))

  def step(x):
    return tf.reduce_sum(tf.tanh(tf.matmul(x, w)))  # a sum over the split batch

  x = np.random.RandomState(1).randn(16, 8).astype(np.float32)
  split = tg.NamedSharding(mesh, tg.P('data', None))
  partitioned = tg.partition(tf.function(step), mesh, in_shardings=(split,), progress=False)
  verdict = oracle.check(partitioned(x).numpy(), step(x).numpy(), 'step')
  assert verdict.ok, verdict
  kinds = [c['kind'] for c in partitioned.collectives()]
  assert kinds == ['all_reduce'], kinds
  print('CHILD OK')
  """
)


def test_configure_cpu_devices_in_a_fresh_interpreter():
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL='2', PYTHONPATH=ROOT)
  done = subprocess.run(
    [sys.executable, '-c', _CHILD], capture_output=True, text=True, env=env, timeout=300
  )
  assert 'CHILD OK' in done.stdout, done.stdout + done.stderr[-3000:]


def test_after_tf_started_a_different_count_is_a_clear_error():
  with pytest.raises(RuntimeError, match='already initialized with 8 logical CPU devices'):
    tg.configure_cpu_devices(3)


def test_the_sessions_own_configuration_is_accepted_as_it_is():
  assert len(tg.configure_cpu_devices(8)) == 8  # the default leaves TF's pools as they are


def test_other_pools_after_tf_started_are_a_clear_error():
  with pytest.raises(RuntimeError, match='inter-op / intra-op threads'):
    tg.configure_cpu_devices(8, threads=3)


def test_n_below_one_is_refused():
  with pytest.raises(ValueError, match='n must be at least 1'):
    tg.configure_cpu_devices(0)
