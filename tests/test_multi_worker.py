"""The same SPMD program across TF tasks (tf_gspmd.runtime.cluster, examples/multi_worker.py).

The cluster tests run the example as a subprocess: connecting to a cluster
changes this process's TF context for good, and the pytest process holds
8 local logical devices for the other tests. One run has both faults, the kill and then the
hang, each followed by its recovery; it checks every step's loss and the final weights
against the unpartitioned run, so no uninterrupted run is needed beside it.
"""

import os
import re
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import tensorflow as tf

import tf_gspmd as tg
from tf_gspmd.runtime import cluster, loopback, remote_watch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, 'examples', 'multi_worker.py')
TIMEOUT = 20.0  # the example's collective timeout (TF_GSPMD_EXAMPLE_TIMEOUT)


def _names(tasks, per_task):
  spec = tf.train.ClusterSpec({'worker': [f'127.0.0.1:{1000 + t}' for t in range(tasks)]})
  return cluster.task_devices(spec, per_task)


def test_mesh_devices_keeps_model_groups_inside_a_task():
  mesh = tg.Mesh.create((2, 4), ('data', 'model'))
  devices = cluster.mesh_devices(mesh, _names(2, 4), inside=('model',))
  assert devices == tuple(
    f'/job:worker/replica:0/task:{p // 4}/device:CPU:{p % 4}' for p in range(8)
  )
  for group in mesh.groups(['model']):
    assert len({cluster.task_of(devices[p]) for p in group}) == 1
  for group in mesh.groups(['data']):
    assert len({cluster.task_of(devices[p]) for p in group}) == 2


def test_mesh_devices_inside_a_leading_axis():
  mesh = tg.Mesh.create((4, 2), ('model', 'data'))  # 'model' is not the fastest axis here
  devices = cluster.mesh_devices(mesh, _names(2, 4), inside=('model',))
  for group in mesh.groups(['model']):
    assert len({cluster.task_of(devices[p]) for p in group}) == 1
  # data=0 -> task 0, data=1 -> task 1; device index = the model coordinate.
  for p in mesh.devices:
    coords = mesh.coords(p)
    assert devices[p] == f'/job:worker/replica:0/task:{coords["data"]}/device:CPU:{coords["model"]}'
  assert len(set(devices)) == 8


def test_mesh_devices_errors():
  mesh = tg.Mesh.create((2, 4), ('data', 'model'))
  with pytest.raises(ValueError, match=r"group along \('model',\) has 4 devices"):
    cluster.mesh_devices(mesh, _names(4, 2), inside=('model',))
  with pytest.raises(ValueError, match=r'2 tasks x 2 devices = 4 devices for a mesh of 8'):
    cluster.mesh_devices(mesh, _names(2, 2), inside=('model',))
  with pytest.raises(ValueError, match="'batch' is not an axis"):
    cluster.mesh_devices(mesh, _names(2, 4), inside=('batch',))


def test_the_task_whose_server_is_gone_is_named_not_the_one_the_error_names(monkeypatch):
  """TF's error may name a live task whose collectives the dead one aborted; the task whose
  server no longer accepts connections is the lost one."""
  import socket

  devices = [d for names in _names(2, 4) for d in names]
  live = socket.socket()
  live.bind(('127.0.0.1', 0))
  live.listen(1)
  closed = socket.socket()
  closed.bind(('127.0.0.1', 0))
  gone = closed.getsockname()[1]
  closed.close()  # nothing listens there: a killed worker's port
  monkeypatch.setattr(
    cluster,
    'task_addresses',
    lambda: {
      '/job:worker/replica:0/task:0': f'127.0.0.1:{live.getsockname()[1]}',
      '/job:worker/replica:0/task:1': f'127.0.0.1:{gone}',
    },
  )
  text = (
    'UNAVAILABLE: Socket closed\nAdditional GRPC error information from remote target '
    '/job:worker/replica:0/task:0/device:CPU:0 while calling RunComponentFunction'
  )
  try:
    assert cluster.lost_tasks(devices, tf.errors.UnavailableError(None, None, text)) == [
      '/job:worker/replica:0/task:1'
    ]
  finally:
    live.close()


def test_lost_task_is_named_only_for_unavailable_errors():
  devices = [d for names in _names(2, 4) for d in names]
  text = (
    'UNAVAILABLE: Socket closed\nAdditional GRPC error information from remote target '
    '/job:worker/replica:0/task:1/device:CPU:3 while calling RunComponentFunction'
  )
  assert cluster.lost_tasks(devices, tf.errors.UnavailableError(None, None, text)) == [
    '/job:worker/replica:0/task:1'
  ]
  assert cluster.lost_tasks(devices, tf.errors.InternalError(None, None, text)) == []
  with pytest.raises(
    tg.CollectiveError,
    match=r'task /job:worker/replica:0/task:1 .*partitions '
    r'\[4, 5, 6, 7\].*unreachable',
  ):
    cluster.raise_if_task_lost(devices, tf.errors.UnavailableError(None, None, text), 'step')


