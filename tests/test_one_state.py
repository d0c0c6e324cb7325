"""One state per variable (#31): a partitioned variable lives once, as its shards.

Each case a new user meets on the plain `tg.partition` API or with Keras, against the same
steps run by plain TF on a twin of the variables, through the oracle: functions partitioned
separately share the shards, a write between calls is what the next call reads, whatever
reads a variable sees the trained value, and no whole copy of a split variable is kept.
"""

import gc

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_gspmd as tg
from tf_gspmd.program import held
from tf_gspmd.testing import assert_close

MESH = ((2, 4), ('data', 'model'))


def _weights():
  return (
    np.random.RandomState(1).randn(16, 64).astype(np.float32),
    np.random.RandomState(2).randn(64, 4).astype(np.float32),
  )


def _steps(w1, w2, mesh=None):
  """The README's Megatron step (annotated when `mesh` is given) and an evaluation step."""
  if mesh is not None:
    tg.shard_variable(w1, mesh, tg.P(None, 'model'))
    tg.shard_variable(w2, mesh, tg.P('model', None))

  def loss_of(x, y):
    logits = tf.matmul(tf.nn.relu(tf.matmul(x, w1)), w2)
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits))

  @tf.function
  def train_step(x, y):
    if mesh is not None:
      x = tg.shard(x, mesh, tg.P('data', None))
    with tf.GradientTape() as tape:
      loss = loss_of(x, y)
    g1, g2 = tape.gradient(loss, [w1, w2])
    w1.assign_sub(0.1 * g1)
    w2.assign_sub(0.1 * g2)
    return loss

  @tf.function
  def eval_step(x, y):
    return loss_of(x, y)

  return train_step, eval_step


def _data():
  return (
    np.random.RandomState(0).randn(16, 16).astype(np.float32),
    np.random.RandomState(1).randint(0, 4, 16).astype(np.int32),
  )


def _pair(backend='tf', as_shards=False):
  """(partitioned train, partitioned eval, their variables), (plain train, plain eval, twins).

  `as_shards`: the partitioned side's variables made as shards (`tg.Variable`), else plain
  tf.Variables the partitioned functions adopt.
  """
  mesh = tg.Mesh.create(*MESH)
  specs = (tg.P(None, 'model'), tg.P('model', None))
  if as_shards:
    a = [
      tg.Variable(v, tg.NamedSharding(mesh, spec), name=n, backend=backend)
      for v, n, spec in zip(_weights(), ('w1', 'w2'), specs)
    ]
  else:
    a = [tf.Variable(v, name=n) for v, n in zip(_weights(), ('w1', 'w2'))]
  b = [tf.Variable(v, name=n) for v, n in zip(_weights(), ('w1', 'w2'))]
  train, evaluate = _steps(*a, mesh)
  plain_train, plain_eval = _steps(*b)
  return (
    (tg.partition(train, mesh, backend=backend), tg.partition(evaluate, mesh, backend=backend), a),
    (plain_train, plain_eval, b),
  )


# The XLA rows build an XLA program each: `make test` runs them, the edit loop the TF rows.
BACKENDS = ['tf', pytest.param('xla', marks=pytest.mark.slow)]


@pytest.mark.parametrize('backend', BACKENDS)
def test_train_and_eval_partitioned_separately_share_the_trained_weights(backend):
  if backend == 'xla':
    pytest.importorskip('jax')
  (train, evaluate, _), (plain_train, plain_eval, _) = _pair(backend)
  x, y = _data()
  assert_close(evaluate(x, y), plain_eval(x, y), 'eval before training')
  for i in range(3):
    assert_close(train(x, y), plain_train(x, y), f'train step {i}')
  # On main the evaluation kept reading its own copy of the untrained weights (10.9 vs 0.0005).
  assert_close(evaluate(x, y), plain_eval(x, y), 'eval after 3 training steps')


