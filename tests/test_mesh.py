"""Mesh: value semantics, groups along any subset of axes, coordinates, errors."""

import copy
import itertools
import pickle

import numpy as np
import pytest

from tf_gspmd import Mesh
from tf_gspmd.mesh import all_orders

PERMUTED = np.array([[[5, 2], [7, 0]], [[1, 6], [3, 4]]])


def brute_groups(mesh, axes):
  """Groups by definition: devices equal in every coordinate outside `axes`."""
  others = [a for a in mesh.axis_names if a not in axes]
  groups = {}
  for d in mesh.devices:
    c = mesh.coords(d)
    groups.setdefault(tuple(c[a] for a in others), []).append(d)
  ordered = []
  for key in sorted(groups):
    members = sorted(groups[key], key=lambda d: tuple(mesh.coords(d)[a] for a in axes))
    ordered.append(tuple(members))
  return tuple(ordered)


def test_create_shape_and_devices():
  mesh = Mesh.create((2, 4), ('data', 'model'))
  assert mesh.shape == {'data': 2, 'model': 4}
  assert mesh.size == 8 and mesh.devices == tuple(range(8))
  assert mesh.axis_size('model') == 4 and mesh.axes_size(['data', 'model']) == 8
  assert mesh.axes_size([]) == 1


@pytest.mark.parametrize('device_ids', [np.arange(8).reshape(2, 2, 2), PERMUTED])
def test_groups_along_every_subset_of_axes(device_ids):
  mesh = Mesh(device_ids, ('x', 'y', 'z'))
  for axes in all_orders(mesh.axis_names):
    assert mesh.groups(axes) == brute_groups(mesh, axes), axes
    for d in mesh.devices:
      g, i = mesh.group_index(d, axes)
      assert mesh.groups(axes)[g][i] == d
      assert mesh.linear_index(d, axes) == i


def test_groups_examples():
  mesh = Mesh.create((2, 4), ('data', 'model'))
  assert mesh.groups(['model']) == ((0, 1, 2, 3), (4, 5, 6, 7))
  assert mesh.groups(['data']) == ((0, 4), (1, 5), (2, 6), (3, 7))
  assert mesh.groups([]) == tuple((d,) for d in range(8))
  assert mesh.groups(['model', 'data']) == ((0, 4, 1, 5, 2, 6, 3, 7),)


def test_coords_device_at_round_trip():
  mesh = Mesh(PERMUTED, ('x', 'y', 'z'))
  for idx in itertools.product(range(2), repeat=3):
    d = int(PERMUTED[idx])
    assert mesh.coords(d) == dict(zip('xyz', idx))
    assert mesh.device_at(**mesh.coords(d)) == d


def test_immutable_hashable_and_equal_by_value():
  a = Mesh.create((2, 4), ('data', 'model'))
  b = Mesh(np.arange(8).reshape(2, 4), ['data', 'model'])
  assert a == b and hash(a) == hash(b) and len({a, b}) == 1
  assert a != Mesh.create((2, 4), ('x', 'model'))
  assert a != Mesh(np.arange(8)[::-1].reshape(2, 4), ('data', 'model'))
  with pytest.raises(AttributeError, match='immutable'):
    a._axis_names = ('p', 'q')
  with pytest.raises(ValueError):
    a.device_ids[0, 0] = 3  # the device array is read-only
  source = np.arange(8).reshape(2, 4)
  c = Mesh(source, ('data', 'model'))
  source[0, 0] = 99  # the caller's array is copied
  assert c == a


def test_repr_eval_pickle_copy():
  for mesh in (Mesh.create((2, 4), ('data', 'model')), Mesh(PERMUTED, ('x', 'y', 'z'))):
    assert eval(repr(mesh)) == mesh
    assert pickle.loads(pickle.dumps(mesh)) == mesh
    assert copy.deepcopy(mesh) == mesh
  assert str(Mesh.create((2, 4), ('data', 'model'))) == 'Mesh(data=2, model=4)'


@pytest.mark.parametrize(
  'build, message',
  [
    (lambda: Mesh(np.arange(8).reshape(2, 4), ('data',)), 'rank 2.*one name per axis'),
    (lambda: Mesh(np.arange(4).reshape(2, 2), ('x', 'x')), 'distinct'),
    (lambda: Mesh([[0, 1], [1, 2]], ('x', 'y')), 'distinct and non-negative'),
    (
      lambda: Mesh.create((2, 4), ('data', 'model')).axis_size('batch'),
      "Unknown mesh axis 'batch'.*'data', 'model'",
    ),
    (lambda: Mesh.create((2, 4), ('data', 'model')).groups(['data', 'data']), 'used twice'),
    (lambda: Mesh.create((2, 4), ('data', 'model')).coords(8), 'Device 8 is not in mesh'),
    (lambda: Mesh.create((2, 4), ('data', 'model')).device_at(batch=0), 'Unknown mesh axes'),
  ],
)
def test_errors_name_the_problem(build, message):
  with pytest.raises(ValueError, match=message):
    build()
