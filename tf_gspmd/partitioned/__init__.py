"""`tf_gspmd.partition`: an annotated tf.function as one SPMD program on a mesh.

The data flow, one stage per package:
capture (`graph.capture`) -> propagate (`propagation`) -> partition
(`graph_rewrite.partitioner` and its handlers, with reshards routed by
`graph_rewrite.reshard` and lowered by `graph_rewrite.lower_reshard`) ->
run (`runtime.SpmdProgram`: one per-partition program launched on every device;
or, with backend='xla', the program exported to StableHLO and run through PJRT).

This package is the front over those stages:
- `front`: `partition` and `PartitionedFunction`, what the user holds;
- `compile`: capture, annotate, propagate and build the per-partition program;
- `boundary`: the given in/out shardings, the mesh and device order the program
  computes in;
- `variables`: `VariableStore`, one function's index of the variables it holds as shards;
  `Variable` and `sharded_variables`, variables made as shards;
- `tf_executor`, `xla_executor`: one call on each backend; `xla_programs`: the XLA programs of
  a partition (TPU lowering, StableHLO export), whatever backend runs it.

A variable the function touches lives once, as its shards across the devices
(`ShardedVariable`s, laid out as propagation decided): the `tf.Variable` becomes a
view of them (`program/held.py`), shared by every partitioned function over it.
"""

from tf_gspmd.partitioned.compile import Compiled
from tf_gspmd.partitioned.front import BACKENDS, PartitionedFunction, partition
from tf_gspmd.partitioned.signature import name_of
from tf_gspmd.partitioned.variables import Variable, VariableStore, sharded_variables

__all__ = [
  'BACKENDS',
  'Compiled',
  'PartitionedFunction',
  'Variable',
  'VariableStore',
  'name_of',
  'partition',
  'sharded_variables',
]
