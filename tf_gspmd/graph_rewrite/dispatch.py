"""Which handler partitions an IR node: `lookup(partitioner, node, graph) -> (handler, how)`.

Values known before run time and values of run-time shape come first (no
sharding applies to them), then the hand-written local computation the op's
registry entry names (`Entry.local`), then the op's propagation rule, then the
replicated fallback. Hand-written handler modules of this package register
their computations by name on import (`handlers.computes`); they are found by
listing the package, so no list of them is kept by hand.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil

from tf_gspmd.graph import ir
from tf_gspmd.graph_rewrite import factors, handlers
from tf_gspmd.graph_rewrite.partitioner import Partitioner
from tf_gspmd.propagation import registry


@functools.lru_cache(maxsize=None)
def _load_families() -> None:
  package = importlib.import_module('tf_gspmd.graph_rewrite')
  for module in pkgutil.iter_modules(package.__path__):
    importlib.import_module(f'tf_gspmd.graph_rewrite.{module.name}')


def lookup(p: Partitioner, node: ir.Node, graph: ir.Graph):
  """The handler for `node` and a word on how it is partitioned."""
  _load_families()
  entry = registry.entry_of(node.op)
  # Values known before run time and values of run-time shape come first: no
  # sharding can apply to them, whatever the op.
  if (
    node.outputs
    and not node.called_functions()
    and all(p.static_value(graph, t.name) is not None for t in node.outputs)
  ):
    return handlers.static_handler, 'static value'
  if (
    any(handlers.is_dynamic(t) for t in node.outputs)
    and not node.called_functions()
    and not entry.unshaped_results_ok
  ):
    return handlers.dynamic_handler, 'replicated (dynamic shape)'
  if entry.local is not None:
    return handlers.LOCAL[entry.local], 'hand-written'
  if node.op in handlers.SEEDED_STATEFUL_OPS:  # TF's seeded random ops not registered (yet)
    return handlers.random_handler, 'hand-written'
  if factors.has_rule(node, graph):
    if graph is not p.program.main and any(
      handlers.is_dynamic(graph.tensor(t)) for t in node.inputs
    ):
      # In a branch body, a result of static shape from an operand of run-time shape (a cond's
      # gradient branch sizes a dense gradient by a shape passed in): layouts need static
      # shapes. The main graph's such ops (an embedding's UnsortedSegmentSum) have rules that
      # keep their pending sums, bucketed with the other gradients.
      return handlers.dynamic_handler, 'replicated (operand of dynamic shape)'
    return factors.factor_handler, 'rule'
  return handlers.fallback_handler, 'replicated (no rule)'