@pytest.mark.parametrize('backend', BACKENDS)
def test_a_write_between_calls_is_what_the_next_call_reads(backend, tmp_path):
  if backend == 'xla':
    pytest.importorskip('jax')
  (train, evaluate, (w1, w2)), (plain_train, plain_eval, (v1, v2)) = _pair(backend)
  x, y = _data()
  train(x, y), plain_train(x, y)
  for w in (w1, v1):
    w.assign(tf.zeros_like(w))  # assign
  assert_close(train(x, y), plain_train(x, y), 'step after assign(zeros)')

  checkpoint, twin = tf.train.Checkpoint(w1=w1, w2=w2), tf.train.Checkpoint(w1=v1, w2=v2)
  saved, saved_twin = checkpoint.save(str(tmp_path / 'a')), twin.save(str(tmp_path / 'b'))
  # tf.train.Checkpoint.save without sync_variables() writes the trained values.
  reader = tf.train.load_checkpoint(saved)
  assert_close(reader.get_tensor('w1/.ATTRIBUTES/VARIABLE_VALUE'), v1.numpy(), 'saved w1')
  for _ in range(2):
    train(x, y), plain_train(x, y)
  checkpoint.restore(saved), twin.restore(saved_twin)  # tf.train.Checkpoint.restore
  assert_close(evaluate(x, y), plain_eval(x, y), 'eval after tf.train.Checkpoint.restore')

  directory = str(tmp_path / 'tg')
  tg.save_checkpoint([w1, w2], directory)
  for _ in range(2):
    train(x, y)
  tg.restore_checkpoint(directory, [w1, w2])  # the export page's form: plain variables
  assert_close(evaluate(x, y), plain_eval(x, y), 'eval after tg.restore_checkpoint([w1, w2])')
  assert_close(train(x, y), plain_train(x, y), 'train after the restores')


@pytest.mark.parametrize('backend', BACKENDS)
def test_only_plain_variables_written_since_the_last_call_are_copied_into_their_shards(
  backend, monkeypatch
):
  """The first step copies no adopted variable in (its shards were made from its value), nor
  does a step after a step (before: every call copied every one; on backend='xla' half the
  Megatron transformer's step, on a ResNet's raw step a quarter of the first call); a write
  between calls is still copied, and only the written variable."""
  if backend == 'xla':
    pytest.importorskip('jax')
  (train, evaluate, (w1, w2)), (plain_train, plain_eval, (v1, v2)) = _pair(backend)
  x, y = _data()
  copied = []
  copy_now = tg.PartitionedFunction._copy_now  # noqa: SLF001

  def recorded(self, copy, adopted, what):
    copied.append((copy.__name__, sorted(v.name for v in adopted)))
    return copy_now(self, copy, adopted, what)

  monkeypatch.setattr(tg.PartitionedFunction, '_copy_now', recorded)
  assert_close(train(x, y), plain_train(x, y), 'first step')
  assert copied == [('gather_adopted', ['w1:0', 'w2:0'])]
  copied.clear()
  assert_close(train(x, y), plain_train(x, y), 'second step')
  assert_close(evaluate(x, y), plain_eval(x, y), 'eval after it')
  assert copied == [('gather_adopted', ['w1:0', 'w2:0'])]  # the step's writes, copied back
  for w in (w2, v2):
    w.assign_add(tf.ones_like(w))
  copied.clear()
  assert_close(train(x, y), plain_train(x, y), 'step after assign_add to w2')
  assert copied[0] == ('scatter_adopted', ['w2:0'])
  assert_close(w1.numpy(), v1.numpy(), 'w1 after it')


