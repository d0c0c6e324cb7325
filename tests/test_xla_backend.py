"""backend='xla': the per-replica program exported to StableHLO, compiled by XLA, run through PJRT.

Every model of tests/test_models.py (and the training loop inside one While of
tests/test_partitioned.py) runs on 8 jax CPU devices and must equal the
unpartitioned function and the default (TF-collective) backend; the collectives
are counted in the exported module (native ops, one per recorded collective) and
in the optimized HLO XLA compiled. Each collective kind is checked numerically
against numpy on 1-D and 2-D meshes, with replica groups written out by hand.
"""

import collections
import sys

import numpy as np
import pytest
import tensorflow as tf

pytest.importorskip('jax')

import tf_gspmd as tg  # noqa: E402
from tf_gspmd.testing import assert_close, assert_close_to_float64, check  # noqa: E402
from tf_gspmd.testing.float64 import float64_policy, float64_twin  # noqa: E402
from tf_gspmd.xla_bridge import (
  PjrtExecutable,
  XlaLoweringError,
  export_per_replica,  # noqa: E402
  pjrt,  # noqa: E402
  stablehlo_collectives,
)

from helpers import (  # noqa: E402
  ROOT,
  image_batches,
  keras_cnn,
  keras_mlp,
  keras_train_step,
  loop_training,
  mlp_batches,
  randn,
  variable_mlp,
)

sys.path[:0] = [str(ROOT / 'examples'), str(ROOT / 'examples' / 'keras')]
import moe  # noqa: E402
import transformer  # noqa: E402

STEPS = 3
# Recorded collective kind -> the native XLA op it is exported as.
NATIVE = {
  'all_reduce': 'all-reduce',
  'broadcast': 'all-reduce',
  'reduce_scatter': 'reduce-scatter',
  'all_gather': 'all-gather',
  'all_to_all': 'all-to-all',
  'permute': 'collective-permute',
}


def train_three(make, mesh, batches, exact=None):
  """Train the XLA backend, the TF backend and the unpartitioned step side by side.

  `make(annotate)` builds a fresh model and returns (tf.function step, variables to compare).
  `exact()`, where float32 is ill-conditioned, builds the same model in float64: the
  variables are then compared by the oracle's float64 rule. Returns the XLA
  PartitionedFunction and the compiled executable of its step.
  """
  (xla_fn, xla_vars), (tf_fn, tf_vars), (ref_fn, ref_vars) = make(True), make(True), make(False)
  xla = tg.partition(xla_fn, mesh, backend='xla')
  via_tf = tg.partition(tf_fn, mesh)
  for i, batch in enumerate(batches):
    got, other, want = (np.asarray(f(*batch)) for f in (xla, via_tf, ref_fn))
    assert_close(got, want, f'step {i + 1} loss, xla vs unpartitioned')
    assert_close(got, other, f'step {i + 1} loss, xla vs tf backend')
  if exact is None:
    assert_close(xla_vars, ref_vars, 'xla vs unpartitioned')
    assert_close(xla_vars, tf_vars, 'xla vs tf backend')
  else:
    exact_fn, exact_vars = exact()
    for batch in batches:
      exact_fn(*(np.float64(b) if np.asarray(b).dtype == np.float32 else b for b in batch))
    assert_close_to_float64(xla_vars, ref_vars, exact_vars, 'xla vs unpartitioned')
    assert_close_to_float64(tf_vars, ref_vars, exact_vars, 'tf backend vs unpartitioned')
  return xla, xla.xla_executable(*batches[0])


def check_exported_collectives(step, executable):
  """The module holds one native collective per recorded one, and no marker is left."""
  module = executable.export.module
  assert 'custom_call @tf_gspmd' not in module
  recorded = collections.Counter(NATIVE[r['kind']] for r in step.collectives())
  assert collections.Counter(stablehlo_collectives(module)) == recorded
  return recorded, executable.collective_counts()


