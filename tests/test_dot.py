"""Dot partitioning on 2-D and 3-D meshes: correct, and operands used as they are when they fit."""

import collections

import numpy as np
import pytest
import tensorflow as tf

import tf_gspmd as tg
from tf_gspmd.testing import assert_close

MESH3 = tg.Mesh.create((2, 2, 2), ('x', 'y', 'z'))


def run(eq, shapes, specs, mesh=MESH3, out_spec=None):
  @tf.function
  def f(a, b):
    a = tg.shard(a, mesh, tg.P(*specs[0]))
    b = tg.shard(b, mesh, tg.P(*specs[1]))
    out = tf.einsum(eq, a, b)
    return tg.shard(out, mesh, tg.P(*out_spec)) if out_spec is not None else out

  rng = np.random.RandomState(0)
  a, b = (rng.randn(*s).astype(np.float32) for s in shapes)
  pf = tg.partition(f, mesh)
  assert_close(pf(a, b), f(a, b), name=eq)
  # The dot's own collectives, and its pending sum when resolved at the function's end.
  dot = [
    r
    for r in pf.op_records()
    if r.op == 'Einsum' or r.op.startswith('BatchMatMul') or r.op in ('MatMul', 'outputs')
  ]
  return collections.Counter(c['kind'] for r in dot for c in r.collectives), pf


def test_batch_and_both_free_dims_on_three_axes_need_no_communication():
  kinds, _ = run('bmk,bkn->bmn', [(4, 6, 8), (4, 8, 10)], [('x', 'y', None), ('x', None, 'z')])
  assert not kinds  # b on x, m on y, n on z: every device computes its own block


def test_contracting_dim_split_over_two_axes_gives_one_reduction():
  kinds, _ = run('mk,kn->mn', [(6, 16), (16, 10)], [(None, ('y', 'z')), (('y', 'z'), None)])
  assert kinds == {'all_reduce': 1}


def test_contracting_split_resolved_by_reduce_scatter_into_a_sharded_result():
  kinds, _ = run('mk,kn->mn', [(8, 16), (16, 12)], [('x', 'y'), ('y', None)], out_spec=('x', 'y'))
  assert kinds == {'reduce_scatter': 1}


@pytest.mark.parametrize(
  'specs',
  [
    [('x', ('y', 'z')), (('y', 'z'), None)],
    [(('x', 'y'), None), (None, 'z')],
    [('z', 'x'), ('y', None)],
  ],
)
def test_mixed_layouts_with_uneven_sizes(specs):
  run('mk,kn->mn', [(10, 12), (12, 7)], specs)


def test_operands_kept_as_they_are_when_that_is_cheapest():
  # The result is left to propagation; the lhs's batch split and the rhs's column split
  # are both usable as they are, so the dot itself moves nothing.
  kinds, pf = run('bmk,bkn->bmn', [(4, 6, 8), (4, 8, 10)], [('x', None, None), (None, None, 'y')])
  assert not kinds


def test_a_contracting_and_a_free_dim_on_one_axis_move_the_smaller_operand():
  """x's features and w's columns both want 'model': splitting the contraction would
  all-to-all the weight (64x64) and reduce-scatter the product; splitting the columns
  all-gathers the 4x64 activation instead. Bytes decide, not the rule's factor order."""
  mesh = tg.Mesh.create((8,), ('model',))
  kinds, pf = run('mk,kn->mn', [(4, 64), (64, 64)], [(None, 'model'), (None, 'model')], mesh)
  operands = [c for r in pf.op_records() for c in r.collectives if c['why'].startswith('operand')]
  assert [(c['kind'], c['why'], c['shape']) for c in operands] == [
    ('all_gather', 'operand 0 of Einsum', (4, 8))  # the activation's shard, not the weight
  ]
  assert set(kinds) == {'all_gather'}, kinds  # and the result's, as the function returns it whole
