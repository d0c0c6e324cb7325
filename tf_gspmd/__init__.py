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
  auto_shard,  # the package, callable: tg.auto_shard(fn, ...) runs the search
  keras,  # keras.distribution on TF: changes nothing until keras.enable()
  xla_sharding,  # noqa: F401 (tg.xla_sharding; not in __all__, see there)
)
from tf_gspmd.annotations import get_sharding, shard, shard_variable
from tf_gspmd.dtensor_compat import from_dtensor_layout, from_dtensor_mesh
from tf_gspmd.errors import Unsupported
from tf_gspmd.export import saved_model  # tg.saved_model.save / load, save_xla / load_xla
from tf_gspmd.export.checkpoint import restore_checkpoint, save_checkpoint
from tf_gspmd.keras.fit import partition_model, unpartition_model
from tf_gspmd.keras.layout import LayoutMap
from tf_gspmd.mesh import Mesh
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
from tf_gspmd.program.held import SplitVariable
from tf_gspmd.propagation.api import Propagation, propagate
from tf_gspmd.runtime import CollectiveError, ShardedValue, ShardedVariable
from tf_gspmd.runtime.cpu_devices import configure_cpu_devices
from tf_gspmd.shard_map import (
  all_gather,
  all_to_all,
  axis_index,
  ppermute,
  psum,
  psum_scatter,
  shard_map,
)
from tf_gspmd.sharding import NamedSharding, P, Sharding
from tf_gspmd.step_cost import TPU_V3, HardwareProfile, StepTime

# `tg.xla_sharding` is reached by name, not star-imported: `from tf_gspmd import *` leaves a
# module's own `xla_sharding` (TF's) as it was.
__all__ = [
  'keras',
  'saved_model',
  'partition',
  'PartitionedFunction',
  'Variable',
  'SplitVariable',
  'VariableStore',
  'sharded_variables',
  'LayoutMap',
  'partition_model',
  'unpartition_model',
  'Propagation',
  'propagate',
  'plan',
  'PlanReport',
  'abstract_variable',
  'HardwareProfile',
  'TPU_V3',
  'StepTime',
  'CollectiveError',
  'configure_cpu_devices',
  'Unsupported',
  'ShardedValue',
  'ShardedVariable',
  'Mesh',
  'P',
  'Sharding',
  'NamedSharding',
  'shard',
  'shard_variable',
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

# Names kept one release for code written against them, each with the one to use instead:
# TF's xla_sharding names live in `tg.xla_sharding`; internals of one stage in their module;
# `Plan` is `Propagation` and `plan_reshard` is `route_reshard` ("plan" is `tg.plan`'s word
# alone). (module, attribute, what to use instead) of each.
_DEPRECATED = {
  'annotate': ('tf_gspmd.annotations', 'annotate', 'tg.shard(x, sharding)'),
  'variable_sharding': ('tf_gspmd.annotations', 'variable_sharding', 'tg.get_sharding(variable)'),
  'Plan': ('tf_gspmd.propagation.api', 'Propagation', 'tg.Propagation'),
  'plan_reshard': (
    'tf_gspmd.graph_rewrite.reshard',
    'route_reshard',
    'tf_gspmd.graph_rewrite.reshard.route_reshard',
  ),
}
for _module, _names in [
  ('xla_sharding', xla_sharding.__all__),
  ('sharding', ['named', 'named_for_rank']),
  ('op_sharding', ['from_proto', 'to_proto']),
  ('graph.capture', ['capture']),
  ('graph.rebuild', ['rebuild']),
  ('runtime', ['SpmdProgram']),
]:
  _home = 'tg.xla_sharding' if _module == 'xla_sharding' else f'tf_gspmd.{_module}'
  for _name in _names:
    _DEPRECATED[_name] = (f'tf_gspmd.{_module}', _name, f'{_home}.{_name}')
del _module, _names, _home, _name


def __getattr__(name: str):
  """A deprecated name: the object it named, with a DeprecationWarning saying what to use."""
  if name not in _DEPRECATED:
    raise AttributeError(f'module {__name__!r} has no attribute {name!r}')
  import importlib
  import warnings

  module, attr, instead = _DEPRECATED[name]
  warnings.warn(
    f'tf_gspmd.{name} is deprecated and goes in the next release; use {instead}.',
    DeprecationWarning,
    stacklevel=2,
  )
  return getattr(importlib.import_module(module), attr)
