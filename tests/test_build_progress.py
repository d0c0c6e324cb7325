"""The first call's progress: which phase a long build is in, on a terminal or in the log."""

import io
import logging
import re
import time

import numpy as np
import tensorflow as tf

import tf_gspmd as tg
from tf_gspmd import build_progress
from tf_gspmd.testing import assert_close

PHASES = [
  'capturing the step',
  'propagating shardings',
  'making the sharded variables',
  'partitioning the program',
  'instantiating on 8 devices and running the first step',
]


class Terminal(io.StringIO):
  def isatty(self):
    return True


def test_a_terminal_sees_one_line_rewritten_then_the_phase_times():
  stream = Terminal()
  with build_progress.BuildProgress('step', stream=stream, delay=0.0) as progress:
    progress.phase('capturing the step')
    time.sleep(0.6)
    progress.phase('propagating shardings')
    time.sleep(0.6)
  text = stream.getvalue()
  assert text.count('\n') == 1 and text.endswith('\n')  # one line, ended once
  updates = text.split('\r')[1:]
  assert any('capturing the step' in u for u in updates)
  assert any('propagating shardings' in u for u in updates)
  assert [p for p, _ in progress.phases] == ['capturing the step', 'propagating shardings']
  # The closing line gives each phase's time as measured (at least the 0.6 s slept; a loaded
  # machine may add more), and the total as at least their sum.
  shown = re.fullmatch(
    r'.*built in ([\d.]+) s \(capturing the step ([\d.]+) s, propagating shardings ([\d.]+) s\)\s*',
    updates[-1],
  )
  assert shown, updates[-1]
  total, *each = (float(v) for v in shown.groups())
  assert each == [round(s, 1) for _, s in progress.phases]
  assert all(s >= 0.6 for _, s in progress.phases)
  assert total >= sum(each) - 0.1


def test_a_short_build_shows_nothing():
  stream = Terminal()
  with build_progress.BuildProgress('step', stream=stream, delay=5.0) as progress:
    progress.phase('capturing the step')
    time.sleep(0.3)
  assert stream.getvalue() == ''
  assert [p for p, _ in progress.phases] == ['capturing the step']


def test_off_a_terminal_without_logging_plain_lines_reach_the_stream(monkeypatch):
  """CI and `| tee`: nothing configures logging, so the lines go to the stream itself."""
  monkeypatch.setattr(build_progress, 'POLL', 0.01)
  monkeypatch.setattr(build_progress, 'REMIND', 0.2)
  monkeypatch.setattr(logging.getLogger('tf_gspmd'), 'level', logging.NOTSET)
  monkeypatch.setattr(logging.getLogger(), 'level', logging.WARNING)  # Python's default
  stream = io.StringIO()
  with build_progress.BuildProgress('step', stream=stream, delay=0.0) as progress:
    progress.phase('capturing the step')
    time.sleep(0.5)
    progress.phase('propagating shardings')
    time.sleep(0.1)
  lines = stream.getvalue().splitlines()
  assert '\r' not in stream.getvalue()
  assert lines[0] == 'tf_gspmd: building step: capturing the step'
  reminder = 'tf_gspmd: building step: still capturing the step ('
  still = [line for line in lines if line.startswith(reminder)]
  # One line per REMIND seconds of the phase (however long a loaded machine made it), not one
  # per poll (about 50 polls here).
  assert 1 <= len(still) <= progress.phases[0][1] / 0.2 + 1
  assert 'tf_gspmd: building step: propagating shardings' in lines
  assert lines[-1].startswith('tf_gspmd: building step: built in ')


def _step(mesh):
  w = tf.Variable(np.ones((8, 4), np.float32), name='w')

  @tf.function
  def step(x):
    x = tg.shard(x, mesh, tg.P('data', None))
    loss = tf.reduce_sum(tf.tanh(x @ w))
    w.assign_sub(0.1 * tf.ones_like(w) * loss)
    return loss

  return step


def test_partition_logs_each_phase_of_a_long_first_call_once(caplog, monkeypatch):
  monkeypatch.setattr(build_progress, 'DELAY', 0.0)  # every build counts as long here
  monkeypatch.setattr(build_progress, 'POLL', 0.01)
  mesh = tg.Mesh.create((8,), ('data',))
  x = np.arange(64, dtype=np.float32).reshape(8, 8) / 64
  pf = tg.partition(_step(mesh), mesh)
  with caplog.at_level(logging.INFO, logger='tf_gspmd'):
    first = pf(x)
    logged = [r.getMessage() for r in caplog.records if 'building step' in r.getMessage()]
    caplog.clear()
    pf(x)
    assert not [r for r in caplog.records if 'building' in r.getMessage()]
  assert_close(first, _step(mesh)(x), 'first loss')
  assert [p for p, _ in pf.last_build.phases] == PHASES
  assert all(s >= 0 for _, s in pf.last_build.phases)
  # Phases the poll saw, each once and in order; the last line sums them up.
  seen = [m.split('building step on 8 devices: ')[1] for m in logged[:-1]]
  assert seen == [p for p in PHASES if p in seen] and len(set(seen)) == len(seen)
  assert 'built in' in logged[-1]


def test_progress_off_by_option_and_by_environment(caplog, monkeypatch):
  monkeypatch.setattr(build_progress, 'DELAY', 0.0)
  mesh = tg.Mesh.create((8,), ('data',))
  x = np.ones((8, 8), np.float32)
  with caplog.at_level(logging.INFO, logger='tf_gspmd'):
    tg.partition(_step(mesh), mesh, progress=False)(x)
    monkeypatch.setenv('TF_GSPMD_PROGRESS', '0')
    pf = tg.partition(_step(mesh), mesh)
    pf(x)
  assert not [r for r in caplog.records if 'building' in r.getMessage()]
  assert [p for p, _ in pf.last_build.phases] == PHASES  # still timed, only not shown
