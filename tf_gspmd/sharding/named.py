"""`NamedSharding`: a sharding written against a named mesh as a `P` spec."""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

from tf_gspmd.mesh import Mesh
from tf_gspmd.sharding.core import (
  PARTIAL_PREFIX,
  REDUCTIONS,
  REPLICATED,
  Sharding,
  frozen_ids,
  init_slots,
)
from tf_gspmd.sharding.spec import P


class NamedSharding(Sharding):
  """A sharding written against a named mesh: `NamedSharding(mesh, P('data', None))`.

  `partial` names mesh axes over which the tensor holds a pending reduction
  (partial results that must still be combined with `reduction`); it is an
  internal state of the partitioner, not something users annotate.

  >>> mesh = Mesh.create((2, 4), ('data', 'model'))
  >>> s = NamedSharding(mesh, P('data', None))
  >>> str(s), s.shard_shape((8, 3))
  ("P('data', None)", (4, 3))
  """

  __slots__ = ('_mesh', '_spec', '_partial_axes', '_reduction')
  _mesh: Mesh
  _spec: P
  _partial_axes: Tuple[str, ...]
  _reduction: str

  def __init__(self, mesh: Mesh, spec, partial: Sequence[str] = (), reduction: str = 'sum'):
    spec = spec if isinstance(spec, P) else P(*spec)
    partial = (partial,) if isinstance(partial, str) else tuple(partial)
    _check_spec(mesh, spec, partial)
    if reduction not in REDUCTIONS:
      raise ValueError(f'NamedSharding: reduction must be one of {REDUCTIONS}, got {reduction!r}.')
    tile, subgroups = _named_tile(mesh, spec, partial, reduction)
    if tile is None:
      super().__init__('replicated')
    else:
      super().__init__('tiled', frozen_ids(tile), subgroups)
    init_slots(self, _mesh=mesh, _spec=spec, _partial_axes=partial, _reduction=reduction)

  def __reduce__(self):
    return (NamedSharding, (self._mesh, self._spec, self._partial_axes, self._reduction))

  @property
  def mesh(self) -> Mesh:
    return self._mesh

  @property
  def spec(self) -> P:
    return self._spec

  @property
  def partial_axes(self) -> tuple:
    return self._partial_axes

  @property
  def reduction(self) -> str:
    """How the pending partial results combine ('sum', 'max', ...); meaningful with
    `partial_axes`."""
    return self._reduction

  @property
  def rank(self) -> Optional[int]:
    return len(self._spec)

  @property
  def tile_shape(self) -> tuple:
    return tuple(self._mesh.axes_size(self._spec.axes_of(d)) for d in range(len(self._spec)))

  def tile_index(self, device):
    if int(device) not in self._mesh.devices:
      return None
    return tuple(
      self._mesh.linear_index(device, self._spec.axes_of(d)) for d in range(len(self._spec))
    )

  @property
  def devices(self) -> tuple:
    return self._mesh.devices

  _built_from = 'mesh'
  _entry = 'spec entry'

  def _device_source(self) -> str:
    return f'mesh {self._mesh} of {self._mesh.size} devices'

  def _structure(self) -> tuple:
    """Mesh (axis names and device order), spec, and the pending reduction if any."""
    reduction = self._reduction if self._partial_axes else None
    return (NamedSharding, self._mesh, self._spec, self._partial_axes, reduction)

  def without_partial(self) -> 'NamedSharding':
    return NamedSharding(self._mesh, self._spec) if self._partial_axes else self

  def __repr__(self):
    extra = ''
    if self._partial_axes:
      extra = f', partial={self._partial_axes!r}'
      if self._reduction != 'sum':
        extra += f', reduction={self._reduction!r}'
    return f'NamedSharding({self._mesh!r}, {self._spec!r}{extra})'

  def __str__(self):
    if not self._partial_axes:
      return str(self._spec)
    axes = ', '.join(repr(a) for a in self._partial_axes)
    return f'{self._spec} partial_{self._reduction}({axes})'


def _check_spec(mesh: Mesh, spec: P, partial: tuple) -> None:
  """Raise a ValueError naming spec and mesh for unknown or repeated mesh axes."""
  what = f'NamedSharding({mesh}, {spec}' + (f', partial={partial})' if partial else ')')
  seen = []
  for axis in spec.used_axes() + partial:
    if axis not in mesh.axis_names:
      raise ValueError(
        f'{what}: unknown mesh axis {axis!r}; the mesh has axes {mesh.axis_names} with shape '
        f'{mesh.shape}. Use one of those names, or None for a dim that is not split.'
      )
    if axis in seen:
      raise ValueError(
        f'{what}: mesh axis {axis!r} is used twice; each mesh axis may split at most one '
        f'tensor dim, once. Drop one use, or split by another axis.'
      )
    seen.append(axis)


def _named_tile(mesh: Mesh, spec: P, partial: tuple, reduction: str):
  """Tile assignment and subgroup kinds equivalent to (mesh, spec, partial)."""
  used = spec.used_axes()
  rest = tuple(a for a in mesh.axis_names if a not in used and a not in partial)
  order = [mesh.axis_index(a) for a in used + partial + rest]
  dims = [mesh.axes_size(spec.axes_of(d)) for d in range(len(spec))]
  subgroups = []
  if mesh.axes_size(partial) > 1:
    dims.append(mesh.axes_size(partial))
    subgroups.append(PARTIAL_PREFIX + reduction)
  if mesh.axes_size(rest) > 1:
    dims.append(mesh.axes_size(rest))
    subgroups.append(REPLICATED)
  if not used and mesh.axes_size(partial) == 1:
    return None, ()
  return mesh.device_ids.transpose(order).reshape(dims), tuple(subgroups)
