"""Manual regions: TF's own manual ops, tg.shard_map, gradients, partial manual, bad input.

Every region is compared, by the oracle, with its automatic twin (the same math written
without a manual region, run unpartitioned), on the TF backend and on XLA, and the
collectives written inside are counted.
"""

import collections

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.compiler.xla.experimental import xla_sharding  # noqa: TID251 (TF's API)

import tf_gspmd as tg
from tf_gspmd.testing import assert_close

try:
  import jax  # noqa: F401

  BACKENDS = ['tf', 'xla']
except ImportError:  # backend='xla' needs the [xla] extra
  BACKENDS = ['tf']

MESH8 = tg.Mesh.create((8,), ('x',))
MESH24 = tg.Mesh.create((2, 4), ('data', 'model'))


def _rand(*shape, seed=0):
  return np.random.RandomState(seed).randn(*shape).astype(np.float32)


def _kinds(step):
  return collections.Counter((c['kind'], tuple(c['axes'])) for c in step.collectives())


def _hand_written(step):
  return collections.Counter(
    (c['kind'], tuple(c['axes'])) for c in step.collectives() if 'by hand' in c.get('why', '')
  )


# --- TF's own manual ops, as TPU code writes them -----------------------------------------
def _tf_psum_region(x):
  x = xla_sharding.split(x, 0, 8)
  s = xla_sharding.get_op_sharding(x.op)
  m = xla_sharding.auto_to_manual_spmd_partition(x, s)
  m = tf.raw_ops.CrossReplicaSum(input=m * 2.0, group_assignment=[list(range(8))])
  return xla_sharding.manual_to_auto_spmd_partition(m, s, full_shape=[8, 16])


def _tf_local_region(x):
  x = xla_sharding.split(x, 0, 8)
  s = xla_sharding.get_op_sharding(x.op)
  m = xla_sharding.auto_to_manual_spmd_partition(x, s)
  m = m * 2.0 + tf.reduce_sum(m, 0, keepdims=True)
  return xla_sharding.manual_to_auto_spmd_partition(m, s, full_shape=[16, 4])


@pytest.mark.parametrize('backend', BACKENDS)
def test_tf_manual_region_with_cross_replica_sum(backend):
  x = _rand(8, 16)
  step = tg.partition(tf.function(_tf_psum_region), MESH8, backend=backend)
  want = np.tile(2.0 * x.sum(0, keepdims=True), [8, 1])
  assert_close(step(x), want)
  assert _hand_written(step) == {('all_reduce', ('x',)): 1}


def test_a_region_is_found_once_by_propagation_and_read_by_the_partitioner(monkeypatch):
  from tf_gspmd.propagation import manual

  found = []
  regions = manual.regions

  def counting(program, mesh):
    found.append(program)
    return regions(program, mesh)

  monkeypatch.setattr(manual, 'regions', counting)
  x = _rand(8, 16)
  step = tg.partition(tf.function(_tf_psum_region), MESH8)
  assert_close(step(x), np.tile(2.0 * x.sum(0, keepdims=True), [8, 1]))
  assert len(found) == 1  # propagation's search; the partitioner reads its result
  assert _hand_written(step) == {('all_reduce', ('x',)): 1}


def _two_regions(x, y):
  """Two `tg.shard_map` regions in a row: the first entered twice (x and y), left once."""

  def body(a, b):
    return tg.psum(a * b, 'model')

  z = tg.shard_map(body, MESH24, (tg.P('data', 'model'),) * 2, tg.P('data', None))(x, y)
  w = tg.shard_map(lambda c: c * 2.0, MESH24, tg.P('data', None), tg.P('data', None))(z)
  return w + 1.0


