"""What a new user meets first (issue #35, point 6): each a clear error or the right result.

Every case was a failure before its fix: a TypeError or a rank error about a spec the user never
wrote, a raw reshape error once per device, a warning per step function, a silent first call,
Keras' bare device count, a layout error contradicting itself.
"""

import importlib
import logging
import re
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_gspmd as tg
from tf_gspmd.graph_rewrite import partitioner as partitioner_lib
from tf_gspmd.propagation import PropagationWarning
from tf_gspmd.testing import assert_close
from tf_gspmd.xla_bridge.export import XlaLoweringError

from helpers import run_python

# The module, not the function `tf_gspmd.propagation.propagate` that its package exports.
propagate_lib = importlib.import_module('tf_gspmd.propagation.propagate')

MESH = tg.Mesh.create((8,), ('data',))
MESH_2D = tg.Mesh.create((2, 4), ('data', 'model'))


def _x(rows=8, cols=4, seed=0):
  return np.random.RandomState(seed).randn(rows, cols).astype(np.float32)


# --- tf.py_function --------------------------------------------------------------------------
def _py_function_step(give_shape, differentiate=True):
  """A train step through a tf.py_function, its shape given as `give_shape` says."""
  w = tf.Variable(np.full((4, 4), 0.1, np.float32), name='w')

  @tf.function
  def step(x):
    x = tg.shard(x, MESH, tg.P('data', None))
    with tf.GradientTape() as tape:
      h = x @ w
      y = tf.py_function(tf.tanh, [h], tf.float32)
      if give_shape == 'set_shape':
        y.set_shape(h.shape)
      else:
        y = tf.ensure_shape(y, h.shape)
      loss = tf.reduce_sum(y * y)
    if differentiate:
      w.assign_sub(0.1 * tape.gradient(loss, w))
    return loss

  return step


@pytest.mark.parametrize('give_shape', ['set_shape', 'ensure_shape'])
def test_a_py_function_gradient_is_refused_naming_the_op(give_shape):
  step = tg.partition(_py_function_step(give_shape), MESH)
  with pytest.raises(
    ValueError,
    match=r'node gradient_tape/EagerPyFunc is the gradient of a '
    r'tf\.py_function \(op type EagerPyFunc',
  ) as caught:
    step(_x())
  assert 'tf.custom_gradient' in str(caught.value)


@pytest.mark.parametrize('give_shape', ['set_shape', 'ensure_shape'])
def test_a_forward_py_function_partitions_and_matches(give_shape):
  want = _py_function_step(give_shape, differentiate=False)(_x())
  got = tg.partition(_py_function_step(give_shape, differentiate=False), MESH)(_x())
  assert_close(got, want, f'py_function, shape by {give_shape}')


@pytest.mark.parametrize('give_shape', ['set_shape', 'ensure_shape'])
def test_a_py_function_on_xla_is_an_xla_lowering_error_naming_it(give_shape):
  step = tg.partition(_py_function_step(give_shape), MESH, backend='xla')
  with pytest.raises(
    XlaLoweringError,
    match=r'op type EagerPyFunc \(node EagerPyFunc\) has no '
    'XLA lowering',
  ):
    step(_x())


# --- a served SavedModel fed another batch size ----------------------------------------------
def test_a_served_signature_fed_another_shape_names_its_fixed_shape(tmp_path):
  w = tf.Variable(np.ones((4, 3), np.float32), name='w')

  @tf.function
  def step(x):
    return tf.nn.relu(tg.shard(x, MESH, tg.P('data', None)) @ w)

  pf = tg.partition(step, MESH)
  want = step(_x())
  assert_close(pf(_x()), want, 'partitioned')
  tg.saved_model.save(pf, str(tmp_path / 'export'))
  serve = tf.saved_model.load(str(tmp_path / 'export')).signatures['serving_default']
  assert_close(serve(x=tf.constant(_x()))['output_0'], want, 'served')
  with pytest.raises(tf.errors.InvalidArgumentError) as caught:
    serve(x=tf.constant(_x(rows=16)))
  text = str(caught.value)
  assert 'Shape of tensor x [16,4] is not compatible with expected shape [8,4]' in text
  assert 'x_has_the_fixed_shape_8x4_of_this_signature' in text
  assert 'Input to reshape' not in text


