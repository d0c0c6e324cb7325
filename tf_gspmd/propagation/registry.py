"""The op registry: one entry per TF op type holds everything tf_gspmd knows about it.

An `Entry` holds the op's rule (how shardings flow through it), how it is
computed on local blocks (derived from the rule, or the hand-written local
computation `graph_rewrite` registers under the name the entry gives), its
properties (the reduction a sharded reduction factor leaves, whether partial
results combine, the operand it divides by, how it runs on pending sums,
whether its results alias another buffer, what it says about a variable's
shape, whether unshaped results are fine) and the op sweep's program for it.
No other module keeps a table of op types (`tests/test_op_registry.py`).

The family modules (every `ops_*` module of this package: `ops_elementwise`,
`ops_matmul`, `ops_reduction`, `ops_shape`, `ops_indexing`, `ops_nn`,
`ops_random`, `ops_rnn`, `ops_variables`, `ops_control_flow`, `ops_sources`)
register their op types here (`register`) and then declare their properties
(`declare`): adding an op touches its family module only. Most rules are a
function `(node, ctx) -> OpRule`; control-flow entries carry call ties (`CallTies`) that
ties tensors of the caller and the called functions together instead. Every
entry has an example node, so the rule text of every op type can be printed
(the support table, the golden test).

>>> lookup('MatMul').family
'matmul'
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import pkgutil
import types
from typing import Any, Callable, Dict, List, Mapping, Optional

import numpy as np

from tf_gspmd.errors import Unsupported
from tf_gspmd.graph import ir
from tf_gspmd.propagation.rule import OpRule


def family_modules() -> List[str]:
  """The rule family modules: every `ops_*` module of this package (none listed by hand)."""
  package = importlib.import_module('tf_gspmd.propagation')
  return sorted(m.name for m in pkgutil.iter_modules(package.__path__) if m.name.startswith('ops_'))


class RuleError(Unsupported):
  """A rule could not be built for a node (unknown constant input, bad attrs): a refusal."""


# How a resource-typed first operand relates to the variable whose shape it stands for.
RESOURCE_DECLARES = 'declares'  # the op makes the handle: its `shape` attr is the variable's
RESOURCE_READS = 'reads'  # result 0 is the variable's value
RESOURCE_ASSIGNS = 'assigns'  # operand 1 is the variable's new value
RESOURCE_FORWARDS = 'forwards'  # result 0 is the same handle
RESOURCE_KINDS = (RESOURCE_DECLARES, RESOURCE_READS, RESOURCE_ASSIGNS, RESOURCE_FORWARDS)

# How an op runs on the local partial blocks of operands holding pending sums (each
# yields a pending sum again; `coalesce` defers the all-reduce past such ops).
LINEAR_FORMS = (
  'add',  # x + y, both pending alike
  'add_n',  # the sum of n pending operands alike
  'subtract',  # x - y, both pending alike
  'negate',  # -x
  'scale',  # x * c or c * x, c one element
  'divide',  # x / c, c one element (the numerator pending)
  'layout',  # the value itself (an identity)
  'annotate',  # the value itself, if its sharding annotation names the pending layout
  'reshape',  # a reshape keeping the sharded leading dims
  'sum',  # a sum over unsharded dims
)
# The pending reduction a sharded reduction factor leaves ('mean': a sum, then scaled).
REDUCTION_KINDS = ('sum', 'max', 'min', 'prod', 'mean')


@dataclasses.dataclass(frozen=True)
class Entry:
  """Everything tf_gspmd knows about one op type.

  `rule` says how shardings flow through it (`call_ties` instead for control
  flow, which ties tensors across graphs). `local` names its hand-written
  local computation in `graph_rewrite` (resolved by `graph_rewrite.handlers.local`;
  `local_params` are what that computation reads about this op type); None means
  the local computation is derived from the rule (or, with no rule, the
  replicated fallback). The properties:

  - `reduction`: what a sharded reduction factor leaves pending (`REDUCTION_KINDS`);
  - `combinable`: whether partial results of a sharded reduction factor combine by
    a collective (False: reduced dims stay whole);
  - `divisor`: the operand this op divides by (its padding is filled with ones);
  - `linear`: how it runs on pending sums (`LINEAR_FORMS`), None when it cannot;
  - `aliasing`: its results alias memory held elsewhere (no bytes of their own);
  - `resource`: what its resource-typed first operand says about the variable's
    shape (`RESOURCE_KINDS`); `reads_variable_only`: it only reads the variable its
    handle operands stand for (any other use of a handle may write it);
  - `settles_by_bytes`: where two of its factors are proposed one mesh axis, propagation
    gives it to the one whose keeping moves fewer bytes (`pricing`), not to the earlier
    factor (gathers and scatters: a small table against many ids; dots: a weight against
    the activation it multiplies);
  - `unshaped_results_ok`: its local computation partitions it although some
    result has no static shape;
  - `sweep`: how the op sweep produces it (`testing/op_builders.py` reads it):
    the name of a program kind and its parameters, or `unswept`: why no program can.
  """

  op_type: str
  family: str
  rule: Optional[Callable] = None  # (node, ctx) -> OpRule
  call_ties: Optional[Any] = None  # control flow: ties tensors across graphs
  example: Optional[Callable] = None  # (GraphBuilder) -> node name
  note: str = ''
  local: Optional[str] = None
  local_params: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  reduction: str = 'sum'
  combinable: bool = True
  divisor: Optional[int] = None
  linear: Optional[str] = None
  aliasing: bool = False
  resource: Optional[str] = None
  reads_variable_only: bool = False
  settles_by_bytes: bool = False
  unshaped_results_ok: bool = False
  sweep: Optional[str] = None
  sweep_params: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  unswept: str = ''

  def __post_init__(self):
    for name in ('local_params', 'sweep_params'):
      object.__setattr__(self, name, types.MappingProxyType(dict(getattr(self, name))))
    checks = (
      (self.reduction in REDUCTION_KINDS, f'reduction {self.reduction!r}'),
      (self.linear is None or self.linear in LINEAR_FORMS, f'linear form {self.linear!r}'),
      (self.resource is None or self.resource in RESOURCE_KINDS, f'resource {self.resource!r}'),
      (not (self.sweep and self.unswept), 'both a sweep program and a reason it has none'),
    )
    for ok, what in checks:
      if not ok:
        raise ValueError(f'Registry: {self.op_type!r} has {what}.')

  def example_rule(self) -> Optional[OpRule]:
    """The rule of this op type's example node, or None for control flow."""
    if self.rule is None or self.example is None:
      return None
    from tf_gspmd.propagation.builder import GraphBuilder

    b = GraphBuilder()
    node_name = self.example(b)
    graph = b.graph()
    node = graph.node(node_name)
    # Op types registered together share one example node of the same signature.
    node.op = self.op_type
    return self.rule(node, RuleContext(graph, b.resource_shapes))

  def text(self) -> str:
    """The rule text of the example node (or the call ties' description)."""
    rule = self.example_rule()
    if rule is not None:
      return rule.text()
    return self.call_ties.text(self.op_type) if self.call_ties is not None else self.note


