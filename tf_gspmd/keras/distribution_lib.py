"""What Keras 3's TF backend lacks for `keras.distribution`, supplied by tf_gspmd.

Keras' distribution API (`keras.distribution`) is backend independent; what
a backend supplies is (a) the functions of its `distribution_lib` module,
(b) a variable layout chosen when a variable is created under a
distribution, and (c) a trainer that runs steps distributed. Keras' TF
backend has only a prototype of (a) and neither (b) nor (c). `install()`
provides all three (through `tf_gspmd.keras.hooks`, the module on Keras' private
API), `uninstall()` puts every replaced attribute back:

(a) `keras.src.backend.tensorflow.distribution_lib` gains `distribute_tensor`
    (a tf_gspmd annotation), `get_device_count`, `initialize`, and
    `_to_backend_mesh`/`_to_backend_layout` giving tf_gspmd objects instead of
    DTensor ones. Keras' layers call `distribute_tensor` through it for the
    layout map's `<layer path>/output` entries and for user calls of
    `keras.distribution.distribute_tensor`.
(b) `KerasVariable.__init__` records `distribution.get_variable_layout(v)`
    as the variable's `_layout` (what Keras' JAX variables do), so an
    optimizer slot made from it inherits it (Keras' optimizer copies `_layout`).
(c) `TensorFlowTrainer.fit/evaluate/predict/*_on_batch` first make the model
    partitioned (`tf_gspmd.partition_model`) when a distribution applies to it.
(d) `DeviceMesh` refusing a shape the devices do not fill says how to configure
    logical devices.
"""

from __future__ import annotations

import functools
import math
import re
from typing import Dict, List, Tuple

import keras
import tensorflow as tf

from tf_gspmd.annotations import annotate, shard_variable
from tf_gspmd.keras import hooks, translate
from tf_gspmd.keras.fit import layer_paths, partition_model
from tf_gspmd.keras.layout import warn_unused
from tf_gspmd.keras.strategy import strategy_of
from tf_gspmd.partitioned import Variable, executors
from tf_gspmd.partitioned.variables import making_shards
from tf_gspmd.sharding import NamedSharding

# Attributes tf_gspmd sets: on a Keras variable, the distribution it was made
# under; on a model, the distribution its steps are partitioned for.
_MADE_UNDER = '_tf_gspmd_distribution'
_PARTITIONED_FOR = '_tf_gspmd_distribution'

_STEP_FACTORIES = ('make_train_function', 'make_test_function', 'make_predict_function')

# The backend partitioned models run on (a name of `executors.EXECUTORS`: TF devices and
# collectives by default); set by install().
_backend = [executors.DEFAULT]


# --- (a) the backend's distribution_lib -------------------------------------------------
def distribute_tensor(tensor, layout):
  """Annotate `tensor` with `layout` (a TensorLayout or a tf_gspmd NamedSharding).

  Inside a step tf_gspmd partitions this is a sharding annotation the
  propagation honours; eagerly there is no program to lay out and the value
  (a global value) is returned as it is; so is a tensor given a layout
  without a mesh while no distribution is set (the same layer code then runs
  whole, as plain Keras).
  """
  if isinstance(layout, NamedSharding):
    return annotate(tensor, layout)
  current = keras.distribution.distribution()
  if current is None and getattr(layout, 'device_mesh', None) is None:
    return tensor  # no distribution, no mesh: the model runs whole, nothing to lay out
  sharding = translate.to_sharding(layout, getattr(current, 'device_mesh', None))
  return annotate(tensor, sharding)


def get_device_count(device_type=None) -> int:
  return len(keras.distribution.list_devices(device_type))


def initialize(job_addresses=None, num_processes=None, process_id=None):
  """One process needs no set-up; several processes are not supported by tf_gspmd's launcher."""
  if (num_processes or 1) > 1:
    raise NotImplementedError(
      f'keras.distribution.initialize: tf_gspmd runs one process over its local devices; '
      f'got num_processes={num_processes} (job_addresses={job_addresses!r}, '
      f'process_id={process_id}).'
    )


