"""What one report page shows, as plain data (`Page`), and writing it out.

A `Page` is filled from a partitioned function or a `tg.plan` report (`sources`) and drawn
by `html.render`; it holds no TF object, so a page can be drawn from anything
that knows its variables' layouts, its collectives and its bytes.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Tuple

from tf_gspmd.mesh import Mesh
from tf_gspmd.sharding import Sharding

# The three parts of a device's memory the page splits, in the order drawn.
MEMORY_PARTS = ('parameters', 'optimizer state', 'activations')
# A variable is a parameter when trainable, else optimizer state (the slots a step touches).
VARIABLE_ROLES = MEMORY_PARTS[:2]


@dataclasses.dataclass
class TensorEntry:
  """A variable, argument or output: its sharding, what one device holds of it, and why."""

  name: str
  shape: Tuple[int, ...]
  dtype: str
  sharding: Sharding
  role: str  # VARIABLE_ROLES (trainable or not), 'argument' or 'output'
  per_device: int  # bytes of one device's (padded) shard
  total: int  # bytes of the global value
  provenance: str = ''

  @property
  def trainable(self) -> bool:
    return self.role == 'parameters'


@dataclasses.dataclass
class Page:
  """Everything the report page draws."""

  title: str
  mesh: Mesh
  variables: List[TensorEntry]
  collectives: List[dict]  # as PartitionedFunction.collectives() gives them
  memory: Dict[str, Optional[int]]  # MEMORY_PARTS -> bytes per device (None: not measured)
  records: List[dict] = dataclasses.field(default_factory=list)  # propagation's, per op result
  notes: List[str] = dataclasses.field(default_factory=list)
  boundary: List[TensorEntry] = dataclasses.field(default_factory=list)  # arguments, outputs


def memory_of(variables: List[TensorEntry], activations: Optional[int]) -> Dict[str, Optional[int]]:
  """Per-device bytes: trainable variables are parameters, the others optimizer state."""
  return {
    'parameters': sum(v.per_device for v in variables if v.trainable),
    'optimizer state': sum(v.per_device for v in variables if not v.trainable),
    'activations': activations,
  }