def _keras_step(build, spec_of):
  def make(annotate):
    model, optimizer = build(annotate)
    annotate_fn = None if not annotate else spec_of
    return keras_train_step(model, optimizer, annotate_fn), model.variables + optimizer.variables

  return make


@pytest.mark.parametrize(
  'devices,batch',
  [(8, 16), pytest.param(4, 10, marks=pytest.mark.slow)],  # make test: both
)
def test_mlp_data_parallel(devices, batch):
  mesh = tg.Mesh.create((devices,), ('data',))
  make = _keras_step(lambda annotate: keras_mlp(0), lambda x: tg.shard(x, mesh, tg.P('data', None)))
  step, executable = train_three(make, mesh, mlp_batches(batch)[:STEPS])
  recorded, compiled = check_exported_collectives(step, executable)
  # Six gradients and the loss, all over 'data', resolved together (graph_rewrite/coalesce.py)
  # as one all-reduce each, side by side: no concatenation copies them in and out.
  assert recorded == {'all-reduce': 7}
  assert not any(r.get('fused') for r in step.collectives())
  # XLA's all-reduce combiner merges the seven into one tuple all-reduce; nothing else runs.
  assert compiled == {'all-reduce': 1}


def test_mlp_hidden_not_divisible_by_model_axis():
  mesh = tg.Mesh.create((2, 4), ('data', 'model'))

  def build(annotate):
    model, optimizer = keras_mlp(0, hidden=30)
    if annotate:
      layout = tg.LayoutMap(mesh)
      layout[r'.*hidden_0/kernel'] = tg.P(None, 'model')
      layout[r'.*hidden_0/bias'] = tg.P('model')
      layout[r'.*hidden_1/kernel'] = tg.P('model', None)
      assert len(layout.apply(model)) == 3
    return model, optimizer

  make = _keras_step(build, lambda x: tg.shard(x, mesh, tg.P('data', None)))
  step, executable = train_three(make, mesh, mlp_batches(10)[:STEPS])
  recorded, compiled = check_exported_collectives(step, executable)
  assert sum(r.get('fused', 1) for r in step.collectives() if r['kind'] == 'all_reduce') >= 8
  assert recorded['all-reduce'] >= 2 and compiled.get('all-reduce', 0) >= 1
  assert set(compiled) <= set(recorded)
  groups = {c.replica_groups for c in pjrt.hlo_collectives(executable.compiled_hlo())}
  assert ((0, 1, 2, 3), (4, 5, 6, 7)) in groups  # over 'model', written out by hand


@pytest.mark.slow
def test_transformer_megatron_with_adam():
  mesh = tg.Mesh.create((2, 4), ('data', 'model'))

  def make(annotate):
    model, optimizer = transformer.build(seed=0)
    if annotate:
      transformer.layout(mesh).apply(model)
    step = transformer.train_step(model, optimizer, mesh if annotate else None)
    return step, model.variables + optimizer.variables

  def exact():
    # The attention key biases have a zero gradient in exact arithmetic (a bias added to
    # every key shifts each query's scores alike; softmax cancels it): in float32 they and
    # their Adam slots hold round-off alone (measured: normwise 0.7-1.2 apart between two
    # correct float32 runs), so every variable is compared against a float64 run.
    model, optimizer = float64_twin(transformer.build, seed=0)
    with float64_policy():  # the step's Keras loss computes in the policy it is made under
      step = transformer.train_step(model, optimizer)
    return step, model.variables + optimizer.variables

  batches = [transformer.batch(seed=i) for i in range(STEPS)]
  step, executable = train_three(make, mesh, batches, exact)
  recorded, compiled = check_exported_collectives(step, executable)
  assert recorded['all-reduce'] >= 4 and compiled.get('all-reduce', 0) >= 1
  # Memory: one device holds 1/4 of every model-split weight and its Adam slots.
  sizes = step.variable_bytes()
  query = next(v for k, v in sizes.items() if 'attn_0_query_kernel_momentum' in k)
  assert query['per_device'] * 4 == query['total']


