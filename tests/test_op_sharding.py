"""OpSharding conversion: exact round trips for what TF writes, the iota form, and a property test.

The property test draws shardings of every kind on meshes of up to 3 dims and
64 devices and checks (1) Sharding -> OpSharding -> Sharding keeps ==, hash,
repr and the proto bytes, and (2) the shards of random global shapes (uneven,
and smaller than the shard count too) cover every element once per replica.
"""

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from tensorflow.compiler.xla import xla_data_pb2
from tensorflow.python.compiler.xla.experimental import xla_sharding

from tf_gspmd import *  # noqa: F401,F403  (repr strings are evaluated in this namespace)
from tf_gspmd import Mesh, NamedSharding, P, Sharding
from tf_gspmd.op_sharding import from_proto, to_proto
from tf_gspmd.sharding import named_for_rank

OpSharding = xla_data_pb2.OpSharding
MESH_2x4 = np.arange(8).reshape(2, 4)
MESH_2x2x2 = np.array([[[5, 2], [7, 0]], [[1, 6], [3, 4]]])

TF_SHARDINGS = {
  'replicate': xla_sharding.Sharding.replicate(),
  'manual': xla_sharding.Sharding.manual(),
  'assign_device': xla_sharding.Sharding.assign_device(5),
  'split': xla_sharding.Sharding.split(None, 1, 4, input_shape=[3, 8]),
  'tile': xla_sharding.Sharding.tile(np.array([[1, 0, 7], [3, 2, 4]])),
  'partial_tile': xla_sharding.Sharding.partial_tile(np.array([[[1, 0]], [[3, 2]]])),
  'subgroup_tile': xla_sharding.Sharding.subgroup_tile(
    np.arange(8).reshape(2, 2, 2), [OpSharding.MANUAL, OpSharding.REPLICATED]
  ),
  'mesh_split': xla_sharding.mesh_split_sharding(MESH_2x4, [1, 0]),
  'mesh_split_unused_axis': xla_sharding.mesh_split_sharding(MESH_2x4, [0, -1]),
  'mesh_split_3d_unused_axes': xla_sharding.mesh_split_sharding(MESH_2x2x2, [-1, 2, -1]),
  'mesh_split_manual': xla_sharding.mesh_split_sharding(MESH_2x2x2, [0, -1], manual_mesh_dims=[2]),
  'mesh_split_manual_all': xla_sharding.mesh_split_sharding(
    MESH_2x2x2, [1, 0], manual_mesh_dims=[2]
  ),
  'mesh_split_two_manual': xla_sharding.mesh_split_sharding(
    MESH_2x2x2, [-1], manual_mesh_dims=[2, 0]
  ),
}


@pytest.mark.parametrize('name', sorted(TF_SHARDINGS))
def test_exact_round_trip_of_tf_xla_sharding(name):
  proto = TF_SHARDINGS[name].proto
  s = from_proto(proto)
  assert to_proto(s).SerializeToString() == proto.SerializeToString()
  assert from_proto(proto.SerializeToString()) == s  # serialized bytes read too
  assert eval(repr(s)) == s


def test_what_tf_shardings_mean():
  s = {name: from_proto(tf.proto) for name, tf in TF_SHARDINGS.items()}
  assert s['replicate'].is_equivalent_to(Sharding.replicated())
  assert s['manual'].is_equivalent_to(Sharding.manual())
  assert s['assign_device'].is_equivalent_to(Sharding.maximal(5))
  assert s['split'].is_equivalent_to(Sharding.tiled([[0, 1, 2, 3]]))
  mesh = Mesh(MESH_2x4, ('data', 'model'))
  assert s['mesh_split'].is_equivalent_to(NamedSharding(mesh, P('model', 'data')))
  assert s['mesh_split_unused_axis'].is_equivalent_to(NamedSharding(mesh, P('data', None)))
  mesh3 = Mesh(MESH_2x2x2, ('x', 'y', 'z'))
  assert s['mesh_split_3d_unused_axes'].is_equivalent_to(NamedSharding(mesh3, P(None, 'z', None)))
  assert s['mesh_split_manual'].subgroups == ('manual', 'replicated')
  assert s['mesh_split_manual'].tile_shape == (2, 1)
  assert s['mesh_split_two_manual'].subgroups == ('manual', 'manual', 'replicated')


def iota_proto(dims, reshape, perm, **extra):
  return OpSharding(
    type=OpSharding.OTHER,
    tile_assignment_dimensions=dims,
    iota_reshape_dims=reshape,
    iota_transpose_perm=perm,
    **extra,
  )


