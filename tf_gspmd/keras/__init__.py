"""Keras 3's own `keras.distribution` API on the TensorFlow backend, run by tf_gspmd.

Keras' distribution API (`DeviceMesh`, `TensorLayout`, `LayoutMap`,
`DataParallel`, `ModelParallel`, `set_distribution`, `distribute_tensor`)
runs only on JAX; on TF its backend module is a prototype. After
`tf_gspmd.keras.enable()` the same code runs on TF:

* `keras.distribution.list_devices()` lists the TF devices ('cpu:0', ...) and
  a `DeviceMesh` over them becomes a `tf_gspmd.Mesh` whose device ids run on
  those TF devices;
* a variable made while a distribution is set gets the layout Keras' rules
  give it (`Distribution.get_variable_layout`: the `LayoutMap` entry whose
  regex matches its path, else replicated) and optimizer slots inherit it;
* `keras.distribution.distribute_tensor(x, layout)` and the layout map's
  `'<layer path>/output'` entries annotate activations for tf_gspmd;
* `fit`, `evaluate`, `predict`, `train_on_batch`, `test_on_batch` and
  `predict_on_batch` of a model the distribution applies to (the one set, else
  the one its variables were made under) run through
  `tf_gspmd.partition_model`: every input's batch dim is split over the
  distribution's `batch_dim_name` axis, the whole step runs as one SPMD
  program on the mesh's devices.

>>> import tf_gspmd, keras                                            # doctest: +SKIP
>>> tf_gspmd.keras.enable()                                           # doctest: +SKIP
>>> mesh = keras.distribution.DeviceMesh((2, 4), ['data', 'model'])   # doctest: +SKIP
>>> layout_map = keras.distribution.LayoutMap(mesh)                   # doctest: +SKIP
>>> layout_map['d1/kernel'] = (None, 'model')                         # doctest: +SKIP
>>> keras.distribution.set_distribution(                              # doctest: +SKIP
...     keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name='data'))
>>> model = make_model(); model.compile(...); model.fit(x, y)         # doctest: +SKIP

`auto_layout(model, mesh, memory_budget=..., x=..., y=...)` chooses the
LayoutMap and batch axis itself: `tg.auto_shard`'s search on the model's own
train step (tf_gspmd/keras/auto_layout.py).

Importing tf_gspmd changes nothing in Keras; `enable()` does, `disable()`
undoes it.
"""

from __future__ import annotations

from tf_gspmd.keras import distribution_lib
from tf_gspmd.keras.auto_layout import AutoLayout, auto_layout
from tf_gspmd.keras.hooks import backing
from tf_gspmd.keras.translate import mesh_and_devices, to_mesh, to_sharding, to_spec

__all__ = [
  'AutoLayout',
  'auto_layout',
  'enable',
  'disable',
  'is_enabled',
  'backend',
  'annotate_variables',
  'distribution_of',
  'shard_layouts',
  'mesh_and_devices',
  'to_mesh',
  'to_sharding',
  'to_spec',
]


def enable(backend: str = 'tf') -> None:
  """Make Keras' `keras.distribution` API run through tf_gspmd on the TF backend (idempotent).

  `backend`: where the partitioned steps run. 'tf' (default): one TF program per
  device, TF collectives. 'xla': the per-replica program exported to StableHLO,
  compiled by XLA and run on the DeviceMesh's devices through PJRT (the
  `tf_gspmd[xla]` extra); the variables stay on those devices between calls.
  Calling it again switches the backend for models partitioned afterwards; a
  model already partitioned on the other backend refuses to run (see
  `tf_gspmd.unpartition_model`).

  Raises RuntimeError when Keras runs another backend.
  """
  distribution_lib.install(backend)


def disable() -> None:
  """Put back everything `enable()` replaced in Keras; models already partitioned stay so."""
  distribution_lib.uninstall()


def is_enabled() -> bool:
  return distribution_lib.installed()


def backend() -> str:
  """The backend `enable()` set: 'tf' or 'xla'."""
  return distribution_lib.backend()


def distribution_of(model):
  """The `keras.distribution.Distribution` `model`'s steps run under, or None."""
  return distribution_lib.distribution_of(model)


def annotate_variables(model, distribution=None):
  """Annotate every variable of `model` (optimizer and metrics too) with its Keras layout.

  Done by the partitioned steps themselves; call it to inspect the layouts
  first. Returns (variable path, NamedSharding) pairs.
  """
  distribution = distribution or distribution_lib.distribution_of(model)
  if distribution is None:
    raise ValueError(
      f'tf_gspmd.keras.annotate_variables: no distribution is set for model {model.name}.'
    )
  return distribution_lib.annotate_variables(model, distribution)


def shard_layouts(model) -> dict:
  """Variable path -> (spec, local shape) of the shards `model`'s partitioned steps hold.

  Empty until a partitioned step of `model` has run.
  """
  store = model.__dict__.get('_tf_gspmd_store')
  if store is None:
    return {}
  # Keyed by the Keras path: the TF names of nested layers' variables repeat ('attention/kernel'
  # for each of query, key and value).
  paths = {id(backing(v)): v.path for v in distribution_lib.all_variables(model)}
  return {
    paths.get(id(original), original.name.split(':')[0]): (
      sharded.sharding.spec,
      tuple(sharded.local_shape),
    )
    for original, sharded in store.pairs()
  }
