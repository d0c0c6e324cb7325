"""tf_gspmd: GSPMD for TensorFlow.

Value types (`Mesh`, `P`, `Sharding`, `NamedSharding`), `OpSharding`
conversion, and the annotation API (`shard`, `mesh_split`, `shard_variable`,
`get_sharding`, ...) that later stages read from captured graphs.
`tg.saved_model` exports partitioned programs (SavedModel signatures, XLA modules).

TF DTensor users keep their `tf.experimental.dtensor.Mesh` and `Layout`: every
entry point taking a mesh or sharding takes them, and `from_dtensor_mesh` /
`from_dtensor_layout` convert them explicitly.

>>> layout = dtensor.Layout.batch_sharded(dtensor_mesh, 'batch', rank=2)  # doctest: +SKIP
>>> from_dtensor_layout(layout)                                             # doctest: +SKIP
NamedSharding(Mesh.create((2, 4), ('batch', 'model')), P('batch', None))
"""

# First: a missing or unsupported TensorFlow says what to install (imported for that check).
from tf_gspmd import (
  _tf_version,  # noqa: F401
  keras,  # keras.distribution on TF: changes nothing until keras.enable()
)
from tf_gspmd.annotations import (
  annotate,
  assign_device,
  get_sharding,
  mesh_split,
  mesh_split_sharding,
  partial_tile,
  replicate,
  shard,
  shard_variable,
  split,
  tile,
  variable_sharding,
)
from tf_gspmd.auto_shard import auto_shard
from tf_gspmd.dtensor_compat import from_dtensor_layout, from_dtensor_mesh
from tf_gspmd.export import saved_model  # tg.saved_model.save / load, save_xla / load_xla
from tf_gspmd.export.checkpoint import restore_checkpoint, save_checkpoint
from tf_gspmd.graph.capture import capture
from tf_gspmd.graph.rebuild import rebuild
from tf_gspmd.graph_rewrite.reshard import plan_reshard
from tf_gspmd.keras.fit import partition_model, unpartition_model
from tf_gspmd.keras.layout import LayoutMap
from tf_gspmd.mesh import Mesh
from tf_gspmd.op_sharding import from_proto, to_proto
from tf_gspmd.partitioned import (
  PartitionedFunction,
  Variable,
  VariableStore,
  partition,
  sharded_variables,
)
from tf_gspmd.pictures import visualize
from tf_gspmd.pipeline import bubble_fraction as pipeline_bubble_fraction
from tf_gspmd.pipeline import pipeline
from tf_gspmd.planning import PlanReport, abstract_variable, plan
from tf_gspmd.propagation.api import Plan, propagate
from tf_gspmd.runtime import CollectiveError, ShardedValue, ShardedVariable, SpmdProgram
from tf_gspmd.shard_map import (
  all_gather,
  all_to_all,
  axis_index,
  ppermute,
  psum,
  psum_scatter,
  shard_map,
)
from tf_gspmd.sharding import NamedSharding, P, Sharding, named, named_for_rank

__all__ = [
  'keras',
  'saved_model',
  'partition',
  'PartitionedFunction',
  'Variable',
  'VariableStore',
  'sharded_variables',
  'LayoutMap',
  'partition_model',
  'unpartition_model',
  'Plan',
  'propagate',
  'plan',
  'PlanReport',
  'abstract_variable',
  'capture',
  'rebuild',
  'plan_reshard',
  'CollectiveError',
  'ShardedValue',
  'ShardedVariable',
  'SpmdProgram',
  'Mesh',
  'P',
  'Sharding',
  'NamedSharding',
  'named',
  'named_for_rank',
  'from_proto',
  'to_proto',
  'annotate',
  'shard',
  'mesh_split',
  'mesh_split_sharding',
  'split',
  'tile',
  'partial_tile',
  'replicate',
  'assign_device',
  'shard_variable',
  'variable_sharding',
  'get_sharding',
  'save_checkpoint',
  'restore_checkpoint',
  'pipeline',
  'pipeline_bubble_fraction',
  'from_dtensor_layout',
  'from_dtensor_mesh',
  'auto_shard',
  'visualize',
  'shard_map',
  'psum',
  'all_gather',
  'psum_scatter',
  'all_to_all',
  'ppermute',
  'axis_index',
]
