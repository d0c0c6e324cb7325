"""The Keras workflow around partition_model, as functions of the backend: each step run
partitioned and against the same model run plainly. tests/test_keras_workflow.py runs them on
the TF backend, tests/test_keras_xla.py on backend='xla' (test files import helpers, never each
other)."""

import collections
import time

import keras
import numpy as np
import tensorflow as tf

import tf_gspmd as tg
from tf_gspmd.testing import (
  as_float32,
  assert_close,
)


def workflow_model(seed=0):
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


def workflow_partitioned(model, mesh=None, out_kernel=True, **kw):
  mesh = mesh or tg.Mesh.create((2, 4), ('data', 'model'))
  layout = tg.LayoutMap(mesh)
  layout[r'.*h0/kernel'] = tg.P(None, 'model')
  layout[r'.*h0/bias'] = tg.P('model')
  if out_kernel:
    layout[r'.*out/kernel'] = tg.P('model', None)
  layout.apply(model)
  return tg.partition_model(model, mesh, **kw)


def workflow_data(n=64, seed=0):
  rng = np.random.RandomState(seed)
  return rng.randn(n, 16).astype(np.float32), rng.randint(0, 4, n).astype(np.int32)


def workflow_weights(model):
  """'layer/variable' -> value, read by get_weights (which pulls a partitioned model's shards
  first); the paths without the model's own name, which Keras numbers per instance."""
  weights = {
    '/'.join(v.path.split('/')[-2:]): np.asarray(w)
    for v, w in zip(model.weights, model.get_weights())
  }
  assert len(weights) == len(model.weights)
  return weights


def workflow_history(fit):
  return as_float32(fit.history)


def workflow_evaluate(model, x, y, batch_size):
  return as_float32(model.evaluate(x, y, batch_size=batch_size, verbose=0))


def workflow_shards(model, name):
  return next(s for v, s in model._tf_gspmd_store.pairs() if name in v.name)


FIT = dict(batch_size=16, epochs=1, shuffle=False, verbose=0)


def writes_between_calls(tmp_path, **partition):
  """fit -> set_weights -> fit -> load_weights -> fit -> checkpoint restore -> fit -> assign ->
  evaluate -> predict -> fit -> save('m.keras'), each step against the same sequence unpartitioned.
  `partition`: more arguments of partition_model (backend='xla': tests/test_keras_xla.py)."""
  x, y = workflow_data()
  model, reference = workflow_partitioned(workflow_model(), **partition), workflow_model()
  both = (model, reference)

  def fit_both(what):
    got, want = (m.fit(x, y, **FIT) for m in both)
    assert_close(workflow_history(got), workflow_history(want), f'history of the {what}')
    assert_close(workflow_weights(model), workflow_weights(reference), f'weights after the {what}')

  fit_both('first fit')
  fresh = workflow_model(seed=7).get_weights()
  for m in both:
    m.set_weights(fresh)
  fit_both('fit after set_weights')

  donor = workflow_model(seed=3)  # a weights file of other (trained) values
  donor.fit(x, y, **FIT)
  donor.save_weights(str(tmp_path / 'donor.weights.h5'))
  for m in both:
    m.load_weights(str(tmp_path / 'donor.weights.h5'))
  for path, value in workflow_weights(donor).items():  # the file's values as they are, bit for bit
    np.testing.assert_array_equal(workflow_weights(model)[path], value, err_msg=path)
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
    workflow_evaluate(model, x[:32], y[:32], 16),
    workflow_evaluate(reference, x[:32], y[:32], 16),
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
  assert_close(workflow_weights(loaded), workflow_weights(reference), 'loaded m.keras')

  launcher = model._tf_gspmd_launcher
  assert launcher.launches == 6 * 4 + 2 + 4
  return model


