"""Tests for bench/xla_reference.py: XLA's own reshards as the reshard search's reference.

Two parts. The HLO reader (replica-group forms, bytes rules, async pairs) is
pure Python and runs here, in the TensorFlow venv, on hand-written HLO with
groups and bytes worked out by hand. The measurements themselves need JAX,
which lives in a separate venv: they run the script through a subprocess with
$TF_GSPMD_JAX_PYTHON or /work/jaxenv/bin/python and are skipped only when
neither exists.
"""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, 'bench', 'xla_reference.py')
MIB4 = 1024 * 1024 * 4  # a 1024x1024 float32 tensor
SHARD8 = MIB4 // 8


def _load(name, path):
  spec = importlib.util.spec_from_file_location(name, path)
  module = importlib.util.module_from_spec(spec)
  sys.path.insert(0, os.path.dirname(path))
  try:
    spec.loader.exec_module(module)
  finally:
    sys.path.pop(0)
  return module


xr = _load('xla_reference', SCRIPT)
cases_mod = _load('reshard_cases', os.path.join(ROOT, 'bench', 'reshard_cases.py'))


def _jax_python():
  for candidate in (os.environ.get('TF_GSPMD_JAX_PYTHON'), '/work/jaxenv/bin/python'):
    if candidate and os.path.exists(candidate):
      return candidate
  return None


def _has_jax(python):
  return (
    python is not None
    and subprocess.run([python, '-c', 'import jax'], capture_output=True).returncode == 0
  )


JAX_PYTHON = _jax_python()
needs_jax = pytest.mark.skipif(
  not _has_jax(JAX_PYTHON),
  reason='no Python with JAX: set TF_GSPMD_JAX_PYTHON or create /work/jaxenv '
  '(python3 -m venv /work/jaxenv && /work/jaxenv/bin/pip install jax jaxlib)',
)


