"""Bad input gets a clear error, never a wrong number.

One table of bad calls, each with the error type it must raise and the words its message must
hold: the offending tensor or op, the sharding or axes, and what to do. A call that raises the
right error with a vague message, raises it from outside tf_gspmd (a failure deep in TF rather
than tf_gspmd's check), or runs, fails its row.
"""

import numpy as np
import pytest
import tensorflow as tf

import tf_gspmd as tg
from tf_gspmd import Mesh, NamedSharding, P, Sharding, annotations
from tf_gspmd.partitioned import partition
from tf_gspmd.runtime import SpmdProgram

from helpers import assert_raises_clearly

MESH = Mesh.create((2, 4), ('data', 'model'))
MESH8 = Mesh.create((8,), ('x',))
X = np.arange(64, dtype=np.float32).reshape(16, 4)


def _traced(body, *specs):
  """Run `body` on placeholders named x, y, ... inside a tf.function (annotations need a graph)."""
  specs = specs or (tf.TensorSpec((16, 4), tf.float32, name='x'),)
  return tf.function(body, input_signature=specs).get_concrete_function()


def _in_fn(body):
  """A bad call inside the function given to tg.partition (on 8 devices)."""

  @tf.function
  def f(x):
    return body(x)

  return partition(f, MESH8)(X)


def _collective(call):
  """A bad call on the collectives of a per-partition program over MESH8."""

  def fn(ctx):
    with tf.name_scope('dense_3'):
      return call(ctx.collectives, tf.zeros((8, 2)))

  return SpmdProgram(MESH8, fn, autograph=False)()


def _identity_fn():
  @tf.function
  def f(x):
    return tf.identity(x, name='out') * 2.0

  return f


def _variable_annotated_after():
  w = tf.Variable(np.ones((8, 4), np.float32), name='w_late')
  tg.shard_variable(w, MESH8, P('x', None))

  @tf.function
  def f(x):
    return w + x[:8]

  pf = partition(f, MESH8)
  pf(X)
  tg.shard_variable(w, MESH8, P(None, 'x'))  # too late: its shards already live by rows
  pf(X)


def _called_with_other_rank():
  pf = partition(_identity_fn(), MESH8, in_shardings=[NamedSharding(MESH8, P('x', None))])
  pf(X)
  pf(X.reshape(16, 4, 1))


def _dynamic_output():
  @tf.function
  def f(x):
    return tf.boolean_mask(x, x[:, 0] > 10.0)

  partition(f, MESH8)(X)


