"""Device meshes: an N-D array of device ids with a name per axis."""

from __future__ import annotations

import itertools
from typing import Dict, Iterable, Sequence, Tuple

import numpy as np


class Mesh:
  """An immutable, hashable N-D grid of device ids with named axes.

  >>> mesh = Mesh.create((2, 4), ('data', 'model'))
  >>> mesh.shape
  {'data': 2, 'model': 4}
  >>> mesh.groups(['model'])
  ((0, 1, 2, 3), (4, 5, 6, 7))
  >>> mesh.coords(6)
  {'data': 1, 'model': 2}
  """

  __slots__ = ('_devices', '_axis_names', '_hash', '_coords')
  _devices: np.ndarray  # device ids, read-only, one array dim per axis
  _axis_names: Tuple[str, ...]
  _hash: int
  _coords: Dict[int, Tuple[int, ...]]  # device id -> its index in `_devices`

  def __init__(self, device_ids, axis_names: Sequence[str]):
    devices = np.array(device_ids, dtype=np.int64)
    axis_names = tuple(axis_names)
    if devices.ndim != len(axis_names):
      raise ValueError(
        f'Mesh: device array has rank {devices.ndim} (shape {devices.shape}) but '
        f'{len(axis_names)} axis names were given {axis_names}; give one name per axis.'
      )
    if len(set(axis_names)) != len(axis_names):
      raise ValueError(f'Mesh: axis names must be distinct, got {axis_names}.')
    for name in axis_names:
      if not isinstance(name, str) or not name:
        raise ValueError(f'Mesh: axis names must be non-empty strings, got {name!r}.')
    flat = devices.reshape(-1).tolist()
    if len(set(flat)) != len(flat) or min(flat, default=0) < 0:
      raise ValueError(f'Mesh: device ids must be distinct and non-negative, got {flat}.')
    devices.setflags(write=False)
    values = dict(
      _devices=devices,
      _axis_names=axis_names,
      _hash=hash((axis_names, devices.shape, tuple(flat))),
      _coords={int(d): idx for idx, d in np.ndenumerate(devices)},
    )
    for name, value in values.items():
      object.__setattr__(self, name, value)

  def __setattr__(self, name, value):
    raise AttributeError(f'Mesh is immutable; build a new one instead of setting {name!r}.')

  def __reduce__(self):
    return (Mesh, (self._devices.tolist(), self._axis_names))

  @classmethod
  def create(cls, shape: Sequence[int], axis_names: Sequence[str]) -> 'Mesh':
    """A mesh over devices 0..prod(shape)-1 in row-major order."""
    shape = tuple(int(s) for s in shape)
    return cls(np.arange(int(np.prod(shape, dtype=np.int64))).reshape(shape), axis_names)

  # --- structure ---------------------------------------------------------
  @property
  def device_ids(self) -> np.ndarray:
    return self._devices

  @property
  def axis_names(self) -> tuple:
    return self._axis_names

  @property
  def shape(self) -> dict:
    return dict(zip(self._axis_names, self._devices.shape))

  @property
  def size(self) -> int:
    return int(self._devices.size)

  @property
  def devices(self) -> tuple:
    """Device ids in row-major mesh order."""
    return tuple(int(d) for d in self._devices.reshape(-1))

  def axis_size(self, axis: str) -> int:
    return int(self._devices.shape[self.axis_index(axis)])

  def axes_size(self, axes: Iterable[str]) -> int:
    size = 1  # a Python product: called ~30k times while partitioning a small transformer
    for a in axes:
      size *= self.axis_size(a)
    return size

  def axis_index(self, axis: str) -> int:
    try:
      return self._axis_names.index(axis)
    except ValueError:
      raise ValueError(
        f'Unknown mesh axis {axis!r}; this mesh has axes {self._axis_names} '
        f'with shape {self.shape}. Use one of those names.'
      ) from None

  # --- groups and coordinates -------------------------------------------
  def groups(self, axes: Sequence[str]) -> tuple:
    """Replica groups along `axes`: devices that differ only in those axes.

    Groups are ordered row-major over the other axes; inside a group devices
    are ordered row-major over `axes` in the order given.
    """
    axes = tuple(axes)
    idx = [self.axis_index(a) for a in axes]
    if len(set(idx)) != len(idx):
      raise ValueError(
        f'Mesh.groups: an axis is used twice in {axes} on mesh {self}; name each axis once.'
      )
    rest = [i for i in range(self._devices.ndim) if i not in idx]
    arr = self._devices.transpose(rest + idx).reshape(-1, self.axes_size(axes))
    return tuple(tuple(int(d) for d in row) for row in arr)

  def group_index(self, device: int, axes: Sequence[str]) -> tuple:
    """(index of the group holding `device`, position of `device` inside it)."""
    for g, members in enumerate(self.groups(axes)):
      if device in members:
        return g, members.index(device)
    raise ValueError(f'Device {device} is not in mesh {self!r}.')

  def coords(self, device: int) -> dict:
    try:
      idx = self._coords[int(device)]
    except KeyError:
      raise ValueError(f'Device {device} is not in mesh {self!r}.') from None
    return dict(zip(self._axis_names, (int(i) for i in idx)))

  def device_at(self, **coords) -> int:
    unknown = set(coords) - set(self._axis_names)
    if unknown:
      raise ValueError(f'Unknown mesh axes {sorted(unknown)}; mesh has {self._axis_names}.')
    return int(self._devices[tuple(coords[a] for a in self._axis_names)])

  def linear_index(self, device: int, axes: Sequence[str]) -> int:
    """Row-major index of `device` along `axes` (0 when `axes` is empty)."""
    c = self.coords(device)
    index = 0
    for a in axes:
      index = index * self.axis_size(a) + c[a]
    return index

  # --- device orders -----------------------------------------------------
  def reordered(self, device_ids) -> 'Mesh':
    """The same axes (names and sizes) over the same devices in another order."""
    other = Mesh(
      np.asarray(device_ids, dtype=np.int64).reshape(self._devices.shape), self._axis_names
    )
    if sorted(other.devices) != sorted(self.devices):
      raise ValueError(f'Mesh.reordered: {other!r} does not hold the devices of {self!r}.')
    return other

  def is_reordering_of(self, other: 'Mesh') -> bool:
    """Whether both have the same axes (names and sizes) over the same set of devices."""
    return (
      isinstance(other, Mesh)
      and self._axis_names == other.axis_names
      and self._devices.shape == other.device_ids.shape
      and sorted(self.devices) == sorted(other.devices)
    )

  # --- value semantics ---------------------------------------------------
  def __eq__(self, other):
    return (
      isinstance(other, Mesh)
      and self._axis_names == other._axis_names
      and np.array_equal(self._devices, other._devices)
    )

  def __hash__(self):
    return self._hash

  def __repr__(self):
    if np.array_equal(self._devices.reshape(-1), np.arange(self.size)):
      return f'Mesh.create({tuple(self._devices.shape)!r}, {self._axis_names!r})'
    return f'Mesh({self._devices.tolist()!r}, {self._axis_names!r})'

  def __str__(self):
    return 'Mesh(' + ', '.join(f'{a}={s}' for a, s in self.shape.items()) + ')'


def all_orders(axes: Sequence[str]):
  """Every ordering of every subset of `axes` (used to match tile assignments)."""
  for k in range(len(axes) + 1):
    yield from itertools.permutations(axes, k)
