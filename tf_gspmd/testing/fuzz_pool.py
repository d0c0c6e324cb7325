"""A fuzz campaign on worker processes: programs judged side by side, reported in order.

A campaign's programs are independent (each draws its own inputs and builds its own
functions and variables), and judging one is Python and TF work on one core at a time. So
`Workers(jobs, work, args, setup)` judges in this process and in `jobs` - 1 persistent
worker processes (started once each: devices configured, the imports frozen out of the
garbage collector's walks once, not once per program; forked while TF's runtime has not
started here, so that a worker does not import TF again, else spawned), and
`results(indices)` yields `(index, work(index, *args))` in index order, whatever order they
finish in: a campaign's printed lines and tally are the ones a single process gives.

`work` returns `(result, replace)`: `replace` asks for a fresh worker after this one (a
failed collective aborts every later collective in its process; this process then judges no
more). A worker that dies (TF aborting the process) is replaced too, and its program's result
is `died(index, exitcode)`.
"""

from __future__ import annotations

import collections
import dataclasses
import gc
import multiprocessing
import os
import sys
import threading
from multiprocessing import connection
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Tuple

# What a campaign's process sets for the garbage collector once its imports are frozen
# (`quiet_collector`): a collection every 10,000 new objects, not 700 (tracing a program
# makes hundreds of thousands), and a full one only when asked: a campaign asks after
# each program (`collect`), where the program's graphs have just become garbage.
GC_THRESHOLDS = (10_000, 50, 1_000_000)


def quiet_collector() -> None:
  """Put what is alive now (TF's and tf_gspmd's ~350k objects, alive for the whole run) out
  of the garbage collector's reach, and collect in larger steps (`GC_THRESHOLDS`)."""
  gc.collect()
  gc.freeze()
  gc.set_threshold(*GC_THRESHOLDS)


def collect() -> None:
  """The full collection after a program: its functions' graphs are cycles, and a function
  leaves TF's context only when its graph is collected."""
  gc.collect()


@dataclasses.dataclass
class _Worker:
  process: Any
  conn: Any
  index: Optional[int] = None  # the program it is judging, None when idle


class Workers:
  """`jobs` processes running `work(index, *args)`: this one (in the thread that reads
  `results`) and `jobs` - 1 spawned workers, served by a thread of this process.

  `setup()` runs once in each spawned worker before its first program (this process is set
  up by its caller); `died(index, exitcode)` is the result of a program whose worker died
  judging it. A context manager: leaving it stops the workers."""

  def __init__(
    self,
    jobs: int,
    work: Callable,
    args: tuple = (),
    setup: Optional[Callable[[], None]] = None,
    died: Optional[Callable[[int, int], Any]] = None,
  ):
    if jobs < 1:
      raise ValueError(f'Workers: jobs must be 1 or more, got {jobs}.')
    self.jobs = jobs
    self.work, self.args, self.setup = work, tuple(args), setup
    self.died = died or (lambda index, code: None)
    self.workers: List[_Worker] = []
    self.replaced = 0
    self._changed = threading.Condition()  # guards what follows; notified when it changes
    self._waiting: collections.deque = collections.deque()
    self._done: Dict[int, Any] = {}
    self._here = True  # whether this process still judges (not once its collectives failed)
    self._closing = False

  def __enter__(self) -> 'Workers':
    self.workers = [self._start() for _ in range(self.jobs - 1)]
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def _start(self) -> _Worker:
    context = multiprocessing.get_context(start_method())
    mine, theirs = context.Pipe()
    process = context.Process(
      target=_serve, args=(self.work, self.args, self.setup, theirs), daemon=True
    )
    process.start()
    theirs.close()
    return _Worker(process, mine)

  def _replace(self, worker: _Worker) -> None:
    _stop(worker)
    self.workers[self.workers.index(worker)] = self._start()
    self.replaced += 1

  def results(self, indices: Iterable[int]) -> Iterator[Tuple[int, Any]]:
    """`(index, result)` for each of `indices`, in their order."""
    order = list(indices)
    with self._changed:
      self._waiting.extend(order)
    server = threading.Thread(target=self._serve_workers, daemon=True)
    server.start()
    try:
      for index in order:
        yield index, self._result(index)
    finally:
      with self._changed:
        self._closing = True
        self._changed.notify_all()
      server.join()

  def _result(self, index: int) -> Any:
    """`index`'s result: judging the next waiting program here while it is not in."""
    while True:
      with self._changed:
        if index in self._done:
          return self._done.pop(index)
        if not (self._here and self._waiting):
          self._changed.wait()
          continue
        mine = self._waiting.popleft()
      result, replace = self.work(mine, *self.args)
      with self._changed:
        self._done[mine] = result
        self._here = self._here and not replace
        self._changed.notify_all()

  def _serve_workers(self) -> None:
    """The spawned workers' side of `results`: hand out waiting programs, take results."""
    while True:
      with self._changed:
        if self._closing:
          return
        for worker in self.workers:
          if worker.index is None and self._waiting:
            worker.index = self._waiting.popleft()
            worker.conn.send(worker.index)
        busy = [w for w in self.workers if w.index is not None]
        if not busy:
          self._changed.wait()
          continue
      ready = connection.wait([w.conn for w in busy] + [w.process.sentinel for w in busy], 1.0)
      for worker in busy:
        if worker.conn in ready or worker.process.sentinel in ready:
          self._take(worker)

  def _take(self, worker: _Worker) -> None:
    """What `worker` answered (or, when it died, `died`); a fresh worker in its place when
    it asked for one or died."""
    index, worker.index = worker.index, None
    try:
      result, replace = worker.conn.recv()
    except (EOFError, OSError):  # it died before answering
      worker.process.join(5)
      result, replace = self.died(index, worker.process.exitcode), True
    if replace:
      self._replace(worker)
    with self._changed:
      self._done[index] = result
      self._changed.notify_all()

  def close(self) -> None:
    for worker in self.workers:
      _stop(worker)
    self.workers = []


def start_method() -> str:
  """How a worker starts: 'fork' while TF's runtime has not started in this process (TF then
  has no thread of its own, and a forked worker has TF and tf_gspmd imported: ~5 s sooner on
  this machine than a spawned one importing them again); 'spawn' once it has (TF's threads
  and the locks they hold do not survive a fork). A campaign starts its workers before it
  configures its own devices (`fuzz.judge_all`); a replacement, started later, is spawned.
  Linux only: macOS forks no process that loaded its system frameworks safely, Windows none."""
  from tf_gspmd.tf_private import runtime_started

  return 'fork' if sys.platform.startswith('linux') and not runtime_started() else 'spawn'


def _stop(worker: _Worker) -> None:
  try:
    worker.conn.send(None)
  except (OSError, ValueError):
    pass
  worker.process.join(10)
  if worker.process.is_alive():
    worker.process.terminate()
    worker.process.join(5)
  worker.conn.close()


def _serve(work: Callable, args: tuple, setup: Optional[Callable], conn) -> None:
  """A worker's loop: an index in, `work(index, *args)` out, until None comes."""
  os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
  if setup is not None:
    setup()
  while True:
    index = conn.recv()
    if index is None:
      return
    conn.send(work(index, *args))


def summary_table(rows: List[Tuple[str, Any]]) -> str:
  """`rows` of (what, count) as an aligned two-column table."""
  width = max(len(what) for what, _ in rows)
  return '\n'.join(f'  {what.ljust(width)}  {count}' for what, count in rows)