def _run(args, python=None, env_extra=None):
  env = dict(os.environ)
  env.pop('XLA_FLAGS', None)  # the script sets its own device count
  env.update(env_extra or {})
  proc = subprocess.run(
    [python or JAX_PYTHON, SCRIPT] + list(args),
    capture_output=True,
    text=True,
    env=env,
    timeout=600,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  return json.loads(proc.stdout), proc.stderr


# ---------------------------------------------------------------------------
# cases
# ---------------------------------------------------------------------------


def test_cases_cover_the_required_kinds():
  cases = cases_mod.CASES
  assert len(cases) >= 22
  by_name = {c['name']: c for c in cases}
  assert by_name['2x4_xy_to_yx']['src_spec'] == ('x', 'y')
  assert by_name['2x4_xy_to_yx']['dst_spec'] == ('y', 'x')
  assert any(c['src_partial'] and all(e is None for e in c['dst_spec']) for c in cases)
  assert any(c['src_partial'] == ('y',) and c['dst_spec'] == ('y', None) for c in cases)
  assert any(c['mesh_shape'] == (8,) for c in cases)
  assert any(c['mesh_shape'] == (2, 2, 2) for c in cases)
  uneven = {
    (c['shape'][0], c['mesh_shape'][list(c['axis_names']).index(c['src_spec'][0])])
    for c in cases
    if c['name'].startswith('uneven') and isinstance(c['src_spec'][0], str)
  }
  assert {(10, 4), (7, 8), (1, 2)} <= uneven


def test_case_validation_names_the_problem():
  bad = dict(cases_mod.CASES[0], name='bad', src_spec=('x', 'x'))
  with pytest.raises(ValueError, match='bad.*twice'):
    cases_mod.validate_case(bad)
  with pytest.raises(ValueError, match='not in mesh'):
    cases_mod.validate_case(dict(cases_mod.CASES[0], dst_spec=('z', None)))
  round_trip = [cases_mod.normalize_case(c) for c in json.loads(json.dumps(cases_mod.CASES))]
  assert round_trip == cases_mod.CASES


# ---------------------------------------------------------------------------
# HLO reader (pure Python)
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
  'attrs, groups',
  [
    # Mesh form with an iota device order and a minor sub-axis (from this XLA's
    # P('x','y') -> P('y','x') on 2x4): devices arange(8).reshape(2,2,2)
    # .transpose(0,2,1) laid out as 4x2; axis_0 splits into 2x2 and the groups
    # span its minor half.
    (
      "replica_groups=mesh['axis_0'=4,'axis_1'=2], device_ids=([2,2,2]T(0,2,1)) {'axis_0':(2)2}",
      [[0, 1], [2, 3], [4, 5], [6, 7]],
    ),
    (
      "replica_groups=mesh['axis_0'=1,'axis_1'=4,'axis_2'=2], device_ids=([2,4]T(1,0)) "
      "{'axis_1'}, dimensions={0}",
      [[0, 1, 2, 3], [4, 5, 6, 7]],
    ),
    (
      "replica_groups=mesh['axis_0'=1,'axis_1'=2,'axis_2'=4] {'axis_1'}",
      [[0, 4], [1, 5], [2, 6], [3, 7]],
    ),
    # two sub-axes of one axis, in both orders: 8 -> 2x2x2, groups over dims 0 and 2
    ("replica_groups=mesh['a'=8] {'a':(1)2,'a':(4)2}", [[0, 1, 4, 5], [2, 3, 6, 7]]),
    ("replica_groups=mesh['a'=8] {'a':(4)2,'a':(1)2}", [[0, 4, 1, 5], [2, 6, 3, 7]]),
    ("replica_groups=mesh['a'=2,'b'=4] {'b','a'}", [[0, 4, 1, 5, 2, 6, 3, 7]]),
    ('replica_groups=[2,4]<=[4,2]T(1,0), dimensions={0}', [[0, 2, 4, 6], [1, 3, 5, 7]]),
    ('replica_groups=[4,2]<=[8], to_apply=%add', [[0, 1], [2, 3], [4, 5], [6, 7]]),
    ('replica_groups={{0,2},{1,3},{4,6},{5,7}}, dimensions={1}', [[0, 2], [1, 3], [4, 6], [5, 7]]),
    ('replica_groups={}, to_apply=%add', [list(range(8))]),
  ],
)
def test_replica_group_forms(attrs, groups):
  assert xr.parse_replica_groups(attrs, 8) == groups


def test_unreadable_replica_groups_raise():
  with pytest.raises(ValueError, match='cannot read replica groups'):
    xr.parse_replica_groups('channel_id=1, dimensions={0}', 8)
  with pytest.raises(ValueError, match='only the iota'):
    xr.parse_replica_groups("replica_groups=mesh['a'=2], device_ids=({1,0}) {'a'}", 2)


