"""Scripts run as in a fresh interpreter, forked from one that has imported TensorFlow.

The tests run pages, examples and READMEs in fresh interpreters (their own TF devices, their
own Keras state). Starting one costs TensorFlow's import, about 5 CPU seconds on this
machine, paid some twenty times per suite. Here one helper interpreter per test process
imports numpy and TensorFlow once, without initializing TF's runtime (no device is listed and
no op runs, so no TF thread exists yet), and forks a child per script: the child starts where
a fresh interpreter would be after `import tensorflow`, and runs the script as `__main__`
(`runpy.run_path`) with its own argv, working directory, environment and output files.

What differs from `python script.py`: TensorFlow and numpy are imported already (so is what
they import); the environment variables TF reads at import (TF_*, and those of Keras and XLA,
read before the script could set them) are the helper's. A request whose environment differs
from the helper's in any of those runs in a real fresh interpreter instead.
"""

import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from typing import Dict, Optional, Sequence

# Read at import by TF, Keras or XLA: a child cannot take other values for them.
_READ_AT_IMPORT = ('TF_', 'KERAS_', 'XLA_', 'PYTHON', 'OMP_', 'MKL', 'CUDA_')

_HELPER = r"""
import atexit, json, os, runpy, sys, traceback
import numpy
import tensorflow

def _run(request):
  os.setpgid(0, 0)  # the child and what it starts: one group, killed together on a timeout
  null = os.open(os.devnull, os.O_RDONLY)
  os.dup2(null, 0)
  for fd, path in ((1, request['stdout']), (2, request['stderr'])):
    os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
  os.chdir(request['cwd'])
  os.environ.clear()
  os.environ.update(request['env'])
  script = request['script']
  sys.argv = [script] + request['args']
  sys.path[0] = os.path.dirname(os.path.abspath(script))
  code = 0
  try:
    runpy.run_path(script, run_name='__main__')
  except SystemExit as exit:
    if exit.code is None or isinstance(exit.code, int):
      code = exit.code or 0
    else:
      print(exit.code, file=sys.stderr)
      code = 1
  except BaseException:
    traceback.print_exc()
    code = 1
  try:
    atexit._run_exitfuncs()  # as an interpreter's exit would
  finally:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)

for line in sys.stdin:
  request = json.loads(line)
  sys.stdout.flush()
  pid = os.fork()
  if pid == 0:
    _run(request)
  print(json.dumps({'pid': pid}), flush=True)
  _, status = os.waitpid(pid, 0)
  print(json.dumps({'code': os.waitstatus_to_exitcode(status)}), flush=True)
"""


def _import_time_env(env: Dict[str, str]) -> Dict[str, str]:
  return {k: v for k, v in env.items() if k.startswith(_READ_AT_IMPORT)}


class _Helper:
  """One forking helper interpreter, started with `env`."""

  def __init__(self, env: Dict[str, str]):
    self.env = dict(env)
    self._pending = b''  # read from the helper's stdout, not yet a whole line
    self.process = subprocess.Popen(
      [sys.executable, '-c', _HELPER],
      stdin=subprocess.PIPE,
      stdout=subprocess.PIPE,
      stderr=subprocess.DEVNULL,
      env=self.env,
      text=True,
    )

  def alive(self) -> bool:
    return self.process.poll() is None

  def _line(self, deadline: float) -> Optional[dict]:
    """The helper's next line (None at `deadline`), read from its pipe unbuffered: a buffered
    reader could hold both of a request's lines while select waits on the empty pipe."""
    fd = self.process.stdout.fileno()
    while b'\n' not in self._pending:
      left = deadline - time.monotonic()
      if left <= 0:
        return None
      if select.select([fd], [], [], left)[0]:
        chunk = os.read(fd, 65536)
        if not chunk:
          raise RuntimeError('the forking interpreter ended unexpectedly')
        self._pending += chunk
    line, self._pending = self._pending.split(b'\n', 1)
    return json.loads(line)

  def run(self, script: str, args: Sequence[str], cwd: str, env: Dict[str, str], timeout: float):
    with tempfile.TemporaryDirectory(prefix='fresh_') as where:
      request = {
        'script': script,
        'args': list(args),
        'cwd': cwd,
        'env': env,
        'stdout': os.path.join(where, 'out'),
        'stderr': os.path.join(where, 'err'),
      }
      self.process.stdin.write(json.dumps(request) + '\n')
      self.process.stdin.flush()
      deadline = time.monotonic() + timeout
      started = self._line(time.monotonic() + 60)  # the helper's import, then the fork
      if started is None:
        raise RuntimeError('the forking interpreter did not start the script within 60 s')
      pid = started['pid']
      done = self._line(deadline)
      if done is None:  # as subprocess.run does on a timeout: kill, then raise
        os.killpg(pid, signal.SIGKILL)
        self._line(time.monotonic() + 60)
        raise subprocess.TimeoutExpired([sys.executable, script, *args], timeout)
      outputs = []
      for name in ('out', 'err'):
        with open(os.path.join(where, name), errors='replace') as f:
          outputs.append(f.read())
    return subprocess.CompletedProcess(
      [sys.executable, script, *args], done['code'], outputs[0], outputs[1]
    )


_helper: Optional[_Helper] = None


def run(
  script: str, args: Sequence[str], cwd: str, env: Dict[str, str], timeout: float
) -> subprocess.CompletedProcess:
  """`python script *args` in `cwd` with `env`, as a fresh interpreter would run it (see the
  module's docstring), with its output captured as text."""
  global _helper
  if _helper is None or not _helper.alive():
    _helper = _Helper(env)
  if _import_time_env(_helper.env) != _import_time_env(env):
    return subprocess.run(  # another import-time environment: a real fresh interpreter
      [sys.executable, script, *args],
      cwd=cwd,
      env=env,
      capture_output=True,
      text=True,
      timeout=timeout,
      check=False,
    )
  return _helper.run(script, args, cwd, env, timeout)
