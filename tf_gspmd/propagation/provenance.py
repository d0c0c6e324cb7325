"""What propagation returns: per tensor a sharding and the `Provenance` saying where it came
from (`PropagationResult`), and the provenance kinds."""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Mapping, Optional, Tuple

from tf_gspmd.graph import ir
from tf_gspmd.propagation.rule import OpRule
from tf_gspmd.sharding import NamedSharding

Key = Tuple[str, str]  # (graph name, tensor name)


class PropagationWarning(UserWarning):
  """An op with no usable rule: its results are replicated."""


# Provenance kinds.
ANNOTATION = 'annotation'  # the user annotated this tensor
VARIABLE = 'variable'  # a resource placeholder of an annotated variable
FORWARD = 'forward'  # from the operands of the op that produces it
BACKWARD = 'backward'  # from an op that uses it (its results or other operands)
NO_RULE = 'no_rule'  # produced by an op without a rule: replicated
BY_RULE = 'rule'  # the producing op's rule replicates it (shape vectors, ...)
AUXILIARY = 'auxiliary'  # only used as shape/axis/index-list operands (or unused): replicated
SCALAR = 'scalar'  # rank 0: replicated
UNKNOWN_RANK = 'unknown_rank'
DEFAULT = 'default'  # nothing reached it: replicated
MANUAL = 'manual'  # fixed by a manual region's entry or exit op (a propagation boundary)


@dataclasses.dataclass(frozen=True)
class Provenance:
  """Where a tensor's sharding came from."""

  kind: str
  op: Optional[str] = None  # node through which it arrived (qualified)
  op_type: Optional[str] = None
  source: Optional[str] = None  # tensor it was read from (qualified)
  origin: Optional[str] = None  # the annotated tensor or variable at the root of the path
  path: Tuple[str, ...] = ()  # nodes passed from the origin to here, in order
  level: Optional[int] = None
  detail: str = ''

  @property
  def direction(self) -> str:
    return self.kind if self.kind in (FORWARD, BACKWARD) else '-'

  def describe(self) -> str:
    if self.kind == ANNOTATION:
      return 'user annotation'
    if self.kind == VARIABLE:
      return f'variable {self.origin}'
    if self.kind == MANUAL:
      return f'manual region boundary {self.op} ({self.op_type}): {self.detail}'
    if self.kind in (FORWARD, BACKWARD):
      return (
        f'{self.kind} via {self.op} ({self.op_type}) from {self.source}; origin '
        f'{self.origin}, {len(self.path)} step(s), level {self.level}'
      )
    return {
      NO_RULE: f'no rule for {self.op_type}: replicated',
      BY_RULE: f'{self.op_type} rule: replicated',
      AUXILIARY: 'auxiliary operand (shape/axes/indices): replicated',
      SCALAR: 'scalar: replicated',
      UNKNOWN_RANK: 'unknown rank: replicated',
      DEFAULT: 'not reached by any sharding: replicated',
    }[self.kind] + (f' ({self.detail})' if self.detail else '')


def qualified(program: ir.Program, key: Key) -> str:
  """'tensor' for the top-level graph, 'function::tensor' inside a library function."""
  graph, tensor = key
  return tensor if graph == program.main.name else f'{graph}::{tensor}'


class PropagationResult:
  """Shardings and provenance of every tensor of a program."""

  def __init__(self, program, mesh, shardings, provenance, infos, warnings_list, iterations):
    self.program = program
    self.mesh = mesh
    self.shardings: Dict[str, Dict[str, NamedSharding]] = shardings
    self.provenance: Dict[str, Dict[str, Provenance]] = provenance
    self._infos = infos
    self.warnings: List[str] = warnings_list
    self.iterations = iterations  # sweeps run per level
    # The manual regions (`manual.ManualRegions`): (graph, tensor) -> the mesh axes it is
    # manual over, for tensors inside them (set by propagation).
    self.manual: Mapping[Key, Tuple[str, ...]] = {}

  def _split(self, name: str, graph: Optional[str]) -> Key:
    if graph is None and '::' in name:
      graph, name = name.split('::', 1)
    graph = graph or self.program.main.name
    if ':' not in name:
      name += ':0'
    if graph not in self.shardings or name not in self.shardings[graph]:
      raise KeyError(f'No tensor {name!r} in graph {graph!r} of the propagated program.')
    return graph, name

  def sharding(self, name: str, graph: Optional[str] = None) -> NamedSharding:
    """The sharding of tensor `name` ('node:0', 'node', or 'function::node:0')."""
    g, t = self._split(name, graph)
    return self.shardings[g][t]

  def provenance_of(self, name: str, graph: Optional[str] = None) -> Provenance:
    g, t = self._split(name, graph)
    return self.provenance[g][t]

  def rule(self, node: str, graph: Optional[str] = None) -> Optional[OpRule]:
    info = self._infos.get((graph or self.program.main.name, node))
    return None if info is None else info.rule

  def records(self) -> List[dict]:
    """One record per op result: the data behind `explain()`."""
    rows = []
    for graph in self.program.graphs():
      for node in graph.nodes:
        for out in node.outputs:
          prov = self.provenance[graph.name][out.name]
          manual = self.manual.get((graph.name, out.name), ())
          sharding = str(self.shardings[graph.name][out.name].spec)
          if manual:  # each partition's own value: its automatic layout, then its manual axes
            sharding += ' manual(' + ', '.join(repr(a) for a in manual) + ')'
          rows.append(
            {
              'graph': graph.name,
              'node': node.name,
              'op': node.op,
              'tensor': out.name,
              'sharding': sharding,
              'manual': manual,
              'kind': prov.kind,
              'direction': prov.direction,
              'via': prov.op,
              'source': prov.source,
              'origin': prov.origin,
              'path': list(prov.path),
              'level': prov.level,
              'detail': prov.describe(),
            }
          )
    return rows

  def explain(self) -> str:
    """A readable table: each op's result shardings and where they came from."""
    from tf_gspmd.propagation.explain import format_table

    return format_table(self)
