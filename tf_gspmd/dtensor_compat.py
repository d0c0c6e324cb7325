"""TF DTensor's value types as tf_gspmd's: a DTensor `Mesh` is a `Mesh`, a `Layout` a `Sharding`.

DTensor users already describe their programs with `tf.experimental.dtensor.Mesh`
(named dims over device ids) and `tf.experimental.dtensor.Layout` (one mesh dim or
`UNSHARDED` per tensor dim). Every tf_gspmd entry point that takes a mesh or a
sharding (`shard`, `shard_variable`, `partition`, `LayoutMap`) converts them here,
so those programs move over with their layouts unchanged.

Only DTensor's value types are read, through the public accessors of the
`tf.experimental.dtensor` names; its runtime (the DTensor device,
`initialize_accelerator_system`) is never started. Building a mesh needs none of
it either: `dtensor.create_mesh([('batch', 2), ('model', 4)], devices=[...])` or
`dtensor.Mesh(dim_names, global_device_ids, local_device_ids, local_devices)`.

>>> from tensorflow.experimental import dtensor                         # doctest: +SKIP
>>> mesh = dtensor.create_mesh([('batch', 2), ('model', 4)],            # doctest: +SKIP
...                            devices=[f'CPU:{i}' for i in range(8)])
>>> from_dtensor_layout(dtensor.Layout(['batch', dtensor.UNSHARDED], mesh))  # doctest: +SKIP
NamedSharding(Mesh.create((2, 4), ('batch', 'model')), P('batch', None))
"""

from __future__ import annotations

from typing import Optional

import tensorflow as tf

from tf_gspmd.mesh import Mesh
from tf_gspmd.sharding import NamedSharding, P, Sharding

# Public tf.experimental.dtensor names only: its modules (tensorflow.dtensor.python.*) are
# private. TF imports them anyway, so reading these names costs nothing at import.
_DTensorMesh = tf.experimental.dtensor.Mesh  # to recognise a DTensor mesh
_DTensorLayout = tf.experimental.dtensor.Layout  # to recognise a DTensor layout
_UNSHARDED = tf.experimental.dtensor.UNSHARDED  # the spec of a tensor dim no mesh dim splits
_MATCH = tf.experimental.dtensor.MATCH  # a placeholder spec DTensor resolves: refused

# The layout kinds a tf_gspmd sharding says exactly (names of DTensor's LayoutType, which the
# public namespace does not export; read from `layout.type.name`).
_STATIC, _SINGLE_DEVICE = 'STATIC', 'SINGLE_DEVICE'


def is_dtensor_mesh(value) -> bool:
  """Whether `value` is a `tf.experimental.dtensor.Mesh`."""
  return isinstance(value, _DTensorMesh)


def is_dtensor_layout(value) -> bool:
  """Whether `value` is a `tf.experimental.dtensor.Layout`."""
  return isinstance(value, _DTensorLayout)


def from_dtensor_mesh(mesh) -> Mesh:
  """The tf_gspmd `Mesh` of DTensor `mesh`: its dim names, shape and device order.

  DTensor numbers a mesh's devices row-major from its first global id (meshes
  of one cluster share that numbering); tf_gspmd numbers the partitions of one
  program from 0, so ids count from the mesh's first one.

  >>> from_dtensor_mesh(dtensor.create_mesh([('batch', 2), ('model', 4)]))  # doctest: +SKIP
  Mesh.create((2, 4), ('batch', 'model'))
  """
  if not is_dtensor_mesh(mesh):
    raise TypeError(
      f'from_dtensor_mesh: expected a tf.experimental.dtensor.Mesh, got '
      f'{type(mesh).__name__} {mesh!r}.'
    )
  if mesh.is_single_device():
    raise ValueError(
      f'from_dtensor_mesh: {mesh!r} is a single-device mesh: it has no dims to name. '
      'Its layout (Layout.from_single_device_mesh) converts with from_dtensor_layout, to '
      'a sharding on that one device; partition over a mesh of several devices.'
    )
  ids = mesh.global_device_ids()
  return Mesh(ids - ids.min(), mesh.dim_names)


