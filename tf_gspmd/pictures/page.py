"""What one report page shows, as plain data (`Page`), and writing it out.

A `Page` is filled from a partitioned function or a plan (`sources`) and drawn
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


@dataclasses.dataclass
class VariableEntry:
  """One variable: its layout, what one device holds of it, and why it is laid out so."""
  name: str
  shape: Tuple[int, ...]
  dtype: str
  sharding: Sharding
  trainable: bool
  per_device: int      # bytes of one device's (padded) shard
  total: int           # bytes of the global value
  provenance: str = ''


@dataclasses.dataclass
class Page:
  """Everything the report page draws."""
  title: str
  mesh: Mesh
  variables: List[VariableEntry]
  collectives: List[dict]                 # as PartitionedFunction.collectives() gives them
  memory: Dict[str, Optional[int]]        # MEMORY_PARTS -> bytes per device (None: not measured)
  records: List[dict] = dataclasses.field(default_factory=list)  # propagation's, per op result
  notes: List[str] = dataclasses.field(default_factory=list)


def memory_of(variables: List[VariableEntry], activations: Optional[int]) -> Dict[str, Optional[int]]:
  """Per-device bytes: trainable variables are parameters, the others optimizer state."""
  return {'parameters': sum(v.per_device for v in variables if v.trainable),
          'optimizer state': sum(v.per_device for v in variables if not v.trainable),
          'activations': activations}