CASES = {
  # --- meshes -------------------------------------------------------------------------------
  'mesh_names_fewer_than_dims': (
    lambda: Mesh.create((2, 4), ('data',)),
    ValueError,
    ['rank 2', "('data',)", 'one name'],
  ),
  'mesh_axis_named_twice': (
    lambda: Mesh.create((2, 4), ('x', 'x')),
    ValueError,
    ["('x', 'x')", 'distinct'],
  ),
  'mesh_device_twice': (
    lambda: Mesh([[0, 1], [1, 2]], ('a', 'b')),
    ValueError,
    ['[0, 1, 1, 2]', 'distinct'],
  ),
  'mesh_more_devices_than_exist': (
    lambda: partition(_identity_fn(), Mesh.create((16,), ('x',)))(X),
    ValueError,
    ['16', 'do not exist', 'set_logical_device_configuration'],
  ),
  'mesh_size_differs_from_devices': (
    lambda: partition(_identity_fn(), MESH8, devices=[f'/device:CPU:{i}' for i in range(4)])(X),
    ValueError,
    ['4 devices', 'mesh of 8'],
  ),
  'mesh_groups_axis_twice': (
    lambda: MESH.groups(('model', 'model')),
    ValueError,
    ["('model', 'model')", 'twice'],
  ),
  # --- partition specs and shardings ---------------------------------------------------------
  'axis_not_in_mesh': (
    lambda: NamedSharding(MESH, P('batch', None)),
    ValueError,
    ["'batch'", "('data', 'model')", "P('batch', None)"],
  ),
  'axis_used_twice': (
    lambda: NamedSharding(MESH, P('data', 'data')),
    ValueError,
    ["'data'", 'twice', "P('data', 'data')"],
  ),
  'axis_used_twice_in_one_entry': (
    lambda: NamedSharding(MESH, P(('model', 'model'), None)),
    ValueError,
    ["'model'", 'twice'],
  ),
  'p_unknown_entry_type': (lambda: P('data', 3), TypeError, ['P', '3', 'axis name']),
  'p_tuple_holds_a_number': (lambda: P(('data', 1)), TypeError, ["('data', 1)", 'axis names']),
  'unknown_reduction_in_sharding': (
    lambda: NamedSharding(MESH, P('data'), partial=('model',), reduction='mean'),
    ValueError,
    ["'mean'", "'sum'"],
  ),
  'tile_assignment_device_twice': (
    lambda: Sharding.tiled([[0, 1], [1, 2]]),
    ValueError,
    ['[0, 1, 1, 2]', 'distinct'],
  ),
  'tile_assignment_empty': (lambda: Sharding.tiled(np.zeros((0, 2))), ValueError, ['no device']),
  'unknown_subgroup_kind': (
    lambda: Sharding.tiled([[0, 1]], subgroups=('mean',)),
    ValueError,
    ["'mean'", 'partial_sum'],
  ),
  'mesh_split_dim_out_of_range': (
    lambda: tg.xla_sharding.mesh_split_sharding(np.arange(8).reshape(2, 4), [0, 2]),
    ValueError,
    ['mesh dim 2', 'dims_mapping=[0, 2]'],
  ),
  'mesh_split_dim_twice': (
    lambda: tg.xla_sharding.mesh_split_sharding(np.arange(8).reshape(2, 4), [1, 1]),
    ValueError,
    ['[1]', 'twice'],
  ),
  # --- annotations ---------------------------------------------------------------------------
  'spec_shorter_than_rank': (
    lambda: _traced(lambda x: tg.shard(x, MESH, P('data'))),
    ValueError,
    ["'x:0'", "P('data')", 'rank 1', '(16, 4)'],
  ),
  'spec_longer_than_rank': (
    lambda: _traced(lambda x: tg.shard(x, MESH, P('data', None, 'model'))),
    ValueError,
    ["'x:0'", "P('data', None, 'model')", 'rank 3', '(16, 4)'],
  ),
  'tile_rank_mismatch': (
    lambda: _traced(lambda x: tg.xla_sharding.tile(x, [[[0, 1]]])),
    ValueError,
    ["'x:0'", 'rank 3', 'tile dim'],
  ),
  'annotating_a_python_number': (
    lambda: _traced(lambda x: x + tg.shard(3.0, MESH, P())),
    TypeError,
    ['float', '3.0', 'P()', 'tf.constant'],
  ),
  'sharding_of_the_wrong_type': (
    lambda: _traced(lambda x: annotations.annotate(x, P('data', None))),
    TypeError,
    ["'x:0'", "P('data', None)", 'NamedSharding(mesh, spec)'],
  ),
  'split_dimension_out_of_range': (
    lambda: _traced(lambda x: tg.xla_sharding.split(x, 2, 8)),
    ValueError,
    ["'x:0'", 'split_dimension 2'],
  ),
  'shard_variable_rank_mismatch': (
    lambda: tg.shard_variable(
      tf.Variable(np.ones((4, 4), np.float32), name='w_rank'), MESH, P('data')
    ),
    ValueError,
    ['w_rank', "P('data')", 'rank 1'],
  ),
  'shard_variable_mesh_without_spec': (
    lambda: tg.shard_variable(tf.Variable(np.ones(4, np.float32)), MESH),
    ValueError,
    ['needs a spec'],
  ),
  'shard_variable_of_a_tensor': (
    lambda: tg.shard_variable(tf.ones(4), MESH, P('data')),
    TypeError,
    ['tf.Variable', 'EagerTensor'],
  ),
  # --- tg.partition arguments ------------------------------------------------------------------
  'partition_mesh_not_a_mesh': (
    lambda: partition(_identity_fn(), (2, 4)),
    TypeError,
    ['tf_gspmd.Mesh', 'tuple'],
  ),
  'in_shardings_count_mismatch': (
    lambda: partition(_identity_fn(), MESH8, in_shardings=[None, None])(X),
    ValueError,
    ["'f'", '1 tensor argument', '2 in_shardings'],
  ),
  'out_shardings_count_mismatch': (
    lambda: partition(_identity_fn(), MESH8, out_shardings=[None, None, None])(X),
    ValueError,
    ["'f'", '1 output', "['Identity:0']", '3 out_shardings'],
  ),
  'out_shardings_axis_twice': (
    lambda: partition(_identity_fn(), MESH8, out_shardings=P('x', 'x'))(X),
    ValueError,
    ["'x'", 'twice', "P('x', 'x')", 'out_shardings'],
  ),
  'in_shardings_rank_mismatch': (
    lambda: partition(_identity_fn(), MESH8, in_shardings=P('x'))(X),
    ValueError,
    ['in_shardings', "P('x')", 'rank 1', '(16, 4)', "'f'"],
  ),
  'in_shardings_on_another_mesh': (
    lambda: partition(
      _identity_fn(), MESH8, in_shardings=NamedSharding(Mesh.create((4,), ('x',)), P('x', None))
    )(X),
    ValueError,
    ['in_shardings', "P('x', None)", '4 devices', '8 devices'],
  ),
  'called_with_another_rank': (
    _called_with_other_rank,
    ValueError,
    ['in_shardings', "P('x', None)", '(16, 4, 1)', 'rank 3'],
  ),
  'maximal_device_out_of_range': (
    lambda: _in_fn(lambda x: tg.xla_sharding.assign_device(x, 9) * 2.0),
    ValueError,
    ['device 9', '{maximal device=9}', 'Mesh(x=8) of 8 devices', 'XlaSharding'],
  ),
  'tile_assignment_missing_devices': (
    lambda: _in_fn(lambda x: tg.xla_sharding.tile(x, [[0], [1], [2], [3]]) * 2.0),
    ValueError,
    ['4 devices [0, 1, 2, 3]', '{devices=[4,1]0,1,2,3}', 'Mesh(x=8) of 8 devices', 'XlaSharding'],
  ),
  'non_static_output_shape': (
    _dynamic_output,
    ValueError,
    ['known only at run time', 'boolean_mask', 'GatherV2', 'None'],
  ),
  'string_tensor_resharded': (
    lambda: _in_fn(
      lambda x: tg.shard(
        tg.shard(tf.strings.as_string(x), MESH8, P('x', None)), MESH8, P(None, 'x')
      )
    ),
    tg.Unsupported,  # a refusal, raised inside the partitioner's tf.function: still its type
    ['string', 'AsString', "P('x', None)", 'cannot be moved'],
  ),
  'variable_annotated_after_partitioning': (
    _variable_annotated_after,
    ValueError,
    ['w_late', "P('x', None)", "P(None, 'x')", 'after'],
  ),
  # --- collectives ----------------------------------------------------------------------------
  'collective_unknown_reduction': (
    lambda: _collective(lambda c, x: c.all_reduce(x, 'x', 'mean')),
    ValueError,
    ["'mean'", 'all_reduce', "('x',)", 'dense_3'],
  ),
  'collective_axis_not_in_mesh': (
    lambda: _collective(lambda c, x: c.all_gather(x, 'y', 0)),
    ValueError,
    ["'y'", "('x',)"],
  ),
  'collective_dim_out_of_range': (
    lambda: _collective(lambda c, x: c.all_gather(x, 'x', 2)),
    ValueError,
    ['all_gather', 'dim 2', 'rank-2'],
  ),
  'permute_target_twice': (
    lambda: _collective(lambda c, x: c.permute(x, [(0, 1), (2, 1)])),
    ValueError,
    ['permute', '[1]', 'target'],
  ),
  'broadcast_root_out_of_range': (
    lambda: _collective(lambda c, x: c.broadcast(x, 'x', 8)),
    ValueError,
    ['broadcast', 'root_index 8'],
  ),
}


@pytest.mark.parametrize('name', sorted(CASES))
def test_bad_call_raises_a_clear_error(name):
  assert_raises_clearly(name, *CASES[name])
