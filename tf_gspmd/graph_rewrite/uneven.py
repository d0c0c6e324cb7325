"""Uneven shapes: masks for the padding of ceil-sized shards.

A dim of size n split k ways is held as k shards of ceil(n/k) rows; the last
shards hold fewer real rows (possibly none), the rest is padding. Padding is
harmless for elementwise work but must be replaced by the identity of any
reduction that crosses it. The offset of this partition's shard comes from a
constant table indexed by the partition id (a mesh device id), so the
program stays the same for every partition.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np
import tensorflow as tf

from tf_gspmd.sharding import NamedSharding

# Identity of each reduction, used to fill padding before it.
_IDENTITY = {'sum': 0, 'mean': 0, 'prod': 1}


def identity_value(reduction: str, dtype: tf.DType):
  """The value that leaves `reduction` unchanged, for `dtype`."""
  if reduction in _IDENTITY:
    return _IDENTITY[reduction]
  if reduction == 'max':
    return dtype.min if not dtype.is_floating else -np.inf
  if reduction == 'min':
    return dtype.max if not dtype.is_floating else np.inf
  if reduction in ('all',):
    return True
  if reduction in ('any',):
    return False
  raise ValueError(f'No identity known for reduction {reduction!r}.')


def is_padded(sharding: NamedSharding, global_shape: Sequence[int], dim: int) -> bool:
  """Whether shards of `dim` carry padding (the dim does not divide evenly)."""
  tiles = sharding.tile_shape[dim]
  return tiles > 1 and global_shape[dim] % tiles != 0


def offset_table(sharding: NamedSharding, global_shape: Sequence[int], dim: int) -> np.ndarray:
  """Start of each partition's shard along `dim`, indexed by partition id."""
  devices = sharding.mesh.devices
  table = np.zeros(max(devices) + 1, dtype=np.int32)
  for d in devices:
    table[d] = sharding.shard_bounds(global_shape, d)[dim][0]
  return table


def shard_offset(
  sharding: NamedSharding, global_shape: Sequence[int], dim: int, partition_id: tf.Tensor
) -> tf.Tensor:
  """This partition's shard start along `dim` (int32 scalar tensor)."""
  table = tf.constant(offset_table(sharding, global_shape, dim), name=f'offsets_dim{dim}')
  return tf.gather(table, partition_id)


def valid_mask(
  sharding: NamedSharding,
  global_shape: Sequence[int],
  dim: int,
  local_size: int,
  partition_id: tf.Tensor,
  rank: int,
) -> tf.Tensor:
  """Bool tensor broadcastable to the local shard: True on real rows of `dim`."""
  offset = shard_offset(sharding, global_shape, dim, partition_id)
  rows = tf.range(local_size, dtype=tf.int32) + offset
  shape = [1] * rank
  shape[dim] = local_size
  return tf.reshape(rows < global_shape[dim], shape)


def mask_padding(
  x: tf.Tensor,
  sharding: NamedSharding,
  global_shape: Sequence[int],
  dims: Iterable[int],
  fill,
  partition_id: tf.Tensor,
) -> tf.Tensor:
  """`x` with the padding of every padded dim in `dims` replaced by `fill`.

  Emits nothing for dims that divide evenly.
  """
  dims = [d for d in dims if is_padded(sharding, global_shape, d)]
  if not dims:
    return x
  rank = len(global_shape)
  valid = None
  for d in dims:
    m = valid_mask(sharding, global_shape, d, int(x.shape[d]), partition_id, rank)
    valid = m if valid is None else tf.logical_and(valid, m)
  fill_value = (
    tf.cast(tf.constant(fill), x.dtype) if x.dtype != tf.bool else tf.constant(bool(fill))
  )
  return tf.where(valid, x, tf.broadcast_to(fill_value, tf.shape(x)))