@pytest.mark.parametrize('as_shards', [False, True], ids=['adopted', 'split'])
def test_plain_reads_and_functions_traced_before_see_the_trained_value(as_shards):
  (train, _, (w1, w2)), (plain_train, _, (v1, v2)) = _pair(as_shards=as_shards)
  x, y = _data()

  @tf.function
  def total_traced_before():
    return tf.reduce_sum(w1)

  total_traced_before()  # traced before the first partitioned call
  train(x, y), plain_train(x, y)

  @tf.function
  def total():
    return tf.reduce_sum(w1) + tf.reduce_sum(w2)

  assert_close(total(), tf.reduce_sum(v1) + tf.reduce_sum(v2), 'a plain tf.function')
  assert_close(w1.numpy(), v1.numpy(), 'numpy()')
  assert_close(tf.reduce_sum(w1), tf.reduce_sum(v1), 'an eager op on the variable')
  assert tuple(tf.shape(w1).numpy()) == (16, 64)
  assert_close(total_traced_before(), tf.reduce_sum(v1), 'a function traced before')


@pytest.mark.parametrize('as_shards', [False, True], ids=['adopted', 'split'])
def test_gradients_of_a_plain_function_over_held_variables(as_shards):
  """Training the same variables unpartitioned (a plain tf.function) after partitioning."""
  (train, _, (w1, w2)), (plain_train, _, (v1, v2)) = _pair(as_shards=as_shards)
  x, y = _data()
  train(x, y), plain_train(x, y)
  retraced, _ = _steps(w1, w2)  # a plain step over the held variables
  for i in range(2):
    assert_close(retraced(x, y), plain_train(x, y), f'plain step {i} over held variables')
  assert_close(train(x, y), plain_train(x, y), 'partitioned step after them')


@pytest.mark.parametrize('backend', BACKENDS)
def test_a_traced_write_between_partitioned_steps_is_what_the_next_step_reads(backend):
  """Split variables written by a plain tf.function between two partitioned steps: the next
  step and every read see the write (on backend='xla' the write goes through the mirror to
  new buffers, and the array the first step left must not be taken for the value)."""
  if backend == 'xla':
    pytest.importorskip('jax')
  (train, _, (w1, w2)), (plain_train, _, (p1, p2)) = _pair(backend, as_shards=True)

  def nudge(a, b):
    @tf.function
    def write():
      a.assign_add(tf.ones_like(a))
      b.assign(b * 0.5)

    return write

  x, y = _data()
  assert_close(train(x, y), plain_train(x, y), 'first step')
  nudge(w1, w2)()
  nudge(p1, p2)()
  assert_close([w1.numpy(), w2.numpy()], [p1.numpy(), p2.numpy()], 'after the traced write')
  assert_close(train(x, y), plain_train(x, y), 'the step after the write')
  assert_close([w1.numpy(), w2.numpy()], [p1.numpy(), p2.numpy()], 'after that step')


def _split_shapes(variables):
  return {
    tuple(v.shape)
    for v in variables
    if any(e is not None for e in getattr(tg.get_sharding(v), 'spec', ()) or ())
  }


def _live_variables() -> list:
  """Every live tf.Variable: what a test's `_whole_copies` leaves out as not its own (other
  tests' leftovers). Held by the test, so no id among them is reused while it runs."""
  return [o for o in gc.get_objects() if isinstance(o, tf.Variable)]


def _whole_copies(shapes, exclude=(), before=()):
  """Live tf.Variables (other than those made as shards, `exclude` and those alive `before`)
  of any of these shapes."""
  skip = {id(v) for v in list(exclude) + list(before)}
  skip |= {id(v.logical) for v in held.held_variables()}
  return [
    o.name
    for o in gc.get_objects()
    if isinstance(o, tf.Variable)
    and not held.is_split(o)
    and id(o) not in skip
    and tuple(o.shape) in shapes
  ]


def test_no_whole_copy_of_a_variable_made_as_shards_after_partition():
  gc.collect()
  before = _live_variables()
  (train, _, (w1, w2)), _ = _pair(as_shards=True)
  shapes = {(16, 64), (64, 4)}
  x, y = _data()
  train(x, y)
  gc.collect()
  assert held.is_held(w1) and held.is_held(w2)
  # The twins (the plain run's variables) are the only whole variables of these shapes.
  assert len(_whole_copies(shapes, before=before)) == 2
  for holder in (held.holder_of(w1), held.holder_of(w2)):
    assert all(tuple(s.shape) != tuple(holder.shape) for s in holder.shards)


