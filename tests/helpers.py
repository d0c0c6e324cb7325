"""What several test files share: values, meshes, models, a fresh interpreter.

Test files import from here (pytest puts `tests/` on sys.path), never from each other;
fixtures live in `conftest.py`.
"""

import os
import pathlib
import re
import subprocess
import traceback

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_gspmd as tg
from tf_gspmd.partitioned import PartitionedFunction
from tf_gspmd.testing import bound, fresh_interpreter
from tf_gspmd.testing.keras_steps import keras_train_step  # noqa: F401  (shared by tests)

ROOT = pathlib.Path(__file__).resolve().parent.parent
MESH = tg.Mesh.create((2, 4), ('data', 'model'))  # the usual 8-device mesh
STEPS = 5  # training steps a partitioned model runs against the unpartitioned one


def randn(seed, *shape, scale=1.0):
  """Seeded standard-normal float32 values of `shape` (times `scale`)."""
  return (np.random.RandomState(seed).randn(*shape) * scale).astype(np.float32)


def run_python(script: pathlib.Path, timeout: int = 240, args=()) -> subprocess.CompletedProcess:
  """Run `script` as a fresh interpreter would (its own TF devices) with the repo importable:
  forked from one that has imported TensorFlow (tf_gspmd/testing/fresh_interpreter.py)."""
  env = dict(os.environ, PYTHONPATH=str(ROOT), TF_CPP_MIN_LOG_LEVEL='2')
  return fresh_interpreter.run(str(script), [str(a) for a in args], str(ROOT), env, timeout)


# --- Keras models and their data ----------------------------------------------------------
def _with_adam(model, **names):
  optimizer = keras.optimizers.Adam(1e-2, **names)
  optimizer.build(model.trainable_variables)
  return model, optimizer


def keras_mlp(seed, hidden=32, named=False):
  """A 16 -> hidden -> hidden -> 4 Keras MLP and its built Adam optimizer.

  `named`: the model called 'mlp' and the optimizer 'adam' (a checkpoint names variables by
  their Keras paths, which hold those names; Keras numbers default names per instance).
  """
  keras.utils.set_random_seed(seed)
  layers = [
    keras.Input((16,)),
    keras.layers.Dense(hidden, activation='relu', name='hidden_0'),
    keras.layers.Dense(hidden, activation='relu', name='hidden_1'),
    keras.layers.Dense(4, name='logits'),
  ]
  if named:
    return _with_adam(keras.Sequential(layers, name='mlp'), name='adam')
  return _with_adam(keras.Sequential(layers))


def keras_cnn(seed):
  """Conv/BatchNorm/MaxPool/Conv, global average pooling, a Dense head; and Adam."""
  keras.utils.set_random_seed(seed)
  model = keras.Sequential(
    [
      keras.Input((16, 12, 3)),
      keras.layers.Conv2D(8, 3, padding='same', activation='relu', name='conv_0'),
      keras.layers.BatchNormalization(name='bn_0'),
      keras.layers.MaxPooling2D(2, name='pool_0'),
      keras.layers.Conv2D(8, 3, padding='same', activation='relu', name='conv_1'),
      keras.layers.GlobalAveragePooling2D(),
      keras.layers.Dense(4, name='logits'),
    ]
  )
  return _with_adam(model)


def mlp_batches(batch):
  """`STEPS` (features, labels) batches for `keras_mlp`."""
  rng = np.random.RandomState(0)
  return [
    (rng.randn(batch, 16).astype(np.float32), rng.randint(0, 4, batch).astype(np.int32))
    for _ in range(STEPS)
  ]


def image_batches(batch, height=16):
  """`STEPS` (images, labels) batches for `keras_cnn`."""
  rng = np.random.RandomState(0)
  return [
    (rng.randn(batch, height, 12, 3).astype(np.float32), rng.randint(0, 4, batch).astype(np.int32))
    for _ in range(STEPS)
  ]


# --- the Keras distribution guide's model and data ---------------------------------------------
_guide_rng = np.random.RandomState(0)
X = _guide_rng.randn(64, 16).astype(np.float32)
Y = _guide_rng.randint(0, 4, 64).astype(np.int32)
FIT = dict(batch_size=16, epochs=2, shuffle=False, verbose=0, validation_data=(X[:32], Y[:32]))


def guide_model():
  """The guide's model shape: Dense layers and an EinsumDense, compiled with Adam and a metric."""
  keras.utils.set_random_seed(0)
  inputs = keras.Input((16,))
  y = keras.layers.Dense(32, activation='relu', name='d1')(inputs)
  y = keras.layers.EinsumDense('bh,hk->bk', output_shape=24, bias_axes='k', name='e1')(y)
  y = keras.layers.Dense(4, name='d2')(keras.ops.relu(y))
  model = keras.Model(inputs, y)
  model.compile(
    optimizer=keras.optimizers.Adam(1e-2),
    metrics=['accuracy'],
    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
  )
  return model


# --- a plain TF MLP trained in a loop inside one function ----------------------------------------
def variable_mlp(seed):
  """The two weight matrices of a 16 -> 32 -> 4 MLP, as tf.Variables."""
  return [tf.Variable(randn(seed, 16, 32) * 0.1), tf.Variable(randn(seed + 1, 32, 4) * 0.1)]


