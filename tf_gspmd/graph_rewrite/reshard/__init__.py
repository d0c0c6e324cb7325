"""The reshard planner: which steps turn one sharding of a tensor into another (no TensorFlow).

- `geometry`: uneven per-dim geometry and the local ops steps share;
- `moves` and `exchange`: one class per kind of step, with its effect on the
  search state, its cost and the data its lowering needs;
- `plan`: `ReshardPlan`, the steps of one reshard and their costs;
- `search`: `plan_reshard`, the search for the cheapest plan;
- `sim`: a numpy simulator of plans, the executable specification of every step.

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
from tf_gspmd.graph_rewrite.reshard.plan import ReshardPlan, collective_count
from tf_gspmd.graph_rewrite.reshard.search import (
  MOVE_KINDS,
  naive_plan,
  plan_reshard,
  reorder_pairs,
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
  'ReshardPlan',
  'Slice',
  'canonical_levels',
  'collective_count',
  'naive_plan',
  'normalize_levels',
  'pad_dim',
  'plan_reshard',
  'refined_mesh',
  'regroup_blocks',
  'reorder_pairs',
  'same_geometry',
  'shard_intervals',
  'slice_window',
  'split_trailing',
]