def _device_mesh_init(original):
  """`DeviceMesh.__init__`, whose refusal of a shape the devices do not fill says how to
  configure logical devices (Keras' own says only that the counts differ)."""

  @functools.wraps(original)
  def init(self, shape, axis_names, devices=None):
    try:
      original(self, shape, axis_names, devices)
    except ValueError as error:
      if devices is not None or 'does not match the number of devices' not in str(error):
        raise
      raise ValueError(f'{_too_few_devices(shape)} (Keras: {error})') from error

  return init


def _too_few_devices(shape) -> str:
  needed, found = math.prod(shape), keras.distribution.list_devices()
  return (
    f'keras.distribution.DeviceMesh(shape={tuple(shape)}) needs {needed} devices; this process '
    f'has {len(found)} ({", ".join(map(str, found[:4]))}{" ..." if len(found) > 4 else ""}). '
    f'On CPU, split it into {needed} logical devices before TensorFlow starts (before any '
    'op runs): tf.config.set_logical_device_configuration('
    'tf.config.list_physical_devices("CPU")[0], '
    f'[tf.config.LogicalDeviceConfiguration()] * {needed}). Otherwise give a shape whose '
    'product is the number of devices, or pass devices=.'
  )


def _backend_mesh(device_mesh):
  return translate.to_mesh(device_mesh)


def _backend_layout(tensor_layout):
  return translate.to_sharding(tensor_layout)


_BACKEND_FUNCTIONS = {
  'distribute_tensor': distribute_tensor,
  'get_device_count': get_device_count,
  'initialize': initialize,
  'to_backend_mesh': _backend_mesh,
  'to_backend_layout': _backend_layout,
}


# --- (b) variable layouts at creation -----------------------------------------------------
def _variable_init(original):
  @functools.wraps(original)
  def init(self, *args, **kwargs):
    # An optimizer slot takes its variable's layout (Keras passes it): made under the
    # distribution that variable was made under, even when none is current now.
    current = keras.distribution.distribution() or getattr(kwargs.get('layout'), _MADE_UNDER, None)
    if current is None:
      original(self, *args, **kwargs)
      return
    # Keras makes its tf.Variable inside __init__ (`_initialize`): made there as shards when
    # its layout splits it, so its whole value never lives on a device.
    with tf.variable_creator_scope(functools.partial(_as_shards, self, current)):
      original(self, *args, **kwargs)
    _record_layout(self, current)
    setattr(self, _MADE_UNDER, current)
    _remember(hooks.layout_of(self), current)
    if hooks.backing(self) is not None:
      # Made inside a step being captured (optimizer slots, metric state): annotated now,
      # before the capture reads it; otherwise the step would give it a layout of its own.
      shard_variable(self, _sharding_of(self, current))

  return init


def _remember(layout, distribution) -> None:
  """Tag `layout` with the distribution it was given under (its slots are made under it)."""
  try:
    setattr(layout, _MADE_UNDER, distribution)
  except AttributeError:  # a layout that takes no attributes (None, a tuple): nothing to find
    pass


def _as_shards(variable, distribution, next_creator, **kwargs):
  """The tf.Variable behind Keras variable `variable`, made as shards of its layout (a
  `SplitVariable`, by `tg.Variable`: its initial value computed on the host, split, dropped)."""
  if making_shards() or tf.inside_function() or kwargs.get('initial_value') is None:
    return next_creator(**kwargs)  # made while a step is traced: annotated below instead
  if not _shape_known(variable):
    return next_creator(**kwargs)  # made from a value (a counter, a constant): its own shape
  _record_layout(variable, distribution)
  sharding = _sharding_of(variable, distribution)
  # Replicated ones too: their copies on the devices are their one state (a plain variable
  # would be copied into them and back at every step).
  _, devices = translate.mesh_and_devices(distribution.device_mesh)
  devices = executors.get(_backend[0]).devices_named(devices)
  return Variable(
    kwargs['initial_value'],
    sharding,
    name=kwargs.get('name'),
    trainable=kwargs.get('trainable', True) is not False,
    dtype=kwargs.get('dtype'),
    backend=_backend[0],
    devices=devices,
    shape=tuple(variable.shape),
  )


def _shape_known(variable) -> bool:
  """Keras knows a variable's shape before making it from an initializer, not from a value."""
  try:
    return variable.shape.rank is not None if hasattr(variable.shape, 'rank') else True
  except ValueError:
    return False


