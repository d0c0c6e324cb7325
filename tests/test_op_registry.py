"""One registry entry per op type holds everything tf_gspmd knows about it.

- No property table outside the registry: an AST scan of `tf_gspmd/` (but the
  registry and the `ops_*.py` modules declaring entries) finds no set, list,
  tuple or dict literal, and no `==`/`in` comparison, holding a registered op
  type's name, but for the few listed below with why they are not a per-op
  property.
- Every name an entry gives (its local computation, its sweep program) resolves.
- Every entry's properties fit its op (a linear op's pending operands exist, ...).
- Every op type is swept by its entry's program or says why it cannot be.
"""

import ast
import pathlib

import pytest

from tf_gspmd.propagation import registry

ROOT = pathlib.Path(__file__).resolve().parent.parent / 'tf_gspmd'

# Modules that may name registered op types, by file name (the name survives a move between
# packages), each with the names it may use and why those are not per-op properties.
_GRAPH_LAYER = 'the graph layer sits below the registry (tests/test_layout.py) and cannot read it'
ALLOWED = {
  'ir.py': (
    {'If', 'StatelessIf', 'While', 'StatelessWhile', 'PartitionedCall'}
    | {'StatefulPartitionedCall', 'Case', 'StatelessCase'},
    f'control-flow ops and the attrs naming their functions: {_GRAPH_LAYER}',
  ),
  'library.py': (
    {'If', 'StatelessIf', 'Case', 'StatelessCase', 'PartitionedCall', 'StatefulPartitionedCall'}
    | {'While', 'StatelessWhile'},
    f'control-flow ops and the attrs naming their functions: {_GRAPH_LAYER}',
  ),
  'capture.py': (
    {'ReadVariableOp', 'AssignVariableOp', 'AssignAddVariableOp', 'AssignSubVariableOp'}
    | {'VariableShape'},
    f'capture follows variable handles: {_GRAPH_LAYER}',
  ),
  'static_values.py': (
    {'Shape', 'ShapeN', 'Size', 'Rank', 'Placeholder', 'Const'},
    f'constant folding of shape queries and literals: {_GRAPH_LAYER}',
  ),
  'rebuild.py': ({'Placeholder'}, f"a function's argument nodes: {_GRAPH_LAYER}"),
  'tf_private.py': (
    {'Const', 'Reshape'},
    'shares equal constants of a per-partition trace (TF makes every graph constant as a '
    "'Const' through one private method) and reshapes a Reshape's input, not its result: "
    "TF's graph layer, below the registry",
  ),
  'step_cost.py': (
    {'Const', 'NoOp', 'Placeholder', '_Arg', '_Retval', 'VarHandleOp'},
    'the nodes a graph holds that launch no kernel in a step (the cost model counts launched '
    'ops); graph structure, not a property of an op rule',
  ),
  'annotations.py': (
    {'XlaSharding', 'Identity', 'ReadVariableOp'},
    'reads back the annotation chain tf_gspmd itself writes (Identity -> XlaSharding, a '
    'variable read); below the registry in the layers',
  ),
  'compile.py': (
    {'Identity', 'XlaSharding'} | {'ReadVariableOp', 'ResourceGather', 'VariableShape'},
    'recognises the annotation ops tf_gspmd writes around boundary tensors, and the ops that '
    'only read a variable handle (a variable reaching no other op is not written back)',
  ),
  'held.py': (
    {'AssignVariableOp', 'AssignAddVariableOp'}
    | {f'ResourceScatter{k}' for k in ('Add', 'Sub', 'Max', 'Min', 'Update', 'Mul', 'Div')},
    "the TF ops a SplitVariable emits for its methods in a partition trace (TF's own variable "
    'methods emit the same): what it writes, not a property of the op',
  ),
  'hlo.py': (
    {'Identity', 'Const', 'XlaAllReduce', 'XlaReduceScatter', 'AllToAll', 'CollectivePermute'},
    'XLA-side names of pass-through, literal and collective nodes the XLA backend emits',
  ),
  'xla.py': ({'Placeholder', 'XlaSharding'}, "an exported program's placeholders and annotations"),
  'coalesce.py': ({'Const'}, 'a literal node: its value is known before run time'),
  'shape_ops.py': ({'Const'}, "a literal node's value, which folding keeps only for ints"),
  # Sweep data beside the sweep programs: the order a program always drew its ops' values in
  # from one seeded stream (programs/__init__.py `in_draw_order`), kept so every case keeps
  # its values; test data, not a property of the op (#34).
  'reductions.py': (
    {'Sum', 'Max', 'Min', 'Mean', 'EuclideanNorm', 'Prod', 'All', 'Any', 'ArgMax', 'ArgMin'}
    | {'Cumsum', 'Cumprod', 'CumulativeLogsumexp'},
    'DRAW_ORDER: the order the reductions program draws values in',
  ),
  'shape.py': (
    {'UnsortedSegmentSum', 'UnsortedSegmentMax', 'UnsortedSegmentMin', 'UnsortedSegmentProd'},
    'SEGMENT_DRAW_ORDER: the order the shape program draws segment values in',
  ),
  'state.py': (
    {'AssignVariableOp', 'AssignAddVariableOp', 'AssignSubVariableOp'}
    | {'ResourceApplyGradientDescent', 'ResourceApplyMomentum', 'ResourceApplyKerasMomentum'}
    | {'ResourceApplyAdagrad', 'ResourceApplyAdagradV2', 'ResourceApplyAdadelta'}
    | {'ResourceApplyRMSProp', 'ResourceApplyCenteredRMSProp', 'ResourceApplyAdam'}
    | {'ResourceApplyAdaMax', 'ResourceApplyAdamWithAmsgrad', 'ResourceScatterAdd'}
    | {'ResourceScatterSub', 'ResourceScatterMul', 'ResourceScatterDiv', 'ResourceScatterMax'}
    | {'ResourceScatterMin', 'ResourceScatterUpdate'},
    'DRAW_ORDER: the order the variables program draws values in',
  ),
}


