"""The per-partition program contract both backends stand on.

A per-partition program is one `tf.function` traced once for all partitions:
`fn(ctx, *local_args)` written for one partition, talking to the others through
`ctx.collectives` (a `Collectives`). This package says how it is traced and what the
trace holds (`trace_per_partition`, `PerPartitionProgram`, `PartitionContext`),
independent of who runs it: the TF runtime (`tf_gspmd.runtime`, collective ops on TF
devices) and the XLA bridge (`tf_gspmd.xla_bridge`, XLA's collectives) each give it a
`Backend` and run the result their own way.
"""

from tf_gspmd.program.contract import (
  PARTITION_ID_SPEC,
  TOKEN_SPEC,
  Backend,
  PartitionContext,
  PerPartitionProgram,
  trace_per_partition,
)

__all__ = [
  'PARTITION_ID_SPEC',
  'TOKEN_SPEC',
  'Backend',
  'PartitionContext',
  'PerPartitionProgram',
  'trace_per_partition',
]
