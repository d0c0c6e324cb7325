"""The value shape of every resource tensor of a program (resource handles are scalars; rules
need the shape of the variable a handle stands for)."""

from __future__ import annotations

from typing import Dict

from tf_gspmd.graph import ir
from tf_gspmd.propagation import registry
from tf_gspmd.propagation.provenance import Key
from tf_gspmd.propagation.registry import is_resource


def infer_resource_shapes(program: ir.Program) -> Dict[Key, tuple]:
  """Value shape of every resource tensor: variables, reads, assigns, ties, VarHandleOp attrs.

  What each op says about a variable's shape is its registry entry's `resource`.
  """
  shapes: Dict[Key, tuple] = {}
  main = program.main.name
  for tensor, var in program.variables.items():
    shape = getattr(var, 'shape', None)
    if shape is not None:
      shapes[(main, tensor)] = tuple(
        None if d is None else int(d)
        for d in (shape.as_list() if hasattr(shape, 'as_list') else shape)
      )
  for _ in range(len(program.functions) + 2):
    before = len(shapes)
    for graph in program.graphs():
      _shapes_in(program, graph, shapes)
    if len(shapes) == before:
      break
  return shapes


def _shapes_in(program: ir.Program, graph: ir.Graph, rs: Dict[Key, tuple]) -> None:
  for node in graph.nodes:
    g = graph.name
    how = registry.entry_of(node.op).resource  # what the op says about a variable's shape
    if how == registry.RESOURCE_DECLARES:
      shape = registry.attr(node, 'shape')
      if shape is not None and node.outputs:
        rs.setdefault((g, node.outputs[0].name), tuple(shape))
    if not node.inputs:
      continue
    first = (g, node.inputs[0])
    src = graph.tensor(node.inputs[0])
    if not is_resource(src.dtype):
      continue
    if how == registry.RESOURCE_READS and node.outputs[0].shape is not None:
      rs.setdefault(first, tuple(node.outputs[0].shape))
    elif how == registry.RESOURCE_ASSIGNS:
      shape = graph.tensor(node.inputs[1]).shape
      if shape is not None:
        rs.setdefault(first, tuple(shape))
    elif how == registry.RESOURCE_FORWARDS and first in rs:
      rs.setdefault((g, node.outputs[0].name), rs[first])
  for node in graph.nodes:
    entry = registry.lookup(node.op)
    if entry is None or entry.call_ties is None:
      continue
    try:
      groups = entry.call_ties.ties(node, graph, program)
    except ValueError:
      continue
    for group in groups:
      known = [rs[k] for k in group if k in rs]
      if known:
        for k in group:
          if _graph(program, k[0]).tensor(k[1]).dtype is not None and is_resource(
            _graph(program, k[0]).tensor(k[1]).dtype
          ):
            rs.setdefault(k, known[0])


def _graph(program: ir.Program, name: str) -> ir.Graph:
  return program.main if name == program.main.name else program.functions[name]