# --- warnings once per op type per process ----------------------------------------------------
def _tensor_array_step():
  @tf.function
  def step(x):
    x = tg.shard(x, MESH, tg.P('data', None))
    rows = tf.TensorArray(tf.float32, size=4, element_shape=(8,)).unstack(tf.transpose(x))
    return rows.stack() * 2.0

  return step


def test_an_op_type_without_rule_is_named_once_per_process(caplog):
  propagate_lib._SHOWN_WITHOUT_RULE.discard('TensorListFromTensor')
  partitioner_lib._WARNED_IN_PROCESS.discard('TensorListFromTensor')
  with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.WARNING):
    warnings.simplefilter('always')
    for _ in range(3):  # three step functions (Keras makes one per fit, evaluate, signature)
      step = _tensor_array_step()
      assert_close(tg.partition(step, MESH)(_x(cols=4)), step(_x(cols=4)), 'TensorArray step')
  said = [str(w.message) for w in caught if issubclass(w.category, PropagationWarning)]
  said += [r.getMessage() for r in caplog.records]
  about = [m for m in said if "'TensorListFromTensor'" in m or ' TensorListFromTensor ' in m]
  assert len(about) == 1, about
  assert 'no sharding rule' in about[0] and 'said once per op type' in about[0]
  propagation = tg.propagate(_tensor_array_step(), tf.TensorSpec((8, 4), tf.float32), mesh=MESH)
  assert [w for w in propagation.warnings if "'TensorListFromTensor'" in w]  # each still says it


# --- an abstract variable in a real partition --------------------------------------------------
def test_an_abstract_variable_in_a_partition_is_refused_as_for_planning():
  v = tg.abstract_variable((4, 6), name='planned')

  @tf.function
  def step(x):
    return tf.reduce_sum(tg.shard(x, MESH, tg.P('data', None)) @ v)

  assert tg.plan(step, tf.TensorSpec((8, 4), tf.float32), mesh=MESH).parameter_bytes > 0
  with pytest.raises(
    ValueError,
    match=r'variable planned:0 \(shape \(4, 6\), float32\) is a '
    r'tg\.abstract_variable.*Abstract variables are for planning',
  ):
    tg.partition(step, MESH)(_x())


# --- keras.distribution with too few devices ------------------------------------------------
def test_a_keras_device_mesh_too_big_says_how_to_configure_logical_devices():
  was_enabled = tg.keras.is_enabled()
  tg.keras.enable()
  try:
    with pytest.raises(ValueError) as caught:
      keras.distribution.DeviceMesh((4, 4), ['data', 'model'])
    keras.distribution.DeviceMesh((2, 4), ['data', 'model'])  # 8 devices: fine
  finally:
    if not was_enabled:
      tg.keras.disable()
  text = str(caught.value)
  assert 'DeviceMesh(shape=(4, 4)) needs 16 devices; this process has 8' in text
  assert '[tf.config.LogicalDeviceConfiguration()] * 16' in text
  assert 'set_logical_device_configuration' in text


# --- shard_variable after the first call ----------------------------------------------------
def _megatron_step(w):
  @tf.function
  def step(x):
    y = tg.shard(x, MESH_2D, tg.P('data', None)) @ w
    w.assign_add(0.5 * tf.ones_like(w))
    return tf.reduce_sum(y, axis=1)

  return step


