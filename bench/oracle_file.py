"""tf_gspmd's numerical oracle for bench processes that cannot import tf_gspmd.

`tf_gspmd/testing/oracle.py` needs only numpy and ml_dtypes, so it is loaded
from its file: bench/step_time.py's parent process runs without TensorFlow, and
bench/xla_reference.py runs in the JAX venv, where tf_gspmd cannot be imported.
"""

import importlib.util
import os
import sys

_NAME = 'tf_gspmd_testing_oracle'
_PATH = os.path.join(
  os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'tf_gspmd', 'testing', 'oracle.py'
)


def load():
  """The oracle module (loaded once per process)."""
  if _NAME not in sys.modules:
    spec = importlib.util.spec_from_file_location(_NAME, _PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[_NAME] = module
    spec.loader.exec_module(module)
  return sys.modules[_NAME]