def test_each_region_is_an_object_with_its_entries_exits_and_axes():
  x, y = _rand(4, 8), _rand(4, 8, seed=1)
  propagation = tg.propagate(tf.function(_two_regions), x, y, mesh=MESH24)
  regions = propagation.manual_regions.regions
  assert [r.name for r in regions] == ['manual_region_0', 'manual_region_1']
  first, second = regions
  assert (len(first.entries), len(first.exits)) == (2, 1)  # x and y meet in one region
  assert (len(second.entries), len(second.exits)) == (1, 1)
  assert first.axes == second.axes == ('data', 'model')
  assert not first.tensors & second.tensors
  exit_op = propagation.program.main.node(first.exits[0])
  inside = exit_op.inputs[0]
  assert propagation.manual_regions.region_of_tensor(first.graph, inside) is first
  assert propagation.manual_regions[(first.graph, inside)] == first.axes
  step = tg.partition(tf.function(_two_regions), MESH24)
  # each partition's block of x * y summed over 'model': column k * 2 + j of model shard k
  assert_close(step(x, y), 2.0 * (x * y).reshape(4, 4, 2).sum(1) + 1.0)
  (record,) = [c for c in step.collectives() if 'by hand' in c['why']]
  assert 'manual_region_0' in record['why'] and "('data', 'model')" in record['why']


@pytest.mark.parametrize('backend', BACKENDS)
def test_tf_manual_region_without_collectives(backend):
  x = _rand(16, 4)
  step = tg.partition(tf.function(_tf_local_region), MESH8, backend=backend)
  blocks = x.reshape(8, 2, 4)
  want = (2.0 * blocks + blocks.sum(1, keepdims=True)).reshape(16, 4)
  assert_close(step(x), want)
  assert not step.collectives()


# --- tg.shard_map: each collective and its transpose -----------------------------------------
def _value_and_grad(fn, c):
  """`fn`'s value and the gradient of sum(fn(x) * c) with respect to x."""

  @tf.function
  def step(x):
    with tf.GradientTape() as tape:
      tape.watch(x)
      y = fn(x)
      loss = tf.reduce_sum(y * c)
    return y, tape.gradient(loss, x)

  return step


def _against_twin(manual_fn, twin_fn, x, out_shape, mesh, backend):
  c = _rand(*out_shape, seed=7)
  step = tg.partition(_value_and_grad(manual_fn, c), mesh, backend=backend)
  assert_close(step(x), _value_and_grad(twin_fn, c)(x))
  return step


P = tg.P
COLLECTIVE_CASES = {
  # name: (region body, in spec, out spec, automatic twin, input shape, output shape)
  'psum': (
    lambda b: tg.psum(b, 'x'),
    P('x'),
    P(),
    lambda x: tf.reduce_sum(tf.reshape(x, [8, 2, 4]), 0),
    (16, 4),
    (2, 4),
  ),
  'all_gather': (
    lambda b: tg.all_gather(b, 'x', tiled=True),
    P('x'),
    P(),
    tf.identity,
    (16, 4),
    (16, 4),
  ),
  'all_gather_stacked': (
    lambda b: tg.all_gather(b, 'x', axis=1),
    P('x'),
    P(),
    lambda x: tf.transpose(tf.reshape(x, [8, 2, 4]), [1, 0, 2]),
    (16, 4),
    (2, 8, 4),
  ),
  'psum_scatter': (
    lambda b: tg.psum_scatter(b, 'x', 0, tiled=True),
    P(),
    P('x'),
    lambda x: 8.0 * x,
    (16, 4),
    (16, 4),
  ),
  'all_to_all': (
    lambda b: tg.all_to_all(b, 'x', 1, 0),
    P('x', None),
    P(None, 'x'),
    tf.identity,
    (16, 8),
    (16, 8),
  ),
  'ppermute': (
    lambda b: tg.ppermute(b, 'x', [(i, (i + 1) % 8) for i in range(8)]),
    P('x'),
    P('x'),
    lambda x: tf.roll(x, 2, 0),
    (16, 4),
    (16, 4),
  ),
  'axis_index': (
    lambda b: b * tf.cast(tg.axis_index('x') + 1, tf.float32),
    P('x'),
    P('x'),
    lambda x: x * np.repeat(np.arange(1, 9), 2)[:, None].astype(np.float32),
    (16, 4),
    (16, 4),
  ),
}
KIND = {
  'psum': 'all_reduce',
  'all_gather': 'all_gather',
  'all_gather_stacked': 'all_gather',
  'psum_scatter': 'reduce_scatter',
  'all_to_all': 'all_to_all',
  'ppermute': 'permute',
  'axis_index': None,
}


