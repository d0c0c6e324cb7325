"""P, Sharding and NamedSharding: meaning-based equality, str/repr, geometry, helpful errors."""

import copy
import pickle

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tf_gspmd import *  # noqa: F401,F403  (repr strings are evaluated in this namespace)
from tf_gspmd import Mesh, NamedSharding, P, Sharding
from tf_gspmd.op_sharding import from_proto
from tf_gspmd.sharding import named, named_for_rank, num_shards, shard_bounds

MESH = Mesh.create((2, 4), ('data', 'model'))
MESH3 = Mesh(np.array([[[5, 2], [7, 0]], [[1, 6], [3, 4]]]), ('x', 'y', 'z'))

REPR_CASES = [
  Sharding.replicated(),
  Sharding.manual(),
  Sharding.maximal(3),
  Sharding.tiled([[0, 1], [2, 3]]),
  Sharding.tiled([[[3, 1]], [[0, 2]]], subgroups=('replicated',)),
  Sharding.tiled(np.arange(8).reshape(2, 1, 2, 2), subgroups=('manual', 'replicated')),
  Sharding.tiled(np.arange(8).reshape(2, 2, 2), subgroups=('partial_sum', 'replicated')),
  NamedSharding(MESH, P('data', None)),
  NamedSharding(MESH, P(('model', 'data'), None)),
  NamedSharding(MESH, P(None, 'model'), partial=('data',)),
  NamedSharding(MESH, P(None, None), partial='model', reduction='max'),
  NamedSharding(MESH3, P('z', None, ('x', 'y'))),
]


# --- P ------------------------------------------------------------------------------
def test_p_normalizes_entries():
  assert P('data', None) == ('data', None)
  assert P(('x',), ()) == P('x', None)
  assert P(['x', 'y'], None)[0] == ('x', 'y')
  assert P(('x', 'y')).axes_of(0) == ('x', 'y') and P(None).axes_of(0) == ()
  assert P(('x', 'y'), 'z').used_axes() == ('x', 'y', 'z')
  assert str(P('data', None)) == "P('data', None)" and repr(P()) == 'P()'


def test_p_rebuilt_from_a_list_like_tuple():
  # tf.nest and Keras 3 attribute tracking rebuild tuple subclasses as cls(list).
  assert P(['data', None]) == P('data', None)
  assert P([('x', 'y'), None]) == P(('x', 'y'), None)
  assert pickle.loads(pickle.dumps(P(('x', 'y'), None))) == P(('x', 'y'), None)


@pytest.mark.parametrize('entry', [3, ('x', 1), 1.5])
def test_p_rejects_bad_entries(entry):
  with pytest.raises(TypeError, match='P:'):
    P(entry, None)


# --- value semantics ---------------------------------------------------------------------
@pytest.mark.parametrize('s', REPR_CASES, ids=str)
def test_repr_is_exact(s):
  again = eval(repr(s))
  assert again == s and hash(again) == hash(s) and repr(again) == repr(s)
  assert type(again) is type(s)
  assert pickle.loads(pickle.dumps(s)) == s and copy.deepcopy(s) == s


@pytest.mark.parametrize('s', REPR_CASES, ids=str)
def test_immutable(s):
  with pytest.raises(AttributeError, match='immutable'):
    s._kind = 'maximal'
  if s.tile_assignment is not None:
    with pytest.raises(ValueError):
      s.tile_assignment[(0,) * s.tile_assignment.ndim] = 7


def test_str_forms():
  assert str(NamedSharding(MESH, P('data', None))) == "P('data', None)"
  assert str(NamedSharding(MESH, P(None, 'model'), partial='data')) == (
    "P(None, 'model') partial_sum('data')"
  )
  assert str(Sharding.tiled([[0, 1], [2, 3]])) == '{devices=[2,2]0,1,2,3}'
  assert str(Sharding.partial_tile([[[0, 1]], [[2, 3]]])) == (
    '{devices=[2,1,2]0,1,2,3 last_tile_dim_replicate}'
  )
  assert str(Sharding.maximal(2)) == '{maximal device=2}'
  assert str(Sharding.replicated()) == '{replicated}'


