"""The TF backend: a per-partition program run on N TensorFlow devices of this process.

`runtime` *runs* a partitioned program here and now, on N TensorFlow devices (logical
CPUs, or GPUs; devices of other tasks with `runtime.cluster`). It stands on the
backend-neutral per-partition contract of `tf_gspmd.program` (`trace_per_partition`:
one `tf.function` of `(partition_id, token, *local_shards)` here, traced once) and owns:

* the launcher that calls the program on every device (`SpmdProgram`, `launcher.py`),
  its watchdog (`watchdog.py`) and the Grappler passes run on it (`grappler.py`);
* the per-device value types (`ShardedValue`, `ShardedVariable`, `sharded.py`);
* the TF-collective backend of the `Collectives` interface (`TFCollectives`:
  collective V2 ops ordered by per-device tokens, point-to-point via pairwise
  send/receive, `collectives.py`).

`tf_gspmd.xla_bridge` is the second backend: it emits XLA's collective ops for an XLA
compile of the same program. Its TPU path (`xla_bridge.tpu`) runs on TF's TPU runtime
and so reuses pieces of this one (sharded values, tokens, `without_grappler`); this
package imports nothing of `xla_bridge`.
"""

from tf_gspmd.program import PartitionContext, PerPartitionProgram
from tf_gspmd.runtime.collectives import (
  DEFAULT_TIMEOUT,
  CollectiveRecord,
  Collectives,
  TFCollectives,
)
from tf_gspmd.runtime.errors import CollectiveError
from tf_gspmd.runtime.launcher import SpmdProgram, trace_per_partition
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
