"""The one place that converts between `Sharding` and XLA's `OpSharding` proto."""

from __future__ import annotations

from typing import Optional, Tuple

import numpy as np

from tf_gspmd.errors import Unsupported
from tf_gspmd.mesh import Mesh
from tf_gspmd.sharding import MANUAL, REPLICATED, NamedSharding, Sharding, named


def _pb():
  from tensorflow.compiler.xla import xla_data_pb2

  return xla_data_pb2


def from_proto(proto, tuple_index: Optional[int] = None, mesh: Optional[Mesh] = None) -> Sharding:
  """Sharding from an `OpSharding` (or its serialized bytes).

  A TUPLE sharding needs `tuple_index`, the output it describes. With `mesh`,
  a tiled sharding over the mesh's devices comes back as a `NamedSharding`
  (still written back to the same proto by `to_proto`): on `mesh` when some
  spec there expresses it, else on `mesh.reordered(...)`, the same axes in the
  tile assignment's own device order (`devices=[2,4]0,2,3,1,4,6,7,5` on a 2x4
  mesh is P('x', 'y') over the devices [[0,2,3,1],[4,6,7,5]]). Any other comes
  back as a plain `Sharding`.
  """
  pb = _pb()
  if isinstance(proto, (bytes, bytearray)):
    proto = pb.OpSharding.FromString(bytes(proto))
  t = pb.OpSharding
  if proto.type == t.TUPLE:
    if tuple_index is None:
      raise ValueError(
        'from_proto: a TUPLE OpSharding describes several outputs; pass tuple_index.'
      )
    if not 0 <= tuple_index < len(proto.tuple_shardings):
      raise ValueError(
        f'from_proto: tuple_index {tuple_index} is out of range for a TUPLE OpSharding of '
        f'{len(proto.tuple_shardings)} outputs.'
      )
    return from_proto(proto.tuple_shardings[tuple_index], mesh=mesh)
  plain = _from_single_proto(proto)
  if mesh is None or plain.kind != 'tiled':
    return plain
  on_mesh = named(plain, mesh) if sorted(plain.devices) == sorted(mesh.devices) else None
  if on_mesh is None:
    return plain
  return _with_proto_style(on_mesh, plain)


def _from_single_proto(proto) -> Sharding:
  """Sharding from one non-TUPLE `OpSharding`."""
  t = _pb().OpSharding
  if proto.type == t.REPLICATED:
    return Sharding.replicated()
  if proto.type == t.MANUAL:
    return Sharding.manual()
  if proto.type == t.MAXIMAL:
    devices = _devices(proto)
    if len(devices) != 1:
      raise ValueError(f'from_proto: MAXIMAL sharding must name one device, got {devices}.')
    return Sharding.maximal(devices[0])
  if proto.type != t.OTHER:
    raise Unsupported(f'from_proto: unsupported OpSharding type {t.Type.Name(proto.type)}.')
  dims = tuple(proto.tile_assignment_dimensions)
  devices = _devices(proto)
  if int(np.prod(dims, dtype=np.int64)) != len(devices):
    raise ValueError(
      f'from_proto: tile assignment dims {list(dims)} hold {int(np.prod(dims))} devices but '
      f'{len(devices)} device ids were given.'
    )
  if proto.replicate_on_last_tile_dim:
    subgroups: Tuple[str, ...] = (REPLICATED,)
    style_last = False
  else:
    kinds = {t.REPLICATED: REPLICATED, t.MANUAL: MANUAL}
    unknown = [t.Type.Name(k) for k in proto.last_tile_dims if k not in kinds]
    if unknown:
      raise ValueError(
        f'from_proto: last_tile_dims {unknown} in tile assignment dims {list(dims)}; '
        'subgroup dims can only be REPLICATED or MANUAL.'
      )
    subgroups, style_last = tuple(kinds[k] for k in proto.last_tile_dims), True
  iota = None
  if proto.iota_reshape_dims:
    iota = (tuple(proto.iota_reshape_dims), tuple(proto.iota_transpose_perm))
  return Sharding.tiled(np.array(devices).reshape(dims), subgroups, proto_style=(iota, style_last))


