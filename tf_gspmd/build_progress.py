"""What a partitioned program's first call is doing, shown while it takes long.

The first call of a partitioned function captures the step, propagates
shardings, makes the sharded variables, partitions the program and lets TF
instantiate it on every device: tens of seconds for a large model. Keras shows a
progress bar for the steps that follow; this shows which phase the build is in.
Nothing is shown for a build shorter than `DELAY` seconds. On a terminal it is
one line, updated in place and closed with the phase times. Elsewhere (CI, `| tee`,
a notebook) one line per phase reached after the delay, one more every `REMIND`
seconds of a phase that lasts, and one at the end: INFO records on the 'tf_gspmd'
logger when logging is configured to show them, else plain lines on the stream
(stderr), so a build is never silent for want of a logging set-up. Off with
`progress=False` on `tf_gspmd.partition`, or TF_GSPMD_PROGRESS=0 for the whole process.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from typing import Dict, List, Optional, TextIO

DELAY = 3.0  # seconds of build before anything is shown
POLL = 0.25  # seconds between updates of the line
REMIND = 30.0  # off a terminal: seconds between two lines of one long phase
_LOG = logging.getLogger('tf_gspmd')


def enabled_by_default() -> bool:
  return os.environ.get('TF_GSPMD_PROGRESS', '1').lower() not in ('0', 'false', 'off', 'no')


class BuildProgress:
  """A context manager around one build; `phase(text)` marks where it is.

  `phases` holds (phase, seconds) in order once the build ends, shown or not.
  """

  def __init__(
    self,
    name: str,
    enabled: bool = True,
    stream: Optional[TextIO] = None,
    delay: Optional[float] = None,
  ):
    self.name = name
    self.enabled = enabled
    self.stream = stream if stream is not None else sys.stderr
    self.delay = DELAY if delay is None else delay
    self.phases: List[tuple] = []
    self._lock = threading.Lock()
    self._done = threading.Event()
    self._thread: Optional[threading.Thread] = None
    self._start = self._phase_start = 0.0
    self._phase = ''
    self._shown = False
    self._logged: Dict[str, float] = {}  # off a terminal: phase -> when its last line went out

  def __enter__(self) -> 'BuildProgress':
    self._start = self._phase_start = time.perf_counter()
    if self.enabled:
      self._thread = threading.Thread(target=self._run, name='tf_gspmd_progress', daemon=True)
      self._thread.start()
    return self

  def phase(self, text: str) -> None:
    now = time.perf_counter()
    with self._lock:
      if self._phase:
        self.phases.append((self._phase, now - self._phase_start))
      self._phase, self._phase_start = text, now

  def __exit__(self, *exc) -> None:
    self.phase('')
    self._done.set()
    if self._thread is not None:
      self._thread.join()
    if self._shown and exc[0] is None:
      self._show(
        f'built in {time.perf_counter() - self._start:.1f} s ('
        + ', '.join(f'{p} {s:.1f} s' for p, s in self.phases)
        + ')',
        final=True,
      )
    elif self._shown and self._is_terminal():
      self.stream.write('\n')
      self.stream.flush()

  # --- showing --------------------------------------------------------------------
  def _is_terminal(self) -> bool:
    isatty = getattr(self.stream, 'isatty', None)
    return bool(isatty and isatty())

  def _run(self) -> None:
    while not self._done.wait(POLL):
      now = time.perf_counter()
      if now - self._start < self.delay:
        continue
      with self._lock:
        phase, since = self._phase, self._phase_start
      if phase:
        self._show(f'{phase} ({now - since:.0f} s; {now - self._start:.0f} s in all)', phase=phase)

  def _show(self, text: str, phase: str = '', final: bool = False) -> None:
    line = f'tf_gspmd: building {self.name}: {text}'
    if self._is_terminal():  # rewrite the line in place (padded over a longer one); end it
      self.stream.write('\r' + line.ljust(100) + ('\n' if final else ''))
      self.stream.flush()
    elif final:
      self._write_line(line)
    elif self._due(phase):  # the phase's name first; later lines of a long phase its times
      first = phase not in self._logged
      self._logged[phase] = time.perf_counter()
      self._write_line(f'tf_gspmd: building {self.name}: {phase if first else "still " + text}')
    self._shown = True

  def _due(self, phase: str) -> bool:
    """Off a terminal: a phase's first line, then one every REMIND seconds it lasts."""
    last = self._logged.get(phase)
    return last is None or time.perf_counter() - last >= REMIND

  def _write_line(self, line: str) -> None:
    """One line where it will be seen: the log when it shows INFO records, else the stream."""
    if _LOG.isEnabledFor(logging.INFO) and _LOG.hasHandlers():
      _LOG.info(line)
    else:
      self.stream.write(line + '\n')
      self.stream.flush()