@pytest.mark.parametrize('backend', BACKENDS)
@pytest.mark.parametrize('name', sorted(COLLECTIVE_CASES))
def test_shard_map_collective_and_its_gradient(name, backend):
  body, in_spec, out_spec, twin, in_shape, out_shape = COLLECTIVE_CASES[name]
  region = tg.shard_map(body, MESH8, in_spec, out_spec)
  step = _against_twin(region, twin, _rand(*in_shape), out_shape, MESH8, backend)
  kinds = {k for k, _ in _hand_written(step)}
  if KIND[name]:
    assert KIND[name] in kinds, _kinds(step)


# --- partially manual, written only with TF's own ops ----------------------------------------
DATA_GROUPS = [list(g) for g in MESH24.groups(('data',))]


def _tf_partial_manual_model(w, manual):
  """A step manual over 'data' (TF's single_dim) and automatic over 'model', or its twin."""
  device_mesh = np.arange(8).reshape(2, 4)

  @tf.function
  def step(x):
    if manual:
      w_read = xla_sharding.mesh_split(tf.convert_to_tensor(w), device_mesh, [-1, 1])
    else:
      w_read = tf.convert_to_tensor(w)
    with tf.GradientTape() as tape:
      tape.watch(w_read)
      if manual:
        x = xla_sharding.mesh_split(x, device_mesh, [0, -1])
        s = xla_sharding.get_op_sharding(x.op)
        m = xla_sharding.auto_to_manual_spmd_partition(x, s, single_dim=0)
        h = tf.nn.relu(tf.matmul(m, w_read))
        h = xla_sharding.manual_to_auto_spmd_partition(h, s, full_shape=[8, 12], single_dim=0)
      else:
        h = tf.nn.relu(tf.matmul(x, w_read))
      loss = tf.reduce_mean(tf.square(h - 1.0))
    g = tape.gradient(loss, w_read)
    if manual:  # each 'data' group's part of the gradient, summed over the groups by hand
      g = tf.raw_ops.CrossReplicaSum(input=g, group_assignment=DATA_GROUPS)
    w.assign_sub(0.1 * g)
    return loss

  return step


@pytest.mark.parametrize('backend', BACKENDS)
def test_tf_partially_manual_region_trains_like_its_unpartitioned_twin(backend):
  init = _rand(16, 12, seed=3)
  x = _rand(8, 16, seed=4)
  w_manual, w_twin = tf.Variable(init), tf.Variable(init)
  step = tg.partition(_tf_partial_manual_model(w_manual, True), MESH24, backend=backend)
  twin = _tf_partial_manual_model(w_twin, False)
  losses = [(step(x), twin(x)) for _ in range(3)]
  assert_close([a for a, _ in losses], [b for _, b in losses])
  assert_close(w_manual, w_twin)
  assert _hand_written(step) == {('all_reduce', ('data',)): 1}


# --- tg.shard_map partially manual, in a step and in a Keras layer ----------------------------
def _partial_step(w, manual):
  def body(xb, wb):
    h = tf.nn.relu(tf.matmul(xb, wb))
    return tg.psum(tf.reduce_sum(tf.square(h - 1.0)), 'data') / 96.0

  @tf.function
  def step(x):
    with tf.GradientTape() as tape:
      if manual:
        loss = tg.shard_map(body, MESH24, (P('data'), P()), P(), axes='data')(x, w)
      else:
        loss = tf.reduce_mean(tf.square(tf.nn.relu(x @ w) - 1.0))
    w.assign_sub(0.1 * tape.gradient(loss, w))
    return loss

  return step