@pytest.mark.slow
def test_cnn_with_halos_and_batchnorm():
  mesh = tg.Mesh.create((2, 4), ('data', 'h'))
  make = _keras_step(
    lambda annotate: keras_cnn(0), lambda x: tg.shard(x, mesh, tg.P('data', 'h', None, None))
  )
  step, executable = train_three(make, mesh, image_batches(4)[:STEPS])
  recorded, compiled = check_exported_collectives(step, executable)
  assert 'all-gather' not in recorded
  assert recorded['collective-permute'] >= 8  # halos of both convs and the pool, both ways
  # Measured: 12 exported, 6 left after XLA's optimizer (it merges permutes it finds alike).
  assert compiled['collective-permute'] >= 6


def test_mixture_of_experts_with_all_to_all():
  mesh = tg.Mesh.create((2, 4), ('data', 'model'))

  def make(annotate):
    w = moe.weights(0)
    if annotate:
      moe.annotate(w, mesh)
    return moe.train_step(w, mesh if annotate else None), list(w.values())

  step, executable = train_three(make, mesh, [moe.batch(seed=i) for i in range(STEPS)])
  recorded, compiled = check_exported_collectives(step, executable)
  assert recorded['all-to-all'] == 3  # dispatch, combine, combine's gradient
  # XLA's optimizer merged the two identical ones tf_gspmd once exported (4 -> 3); tf_gspmd now
  # reuses the forward's reshard itself.
  assert compiled['all-to-all'] == 3
  a2a_groups = {
    c.replica_groups
    for c in pjrt.hlo_collectives(executable.compiled_hlo())
    if c.kind == 'all-to-all'
  }
  assert a2a_groups == {((0, 1, 2, 3), (4, 5, 6, 7))}


def test_training_loop_inside_one_while():
  mesh = tg.Mesh.create((2, 4), ('data', 'model'))
  x = randn(2, 10, 16)
  y = np.random.RandomState(3).randint(0, 4, 10).astype(np.int32)

  def make(annotate):
    w = variable_mlp(0)
    if annotate:
      tg.shard_variable(w[0], mesh, tg.P(None, 'model'))
      tg.shard_variable(w[1], mesh, tg.P('model', None))
    return loop_training(mesh, *w, annotate=annotate), w

  # The trip count is a Python number: XLA needs a tf.range bound as a compile-time constant.
  step, executable = train_three(make, mesh, [(x, y, 4)])
  recorded, compiled = check_exported_collectives(step, executable)
  # Three over 'data' (one bucket, side by side) and one over 'model', all in the loop.
  assert recorded == {'all-reduce': 4}
  assert not any(r.get('fused') for r in step.collectives())
  assert ' while(' in executable.compiled_hlo() and compiled.get('all-reduce', 0) >= 1
  # As a tensor, the trip count is a run-time input of one compiled program (a dynamic while).
  w_tensor, w_ref = variable_mlp(0), variable_mlp(0)
  tg.shard_variable(w_tensor[0], mesh, tg.P(None, 'model'))
  tg.shard_variable(w_tensor[1], mesh, tg.P('model', None))
  looped = tg.partition(loop_training(mesh, *w_tensor, annotate=True), mesh, backend='xla')
  reference = loop_training(mesh, *w_ref, annotate=False)
  for steps in (3, 1):
    assert_close(
      looped(x, y, tf.constant(steps)),
      reference(x, y, tf.constant(steps)),
      f'loss after {steps} steps',
    )
  assert len(looped._compiled) == 1  # noqa: SLF001
  assert_close(list(w_tensor), list(w_ref), 'weights')


def test_an_argument_xla_needs_as_a_constant_is_refused_by_name():
  mesh = tg.Mesh.create((8,), ('data',))

  @tf.function
  def weighted(x, n):  # tf.range(n): XLA needs n at compile time
    return x * tf.reduce_sum(tf.cast(tf.range(n), tf.float32))

  step = tg.partition(weighted, mesh, in_shardings=[tg.P('data'), None])
  # Exported from a tensor, tf2xla would bake in the example value: refused, naming it.
  with pytest.raises(XlaLoweringError, match=r'n.*compile-time constants'):
    step.export_xla(np.ones([8], np.float32), tf.constant(4))