def _registry_modules(path: pathlib.Path, root: pathlib.Path) -> bool:
  rel = path.relative_to(root).as_posix()
  return rel == 'propagation/registry.py' or (
    rel.startswith('propagation/ops_') and rel.count('/') == 1
  )


def _is_all(node: ast.AST) -> bool:
  """`__all__ = [...]`: names of Python objects (a `Case`, a `Slice` step), not op types."""
  return isinstance(node, ast.Assign) and any(
    isinstance(t, ast.Name) and t.id == '__all__' for t in node.targets
  )


def _string_constants(node: ast.AST):
  if isinstance(node, (ast.Set, ast.List, ast.Tuple)):
    items = node.elts
  elif isinstance(node, ast.Dict):
    items = [k for k in node.keys if k is not None]
  elif isinstance(node, ast.Compare):
    items = [node.left, *node.comparators]
  else:
    return []
  return [c.value for c in items if isinstance(c, ast.Constant) and isinstance(c.value, str)]


def op_type_names_in(root: pathlib.Path, op_types):
  """(file, line, op type) for each registered op type named in a table or comparison."""
  found = []
  for path in sorted(root.rglob('*.py')):
    if _registry_modules(path, root):
      continue
    tree = ast.parse(path.read_text())
    exported = {id(n.value) for n in ast.walk(tree) if _is_all(n)}
    for node in ast.walk(tree):
      if id(node) in exported:
        continue
      for name in _string_constants(node):
        if name in op_types:
          found.append((path, node.lineno, name))
  return found


def test_no_property_table_outside_the_registry_names_an_op_type():
  op_types = set(registry.op_types())
  unexplained = [
    f'{path.relative_to(ROOT)}:{line}: {name!r}'
    for path, line, name in op_type_names_in(ROOT, op_types)
    if name not in ALLOWED.get(path.name, (set(), ''))[0]
  ]
  assert not unexplained, (
    'op types named outside their registry entry (declare the property in the ops_*.py '
    'module registering the op, and read it from `registry.entry_of(op).<property>`):\n'
    + '\n'.join(unexplained)
  )


def test_the_allowed_names_are_still_used():
  op_types = set(registry.op_types())
  used = {}
  for path, _, name in op_type_names_in(ROOT, op_types):
    used.setdefault(path.name, set()).add(name)
  stale = {f: sorted(names - used.get(f, set())) for f, (names, _) in ALLOWED.items()}
  assert not {f: n for f, n in stale.items() if n}, f'allowed but no longer named: {stale}'


def test_the_scan_sees_a_table():
  # The scan itself can tell: a side table of op types is found.
  tree = ast.parse("_DIVISIONS = ('FloorDiv', 'Mod')\nif node.op == 'Mean': pass\n")
  names = [n for node in ast.walk(tree) for n in _string_constants(node)]
  assert names == ['FloorDiv', 'Mod', 'Mean']


# --- every named thing resolves ---------------------------------------------------------------
def test_every_local_computation_an_entry_names_exists():
  from tf_gspmd.graph_rewrite import dispatch, handlers

  dispatch._load_families()  # noqa: SLF001 (imports every handler module)
  named = {e.local for e in registry.entries() if e.local is not None}
  assert named <= set(handlers.LOCAL), sorted(named - set(handlers.LOCAL))
  assert set(handlers.LOCAL) <= named, f'never named: {sorted(set(handlers.LOCAL) - named)}'


def test_every_sweep_program_an_entry_names_exists():
  from tf_gspmd.testing import op_builders

  op_builders.load_programs()
  named = {e.sweep for e in registry.entries() if e.sweep is not None}
  assert named <= set(op_builders.PROGRAMS), sorted(named - set(op_builders.PROGRAMS))
  assert set(op_builders.PROGRAMS) <= named, sorted(set(op_builders.PROGRAMS) - named)


def test_every_op_type_is_swept_or_says_why_not():
  from tf_gspmd.testing import op_builders

  swept = set(op_builders.specs_by_op_type())
  for entry in registry.entries():
    assert (entry.op_type in swept) != bool(entry.unswept), entry