def test_equivalent_by_meaning():
  eq = Sharding.is_equivalent_to
  # Order inside a replica group carries no meaning.
  assert eq(
    Sharding.partial_tile([[[0, 1]], [[2, 3]]]), Sharding.partial_tile([[[1, 0]], [[3, 2]]])
  )
  assert not eq(
    Sharding.partial_tile([[[0, 1]], [[2, 3]]]), Sharding.partial_tile([[[0, 2]], [[1, 3]]])
  )
  # Size-1 subgroup dims and split subgroup dims of one kind change nothing.
  assert eq(Sharding.tiled([[0, 1], [2, 3]]), Sharding.partial_tile([[[0], [1]], [[2], [3]]]))
  assert eq(
    Sharding.tiled(np.arange(8).reshape(2, 2, 2), ('replicated', 'replicated')),
    Sharding.partial_tile(np.arange(8).reshape(2, 4)),
  )
  # A tile of one device is maximal, a tile of all replicas is replicated.
  assert eq(Sharding.tiled([[5]]), Sharding.maximal(5))
  assert eq(Sharding.partial_tile([[np.arange(8)]]), Sharding.replicated())
  assert eq(Sharding.tiled([[[0, 1, 2, 3]]], ('manual',)), Sharding.manual())
  # Tile order matters, and so does which dim is split.
  assert not eq(Sharding.tiled([[0, 1], [2, 3]]), Sharding.tiled([[0, 2], [1, 3]]))
  assert not eq(Sharding.tiled([[0, 1]]), Sharding.tiled([[0], [1]]))
  # Manual groups keep their order; the groups of a pending reduction do not.
  assert not eq(
    Sharding.tiled([[[0, 1]], [[2, 3]]], ('manual',)),
    Sharding.tiled([[[1, 0]], [[3, 2]]], ('manual',)),
  )
  pending = Sharding.tiled(np.arange(8).reshape(2, 2, 2), ('partial_sum', 'replicated'))
  swapped = Sharding.tiled(
    np.arange(8).reshape(2, 2, 2)[:, ::-1, ::-1], ('partial_sum', 'replicated')
  )
  assert eq(pending, swapped) and pending.canonical_key() == swapped.canonical_key()
  assert not eq(pending, pending.without_partial())
  assert eq(pending.without_partial(), Sharding.partial_tile(np.arange(8).reshape(2, 4)))


def test_equality_is_structural():
  # The same layout written on meshes with other axis names: equivalent, not equal.
  a = NamedSharding(Mesh.create((2, 4), ('x', 'y')), P('x', None))
  b = NamedSharding(Mesh.create((2, 4), ('data', 'model')), P('data', None))
  assert a.is_equivalent_to(b) and b.is_equivalent_to(a)
  assert a != b and not a == b and len({a, b}) == 2
  # A NamedSharding and the tile assignment it stands for: equivalent, not equal.
  plain = Sharding.partial_tile([[[0, 1, 2, 3]], [[4, 5, 6, 7]]])
  assert a.is_equivalent_to(plain) and plain.is_equivalent_to(a) and a != plain
  # Two spellings of one tile assignment: equivalent, not equal.
  assert Sharding.partial_tile([[[0, 1]], [[2, 3]]]) != Sharding.partial_tile([[[1, 0]], [[3, 2]]])
  assert Sharding.tiled([[5]]) != Sharding.maximal(5)
  # Written the same way: equal, with equal hashes (rebuilt, not the same object).
  again = NamedSharding(Mesh.create((2, 4), ('x', 'y')), P('x', None))
  assert a == again and hash(a) == hash(again) and {a: 1}[again] == 1
  tiled = Sharding.tiled([[0, 1], [2, 3]])
  assert tiled == Sharding.tiled(np.array([[0, 1], [2, 3]])) and hash(tiled) == hash(
    Sharding.tiled([[0, 1], [2, 3]])
  )
  assert (
    Sharding.replicated() == Sharding.replicated() and Sharding.replicated() != Sharding.manual()
  )
  # The reduction of a pending reduction is structure; without pending axes it names nothing.
  mesh = Mesh.create((2, 4), ('x', 'y'))
  assert NamedSharding(mesh, P('x'), ('y',), 'max') != NamedSharding(mesh, P('x'), ('y',))
  assert NamedSharding(mesh, P('x'), (), 'max') == NamedSharding(mesh, P('x'))


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_property_hash_consistent_with_equality(data):
  mesh = Mesh.create((2, 2, 2), ('a', 'b', 'c'))
  names = st.sampled_from([None, 'a', 'b', 'c', ('a', 'b'), ('b', 'a'), ('c', 'a')])
  specs = []
  for _ in range(2):
    spec = P(data.draw(names), data.draw(names))
    specs.append(spec if len(set(spec.used_axes())) == len(spec.used_axes()) else P(None, None))
  x, y = (NamedSharding(mesh, s) for s in specs)
  if x == y:
    assert hash(x) == hash(y) and x.is_equivalent_to(y)
  plain_x = Sharding.tiled(x.tile_assignment, x.subgroups) if x.is_tiled else Sharding.replicated()
  assert plain_x != x and plain_x.is_equivalent_to(x)
  if x.is_tiled:
    assert plain_x == Sharding.tiled(x.tile_assignment, x.subgroups)
    assert hash(plain_x) == hash(Sharding.tiled(x.tile_assignment, x.subgroups))


