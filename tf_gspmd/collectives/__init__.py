"""The collective interface a backend implements (`interface`), how values of dtypes the
kernels refuse travel through it (`carriers`), and the partition-id tables it reads (`tables`).

Below the partitioner (which emits collectives through `Collectives`) and above
the value types; the TF runtime and the XLA bridge each implement it.
"""

from tf_gspmd.collectives.interface import (
  DEFAULT_TIMEOUT,
  KINDS,
  CollectiveRecord,
  Collectives,
  merge_leading_into,
  pad_dim,
  slice_dim,
  split_leading_from,
)

__all__ = [
  'DEFAULT_TIMEOUT',
  'KINDS',
  'CollectiveRecord',
  'Collectives',
  'merge_leading_into',
  'pad_dim',
  'slice_dim',
  'split_leading_from',
]
