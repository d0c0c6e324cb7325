"""The package layout shows the pipeline: every import points down the layer list, no cycles.

Imports are read from the source (module level and inside functions alike; only
`if TYPE_CHECKING:` blocks are skipped), so a lazy import cannot hide a cycle.
"""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent / 'tf_gspmd'

# Bottom to top: a unit may import units listed before it (and itself), never after.
LAYERS = (
  ('_tf_version', 'errors'),  # checks TensorFlow is installed; the refusal error type
  ('tf_private', 'device_names'),  # TF's private API (the one module), TF device names
  ('mesh', 'sharding'),  # value types
  ('op_sharding',),  # OpSharding conversion, the one place
  ('dtensor_compat',),  # TF DTensor's Mesh and Layout as tf_gspmd's, the one place
  ('annotations', 'xla_sharding'),  # writes and reads TF's XlaSharding
  ('pipeline', 'shard_map'),  # pipelining, manual regions: annotated TF ops, before capture
  ('graph',),  # capture, IR, rebuild, static values
  ('propagation',),  # one rule per op type, the fixpoint
  ('collectives',),  # the interface a backend implements
  ('graph_rewrite',),  # the partitioner: local ops from rules, reshards
  ('program',),  # the per-partition program contract both backends stand on
  ('runtime',),  # TF backend: collectives on TF devices, the launcher
  ('xla_bridge',),  # XLA backend: XLA collectives, export, PJRT
  ('build_progress',),  # what a long first call is doing, shown as it runs
  ('pictures',),  # layouts drawn: text grids, the HTML report page
  ('partitioned',),  # partition(): capture -> propagate -> rewrite -> backend
  ('step_cost',),  # a step's features priced on a HardwareProfile (tg.plan, auto_shard)
  ('planning',),  # a partitioned program planned without running it (tg.plan)
  ('keras',),  # Keras on top of partition(): partition_model, LayoutMap, keras.distribution
  ('export',),  # save/restore/export/serve a partitioned program or Keras model
  ('auto_shard',),  # layouts chosen by planning candidates (tg.plan, LayoutMap)
  ('keras_api',),  # tf_gspmd.keras's API and auto_layout: Keras' LayoutMap chosen by auto_shard
  ('testing',),  # the op sweep harness
  ('__init__',),  # the public API
)
RANK = {unit: i for i, units in enumerate(LAYERS) for unit in units}


def module_name(path: pathlib.Path) -> str:
  parts = path.relative_to(ROOT.parent).with_suffix('').parts
  return '.'.join(parts[:-1] if parts[-1] == '__init__' else parts)


MODULES = {module_name(p): p for p in ROOT.rglob('*.py')}


def _skipped(node) -> bool:
  test = getattr(node, 'test', None)
  return isinstance(node, ast.If) and isinstance(test, ast.Name) and test.id == 'TYPE_CHECKING'


def _walk(tree):
  stack = [tree]
  while stack:
    node = stack.pop()
    if _skipped(node):
      continue
    yield node
    stack.extend(ast.iter_child_nodes(node))


def imports_of(name: str):
  """The tf_gspmd modules `name` imports (a from-import of a module names the module)."""
  tree = ast.parse(MODULES[name].read_text())
  out = set()
  for node in _walk(tree):
    if isinstance(node, ast.Import):
      out.update(a.name for a in node.names if a.name.startswith('tf_gspmd'))
    elif isinstance(node, ast.ImportFrom) and (node.module or '').startswith('tf_gspmd'):
      for a in node.names:
        sub = f'{node.module}.{a.name}'
        out.add(sub if sub in MODULES else node.module)
  return {m for m in out if m in MODULES and m != name}


GRAPH = {name: imports_of(name) for name in MODULES}


# Modules ranked apart from their package: tf_gspmd.keras's API offers auto_layout, which runs
# auto_shard (above the Keras layer auto_shard's own LayoutMap stands on).
OWN_UNITS = {'tf_gspmd.keras': 'keras_api', 'tf_gspmd.keras.auto_layout': 'keras_api'}


def unit_of(module: str) -> str:
  if module in OWN_UNITS:
    return OWN_UNITS[module]
  parts = module.split('.')
  return '__init__' if len(parts) == 1 else parts[1]


def test_every_unit_has_a_layer():
  assert {unit_of(m) for m in MODULES} <= set(RANK)


def test_imports_point_down_the_layers():
  upward = sorted(
    f'{a} -> {b}' for a, deps in GRAPH.items() for b in deps if RANK[unit_of(b)] > RANK[unit_of(a)]
  )
  assert not upward, 'imports pointing up the layer list:\n' + '\n'.join(upward)


def find_cycle(graph):
  """One cycle of `graph` as a list of nodes, or None (iterative DFS)."""
  state = {}
  for start in sorted(graph):
    if start in state:
      continue
    path, stack = [], [(start, iter(sorted(graph[start])))]
    state[start] = 'open'
    path.append(start)
    while stack:
      node, children = stack[-1]
      child = next(children, None)
      if child is None:
        state[node] = 'done'
        stack.pop()
        path.pop()
      elif state.get(child) == 'open':
        return path[path.index(child) :] + [child]
      elif child not in state:
        state[child] = 'open'
        path.append(child)
        stack.append((child, iter(sorted(graph.get(child, ())))))
  return None


def test_no_module_import_cycles():
  # A package's __init__ re-exporting its own modules is not a cycle of the design.
  graph = {
    a: {b for b in deps if not (MODULES[a].name == '__init__.py' and b.startswith(a + '.'))}
    for a, deps in GRAPH.items()
  }
  cycle = find_cycle(graph)
  assert cycle is None, 'import cycle: ' + ' -> '.join(cycle)


@pytest.mark.parametrize(
  'graph, has_cycle',
  [
    ({'a': {'b'}, 'b': {'c'}, 'c': set()}, False),
    ({'a': {'b'}, 'b': {'c'}, 'c': {'a'}}, True),
    ({'a': {'a2'}, 'a2': set(), 'b': {'b'}}, True),
  ],
)
def test_find_cycle_finds_cycles(graph, has_cycle):
  assert (find_cycle(graph) is not None) == has_cycle


def test_test_files_import_no_other_test_file():
  """Tests share helpers through tests/helpers.py, keras_workflows.py and fixtures: a test file
  importing another runs that file's module-level set-up twice and ties their fates."""
  tests = pathlib.Path(__file__).resolve().parent
  offenders = []
  for path in sorted(tests.glob('test_*.py')):
    for node in ast.walk(ast.parse(path.read_text())):
      names = []
      if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
      elif isinstance(node, ast.ImportFrom) and node.module:
        names = [node.module]
      offenders += [f'{path.name}: {n}' for n in names if n.split('.')[0].startswith('test_')]
  assert not offenders, offenders
