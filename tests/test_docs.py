"""Every code block of the README and of docs/*.md runs under a test, or says on the page why not.

A page's fenced blocks are ```python, ```sh (commands) or unlabelled (what a block prints).
Each ```python block is one of, by the HTML comment on the line before it:

- no comment: run here, in a fresh interpreter with the repo importable; when an unlabelled
  block follows it (blank lines between at most), that is what it must print;
- `<!-- run by tests/test_x.py::test_name -->`: that test runs it (it reads the page);
- `<!-- excerpt of tf_gspmd/path.py -->`: the block is that file's text, verbatim;
- `<!-- not run: why -->`: a fragment, or code needing a TPU or a long run; the reason names
  the test (tests/test_x.py, or tests/test_x.py::test_name) that runs the same code or, for a
  TPU, its CPU stand-in; each test named must exist.

Blocks import tf_gspmd's public API only, so moving a module inside the package breaks no page.
Every page is reached by links from the README, every link and anchor resolves, and every
`tf_gspmd/...` file a page names exists.
"""

import dataclasses
import pathlib
import re
from typing import List, Optional

import pytest

from helpers import run_python  # a fresh interpreter with the repo importable

# Pages run verbatim: `make test` runs them, `make test-fast` (the edit loop) does not.
pytestmark = pytest.mark.slow

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = [ROOT / 'README.md'] + sorted((ROOT / 'docs').glob('*.md'))
LANGUAGES = ('python', 'sh', '')
PUBLIC_MODULES = ('tf_gspmd', 'tf_gspmd.keras', 'tf_gspmd.testing', 'tf_gspmd.saved_model')
# An unlabelled block is printed output; these lines would make it code.
CODE_LINE = re.compile(r'^(import \w|from [\w.]+ import |[\w.]+(\[[^\]]*\])? = \S)')
MARKER = re.compile(r'^<!-- (not run|run by|excerpt of):? (.+?) -->$')
TEST_REF = re.compile(r'(tests/[\w/]+\.py)(?:::(\w+))?')
SENTINEL = '<<< docs block {} >>>'


@dataclasses.dataclass
class Block:
  page: pathlib.Path
  line: int  # 1-based line of the opening fence
  language: str
  code: str
  marker: Optional[str]  # 'not run' | 'run by' | 'excerpt of' | None
  detail: str = ''
  output: Optional[str] = None  # the unlabelled block right after it, if any

  def where(self) -> str:
    return f'{self.page.relative_to(ROOT)}:{self.line}'


def blocks_of(page: pathlib.Path) -> List[Block]:
  """The fenced blocks of a page, each with the marker on the line before it."""
  lines = page.read_text().split('\n')
  blocks, i = [], 0
  while i < len(lines):
    opening = re.match(r'^( *)```(\w*)$', lines[i])
    if not opening:
      i += 1
      continue
    indent, language = opening.groups()
    end = lines.index(indent + '```', i + 1)
    code = '\n'.join(line[len(indent) :] for line in lines[i + 1 : end]) + '\n'
    before = [line.strip() for line in lines[:i] if line.strip()]
    marker = MARKER.match(before[-1]) if before else None
    blocks.append(
      Block(page, i + 1, language, code, marker and marker.group(1), marker and marker.group(2))
    )
    gap = lines[end + 1 :]
    while gap and not gap[0].strip():
      gap = gap[1:]
    if language == 'python' and gap and gap[0] == '```':
      stop = gap.index('```', 1)
      blocks[-1].output = '\n'.join(gap[1:stop])
    i = end + 1
  return blocks


BLOCKS = [b for page in PAGES for b in blocks_of(page)]
PYTHON = [b for b in BLOCKS if b.language == 'python']


def test_every_page_has_blocks_and_every_block_a_known_language():
  assert len(PAGES) >= 10 and PYTHON, [p.name for p in PAGES]
  wrong = [(b.where(), b.language) for b in BLOCKS if b.language not in LANGUAGES]
  assert not wrong, f'label each block python, sh, or nothing (printed output): {wrong}'


def test_unlabelled_blocks_are_output_not_code():
  code = [
    (b.where(), line)
    for b in BLOCKS
    if b.language == ''
    for line in b.code.splitlines()
    if CODE_LINE.match(line)
  ]
  assert not code, f'code in an unlabelled block: label it python (run it or mark it): {code}'


