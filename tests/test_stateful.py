"""Stateful ops: never folded into constants, and stateful random ops partitioned as one
global random tensor on 8 logical devices.

TF gives an unseeded stateful random op new values on every call. Partitioned,
every partition must hold a piece of ONE global random tensor (a replicated
result identical on all devices, a sharded one assembling consistently), and
the values must still change from call to call. Seeded ops must give exactly
TF's values, call after call.
"""

import numpy as np
import pytest
import tensorflow as tf

import tf_gspmd as tg
from tf_gspmd.annotations import replicate
from tf_gspmd.graph import capture as capture_lib
from tf_gspmd.graph import static_values
from tf_gspmd.sharding import NamedSharding, P

MESH = tg.Mesh.create((8,), ('x',))
MESH_2D = tg.Mesh.create((2, 4), ('a', 'b'))


def _values(result):
  return [np.asarray(t) for t in tf.nest.flatten(result)]


# --- folding ---------------------------------------------------------------------------------
def test_stateful_ops_are_not_folded_but_constant_arithmetic_is():
  @tf.function
  def f():
    draw = tf.random.uniform([8, 3], maxval=100, dtype=tf.int32, name='draw')
    dims = tf.constant([8, 3]) * 2
    return draw, dims

  graph = capture_lib.capture(f).main
  folded = static_values.fold(graph)
  draw = next(n for n in graph.nodes if n.op == 'RandomUniformInt')
  dims = next(n for n in graph.nodes if n.op == 'Mul')
  assert draw.outputs[0].name not in folded
  np.testing.assert_array_equal(folded[dims.outputs[0].name], [16, 6])
  assert static_values.is_stateful('RandomUniformInt')
  assert static_values.is_stateful('AssignVariableOp')
  assert not static_values.is_stateful('Mul')


def test_random_int_draw_changes_from_call_to_call():
  """Issue #12: the draw was folded into a constant and repeated on every call."""

  @tf.function
  def f():
    return tf.random.uniform([8, 3], maxval=100, dtype=tf.int32)

  pf = tg.partition(f, MESH)
  calls = [pf().numpy() for _ in range(3)]
  assert not np.array_equal(calls[0], calls[1]) and not np.array_equal(calls[1], calls[2])
  for c in calls:
    assert c.dtype == np.int32 and c.min() >= 0 and c.max() < 100
  assert len(np.unique(np.concatenate(calls))) > 30  # a spread of values, not one repeated
  assert not pf.collectives()  # generated whole on every device: nothing moves


# --- one global random tensor on every partition ---------------------------------------------
UNSEEDED = {
  'RandomUniform': lambda: tf.random.uniform([16, 5]),
  'RandomStandardNormal': lambda: tf.random.normal([16, 5]),
  'TruncatedNormal': lambda: tf.random.truncated_normal([16, 5]),
  'RandomUniformInt': lambda: tf.random.uniform([16, 5], maxval=1 << 30, dtype=tf.int32),
  'RandomShuffle': lambda: tf.random.shuffle(tf.reshape(tf.range(80), [16, 5])),
  'Multinomial': lambda: tf.random.categorical(tf.math.log(tf.fill([16, 50], 0.02)), 5),
  'RandomGamma': lambda: tf.random.gamma([16, 5], 2.0),
}


@pytest.mark.parametrize('op_type', sorted(UNSEEDED))
def test_unseeded_random_is_one_tensor_on_all_partitions_and_new_each_call(op_type):
  """The draw is kept replicated: each device slices its own copy for the sharded
  output, the replicated output comes from one device. Equal only if every device
  drew the same tensor."""
  draw = UNSEEDED[op_type]

  @tf.function
  def f():
    r = replicate(draw())
    return r, r

  pf = tg.partition(f, MESH, out_shardings=[NamedSharding(MESH, P('x', None)), None])
  first = _values(pf())
  second = _values(pf())
  program = pf.get_program().program
  assert any(n.op == op_type for g in program.graphs() for n in g.nodes), op_type
  for sharded, whole in (first, second):
    np.testing.assert_array_equal(sharded, whole)
  assert not np.array_equal(first[1], second[1]), f'{op_type} repeated its values'
  assert not pf.collectives()


def test_unseeded_random_consumed_sharded_and_replicated_on_2d_mesh():
  """A dropout-like mask used both whole (its sum on every device) and sharded
  (multiplied into an activation split over both mesh axes)."""
  x = np.random.RandomState(0).uniform(1.0, 2.0, (8, 12)).astype(np.float32)

  @tf.function
  def f(a):
    keep = replicate(tf.cast(tf.random.uniform([8, 12]) < 0.5, tf.float32))
    a = tg.shard(a, MESH_2D, P('a', 'b'))
    return keep, a * keep, tf.reduce_sum(keep)

  pf = tg.partition(f, MESH_2D)
  masks = []
  for _ in range(2):
    keep, dropped, total = _values(pf(x))
    np.testing.assert_array_equal(dropped, x * keep)
    assert total == keep.sum()
    masks.append(keep)
  assert not np.array_equal(masks[0], masks[1])


def test_unseeded_random_inside_a_loop_is_one_tensor_per_iteration():
  @tf.function
  def f():
    def body(i, acc):
      return i + 1, acc + replicate(tf.random.uniform([16, 3]))

    _, acc = tf.while_loop(lambda i, acc: i < 3, body, [0, tf.zeros([16, 3])])
    acc = replicate(acc)
    return acc, acc

  pf = tg.partition(f, MESH, out_shardings=[NamedSharding(MESH, P('x', None)), None])
  first, second = _values(pf()), _values(pf())
  np.testing.assert_array_equal(first[0], first[1])
  np.testing.assert_array_equal(second[0], second[1])
  assert not np.array_equal(first[1], second[1])


# --- seeded: TF's own values, call after call ------------------------------------------------
SEEDED = {
  'RandomUniform': lambda: tf.random.uniform([10, 3], seed=7),
  'RandomUniformInt': lambda: tf.random.uniform([10, 3], maxval=100, dtype=tf.int32, seed=7),
  'TruncatedNormal': lambda: tf.random.truncated_normal([10, 3], seed=7),
  'RandomShuffle': lambda: tf.random.shuffle(tf.range(10), seed=7),
}


@pytest.mark.parametrize('op_type', sorted(SEEDED))
@pytest.mark.parametrize('out_spec', [None, P('x')], ids=['replicated', 'sharded'])
def test_seeded_random_matches_tensorflow_on_every_call(op_type, out_spec):
  draw = SEEDED[op_type]
  reference = tf.function(draw)
  want = [reference().numpy() for _ in range(3)]
  assert not np.array_equal(want[0], want[1])  # TF's seeded op moves on between calls
  spec = None if out_spec is None else P(*(['x'] + [None] * (want[0].ndim - 1)))
  pf = tg.partition(
    tf.function(draw), MESH, out_shardings=None if spec is None else [NamedSharding(MESH, spec)]
  )
  for k in range(3):
    np.testing.assert_array_equal(_values(pf())[0], want[k], err_msg=f'call {k}')