# --- variables: resident, synced, scattered -----------------------------------------------------
def test_variables_stay_on_device_and_user_weights_are_used_after_scatter():
  mesh = tg.Mesh.create((8,), ('data',))
  w = tf.Variable(np.ones((16, 8), np.float32))
  tg.shard_variable(w, mesh, tg.P(None, 'data'))

  @tf.function
  def step(x):
    w.assign_add(tf.ones_like(w))
    return tf.reduce_sum(tf.matmul(x, w))

  pf = tg.partition(step, mesh, backend='xla')
  x = np.ones((2, 16), np.float32)
  pf(x)
  (sharded,) = pf.sharded_variables()
  assert isinstance(sharded, pjrt.XlaShardedVariable) and len(sharded.shards) == 8
  assert sharded.shards[3].devices() == {pjrt.jax_devices(8)[3]}
  assert pf.variable_bytes()[w.name] == {'total': 512, 'per_device': 64}
  np.testing.assert_array_equal(w.numpy(), 2.0)  # w reads its device buffers: one state
  w.assign(np.full((16, 8), 5.0, np.float32))  # the user loads new weights: the buffers
  assert_close(pf(x), np.float32(2 * 16 * 8 * 6.0), 'sum after the loaded weights')
  np.testing.assert_array_equal(w.numpy(), 6.0)


def test_export_describes_layouts_and_explain_works():
  mesh = tg.Mesh.create((2, 4), ('data', 'model'))
  w = tf.Variable(np.ones((16, 8), np.float32))
  tg.shard_variable(w, mesh, tg.P(None, 'model'))

  @tf.function
  def f(x):
    x = tg.shard(x, mesh, tg.P('data', None))
    return tf.matmul(x, w)

  pf = tg.partition(f, mesh)  # export works from the default backend too
  export = pf.export_xla(np.ones((6, 16), np.float32))
  assert [(a.kind, a.local_shape) for a in export.args] == [
    ('argument', (3, 16)),
    ('variable', (16, 2)),
  ]
  assert export.args[0].sharding.spec == tg.P('data', None)
  assert [(r.kind, r.shape) for r in export.results] == [('output', (6, 8))]
  assert 'func.func @main' in export.module and 'stablehlo.replica_id' in export.module
  assert 'partition_id' not in export.module.split('func.func @main')[1].split('\n')[0]
  assert 'variable' in export.describe() and "P(None, 'model')" in export.describe()
  assert 'tf.' not in export.module.split('func.func @main')[1].split('{')[0]


def test_unlowerable_op_is_named():
  mesh = tg.Mesh.create((8,), ('x',))

  def fn(ctx, x):
    return tf.numpy_function(lambda v: v * 2, [x], tf.float32, name='host_double')

  with pytest.raises(XlaLoweringError, match=r'PyFunc.*host_double'):
    export_per_replica(mesh, fn, [np.ones((2,), np.float32)])


def test_bad_backend_is_refused():
  with pytest.raises(ValueError, match='backend'):
    tg.partition(tf.function(lambda x: x), tg.Mesh.create((8,), ('x',)), backend='tpu')


def test_a_saved_model_of_an_xla_backend_function_is_refused_naming_save_xla(tmp_path):
  mesh = tg.Mesh.create((8,), ('x',))
  step = tg.partition(tf.function(lambda x: tf.nn.relu(x) * 2), mesh, backend='xla')
  step(np.ones((8, 4), np.float32))
  with pytest.raises(ValueError, match=r"backend='xla'.*save_xla"):
    tg.saved_model.save(step, str(tmp_path / 'model'))