def test_python_blocks_import_only_the_public_api():
  private = [
    (b.where(), name)
    for b in PYTHON
    for name in re.findall(r'^\s*(?:from|import) (tf_gspmd[\w.]*)', b.code, re.M)
    if name not in PUBLIC_MODULES
  ]
  assert not private, f'import {PUBLIC_MODULES} only in pages: {private}'


def _tests_named(text: str):
  for path, name in TEST_REF.findall(text):
    source = ROOT / path
    assert source.is_file(), f'{path} does not exist'
    if name:
      assert re.search(rf'^def {name}\(', source.read_text(), re.M), f'{path} has no {name}'
    yield source


def test_a_block_not_run_says_why_and_names_the_tests_that_cover_it():
  for b in PYTHON:
    if b.marker == 'not run':
      assert len(b.detail) >= 10, f'{b.where()}: say why the block is not run'
      assert list(_tests_named(b.detail)), f'{b.where()}: name the test that runs this code'


def test_a_block_run_elsewhere_names_a_test_that_reads_its_page():
  for b in PYTHON:
    if b.marker == 'run by':
      sources = list(_tests_named(b.detail))
      assert len(sources) == 1 and '::' in b.detail, f'{b.where()}: name tests/x.py::test_y'
      assert b.page.name in sources[0].read_text(), f'{b.detail} does not read {b.page.name}'


def test_an_excerpt_is_its_source_verbatim():
  for b in PYTHON:
    if b.marker == 'excerpt of':
      source = ROOT / b.detail
      assert source.is_file(), f'{b.where()}: {b.detail} does not exist'
      assert b.code in source.read_text(), f'{b.where()}: no longer the text of {b.detail}'


def test_the_files_a_page_names_exist():
  named = {(p.name, f) for p in PAGES for f in re.findall(r'tf_gspmd/[\w/.]*\w', p.read_text())}
  missing = sorted((page, f) for page, f in named if not (ROOT / f).exists())
  assert not missing, f'pages name files that are gone: {missing}'


def anchors(page: pathlib.Path) -> set:
  """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces as '-'."""
  prose = re.sub(r'^( *)```.*?^\1```$', '', page.read_text(), flags=re.S | re.M)
  headings = re.findall(r'^#+ (.+)$', prose, re.M)
  return {re.sub(r'[^\w\- ]', '', h.lower()).replace(' ', '-') for h in headings}


def test_every_page_is_linked_from_the_readme_and_every_link_resolves():
  reached, todo = set(), [ROOT / 'README.md']
  while todo:
    page = todo.pop()
    if page in reached:
      continue
    reached.add(page)
    for target, anchor in re.findall(r'\]\(([^)#\s]+\.md)(?:#([\w-]+))?\)', page.read_text()):
      linked = (page.parent / target).resolve()
      assert linked.is_file(), f'{page.name} links to {target}, which does not exist'
      assert not anchor or anchor in anchors(linked), f'{page.name}: no #{anchor} in {target}'
      todo.append(linked)
  assert not set(PAGES) - reached, f'no link reaches {sorted(set(PAGES) - reached)}'


RUN_HERE = {}
for _b in PYTHON:
  if _b.marker is None:
    RUN_HERE.setdefault(_b.page, []).append(_b)


@pytest.mark.parametrize('page', sorted(RUN_HERE), ids=lambda p: p.name)
def test_the_unmarked_blocks_of_a_page_run_and_print_what_it_shows(page, tmp_path):
  """A page's unmarked blocks run in order in one interpreter (a later one may use an earlier
  one's names); each prints the unlabelled block after it, where there is one."""
  blocks = RUN_HERE[page]
  script = ''.join(f'print({SENTINEL.format(i)!r})\n{b.code}' for i, b in enumerate(blocks))
  path = tmp_path / 'page_blocks.py'
  path.write_text(script)  # a file, so AutoGraph can read the source
  result = run_python(path)
  assert result.returncode == 0, f'{[b.where() for b in blocks]}\n{result.stderr[-3000:]}'
  printed = re.split(r'^<<< docs block \d+ >>>\n', result.stdout, flags=re.M)[1:]
  assert len(printed) == len(blocks), result.stdout
  for block, out in zip(blocks, printed):
    if block.output is not None:
      assert out.rstrip('\n') == block.output, f'{block.where()} printed\n{out}'