# --- properties fit their ops ------------------------------------------------------------------
def _example(entry):
  """(graph, node) of the entry's example node."""
  from tf_gspmd.propagation.builder import GraphBuilder

  b = GraphBuilder()
  name = entry.example(b)
  graph = b.graph()
  node = graph.node(name)
  node.op = entry.op_type
  return graph, node


def _example_node(entry):
  return _example(entry)[1]


@pytest.mark.parametrize(
  'entry', [e for e in registry.entries() if e.linear is not None], ids=lambda e: e.op_type
)
def test_a_linear_op_has_the_operands_its_form_reads(entry):
  node = _example_node(entry)
  least = {'negate': 1, 'layout': 1, 'annotate': 1, 'add_n': 2}.get(entry.linear, 2)
  assert len(node.inputs) >= least and len(node.outputs) == 1, (entry, node.inputs)


@pytest.mark.parametrize(
  'entry', [e for e in registry.entries() if e.divisor is not None], ids=lambda e: e.op_type
)
def test_a_divisor_operand_exists(entry):
  assert entry.divisor < len(_example_node(entry).inputs)


@pytest.mark.parametrize(
  'entry',
  [e for e in registry.entries() if e.reduction != 'sum' or not e.combinable],
  ids=lambda e: e.op_type,
)
def test_a_reduction_kind_is_given_to_ops_that_reduce(entry):
  from tf_gspmd.propagation.rule import NEED_REPLICATION, REDUCTION

  rule = entry.example_rule()
  # Not combinable: the reduced factor is a reduction kept whole, or one never sharded.
  reduced = (REDUCTION,) if entry.combinable else (REDUCTION, NEED_REPLICATION)
  assert rule is not None and any(rule.kind(f) in reduced for f in rule.factors()), entry


@pytest.mark.parametrize(
  'entry', [e for e in registry.entries() if e.resource is not None], ids=lambda e: e.op_type
)
def test_a_resource_op_reads_or_makes_a_handle(entry):
  node = _example_node(entry)
  if entry.resource == registry.RESOURCE_DECLARES:
    assert not node.inputs and registry.attr(node, 'shape') is not None
  else:
    assert node.inputs
  if entry.resource == registry.RESOURCE_ASSIGNS:
    assert len(node.inputs) >= 2


@pytest.mark.parametrize(
  'entry', [e for e in registry.entries() if e.reads_variable_only], ids=lambda e: e.op_type
)
def test_a_variable_reader_takes_a_handle(entry):
  graph, node = _example(entry)
  assert node.inputs and registry.is_resource(graph.tensor(node.inputs[0]).dtype)


def test_windowed_entries_name_a_form_and_operands_that_exist():
  from tf_gspmd.graph_rewrite import windowed

  for entry in registry.entries():
    if entry.local != 'windowed':
      continue
    params = entry.local_params
    assert params['form'] in windowed._LOCAL, entry  # noqa: SLF001
    n = len(_example_node(entry).inputs)
    operands = list(params.get('whole_image_masks', {})) + [params.get('sizes_operand', 0)]
    assert all(0 <= i < n for i in operands), entry


def test_entries_are_immutable():
  entry = registry.lookup('Pad')
  with pytest.raises(Exception):  # noqa: B017 (frozen dataclass or read-only mapping)
    entry.local = 'other'
  with pytest.raises(TypeError):
    entry.local_params['fill'] = 'other'


def test_two_modules_registering_one_op_family_are_refused():
  fresh = registry.Registry()
  fresh.register('A', 'shape', lambda n, c: None, module='tf_gspmd.propagation.ops_shape')
  fresh.register('B', 'shape', lambda n, c: None, module='tf_gspmd.propagation.ops_shape')
  with pytest.raises(ValueError, match="op family 'shape' is registered by two modules"):
    fresh.register('C', 'shape', lambda n, c: None, module='tf_gspmd.propagation.ops_indexing')


def test_a_family_module_registers_the_family_it_is_named_for():
  with pytest.raises(ValueError, match="registers family 'shape'; name it 'indexing'"):
    registry.Registry().register(
      'A', 'shape', lambda n, c: None, module='tf_gspmd.propagation.ops_indexing'
    )


def test_every_family_has_one_module_named_for_it():
  registry.op_types()  # every family module loaded
  owners = registry.REGISTRY.family_modules()
  assert set(owners) == set(registry.families())
  assert {m.rpartition('.')[2] for m in owners.values()} == set(registry.family_modules())
  for family, module in owners.items():
    assert module == f'tf_gspmd.propagation.ops_{family}'


def test_register_refuses_a_family_from_a_module_not_its_own():
  registry.op_types()  # every family module loaded: 'matmul' belongs to ops_matmul
  # register() takes the module from its caller: this test module is not ops_matmul.
  with pytest.raises(ValueError, match="op family 'matmul' is registered by two modules"):
    registry.register('NotAnOpType', 'matmul', lambda n, c: None)
  assert registry.lookup('NotAnOpType') is None