# --- (c) partitioned steps ------------------------------------------------------------------
def distribution_of(model):
  """The distribution `model`'s steps run under.

  The current one, else the one its variables were made under.
  """
  current = keras.distribution.distribution()
  if current is not None:
    return current
  for variable in model.variables:
    made_under = getattr(variable, _MADE_UNDER, None)
    if made_under is not None:
      return made_under
  return None


def _layout_of(variable, distribution):
  """The one place a Keras variable's layout is decided: the layout it was given (Keras
  passes an optimizer slot its variable's), else the distribution's rule for its path."""
  layout = hooks.layout_of(variable)
  return distribution.get_variable_layout(variable) if layout is None else layout


def _record_layout(variable, distribution) -> None:
  """Give `variable` its layout (`_layout_of`), where Keras reads it back from (a slot made
  from it takes it)."""
  if hooks.layout_of(variable) is None:
    hooks.set_layout(variable, _layout_of(variable, distribution))


def _give_layouts(variables, distribution) -> None:
  """Give variables made outside any distribution the layout Keras' rules give them now."""
  for variable in variables:
    _record_layout(variable, distribution)


def all_variables(model) -> list:
  """The model's, its optimizer's and its metrics' variables, each once."""
  found: Dict[int, object] = {}
  groups = [model.variables]
  if getattr(model, 'optimizer', None) is not None:
    groups.append(model.optimizer.variables)
  groups.extend(m.variables for m in model.metrics)
  for group in groups:
    for variable in group:
      found.setdefault(id(variable), variable)
  return list(found.values())


def _sharding_of(variable, distribution) -> NamedSharding:
  """The NamedSharding of `variable`'s Keras layout.

  A layout without a mesh takes the distribution's.
  """
  layout = _layout_of(variable, distribution)
  if isinstance(layout, NamedSharding):
    return layout
  device_mesh = layout.device_mesh if layout.device_mesh is not None else distribution.device_mesh
  spec = translate.variable_spec(variable, layout)
  try:
    return NamedSharding(translate.to_mesh(device_mesh), spec)
  except ValueError as error:  # an axis used twice: say which variable's layout
    raise ValueError(
      f'keras.distribution: layout {tuple(spec)} for variable {variable.path} of '
      f'shape {tuple(variable.shape)}: {error}'
    ) from None


def annotate_variables(model, distribution) -> List[Tuple[str, object]]:
  """Annotate every variable of `model` with its Keras layout; returns (path, sharding) pairs.

  Variables whose shards a partitioned step already made keep the layout they have.
  """
  store = model.__dict__.get('_tf_gspmd_store')
  applied = []
  for variable in all_variables(model):
    if store is not None and id(hooks.backing(variable)) in store.sharded:
      continue
    sharding = _sharding_of(variable, distribution)
    shard_variable(variable, sharding)
    applied.append((variable.path, sharding))
  return applied


def _annotating(model, distribution, factory):
  """`factory` (a make_*_function) that first annotates every variable, optimizer slots included."""

  @functools.wraps(factory)
  def make(force=False):
    annotate_variables(model, distribution)
    return factory(force)

  return make


def partition_for_distribution(model) -> bool:
  """Partition `model`'s steps for the distribution that applies to it; True if this call did it."""
  distribution = distribution_of(model)
  if distribution is None:
    return False
  done = model.__dict__.get(_PARTITIONED_FOR)
  if '_tf_gspmd_launcher' not in model.__dict__:
    done = None  # tf_gspmd.unpartition_model(model) undid it: partition it again
  backend = _backend[0]
  if done is distribution:
    _check_backend(model, backend)
    return False
  if done is not None:
    raise ValueError(
      f'tf_gspmd.keras: model {model.name} runs partitioned for {done}; it cannot '
      f'switch to {distribution}. Build a new model under the new distribution.'
    )
  _refuse_slots_made_before(model, distribution)
  _warn_unused_keys(model, distribution)
  _give_layouts(model.variables, distribution)  # before fit builds optimizer slots from them
  mesh, devices = translate.mesh_and_devices(distribution.device_mesh)
  # The DeviceMesh's devices, in its order, as the backend's devices.
  devices = executors.get(backend).devices_named(devices)
  # strategy: a tf.distribute scope entered (a TPUStrategy's): its strategy.run runs the steps.
  partition_model(
    model,
    mesh,
    batch_axes=translate.batch_axes(distribution),
    devices=devices,
    backend=backend,
    strategy=strategy_of(model),
  )
  for name in _STEP_FACTORIES:
    setattr(model, name, _annotating(model, distribution, getattr(model, name)))
  model.__dict__[_PARTITIONED_FOR] = distribution
  return True


