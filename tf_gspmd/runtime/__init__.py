"""The single-program runtime: one per-partition program run on N TF devices.

Why this is its own package, beside `tf_gspmd.xla_bridge`:

* `runtime` *runs* a partitioned program here and now, on N TensorFlow devices
  of one process (logical CPUs, or GPUs). It owns the per-partition program
  contract (`trace_per_partition`: one `tf.function` of
  `(partition_id, token, *local_shards)`, traced once), the launcher that calls
  it on every device (`SpmdProgram`), the per-device value types
  (`ShardedValue`, `ShardedVariable`), the constant tables indexed by
  partition id, and the collective interface (`Collectives`) with its
  TF-collective backend (`TFCollectives`: collective V2 ops ordered by
  per-device tokens, point-to-point via pairwise send/receive).
* `xla_bridge` is a second *backend* of the same `Collectives` interface that
  emits XLA's collective ops (XlaAllReduce, XlaReduceScatter, AllToAll,
  CollectivePermute) for a TPU compile. Nothing here can execute those ops (they
  are no-ops or missing on CPU), so it is built and inspected as graphs/HLO,
  and it must not be pulled in by, or pull in, the runtime's device plumbing.

The partitioner writes its per-partition program against `Collectives` only,
so the same program lowers to either backend.
"""

from tf_gspmd.runtime.collectives import (
  DEFAULT_TIMEOUT,
  CollectiveRecord,
  Collectives,
  TFCollectives,
)
from tf_gspmd.runtime.launcher import (
  CollectiveError,
  PartitionContext,
  PerPartitionProgram,
  SpmdProgram,
  trace_per_partition,
)
from tf_gspmd.runtime.sharded import ShardedValue, ShardedVariable, assemble, split

__all__ = [
  'CollectiveError',
  'CollectiveRecord',
  'Collectives',
  'DEFAULT_TIMEOUT',
  'PartitionContext',
  'PerPartitionProgram',
  'ShardedValue',
  'ShardedVariable',
  'SpmdProgram',
  'TFCollectives',
  'assemble',
  'split',
  'trace_per_partition',
]