@pytest.mark.parametrize('backend', BACKENDS)
def test_shard_map_manual_over_one_axis_keeps_the_other_automatic(backend):
  init, x = _rand(16, 12, seed=1), _rand(8, 16)
  w, w_twin = tf.Variable(init), tf.Variable(init)
  tg.shard_variable(w, MESH24, P(None, 'model'))
  step = tg.partition(_partial_step(w, True), MESH24, backend=backend)
  twin = _partial_step(w_twin, False)
  losses = [(step(x), twin(x)) for _ in range(3)]
  assert_close([a for a, _ in losses], [b for _, b in losses])
  assert_close(w, w_twin)
  # The weight stays split over 'model' inside the region: its gradient is summed over
  # 'data' on a quarter of it, and nothing gathers it.
  sums = [c for c in step.collectives() if c['kind'] == 'all_reduce' and c['axes'] == ('data',)]
  assert (16, 3) in [tuple(c['shape']) for c in sums], step.collectives()
  assert not [c for c in step.collectives() if c['kind'] == 'all_gather']


class ManualDense(tf.keras.layers.Layer):
  """A Dense layer whose matmul is a manual region over 'data' (the batch split by hand)."""

  def build(self, input_shape):
    self.w = self.add_weight(shape=(int(input_shape[-1]), 4), initializer='glorot_uniform')

  def call(self, x):
    return tg.shard_map(
      lambda xb, wb: tf.matmul(xb, wb), MESH24, (P('data'), P()), P('data'), axes='data'
    )(x, self.w)


def test_shard_map_in_a_keras_layer_call():
  layer = ManualDense()
  layer.build((8, 16))
  x = _rand(8, 16)

  @tf.function
  def forward(x):
    return layer(x)

  got = tg.partition(forward, MESH24)(x)
  assert_close(got, x @ layer.w.numpy())


# --- bad input: clear errors when traced or partitioned ---------------------------------------
def _partition_error(fn, mesh, *args):
  with pytest.raises(ValueError) as info:
    tg.partition(tf.function(fn), mesh)(*args)
  return str(info.value)


def test_collective_over_an_axis_not_manual_in_the_region():
  with pytest.raises(ValueError, match=r"tg.psum: mesh axis 'model' is not manual"):
    tg.partition(
      tf.function(
        lambda x: tg.shard_map(
          lambda b: tg.psum(b, 'model'), MESH24, P('data'), P('data'), axes='data'
        )(x)
      ),
      MESH24,
    )(_rand(8, 4))

  def tf_written(x):  # groups along 'model' inside a region manual over 'data' only
    x = xla_sharding.mesh_split(x, np.arange(8).reshape(2, 4), [0, -1])
    s = xla_sharding.get_op_sharding(x.op)
    m = xla_sharding.auto_to_manual_spmd_partition(x, s, single_dim=0)
    groups = [list(g) for g in MESH24.groups(('model',))]
    m = tf.raw_ops.CrossReplicaSum(input=m, group_assignment=groups)
    return xla_sharding.manual_to_auto_spmd_partition(m, s, full_shape=[8, 4], single_dim=0)

  message = _partition_error(tf_written, MESH24, _rand(8, 4))
  assert 'CrossReplicaSum' in message and "['model']" in message and "('data',)" in message


def test_group_assignment_that_is_no_mesh_axes_groups():
  def f(x):
    x = xla_sharding.split(x, 0, 8)
    s = xla_sharding.get_op_sharding(x.op)
    m = xla_sharding.auto_to_manual_spmd_partition(x, s)
    m = tf.raw_ops.CrossReplicaSum(input=m, group_assignment=[[0]])  # cross_replica_sum's default
    return xla_sharding.manual_to_auto_spmd_partition(m, s, full_shape=[8, 4])

  message = _partition_error(f, MESH8, _rand(8, 4))
  assert 'CrossReplicaSum' in message and '[[0]]' in message and 'group_assignment' in message


