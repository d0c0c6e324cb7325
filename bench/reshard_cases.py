"""Reshard benchmark cases shared by tf_gspmd's reshard search benchmark and the XLA reference.

Pure Python (no TensorFlow, no JAX) so that both `bench/reshard.py` (tf_gspmd's
reshard search, main venv) and `bench/xla_reference.py` (XLA through JAX, a separate
venv) read the very same list.

Each case is a dict:

  name         unique identifier, used to join the two benchmarks' outputs
  mesh_shape   mesh axis sizes, e.g. (2, 4); devices are 0..N-1 in row-major order
  axis_names   one name per mesh axis, e.g. ('x', 'y')
  src_spec     source partition spec: one entry per tensor dim, each None, an
               axis name, or a tuple of axis names (major to minor)
  dst_spec     target partition spec, same form
  src_partial  mesh axes over which the source holds a pending sum (each
               device holds one summand of its shard); () for none
  shape        global tensor shape
  dtype        element type name ('float32')

Sizes that do not divide evenly follow the ceil convention of
`tf_gspmd.sharding.shard_bounds` (and of XLA): every shard holds ceil(n/k) rows
except trailing ones, which are shorter or empty.

Run as a script it prints the cases as JSON.
"""

import json

DTYPE_SIZES = {'float32': 4}

MESH_2X4 = dict(mesh_shape=(2, 4), axis_names=('x', 'y'))
MESH_8 = dict(mesh_shape=(8,), axis_names=('i',))
MESH_2X2X2 = dict(mesh_shape=(2, 2, 2), axis_names=('a', 'b', 'c'))

BIG = (1024, 1024)  # 4 MiB in float32: large enough that bytes moved dominate


def _case(name, mesh, src_spec, dst_spec, shape, src_partial=(), dtype='float32'):
  return dict(
    name=name,
    mesh_shape=tuple(mesh['mesh_shape']),
    axis_names=tuple(mesh['axis_names']),
    src_spec=tuple(src_spec),
    dst_spec=tuple(dst_spec),
    src_partial=tuple(src_partial),
    shape=tuple(shape),
    dtype=dtype,
  )


CASES = [
  # --- 2x4 mesh, 1024x1024 -------------------------------------------------
  _case('2x4_xy_to_yx', MESH_2X4, ('x', 'y'), ('y', 'x'), BIG),
  _case('2x4_move_x_dim0_to_dim1', MESH_2X4, ('x', None), (None, 'x'), BIG),
  _case('2x4_replicated_to_xy', MESH_2X4, (None, None), ('x', 'y'), BIG),
  _case('2x4_xy_to_replicated', MESH_2X4, ('x', 'y'), (None, None), BIG),
  _case('2x4_x_to_xy_minor', MESH_2X4, ('x', None), (('x', 'y'), None), BIG),
  _case('2x4_xy_minor_to_x', MESH_2X4, (('x', 'y'), None), ('x', None), BIG),
  _case('2x4_y_to_x_same_dim', MESH_2X4, ('y', None), ('x', None), BIG),
  _case('2x4_xy_dim0_to_xy_dim1', MESH_2X4, (('x', 'y'), None), (None, ('x', 'y')), BIG),
  _case('2x4_xy_dim0_to_yx_dim0', MESH_2X4, (('x', 'y'), None), (('y', 'x'), None), BIG),
  # --- pending sums (partial results) --------------------------------------
  _case('2x4_partial_y_to_y', MESH_2X4, (None, None), ('y', None), BIG, src_partial=('y',)),
  _case(
    '2x4_partial_y_to_replicated', MESH_2X4, (None, None), (None, None), BIG, src_partial=('y',)
  ),
  _case('2x4_partial_y_x_rows_to_xy', MESH_2X4, ('x', None), ('x', 'y'), BIG, src_partial=('y',)),
  _case(
    '2x4_partial_xy_to_xy_dim0',
    MESH_2X4,
    (None, None),
    (('x', 'y'), None),
    BIG,
    src_partial=('x', 'y'),
  ),
  # --- sizes that do not divide evenly -------------------------------------
  _case('uneven_10_over_4_dim0_to_dim1', MESH_2X4, ('y', None), (None, 'y'), (10, 10)),
  _case('uneven_10_over_4_to_replicated', MESH_2X4, ('y', None), (None, None), (10, 16)),
  _case('uneven_7_over_8_to_replicated', MESH_8, ('i', None), (None, None), (7, 16)),
  _case('uneven_7_over_8_dim0_to_dim1', MESH_8, ('i', None), (None, 'i'), (7, 64)),
  _case('uneven_1_over_2_dim0_to_dim1', MESH_2X4, ('x', None), (None, 'x'), (1, 64)),
  # --- 1-D mesh of 8 -------------------------------------------------------
  _case('1d_gather', MESH_8, ('i', None), (None, None), BIG),
  _case('1d_dim0_to_dim1', MESH_8, ('i', None), (None, 'i'), BIG),
  _case('1d_replicated_to_dim1', MESH_8, (None, None), (None, 'i'), BIG),
  _case('1d_partial_to_dim0', MESH_8, (None, None), ('i', None), BIG, src_partial=('i',)),
  _case('1d_vector_gather', MESH_8, ('i',), (None,), (1 << 20,)),
  # --- 3-D mesh 2x2x2 ------------------------------------------------------
  _case('3d_rotate_axes', MESH_2X2X2, ('a', 'b', 'c'), ('b', 'c', 'a'), (128, 128, 128)),
  _case('3d_ab_c_to_c_ab', MESH_2X2X2, (('a', 'b'), 'c'), ('c', ('a', 'b')), BIG),
  _case('3d_ab_dim0_to_ba_dim0', MESH_2X2X2, (('a', 'b'), None), (('b', 'a'), None), BIG),
  _case('3d_abc_to_replicated', MESH_2X2X2, (('a', 'b', 'c'), None), (None, None), BIG),
  _case('3d_partial_c_to_ac_b', MESH_2X2X2, ('a', 'b'), (('a', 'c'), 'b'), BIG, src_partial=('c',)),
  _case(
    '3d_partial_bc_to_replicated',
    MESH_2X2X2,
    ('a', None),
    (None, None),
    BIG,
    src_partial=('b', 'c'),
  ),
]


