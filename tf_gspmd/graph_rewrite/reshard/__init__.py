"""The reshard search: which steps turn one sharding of a tensor into another (no TensorFlow).

- `geometry`: uneven per-dim geometry and the local ops steps share;
- `moves` and `exchange`: one class per kind of step, with its effect on the
  search state, its cost and the data its lowering needs;
- `route`: `ReshardRoute`, the steps of one reshard and their costs;
- `search`: `route_reshard`, the search for the cheapest route;
- `sim`: a numpy simulator of routes, the executable specification of every step.

`graph_rewrite.lower_reshard` is the one module that turns steps into TF ops.
"""

from tf_gspmd.graph_rewrite.reshard.exchange import Permute, Repad, RepadRound
from tf_gspmd.graph_rewrite.reshard.geometry import (
  canonical_levels,
  normalize_levels,
  pad_dim,
  refined_mesh,
  regroup_blocks,
  same_geometry,
  shard_intervals,
  slice_window,
  split_trailing,
)
from tf_gspmd.graph_rewrite.reshard.moves import (
  AllGather,
  AllReduce,
  AllToAll,
  ReduceScatter,
  Slice,
)
from tf_gspmd.graph_rewrite.reshard.route import ReshardRoute, collective_count
from tf_gspmd.graph_rewrite.reshard.search import (
  MOVE_KINDS,
  naive_route,
  reorder_pairs,
  route_reshard,
)

STEP_TYPES = (Slice, AllGather, AllToAll, ReduceScatter, AllReduce, Permute, Repad)

__all__ = [
  'MOVE_KINDS',
  'STEP_TYPES',
  'AllGather',
  'AllReduce',
  'AllToAll',
  'Permute',
  'ReduceScatter',
  'Repad',
  'RepadRound',
  'ReshardRoute',
  'Slice',
  'canonical_levels',
  'collective_count',
  'naive_route',
  'normalize_levels',
  'pad_dim',
  'refined_mesh',
  'regroup_blocks',
  'reorder_pairs',
  'route_reshard',
  'same_geometry',
  'shard_intervals',
  'slice_window',
  'split_trailing',
]