@pytest.mark.parametrize(
  'proto, expected',
  [
    (iota_proto([2, 4], [8], [0]), np.arange(8).reshape(2, 4)),
    (iota_proto([2, 4], [4, 2], [1, 0]), np.arange(8).reshape(4, 2).T),
    (
      iota_proto([2, 1, 4], [2, 4], [1, 0], replicate_on_last_tile_dim=True),
      np.arange(8).reshape(2, 4).T.reshape(2, 1, 4),
    ),
    (
      iota_proto([2, 2, 2], [2, 2, 2], [2, 0, 1], last_tile_dims=[OpSharding.MANUAL]),
      np.arange(8).reshape(2, 2, 2).transpose(2, 0, 1),
    ),
  ],
)
def test_iota_form_round_trip(proto, expected):
  s = from_proto(proto)
  assert np.array_equal(s.tile_assignment, expected)
  assert to_proto(s).SerializeToString() == proto.SerializeToString()
  explicit = to_proto(s, iota=False)
  assert list(explicit.tile_assignment_devices) == expected.reshape(-1).tolist()
  assert from_proto(explicit) == s


def test_to_proto_finds_iota_for_named_shardings():
  mesh = Mesh.create((2, 4), ('data', 'model'))
  s = NamedSharding(mesh, P('model', None))
  proto = to_proto(s, iota=True)
  assert list(proto.iota_reshape_dims) == [2, 4] and list(proto.iota_transpose_perm) == [1, 0]
  assert not proto.tile_assignment_devices and from_proto(proto).is_equivalent_to(s)


def test_from_proto_on_a_mesh():
  mesh = Mesh(MESH_2x4, ('data', 'model'))
  proto = TF_SHARDINGS['mesh_split_unused_axis'].proto
  s = from_proto(proto, mesh=mesh)
  assert isinstance(s, NamedSharding) and s.spec == P('data', None)
  assert to_proto(s).SerializeToString() == proto.SerializeToString()
  # Not expressible on this mesh, or tiled over other devices: a plain Sharding.
  assert type(from_proto(TF_SHARDINGS['tile'].proto, mesh=mesh)) is Sharding
  assert type(from_proto(TF_SHARDINGS['partial_tile'].proto, mesh=mesh)) is Sharding


def test_tuple_and_errors():
  tup = OpSharding(
    type=OpSharding.TUPLE,
    tuple_shardings=[OpSharding(type=OpSharding.REPLICATED), TF_SHARDINGS['split'].proto],
  )
  assert from_proto(tup, tuple_index=1) == Sharding.tiled([[0, 1, 2, 3]])
  with pytest.raises(ValueError, match='pass tuple_index'):
    from_proto(tup)
  with pytest.raises(ValueError, match='tuple_index 2 is out of range.*2 outputs'):
    from_proto(tup, tuple_index=2)
  with pytest.raises(ValueError, match=r'dims \[2, 2\] hold 4 devices but 3'):
    from_proto(
      OpSharding(
        type=OpSharding.OTHER, tile_assignment_dimensions=[2, 2], tile_assignment_devices=[0, 1, 2]
      )
    )
  with pytest.raises(ValueError, match="last_tile_dims \\['MAXIMAL'\\]"):
    from_proto(
      OpSharding(
        type=OpSharding.OTHER,
        tile_assignment_dimensions=[2, 2],
        tile_assignment_devices=[0, 1, 2, 3],
        last_tile_dims=[OpSharding.MAXIMAL],
      )
    )
  mesh = Mesh.create((2, 4), ('data', 'model'))
  with pytest.raises(ValueError, match='pending sum reduction'):
    to_proto(NamedSharding(mesh, P('data', None), partial='model'))


# --- property test -------------------------------------------------------------------------------
AXES = ('a', 'b', 'c')
SUBGROUPS = [
  (),
  ('replicated',),
  ('manual',),
  ('manual', 'replicated'),
  ('replicated', 'replicated'),
  ('manual', 'manual', 'replicated'),
]


@st.composite
def meshes(draw):
  sizes = []
  for _ in range(draw(st.integers(1, 3))):
    room = 64 // math.prod(sizes)
    sizes.append(draw(st.sampled_from([n for n in (1, 2, 2, 3, 4, 4, 8) if n <= room])))
  n = math.prod(sizes)
  order = np.arange(n) if draw(st.booleans()) else np.array(draw(st.permutations(range(n))))
  return Mesh(order.reshape(sizes), AXES[: len(sizes)])


@st.composite
def named_shardings(draw, with_partial=False):
  """Specs with multi-axis dims, unused (replicated) axes and, optionally, pending reductions.

  Only axes of size > 1 are named, so the spec read back on the mesh is unique.
  """
  mesh = draw(meshes())
  rank = draw(st.sampled_from([0, 1, 1, 2, 2, 3]))
  dims, partial = [[] for _ in range(rank)], []
  for axis in draw(st.permutations([a for a in mesh.axis_names if mesh.axis_size(a) > 1])):
    where = draw(st.integers(-2 if with_partial else -1, rank - 1))
    if where >= 0:
      dims[where].append(axis)
    elif where == -2:
      partial.append(axis)
  return NamedSharding(mesh, P(*[tuple(d) or None for d in dims]), partial)


