"""How a bench's --quick run starts its TF children: forked from one interpreter that has
imported TensorFlow (tf_gspmd/testing/fresh_interpreter.py), instead of a new interpreter
each (TF's import, about 5 CPU seconds a child).

--quick checks that a bench runs and reports, not its speed; the full runs start every child
in a new interpreter. The module is loaded from its file (bench/oracle_file.py): the
benches' parent processes run without TensorFlow.
"""

import os
import subprocess
import sys

import oracle_file  # sibling: loads a tf_gspmd module from its file


def _module():
  return oracle_file.load_package_file(
    'tf_gspmd_testing_fresh_interpreter', 'tf_gspmd', 'testing', 'fresh_interpreter.py'
  )


def run(cmd, env, cwd: str, timeout: float, quick: bool) -> subprocess.CompletedProcess:
  """`cmd` ([python, script, *args]) as subprocess.run would run it (`env` None: this
  process's), output captured as text; forked when `quick` and the child is this Python (the
  JAX children run another)."""
  if quick and cmd[0] == sys.executable:
    env = dict(os.environ if env is None else env)
    return _module().run(cmd[1], [str(a) for a in cmd[2:]], cwd, env, timeout)
  return subprocess.run(
    cmd, capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env, check=False
  )