def _op_type_list(op_types) -> List[str]:
  return [op_types] if isinstance(op_types, str) else list(op_types)


class Registry:
  """Op type -> Entry."""

  def __init__(self):
    self._entries: Dict[str, Entry] = {}
    self._family_modules: Dict[str, str] = {}  # family -> the one module registering it

  def register(
    self,
    op_types,
    family: str,
    rule=None,
    example=None,
    call_ties=None,
    note='',
    module=None,
    **props,
  ):
    if module is not None:
      self._claim(family, module)
    for op_type in _op_type_list(op_types):
      if op_type in self._entries:
        raise ValueError(
          f'Registry: op type {op_type!r} is registered twice (families '
          f'{self._entries[op_type].family!r} and {family!r}).'
        )
      if rule is None and call_ties is None:
        raise ValueError(f'Registry: {op_type!r} needs a rule function or call ties.')
      self._entries[op_type] = Entry(op_type, family, rule, call_ties, example, note, **props)

  def _claim(self, family: str, module: str) -> None:
    """One family, one module, named as it (`ops_<family>`): what a family holds then does not
    depend on which module was imported first."""
    owner = self._family_modules.setdefault(family, module)
    if owner != module:
      raise ValueError(
        f'Registry: op family {family!r} is registered by two modules, {owner} and {module}; '
        'a family is one ops_<family> module.'
      )
    stem = module.rpartition('.')[2]
    if stem.startswith('ops_') and stem != f'ops_{family}':
      raise ValueError(f'Registry: {module} registers family {family!r}; name it {stem[4:]!r}.')

  def family_modules(self) -> Dict[str, str]:
    """Family -> the module that registers it."""
    return dict(self._family_modules)

  def declare(self, op_types, **props):
    """Set properties of registered op types (their family module declares them)."""
    for op_type in _op_type_list(op_types):
      if op_type not in self._entries:
        raise ValueError(f'Registry: {op_type!r} is declared before it is registered.')
      self._entries[op_type] = dataclasses.replace(self._entries[op_type], **props)

  def lookup(self, op_type: str) -> Optional[Entry]:
    return self._entries.get(op_type)

  def op_types(self) -> List[str]:
    return sorted(self._entries)

  def families(self) -> Dict[str, List[str]]:
    out: Dict[str, List[str]] = {}
    for op_type in self.op_types():
      out.setdefault(self._entries[op_type].family, []).append(op_type)
    return dict(sorted(out.items()))