def _keras_model(seed=0):
  keras.utils.set_random_seed(seed)
  model = keras.Sequential(
    [
      keras.Input((32,)),
      keras.layers.Dense(64, use_bias=False, name='d0'),
      keras.layers.Dense(64, use_bias=False, name='d1'),
      keras.layers.Dense(4, name='out'),
    ],
    name='mlp',
  )
  model.compile(optimizer=keras.optimizers.Adam(1e-2, name='opt'), loss='mse')
  return model


@pytest.fixture
def keras_distribution():
  tg.keras.enable()
  yield
  keras.distribution.set_distribution(None)
  tg.keras.disable()


def _keras_on(backend: str) -> None:
  """tf_gspmd.keras on `backend` (the keras_distribution fixture disables it after the test);
  backend='xla' needs jax."""
  if backend == 'xla':
    pytest.importorskip('jax')
  tg.keras.enable(backend)


def _model_parallel(layouts: dict):
  """Keras' ModelParallel on the 2x4 ('batch', 'model') mesh, `layouts` (path -> axes) its map."""
  device_mesh = keras.distribution.DeviceMesh(
    (2, 4), ['batch', 'model'], keras.distribution.list_devices()
  )
  layout_map = keras.distribution.LayoutMap(device_mesh)
  for path, axes in layouts.items():
    layout_map[path] = axes
  return keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name='batch')


def _made_under(distribution, make):
  """`make()` with `distribution` current, and none after."""
  keras.distribution.set_distribution(distribution)
  try:
    return make()
  finally:
    keras.distribution.set_distribution(None)


def _fit_beside(model, reference):
  """Both models fit on the same data; the partitioned one's weights equal the plain one's."""
  rng = np.random.RandomState(0)
  x, y = rng.randn(32, 32).astype(np.float32), rng.randn(32, 4).astype(np.float32)
  reference.fit(x, y, batch_size=16, epochs=2, verbose=0)
  model.fit(x, y, batch_size=16, epochs=2, verbose=0)
  for got, want, v in zip(model.get_weights(), reference.get_weights(), model.weights):
    assert_close(got, want, v.path)


@pytest.mark.parametrize('backend', BACKENDS)
def test_model_parallel_keras_model_is_made_and_trained_as_shards(backend, keras_distribution):
  _keras_on(backend)
  gc.collect()
  before = _live_variables()
  reference = _keras_model()
  model = _made_under(_model_parallel({r'.*/d\d/kernel': (None, 'model')}), _keras_model)
  kernel = tg.keras.backing(model.layers[0].kernel)
  assert held.is_held(kernel)  # made as shards: never whole on a device
  _fit_beside(model, reference)
  gc.collect()
  exclude = [tg.keras.backing(v) for v in reference.weights + reference.optimizer.variables]
  assert _whole_copies({(32, 64), (64, 64)}, exclude, before) == []
  # Optimizer slots of split kernels are held too (they inherit the kernel's layout).
  slots = [v for v in model.optimizer.variables if tuple(v.shape) == (64, 64)]
  assert slots and all(held.is_held(tg.keras.backing(v)) for v in slots)


def _functional_model(seed=0):
  """Layers that Keras traces symbolically to infer their output shape (EinsumDense, a layer
  reading its own weight in `call`): each reads its split weights in a scratch graph."""

  class Scale(keras.layers.Layer):
    def build(self, shape):
      self.scale = self.add_weight(shape=(shape[-1],), initializer='ones', name='scale')

    def call(self, x):
      return x * self.scale

  keras.utils.set_random_seed(seed)
  inputs = keras.Input((32,))
  hidden = keras.layers.EinsumDense('bi,ih->bh', output_shape=64, name='e0')(inputs)
  hidden = Scale(name='s0')(hidden)
  outputs = keras.layers.EinsumDense('bh,ho->bo', output_shape=4, name='e1')(hidden)
  model = keras.Model(inputs, outputs)
  model.compile(optimizer=keras.optimizers.Adam(1e-2), loss='mse')
  return model


