"""The Keras workflow around partition_model, each step against the same model run plainly.

Issue #11: weights written between partitioned calls are what the next call
trains on; unannotated variables are replicated; steps_per_execution,
uneven predict batches, validation, callbacks, saving, mixed precision,
*_on_batch; tf_keras models are refused by name. Every comparison goes through
the numerical oracle (tf_gspmd.testing); mixed bfloat16 by its float64 rule.
"""

import collections
import os
import time

import keras
import ml_dtypes
import numpy as np
import pytest
import tensorflow as tf

import tf_gspmd as tg
from tf_gspmd.testing import (
  as_float32,
  assert_close,
  assert_close_to_float64,
  bound,
  relative_error,
)


def _model(seed=0):
  keras.utils.set_random_seed(seed)
  model = keras.Sequential(
    [
      keras.Input((16,)),
      keras.layers.Dense(32, activation='relu', name='h0'),
      keras.layers.Dense(4, name='out'),
    ]
  )
  model.compile(
    optimizer=keras.optimizers.Adam(1e-2),
    metrics=['accuracy'],
    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
  )
  return model


def _partitioned(model, mesh=None, out_kernel=True, **kw):
  mesh = mesh or tg.Mesh.create((2, 4), ('data', 'model'))
  layout = tg.LayoutMap(mesh)
  layout[r'.*h0/kernel'] = tg.P(None, 'model')
  layout[r'.*h0/bias'] = tg.P('model')
  if out_kernel:
    layout[r'.*out/kernel'] = tg.P('model', None)
  layout.apply(model)
  return tg.partition_model(model, mesh, **kw)


def _data(n=64, seed=0):
  rng = np.random.RandomState(seed)
  return rng.randn(n, 16).astype(np.float32), rng.randint(0, 4, n).astype(np.int32)


def _weights(model):
  """'layer/variable' -> value, read by get_weights (which pulls a partitioned model's shards
  first); the paths without the model's own name, which Keras numbers per instance."""
  weights = {
    '/'.join(v.path.split('/')[-2:]): np.asarray(w)
    for v, w in zip(model.weights, model.get_weights())
  }
  assert len(weights) == len(model.weights)
  return weights


def _history(fit):
  return as_float32(fit.history)


def _evaluate(model, x, y, batch_size):
  return as_float32(model.evaluate(x, y, batch_size=batch_size, verbose=0))


def _shards_of(model, name):
  return next(s for v, s in model._tf_gspmd_store.pairs() if name in v.name)


FIT = dict(batch_size=16, epochs=1, shuffle=False, verbose=0)


# --- point 2: one layout per variable ---------------------------------------------------------


def test_unannotated_output_kernel_replicated_across_train_evaluate_predict():
  x, y = _data()
  model, reference = _partitioned(_model(), out_kernel=False), _model()
  assert_close(_history(model.fit(x, y, **FIT)), _history(reference.fit(x, y, **FIT)), 'history')
  assert_close(_evaluate(model, x, y, 16), _evaluate(reference, x, y, 16), 'evaluate')
  assert_close(
    model.predict(x, batch_size=16, verbose=0),
    reference.predict(x, batch_size=16, verbose=0),
    'predict',
  )
  out_kernel = _shards_of(model, 'out/kernel')
  assert out_kernel.sharding.spec == tg.P(None, None)  # replicated, in every step
  assert _shards_of(model, 'h0/kernel').local_shape == (16, 8)


# --- point 2: writes between partitioned calls ------------------------------------------------


def test_writes_between_calls_are_what_the_next_call_trains_on(tmp_path):
  writes_between_calls(tmp_path)