# --- each collective, numerically, on 1-D and 2-D meshes -----------------------------------------
MESH_1D = tg.Mesh.create((8,), ('x',))
MESH_2D = tg.Mesh.create((2, 4), ('x', 'y'))
# Replica groups written out by hand (row-major device ids; members in position order).
GROUPS = {
  (MESH_1D, ('x',)): [[0, 1, 2, 3, 4, 5, 6, 7]],
  (MESH_2D, ('y',)): [[0, 1, 2, 3], [4, 5, 6, 7]],
  (MESH_2D, ('x',)): [[0, 4], [1, 5], [2, 6], [3, 7]],
  (MESH_2D, ('x', 'y')): [[0, 1, 2, 3, 4, 5, 6, 7]],
  (MESH_2D, ('y', 'x')): [[0, 4, 1, 5, 2, 6, 3, 7]],
}
LOCAL_SHAPE = (5, 8)
OPS = ('sum', 'max', 'min', 'prod')
PAIRS = [(0, 7), (7, 0), (3, 4)]


def _collective_program(mesh, axes_list):
  def fn(ctx, x):
    c, out = ctx.collectives, []
    for axes in axes_list:
      k = mesh.axes_size(axes)
      out += [c.all_reduce(x, axes, op) for op in OPS]
      out += [
        c.reduce_scatter(x, axes, 0),
        c.all_gather(x, axes, 1),
        c.all_to_all(x, axes, 1, 0),
        c.broadcast(x, axes, k - 1),
      ]
    out += [
      c.shift(x, mesh.axis_names[-1], 1),
      c.shift(x, mesh.axis_names[-1], -1, cyclic=True),
      c.permute(x, PAIRS),
    ]
    return out

  return fn


@pytest.fixture(scope='module', params=['1d', '2d'])
def collective_run(request):
  """One compiled program per mesh holding every kind over every axis set; run once."""
  mesh = MESH_1D if request.param == '1d' else MESH_2D
  axes_list = [axes for (m, axes) in GROUPS if m is mesh]
  export = export_per_replica(
    mesh, _collective_program(mesh, axes_list), [np.zeros(LOCAL_SHAPE, np.float32)]
  )
  executable = PjrtExecutable(export)
  rng = np.random.default_rng(0)
  inputs = [rng.uniform(0.5, 1.5, LOCAL_SHAPE).astype(np.float32) for _ in range(8)]
  outputs = executable.run([pjrt.put_local(inputs, executable.devices)])
  got = [[np.asarray(b) for b in result] for result in outputs]
  return mesh, axes_list, inputs, got, executable