@pytest.mark.parametrize(
  'op, operands, results, g, expected',
  [
    ('all-gather', ['f32[128,1024]'], ['f32[1024,1024]'], 8, 7 * 128 * 1024 * 4),
    ('all-to-all', ['f32[128,1,128]'] * 8, ['(...)'], 8, 7 * 128 * 128 * 4),
    ('all-to-all', ['f32[8,8]'], ['f32[8,8]'], 2, 128),
    ('reduce-scatter', ['f32[16,8]'], ['f32[4,8]'], 4, 3 * 4 * 8 * 4),
    ('all-reduce', ['f32[1024,1024]'], ['f32[1024,1024]'], 4, 2 * 3 * MIB4 // 4),
    ('all-reduce', ['f32[10]'], ['f32[10]'], 4, 2 * 3 * 3 * 4),  # ceil(10/4) = 3 elems/piece
    ('all-gather', ['f32[4]'], ['f32[4]'], 1, 0),
  ],
)
def test_bytes_rules(op, operands, results, g, expected):
  assert xr.received_bytes(op, operands, results, g) == expected


ASYNC_HLO = """HloModule m, is_scheduled=true

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

ENTRY %main (p: f32[4,8]) -> f32[16,8] {
  %p = f32[4,8]{1,0} parameter(0)
  %ags = (f32[4,8]{1,0}, f32[16,8]{1,0}) all-gather-start(%p), channel_id=1, replica_groups=[2,4]<=[8], dimensions={0}, use_global_device_ids=true
  %agd = f32[16,8]{1,0} all-gather-done(%ags)
  %cp = f32[16,8]{1,0} collective-permute(%agd), channel_id=2, source_target_pairs={{0,0},{1,2},{2,1}}
  ROOT %ar = f32[16,8]{1,0} all-reduce(%cp), channel_id=3, replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%add
}
"""


def test_analyze_hlo_counts_async_once_and_permute_receivers_only():
  result = xr.analyze_hlo(ASYNC_HLO, 8)
  ops = [c['op'] for c in result['xla_collectives']]
  assert ops == ['all-gather', 'collective-permute', 'all-reduce']
  gather, permute, reduce = result['xla_collectives']
  assert gather['result_shapes'] == ['f32[16,8]'] and gather['group_size'] == 4
  assert gather['bytes_received_per_device'] == 512 - 128
  assert permute['bytes_received_per_device'] == 512  # devices 1 and 2; 0 -> 0 is local
  assert reduce['bytes_received_per_device'] == 2 * 7 * 16 * 4
  # devices 1 and 2 receive the permute on top of the group collectives
  assert result['xla_bytes'] == 384 + 512 + 896
  assert result['xla_peak'] == 512 and result['src_shard_bytes'] == 128
  assert result['dst_shard_bytes'] == 512


FP8_HLO = """HloModule m, entry_computation_layout={(f8e4m3fn[4,8]{1,0})->f8e4m3fn[16,8]{1,0}}

ENTRY %main (p: f8e4m3fn[4,8]) -> f8e4m3fn[16,8] {
  %p = f8e4m3fn[4,8]{1,0} parameter(0)
  ROOT %g = f8e4m3fn[16,8]{1,0} all-gather(%p), replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={0}
}
"""


def test_one_dtype_table_reads_fp8_on_both_sides():
  """The bench reads tf_gspmd's table (it cannot import TensorFlow): one table, fp8 in it, and
  an fp8 all-gather measured alike by both (3 of 4 blocks of 32 bytes)."""
  from tf_gspmd.xla_bridge import reference_partitioner

  assert xr.DTYPE_BYTES == reference_partitioner._DTYPE_BYTES
  assert {'f8e4m3fn', 'f8e5m2'} <= set(xr.DTYPE_BYTES)
  (bench,) = xr.analyze_hlo(FP8_HLO, 8)['xla_collectives']
  (ours,) = reference_partitioner.partitioned_collectives(FP8_HLO, 8)
  assert bench['bytes_received_per_device'] == ours['bytes'] == 96


def test_unmeasured_communication_is_an_error():
  hlo = ASYNC_HLO.replace(
    '%cp = f32[16,8]{1,0} collective-permute(%agd), channel_id=2, '
    'source_target_pairs={{0,0},{1,2},{2,1}}',
    '%cp = f32[16,8]{1,0} collective-broadcast(%agd), channel_id=2, replica_groups={}',
  )
  with pytest.raises(ValueError, match='collective-broadcast'):
    xr.analyze_hlo(hlo, 8)


# ---------------------------------------------------------------------------
# XLA measurements (need JAX)
# ---------------------------------------------------------------------------


@pytest.fixture(scope='module')
def records():
  out, table = _run(['--table'])
  return {r['name']: r for r in out}


def _ops(record):
  return [c['op'] for c in record['xla_collectives']]


@needs_jax
def test_every_case_is_measured_and_numerically_checked(records):
  assert list(records) == [c['name'] for c in cases_mod.CASES]
  for name, r in records.items():
    assert r['checked'] in ('exact', 'normwise<=1e-05'), name
    assert r['xla_peak'] >= max(r['src_shard_bytes'], r['dst_shard_bytes']), name
    assert r['xla_bytes'] >= max(
      (c['bytes_received_per_device'] for c in r['xla_collectives']), default=0
    ), name
  # Both checks ran: pending sums against numpy's float64 sum by the oracle, the rest exactly.
  assert {r['checked'] for r in records.values()} == {'exact', 'normwise<=1e-05'}


@needs_jax
def test_replicated_to_sharded_moves_nothing(records):
  for name in ('2x4_replicated_to_xy', '1d_replicated_to_dim1', '2x4_x_to_xy_minor'):
    assert records[name]['xla_bytes'] == 0 and records[name]['xla_collectives'] == [], name


@needs_jax
def test_sharded_to_replicated_gathers_seven_eighths(records):
  for name in ('1d_gather', '2x4_xy_to_replicated', '3d_abc_to_replicated', '1d_vector_gather'):
    assert records[name]['xla_bytes'] == 7 * MIB4 // 8, name
    assert set(_ops(records[name])) == {'all-gather'}, name
    assert records[name]['xla_peak'] == MIB4, name


@needs_jax
def test_transposing_the_mesh_axes_avoids_a_full_gather(records):
  r = records['2x4_xy_to_yx']
  assert set(_ops(r)) <= {'all-to-all', 'collective-permute'} and _ops(r)
  assert r['xla_bytes'] < 7 * MIB4 // 8
  assert r['xla_peak'] <= 2 * SHARD8


@needs_jax
def test_moving_a_sharded_dim_is_one_all_to_all(records):
  r = records['2x4_move_x_dim0_to_dim1']
  assert _ops(r) == ['all-to-all'] and r['xla_collectives'][0]['group_size'] == 2
  assert r['xla_bytes'] == MIB4 // 2 // 2  # half of a 2 MiB shard
  assert records['1d_dim0_to_dim1']['xla_bytes'] == 7 * SHARD8 // 8


@needs_jax
def test_same_tiles_new_device_order_is_a_permute(records):
  for name in ('2x4_xy_dim0_to_yx_dim0', '3d_ab_dim0_to_ba_dim0', '3d_rotate_axes'):
    r = records[name]
    assert _ops(r) == ['collective-permute'], name
    assert r['xla_bytes'] == r['src_shard_bytes'], name


@needs_jax
def test_pending_sums_are_reduced_over_the_partial_axes(records):
  for case in cases_mod.CASES:
    if not case['src_partial']:
      continue
    r = records[case['name']]
    sizes = dict(zip(case['axis_names'], case['mesh_shape']))
    group = 1
    for a in case['src_partial']:
      group *= sizes[a]
    reductions = [c for c in r['xla_collectives'] if c['op'] in ('all-reduce', 'reduce-scatter')]
    assert reductions and reductions[0]['group_size'] == group, case['name']


@needs_jax
def test_uneven_sizes_use_ceil_shards(records):
  # 10 rows over 4: shards of 3 rows (the last one padded), as tf_gspmd lays them out
  r = records['uneven_10_over_4_to_replicated']
  assert r['xla_collectives'][0]['operand_shapes'] == ['f32[3,16]']
  assert r['xla_bytes'] == 3 * 3 * 16 * 4
  assert records['uneven_7_over_8_to_replicated']['xla_bytes'] == 7 * 16 * 4


@needs_jax
def test_uneven_control_programs_emit_no_collectives(tmp_path):
  # src -> src through the same pad/slice wrapper: anything counted would be overhead.
  control = [
    dict(c, name=c['name'] + '_control', dst_spec=c['src_spec'])
    for c in cases_mod.CASES
    if c['name'].startswith('uneven')
  ]
  path = tmp_path / 'control.json'
  path.write_text(json.dumps(control))
  out, _ = _run(['--cases-json', str(path)])
  assert [r['name'] for r in out] == [c['name'] for c in control]
  for r in out:
    assert r['xla_collectives'] == [] and r['xla_bytes'] == 0, r['name']


@needs_jax
def test_script_reexecutes_under_the_jax_python():
  # As `make bench` runs it: with a Python that has no JAX (this test's own).
  out, _ = _run(
    ['--cases', '1d_gather'], python=sys.executable, env_extra={'TF_GSPMD_JAX_PYTHON': JAX_PYTHON}
  )
  assert [r['name'] for r in out] == ['1d_gather'] and out[0]['xla_bytes'] == 7 * MIB4 // 8