def writes_between_calls(tmp_path, **partition):
  """fit -> set_weights -> fit -> load_weights -> fit -> checkpoint restore -> fit -> assign ->
  evaluate -> predict -> fit -> save('m.keras'), each step against the same sequence unpartitioned.
  `partition`: more arguments of partition_model (backend='xla': tests/test_keras_xla.py)."""
  x, y = _data()
  model, reference = _partitioned(_model(), **partition), _model()
  both = (model, reference)

  def fit_both(what):
    got, want = (m.fit(x, y, **FIT) for m in both)
    assert_close(_history(got), _history(want), f'history of the {what}')
    assert_close(_weights(model), _weights(reference), f'weights after the {what}')

  fit_both('first fit')
  fresh = _model(seed=7).get_weights()
  for m in both:
    m.set_weights(fresh)
  fit_both('fit after set_weights')

  donor = _model(seed=3)  # a weights file of other (trained) values
  donor.fit(x, y, **FIT)
  donor.save_weights(str(tmp_path / 'donor.weights.h5'))
  for m in both:
    m.load_weights(str(tmp_path / 'donor.weights.h5'))
  for path, value in _weights(donor).items():  # the file's values as they are, bit for bit
    np.testing.assert_array_equal(_weights(model)[path], value, err_msg=path)
  fit_both('fit after load_weights')

  # A checkpoint of weights and optimizer slots, then a fit that moves the shards on:
  # restoring it must win over the shards.
  saved = {
    id(m): tf.train.Checkpoint(model=m, optimizer=m.optimizer).write(str(tmp_path / f'ckpt{i}'))
    for i, m in enumerate(both)
  }
  for m in both:
    m.fit(x, y, **FIT)
  for m in both:
    tf.train.Checkpoint(model=m, optimizer=m.optimizer).read(saved[id(m)]).assert_consumed()
  fit_both('fit after checkpoint restore')

  for m in both:
    kernel = m.get_layer('out').kernel
    kernel.assign(kernel * 0.5)
  assert_close(
    _evaluate(model, x[:32], y[:32], 16),
    _evaluate(reference, x[:32], y[:32], 16),
    'evaluate after assign',
  )  # sees the assign
  assert_close(
    model.predict(x, batch_size=16, verbose=0),
    reference.predict(x, batch_size=16, verbose=0),
    'predict after assign',
  )
  fit_both('fit after evaluate and predict')
  # The optimizer's step counter and slots continued across evaluate/predict; metric state agrees.
  steps = int(reference.optimizer.iterations.numpy())
  assert int(model.optimizer.iterations.numpy()) == steps >= 16, steps
  assert_close(model.optimizer.variables, reference.optimizer.variables, 'optimizer')
  assert_close(
    [v for m in model.metrics for v in m.variables],
    [v for m in reference.metrics for v in m.variables],
    'metrics',
  )

  model.save(str(tmp_path / 'm.keras'))
  loaded = keras.models.load_model(str(tmp_path / 'm.keras'))
  assert_close(_weights(loaded), _weights(reference), 'loaded m.keras')

  launcher = model._tf_gspmd_launcher
  assert launcher.launches == 6 * 4 + 2 + 4
  return model