class _Marker:
  """A token variable stand-in: its [state, since] marker, or a read that never returns."""

  def __init__(self, state=0, since=0.0, hangs=False):
    self.value, self.hangs = np.array([state, since]), hangs

  def numpy(self):
    if self.hangs:
      threading.Event().wait()  # a stopped task: the read never answers
    return self.value


def test_a_task_that_does_not_answer_is_the_hung_one():
  now = time.time()
  markers = [_Marker(3, now - 30)] * 4 + [_Marker(hangs=True)] * 4
  hung = remote_watch._hung_partitions(markers, timeout=10, probe_seconds=0.2)
  assert sorted(hung) == [4, 5, 6, 7] and 'did not answer' in hung[4]


def test_partitions_that_never_reached_a_collective_others_wait_in_are_hung():
  now = time.time()
  markers = [_Marker(5, now - 30)] * 4 + [_Marker(4, now - 30)] * 2 + [_Marker(5, now - 1)] * 2
  hung = remote_watch._hung_partitions(markers, timeout=10, probe_seconds=1)
  assert sorted(hung) == [4, 5] and 'never reached collective #2' in hung[4]
  # Nobody has waited past the timeout: still computing, nobody to blame.
  assert remote_watch._hung_partitions([_Marker(5, now - 1)] * 8, 10, 1) == {}


def test_a_watched_call_returns_or_raises_what_the_call_does():
  assert remote_watch.run_watched(lambda: 7, [], [], timeout=5, what='step') == 7
  with pytest.raises(ZeroDivisionError):
    remote_watch.run_watched(lambda: 1 / 0, [], [], timeout=5, what='step')
  devices = [d for names in _names(2, 4) for d in names]
  assert remote_watch.spans_other_tasks(devices)
  assert not remote_watch.spans_other_tasks([f'/device:CPU:{p}' for p in range(8)])
  markers = [_Marker(1, time.time())] * 4 + [_Marker(hangs=True)] * 4
  start = time.time()
  with pytest.raises(remote_watch.Hang, match=r'task:1 .*partitions \[4, 5, 6, 7\], stopped'):
    remote_watch.run_watched(
      threading.Event().wait, markers, devices, timeout=0.5, what='step', probe_seconds=0.3
    )
  assert time.time() - start < 3


def test_making_the_markers_on_a_task_that_does_not_answer_names_it():
  devices = [d for names in _names(2, 4) for d in names]
  stopped = threading.Event()  # never set: task 1's makes never return
  assert remote_watch.made_on_each_device(lambda p, d: (p, d), devices, 5, 'step')[5] == (
    5,
    devices[5],
  )

  def make(p, device):
    if p >= 4:
      stopped.wait()
    return p

  start = time.time()
  with pytest.raises(remote_watch.Hang, match=r'task:1 .*partitions \[4, 5, 6, 7\], stopped'):
    remote_watch.made_on_each_device(make, devices, 0.5, 'step')
  assert time.time() - start < 3
  with pytest.raises(ZeroDivisionError):  # a dead task's error is the caller's
    remote_watch.made_on_each_device(lambda p, d: 1 / (p - 3), devices, 5, 'step')


def test_a_first_call_whose_marker_cannot_be_made_raises_instead_of_waiting(monkeypatch):
  """The first call makes each partition's progress marker on its device; on a stopped task
  that never returns, and it happened before the call's watch began (the example's hang
  phase then blocked for good, in 3 of 10 runs): now within the timeout, as a CollectiveError."""
  from tf_gspmd.runtime import collectives as collectives_lib

  make = collectives_lib.new_token_variable
  stopped = threading.Event()

  def on_a_stopped_task(device, name):
    if device.endswith(('CPU:6', 'CPU:7')):
      stopped.wait()
    return make(device, name)

  monkeypatch.setattr(collectives_lib, 'new_token_variable', on_a_stopped_task)
  monkeypatch.setattr(remote_watch, 'spans_other_tasks', lambda devices: True)
  mesh = tg.Mesh.create((8,), ('x',))
  step = tg.partition(lambda x: tf.reduce_sum(x * 2.0), mesh, timeout=1.0)
  x = tg.shard(tf.ones([8, 4]), mesh, tg.P('x', None))
  raised = []

  def call():  # on a thread of its own: a call that blocks fails the test, not the suite
    try:
      step(x)
    except tg.CollectiveError as error:
      raised.append(error)

  caller = threading.Thread(target=call, daemon=True)
  caller.start()
  caller.join(30)
  stopped.set()
  assert raised, 'the call blocked making the markers (or returned) instead of raising'
  assert re.search(r'partitions \[6, 7\], stopped responding', str(raised[0])), raised[0]


