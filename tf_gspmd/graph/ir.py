"""Graph IR: the plain-Python view of a captured TF graph that every later stage reads.

A `Program` holds the top-level `Graph` and every library function reachable
from it (If/While branches and bodies, function calls), each as a `Graph` of
the same form. Tensors are named `'node:index'` everywhere, library functions
included, so a rule written for the top level works unchanged inside a While
body. Shapes are static (tuples of ints; `None` for a dim TF could not infer).

Nothing here runs TensorFlow: `capture.py` fills it, `rebuild.py` turns it
back into a runnable function. `format_program` (or `Program.dump()`) prints
a program as text for debugging.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional, Tuple

from tf_gspmd.sharding import Sharding

# Attribute names of ops that call library functions, by op type.
FUNCTION_ATTRS = {
  'If': ('then_branch', 'else_branch'),
  'StatelessIf': ('then_branch', 'else_branch'),
  'While': ('cond', 'body'),
  'StatelessWhile': ('cond', 'body'),
  'PartitionedCall': ('f',),
  'StatefulPartitionedCall': ('f',),
  'Case': ('branches',),
  'StatelessCase': ('branches',),
}


def tensor_name(node: str, index: int = 0) -> str:
  return f'{node}:{index}'


def split_tensor_name(name: str) -> Tuple[str, int]:
  node, _, index = name.rpartition(':')
  if not node:
    return name, 0
  return node, int(index)


@dataclasses.dataclass
class Tensor:
  """One output of one node."""

  node: str
  index: int
  dtype: Any  # tf.DType
  shape: Optional[Tuple[Optional[int], ...]]  # None: unknown rank
  # For resource/variant tensors: what the handle points to, as
  # ((dtype, shape), ...); for a variable handle the variable's dtype and shape.
  handle_data: Optional[Tuple[Tuple[Any, Optional[Tuple[Optional[int], ...]]], ...]] = None
  # The same as TF's HandleData proto (it also holds full types, e.g. that a
  # variant is a TensorList, which some shape functions check); rebuild uses it.
  handle_proto: Any = dataclasses.field(default=None, repr=False, compare=False)

  @property
  def name(self) -> str:
    return tensor_name(self.node, self.index)

  @property
  def rank(self) -> Optional[int]:
    return None if self.shape is None else len(self.shape)

  @property
  def value_dtype(self):
    """dtype of the value behind a resource handle (a variable), else None."""
    return self.handle_data[0][0] if self.handle_data else None

  @property
  def value_shape(self) -> Optional[Tuple[Optional[int], ...]]:
    """Shape of the value behind a resource handle (a variable), else None."""
    return self.handle_data[0][1] if self.handle_data else None


@dataclasses.dataclass
class Node:
  """One op. `inputs` are tensor names; `attrs` hold the NodeDef's AttrValue protos."""

  name: str
  op: str
  inputs: List[str]
  outputs: List[Tensor]
  attrs: Dict[str, Any] = dataclasses.field(default_factory=dict)
  control_inputs: List[str] = dataclasses.field(default_factory=list)
  device: str = ''
  # Sharding the user wrote on this node's output(s): from an XlaSharding op or
  # the `_XlaSharding` attr. One entry per output index that carries one.
  annotations: Dict[int, Sharding] = dataclasses.field(default_factory=dict)

  def output(self, index: int = 0) -> Tensor:
    return self.outputs[index]

  def called_functions(self) -> Dict[str, List[str]]:
    """Library functions this node calls: attr name -> function names."""
    found = {}
    for attr in FUNCTION_ATTRS.get(self.op, ()):
      value = self.attrs.get(attr)
      if value is None:
        continue
      if value.HasField('func'):
        found[attr] = [value.func.name]
      elif value.HasField('list'):
        found[attr] = [f.name for f in value.list.func]
    return found

  def function_refs(self) -> List[str]:
    """Every library function this node names, in any `func` or `list(func)` attr.

    Wider than `called_functions`: it also sees functions held by ops outside
    `FUNCTION_ATTRS` (e.g. a dataset map function), so a rename misses none.
    """
    names = []
    for attr in sorted(self.attrs):
      value = self.attrs[attr]
      if not hasattr(value, 'HasField'):
        continue
      if value.HasField('func') and value.func.name:
        names.append(value.func.name)
      elif value.HasField('list'):
        names.extend(f.name for f in value.list.func if f.name)
    return names