def test_rewind_to_last_synced_values_mid_fit_is_not_lost():
  """set_weights, mid-epoch, of exactly the values the originals held at the epoch's start."""
  x, y = _data()
  model, reference = _partitioned(_model()), _model()

  class Rewind(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
      self.start = self.model.get_weights()

    def on_train_batch_end(self, batch, logs=None):
      if batch == 1:
        self.model.set_weights(self.start)

  got, want = (m.fit(x, y, callbacks=[Rewind()], **FIT) for m in (model, reference))
  assert_close(_history(got), _history(want), 'history')
  assert_close(_weights(model), _weights(reference), 'weights')


# --- point 3: the rest of the workflow --------------------------------------------------------


def test_steps_per_execution_runs_k_steps_per_launch():
  steps_per_execution()


def steps_per_execution(**partition):
  """Returns the model run with steps_per_execution=3."""
  x, y = _data(112)  # 7 batches of 16: chunks of 3, 3 and a partial 1
  runs = {}
  for k in (1, 3):
    model = _model()
    model.compile(
      optimizer=keras.optimizers.Adam(1e-2),
      metrics=['accuracy'],
      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
      steps_per_execution=k,
    )
    _partitioned(model, **partition)
    model.fit(x, y, **FIT)  # compiles
    launcher = model._tf_gspmd_launcher
    launches, start, cpu = launcher.launches, time.perf_counter(), time.process_time()
    history = model.fit(x, y, **FIT)
    seconds = (time.perf_counter() - start, time.process_time() - cpu)  # wall, this process' CPU
    runs[k] = (history, _weights(model), launcher.launches - launches, np.array(seconds) / 7)
  reference = _model()
  reference.fit(x, y, **FIT)
  want = reference.fit(x, y, **FIT)
  for k, (history, weights, launches, per_step) in runs.items():
    print(
      f'steps_per_execution={k}: {launches} launches per epoch, {1e3 * per_step[0]:.1f} ms '
      f'wall, {1e3 * per_step[1]:.1f} ms CPU per step'
    )
    assert_close(_history(history), _history(want), f'history, steps_per_execution={k}')
    assert_close(weights, _weights(reference), f'weights, steps_per_execution={k}')
  assert runs[1][2] == 7 and runs[3][2] == 3
  # The looped program communicates per step exactly what one step does (the peeled first
  # step in the main graph, the others in the While body): no extra collective on the data.
  functions = model._tf_gspmd_launcher.functions
  per_graph = collections.defaultdict(collections.Counter)
  for c in functions['train_step_looped'].collectives():
    per_graph[c['graph'].startswith('steps_per_execution')][(c['kind'], c['axes'])] += 1
  one = collections.Counter((c['kind'], c['axes']) for c in functions['train_step'].collectives())
  assert one and per_graph[False] == per_graph[True] == one, (per_graph, one)
  # evaluate runs its test steps the same way (7 batches: 3 launches), validation too.
  launcher = model._tf_gspmd_launcher
  launches = launcher.launches
  assert_close(_evaluate(model, x, y, 16), _evaluate(reference, x, y, 16), 'evaluate')
  assert launcher.launches - launches == 3
  return model


def test_uneven_last_batch_no_padding_in_predict_fit_or_evaluate():
  uneven_last_batch()


def uneven_last_batch(**partition):
  mesh = tg.Mesh.create((4, 2), ('data', 'model'))
  x, y = _data(10)
  model, reference = _partitioned(_model(), mesh=mesh, **partition), _model()
  got = model.predict(x, batch_size=4, verbose=0)  # batches of 4, 4 and 2 over 4 devices
  want = reference.predict(x, batch_size=4, verbose=0)
  assert got.shape == want.shape == (10, 4)
  assert_close(got, want, 'predict')
  assert_close(model.predict_on_batch(x[:2]), reference.predict_on_batch(x[:2]), 'predict_on_batch')
  # The padded rows of the last batch add nothing to the loss, gradients or metrics either.
  kw = dict(FIT, batch_size=4, epochs=2)
  assert_close(_history(model.fit(x, y, **kw)), _history(reference.fit(x, y, **kw)), 'history')
  assert_close(_evaluate(model, x, y, 4), _evaluate(reference, x, y, 4), 'evaluate')
  assert_close(_weights(model), _weights(reference), 'weights')


@pytest.mark.filterwarnings('ignore:Skipping variable loading for optimizer')  # fresh models
def test_callbacks(tmp_path):
  callbacks_agree(tmp_path)


def callbacks_agree(tmp_path, **partition):
  x, y = _data()
  model, reference = _partitioned(_model(), **partition), _model()

  def callbacks(tag):
    return [
      keras.callbacks.ModelCheckpoint(
        str(tmp_path / f'{tag}_{{epoch}}.weights.h5'), save_weights_only=True
      ),
      keras.callbacks.ReduceLROnPlateau(
        monitor='loss', factor=0.5, patience=0, min_delta=10.0
      ),  # halve every epoch
      keras.callbacks.EarlyStopping(monitor='val_loss', patience=1, restore_best_weights=True),
    ]

  kw = dict(FIT, epochs=4, validation_split=0.25)  # validation_data: test_keras_fit.py
  got, want = (
    model.fit(x, y, callbacks=callbacks('p'), **kw),
    reference.fit(x, y, callbacks=callbacks('r'), **kw),
  )
  assert_close(_history(got), _history(want), 'history')
  assert got.history['learning_rate'][-1] < got.history['learning_rate'][0]
  # EarlyStopping's restored best weights
  assert_close(_weights(model), _weights(reference), 'restored best weights')
  for epoch in range(1, len(want.history['loss']) + 1):  # each checkpoint: that epoch's weights
    a, b = _model(), _model()
    a.load_weights(str(tmp_path / f'p_{epoch}.weights.h5'))
    b.load_weights(str(tmp_path / f'r_{epoch}.weights.h5'))
    assert_close(_weights(a), _weights(b), f'checkpoint of epoch {epoch}')
  assert len(want.history['loss']) < 4  # EarlyStopping stopped both runs early


def _logged_scalars(directory):
  """tag -> values of the scalar summaries TensorBoard wrote under `directory`."""
  out = {}
  for name in sorted(os.listdir(directory)):
    for event in tf.compat.v1.train.summary_iterator(os.path.join(directory, name)):
      for value in event.summary.value:
        if (
          value.HasField('tensor')
          and not value.tensor.tensor_shape.dim
          and value.tensor.dtype == tf.float32.as_datatype_enum
        ):
          out.setdefault(value.tag, []).append(float(tf.make_ndarray(value.tensor)))
  return out


def test_tensorboard_callback(tmp_path):
  import tensorboard  # noqa: F401  a test dependency

  x, y = _data()
  logged = []
  for name, model in (('partitioned', _partitioned(_model())), ('whole', _model())):
    board = keras.callbacks.TensorBoard(str(tmp_path / name), histogram_freq=1)
    model.fit(x, y, callbacks=[board], **FIT)
    logged.append(_logged_scalars(tmp_path / name / 'train'))
  got, want = logged
  assert want['epoch_loss'] and sorted(got) == sorted(want)
  assert_close(as_float32(got['epoch_loss']), as_float32(want['epoch_loss']), 'epoch_loss')


def test_on_batch_calls():
  on_batch_calls()


def on_batch_calls(**partition):
  x, y = _data(32)
  model, reference = _partitioned(_model(), **partition), _model()
  for start in (0, 16):
    xb, yb = x[start : start + 16], y[start : start + 16]
    assert_close(
      as_float32(model.train_on_batch(xb, yb)),
      as_float32(reference.train_on_batch(xb, yb)),
      f'train_on_batch at {start}',
    )
  assert_close(
    as_float32(model.test_on_batch(x[:16], y[:16])),
    as_float32(reference.test_on_batch(x[:16], y[:16])),
    'test_on_batch',
  )
  assert_close(
    model.predict_on_batch(x[:16]), reference.predict_on_batch(x[:16]), 'predict_on_batch'
  )
  assert_close(_weights(model), _weights(reference), 'weights')


def test_mixed_bfloat16():
  """bf16 is ill-conditioned: the float64 rule. The same model under a float64 policy, from the
  same initial weights and data, is the exact answer; the partitioned bf16 run may be no
  further from it than twice plain Keras' bf16 run (plus the dtype's bound)."""
  x, y = _data()
  keras.mixed_precision.set_global_policy('mixed_bfloat16')
  try:
    model, reference = _partitioned(_model()), _model()
    assert model.get_layer('h0').compute_dtype == 'bfloat16'
    initial = reference.get_weights()
    got, want = model.fit(x, y, **FIT), reference.fit(x, y, **FIT)
    preds = (
      model.predict(x, batch_size=16, verbose=0),
      reference.predict(x, batch_size=16, verbose=0),
    )
    keras.mixed_precision.set_global_policy('float64')
    exact_model = _model()
    assert exact_model.get_layer('h0').kernel.dtype == 'float64'
    exact_model.set_weights([w.astype(np.float64) for w in initial])
    exact = exact_model.fit(x, y, **FIT)
    exact_preds = exact_model.predict(x, batch_size=16, verbose=0)
  finally:
    keras.mixed_precision.set_global_policy('float32')
  assert preds[0].dtype == preds[1].dtype and exact_preds.dtype == np.float64
  exact_weights = _weights(exact_model)
  assert all(w.dtype == np.float64 for w in exact_weights.values())
  # The floor is bf16's bound (4 eps = 2^-5), also for the float32 loss and weights: they come
  # out of bf16 arithmetic (bf16 logits, bf16 gradients), not float32. Adam makes one weight
  # ill-conditioned here: out/kernel[5, 2]'s first gradient is -2.1e-4 in float64, the smallest
  # of its 128 (190x below their median), well inside bf16 rounding, and Adam's first step is
  # lr x its sign. Measured, to float64 (partitioned / plain Keras bf16), oneDNN on: loss
  # 1.5e-4 / 2.3e-5, predictions 4.6e-3 / 3.6e-3, h0/kernel 5.6e-4 / 5.0e-4, h0/bias
  # 7.1e-3 / 4.3e-3, out/kernel 3.8e-3 / 2.8e-4 (that one element's sign flipped: 0.0098 off,
  # every other element <= 2.6e-4), out/bias 5.1e-3 / 8.1e-3; oneDNN off: loss 1.3e-3 / 1.2e-3,
  # predictions 6.5e-3 / 6.1e-3, weights 3.8e-4 to 6.5e-3 / 3.9e-4 to 3.9e-3. (A broken
  # program in tests/test_oracle_catches.py lands at 0.40 to 0.85.)
  floor = bound(ml_dtypes.bfloat16)
  for what, g, w, e in (
    (
      'history',
      _history(got),
      _history(want),
      {k: np.asarray(v, np.float64) for k, v in exact.history.items()},
    ),
    ('predict', preds[0], preds[1], exact_preds),
    ('weights', _weights(model), _weights(reference), exact_weights),
  ):
    for key in e if isinstance(e, dict) else [None]:
      gk, wk, ek = (g, w, e) if key is None else (g[key], w[key], e[key])
      print(
        f'mixed_bfloat16 {what} {key or ""}: to float64 partitioned '
        f'{relative_error(gk, ek):.3g}, plain Keras {relative_error(wk, ek):.3g}'
      )
    assert_close_to_float64(g, w, e, what, floor=floor)


# --- point 4: tf_keras ------------------------------------------------------------------------


def test_tf_keras_model_refused_by_name():
  # tf_keras is not installed in this venv (no dependency added for it); a stand-in class
  # from the tf_keras module path is what partition_model sees for a tf_keras model.
  stand_in = type('Functional', (), {'__module__': 'tf_keras.src.engine.functional'})
  with pytest.raises(
    TypeError,
    match=r'tf_keras.*Functional.*not a Keras 3 model.*'
    r'tf_keras \(Keras 2\) models are not supported',
  ):
    tg.partition_model(stand_in(), tg.Mesh.create((2, 4), ('data', 'model')))


def test_partition_again_on_another_mesh_keeps_trained_values():
  x, y = _data()
  model, reference = _partitioned(_model()), _model()
  model.fit(x, y, **FIT)
  reference.fit(x, y, **FIT)
  _partitioned(model, mesh=tg.Mesh.create((4, 2), ('data', 'model')))  # layouts on the new mesh
  assert_close(_history(model.fit(x, y, **FIT)), _history(reference.fit(x, y, **FIT)), 'history')
  assert_close(_weights(model), _weights(reference), 'weights')
  assert _shards_of(model, 'h0/kernel').local_shape == (16, 16)
  tg.keras.fit.unpartition_model(model)  # Keras' own steps again, on the trained values
  assert 'fit' not in model.__dict__ and '_tf_gspmd_launcher' not in model.__dict__
  assert_close(_evaluate(model, x, y, 16), _evaluate(reference, x, y, 16), 'evaluate')


def test_callbacks_that_read_and_write_raw_variables_mid_epoch():
  x, y = _data()

  class HalveKernel(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
      if batch == 1:  # reads the variable itself, not get_weights
        kernel = self.model.get_layer('out').kernel
        kernel.assign(kernel * 0.5)

  # No option needed (on main, pull_every_step=True): the variable reads its shards.
  model, reference = _partitioned(_model()), _model()
  got, want = (m.fit(x, y, callbacks=[HalveKernel()], **FIT) for m in (model, reference))
  assert_close(_history(got), _history(want), 'history')
  assert_close(_weights(model), _weights(reference), 'weights')
  assert model._tf_gspmd_launcher.launches == 4