@pytest.mark.parametrize('backend', BACKENDS)
def test_a_functional_model_built_over_split_weights_keeps_no_whole_copy(
  backend, keras_distribution
):
  """Keras builds a functional model by calling each layer in a scratch graph it never runs;
  a split weight read there gives its shape. It made a whole TF copy of every such weight on
  backend='xla' (a mirror for traced reads), refreshed from the devices after every step."""
  _keras_on(backend)
  gc.collect()
  before = _live_variables()
  reference = _functional_model()
  layouts = {r'e\d/kernel': (None, 'model'), r's0/scale': ('model',)}
  model = _made_under(_model_parallel(layouts), _functional_model)
  assert all(held.is_split(tg.keras.backing(v)) for v in model.weights)
  _fit_beside(model, reference)
  gc.collect()
  exclude = [tg.keras.backing(v) for v in reference.weights + reference.optimizer.variables]
  assert _whole_copies({(32, 64), (64,), (64, 4)}, exclude, before) == []
  # A plain traced read still sees the trained value.
  kernel = model.layers[1].kernel
  assert_close(tf.function(lambda: tf.identity(kernel))(), model.get_weights()[0], 'traced')


@pytest.mark.parametrize('backend', BACKENDS)
def test_a_tf_function_traced_while_keras_builds_reads_the_weight(backend, keras_distribution):
  """A layer whose call is a tf.function is traced inside Keras' scratch graph when the
  functional model is built; TF keeps that trace and a later call reuses it. Its reads must
  read the weight: a shape-only read there gave 0.0 for every later call, silently."""
  _keras_on(backend)

  class Scale(keras.layers.Layer):
    def build(self, shape):
      self.scale = self.add_weight(shape=(shape[-1],), initializer='ones', name='scale')

    @tf.function
    def call(self, x):
      return x * self.scale

  def model_of_one_layer():
    inputs = keras.Input((8,))
    return keras.Model(inputs, Scale(name='s0')(inputs))

  def made(distribution):
    model = _made_under(distribution, model_of_one_layer)
    model.layers[1].scale.assign(np.arange(8, dtype=np.float32))
    return model

  model = made(_model_parallel({'s0/scale': ('model',)}))
  assert held.is_split(tg.keras.backing(model.layers[1].scale))
  x = np.ones((4, 8), np.float32)
  assert_close(model(x), made(None)(x), 'the layer traced while Keras built the model')


@pytest.mark.slow  # two Keras models trained and restored (make test runs it)
def test_restore_into_a_model_whose_optimizer_is_not_built_restores_its_slots(tmp_path):
  mesh = tg.Mesh.create(*MESH)
  rng = np.random.RandomState(0)
  x, y = rng.randn(32, 32).astype(np.float32), rng.randn(32, 4).astype(np.float32)
  trained = tg.partition_model(_keras_model(), mesh, 'data')
  trained.fit(x, y, batch_size=16, epochs=1, verbose=0)
  tg.save_checkpoint(trained, str(tmp_path))
  fresh = tg.partition_model(_keras_model(seed=5), mesh, 'data')
  assert not fresh.optimizer.built
  tg.restore_checkpoint(str(tmp_path), fresh)
  assert fresh.optimizer.built  # its slots were made and restored, not skipped
  want = {v.path: v.numpy() for v in trained.optimizer.variables}
  for v in fresh.optimizer.variables:
    assert_close(v.numpy(), want[v.path], v.path)
  assert_close(fresh.train_on_batch(x[:16], y[:16]), trained.train_on_batch(x[:16], y[:16]), 'l')


