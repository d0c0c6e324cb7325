"""bench/reshard_xla.py in its quick mode: tf_gspmd's reshard programs beside XLA's own.

Three cases of different kinds (an axis swap, a pending sum, an uneven size) at
128 rows: both programs must produce numpy's values exactly, both must have been
compiled, run and timed, and each must hold the collectives a reshard needs.
"""

import json
import os
import sys

import numpy as np
import pytest

pytest.importorskip('jax')

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, 'bench'))
import reshard_xla  # noqa: E402


@pytest.fixture(scope='module')
def quick_run(tmp_path_factory):
  path = tmp_path_factory.mktemp('reshard_xla') / 'quick.json'
  status = reshard_xla.main(['--quick', '--reps', '3', '--json', str(path)])
  with open(path) as f:
    return status, json.load(f)


def test_quick_run_checks_both_programs_exactly(quick_run):
  status, out = quick_run
  assert status == 0 and out['failures'] == []
  results = {r['name']: r for r in out['results']}
  assert sorted(results) == sorted(reshard_xla.QUICK_CASES)
  for name, r in results.items():
    for side in ('ours', 'xla'):
      assert r[side]['exact'], (name, side)
      assert r['step_ms'][side] > 0 and r['step_ms'][f'{side}_min'] > 0, (name, side)
      assert r[side]['collectives']['count'] >= 1, (name, side, r[side]['collectives'])
      assert r[side]['peak'] >= r['src_bytes'] + r['dst_bytes'], (name, side)
      assert r[side]['max_buffer'] >= max(r['src_bytes'], r['dst_bytes']), (name, side)
    assert r['ratio'] == pytest.approx(r['step_ms']['xla'] / r['step_ms']['ours'])
  # The pending sum: tf_gspmd resolves it with a reduce-scatter into the target shards.
  assert results['2x4_partial_y_to_y']['ours']['collectives']['kinds'] == {'reduce-scatter': 1}


def test_programs_expect_what_numpy_computes():
  case = reshard_xla.quick_case(reshard_xla.reshard_cases.case_by_name('2x4_partial_y_to_y'))
  program = reshard_xla.ReshardProgram(case)
  assert program.x.shape == (4, 128, 128)  # one summand per device of 'y' (4)
  np.testing.assert_array_equal(program.want, program.x.sum(axis=0))
  assert program.src_bytes == 4 * 128 * 128  # one whole summand per device
  assert program.dst_bytes == 4 * 128 * 128 // 4  # rows over y=4
  uneven = reshard_xla.ReshardProgram(
    reshard_xla.reshard_cases.case_by_name('uneven_10_over_4_dim0_to_dim1')
  )
  assert uneven.x.shape == (12, 10) and uneven.want.shape == (10, 12)  # padded to 4 shards
  np.testing.assert_array_equal(uneven.want[:, :10], uneven.x[:10])
  assert not uneven.want[:, 10:].any()


def test_largest_buffer_reads_the_entry_computation_only():
  hlo = '\n'.join(
    [
      'HloModule m',
      '%fused (p: f32[1024,1024]) -> f32[1024,1024] {',
      '  %p = f32[1024,1024]{1,0} parameter(0)',
      '  ROOT %n = f32[1024,1024]{1,0} negate(%p)',
      '}',
      'ENTRY %main (a: f32[8,4]) -> (f32[8,4], s32[3]) {',
      '  %a = f32[8,4]{1,0} parameter(0)',
      '  %g = f32[16,4]{1,0} all-gather(%a), replica_groups={{0,1}}, dimensions={0}',
      '  %i = s32[3]{0} iota(), iota_dimension=0',
      '  ROOT %t = (f32[8,4]{1,0}, s32[3]{0}) tuple(%a, %i)',
      '}',
    ]
  )
  assert reshard_xla.largest_buffer(hlo) == 16 * 4 * 4
  with pytest.raises(ValueError, match='no ENTRY'):
    reshard_xla.largest_buffer('HloModule m')


def test_geometric_mean():
  assert reshard_xla.geometric_mean([2.0, 0.5, 1.0]) == pytest.approx(1.0)
  assert reshard_xla.geometric_mean([1.5]) == pytest.approx(1.5)
