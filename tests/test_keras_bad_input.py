"""Bad input at the level Keras users work: keras.distribution and tg.LayoutMap mistakes.

One table: each row makes a mistake users of `keras.distribution` (with
`tf_gspmd.keras.enable()`) or of `tg.LayoutMap` + `tg.partition_model` make,
and names the warning or error it must give and the words its message must
hold -- the layer or variable path, the layout, and what to do. A row that
runs without the error (a wrong number or a silent replication), raises a
vague one, or raises it from outside tf_gspmd (Keras' own refusals are
listed), fails.
"""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_gspmd as tg

from helpers import assert_holds, assert_raises_clearly

X = np.random.RandomState(0).randn(32, 16).astype(np.float32)
Y = np.random.RandomState(1).randint(0, 4, 32).astype(np.int32)
FIT = dict(epochs=1, shuffle=False, verbose=0)

pytestmark = pytest.mark.usefixtures('keras_enabled')  # conftest.py


def mlp(seed=0):
  keras.utils.set_random_seed(seed)
  inputs = keras.Input((16,))
  y = keras.layers.Dense(32, activation='relu', name='d1')(inputs)
  y = keras.layers.Dense(4, name='d2')(y)
  model = keras.Model(inputs, y)
  model.compile(
    optimizer=keras.optimizers.Adam(1e-2),
    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
  )
  return model


def device_mesh(shape=(2, 4), names=('data', 'model')):
  return keras.distribution.DeviceMesh(
    shape, list(names), devices=keras.distribution.list_devices()[: int(np.prod(shape))]
  )


def model_parallel(entries, mesh=None):
  """A ModelParallel over `mesh` (2x4 'data' x 'model') with these layout map entries."""
  layout_map = keras.distribution.LayoutMap(mesh or device_mesh())
  for key, value in entries.items():
    layout_map[key] = value
  return keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name='data')


def fit_under(distribution, build=mlp, x=X, y=Y, **kw):
  with distribution.scope():
    model = build()
    model.fit(x, y, **dict(dict(FIT, batch_size=16), **kw))
  return model


def tg_partitioned(rules, mesh=None, **kw):
  mesh = mesh or tg.Mesh.create((2, 4), ('data', 'model'))
  model = mlp()
  layout = tg.LayoutMap(mesh)
  for key, spec in rules.items():
    layout[key] = spec
  layout.apply(model)
  return tg.partition_model(model, mesh, **kw)


# --- the mistakes ---------------------------------------------------------------------------------


def keras_key_matches_nothing():
  fit_under(model_parallel({'d1/kernal': (None, 'model')}))


def tg_key_matches_nothing():
  tg_partitioned({r'.*d1/kernal': tg.P(None, 'model')})


def keras_two_keys_match_one_variable():
  fit_under(model_parallel({'d1/ker.*': (None, 'model'), '.*1/kernel': ('model', None)}))


def tg_two_keys_match_one_variable():
  tg_partitioned({r'.*d1/kernel': tg.P(None, 'model'), r'.*d1/ker.*': tg.P('model', None)})


def keras_axis_not_in_mesh():
  fit_under(model_parallel({'d1/kernel': (None, 'modle')}))


def tg_axis_not_in_mesh():
  tg_partitioned({r'.*d1/kernel': tg.P(None, 'modle')})


def keras_axis_twice_in_one_layout():
  fit_under(model_parallel({'d1/kernel': ('model', 'model')}))


def keras_layout_of_wrong_rank():
  fit_under(model_parallel({'d1/kernel': ('model',)}))


def keras_output_layout_of_wrong_rank():
  fit_under(model_parallel({'d2/output': ('data', None, None)}))


def batch_not_divisible_by_the_batch_axis():
  fit_under(keras.distribution.DataParallel(), batch_size=12)  # 12 rows over 8 devices


def dataset_batch_not_divisible_with_drop_remainder():
  data = tf.data.Dataset.from_tensor_slices((X, Y)).batch(6, drop_remainder=True)
  with keras.distribution.DataParallel().scope():
    mlp().fit(data, **FIT)


def keras_mesh_larger_than_the_devices():
  keras.distribution.DeviceMesh((4, 4), ['data', 'model'])


def tg_mesh_larger_than_the_devices():
  model = mlp()
  tg.partition_model(model, tg.Mesh.create((4, 4), ('data', 'model')))
  model.fit(X, Y, batch_size=16, **FIT)


def keras_device_that_does_not_exist():
  fit_under(keras.distribution.DataParallel(devices=['cpu:0', 'cpu:11']))


def distribution_set_after_the_model_trained():
  model = mlp()
  model.fit(X, Y, batch_size=16, **FIT)  # its optimizer made its slots unsharded
  with model_parallel({'d1/kernel': (None, 'model')}).scope():
    model.fit(X, Y, batch_size=16, **FIT)


def batch_dim_name_not_an_axis():
  layout_map = keras.distribution.LayoutMap(device_mesh())
  fit_under(keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name='batch'))


def tg_batch_axes_not_in_mesh():
  model = mlp()
  tg.partition_model(model, tg.Mesh.create((2, 4), ('data', 'model')), batch_axes='batch')
  model.fit(X, Y, batch_size=16, **FIT)


