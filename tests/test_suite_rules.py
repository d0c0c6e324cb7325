"""The suite's own rules (tests/conftest.py, pyproject.toml): under `make test` nothing may
skip, the full op sweep is deselected rather than skipped, and a marker must be registered."""

import os
import subprocess
import sys

import pytest

from helpers import ROOT

# Each test starts pytest (and TensorFlow) in fresh interpreters: 10-20 s apiece.
pytestmark = pytest.mark.slow

PROBE = """
import pytest

def test_needs_a_missing_module():
  pytest.importorskip('no_such_module_anywhere')

@pytest.mark.sweep
def test_the_full_sweep():
  pass
"""


def _without_no_skips() -> dict:
  """This process's environment without make test's TF_GSPMD_NO_SKIPS (the probe sets it)."""
  return {k: v for k, v in os.environ.items() if k != 'TF_GSPMD_NO_SKIPS'}


def _pytest(tmp_path, probes, **env):
  """pytest on the `probes` (file name -> source) with the suite's conftest and pyproject, on
  past a file that fails to collect: its summary line, its output."""
  for name, source in probes.items():
    (tmp_path / name).write_text(source)
  result = subprocess.run(
    [sys.executable, '-m', 'pytest', '-q', '-rs', '-p', 'conftest', '-p', 'no:cacheprovider']
    + ['--continue-on-collection-errors', '-c', str(ROOT / 'pyproject.toml')]
    + ['--rootdir', str(tmp_path), str(tmp_path)],
    capture_output=True,
    text=True,
    env=dict(_without_no_skips(), PYTHONPATH=f'{ROOT / "tests"}{os.pathsep}{ROOT}', **env),
    cwd=tmp_path,
    timeout=240,
    check=False,
  )
  return result.stdout.strip().splitlines()[-1], result.stdout


def test_a_skip_fails_under_make_test_and_the_sweep_is_deselected(tmp_path):
  summary, out = _pytest(tmp_path, {'test_probe.py': PROBE}, TF_GSPMD_NO_SKIPS='1')
  assert '1 failed' in summary and '1 deselected' in summary, out
  assert 'nothing may skip' in out and 'no_such_module_anywhere' in out, out


def test_elsewhere_a_skip_is_reported_and_an_unregistered_marker_is_an_error(tmp_path):
  """One run (each costs a fresh interpreter and TF): the probe beside a file whose marker is
  misspelled, which fails to collect while the probe still runs."""
  misspelled = PROBE.replace('mark.sweep', 'mark.sweeep')
  summary, out = _pytest(tmp_path, {'test_probe.py': PROBE, 'test_typo.py': misspelled})
  assert '1 skipped' in summary and '1 deselected' in summary, out  # -rs says why
  assert 'SKIPPED' in out and 'no_such_module_anywhere' in out, out
  assert '1 error' in summary and "'sweeep' not found in `markers`" in out, out