def steps_per_execution(**partition):
  """Returns the model run with steps_per_execution=3."""
  x, y = workflow_data(112)  # 7 batches of 16: chunks of 3, 3 and a partial 1
  runs = {}
  for k in (1, 3):
    model = workflow_model()
    model.compile(
      optimizer=keras.optimizers.Adam(1e-2),
      metrics=['accuracy'],
      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
      steps_per_execution=k,
    )
    workflow_partitioned(model, **partition)
    model.fit(x, y, **FIT)  # compiles
    launcher = model._tf_gspmd_launcher
    launches, start, cpu = launcher.launches, time.perf_counter(), time.process_time()
    history = model.fit(x, y, **FIT)
    seconds = (time.perf_counter() - start, time.process_time() - cpu)  # wall, this process' CPU
    runs[k] = (
      history,
      workflow_weights(model),
      launcher.launches - launches,
      np.array(seconds) / 7,
    )
  reference = workflow_model()
  reference.fit(x, y, **FIT)
  want = reference.fit(x, y, **FIT)
  for k, (history, weights, launches, per_step) in runs.items():
    print(
      f'steps_per_execution={k}: {launches} launches per epoch, {1e3 * per_step[0]:.1f} ms '
      f'wall, {1e3 * per_step[1]:.1f} ms CPU per step'
    )
    assert_close(
      workflow_history(history), workflow_history(want), f'history, steps_per_execution={k}'
    )
    assert_close(weights, workflow_weights(reference), f'weights, steps_per_execution={k}')
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
  assert_close(
    workflow_evaluate(model, x, y, 16), workflow_evaluate(reference, x, y, 16), 'evaluate'
  )
  assert launcher.launches - launches == 3
  return model


def uneven_last_batch(**partition):
  mesh = tg.Mesh.create((4, 2), ('data', 'model'))
  x, y = workflow_data(10)
  model, reference = (
    workflow_partitioned(workflow_model(), mesh=mesh, **partition),
    workflow_model(),
  )
  got = model.predict(x, batch_size=4, verbose=0)  # batches of 4, 4 and 2 over 4 devices
  want = reference.predict(x, batch_size=4, verbose=0)
  assert got.shape == want.shape == (10, 4)
  assert_close(got, want, 'predict')
  assert_close(model.predict_on_batch(x[:2]), reference.predict_on_batch(x[:2]), 'predict_on_batch')
  # The padded rows of the last batch add nothing to the loss, gradients or metrics either.
  kw = dict(FIT, batch_size=4, epochs=2)
  assert_close(
    workflow_history(model.fit(x, y, **kw)), workflow_history(reference.fit(x, y, **kw)), 'history'
  )
  assert_close(workflow_evaluate(model, x, y, 4), workflow_evaluate(reference, x, y, 4), 'evaluate')
  assert_close(workflow_weights(model), workflow_weights(reference), 'weights')


def callbacks_agree(tmp_path, **partition):
  x, y = workflow_data()
  model, reference = workflow_partitioned(workflow_model(), **partition), workflow_model()

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
  assert_close(workflow_history(got), workflow_history(want), 'history')
  assert got.history['learning_rate'][-1] < got.history['learning_rate'][0]
  # EarlyStopping's restored best weights
  assert_close(workflow_weights(model), workflow_weights(reference), 'restored best weights')
  for epoch in range(1, len(want.history['loss']) + 1):  # each checkpoint: that epoch's weights
    a, b = workflow_model(), workflow_model()
    a.load_weights(str(tmp_path / f'p_{epoch}.weights.h5'))
    b.load_weights(str(tmp_path / f'r_{epoch}.weights.h5'))
    assert_close(workflow_weights(a), workflow_weights(b), f'checkpoint of epoch {epoch}')
  assert len(want.history['loss']) < 4  # EarlyStopping stopped both runs early


def on_batch_calls(**partition):
  x, y = workflow_data(32)
  model, reference = workflow_partitioned(workflow_model(), **partition), workflow_model()
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
  assert_close(workflow_weights(model), workflow_weights(reference), 'weights')