def checkpoint_of_another_shape(tmp_path):
  def wide(units):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((16,))
    model = keras.Model(inputs, keras.layers.Dense(units, name='d1')(inputs))
    model.compile(optimizer='sgd', loss='mse')
    return model

  saved = wide(32)
  path = tf.train.Checkpoint(model=saved).write(str(tmp_path / 'ckpt'))
  with model_parallel({'d1/kernel': (None, 'model')}).scope():
    model = wide(24)
    model.fit(X, np.zeros((32, 24), np.float32), batch_size=16, **FIT)
    tf.train.Checkpoint(model=model).read(path)


# name -> (the mistake, ValueError or UserWarning or ..., words its message must hold)
CASES = {
  'keras_key_matches_nothing': (
    keras_key_matches_nothing,
    UserWarning,
    ["'d1/kernal'", 'matches no variable', "'d1/kernel'"],
  ),
  'tg_key_matches_nothing': (
    tg_key_matches_nothing,
    UserWarning,
    ["'.*d1/kernal'", 'matches no variable', 'd1/kernel'],
  ),
  'keras_two_keys_match_one_variable': (
    keras_two_keys_match_one_variable,
    ValueError,
    ['d1/kernel', 'd1/ker.*', 'multiple'],
  ),  # Keras'
  'tg_two_keys_match_one_variable': (
    tg_two_keys_match_one_variable,
    ValueError,
    ['d1/kernel', "'.*d1/ker.*'", "P('model', None)", 'one key'],
  ),
  'keras_axis_not_in_mesh': (
    keras_axis_not_in_mesh,
    ValueError,  # Keras' own, at the key
    ["'modle'", 'Valid axis names'],
  ),
  'tg_axis_not_in_mesh': (
    tg_axis_not_in_mesh,
    ValueError,
    ['d1/kernel', "'modle'", "'data', 'model'"],
  ),
  'keras_axis_twice_in_one_layout': (
    keras_axis_twice_in_one_layout,
    ValueError,
    ['d1/kernel', "'model'", 'twice'],
  ),
  'keras_layout_of_wrong_rank': (
    keras_layout_of_wrong_rank,
    ValueError,
    ['d1/kernel', '(16, 32)', 'one entry per dim'],
  ),
  'keras_output_layout_of_wrong_rank': (
    keras_output_layout_of_wrong_rank,
    ValueError,
    ['d2', "('data', None, None)", 'rank 2'],
  ),
  'batch_not_divisible_by_the_batch_axis': (
    batch_not_divisible_by_the_batch_axis,
    ValueError,
    ['batch', '12', "'batch'", '8', 'multiple of 8'],
  ),
  'dataset_batch_not_divisible_with_drop_remainder': (
    dataset_batch_not_divisible_with_drop_remainder,
    ValueError,
    ['6', "'batch'", '8', 'multiple of 8'],
  ),
  'keras_mesh_larger_than_the_devices': (
    keras_mesh_larger_than_the_devices,
    ValueError,
    ['(4, 4)', '(8,)'],
  ),  # Keras' own check
  'tg_mesh_larger_than_the_devices': (
    tg_mesh_larger_than_the_devices,
    ValueError,
    ['16', '8 logical devices'],
  ),
  'keras_device_that_does_not_exist': (
    keras_device_that_does_not_exist,
    ValueError,
    ['CPU:11', 'do not exist', '8 logical devices'],
  ),
  'distribution_set_after_the_model_trained': (
    distribution_set_after_the_model_trained,
    ValueError,
    ['d1/kernel', "P(None, 'model')", 'slot', 'scope()'],
  ),
  'batch_dim_name_not_an_axis': (batch_dim_name_not_an_axis, ValueError, ["'batch'", 'axis']),
  'tg_batch_axes_not_in_mesh': (
    tg_batch_axes_not_in_mesh,
    ValueError,
    ["'batch'", "('data', 'model')"],
  ),
  'checkpoint_of_another_shape': (
    checkpoint_of_another_shape,
    ValueError,
    ['d1/kernel', '(16, 32)', '(16, 24)'],
  ),
}


# Mistakes Keras itself refuses, clearly enough, before tf_gspmd sees them.
KERAS_REFUSES = ('keras_axis_not_in_mesh',)


@pytest.mark.parametrize('name', sorted(CASES))
def test_keras_mistake_gets_a_clear_message(name, tmp_path):
  mistake, kind, words = CASES[name]
  call = (lambda: mistake(tmp_path)) if mistake.__code__.co_argcount else mistake
  if not issubclass(kind, Warning):
    by = 'keras' if name in KERAS_REFUSES else 'tf_gspmd'
    assert_raises_clearly(name, call, kind, words, raised_by=by)
    return
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter('always')
    call()
  messages = [str(w.message) for w in caught if issubclass(w.category, kind)]
  assert messages, f'{name}: no {kind.__name__}'
  assert_holds(name, '\n'.join(messages), words)


def test_batch_size_is_read_where_keras_reads_it():
  """Given positionally it counts; a generator's own batches are not held to Keras' default."""
  model = mlp()
  tg.partition_model(model, tg.Mesh.create((8,), ('data',)))
  with pytest.raises(ValueError, match=r'batch_size=12: 12 rows do not split'):
    model.fit(X, Y, 12, **FIT)
  model = mlp()
  tg.partition_model(model, tg.Mesh.create((2, 3), ('data', 'model')), batch_axes='model')

  def batches():
    for start in range(0, 24, 6):
      yield X[start : start + 6], Y[start : start + 6]

  model.fit(batches(), **FIT)  # 6 rows over 3 devices: no default of 32 assumed
