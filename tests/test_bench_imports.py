"""The bench scripts and examples import only names tf_gspmd has (they run outside the suite).

A moved module broke `bench/partition_scaling.py` once without any test noticing; every
`from tf_gspmd... import name` in bench/ and examples/ is resolved here, lazy ones included.
"""

import ast
import importlib
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
SCRIPTS = sorted(ROOT.glob('bench/*.py')) + sorted(ROOT.glob('examples/**/*.py'))


def tf_gspmd_imports(path: pathlib.Path):
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.ImportFrom) and (node.module or '').startswith('tf_gspmd'):
      for alias in node.names:
        yield node.module, alias.name
    elif isinstance(node, ast.Import):
      for alias in node.names:
        if alias.name.startswith('tf_gspmd'):
          yield alias.name, None


@pytest.mark.parametrize('path', SCRIPTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_script_imports_resolve(path):
  for module_name, name in tf_gspmd_imports(path):
    module = importlib.import_module(module_name)
    if name is not None and not hasattr(module, name):
      importlib.import_module(f'{module_name}.{name}')  # a submodule, or ModuleNotFoundError


def test_a_missing_name_is_caught(tmp_path):
  script = tmp_path / 'broken.py'
  script.write_text('from tf_gspmd.runtime import tables\n')
  with pytest.raises(ModuleNotFoundError):
    test_script_imports_resolve(script)


def test_fuzz_ab_switches_reach_what_they_switch():
  """bench/fuzz_ab.py flips private names of tf_gspmd's (a marker wrapper, the stack and
  constant hooks): each switch, on then off, must find them and leave the code as it was."""
  import sys

  from tf_gspmd import tf_private
  from tf_gspmd.runtime import collectives

  sys.path.insert(0, str(ROOT / 'bench'))
  try:
    import fuzz_ab
  finally:
    sys.path.remove(str(ROOT / 'bench'))
  shipped = (
    collectives.TFCollectives._around,
    collectives.TFCollectives._permute,
    tf_private.tf_stack.extract_stack,
    tf_private.ops._create_graph_constant,
    tf_private.tf_flags,
  )
  flag = tf_private.tf_flags.config().graph_building_optimization
  flag_before = flag.value()
  on_as_shipped = {'tracebacks', 'shared-constants', 'graph-building', 'closed-cycles'}
  try:
    for name, factory in fuzz_ab.SWITCHES.items():
      if name == 'grappler':
        continue  # TF's own option, set through tf.config
      switch = factory()
      switch(name not in on_as_shipped)
      switch(name in on_as_shipped)
  finally:
    flag.reset(flag_before)  # the campaign's process-wide setting, not this test process's
  assert (
    collectives.TFCollectives._around,
    collectives.TFCollectives._permute,
    tf_private.tf_stack.extract_stack,
    tf_private.ops._create_graph_constant,
    tf_private.tf_flags,
  ) == shipped
