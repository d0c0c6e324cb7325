"""A call whose partitions run in other processes, watched for a task that stops answering.

The launcher's watchdog (`runtime.watchdog`) reads each device's progress marker and, when a
device has waited in a collective longer than the timeout, aborts this
process's collective executor. Neither half works when partitions run on other
tasks: `abort_collective_ops` reaches only this process's collectives, and a
task that hangs without dying (SIGSTOP, a deadlocked op) still accepts TCP
connections but never answers, so the call -- and a read of its markers --
blocks forever.

So a call onto other tasks' devices runs on a helper thread while the caller
waits with a deadline. Once the call has run longer than the timeout, every
partition's marker is read, each read on its own thread and all within
`probe_seconds`:

* a partition whose marker does not arrive sits on a task that no longer
  answers: that task hangs;
* when every task answers, a partition that has waited in collective k longer
  than the timeout names the culprits: the partitions that never reached k;
* otherwise the step is still computing, and the wait goes on.

The caller then gets a `Hang` naming the tasks, their addresses and their
partitions. The helper thread is left blocked: it ends when the hung task is
killed (restarting the tasks kills it), which fails its remote call.

The markers themselves are made at a call's first launch, on their devices: on a stopped
task that blocks too, so `made_on_each_device` makes them under the same deadline.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple, TypeVar

import tensorflow as tf

from tf_gspmd.runtime import cluster

POLL_SECONDS = 0.25
T = TypeVar('T')


class Hang(Exception):
  """Some tasks stopped answering while a call ran on them (the message says which)."""


def spans_other_tasks(devices: Sequence[str]) -> bool:
  """Whether any device belongs to a task other than this process ('/job:localhost')."""
  return any(tf.DeviceSpec.from_string(d).job not in (None, cluster.CLIENT_JOB) for d in devices)


def run_watched(
  call: Callable[[], object],
  tokens: Sequence[tf.Variable],
  devices: Sequence[str],
  timeout: float,
  what: str,
  probe_seconds: Optional[float] = None,
):
  """`call()`'s result (or its exception), raising `Hang` when a task stops answering."""
  outcome: Dict[str, object] = {}

  def run():
    try:
      outcome['result'] = call()
    except BaseException as error:  # noqa: BLE001  re-raised by the caller
      outcome['error'] = error

  worker = threading.Thread(target=run, name='tf_gspmd_remote_call', daemon=True)
  start = time.time()
  worker.start()
  probe = probe_seconds if probe_seconds is not None else min(5.0, max(1.0, timeout / 4))
  while True:
    worker.join(POLL_SECONDS)
    if not worker.is_alive():
      if 'error' in outcome:
        raise outcome['error']  # type: ignore[misc]
      return outcome['result']
    if time.time() - start >= timeout:
      hung = _hung_partitions(tokens, timeout, probe)
      if hung:
        raise Hang(_describe(hung, devices, timeout, what))


def made_on_each_device(
  make: Callable[[int, str], T], devices: Sequence[str], timeout: float, what: str
) -> List[T]:
  """`[make(p, device) for p, device in enumerate(devices)]`; `Hang` when a task stops answering.

  Making a variable on another task's device waits for that task: a stopped one never
  answers, and the call that makes the progress markers would block before any watch could
  start. Each device's `make` runs on its own thread; those not done within `timeout` sit on
  tasks that stopped answering. The first error a `make` raised (a dead task's) is re-raised.
  """
  made, errors = _each_within(lambda p: make(p, devices[p]), len(devices), timeout, 'make')
  if errors:
    raise errors[0]
  silent = {
    p: f'its task did not answer the making of its progress marker within {timeout:g} s'
    for p in range(len(devices))
    if p not in made
  }
  if silent:
    raise Hang(_describe(silent, devices, timeout, what))
  return [made[p] for p in range(len(devices))]


def _hung_partitions(
  tokens: Sequence[tf.Variable], timeout: float, probe_seconds: float
) -> Dict[int, str]:
  """Partition -> why it is to blame; empty while the call may still be computing."""
  markers = _read_markers(tokens, probe_seconds)
  silent = {
    p: f'its task did not answer a read of its progress marker within {probe_seconds:g} s'
    for p, m in enumerate(markers)
    if m is None
  }
  if silent:
    return silent
  now = time.time()
  stuck = [
    int(state)
    for state, started in markers
    if int(state) % 2 == 1 and now - float(started) >= timeout
  ]
  if not stuck:
    return {}
  waited_in = min(stuck)  # the earliest collective some partition waits in past the timeout
  return {
    p: f'never reached collective #{(waited_in - 1) // 2}, which partitions wait in '
    f'for over {timeout:g} s'
    for p, (state, _) in enumerate(markers)
    if int(state) < waited_in
  }


def _read_markers(tokens: Sequence[tf.Variable], seconds: float) -> List[Optional[tuple]]:
  """Each token's [state, since] marker, or None when its task did not answer in time (or
  the read failed: unreadable counts as silent)."""
  values, _ = _each_within(lambda p: tuple(tokens[p].numpy()), len(tokens), seconds, 'probe')
  return [values.get(p) for p in range(len(tokens))]


def _each_within(
  work: Callable[[int], T], count: int, seconds: float, what: str
) -> Tuple[Dict[int, T], List[BaseException]]:
  """`work(p)` for each p < count, each on a daemon thread of its own, all waited for at most
  `seconds`: the results that arrived by then, and the errors raised. A thread still waiting
  (on a task that does not answer) is left behind."""
  done: Dict[int, T] = {}
  errors: List[BaseException] = []

  def run(p: int) -> None:
    try:
      done[p] = work(p)
    except BaseException as error:  # noqa: BLE001  handed to the caller
      errors.append(error)

  threads = [
    threading.Thread(target=run, args=(p,), daemon=True, name=f'tf_gspmd_{what}{p}')
    for p in range(count)
  ]
  for thread in threads:
    thread.start()
  deadline = time.time() + seconds
  for thread in threads:
    thread.join(max(0.0, deadline - time.time()))
  return dict(done), list(errors)


def _describe(hung: Dict[int, str], devices: Sequence[str], timeout: float, what: str) -> str:
  addresses = cluster.task_addresses()
  by_task: Dict[str, List[int]] = {}
  for p in sorted(hung):
    by_task.setdefault(cluster.task_of(devices[p]), []).append(p)
  lines = []
  for task, partitions in sorted(by_task.items()):
    lines.append(
      f'{what}: task {task} ({addresses.get(task, "address unknown")}), which runs '
      f'partitions {partitions}, stopped responding (partition {partitions[0]}: '
      f'{hung[partitions[0]]}).'
    )
  lines.append(
    f'The call had run for over its {timeout:g} s timeout. The call is abandoned, '
    'not cancelled: kill and restart every task (the hung one first), connect again '
    '(tf_gspmd.runtime.cluster.connect), partition again and restore the last '
    'checkpoint (tg.restore_checkpoint).'
  )
  return '\n'.join(lines)