@dataclasses.dataclass
class Graph:
  """A graph body: the top level or one library function.

  `nodes` is in topological order. `inputs` names the tensors that stand for
  the function's arguments in order (for the top level, its placeholders),
  `outputs` the tensors it returns in order.
  """

  name: str
  nodes: List[Node]
  inputs: List[str]
  outputs: List[str]
  # For library functions: the FunctionDef's attrs we must keep on rebuild.
  attrs: Dict[str, Any] = dataclasses.field(default_factory=dict)
  # Names of nodes that must run even though no output depends on them
  # (stateful ops such as variable updates): the FunctionDef's control_ret, or
  # the top-level graph's control outputs.
  control_outputs: List[str] = dataclasses.field(default_factory=list)
  # For library functions: the FunctionDef's output arg names, parallel to
  # `outputs` (empty for the top level).
  output_names: List[str] = dataclasses.field(default_factory=list)

  def __post_init__(self):
    self._index()

  def _index(self):
    self._by_name = {n.name: n for n in self.nodes}
    self._consumers: Dict[str, List[Tuple[str, int]]] = {}
    for n in self.nodes:
      for i, t in enumerate(n.inputs):
        self._consumers.setdefault(t, []).append((n.name, i))

  def reindex(self) -> None:
    """Call after editing `nodes` in place."""
    self._index()

  def node(self, name: str) -> Node:
    return self._by_name[name]

  def has_node(self, name: str) -> bool:
    return name in self._by_name

  def tensor(self, name: str) -> Tensor:
    node, index = split_tensor_name(name)
    return self._by_name[node].outputs[index]

  def producer(self, tensor: str) -> Node:
    return self._by_name[split_tensor_name(tensor)[0]]

  def consumers(self, tensor: str) -> List[Tuple[str, int]]:
    """(node name, input index) of every use of `tensor`."""
    return list(self._consumers.get(tensor, ()))

  def tensors(self):
    for n in self.nodes:
      yield from n.outputs

  def annotated(self) -> Dict[str, Sharding]:
    """tensor name -> the sharding the user wrote on it, for every annotated tensor."""
    return {tensor_name(n.name, i): s for n in self.nodes for i, s in n.annotations.items()}


@dataclasses.dataclass
class Program:
  """A captured tf.function: its top-level graph and the library functions it reaches."""

  main: Graph
  functions: Dict[str, Graph]
  # Top-level resource placeholders that stand for live variables.
  variables: Dict[str, Any] = dataclasses.field(default_factory=dict)  # tensor name -> tf.Variable
  # Other captured (non-variable) tensors: placeholder tensor name -> captured value.
  captures: Dict[str, Any] = dataclasses.field(default_factory=dict)
  # Placeholders fed by the user's arguments, in call order.
  arg_inputs: List[str] = dataclasses.field(default_factory=list)
  # How to rebuild the user's structured outputs from `main.outputs`.
  structured_outputs: Any = None
  # The captured function's FunctionType: binds the user's (args, kwargs) to
  # `arg_inputs` and packs `main.outputs` into `structured_outputs` on rebuild.
  function_type: Any = None
  # Python default values of the captured function's parameters (by name), so
  # a rebuilt function can be called without the arguments that have one.
  default_values: Dict[str, Any] = dataclasses.field(default_factory=dict)
  # Shardings the user put on variables in Python (not through an op):
  # placeholder tensor name -> Sharding. The same sharding is also in the
  # placeholder node's `annotations[0]`.
  variable_shardings: Dict[str, Sharding] = dataclasses.field(default_factory=dict)
  name: str = ''

  def function(self, name: str) -> Graph:
    return self.functions[name]

  def graphs(self):
    yield self.main
    yield from self.functions.values()

  def dump(self) -> str:
    """The whole program as text (see `format_program`)."""
    return format_program(self)


def _format_shape(shape) -> str:
  if shape is None:
    return '<?>'
  return '[' + ','.join('?' if d is None else str(d) for d in shape) + ']'


def _format_tensor(t: Tensor) -> str:
  dtype = getattr(t.dtype, 'name', str(t.dtype))
  text = f'{dtype}{_format_shape(t.shape)}'
  if t.handle_data:
    inner = ', '.join(f'{getattr(d, "name", d)}{_format_shape(s)}' for d, s in t.handle_data)
    text += f'->({inner})'
  return text


def format_graph(graph: Graph, variables: Optional[Dict[str, Any]] = None) -> str:
  """One line per node: `name = Op(inputs) : output types  {shardings} ^control @device`."""
  variables = variables or {}
  lines = [f'graph {graph.name}(' + ', '.join(graph.inputs) + ')']
  for n in graph.nodes:
    outs = ', '.join(_format_tensor(t) for t in n.outputs) or '()'
    text = f'  {n.name} = {n.op}(' + ', '.join(n.inputs) + f') : {outs}'
    calls = n.function_refs()
    if calls:
      text += '  calls ' + ','.join(calls)
    if n.annotations:
      text += '  {' + ', '.join(f'{i}: {s}' for i, s in sorted(n.annotations.items())) + '}'
    if n.control_inputs:
      text += '  ^' + ',^'.join(n.control_inputs)
    if n.device:
      text += f'  @{n.device}'
    variable = variables.get(tensor_name(n.name))
    if variable is not None:
      text += f'  # variable {getattr(variable, "name", variable)}'
    lines.append(text)
  lines.append('  return (' + ', '.join(graph.outputs) + ')')
  if graph.control_outputs:
    lines.append('  control (' + ', '.join(graph.control_outputs) + ')')
  return '\n'.join(lines)


def format_program(program: Program) -> str:
  """The top-level graph, then every library function, as text for debugging."""
  parts = [format_graph(program.main, program.variables)]
  parts.extend(format_graph(program.functions[name]) for name in sorted(program.functions))
  return '\n\n'.join(parts) + '\n'
