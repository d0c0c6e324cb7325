"""A first run on one device: a process with one CPU device and no logical devices configured.

What a new user tries first: `tg.partition` on `Mesh.create((1,), ('data',))`, and
Keras' `DataParallel()` / a 1x1 `ModelParallel` after `tf_gspmd.keras.enable()`.
Each partitions to a program with no collectives whose results equal the
unpartitioned run (the oracle). The test session itself holds 8 logical
devices, so each case runs in a fresh interpreter (helpers.run_python).
"""

import pathlib
import tempfile
import textwrap

import pytest

from helpers import run_python

_PRELUDE = """
import numpy as np
import tensorflow as tf
assert len(tf.config.list_logical_devices('CPU')) == 1
import tf_gspmd as tg
from tf_gspmd.partitioned import PartitionedFunction
from tf_gspmd.testing import assert_close
"""

_TF_FUNCTION = """
mesh = tg.Mesh.create((1,), ('data',))
w = tf.Variable(np.random.RandomState(0).randn(4, 3).astype(np.float32))
tg.shard_variable(w, mesh, tg.P(None, 'data'))

@tf.function
def step(x):
  x = tg.shard(x, mesh, tg.P('data', None))
  with tf.GradientTape() as tape:
    loss = tf.reduce_sum(tf.matmul(x, w) ** 2)
  return loss, tape.gradient(loss, w)

x = np.random.RandomState(1).randn(8, 4).astype(np.float32)
pf = tg.partition(step, mesh)
assert_close(pf(x), step(x), 'step')
assert pf.collectives() == [], pf.collectives()
print('collectives', len(pf.collectives()))
"""

_KERAS = """
import sys
import keras
import tf_gspmd.keras

def build():
  keras.utils.set_random_seed(0)
  model = keras.Sequential([keras.Input((16,)),
                            keras.layers.Dense(32, activation='relu', name='d0'),
                            keras.layers.Dense(4, name='d1')])
  model.compile(optimizer='adam', loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  return model

rng = np.random.RandomState(0)
x, y = rng.randn(64, 16).astype(np.float32), rng.randint(0, 4, 64)
reference = build()
want = reference.fit(x, y, batch_size=16, epochs=2, verbose=0).history

tf_gspmd.keras.enable()
if sys.argv[1] == 'data_parallel':
  distribution = keras.distribution.DataParallel()
else:
  devices = keras.distribution.DeviceMesh((1, 1), ['batch', 'model'],
                                          keras.distribution.list_devices())
  layouts = keras.distribution.LayoutMap(devices)
  layouts['d0/kernel'] = (None, 'model')
  layouts['d1/kernel'] = ('model', None)
  distribution = keras.distribution.ModelParallel(layout_map=layouts, batch_dim_name='batch')
keras.distribution.set_distribution(distribution)
model = build()
got = model.fit(x, y, batch_size=16, epochs=2, verbose=0).history
assert '_tf_gspmd_store' in model.__dict__, 'the model did not run through tf_gspmd'
assert_close(got, want, 'history')
assert_close(model.weights, reference.weights, 'weights')
assert_close(model.predict(x, batch_size=16, verbose=0),
             reference.predict(x, batch_size=16, verbose=0), 'predict')
cells = [c.cell_contents for c in model.train_function.__closure__ or ()]
train = [p for p in cells if isinstance(p, PartitionedFunction) and p._last is not None]
assert train, 'no partitioned train step ran'
assert train[0].collectives() == [], train[0].collectives()
print('collectives', len(train[0].collectives()))
"""


def _run(code: str, *args: str) -> str:
  with tempfile.TemporaryDirectory() as where:
    script = pathlib.Path(where) / 'one_device.py'
    script.write_text(textwrap.dedent(_PRELUDE + code))
    result = run_python(script, 300, args)
  assert result.returncode == 0, result.stderr[-4000:]
  return result.stdout


def test_partition_on_a_one_device_mesh():
  assert 'collectives 0' in _run(_TF_FUNCTION)


@pytest.mark.parametrize('kind', ['data_parallel', 'model_parallel_1x1'])
@pytest.mark.slow  # a whole Keras fit per kind: `make test` runs it, the edit loop not
def test_keras_distribution_on_one_device(kind):
  assert 'collectives 0' in _run(_KERAS, kind)