def _refuse_slots_made_before(model, distribution) -> None:
  """A model trained before the distribution applied has optimizer slots made with no layout:
  they would stay replicated beside a split variable. Refuse, saying how to build it."""
  optimizer = getattr(model, 'optimizer', None)
  slots = [v for v in getattr(optimizer, 'variables', ()) if len(v.shape) > 0]
  if not slots or any(getattr(v, _MADE_UNDER, None) is not None for v in slots):
    return
  for variable in model.trainable_variables:
    layout = _layout_of(variable, distribution)
    spec = translate.to_spec(layout) if not isinstance(layout, NamedSharding) else layout.spec
    if any(entry is not None for entry in spec):
      raise ValueError(
        f'tf_gspmd.keras: model {model.name} was trained before {type(distribution).__name__} '
        f'applied to it: its optimizer made its slots (e.g. {slots[0].path}) with no layout, '
        f'so the slot of {variable.path} would stay replicated while the distribution splits '
        f'{variable.path} as {spec}. Build and compile the model inside `distribution.scope()` '
        '(or after keras.distribution.set_distribution), or compile it again with a new '
        'optimizer before fitting under the distribution.'
      )


def _warn_unused_keys(model, distribution) -> None:
  """Warn for each layout map key that names no variable and no layer output of `model`."""
  layout_map = hooks.layout_map_of(distribution)
  if layout_map is None:
    return
  paths = [v.path for v in all_variables(model)]
  outputs = [f'{path}/output' for path in layer_paths(model)]
  unused = [
    key for key in layout_map if not any(key == p or re.fullmatch(key, p) for p in paths + outputs)
  ]
  warn_unused(unused, paths, 'keras.distribution.LayoutMap')


def _check_backend(model, backend: str) -> None:
  """A model keeps the backend it was partitioned on: refuse a switch, saying what to do."""
  launcher = model.__dict__.get('_tf_gspmd_launcher')
  had = launcher.kwargs.get('backend', executors.DEFAULT) if launcher is not None else backend
  if had != backend:
    raise ValueError(
      f'tf_gspmd.keras: model {model.name} runs partitioned on backend={had!r}, but '
      f'tf_gspmd.keras.enable(backend={backend!r}) is in force. Its variables live on the '
      f"{had!r} backend's devices; call tf_gspmd.unpartition_model(model) first (it copies "
      'the trained values back into the model), then fit again to partition it on the new '
      'backend.'
    )


def _entry_point(name, original):
  @functools.wraps(original)
  def entry(self, *args, **kwargs):
    if partition_for_distribution(self):
      # partition_model may have put its own `name` on the instance (fit, evaluate).
      return getattr(self, name)(*args, **kwargs)
    return original(self, *args, **kwargs)

  return entry


# --- install / uninstall ------------------------------------------------------------------
def installed() -> bool:
  return hooks.patched()


def backend() -> str:
  """The backend models are partitioned on while installed (a name of `executors.NAMES`)."""
  return _backend[0]


def install(backend: str = executors.DEFAULT) -> None:
  executors.get(backend, 'tf_gspmd.keras.enable')  # refuses a name it does not know
  _backend[0] = backend
  if installed():
    return
  keras_backend = keras.backend.backend()
  if keras_backend != 'tensorflow':
    raise RuntimeError(
      f'tf_gspmd.keras.enable: Keras runs the {keras_backend!r} backend; tf_gspmd '
      "implements keras.distribution for 'tensorflow' (set KERAS_BACKEND)."
    )
  hooks.patch(_BACKEND_FUNCTIONS, _variable_init, _entry_point, _device_mesh_init)


def uninstall() -> None:
  _backend[0] = executors.DEFAULT
  hooks.unpatch()