def test_named_equals_tf_mesh_split_layout():
  from tensorflow.python.compiler.xla.experimental import xla_sharding

  device_mesh = np.arange(8).reshape(2, 4)
  from_tf = from_proto(xla_sharding.mesh_split_sharding(device_mesh, [0, -1]).proto)
  assert NamedSharding(MESH, P('data', None)).is_equivalent_to(from_tf)
  assert NamedSharding(MESH, P('data', None)).canonical_key() == from_tf.canonical_key()
  from_tf = from_proto(xla_sharding.mesh_split_sharding(device_mesh, [1, 0]).proto)
  assert NamedSharding(MESH, P('model', 'data')).is_equivalent_to(from_tf)
  assert not NamedSharding(MESH, P('data', 'model')).is_equivalent_to(from_tf)


def test_named_sharding_structure():
  s = NamedSharding(MESH, P(('model', 'data'), None))
  assert s.tile_shape == (8, 1) and s.rank == 2 and s.mesh == MESH
  assert s.tile_assignment.reshape(-1).tolist() == [0, 4, 1, 5, 2, 6, 3, 7]
  assert NamedSharding(MESH, P(None, None)).is_replicated
  partial = NamedSharding(MESH, P('data', None), partial='model')
  assert partial.partial == 'sum' and partial.partial_axes == ('model',)
  assert partial.without_partial() == NamedSharding(MESH, P('data', None))
  assert partial.subgroup_size('partial_sum') == 4


# --- re-expressing on a mesh ---------------------------------------------------------------
@pytest.mark.parametrize(
  'spec',
  [
    P('data', None),
    P(None, 'model'),
    P(('model', 'data'), None),
    P('model', 'data'),
    P(None, None),
  ],
)
def test_named_finds_the_spec(spec):
  s = NamedSharding(MESH, spec)
  plain = Sharding.tiled(s.tile_assignment, s.subgroups) if s.is_tiled else Sharding.replicated()
  back = named_for_rank(plain, MESH, 2)
  assert back == s and back.spec == spec


def test_named_on_permuted_mesh_and_partial():
  s = NamedSharding(MESH3, P('z', ('y', 'x')))
  assert named(Sharding.tiled(s.tile_assignment, s.subgroups), MESH3).spec == P('z', ('y', 'x'))
  p = NamedSharding(MESH3, P('z', None), partial=('x',))
  found = named(Sharding.tiled(p.tile_assignment, p.subgroups), MESH3)
  assert found == p and found.partial_axes == ('x',)
  assert named(Sharding.tiled([[0, 2, 1, 3, 4, 5, 6, 7]]), MESH, reorder=False) is None
  other_order = named(Sharding.tiled([[0, 2, 1, 3, 4, 5, 6, 7]]), MESH)  # its own device order
  assert other_order.mesh.is_reordering_of(MESH) and other_order.mesh != MESH
  assert named(Sharding.maximal(0), MESH) is None and named(Sharding.replicated(), MESH) is None
  assert named_for_rank(Sharding.replicated(), MESH, 3).spec == P(None, None, None)


def test_named_refuses_other_devices():
  with pytest.raises(
    ValueError, match=r'tiled over 4 devices.*mesh Mesh\(data=2, model=4\) holds 8'
  ):
    named(Sharding.tiled([[0, 1], [2, 3]]), MESH)


# --- geometry ----------------------------------------------------------------------------------
def test_shard_bounds_function_uneven():
  assert [shard_bounds(10, 4, i) for i in range(4)] == [(0, 3), (3, 6), (6, 9), (9, 10)]
  assert [shard_bounds(5, 4, i) for i in range(4)] == [(0, 2), (2, 4), (4, 5), (5, 5)]
  assert [shard_bounds(2, 4, i) for i in range(4)] == [(0, 1), (1, 2), (2, 2), (2, 2)]
  assert [shard_bounds(0, 2, i) for i in range(2)] == [(0, 0), (0, 0)]


