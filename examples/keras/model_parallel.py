"""Keras 3's own model-parallel code (keras.distribution) on the TensorFlow backend.

The code between the two rulers is written as in Keras' distribution guide
(DeviceMesh 2x4, LayoutMap, ModelParallel, set_distribution, fit with the
progress bar); the one addition is `tf_gspmd.keras.enable()`. The same model
then trains with no distribution, and the script prints how far the weights
are apart (the oracle's normwise relative error per weight, tf_gspmd.testing)
and the collectives one partitioned training step runs.

`--backend xla`: the same code after `tf_gspmd.keras.enable(backend='xla')`: each
step is one XLA-compiled per-replica program run on 8 PJRT CPU devices (the
`tf_gspmd[xla]` extra); the collectives are then also counted in the module
XLA compiled.
"""

import argparse
import collections
import os
import sys

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
os.environ.setdefault('KERAS_BACKEND', 'tensorflow')

import tensorflow as tf  # noqa: E402

# Before anything initializes TF's devices: split the one CPU into 8 logical devices.
tf.config.set_logical_device_configuration(
  tf.config.list_physical_devices('CPU')[0], [tf.config.LogicalDeviceConfiguration()] * 8
)

import keras  # noqa: E402
import numpy as np  # noqa: E402
from keras import layers  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', '..'))
import tf_gspmd  # noqa: E402
from tf_gspmd.partitioned import PartitionedFunction  # noqa: E402
from tf_gspmd.testing.oracle import check, report  # noqa: E402


def get_model():
  keras.utils.set_random_seed(0)
  inputs = layers.Input(shape=(28, 28, 1))
  y = layers.Flatten()(inputs)
  y = layers.Dense(units=200, use_bias=False, activation='relu', name='d1')(y)
  y = layers.Dense(units=64, activation='relu', name='d2')(y)
  y = layers.Dense(units=10, activation='softmax', name='d3')(y)
  model = keras.Model(inputs=inputs, outputs=y)
  model.compile(
    loss='sparse_categorical_crossentropy',
    metrics=['accuracy'],
    optimizer=keras.optimizers.Adam(1e-3),
  )
  return model


def get_data():
  rng = np.random.RandomState(0)
  images = rng.rand(256, 28, 28, 1).astype('float32')
  labels = (images.reshape(256, -1).mean(axis=1) * 40).astype('int32') % 10
  return images, labels


def train_step_of(model) -> PartitionedFunction:
  """The partitioned training step behind the model's train_function."""
  cells = [c.cell_contents for c in model.train_function.__closure__ or ()]
  # _last: the compiled step of the latest call (its collectives are what this example prints).
  return next(
    p
    for p in cells
    if isinstance(p, PartitionedFunction) and p._last is not None  # noqa: SLF001
  )


def collectives_of(model):
  """Kind and axes of each collective one partitioned training step runs."""
  return collections.Counter((c['kind'], c['axes']) for c in train_step_of(model).collectives())


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--backend', choices=('tf', 'xla'), default='tf')
  backend = parser.parse_args().backend
  tf_gspmd.keras.enable(backend=backend)
  x, y = get_data()
  # ---------------------------------------------------------------- Keras' guide code
  devices = keras.distribution.list_devices()  # 8 logical CPU devices
  mesh = keras.distribution.DeviceMesh(shape=(2, 4), axis_names=['data', 'model'], devices=devices)
  layout_map = keras.distribution.LayoutMap(mesh)
  layout_map['d1/kernel'] = (None, 'model')
  layout_map['d1/bias'] = ('model',)
  layout_map['d2/kernel'] = ('model', None)
  layout_map['d2/output'] = ('data', None)
  model_parallel = keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name='data')
  keras.distribution.set_distribution(model_parallel)
  model = get_model()
  model.fit(x, y, batch_size=32, epochs=2, shuffle=False)
  loss, accuracy = model.evaluate(x, y, batch_size=32)
  # ----------------------------------------------------------------------------------
  keras.distribution.set_distribution(None)
  plain = get_model()
  plain.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
  plain_loss, _ = plain.evaluate(x, y, batch_size=32, verbose=0)
  # Keras returns the evaluate loss as a Python float: float32 again, for the float32 bound.
  verdicts = [check(np.float32(loss), np.float32(plain_loss), 'evaluate loss')]
  verdicts += [check(a, b, a.path) for a, b in zip(model.weights, plain.weights)]
  print(f'\nevaluate loss {loss:.6f} (plain Keras {plain_loss:.6f}), accuracy {accuracy:.4f}')
  lines, ok = report(verdicts, 'weights vs plain Keras: relative error')
  print('\n'.join(lines))
  print(f'\n{"collective":<12}{"axes":<22}count per training step')
  for (kind, axes), count in sorted(collectives_of(model).items()):
    print(f'{kind:<12}{str(axes):<22}{count}')
  if backend == 'xla':
    step = train_step_of(model)
    counts = step._last.prepared.executable.collective_counts()  # noqa: SLF001
    print(
      f'\nXLA compiled the training step for {step.mesh.size} PJRT devices; its collectives: '
      + ', '.join(f'{kind} x{n}' for kind, n in sorted(counts.items()))
    )
  return 0 if ok else 1


if __name__ == '__main__':
  sys.exit(main())