def spec_axes(spec) -> tuple:
  """Every mesh axis a spec uses, in order."""
  axes = []
  for entry in spec:
    if entry is None:
      continue
    axes.extend((entry,) if isinstance(entry, str) else entry)
  return tuple(axes)


def validate_case(case: dict) -> None:
  """Raise ValueError naming the case when it is not a well-formed reshard."""
  name = case.get('name', '?')
  axis_names = tuple(case['axis_names'])
  if len(axis_names) != len(case['mesh_shape']):
    raise ValueError(
      f'case {name}: mesh_shape {case["mesh_shape"]} and axis_names {axis_names} differ in length.'
    )
  if case['dtype'] not in DTYPE_SIZES:
    raise ValueError(f'case {name}: dtype {case["dtype"]!r} is not one of {sorted(DTYPE_SIZES)}.')
  for which in ('src_spec', 'dst_spec'):
    spec = case[which]
    if len(spec) != len(case['shape']):
      raise ValueError(
        f'case {name}: {which} {spec} has {len(spec)} entries for a rank-'
        f'{len(case["shape"])} tensor {case["shape"]}.'
      )
    used = spec_axes(spec) + (tuple(case['src_partial']) if which == 'src_spec' else ())
    unknown = [a for a in used if a not in axis_names]
    if unknown:
      raise ValueError(f'case {name}: {which} uses axes {unknown} not in mesh {axis_names}.')
    if len(set(used)) != len(used):
      raise ValueError(
        f'case {name}: {which} (with src_partial {case["src_partial"]}) uses an axis twice: {used}.'
      )


def normalize_case(case: dict) -> dict:
  """A case read back from JSON (lists everywhere) in the tuple form used here; validated."""

  def entry(e):
    return e if e is None or isinstance(e, str) else tuple(e)

  out = dict(case)
  for key in ('mesh_shape', 'axis_names', 'src_partial', 'shape'):
    out[key] = tuple(case.get(key, ()))
  for key in ('src_spec', 'dst_spec'):
    out[key] = tuple(entry(e) for e in case[key])
  out.setdefault('dtype', 'float32')
  validate_case(out)
  return out


def case_by_name(name: str) -> dict:
  for case in CASES:
    if case['name'] == name:
      return case
  raise KeyError(f'no reshard case named {name!r}; known: {[c["name"] for c in CASES]}')


def _check_all() -> None:
  names = [c['name'] for c in CASES]
  if len(set(names)) != len(names):
    raise ValueError(f'reshard case names must be unique: {names}')
  for case in CASES:
    validate_case(case)


_check_all()

if __name__ == '__main__':
  print(json.dumps(CASES, indent=1))