def test_shard_variable_again_with_the_same_layout_is_accepted():
  values = np.arange(32, dtype=np.float32).reshape(4, 8) / 32
  w, w_ref = tf.Variable(values, name='w'), tf.Variable(values, name='w_ref')
  tg.shard_variable(w, MESH_2D, tg.P(None, 'model'))
  step, ref = tg.partition(_megatron_step(w), MESH_2D), _megatron_step(w_ref)
  got, want = [step(_x())], [ref(_x())]
  tg.shard_variable(w, MESH_2D, tg.P(None, 'model'))  # the same layout again: nothing changes
  tg.shard_variable(w, tg.Mesh.create((2, 4), ('data', 'model')), tg.P(None, 'model'))
  got.append(step(_x()))
  want.append(ref(_x()))
  assert_close(got, want, 'losses')
  assert_close(w, w_ref, 'w')


def test_a_real_layout_change_says_what_made_the_live_layout():
  w = tf.Variable(np.ones((4, 8), np.float32), name='w')
  step = tg.partition(_megatron_step(w), MESH_2D)
  step(_x())  # w unannotated: propagation chose its layout
  tg.shard_variable(w, MESH_2D, tg.P(None, 'model'))
  with pytest.raises(ValueError) as caught:
    step(_x())
  text = str(caught.value)
  assert 'annotated None' not in text
  assert re.search(
    r"was annotated P\(None, 'model'\) after its shards were made; they live as P\(.*\) "
    r'\(the layout propagation chose at the first call: it was not annotated then\)',
    text,
  ), text


def test_the_same_spec_over_other_devices_names_both_meshes():
  w = tf.Variable(np.ones((4, 8), np.float32), name='w')
  tg.shard_variable(w, MESH_2D, tg.P(None, 'model'))
  step = tg.partition(_megatron_step(w), MESH_2D)
  step(_x())
  reversed_mesh = tg.Mesh(np.arange(8)[::-1].reshape(2, 4), ('data', 'model'))
  tg.shard_variable(w, reversed_mesh, tg.P(None, 'model'))
  with pytest.raises(ValueError, match=r"annotated P\(None, 'model'\) on Mesh\(\[\[7, 6"):
    step(_x())


def test_a_batch_size_the_batch_axis_does_not_split_reads_as_a_sentence():
  model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
  model.compile(optimizer='sgd', loss='mse')
  tg.partition_model(model, MESH)
  try:
    with pytest.raises(
      ValueError,
      match=r'batch_size=30: 30 rows do not split over the batch '
      r"axis 'data' of 8 devices",
    ):
      model.fit(np.ones((60, 4), np.float32), np.ones((60, 2), np.float32), batch_size=30)
  finally:
    tg.unpartition_model(model)


# --- TF's retracing warning about tf_gspmd's own functions --------------------------------------
_SIX_PROGRAMS = """
import logging
import numpy as np
import tensorflow as tf
cpu = tf.config.list_physical_devices('CPU')[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
import tf_gspmd as tg

said = []
class Keep(logging.Handler):
  def emit(self, record):
    said.append(record.getMessage())
tf.get_logger().addHandler(Keep())
mesh = tg.Mesh.create((2,), ('x',))
for i in range(6):  # six programs, each called once: no function of the user's is retraced
  v = tf.Variable(np.full((4, 4), i, np.float32))
  tg.shard_variable(v, mesh, tg.P('x', None))
  step = tg.partition(tf.function(lambda a, v=v: tf.reduce_sum(v.assign_add(a))), mesh)
  assert float(step(tf.ones((4, 4)))) == 16 * (i + 1)
print('RETRACING', [m for m in said if 'retracing' in m])
"""


@pytest.mark.slow  # a fresh interpreter: `make test` runs it, the edit loop not
def test_six_programs_raise_no_retracing_warning_about_tf_gspmds_own_functions(tmp_path):
  """TF counts retracing per code object; tf_gspmd's launcher and copier are one code per
  program, so before the fix the fifth program warned of retracing the user never did."""
  script = tmp_path / 'six_programs.py'
  script.write_text(_SIX_PROGRAMS)
  done = run_python(script)
  assert done.returncode == 0, done.stderr[-2000:]
  assert 'RETRACING []' in done.stdout, done.stdout[-2000:]
