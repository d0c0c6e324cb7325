"""The README's example runs verbatim, its commands exist, and `make demo`'s script runs.

Also the usage example of docs/api.md and the oracle's of docs/testing.md, which were the
README's (tests/test_docs.py checks that every page's code runs somewhere).
"""

import pathlib
import re

import pytest

from helpers import run_python

# Pages run verbatim: `make test` runs them, `make test-fast` (the edit loop) does not.
pytestmark = pytest.mark.slow

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = (ROOT / 'README.md').read_text()
API_PAGE = (ROOT / 'docs' / 'api.md').read_text()
TESTING_PAGE = (ROOT / 'docs' / 'testing.md').read_text()


def first_python_block(markdown: str) -> str:
  match = re.search(r'^```python\n(.*?)^```', markdown, re.S | re.M)
  assert match, 'no ```python block'
  return match.group(1)


def test_readme_names_the_two_commands_and_the_makefile_has_them():
  assert 'make demo' in README and 'make test' in README and 'make lint' in README
  makefile = (ROOT / 'Makefile').read_text()
  assert re.search(r'^demo:', makefile, re.M) and re.search(r'^test:', makefile, re.M)
  assert re.search(r'^lint:', makefile, re.M)
  assert 'examples/keras/demo.py' in makefile


def test_readme_usage_example_runs_verbatim(tmp_path):
  script = tmp_path / 'readme_example.py'
  script.write_text(first_python_block(API_PAGE))  # a file, so AutoGraph can read the source
  result = run_python(script)
  assert result.returncode == 0, result.stderr[-3000:]
  lines = result.stdout.splitlines()
  assert lines == ["P('data', None) (5, 16)", '((5, 10), (0, 16))', "['XlaSharding']"], (
    result.stdout
  )
  assert 'AutoGraph could not transform' not in result.stderr


def test_readme_partition_example_runs_verbatim(tmp_path):
  (block,) = re.findall(r'```python\n(.*?)```', README, re.S)  # the README's one example
  script = tmp_path / 'readme_partition.py'
  script.write_text(block)
  result = run_python(script)
  assert result.returncode == 0, result.stderr[-3000:]
  out = result.stdout
  assert len(re.findall(r"^all_reduce \('model',\) ", out, re.M)) == 1, out  # the row-parallel sum
  assert len(re.findall(r"^all_reduce \('data',\)", out, re.M)) == 1, out  # loss, 2 gradients fused
  assert "{'total': 4096, 'per_device': 1024}" in out


@pytest.mark.slow
def test_demo_trains_partitioned_beside_unpartitioned():
  result = run_python(ROOT / 'examples' / 'keras' / 'demo.py')
  assert result.returncode == 0, result.stderr[-3000:]
  out = result.stdout
  assert 'mesh Mesh(data=2, model=4); 20 variables annotated' in out
  error = float(re.search(r'weights vs unpartitioned: relative error (\S+)', out).group(1))
  assert error <= 1e-5, out
  assert re.search(r'all_reduce +data +\d+', out), out
  # Per-device bytes equal total / shard count for variables and optimizer state alike.
  for kind in ('variables', 'optimizer state'):
    row = re.search(kind + r' +([\d,]+) +([\d,]+) +([\d,]+)', out)
    total, per_device, expected = (int(g.replace(',', '')) for g in row.groups())
    assert per_device == expected < total, row.group(0)


def test_readme_oracle_section_runs(tmp_path):
  section = TESTING_PAGE.split('## How results are checked', 1)[1]
  script = tmp_path / 'readme_oracle.py'
  script.write_text(first_python_block(section))
  result = run_python(script)
  assert result.returncode == 0, result.stderr[-3000:]
  assert result.stdout.strip() == (
    'y: normwise relative error 0.316 > bound 1e-05 (float32, '
    'shape (2,)); largest difference at (1,): got 2, expected 3'
  ), result.stdout
