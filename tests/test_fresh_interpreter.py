"""The forked 'fresh interpreter' (tests/fresh_interpreter.py) runs a script as python would."""

import os
import subprocess
import time
import types

import pytest

from tf_gspmd.testing import fresh_interpreter

from helpers import ROOT

SCRIPT = """
import os, sys
import tensorflow as tf
print('argv', sys.argv[1:], 'cwd', os.getcwd(), 'path0', sys.path[0])
print('env', os.environ.get('FRESH_PROBE'))
print('devices', len(tf.config.list_logical_devices('CPU')))
print('to stderr', file=sys.stderr)
sys.exit(int(sys.argv[1]))
"""


def _env(**more):
  return dict(os.environ, PYTHONPATH=str(ROOT), TF_CPP_MIN_LOG_LEVEL='2', **more)


def test_a_script_gets_its_argv_cwd_env_output_and_exit_status(tmp_path):
  script = tmp_path / 'probe.py'
  script.write_text(SCRIPT)
  for code in (0, 3):
    done = fresh_interpreter.run(str(script), [str(code)], str(tmp_path), _env(FRESH_PROBE='x'), 60)
    assert done.returncode == code
    assert f"argv ['{code}'] cwd {tmp_path} path0 {tmp_path}" in done.stdout, done.stdout
    assert 'env x' in done.stdout
    # TF's runtime starts in the child: its own single CPU device, not this process's eight.
    assert 'devices 1' in done.stdout, done.stdout
    assert 'to stderr' in done.stderr


def test_an_exception_is_a_traceback_and_status_1(tmp_path):
  script = tmp_path / 'raises.py'
  script.write_text("raise ValueError('planted')\n")
  done = fresh_interpreter.run(str(script), [], str(tmp_path), _env(), 60)
  assert done.returncode == 1 and 'ValueError: planted' in done.stderr


def test_a_script_past_its_timeout_is_killed(tmp_path):
  script = tmp_path / 'sleeps.py'
  script.write_text('import time\ntime.sleep(60)\n')
  with pytest.raises(subprocess.TimeoutExpired):
    fresh_interpreter.run(str(script), [], str(tmp_path), _env(), 1)
  after = tmp_path / 'after.py'
  after.write_text("print('answered')\n")
  done = fresh_interpreter.run(str(after), [], str(tmp_path), _env(), 60)
  assert done.returncode == 0 and done.stdout == 'answered\n'  # the helper still answers


def test_another_import_time_environment_runs_a_real_interpreter(tmp_path, monkeypatch):
  script = tmp_path / 'pid.py'
  script.write_text('import os\nprint(os.getppid())\n')
  forked = fresh_interpreter.run(str(script), [], str(tmp_path), _env(), 60)
  own = fresh_interpreter.run(str(script), [], str(tmp_path), _env(TF_PROBE_OTHER='1'), 60)
  assert int(own.stdout) == os.getpid()  # started by this process, not by the helper
  assert int(forked.stdout) != os.getpid()


def test_two_lines_that_arrive_together_are_both_read():
  """A fast script's two answers (its pid, then its status) can reach the pipe in one read:
  the second must come from what was read, not from a wait on the then-empty pipe."""
  read, write = os.pipe()
  helper = object.__new__(fresh_interpreter._Helper)  # noqa: SLF001  (no process: a pipe)
  helper._pending = b''  # noqa: SLF001
  helper.process = types.SimpleNamespace(stdout=os.fdopen(read, 'r'))
  os.write(write, b'{"pid": 7}\n{"code": 0}\n')
  deadline = time.monotonic() + 5
  assert helper._line(deadline) == {'pid': 7}  # noqa: SLF001
  assert helper._line(deadline) == {'code': 0}  # noqa: SLF001
  assert time.monotonic() < deadline - 4  # neither waited
  os.close(write)