def _confined_or_exposed(command):
  """`command` in a loopback-only network namespace, or else acknowledging the exposure."""
  if loopback.available() is None:
    return [sys.executable, '-m', 'tf_gspmd.runtime.loopback', '--'] + command
  return command + ['--expose-to-network']


@pytest.fixture(scope='module')
def run():
  """The example's output with --fault --hang: worker 1 killed, recovered, then stopped and
  recovered, then the last step (one run: the two faults share its start and its model)."""
  env = dict(
    os.environ,
    TF_CPP_MIN_LOG_LEVEL='2',
    KERAS_BACKEND='tensorflow',
    TF_GSPMD_EXAMPLE_TIMEOUT=str(TIMEOUT),
  )
  proc = subprocess.Popen(
    _confined_or_exposed([sys.executable, EXAMPLE, '--fault', '--hang']),
    stdin=subprocess.DEVNULL,  # not the pytest worker's (xdist's channel)
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
    env=env,
    cwd=ROOT,
    start_new_session=True,
  )
  try:
    out, err = proc.communicate(timeout=400)
  except subprocess.TimeoutExpired as expired:
    os.killpg(proc.pid, signal.SIGKILL)  # its session: the wrapper, the example, its workers
    try:
      out, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:  # a worker of its own session holds the pipes
      out, err = _text(expired.output), _text(expired.stderr)
    pytest.fail(  # where it stopped: the example's lines so far, and TF's last words
      f'the example did not finish in 400 s; its output:\n{out[-3000:]}\n--- stderr ---\n'
      f'{err[-3000:]}'
    )
  # Both tails: the example's verdict is on stdout, TF's warnings fill stderr.
  assert proc.returncode == 0, out[-3000:] + '\n--- stderr ---\n' + err[-2000:]
  return out


def _text(data) -> str:
  return data.decode(errors='replace') if isinstance(data, bytes) else (data or '')


def _final_error(output: str) -> float:
  last = output.strip().splitlines()[-1]
  match = re.fullmatch(r'max relative error vs unpartitioned: (\S+)', last)
  assert match, last
  return float(match.group(1))


def _losses(output: str):
  return {
    int(m.group(1)): m.group(2) for m in re.finditer(r'^step (\d+): loss (\S+)', output, re.M)
  }


@pytest.mark.slow
def test_example_trains_across_two_workers(run):
  out = run  # before and after its faults: the same placement and collectives
  assert '/job:worker/replica:0/task:0' in out and '/job:worker/replica:0/task:1' in out
  assert _final_error(out) <= 1e-5
  assert len(_losses(out)) == 3
  # The Megatron all-reduces stay inside a worker; only 'data' ones cross between them.
  assert re.search(r'all_reduce\s+over model\s+inside a task', out)
  assert re.search(r'all_reduce\s+over data\s+between tasks', out)
  assert not re.search(r'over model\s+between tasks', out)


def _interrupted_and_resumed(out: str, how: str) -> tuple:
  """The example's fault run: worker 1 `how` ('killed task 1 (SIGKILL)' or 'stopped task 1
  (SIGSTOP)') mid-steps, a CollectiveError naming it, restart, restore, the uninterrupted run's
  losses. Returns (seconds from the fault to the error, the error's text)."""
  match = re.search(
    re.escape(how)
    + r' while steps ran \(\d+ calls had completed\)\nCollectiveError after (\S+) s: (.*?)\n'
    + r'restarted the workers, connected again and restored the checkpoint',
    out,
    re.S,
  )
  assert match, out[-3000:]
  assert 'task /job:worker/replica:0/task:1' in match.group(2)
  assert 'partitions [4, 5, 6, 7]' in match.group(2)
  assert 'checkpoint ckpt-1 written by' in out and 'restored the checkpoint' in out
  assert _final_error(out) <= 1e-5
  return float(match.group(1)), match.group(2)


@pytest.mark.slow
def test_killed_worker_raises_then_restore_continues(run):
  seconds, _ = _interrupted_and_resumed(run, 'killed task 1 (SIGKILL)')
  assert seconds < TIMEOUT
  # Resumed from the checkpoint (twice), each step's loss is the unpartitioned run's: the
  # example checks every one by the oracle and marks a MISMATCH.
  assert len(_losses(run)) == 3 and 'MISMATCH' not in run


@pytest.mark.slow
def test_hung_worker_raises_within_the_timeout_then_restore_continues(run):
  """SIGSTOP: the task keeps its port open and never answers; the client still raises."""
  seconds, error = _interrupted_and_resumed(run, 'stopped task 1 (SIGSTOP)')
  assert TIMEOUT - 1 <= seconds < TIMEOUT + 10  # the timeout, then a probe of at most 5 s
  assert 'stopped responding' in error
  # The stop came after the kill's recovery: the restarted workers fail and recover again.
  assert run.index('killed task 1 (SIGKILL)') < run.index('stopped task 1 (SIGSTOP)')
