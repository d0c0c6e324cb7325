"""The four examples of docs/manual.md (collective matmul, MoE dispatch, pipeline, ring
attention), each against its automatic twin, run from the page itself."""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
MARKER = '<!-- run by tests/test_manual_examples.py::test_manual_page_examples -->'


def page_blocks():
  text = (ROOT / 'docs' / 'manual.md').read_text()
  return re.findall(re.escape(MARKER) + r'\n```python\n(.*?)```', text, re.S)


@pytest.mark.slow  # a page run verbatim: `make test` runs it, the edit loop not
def test_manual_page_examples():
  blocks = page_blocks()
  assert len(blocks) == 5
  namespace = {'__name__': 'manual_page'}
  for block in blocks:  # one interpreter, in order, as the page says (8 devices: conftest)
    exec(compile(block, 'docs/manual.md', 'exec'), namespace)