def to_proto(s: Sharding, iota: Optional[bool] = None):
  """`OpSharding` for `s`. `iota`: force (True) or forbid (False) the compact iota form.

  By default a sharding read from a proto is written back in the form it was
  read in, and others in TF's `xla_sharding` form (explicit device list,
  `replicate_on_last_tile_dim` for one replicated subgroup).
  """
  pb = _pb()
  t = pb.OpSharding
  if s.kind == 'replicated':
    return t(type=t.REPLICATED)
  if s.kind == 'manual':
    return t(type=t.MANUAL)
  if s.kind == 'maximal':
    return t(
      type=t.MAXIMAL, tile_assignment_dimensions=[1], tile_assignment_devices=list(s.devices)
    )
  if s.partial is not None:
    raise ValueError(
      f'to_proto: {s} holds a pending {s.partial} reduction, which OpSharding cannot say; '
      'resolve it (all-reduce) first.'
    )
  iota_form, style_last = s._proto_style or (None, False)  # noqa: SLF001
  tile = s.tile_assignment
  assert tile is not None, s  # replicated, manual and maximal returned above
  proto = t(type=t.OTHER, tile_assignment_dimensions=list(tile.shape))
  if iota is None:
    iota = iota_form is not None and np.array_equal(_iota_devices(iota_form, tile.shape), tile)
  iota_form = (iota_form if iota_form is not None else _find_iota(s)) if iota else None
  if iota_form is not None:
    proto.iota_reshape_dims.extend(iota_form[0])
    proto.iota_transpose_perm.extend(iota_form[1])
  else:
    proto.tile_assignment_devices.extend(int(d) for d in tile.reshape(-1))
  if s.subgroups == (REPLICATED,) and not style_last:
    proto.replicate_on_last_tile_dim = True
  else:
    kinds = {REPLICATED: t.REPLICATED, MANUAL: t.MANUAL}
    proto.last_tile_dims.extend(kinds[k] for k in s.subgroups)
  return proto


def _with_proto_style(on_mesh: NamedSharding, plain: Sharding) -> NamedSharding:
  """`on_mesh` carrying how `plain`'s proto was spelled, when both use the same tile assignment."""
  if (
    np.array_equal(np.asarray(on_mesh.tile_assignment), np.asarray(plain.tile_assignment))
    and on_mesh.subgroups == plain.subgroups
  ):
    object.__setattr__(on_mesh, '_proto_style', plain._proto_style)  # noqa: SLF001
  return on_mesh


def _devices(proto) -> list:
  if proto.iota_reshape_dims:
    dims = tuple(proto.tile_assignment_dimensions)
    form = (tuple(proto.iota_reshape_dims), tuple(proto.iota_transpose_perm))
    return [int(d) for d in _iota_devices(form, dims).reshape(-1)]
  return [int(d) for d in proto.tile_assignment_devices]


def _iota_devices(form, dims) -> np.ndarray:
  reshape_dims, perm = form
  n = int(np.prod(reshape_dims, dtype=np.int64))
  return np.arange(n).reshape(reshape_dims).transpose(perm).reshape(dims)


def _find_iota(s: Sharding):
  """An iota form for `s`'s tile assignment, or None if it has none we can find."""
  tile = s.tile_assignment
  assert tile is not None, s
  if np.array_equal(tile.reshape(-1), np.arange(tile.size)):
    return (tile.size,), (0,)
  if isinstance(s, NamedSharding) and np.array_equal(
    s.mesh.device_ids.reshape(-1), np.arange(s.mesh.size)
  ):
    spec, mesh = s.spec, s.mesh
    used = spec.used_axes() + s.partial_axes
    order = [mesh.axis_index(a) for a in used] + [
      mesh.axis_index(a) for a in mesh.axis_names if a not in used
    ]
    form = (tuple(mesh.device_ids.shape), tuple(order))
    if np.array_equal(_iota_devices(form, tile.shape), tile):
      return form
  return None