def test_variables_made_as_shards_with_tg_variable_and_sharded_variables():
  gc.collect()
  before = _live_variables()
  mesh = tg.Mesh.create(*MESH)
  value = np.random.RandomState(3).randn(16, 64).astype(np.float32)
  w = tg.Variable(value, tg.NamedSharding(mesh, tg.P(None, 'model')), name='w')
  assert held.is_held(w) and tg.get_sharding(w).spec == tg.P(None, 'model')
  assert_close(w.numpy(), value, 'tg.Variable')
  with tg.sharded_variables(mesh, {r'.*kernel': tg.P('data', 'model')}):
    k = tf.Variable(lambda: tf.constant(value), name='dense/kernel')
    b = tf.Variable(tf.zeros([64]), name='dense/bias')
  assert held.is_held(k) and not held.is_held(b)
  assert_close(k.numpy(), value, 'sharded_variables')

  @tf.function
  def f(x):
    return tf.reduce_sum(tf.matmul(x, k) + b + tf.matmul(x, w))

  x = np.random.RandomState(4).randn(8, 16).astype(np.float32)
  want = float(tf.reduce_sum(x @ value * 2))
  assert_close(tg.partition(f, mesh)(x), np.float32(want), 'partitioned over variables made so')
  assert _whole_copies({(16, 64)}, before=before) == []


def test_sync_and_scatter_variables_are_deprecated_no_ops():
  (train, _, (w1, _)), _ = _pair()
  x, y = _data()
  train(x, y)
  before = w1.numpy()
  with pytest.warns(DeprecationWarning, match='does nothing'):
    train.sync_variables()
  with pytest.warns(DeprecationWarning, match='does nothing'):
    train.scatter_variables()
  assert np.array_equal(w1.numpy(), before)


def test_shards_that_would_not_fit_a_device_are_refused_before_any_is_made(monkeypatch):
  """Where TF tells a device's memory (a GPU's memory limit; faked here for the CPUs)."""
  from tf_gspmd.partitioned import variables as variables_lib

  monkeypatch.setattr(variables_lib, 'device_capacity', lambda device: 1024)  # 1 KiB each
  mesh = tg.Mesh.create(*MESH)
  w1, w2 = (tf.Variable(v, name=n) for v, n in zip(_weights(), ('big_w1', 'big_w2')))
  train, _ = _steps(w1, w2, mesh)
  need = r'(?s)need 1\.2 KiB on device /device:CPU:0, which holds 1\.0 KiB.*big_w1'
  with pytest.raises(ValueError, match=need) as error:
    tg.partition(train, mesh)(*_data())
  text = str(error.value)
  assert 'big_w1' in text and 'per device' in text and 'tg.plan predicts' in text
  assert not held.is_held(w1) and not held.is_held(w2)  # refused before any shard was made
  with pytest.raises(ValueError, match='tg.plan predicts'):
    tg.Variable(np.zeros((64, 64), np.float32), tg.NamedSharding(mesh, tg.P(None, 'model')))


def test_xla_backend_refuses_shards_that_would_not_fit_before_any_is_made(monkeypatch):
  """backend='xla' checks too, with what a PJRT device reports (faked here for the CPUs)."""
  from tf_gspmd.partitioned import xla_executor

  monkeypatch.setattr(xla_executor, 'device_capacity', lambda device: 1024)
  mesh = tg.Mesh.create(*MESH)
  w1, w2 = (tf.Variable(v, name=n) for v, n in zip(_weights(), ('big_w1', 'big_w2')))
  train, _ = _steps(w1, w2, mesh)
  with pytest.raises(ValueError, match=r'(?s)need 1\.2 KiB on device .*which holds 1\.0 KiB'):
    tg.partition(train, mesh, backend='xla')(*_data())
  assert not held.is_held(w1) and not held.is_held(w2)
  with pytest.raises(ValueError, match='tg.plan predicts'):
    tg.Variable(
      np.zeros((64, 64), np.float32), tg.NamedSharding(mesh, tg.P(None, 'model')), backend='xla'
    )