def loop_training(mesh, w1, w2, annotate):
  """`train(x, y, steps)`: `steps` SGD steps of the MLP (w1, w2) in a tf.range loop."""

  @tf.function
  def train(x, y, steps):
    if annotate:
      x = tg.shard(x, mesh, tg.P('data', None))
    loss = tf.constant(0.0)
    for _ in tf.range(steps):
      with tf.GradientTape() as tape:
        logits = tf.matmul(tf.nn.relu(tf.matmul(x, w1)), w2)
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits))
      g1, g2 = tape.gradient(loss, [w1, w2])
      w1.assign_sub(0.5 * g1)
      w2.assign_sub(0.5 * g2)
    return loss

  return train


# --- bad input: the error it must give (tests/test_bad_input.py, test_keras_bad_input.py) ------
def assert_raises_clearly(name, call, error, words, raised_by='tf_gspmd'):
  """`call()` raises an `error` whose message holds every one of `words`, raised by
  `raised_by`'s own code (the innermost frame of its traceback is in that package): a check
  of tf_gspmd's, not a failure deep in TF that happens to hold the words."""
  with pytest.raises(Exception) as caught:
    call()
  assert isinstance(caught.value, error), (
    f'{name}: raised {type(caught.value).__name__}: {caught.value}'
  )
  assert_holds(name, str(caught.value), words)
  frames = traceback.extract_tb(caught.value.__traceback__)
  where = frames[-1].filename if frames else ''
  assert f'{os.sep}{raised_by}{os.sep}' in where, f'{name}: raised in {where}, not by {raised_by}'


def assert_holds(name, message, words):
  missing = [w for w in words if w not in message]
  assert not missing, f'{name}: message lacks {missing}:\n{message}'


# --- op types whose hand-written handler the brute force of test_one_definition checks ---------
# Handlers that make no layout decision of their own: values known statically.
NO_LAYOUT_DECISION = ('static_handler', 'no_op_handler')


def agreement_specs():
  """The op sweep's programs of every op type with a rule and a hand-written handler that
  decides layouts: tests/test_one_definition.py partitions and runs every one of them (values
  and the handler's layouts against the rule), so the op sweep's CI sample leaves them out."""
  from tf_gspmd.graph_rewrite import dispatch, handlers
  from tf_gspmd.propagation import registry
  from tf_gspmd.testing.op_builders import op_specs

  dispatch._load_families()  # noqa: SLF001
  hand_written = handlers.hand_written()
  out = []
  for spec in op_specs():
    handler = hand_written.get(spec.op_type)
    entry = registry.lookup(spec.op_type)
    if handler is None or entry is None or entry.rule is None:
      continue
    if handler.__name__ not in NO_LAYOUT_DECISION:
      out.append(spec)
  return out


# --- Keras distribution ------------------------------------------------------------------------
def step_programs(function):
  """The PartitionedFunctions behind a model's train/test function that have run."""
  cells = [c.cell_contents for c in getattr(function, '__closure__', None) or ()]
  return [p for p in cells if isinstance(p, PartitionedFunction) and p._last is not None]


def guide_distribution():
  """The guide's ModelParallel over a 2x4 mesh of the 8 CPU devices."""
  devices = keras.distribution.list_devices()
  assert devices == [f'cpu:{i}' for i in range(8)]
  mesh = keras.distribution.DeviceMesh(shape=(2, 4), axis_names=['data', 'model'], devices=devices)
  layout_map = keras.distribution.LayoutMap(mesh)
  layout_map['d1/kernel'] = (None, 'model')
  layout_map['d1/bias'] = ('model',)
  layout_map['e1/kernel'] = ('model', None)
  layout_map['d2/output'] = ('data', None)
  return keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name='data')


def run_python_output(code_or_path, tmp_path, timeout=240, args=()):
  """The stdout of `code_or_path` (source text, or a script's path) run in a fresh interpreter;
  a failure shows its stderr."""
  script = code_or_path if isinstance(code_or_path, pathlib.Path) else tmp_path / 'script.py'
  if script is not code_or_path:
    script.write_text(code_or_path)
  result = run_python(script, timeout, args)
  assert result.returncode == 0, result.stderr[-3000:]
  return result.stdout


def check_model_parallel_example(tmp_path, *args) -> str:
  """examples/keras/model_parallel.py (with `args`) trains with Keras' progress bar and equals
  plain Keras; returns its output."""
  out = run_python_output(ROOT / 'examples' / 'keras' / 'model_parallel.py', tmp_path, args=args)
  assert re.search(r'Epoch 2/2', out) and re.search(r'\d+/\d+\S* .*━.*loss: [\d.]+', out), out
  error = float(re.search(r'weights vs plain Keras: relative error (\S+)', out).group(1))
  assert error <= bound(np.float32) and 'MISMATCH' not in out, out  # the oracle's verdicts
  assert re.search(r"^all_reduce +\('model',\) +[1-9]", out, re.M), out
  return out
