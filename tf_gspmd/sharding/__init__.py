"""Sharding value types: `P` (a partition spec), `Sharding` and `NamedSharding`.

- `spec`: `P`;
- `core`: `Sharding` (anything XLA's `OpSharding` can say, plus pending reductions),
  its subgroup kinds and `shard_bounds`;
- `named`: `NamedSharding`, a sharding written as a spec on a named mesh;
- `reorder`: `named` / `named_for_rank`, any sharding as a spec on a mesh (or on a
  reordering of its devices), found by search.

`==` and `hash` are structural (how a sharding is written); `is_equivalent_to` compares
meaning (which device holds which piece).
"""

from tf_gspmd.sharding.core import (
  MANUAL,
  PARTIAL_PREFIX,
  REDUCTIONS,
  REPLICATED,
  SUBGROUP_KINDS,
  Sharding,
  num_shards,
  shard_bounds,
)
from tf_gspmd.sharding.named import NamedSharding
from tf_gspmd.sharding.reorder import named, named_for_rank
from tf_gspmd.sharding.spec import P

__all__ = [
  'MANUAL',
  'PARTIAL_PREFIX',
  'REDUCTIONS',
  'REPLICATED',
  'SUBGROUP_KINDS',
  'NamedSharding',
  'P',
  'Sharding',
  'named',
  'named_for_rank',
  'num_shards',
  'shard_bounds',
]