def test_sharding_geometry_uneven():
  s = NamedSharding(MESH, P('model', None))
  assert s.shard_shape((10, 3)) == (3, 3)
  assert [s.shard_bounds((10, 3), d) for d in range(4)] == [
    ((0, 3), (0, 3)),
    ((3, 6), (0, 3)),
    ((6, 9), (0, 3)),
    ((9, 10), (0, 3)),
  ]
  assert s.shard_bounds((10, 3), 4) == s.shard_bounds((10, 3), 0)  # replica along 'data'
  assert s.shard_offsets((10, 3), 7) == (9, 0)
  assert s.shard_bounds((10, 3), 8) is None  # not a mesh device
  m = Sharding.maximal(3)
  assert m.shard_bounds((4, 5), 3) == ((0, 4), (0, 5)) and m.shard_bounds((4, 5), 0) is None
  assert Sharding.replicated().shard_bounds((4,), 6) == ((0, 4),)
  t = Sharding.tiled([[3, 1], [0, 2]])
  assert t.tile_index(0) == (1, 0) and t.devices_for_tile((0, 1)) == (1,)
  assert t.shard_bounds((3, 1), 2) == ((2, 3), (1, 1))  # an empty shard on a short dim
  assert num_shards(t) == 4 and num_shards(Sharding.replicated()) == 1


# --- helpful errors ----------------------------------------------------------------------------
def test_rank_mismatch_names_sharding_shape_and_fix():
  with pytest.raises(ValueError) as err:
    NamedSharding(MESH, P('data', None)).shard_shape((8, 3, 2))
  message = str(err.value)
  assert "P('data', None)" in message and '(8, 3, 2)' in message and 'one spec entry per' in message
  with pytest.raises(ValueError, match=r'rank 2 but the tensor has shape \(4,\)'):
    Sharding.tiled([[0, 1], [2, 3]]).shard_bounds((4,), 0)


def test_axis_used_twice_and_unknown_axis():
  with pytest.raises(ValueError, match=r"P\('data', 'data'\).*'data' is used twice.*Drop one use"):
    NamedSharding(MESH, P('data', 'data'))
  with pytest.raises(ValueError, match=r"P\(\('model', 'data'\), 'model'\).*'model' is used twice"):
    NamedSharding(MESH, P(('model', 'data'), 'model'))
  with pytest.raises(ValueError, match=r"partial=\('data',\).*'data' is used twice"):
    NamedSharding(MESH, P('data', None), partial='data')
  with pytest.raises(
    ValueError, match=r"unknown mesh axis 'batch'.*\{'data': 2, 'model': 4\}.*or None"
  ):
    NamedSharding(MESH, P('batch', None))


def test_check_devices():
  NamedSharding(MESH, P('data', None)).check_devices(8)
  Sharding.tiled([[3, 1], [0, 2]]).check_devices(4)
  Sharding.replicated().check_devices(8)
  Sharding.maximal(7).check_devices(8)
  with pytest.raises(
    ValueError,
    match=r'tile assignment of shape \(2, 2\) \(4 devices\).*runs on 8 '
    r'devices.*tile assignment over exactly',
  ):
    Sharding.tiled([[3, 1], [0, 2]]).check_devices(8)
  with pytest.raises(
    ValueError,
    match=r'mesh Mesh\(data=2, model=4\) of 8 devices.*runs on 4 devices'
    r'.*build the mesh',
  ):
    NamedSharding(MESH, P(None, None)).check_devices(4, what="variable 'w'")
  with pytest.raises(ValueError, match='device 9.*on 8 devices'):
    Sharding.maximal(9).check_devices(8)
  with pytest.raises(ValueError, match=r'device ids \[0, 1, 2, 4\]'):
    Sharding.tiled([0, 1, 2, 4]).check_devices(4)


def test_tiled_construction_errors():
  with pytest.raises(ValueError, match='distinct and non-negative'):
    Sharding.tiled([[0, 1], [1, 2]])
  with pytest.raises(ValueError, match='names no device'):
    Sharding.tiled(np.zeros((2, 0)))
  with pytest.raises(ValueError, match='Unknown subgroup kind'):
    Sharding.tiled([[0, 1]], ('maximal',))
  with pytest.raises(ValueError, match='different kinds'):
    Sharding.tiled(np.arange(4).reshape(1, 2, 2), ('partial_sum', 'partial_max'))
  with pytest.raises(ValueError, match='cannot hold 2 subgroup dims'):
    Sharding.tiled([0, 1], ('replicated', 'manual'))
  with pytest.raises(ValueError, match='reduction must be one of'):
    NamedSharding(MESH, P('data', None), partial='model', reduction='mean')
