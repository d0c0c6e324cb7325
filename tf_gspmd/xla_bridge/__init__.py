"""The XLA bridge: per-partition programs as XLA programs, exported, compiled and run.

* `XlaCollectives` implements `tf_gspmd.collectives.Collectives` with XLA's ops
  (XlaAllReduce, XlaReduceScatter, AllToAll, CollectivePermute) for a
  TPUStrategy-style trace whose partition id is an input; `hlo` builds and
  reads the HLO of such a program.
* `export_per_replica` (used by `PartitionedFunction.export_xla`) lowers a
  per-partition program to one StableHLO module for every replica: partition
  id = XLA replica id, every collective native (`native.NativeCollectives`),
  with the sharding of each global argument and result (`XlaExport`, `ExportedValue`).
* `PjrtExecutable` compiles an `XlaExport` with XLA and runs it on the mesh's
  devices through PJRT (jaxlib, imported lazily: the `tf_gspmd[xla]` extra);
  `XlaShardedVariable` keeps variable shards resident as device buffers.

Both backends stand on `tf_gspmd.program` (the per-partition program contract); see
`tf_gspmd.runtime` for why this backend lives apart from the TF runtime.
"""

from tf_gspmd.xla_bridge.collectives import XlaCollectives
from tf_gspmd.xla_bridge.export import (
  ExportedValue,
  XlaExport,
  XlaLoweringError,
  export_per_replica,
)
from tf_gspmd.xla_bridge.hlo import (
  GraphCollective,
  HloCollective,
  graph_collectives,
  hlo_collectives,
  per_partition_hlo,
  stablehlo_collectives,
)
from tf_gspmd.xla_bridge.native import NativeCollectives
from tf_gspmd.xla_bridge.pjrt import PjrtExecutable, XlaShardedVariable, jax_devices

__all__ = [
  'GraphCollective',
  'HloCollective',
  'ExportedValue',
  'NativeCollectives',
  'PjrtExecutable',
  'XlaCollectives',
  'XlaExport',
  'XlaLoweringError',
  'XlaShardedVariable',
  'export_per_replica',
  'graph_collectives',
  'hlo_collectives',
  'jax_devices',
  'per_partition_hlo',
  'stablehlo_collectives',
]
