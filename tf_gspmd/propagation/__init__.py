"""Sharding propagation: op rules (`registry`, `OpRule`) and the fixpoint algorithm.

`propagate(fn, *example_args, mesh=...)` captures a function and returns a
`Propagation` with every tensor's `NamedSharding` and where it came from.
"""

from tf_gspmd.propagation import registry
from tf_gspmd.propagation.api import Propagation, propagate, propagate_captured
from tf_gspmd.propagation.propagate import (
  PropagationResult,
  PropagationWarning,
  Provenance,
  propagate_program,
)
from tf_gspmd.propagation.rule import NEED_REPLICATION, PASS_THROUGH, REDUCTION, OpRule

__all__ = [
  'Propagation',
  'propagate',
  'propagate_captured',
  'PropagationResult',
  'PropagationWarning',
  'Provenance',
  'propagate_program',
  'OpRule',
  'PASS_THROUGH',
  'REDUCTION',
  'NEED_REPLICATION',
  'registry',
]
