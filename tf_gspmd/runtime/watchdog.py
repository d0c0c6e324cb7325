"""Collectives timed out from the devices' progress markers, and failures told by name.

Each device's ordering token carries a progress marker: 2k+1 while it waits in
collective #k, 2k+2 once that one finished (and the time it started waiting). A
watchdog thread reads the markers of running calls and, when a device has waited
in one collective longer than the timeout, aborts the process's collectives (TF's
own per-op timeouts cost a sleeping thread per op execution). After a failure,
`collective_error` reads the markers to say which collective failed, in which
group, who was waiting in it and who never arrived.
"""

from __future__ import annotations

import threading
import time
from typing import Optional

import tensorflow as tf

from tf_gspmd.runtime.errors import CollectiveError
from tf_gspmd.tf_private import context


class CallWatch:
  """One running call of an SpmdProgram, as the watchdog sees it."""

  def __init__(self, name: str, timeout: float, markers: bool, tokens):
    self.name = name
    self.timeout = timeout
    self.markers = markers
    self.tokens = tokens
    self.start = time.time()
    self.fired = False

  def stuck(self, now: float) -> Optional[str]:
    """A reason to abort, when some device has waited in a collective longer than the timeout."""
    if now - self.start < self.timeout:
      return None  # nothing in this call can have waited that long yet
    if not self.markers:
      return f'{self.name}: the call ran longer than its {self.timeout:g} s timeout'
    for p, token in enumerate(self.tokens):
      state, started = token.numpy()
      if int(state) % 2 == 1 and now - started >= self.timeout:
        return (
          f'{self.name}: partition {p} waited {now - started:.1f} s in collective '
          f'#{(int(state) - 1) // 2} (timeout {self.timeout:g} s)'
        )
    return None


class Watchdog:
  """One daemon thread per process that times out the collectives of running calls.

  Every `poll` seconds it looks at the calls older than their timeout and reads
  their devices' progress markers; when a device has waited in one collective
  longer than the timeout, it aborts the process's collective executor
  (`abort_collective_ops`), which fails every pending collective at once.
  """

  def __init__(self, poll: float = 0.1):
    self._poll = poll
    self._lock = threading.Lock()
    self._calls = set()
    self._thread = None

  def watch(self, name: str, timeout: Optional[float], markers: bool, tokens):
    """Watch one call (None, watching nothing, when it has no timeout)."""
    if timeout is None:
      return None
    call = CallWatch(name, timeout, markers, tokens)
    with self._lock:
      self._calls.add(call)
      if self._thread is None:
        self._thread = threading.Thread(target=self._run, name='tf_gspmd_watchdog', daemon=True)
        self._thread.start()
    return call

  def unwatch(self, call: Optional[CallWatch]) -> None:
    if call is not None:
      with self._lock:
        self._calls.discard(call)

  def _run(self):
    while True:
      time.sleep(self._poll)
      with self._lock:
        calls = list(self._calls)
      now = time.time()
      for call in calls:
        if call.fired:
          continue
        try:
          reason = call.stuck(now)
        except Exception:  # noqa: BLE001
          continue  # markers unreadable (e.g. variables being torn down): try again later
        if reason:
          call.fired = True
          context.context().abort_collective_ops(
            tf.errors.DEADLINE_EXCEEDED, f'tf_gspmd watchdog: {reason}'
          )


WATCHDOG = Watchdog()


def collective_error(
  records, tokens, timeout: Optional[float], error: Exception, watch: Optional[CallWatch]
) -> Optional[CollectiveError]:
  """The CollectiveError telling which collective of `records` failed (None: markers say none).

  `tokens`: each partition's token variable; `watch`: the call's watch, which says
  whether the watchdog fired (a timeout) or the collective failed by itself.
  """
  try:
    markers = [int(t.numpy()[0]) for t in tokens]
  except Exception:  # noqa: BLE001
    return None  # the markers are unreadable: TF's own error stands
  stuck = {}
  for p, marker in enumerate(markers):
    if marker % 2 == 1:
      stuck.setdefault((marker - 1) // 2, []).append(p)
  if not stuck or not records:
    return None
  lines = []
  for index in sorted(stuck):
    record = records[index]
    if watch is not None and watch.fired:
      lines.append(
        f'Collective {record.describe()} did not complete within its {timeout:g} s timeout.'
      )
    else:
      lines.append(f'Collective {record.describe()} failed.')
    lines += _group_lines(record, stuck[index], markers, records)
  lines.append(
    f'(TF reported {type(error).__name__}: {_gist(str(error))}.) '
    'A failed collective aborts all later collectives in this process.'
  )
  return CollectiveError('\n'.join(lines))


def _group_lines(record, waiting, markers, records) -> list:
  """Per group of `record` some partition waits in: who waited, and where the others were."""
  lines, seen = [], set()
  for p in waiting:
    group = record.group_of(p)
    if group in seen:
      continue
    seen.add(group)
    in_group = [q for q in group if q in waiting]
    absent = [q for q in group if q not in waiting]
    absent_text = '; '.join(f'partition {q} {_state(markers[q], records)}' for q in absent)
    lines.append(
      f'  group {list(group)}: partitions {in_group} were waiting in it; '
      f'never joined: {absent_text or "none (the collective itself failed)"}.'
    )
  return lines


def _gist(message: str) -> str:
  """The line of a TF error message that says what happened (not the stack or node list)."""
  for line in message.splitlines():
    line = line.strip()
    if line and not line.startswith(('File ', 'Graph execution error', 'Detected at node', '[[')):
      return line
  return message.strip().splitlines()[0] if message.strip() else ''


def _state(marker: int, records) -> str:
  if marker == 0:
    return 'had finished no collective'
  if marker % 2 == 0:
    return f"had last finished '{records[(marker - 2) // 2].name}'"
  return f"was waiting in '{records[(marker - 1) // 2].name}'"
