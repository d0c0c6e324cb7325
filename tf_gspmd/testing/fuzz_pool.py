"""A fuzz campaign on worker processes: programs judged side by side, reported in order.

A campaign's programs are independent (each draws its own inputs and builds its own
functions and variables), and judging one is Python and TF work on one core at a time. So
`Workers(jobs, work, args, setup)` starts `jobs` persistent processes (spawned once each: TF
imported, devices configured, the imports frozen out of the garbage collector's walks once,
not once per program) and `results(indices)` yields `(index, work(index, *args))` in index
order, whatever order the workers finish in: a campaign's printed lines and tally are the
ones a single process gives.

`work` returns `(result, replace)`: `replace` asks for a fresh worker after this one (a
failed collective aborts every later collective in its process). A worker that dies (TF
aborting the process) is replaced too, and its program's result is `died(index, exitcode)`.
"""

from __future__ import annotations

import dataclasses
import gc
import multiprocessing
import os
import time
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
  """`jobs` worker processes running `work(index, *args)` (see the module docstring).

  `setup()` runs once in each worker before its first program; `died(index, exitcode)`
  is the result of a program whose worker died judging it. A context manager: leaving it
  stops the workers."""

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
    self.context = multiprocessing.get_context('spawn')  # TF's threads do not survive a fork
    self.workers: List[_Worker] = []
    self.replaced = 0

  def __enter__(self) -> 'Workers':
    self.workers = [self._start() for _ in range(self.jobs)]
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def _start(self) -> _Worker:
    mine, theirs = self.context.Pipe()
    process = self.context.Process(
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
    waiting = list(reversed(order))
    done: Dict[int, Any] = {}
    for index in order:
      while index not in done:
        self._hand_out(waiting)
        self._gather(done)
      yield index, done.pop(index)

  def _hand_out(self, waiting: List[int]) -> None:
    for worker in self.workers:
      if worker.index is None and waiting:
        worker.index = waiting.pop()
        worker.conn.send(worker.index)

  def _gather(self, done: Dict[int, Any]) -> None:
    """Wait for a busy worker to answer (or die) and take what it gave."""
    busy = [w for w in self.workers if w.index is not None]
    ready = connection.wait([w.conn for w in busy] + [w.process.sentinel for w in busy])
    for worker in busy:
      if worker.conn not in ready and worker.process.sentinel not in ready:
        continue
      index, worker.index = worker.index, None
      try:
        result, replace = worker.conn.recv()
      except (EOFError, OSError):  # it died before answering
        worker.process.join(5)
        done[index] = self.died(index, worker.process.exitcode)
        self._replace(worker)
        continue
      done[index] = result
      if replace:
        self._replace(worker)

  def close(self) -> None:
    for worker in self.workers:
      _stop(worker)
    self.workers = []


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


def rate_line(programs: int, seconds: float, jobs: int, what: str = 'programs') -> str:
  return (
    f'{programs} {what} in {seconds:.1f} s on {jobs} process{"es" * (jobs > 1)}: '
    f'{programs / max(seconds, 1e-9):.3f} {what}/s'
  )


def summary_table(rows: List[Tuple[str, Any]]) -> str:
  """`rows` of (what, count) as an aligned two-column table."""
  width = max(len(what) for what, _ in rows)
  return '\n'.join(f'  {what.ljust(width)}  {count}' for what, count in rows)


def elapsed(began: float) -> float:
  return time.time() - began