REGISTRY = Registry()
_loaded = False


def _ensure_loaded():
  global _loaded
  if not _loaded:
    _loaded = True
    for mod in family_modules():
      importlib.import_module(f'tf_gspmd.propagation.{mod}')


def register(op_types, family, rule=None, example=None, call_ties=None, note='', **props):
  """Register op types of one family (props: `Entry`'s properties).

  A family belongs to the module registering it (the caller, `ops_<family>`): a second
  module registering into it is refused.
  """
  caller = inspect.currentframe().f_back  # the family's module
  module = caller.f_globals.get('__name__') if caller is not None else None
  REGISTRY.register(op_types, family, rule, example, call_ties, note, module=module, **props)


def declare(op_types, **props):
  """Set `Entry` properties of op types registered before (in the same family module)."""
  REGISTRY.declare(op_types, **props)


def op_types_of(family: str) -> List[str]:
  """The op types of `family` (for its module's declarations, after its registrations: no
  other module registers into it, so the list does not depend on import order)."""
  return REGISTRY.families().get(family, [])


def lookup(op_type: str) -> Optional[Entry]:
  _ensure_loaded()
  return REGISTRY.lookup(op_type)


def op_types() -> List[str]:
  _ensure_loaded()
  return REGISTRY.op_types()


def entries() -> List[Entry]:
  """Every entry, by op type."""
  return [e for e in (REGISTRY.lookup(t) for t in op_types()) if e is not None]


def entry_of(op_type: str) -> Entry:
  """The entry of `op_type`, or a default one (no rule, no properties) when unregistered."""
  found = lookup(op_type)
  return found if found is not None else Entry(op_type, '', note='unregistered')


def families() -> Dict[str, List[str]]:
  _ensure_loaded()
  return REGISTRY.families()


def rule_for(node: ir.Node, graph) -> Optional[OpRule]:
  """The OpRule of `node` in `graph` (an ir.Graph or RuleContext); None when unregistered."""
  entry = lookup(node.op)
  if entry is None or entry.rule is None:
    return None
  ctx = graph if isinstance(graph, RuleContext) else RuleContext(graph)
  return entry.rule(node, ctx)


