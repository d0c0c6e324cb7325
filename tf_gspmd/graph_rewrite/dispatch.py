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

from tf_gspmd.errors import Unsupported
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
  handler, how = _lookup(p, node, graph)
  if how != 'hand-written' and how != 'static value':
    _check_runnable(p, node)
  return handler, how


@functools.lru_cache(maxsize=None)
def _device_types(op_type: str) -> frozenset:
  from tf_gspmd.tf_private import kernels

  try:
    return frozenset(k.device_type for k in kernels.get_registered_kernels_for_op(op_type).kernel)
  except Exception:  # noqa: BLE001 (an op type TF does not know: a function call, checked elsewhere)
    return frozenset(['?'])


def _check_runnable(p: Partitioner, node: ir.Node) -> None:
  """Refuse, when partitioning, an op the program would emit as it is but no device here runs
  (a TPU op): a bare "no OpKernel" error at run time names neither the op's purpose nor a fix."""
  if node.called_functions() or not static_op(node.op):
    return
  types = _device_types(node.op)
  runs = {'CPU', 'GPU', 'DEFAULT', '?'}  # a DEFAULT kernel runs on any device
  runs |= getattr(p.backend, 'kernel_device_types', frozenset())
  if not types & runs:
    raise Unsupported(
      f"tf_gspmd: op {node.op} (node {node.name}) has no kernel on this machine's devices "
      f'(registered for {sorted(types) or "none"}) and tf_gspmd has no local computation '
      'for it, so the partitioned program could not run it. Write it with ops that run here '
      '(inside a manual region: tg.psum, tg.all_gather, tg.all_to_all, tg.ppermute), or '
      'report the op.'
    )


def static_op(op_type: str) -> bool:
  """Whether `op_type` is a registered TF op (not a library function's name)."""
  from tf_gspmd.graph import static_values

  return static_values.op_def(op_type) is not None


def _lookup(p: Partitioner, node: ir.Node, graph: ir.Graph):
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
