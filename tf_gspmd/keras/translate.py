"""Keras 3's distribution objects in tf_gspmd's terms: DeviceMesh -> Mesh, TensorLayout -> P.

Keras describes a layout as a `TensorLayout(axes, device_mesh)` over a
`DeviceMesh(shape, axis_names, devices)` whose devices are strings such as
'cpu:3'. tf_gspmd's `Mesh` holds device ids 0..n-1 in the DeviceMesh's
row-major order and the launcher gets the TF device name of each id, so a
DeviceMesh listing its devices in any order runs on exactly those devices.
Only Keras' public API (`keras.distribution`) is read here.
"""

from __future__ import annotations

from typing import Optional, Tuple

import keras
import numpy as np

from tf_gspmd.mesh import Mesh
from tf_gspmd.sharding import NamedSharding, P

# Attribute on a DeviceMesh caching its translation, so every annotation and
# the partitioned step of one distribution share one Mesh object.
_MESH_ATTR = '_tf_gspmd_mesh'


def tf_device_name(device) -> str:
  """'cpu:3' (Keras' device string) -> '/device:CPU:3'; TF names pass through."""
  name = str(device)
  if name.startswith('/'):
    return name
  kind, sep, index = name.rpartition(':')
  if not sep or not index.isdigit() or not kind:
    raise ValueError(
      f'keras.distribution: cannot read device {name!r} as "type:index" '
      "(Keras' own form, e.g. 'cpu:0') or a TF device name."
    )
  return f'/device:{kind.upper()}:{int(index)}'


def mesh_and_devices(device_mesh) -> Tuple[Mesh, Tuple[str, ...]]:
  """The tf_gspmd Mesh of a Keras DeviceMesh and the TF device name of each mesh id."""
  cached = getattr(device_mesh, _MESH_ATTR, None)
  if cached is not None:
    return cached
  shape = tuple(int(s) for s in device_mesh.shape)
  names = tuple(str(a) for a in device_mesh.axis_names)
  devices = tuple(tf_device_name(d) for d in np.asarray(device_mesh.devices).reshape(-1))
  if len(set(devices)) != len(devices):
    raise ValueError(
      f'keras.distribution: DeviceMesh {device_mesh} lists a device twice: {devices}.'
    )
  result = (Mesh.create(shape, names), devices)
  setattr(device_mesh, _MESH_ATTR, result)
  return result


def to_mesh(device_mesh) -> Mesh:
  return mesh_and_devices(device_mesh)[0]


def to_spec(layout) -> P:
  """A TensorLayout's (or a tuple of axis names') partition spec."""
  axes = layout.axes if isinstance(layout, keras.distribution.TensorLayout) else tuple(layout)
  return P(*[tuple(a) if isinstance(a, list) else a for a in axes])


def to_sharding(layout, default_mesh=None) -> NamedSharding:
  """A TensorLayout as a NamedSharding; a layout without a mesh takes `default_mesh`'s."""
  device_mesh = getattr(layout, 'device_mesh', None) or default_mesh
  if device_mesh is None:
    raise ValueError(
      f'keras.distribution: layout {layout} has no device mesh and no '
      'distribution is set to take one from.'
    )
  return NamedSharding(to_mesh(device_mesh), to_spec(layout))


def variable_spec(variable, layout) -> P:
  """`variable`'s Keras `layout` (decided by distribution_lib._layout_of) as a spec of its rank."""
  spec = to_spec(layout)
  if len(spec) != len(variable.shape):
    raise ValueError(
      f'keras.distribution: layout {tuple(spec)} for variable {variable.path} of shape '
      f'{tuple(variable.shape)} has {len(spec)} entries for rank {len(variable.shape)}; '
      'give one entry per dim.'
    )
  return spec


def batch_axes(distribution) -> Optional[str]:
  """The mesh axis the batch dim of every input is split over (Keras' `batch_dim_name`)."""
  name = distribution.batch_dim_name
  if name is not None and name not in distribution.device_mesh.axis_names:
    raise ValueError(
      f'keras.distribution: batch_dim_name {name!r} is not an axis of {distribution.device_mesh}.'
    )
  return name
