"""The executor registry is the one place a backend is chosen by name.

Everything that differs between backends is a method of its executor
(`tf_gspmd/partitioned/executors.py`); code elsewhere comparing a value with a backend's
name ('tf', 'xla') is a choice the registry should make, so the scan below refuses it.
"""

import ast
import pathlib

import pytest

from tf_gspmd.collectives.interface import Collectives
from tf_gspmd.partitioned import executors

ROOT = pathlib.Path(__file__).resolve().parent.parent / 'tf_gspmd'
REGISTRY = ROOT / 'partitioned' / 'executors.py'
# TPUStrategyStep's `collectives=` mode says which collective ops a strategy replica emits
# ('xla' on a TPU, 'tf' for a MirroredStrategy standing in for one); both run under
# strategy.run, not through an executor (docs/architecture.md, "How to add a backend").
OTHER_CONCEPTS = {'collectives'}


def _names(node):
  """The backend names a comparison operand spells: a string, or a tuple/list/set of them."""
  if isinstance(node, ast.Constant) and node.value in executors.NAMES:
    return [node.value]
  if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
    return [n for e in node.elts for n in _names(e)]
  return []


def _operand_name(node) -> str:
  if isinstance(node, ast.Name):
    return node.id
  if isinstance(node, ast.Attribute):
    return node.attr
  return ''


def backend_comparisons(source: str):
  """(line, names) of each comparison of a value with a backend's name in `source`."""
  found = []
  for node in ast.walk(ast.parse(source)):
    if not isinstance(node, ast.Compare):
      continue
    operands = [node.left, *node.comparators]
    names = [n for o in operands for n in _names(o)]
    if names and not any(_operand_name(o) in OTHER_CONCEPTS for o in operands):
      found.append((node.lineno, names))
  return found


def test_no_backend_named_by_a_string_outside_the_registry():
  offenders = []
  for path in sorted(ROOT.rglob('*.py')):
    if path == REGISTRY:
      continue
    for line, names in backend_comparisons(path.read_text()):
      offenders.append(f'{path.relative_to(ROOT.parent)}:{line} compares with {names}')
  assert not offenders, 'ask the executor registry instead:\n' + '\n'.join(offenders)


@pytest.mark.parametrize(
  'source',
  [
    "if backend == 'xla': pass",
    "x = 'tf' != self.backend",
    "if name not in ('tf', 'xla'): pass",
    "ok = kwargs.get('backend', 'tf') in ['tf']",
  ],
)
def test_the_scan_finds_a_backend_named_by_a_string(source):
  assert backend_comparisons(source)


def test_the_scan_leaves_other_strings_and_the_strategy_mode():
  assert not backend_comparisons("if kind == 'tensorflow': pass")
  assert not backend_comparisons("if collectives == 'tf': pass")


@pytest.mark.parametrize('name', executors.NAMES)
def test_every_registered_executor_provides_a_backend(name):
  executor = executors.get(name)
  assert executor.name == name
  assert issubclass(executor.collectives_class(), Collectives)
  assert isinstance(executor.sharded_variable_class(), type)
  assert executor.running_phase(type('M', (), {'size': 8})())


def test_an_unknown_backend_is_refused_naming_the_known_ones():
  with pytest.raises(ValueError, match=r"partition: backend must be one of \('tf', 'xla'\)"):
    executors.get('tpu')


def test_collectives_subclasses_keep_autograph_out_by_themselves():
  import tensorflow as tf

  class Probe(Collectives):
    def _all_reduce(self, x, axes, op):
      if tf.reduce_sum(x) > 0:  # autograph would turn this into a tf.cond
        return x
      return -x

  # do_not_convert marks the wrapper autograph leaves alone
  assert getattr(Probe._all_reduce, '__wrapped__', None) is not None
