"""Keras' private API, used by tf_gspmd in this one module.

Each private import or attribute below says why no public Keras API serves;
tests/test_private_api.py fails on a `keras.src` import or a read of these
attributes anywhere else in tf_gspmd. The rest of tf_gspmd.keras reaches Keras'
internals through the functions here:

* `backing(v)`: the tf.Variable behind a Keras variable (a captured graph, a
  variable store and a checkpoint all refer to it);
* `layout_of` / `set_layout`: the layout a Keras variable carries;
* `layout_map_of(distribution)`, `distribute_strategy_of(model)`;
* `patch` / `unpatch`: put tf_gspmd's functions into Keras' TF backend
  (its `distribution_lib`, the variable constructor, the trainer's entry
  points) and take them out again; `tf_gspmd.keras.distribution_lib` says what
  they do.

Importing this module registers `backing` with `tf_gspmd.annotations`, which sits
below Keras and so imports none of it (`annotations.register_variable_unwrapper`).
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Tuple

import keras
import tensorflow as tf

# Private: whether Keras is inferring output shapes in a scratch graph it never runs
# (`compute_output_spec`, the functional API's symbolic calls); no public API says so. A split
# variable read there needs its shape only (program.held.register_shape_only_graph).
from keras.src.backend.common.symbolic_scope import in_symbolic_scope

# Private: the base class of every Keras variable, whose constructor is where
# Keras (on JAX) gives a variable its layout; `keras.Variable` is the TF backend's subclass,
# patching its base reaches every backend's variables as Keras' own code sees them.
from keras.src.backend.common.variables import Variable as KerasVariable

# Private: the TF backend's distribution module, which Keras' public
# `keras.distribution` functions and `Layer.__call__` dispatch to.
from keras.src.backend.tensorflow import distribution_lib as tf_distribution_lib

# Private: the TF backend's variable class (`keras.Variable` is its public alias only when
# the backend is TF). Its SavedModel children are its own, none: one whose value is a
# SplitVariable must also export the shard variables its traced reads capture
# (`_trackable_children` is TF's trackable protocol, which Keras does not expose).
from keras.src.backend.tensorflow.core import Variable as KerasTFVariable

# Private: the class keras.Model's training entry points live on under the TF backend.
from keras.src.backend.tensorflow.trainer import TensorFlowTrainer

from tf_gspmd import annotations
from tf_gspmd.program import held

# The trainer methods `patch` wraps: every public way into a model's steps.
ENTRY_POINTS = (
  'fit',
  'evaluate',
  'predict',
  'train_on_batch',
  'test_on_batch',
  'predict_on_batch',
)

# The functions `patch` puts into the TF backend's distribution_lib: their names there. The
# last two are private: Keras converts its DeviceMesh and TensorLayout with them.
_BACKEND_NAMES = {
  'distribute_tensor': 'distribute_tensor',
  'get_device_count': 'get_device_count',
  'initialize': 'initialize',
  'to_backend_mesh': '_to_backend_mesh',
  'to_backend_layout': '_to_backend_layout',
}

_MISSING = object()
# (owner, attribute name, value before patch or _MISSING), in patch order.
_saved: List[Tuple[object, str, object]] = []


# --- Keras variables ------------------------------------------------------------------------
def backing(variable):
  """The tf.Variable behind a Keras variable (None until it is built); anything else as it is.

  Keras keeps it as the private `_value`: the public `.value` goes through autocasting (a
  cast tensor inside a mixed-precision layer) and builds a deferred variable.
  """
  if isinstance(variable, KerasVariable):
    return variable._value  # noqa: SLF001
  return variable


def _built_tf_variable(value):
  """For annotations: the tf.Variable of a built Keras variable; None for a non-Keras value."""
  if not isinstance(value, KerasVariable):
    return None
  inner = backing(value)
  if isinstance(inner, tf.Variable):
    return inner
  raise ValueError(
    f'Keras variable {value.path} is not created yet (deferred initialization); build the '
    'layer or model before annotating its variables.'
  )


annotations.register_variable_unwrapper(_built_tf_variable)


def _building_keras_scratch_graph() -> bool:
  """Whether the graph being built is Keras' shape-inference scratch graph itself. Not a
  `tf.function` traced inside it: TF keeps that trace and a later call of the same function
  would reuse it, so its reads must read the variable. Keras names the graph
  `scratch_graph...` (`compute_output_spec`; private, as the scope is)."""
  return in_symbolic_scope() and tf.compat.v1.get_default_graph().name.startswith('scratch_graph')


held.register_shape_only_graph(_building_keras_scratch_graph)


def _with_saved_model_children(original):
  """`_trackable_children` of a Keras variable, plus, in a SavedModel, its value's own (a
  SplitVariable's shard variables: `saved_model_children`)."""

  def children(self, save_type='checkpoint', **kwargs):
    found = original(self, save_type, **kwargs)
    extra = getattr(backing(self), 'saved_model_children', None)
    if extra is None or str(getattr(save_type, 'value', save_type)) != 'savedmodel':
      return found
    return dict(found, **extra())

  return children