# --- what rules read from a node ---------------------------------------------------
class RuleContext:
  """What a rule function may ask about its node's graph: shapes, attrs, constant inputs.

  `resource_shapes` maps resource tensors of this graph to the shape of the
  variable value they refer to (resource tensors themselves are scalars).
  """

  def __init__(self, graph: ir.Graph, resource_shapes=None, folded=None):
    self.graph = graph
    self.resource_shapes = resource_shapes or {}
    self._folded = folded  # lazily: static_values.fold(graph)

  def shape(self, tensor: str):
    """Static shape of a tensor (the variable's shape for a resource handle), None if unknown."""
    t = self.graph.tensor(tensor)
    if _is_resource(t.dtype):
      return self.resource_shapes.get(tensor)
    return t.shape

  def rank(self, tensor: str) -> Optional[int]:
    s = self.shape(tensor)
    return None if s is None else len(s)

  def out_shape(self, node: ir.Node, index: int = 0):
    return self.shape(node.outputs[index].name)

  def const(self, tensor: str) -> Optional[np.ndarray]:
    """The value of a tensor known before running (a Const, or folded shape arithmetic)."""
    node = self.graph.producer(tensor)
    while node.op in ('Identity', 'Snapshot') and node.inputs:
      tensor = node.inputs[0]
      node = self.graph.producer(tensor)
    if node.op == 'Const':
      return _tensor_value(node.attrs['value'])
    if self._folded is None:
      try:
        from tf_gspmd.graph import static_values

        self._folded = static_values.fold(self.graph)
      except Exception:  # noqa: BLE001
        # Folding runs TF on a copy of the graph; when it cannot, values stay unknown
        # and rules fall back to what static shapes alone say.
        self._folded = {}
    value = self._folded.get(tensor)
    if value is None and node.op == 'BroadcastGradientArgs':
      value = self._broadcast_gradient_args(node, tensor)
    return value

  def _broadcast_gradient_args(self, node, tensor) -> Optional[np.ndarray]:
    """Reduction indices of a broadcasting gradient, from two constant shapes (TF's semantics)."""
    first, second = (self.const_ints(t) for t in node.inputs[:2])
    if first is None or second is None:
      return None
    shapes = [first, second]
    index = int(tensor.rpartition(':')[2])
    if shapes[0] == shapes[1]:
      return np.zeros((0,), np.int32)
    n = max(len(s) for s in shapes)
    padded = [1] * (n - len(shapes[index])) + list(shapes[index])
    return np.array([i for i, d in enumerate(padded) if d == 1], np.int32)

  def const_ints(self, tensor: str) -> Optional[List[int]]:
    v = self.const(tensor)
    return None if v is None else [int(x) for x in np.asarray(v).reshape(-1)]


def attr(node: ir.Node, name: str, default=None):
  """A node attr as a plain python value (int, float, bool, str, list, numpy array, DType enum)."""
  v = node.attrs.get(name)
  if v is None:
    return default
  if not hasattr(v, 'WhichOneof'):
    return v
  kind = v.WhichOneof('value')
  if kind is None:
    return default
  if kind == 's':
    return v.s.decode('utf-8', 'replace')
  if kind in ('i', 'f', 'b', 'type'):
    return getattr(v, kind)
  if kind == 'tensor':
    return _tensor_value(v)
  if kind == 'shape':
    return None if v.shape.unknown_rank else tuple(d.size for d in v.shape.dim)
  if kind == 'func':
    return v.func.name
  if kind == 'list':
    lst = v.list
    for field in ('i', 'f', 'b', 'type', 'func'):
      values = list(getattr(lst, field))
      if values:
        return [f.name for f in values] if field == 'func' else values
    if lst.s:
      return [s.decode('utf-8', 'replace') for s in lst.s]
    if lst.shape:
      return [None if s.unknown_rank else tuple(d.size for d in s.dim) for s in lst.shape]
    return []
  return default


def _tensor_value(av) -> np.ndarray:
  import tensorflow as tf

  proto = av.tensor if hasattr(av, 'tensor') else av
  return tf.make_ndarray(proto)


def _is_resource(dtype) -> bool:
  name = getattr(dtype, 'name', dtype)
  return name == 'resource' or dtype == 20  # DT_RESOURCE enum


def is_resource(dtype) -> bool:
  return _is_resource(dtype)
