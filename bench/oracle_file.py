"""tf_gspmd's numerical oracle for bench processes that cannot import tf_gspmd.

`tf_gspmd/testing/oracle.py` needs only numpy and ml_dtypes, so it is loaded
from its file: bench/step_time.py's parent process runs without TensorFlow, and
bench/xla_reference.py runs in the JAX venv, where tf_gspmd cannot be imported.
"""

import importlib.util
import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_package_file(name: str, *path: str):
  """The module at tf_gspmd's `path` (parts under the repository root), loaded from its file
  as `name` (once per process), without importing tf_gspmd or TensorFlow."""
  if name not in sys.modules:
    spec = importlib.util.spec_from_file_location(name, os.path.join(_ROOT, *path))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
  return sys.modules[name]


def load():
  """The oracle module (loaded once per process)."""
  return load_package_file('tf_gspmd_testing_oracle', 'tf_gspmd', 'testing', 'oracle.py')