# Permanent, not in `patch`: a SplitVariable outlives tg.keras.disable(), and exports then too.
KerasTFVariable._trackable_children = _with_saved_model_children(  # noqa: SLF001
  KerasTFVariable._trackable_children  # noqa: SLF001
)


def layout_of(variable):
  """The layout a Keras variable was given (Keras' private `_layout`, which its optimizer copies
  onto the slots it makes); None when it has none. Keras has no public accessor."""
  return getattr(variable, '_layout', None)


def set_layout(variable, layout) -> None:
  """Give a Keras variable its layout where Keras' JAX backend keeps it (`_layout`)."""
  variable._layout = layout  # noqa: SLF001


def layout_map_of(distribution):
  """A distribution's LayoutMap: ModelParallel keeps it as `_layout_map`, with no public
  accessor; None for distributions without one."""
  return getattr(distribution, '_layout_map', None)


def distribute_strategy_of(model):
  """The tf.distribute strategy a model was built in: where TensorFlowTrainer.__init__ records
  it (`_distribute_strategy`, no public accessor); None when there is none."""
  return getattr(model, '_distribute_strategy', None)


# --- patching Keras' TF backend ---------------------------------------------------------------
def _replace(owner, name, value) -> None:
  # A class's own attribute (not an inherited one), so unpatch puts back exactly what was there.
  if isinstance(owner, type):
    before = owner.__dict__.get(name, _MISSING)
  else:
    before = getattr(owner, name, _MISSING)
  _saved.append((owner, name, before))
  setattr(owner, name, value)


def patch(
  backend_functions: Dict[str, Callable],
  wrap_variable_init: Callable,
  wrap_entry_point: Callable,
  wrap_device_mesh_init: Callable,
) -> None:
  """Put tf_gspmd into Keras' TF backend (`unpatch` takes it out):

  * `backend_functions` into its `distribution_lib`, under the names of `_BACKEND_NAMES`;
  * `wrap_variable_init(original)` as every Keras variable's `__init__`;
  * `wrap_entry_point(name, original)` as each of `ENTRY_POINTS` on the trainer;
  * `wrap_device_mesh_init(original)` as the public `keras.distribution.DeviceMesh`'s
    `__init__` (its own refusal of too few devices does not say how TF makes more).
  """
  for name, function in backend_functions.items():
    _replace(tf_distribution_lib, _BACKEND_NAMES[name], function)
  _replace(KerasVariable, '__init__', wrap_variable_init(KerasVariable.__init__))
  mesh_class = keras.distribution.DeviceMesh
  _replace(mesh_class, '__init__', wrap_device_mesh_init(mesh_class.__init__))
  for name in ENTRY_POINTS:
    _replace(TensorFlowTrainer, name, wrap_entry_point(name, TensorFlowTrainer.__dict__[name]))


def patched() -> bool:
  return bool(_saved)


def unpatch() -> None:
  """Put back every attribute `patch` replaced, in reverse order."""
  while _saved:
    owner, name, value = _saved.pop()
    if value is _MISSING:
      delattr(owner, name)
    else:
      setattr(owner, name, value)


def backend_module():
  """The module Keras' distribution API dispatches to (for tests and explanations)."""
  return tf_distribution_lib


def original_entry_point(name: str) -> Optional[object]:
  """Keras' own `TensorFlowTrainer.<name>` as saved by patch (None when not patched)."""
  for owner, saved_name, value in _saved:
    if owner is TensorFlowTrainer and saved_name == name:
      return value
  return None
