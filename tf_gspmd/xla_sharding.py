"""`tg.xla_sharding`: TF's `xla_sharding` annotation functions, one to one by name.

TF writes shardings with `tensorflow.python.compiler.xla.experimental.xla_sharding`;
these are the same functions on tf_gspmd's side (they write the same `XlaSharding`
ops, which tf_gspmd and XLA read alike), for code moving over from TF's module.
TF's names this module has no counterpart for, and what to use instead:
`get_tensor_sharding` / `get_op_sharding` (`tg.get_sharding`), `copy_sharding`
(`tg.shard(y, tg.get_sharding(x))`), `auto_to_manual_spmd_partition` /
`manual_to_auto_spmd_partition` (`tg.shard_map`). tf_gspmd's own way to annotate is
`tg.shard(x, mesh, P(...))`.

>>> x = tg.xla_sharding.split(x, split_dimension=0, num_devices=8)      # doctest: +SKIP
"""

from tf_gspmd.annotations import (
  assign_device,
  mesh_split,
  mesh_split_sharding,
  partial_tile,
  replicate,
  split,
  tile,
)

__all__ = [
  'assign_device',
  'mesh_split',
  'mesh_split_sharding',
  'partial_tile',
  'replicate',
  'split',
  'tile',
]