def mesh_devices(mesh) -> Optional[tuple]:
  """The TF device of each tf_gspmd device id of DTensor `mesh`, or None.

  None when this process does not hold each device of the mesh once (a
  multi-client mesh, or DTensor's host-CPU mesh naming one CPU for all): then
  tf_gspmd's own default devices stand in.
  """
  first = mesh.min_global_device_id()
  by_id = {
    i - first: tf.DeviceSpec.from_string(d).to_string()
    for i, d in zip(mesh.local_device_ids(), mesh.local_devices())
  }
  devices = tuple(by_id.get(i) for i in range(mesh.size))
  return devices if None not in devices and len(set(devices)) == len(devices) else None


def from_dtensor_layout(layout) -> Sharding:
  """The tf_gspmd `Sharding` of DTensor `layout`.

  A static layout is `NamedSharding(from_dtensor_mesh(layout.mesh), P(...))`,
  `UNSHARDED` becoming None; a single-device layout is `Sharding.maximal` on
  that device's index. Other layouts (parted ones, a `MATCH` spec) say what
  no tf_gspmd sharding says and are refused with a ValueError.

  >>> from_dtensor_layout(dtensor.Layout.batch_sharded(mesh, 'batch', rank=2))  # doctest: +SKIP
  NamedSharding(Mesh.create((2, 4), ('batch', 'model')), P('batch', None))
  >>> from_dtensor_layout(dtensor.Layout.from_device('CPU:3'))         # doctest: +SKIP
  Sharding.maximal(3)
  """
  if not is_dtensor_layout(layout):
    raise TypeError(
      f'from_dtensor_layout: expected a tf.experimental.dtensor.Layout, got '
      f'{type(layout).__name__} {layout!r}.'
    )
  kind = layout.type.name
  if kind == _SINGLE_DEVICE:
    return Sharding.maximal(_device_index(layout))
  if kind != _STATIC:
    raise ValueError(
      _refusal(
        layout,
        (
          f'DTensor treats the sharded dims of a {kind.lower()} layout as independent of each '
          'other, which no tf_gspmd sharding (slices of one global tensor) says; give the static '
          'layout Layout(layout.sharding_specs, layout.mesh) instead'
        ),
      )
    )
  specs = list(layout.sharding_specs)
  if _MATCH in specs:
    raise ValueError(
      _refusal(
        layout,
        (
          f'{_MATCH!r} stands for the layout of another tensor, chosen by DTensor at '
          'run time; give the mesh dim (or UNSHARDED) that dim should have'
        ),
      )
    )
  spec = P(*(None if s == _UNSHARDED else s for s in specs))
  return NamedSharding(from_dtensor_mesh(layout.mesh), spec)


def converted(value):
  """`value` with a DTensor Mesh or Layout converted; a plain list or tuple entry by entry.

  Anything else comes back unchanged (a `P` is a tuple, but holds no DTensor values).
  """
  if is_dtensor_mesh(value):
    return from_dtensor_mesh(value)
  if is_dtensor_layout(value):
    return from_dtensor_layout(value)
  if type(value) in (list, tuple):
    return type(value)(converted(v) for v in value)
  return value


def _device_index(layout) -> int:
  """The device index of a single-device layout: 'CPU:3' is device 3, as in `assign_device`."""
  device = layout.mesh.single_device
  index = tf.DeviceSpec.from_string(device).device_index
  if index is None:
    raise ValueError(_refusal(layout, f'its device {device!r} has no device index'))
  return int(index)


def _refusal(layout, why: str) -> str:
  return f'from_dtensor_layout: cannot convert the DTensor {_describe(layout)}: {why}.'


def _describe(layout) -> str:
  """A layout by its kind, specs and mesh dims (its repr lists every device of the mesh)."""
  mesh = layout.mesh
  dims = ', '.join(f'{n}={s}' for n, s in zip(mesh.dim_names, mesh.shape()))
  where = f'({dims})' if dims else mesh.single_device
  return f'{layout.type.name.lower()} layout {list(layout.sharding_specs)} on mesh {where}'


__all__ = [
  'from_dtensor_layout',
  'from_dtensor_mesh',
  'is_dtensor_layout',
  'is_dtensor_mesh',
  'converted',
  'mesh_devices',
]