def _expected(mesh, axes_list, x):
  """What every replica should hold, from numpy and the hand-written groups."""
  want = [[] for _ in range(8)]
  reduce = {'sum': np.sum, 'max': np.max, 'min': np.min, 'prod': np.prod}
  for axes in axes_list:
    for group in GROUPS[(mesh, axes)]:
      k = len(group)
      stacked = np.stack([x[m] for m in group])
      chunk = -(-LOCAL_SHAPE[0] // k)
      padded = np.pad(stacked, [(0, 0), (0, k * chunk - LOCAL_SHAPE[0]), (0, 0)])
      for pos, member in enumerate(group):
        want[member] += [reduce[op](stacked, axis=0) for op in OPS]
        want[member].append(padded.sum(0)[pos * chunk : (pos + 1) * chunk])
        want[member].append(np.concatenate(list(stacked), axis=1))
        cols = LOCAL_SHAPE[1] // k
        want[member].append(
          np.concatenate([x[m][:, pos * cols : (pos + 1) * cols] for m in group], 0)
        )
        want[member].append(x[group[-1]])
  last = mesh.axis_names[-1]
  rows = GROUPS[(mesh, (last,))]
  for row in rows:
    for pos, member in enumerate(row):
      want[member].append(x[row[pos - 1]] if pos > 0 else np.zeros(LOCAL_SHAPE, np.float32))
      want[member].append(x[row[(pos + 1) % len(row)]])
  for member in range(8):
    source = [s for s, t in PAIRS if t == member]
    want[member].append(x[source[0]] if source else np.zeros(LOCAL_SHAPE, np.float32))
  return want


def test_every_collective_matches_numpy(collective_run):
  mesh, axes_list, inputs, got, _ = collective_run
  want = _expected(mesh, axes_list, inputs)
  failures = []
  for member in range(8):
    assert len(want[member]) == len(got), (member, len(want[member]), len(got))
    for j, expected in enumerate(want[member]):
      verdict = check(got[j][member], expected, f'{mesh} replica {member} result {j}')
      if not verdict.ok:
        failures.append(str(verdict))
  assert not failures, '\n'.join(failures)


def test_compiled_collectives_carry_hand_written_groups(collective_run):
  mesh, axes_list, _, _, executable = collective_run
  kinds = collections.Counter(stablehlo_collectives(executable.export.module))
  n = len(axes_list)
  assert kinds == {
    'all-reduce': 5 * n,
    'reduce-scatter': n,
    'all-gather': n,
    'all-to-all': n,
    'collective-permute': 3,
  }
  found = pjrt.hlo_collectives(executable.compiled_hlo())
  want = {tuple(map(tuple, GROUPS[(mesh, axes)])) for axes in axes_list}
  assert {c.replica_groups for c in found if c.kind == 'all-gather'} == want
  assert {c.replica_groups for c in found if c.kind == 'all-to-all'} == want
  pairs = {c.source_target_pairs for c in found if c.kind == 'collective-permute'}
  assert tuple(sorted(PAIRS)) in {tuple(sorted(p)) for p in pairs}


def test_a_boolean_constant_lowers_and_runs():
  """A non-splat boolean constant (an attention's causal mask): TF's MLIR prints it packed
  eight to a byte, jaxlib's parser reads a byte each (xla_bridge/export.py `_bool_per_byte`);
  it failed to parse before. The mask is uneven along rows, so a wrong unpacking is seen."""
  mesh = tg.Mesh.create((2, 4), ('data', 'model'))
  mask = np.tril(np.ones((16, 16), bool))[None, None]
  mask[0, 0, 0, 5] = True

  @tf.function
  def masked_softmax(scores):
    scores = tg.shard(scores, mesh, tg.P('data', 'model', None, None))
    return tf.nn.softmax(tf.where(tf.constant(mask), scores, -1e9), axis=-1)

  scores = tf.constant(np.random.RandomState(0).randn(2, 4, 16, 16).astype(np.float32))
  got = tg.partition(masked_softmax, mesh, backend='xla')(scores)
  assert_close(got, masked_softmax(scores), 'masked softmax')


def test_a_seed_reset_rebuilds_nothing(monkeypatch):
  """tf.random.set_seed clears TF's kernel cache (the TF backend's next call instantiates its
  multi-device function again, seconds); backend='xla' keeps its compiled program."""
  from tf_gspmd.xla_bridge import pjrt

  compiled = []
  original = pjrt.PjrtExecutable.__init__

  def counted(self, *args, **kwargs):
    compiled.append(1)
    original(self, *args, **kwargs)

  monkeypatch.setattr(pjrt.PjrtExecutable, '__init__', counted)
  mesh = tg.Mesh.create((2, 4), ('data', 'model'))
  w = tf.Variable(np.random.RandomState(0).randn(16, 8).astype(np.float32))
  tg.shard_variable(w, mesh, tg.P(None, 'model'))

  @tf.function
  def step(x):
    y = tf.matmul(tg.shard(x, mesh, tg.P('data', None)), w)
    w.assign_sub(0.01 * tf.matmul(x, y, transpose_a=True))
    return tf.reduce_sum(y)

  x = np.random.RandomState(1).randn(8, 16).astype(np.float32)
  partitioned = tg.partition(step, mesh, backend='xla')
  first = partitioned(x)
  tf.random.set_seed(3)
  second = partitioned(x)
  assert len(compiled) == 1, f'{len(compiled)} programs compiled for one signature'
  w.assign(np.random.RandomState(0).randn(16, 8).astype(np.float32))
  assert_close([first, second], [step(x), step(x)], 'the steps around the seed reset')