def factor(draw, n, parts):
  """`parts` positive ints whose product is n, drawn at random."""
  dims = []
  for _ in range(parts - 1):
    d = draw(st.sampled_from([k for k in range(1, n + 1) if n % k == 0]))
    dims.append(d)
    n //= d
  return dims + [n]


@st.composite
def tiled_shardings(draw):
  """Tile assignments of random shape over a random permutation of 1..64 devices."""
  n = draw(st.integers(1, 64))
  subgroups = draw(st.sampled_from(SUBGROUPS))
  rank = draw(st.integers(0 if subgroups else 1, 3))
  tile = np.array(draw(st.permutations(range(n)))).reshape(factor(draw, n, rank + len(subgroups)))
  spelled_as_last_tile_dims = subgroups == ('replicated',) and draw(st.booleans())
  return Sharding.tiled(
    tile, subgroups, proto_style=(None, True) if spelled_as_last_tile_dims else None
  )


# Weighted towards tiled shardings: the constant kinds need few examples.
any_sharding = st.one_of(
  named_shardings(),
  named_shardings(),
  named_shardings(),
  tiled_shardings(),
  tiled_shardings(),
  tiled_shardings(),
  st.builds(Sharding.maximal, st.integers(0, 63)),
  st.just(Sharding.replicated()),
  st.just(Sharding.manual()),
)


@st.composite
def global_shapes(draw, sharding):
  """A shape the sharding applies to: sizes around the tile counts, uneven and too small too."""
  tiles = sharding.tile_shape if sharding.rank is not None else (1,) * draw(st.integers(0, 3))
  return tuple(draw(st.integers(0, 2 * t + 2)) for t in tiles)


def candidate_devices(s):
  """Every device of the sharding plus one it does not name (any 8 when it names none)."""
  if not s.devices:
    return tuple(range(8))  # replicated or manual: every device holds the whole tensor
  return s.devices + (max(s.devices) + 1,)


def check_cover(s, shape):
  """Shards cover each element once per replica; holders are exactly the named devices."""
  counts = np.zeros(shape, dtype=np.int64)
  holders = []
  padded = s.shard_shape(shape)
  for d in candidate_devices(s):
    bounds = s.shard_bounds(shape, d)
    if bounds is None:
      continue
    holders.append(d)
    assert all(0 <= hi - lo <= p for (lo, hi), p in zip(bounds, padded)), (d, bounds, padded)
    counts[tuple(slice(lo, hi) for lo, hi in bounds)] += 1
  expected_holders = s.devices or candidate_devices(s)
  assert sorted(holders) == sorted(expected_holders)
  tiles = math.prod(s.tile_shape) if s.tile_shape else 1
  assert len(holders) % tiles == 0
  np.testing.assert_array_equal(counts, len(holders) // tiles)


def read_back(s, proto):
  if isinstance(s, NamedSharding):
    return named_for_rank(from_proto(proto), s.mesh, s.rank)
  return from_proto(proto)


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_property_round_trip_and_cover(data):
  s = data.draw(any_sharding, label='sharding')
  event(f'{type(s).__name__} {s.kind} {"/".join(s.subgroups)}')
  if isinstance(s, NamedSharding) and any(isinstance(e, tuple) for e in s.spec):
    event('a dim split over several mesh axes')
  for iota in (None, True):
    proto = to_proto(s, iota=iota)
    if proto.iota_reshape_dims:
      event('iota form')
    back = read_back(s, proto)
    assert back == s and hash(back) == hash(s)
    assert repr(back) == repr(s)
    assert to_proto(back, iota=iota).SerializeToString() == proto.SerializeToString()
  assert eval(repr(s)) == s
  shape = data.draw(global_shapes(s), label='shape')
  check_cover(s, shape)
  if s.is_tiled:  # the named geometry agrees with the tile-assignment geometry
    plain = Sharding.tiled(s.tile_assignment, s.subgroups)
    assert all(
      plain.shard_bounds(shape, d) == s.shard_bounds(shape, d) for d in candidate_devices(s)
    )


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_property_pending_reductions(data):
  s = data.draw(named_shardings(with_partial=True), label='sharding')
  assert eval(repr(s)) == s
  plain = Sharding.tiled(s.tile_assignment, s.subgroups) if s.is_tiled else Sharding.replicated()
  assert plain.is_equivalent_to(s) and named_for_rank(plain, s.mesh, s.rank).is_equivalent_to(s)
  check_cover(s, data.draw(global_shapes(s), label='shape'))