def test_ppermute_that_is_not_a_permutation():
  with pytest.raises(ValueError, match=r'perm \[\(0, 1\), \(1, 1\)\] is not a permutation'):
    tg.partition(
      tf.function(
        lambda x: tg.shard_map(
          lambda b: tg.ppermute(b, 'x', [(0, 1), (1, 1)]), MESH8, P('x'), P('x')
        )(x)
      ),
      MESH8,
    )(_rand(8, 4))

  def tf_written(x):
    x = xla_sharding.split(x, 0, 8)
    s = xla_sharding.get_op_sharding(x.op)
    m = xla_sharding.auto_to_manual_spmd_partition(x, s)
    m = tf.raw_ops.CollectivePermute(input=m, source_target_pairs=[[0, 1], [2, 1]])
    return xla_sharding.manual_to_auto_spmd_partition(m, s, full_shape=[8, 4])

  message = _partition_error(tf_written, MESH8, _rand(8, 4))
  assert 'CollectivePermute' in message and 'not a permutation' in message


def test_out_spec_claiming_replication_the_region_does_not_produce():
  message = _partition_error(
    lambda x: tg.shard_map(lambda b: b * 2.0, MESH8, P('x'), P())(x), MESH8, _rand(8, 4)
  )
  assert "leaves mesh axes ['x'] out" in message and 'psum or all_gather' in message
  # Replicated by a psum, or unchecked: accepted.
  tg.partition(
    tf.function(lambda x: tg.shard_map(lambda b: tg.psum(b, 'x'), MESH8, P('x'), P())(x)), MESH8
  )(_rand(8, 4))


def test_full_shape_the_shard_shape_does_not_divide_into():
  with pytest.raises(ValueError, match=r'dim 0 \(10\) does not divide into the 8 shards'):
    tg.partition(tf.function(lambda x: tg.shard_map(lambda b: b, MESH8, P('x'), P('x'))(x)), MESH8)(
      _rand(10, 4)
    )

  def tf_written(x):
    x = xla_sharding.split(x, 0, 8)
    s = xla_sharding.get_op_sharding(x.op)
    m = xla_sharding.auto_to_manual_spmd_partition(x, s)
    return xla_sharding.manual_to_auto_spmd_partition(m, s, full_shape=[24, 4])

  message = _partition_error(tf_written, MESH8, _rand(8, 4))
  assert 'XlaSpmdShardToFullShape' in message and '[1, 4]' in message and '[24, 4]' in message


def test_an_op_no_device_here_runs_is_refused_when_partitioned():
  message = _partition_error(
    lambda x: tf.raw_ops.TPUReplicatedInput(inputs=[x]) * 2.0, MESH8, _rand(8, 4)
  )
  assert 'TPUReplicatedInput' in message and 'no kernel' in message


# --- propagation boundary, explain() and tg.plan ------------------------------------------------
def _psum_region(x):
  return tg.shard_map(lambda b: tg.psum(b * 2.0, 'x'), MESH8, P('x'), P())(x)


def test_explain_marks_a_region_and_its_boundaries_and_plan_costs_its_collectives():
  propagation = tg.propagate(tf.function(_psum_region), _rand(16, 4), mesh=MESH8)
  rows = {(r['node'], r['tensor'].rsplit(':', 1)[1]): r for r in propagation.records()}
  enter = rows[('XlaSpmdFullToShardShape', '0')]
  assert enter['kind'] == 'manual' and 'manual over mesh axes' in enter['detail']
  assert rows[('CrossReplicaSum', '0')]['sharding'] == "P(None, None) manual('x')"
  assert 'manual region boundary' in rows[('XlaSpmdShardToFullShape', '0')]['detail']
  assert "manual('x')" in propagation.explain()
  report = tg.plan(tf.function(_psum_region), tf.TensorSpec([16, 4]), mesh=MESH8)
  assert [(c['kind'], tuple(c['axes'])) for c in report.collectives()] == [('all_reduce', ('x',))]
