"""Hand-written partitioning of shape-carrying ops: layouts, then end to end on 8 devices."""

import numpy as np
import pytest
import tensorflow as tf

import tf_gspmd as tg
from tf_gspmd.propagation.ops_shape import reshape_factors
from tf_gspmd.propagation.rule_builders import Namer, make_rule
from tf_gspmd.testing import assert_close

MESH = tg.Mesh.create((2, 4), ('data', 'model'))


def named(*spec):
  return tg.NamedSharding(MESH, tg.P(*spec))


def reshape_layouts(mesh, in_shape, out_shape, target):
  """Reshape's layouts for a result target, as its rule gives them (what its handler uses)."""
  in_dims, out_dims, sizes, kinds = reshape_factors(in_shape, out_shape, Namer())
  rule = make_rule([in_dims], [out_dims], [in_shape], [out_shape], kinds=kinds, sizes=sizes)
  axes = [None, tuple(target.spec.axes_of(d) for d in range(len(out_shape)))]
  fa = rule.representable(rule.factor_axes(axes, mesh), mesh, [in_shape, out_shape])
  (in_spec,), (out_spec,) = (
    rule.operand_specs(fa, mesh, [in_shape]),
    rule.result_specs(fa, mesh, [out_shape]),
  )
  return tg.NamedSharding(mesh, in_spec), tg.NamedSharding(mesh, out_spec)


@pytest.mark.parametrize(
  'in_shape,out_shape,target,want_in,want_out',
  [
    ((1, 1, 4, 8), (4, 8), named('model', None), (None, None, 'model', None), ('model', None)),
    (
      (4, 8),
      (1, 1, 4, 8),
      named(None, None, 'model', None),
      ('model', None),
      (None, None, 'model', None),
    ),
    ((8, 6), (2, 4, 6), named('data', None, None), ('data', None), ('data', None, None)),
    ((8, 6), (2, 4, 6), named(None, 'model', None), (None, None), (None, None, None)),
    ((10, 3), (10, 3, 1), named('model', None, None), ('model', None), ('model', None, None)),
  ],
)
def test_reshape_layouts_keep_what_a_local_reshape_allows(
  in_shape, out_shape, target, want_in, want_out
):
  got_in, got_out = reshape_layouts(MESH, in_shape, out_shape, target)
  assert got_in.spec == tg.P(*want_in) and got_out.spec == tg.P(*want_out)


def test_reshapes_around_size_one_dims_move_nothing():
  @tf.function
  def f(x):
    x = tg.shard(x, MESH, tg.P('model', None))
    y = tf.reshape(x, [1, 1, 4, 8]) * 2.0
    return tg.shard(tf.reshape(y, [4, 8]), MESH, tg.P('model', None))

  x = np.arange(32, dtype=np.float32).reshape(4, 8)
  pf = tg.partition(f, MESH)
  np.testing.assert_array_equal(pf(x).numpy(), f(x).numpy())
  assert pf.collectives() == []


@pytest.mark.parametrize(
  'op',
  [
    'ResourceScatterAdd',
    'ResourceScatterSub',
    'ResourceScatterMul',
    'ResourceScatterDiv',
    'ResourceScatterMax',
    'ResourceScatterMin',
    'ResourceScatterUpdate',
  ],
)
@pytest.mark.parametrize('spec', [('x', None), (None, 'x'), (None, None), ('x', 'y')])
def test_variable_row_scatters_touch_only_the_rows_a_partition_holds(op, spec):
  mesh = tg.Mesh.create((4, 2), ('x', 'y'))  # 3 columns over 'y' leave padding
  rng = np.random.RandomState(0)
  start = rng.uniform(0.5, 1.5, (10, 3)).astype(np.float32)
  v, v_ref = tf.Variable(start), tf.Variable(start)
  tg.shard_variable(v, mesh, tg.P(*spec))
  indices = np.array([7, 0, 3, 9, 4], np.int32)
  updates = rng.uniform(0.5, 1.5, (5, 3)).astype(np.float32)

  def scatter(var):
    @tf.function
    def f(i, u):
      getattr(tf.raw_ops, op)(resource=var.handle, indices=i, updates=u)
      return var.read_value()

    return f

  pf = tg.partition(scatter(v), mesh)
  assert_close(pf(indices, updates), scatter(v_ref)(indices, updates), f'{op} result')
  assert_close(v, v_ref, f'{op} variable')


def test_fused_update_with_a_slot_sharded_unlike_its_variable_is_a_clear_error():
  mesh = tg.Mesh.create((2, 2), ('a', 'b'))
  var = tf.Variable(np.ones((4, 8), np.float32))
  accum = tf.Variable(np.ones((4, 8), np.float32))
  tg.shard_variable(var, mesh, tg.P(None, ('b', 'a')))
  tg.shard_variable(accum, mesh, tg.P(None, ('a', 'b')))  # same axes, other order

  @tf.function
  def update(grad):
    tf.compat.v1.get_default_graph().watch_variable(accum)  # used only through its handle
    tf.raw_ops.ResourceApplyAdagrad(var=var.handle, accum=accum.handle, lr=0.1, grad=grad)
    return var.read_value()

  with pytest.raises(ValueError, match='slot variable .* is sharded .* but its variable'):
    tg.partition(update, mesh)(np.ones((4, 8), np.float32))