def test_functions_wanting_other_layouts_of_one_variable_share_its_one_state():
  """Two functions lay out one unannotated variable differently: on one mesh the second takes
  the held layout (and reshards its use); on another mesh the shards move there and back."""
  w = tf.Variable(np.arange(32, dtype=np.float32).reshape(8, 4), name='w_shared')
  twin = tf.Variable(w.numpy())
  mesh8, mesh4 = tg.Mesh.create((8,), ('x',)), tg.Mesh.create((4,), ('y',))

  def fns(v, mesh, spec):
    @tf.function
    def bump(x):
      v.assign_add(x)
      return tf.reduce_sum(v * v)

    @tf.function
    def read(x):
      u = tf.identity(v) if mesh is None else tg.shard(tf.identity(v), mesh, spec)
      return tf.reduce_sum(u * x)

    return bump, read

  x = np.ones((8, 4), np.float32)
  bump, read = fns(w, mesh8, tg.P('x', None))
  plain_bump, plain_read = fns(twin, None, None)
  rows = tg.partition(bump, mesh8)
  assert_close(rows(x), plain_bump(x), 'bump on 8')
  cols = tg.partition(fns(w, mesh8, tg.P(None, 'x'))[1], mesh8)
  assert_close(cols(x), plain_read(x), 'read with another layout on the same mesh')
  other = tg.partition(fns(w, mesh4, tg.P('y', None))[0], mesh4)
  assert_close(other(x), plain_bump(x), 'bump on another mesh (the shards move there)')
  assert held.holder_of(w).sharding.mesh == mesh4
  assert_close(rows(x), plain_bump(x), 'bump on 8 again (the shards move back)')
  assert_close(w.numpy(), twin.numpy(), 'the one state')


def _allocator_peak(make):
  """(what `make()` returns, the peak bytes TF's CPU allocator held while it ran), or
  (result, None) where the allocator keeps no statistics (oneDNN off)."""
  gc.collect()
  try:
    tf.config.experimental.reset_memory_stats('CPU:0')
  except ValueError:
    return make(), None
  held_before = tf.config.experimental.get_memory_info('CPU:0')['current']  # earlier tests'
  made = make()
  return made, tf.config.experimental.get_memory_info('CPU:0')['peak'] - held_before


@pytest.mark.parametrize('backend', BACKENDS)
def test_a_large_initial_value_is_one_whole_buffer_on_the_host(backend, keras_distribution):
  # Keras' uniform initializers scale and shift a draw: eagerly three whole buffers at once,
  # and TF's CPU allocator keeps them for the life of the process (on backend='xla' nothing
  # else ever reuses them). Computed as one graph, each op writes into its input's buffer.
  _keras_on(backend)
  units = 2048  # a kernel of 1024 x 2048 float32: 8 MiB, the size from which a graph is used

  def make(seed):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((1024,)), keras.layers.Dense(units, name='d')])

  mp = _model_parallel({r'.*/d/kernel': (None, 'model')})
  model, peak = _allocator_peak(lambda: _made_under(mp, lambda: make(5)))
  reference = make(5)
  assert held.is_held(model.layers[0].kernel.value)
  assert_close(model.get_weights()[0], reference.get_weights()[0], 'kernel made as shards')
  # On xla TF holds the whole value alone (eagerly two more: the draw and its scaled copy),
  # its shards are PJRT's. On tf the TF split's own copies set TF's peak (its tile grid and a
  # shard per device), not the initializer: values only.
  if peak is not None and backend == 'xla':
    held_kernels = peak / (1024 * units * 4)
    assert held_kernels <= 1, f'TF held {held_kernels:.2f} kernels while building'


def test_an_initializer_that_makes_a_variable_is_computed_eagerly():
  mesh = tg.Mesh.create(*MESH)
  made = []

  def initial_value():
    made.append(tf.Variable(2.0))  # a variable made by the initializer: not in a graph
    return tf.ones([1024, 2048]) * made[-1]

  w = tg.Variable(
    initial_value, tg.NamedSharding(mesh, tg.P(None, 'model')), name='w', shape=(1024, 2048)
  )
  assert len(made) == 1
  assert_close(w.numpy(), np.full((1024, 2048), 2.0, np.float32), 'made eagerly')
