"""Keras `fit` / `evaluate` / `predict` under TPUStrategy (tf_gspmd.keras.strategy), tested as far
as it runs without a TPU.

* the replica function Keras' train step becomes (the guide's MLP, model-parallel over a 2x4
  mesh), built under a MirroredStrategy of 8 logical CPUs (TPUStrategy's replica API), lowered
  by tf2xla with its replica groups read from the HLO;
* that function compiled for 8 PJRT CPU replicas (XLA's replica id as the partition id, what
  `replica_id_in_sync_group` is on a TPU) and trained 3 steps equal to plain Keras;
* the MirroredStrategy stand-in end to end: `fit` / `evaluate` / `predict` through
  `strategy.run`, the shards per-replica components, with TF collective ops between the
  replicas (XLA's have no kernel outside a compiled program); with `tf_gspmd.keras.enable()`,
  a keras.distribution and `fit` inside `strategy.scope()` too; the TPU's own replica
  programs run `predict` of a data-parallel model (no collectives); in `fit` TF has no kernel
  for the traced program's XLA collectives, and the exported module is refused.
Results are checked by the oracle (tf_gspmd.testing: normwise relative error per tensor).
"""

import collections

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.compiler.xla.service import hlo_pb2

import tf_gspmd as tg
from tf_gspmd.keras.hooks import backing
from tf_gspmd.keras.strategy import StrategyFunction
from tf_gspmd.testing import as_float32, assert_close
from tf_gspmd.xla_bridge import tpu
from tf_gspmd.xla_bridge.hlo import hlo_collectives

from helpers import X, Y, guide_model

MODEL_GROUPS = ((0, 1, 2, 3), (4, 5, 6, 7))
DATA_GROUPS = ((0, 4), (1, 5), (2, 6), (3, 7))
FIT = dict(batch_size=16, epochs=2, shuffle=False, verbose=0, validation_data=(X[:32], Y[:32]))


def mirrored():
  """8 logical CPUs, one replica each: the same replica API as a TPUStrategy of 8 cores."""
  return tf.distribute.MirroredStrategy([f'/device:CPU:{i}' for i in range(8)])


def guide_layouts(model, mesh):
  """The guide's layouts, through tg.LayoutMap: d1 column-parallel, e1 row-parallel."""
  layout = tg.LayoutMap(mesh)
  layout['d1/kernel'] = tg.P(None, 'model')
  layout['d1/bias'] = tg.P('model')
  layout['e1/kernel'] = tg.P('model', None)
  layout.apply(model)
  return model


def train_runner(model, batch):
  """The TPUStrategyStep of `model`'s train step for `batch`'s signature, built but not run."""
  model.make_train_function()
  launcher = model._tf_gspmd_launcher  # noqa: SLF001
  launcher.annotate_unmatched()  # what the first launch does before the step is captured
  return launcher.functions['train_step'].runner(batch)


# --- the replica program TPUStrategy runs --------------------------------------------------------
@pytest.fixture(scope='module')
def replica_step():
  """The guide model's train step as a TPU would run it: the exported module, XLA collectives.
  Built under the stand-in, never run by it (XLA's collectives need a compiled program)."""
  pytest.importorskip('jax')
  mesh = tg.Mesh.create((2, 4), ('data', 'model'))
  model = guide_layouts(guide_model(), mesh)
  tg.partition_model(model, mesh, strategy=mirrored(), collectives='xla')
  runner = train_runner(model, (X[:16], Y[:16]))
  return model, runner


def _lowered(runner):
  """The replica function's HLO from tf2xla, on plain variables of the shards' shapes."""
  templates = [tf.Variable(tf.zeros(r.local_shape, r.dtype)) for r in runner.replica_variables]
  function = runner.replica_function()
  return function.experimental_get_compiler_ir(*runner.local_examples(templates))


def test_keras_train_step_lowers_with_the_mesh_replica_groups(replica_step):
  _, runner = replica_step
  assert runner.export is not None and 'stablehlo.all_reduce' in runner.export.module
  hlo = _lowered(runner)(stage='hlo')
  assert 'custom-call' not in hlo  # tf2xla inlined the module: no call, no marker left
  found = collections.Counter((c.kind, c.replica_groups) for c in hlo_collectives(hlo))
  # Megatron's one all-reduce over 'model' (e1's contraction over the split hidden dim; the
  # backward needs none: d1's input gradient is not asked for); over 'data' the loss, the
  # metrics and the gradients, each its own all-reduce side by side in their buckets (XLA's
  # combiner fuses them), as tf_gspmd's own records count them.
  assert found == {('all-reduce', MODEL_GROUPS): 1, ('all-reduce', DATA_GROUPS): 8}, found
  train = runner._compiled  # noqa: SLF001
  assert len([c for op in train.op_records for c in op.collectives]) == 9
  entry = hlo.split('ENTRY', 1)[1].split('\n', 1)[0]
  assert 'f32[16,16]' not in entry  # local shards only (8 rows of 16 per replica)


def test_keras_train_step_trains_on_pjrt_replicas_like_plain_keras(replica_step):
  """The replica function, lowered by tf2xla and compiled for 8 PJRT CPU replicas, trained 3
  steps against `train_on_batch` of the unpartitioned twin (same seed)."""
  from jax._src.lib import xla_client

  from tf_gspmd.xla_bridge import export as export_lib
  from tf_gspmd.xla_bridge import pjrt

  devices = pjrt.jax_devices(8)
  model, runner = replica_step
  twin = guide_model()
  module = hlo_pb2.HloModuleProto.FromString(_lowered(runner)(stage='hlo_serialized'))
  updates = {e.output_shape_index[0]: e.parameter_number for e in module.input_output_alias.entries}
  module.ClearField('input_output_alias')  # no donation: the state buffers are reused
  to_stablehlo = xla_client._xla.mlir.hlo_to_stablehlo  # noqa: SLF001
  stablehlo = to_stablehlo(module.SerializeToString())
  args = list(runner.export.args)  # x, y, captures, then every variable's shard
  outputs = [r for r in runner.export.results if r.updates is None]
  updated = [updates[j] for j in range(len(outputs), len(outputs) + len(updates))]
  executable = pjrt.PjrtExecutable(
    export_lib.XlaExport(
      stablehlo, runner.mesh, args, outputs + [args[p] for p in updated], 'tpu_replica'
    ),
    devices,
  )
  first_variable = len(args) - len(runner.replica_variables)
  originals = runner._originals  # noqa: SLF001
  state = [
    pjrt.put_global(v.numpy(), layout, devices)
    for v, layout in zip(originals, args[first_variable:])
  ]
  captures = [
    pjrt.put_global(np.asarray(c), layout, devices)
    for c, layout in zip(runner._compiled.capture_values, args[2:first_variable])
  ]  # noqa: SLF001
  metric_ids = {id(backing(v)) for m in model.metrics for v in m.variables}
  rng = np.random.RandomState(3)
  for i in range(3):
    x, y = rng.randn(16, 16).astype(np.float32), rng.randint(0, 4, 16).astype(np.int32)
    for j, original in enumerate(originals):
      if id(original) in metric_ids:  # train_on_batch resets the metrics first
        state[j] = pjrt.put_global(
          np.zeros(original.shape, original.dtype.as_numpy_dtype), args[first_variable + j], devices
        )
    got = executable.run(
      [pjrt.put_global(x, args[0], devices), pjrt.put_global(y, args[1], devices)]
      + captures
      + state
    )
    for parameter, buffers in zip(updated, got[len(outputs) :]):
      state[parameter - first_variable] = buffers
    logs = tf.nest.pack_sequence_as(
      runner._compiled.program.structured_outputs,  # noqa: SLF001
      [pjrt.assemble_global(b, r.sharding, r.shape, r.name) for b, r in zip(got, outputs)],
    )
    assert_close(
      as_float32(logs),
      as_float32(twin.train_on_batch(x, y, return_dict=True)),
      f'step {i + 1} logs',
    )
  index = {id(v): j for j, v in enumerate(originals)}

  def trained(variable):
    j = index[id(backing(variable))]
    layout = args[first_variable + j]
    return pjrt.assemble_global(state[j], layout.sharding, layout.shape, variable.path)

  mine = list(model.weights) + list(model.optimizer.variables)
  theirs = list(twin.weights) + list(twin.optimizer.variables)
  assert_close(
    {v.path: trained(v) for v in mine},
    {v.path: t for v, t in zip(mine, theirs)},
    'weights and Adam state',
  )
  # What XLA compiled: all-reduces over the mesh's 'model' and 'data' groups, nothing else.
  compiled = collections.Counter(
    (c.kind, c.replica_groups) for c in hlo_collectives(executable.compiled_hlo())
  )
  assert set(compiled) <= {('all-reduce', MODEL_GROUPS), ('all-reduce', DATA_GROUPS)}, compiled


# --- the MirroredStrategy stand-in, end to end ---------------------------------------------------
def step_functions(model):
  return model._tf_gspmd_launcher.functions  # noqa: SLF001


@pytest.mark.slow  # whole Keras fits: 11 s
def test_fit_evaluate_predict_run_by_strategy_run_equal_plain_keras():
  """partition_model(strategy=): every step through strategy.run, TF collectives between the
  replicas' devices (what runs on CPUs), the shards per-replica components."""
  mesh = tg.Mesh.create((2, 4), ('data', 'model'))
  strategy = mirrored()
  twin = guide_model()
  model = tg.partition_model(guide_layouts(guide_model(), mesh), mesh, strategy=strategy)
  assert_close(
    as_float32(model.fit(X, Y, **FIT).history), as_float32(twin.fit(X, Y, **FIT).history), 'history'
  )
  assert_close(
    model.evaluate(X, Y, batch_size=16, verbose=0),
    twin.evaluate(X, Y, batch_size=16, verbose=0),
    'evaluate',
  )
  assert_close(
    model.predict(X, batch_size=16, verbose=0), twin.predict(X, batch_size=16, verbose=0), 'predict'
  )
  # A write to the model's own variable wins over its shards (keras/fit.py's mirror scatters it).
  for m in (model, twin):
    m.optimizer.learning_rate.assign(3e-3)
  assert_close(
    as_float32(model.train_on_batch(X[:16], Y[:16], return_dict=True)),
    as_float32(twin.train_on_batch(X[:16], Y[:16], return_dict=True)),
    'train_on_batch',
  )
  assert_close(model.weights, twin.weights, 'weights')

  functions = step_functions(model)
  train = functions['train_step']
  assert isinstance(train, StrategyFunction) and train.replica_collectives == 'tf'
  # One runner per signature: fit's batches (x, y) and train_on_batch's (x, y, None).
  runners = list(train._runners.values())  # noqa: SLF001
  assert len(runners) == 2
  assert all(r.strategy is strategy and r.collectives == 'tf' for r in runners)
  # train, test and predict steps share one store: one ReplicaVariable per variable.
  store = model._tf_gspmd_store  # noqa: SLF001
  assert all(isinstance(s, tpu.ReplicaVariable) for _, s in store.pairs())
  d1 = next(s for o, s in store.pairs() if o.name.startswith('d1/kernel'))
  components = d1.components()
  assert len(components) == 8 and tuple(components[0].shape) == (16, 8)
  for replica, component in enumerate(components):  # replica r holds model column block r % 4
    column = replica % 4
    assert_close(
      component,
      model.get_layer('d1').kernel.numpy()[:, 8 * column : 8 * column + 8],
      f'd1 kernel on replica {replica}',
    )
  kinds = collections.Counter((c['kind'], c['axes']) for c in train.collectives())
  assert kinds == {('all_reduce', ('model',)): 1, ('all_reduce', ('data',)): 3}, kinds


@pytest.fixture
def keras_distribution():
  """tf_gspmd.keras enabled and the guide's ModelParallel distribution set (both undone after)."""
  tg.keras.enable()
  mesh = keras.distribution.DeviceMesh((2, 4), ['data', 'model'])
  layout_map = keras.distribution.LayoutMap(mesh)
  layout_map['d1/kernel'] = (None, 'model')
  layout_map['d1/bias'] = ('model',)
  layout_map['e1/kernel'] = ('model', None)
  keras.distribution.set_distribution(
    keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name='data')
  )
  yield
  keras.distribution.set_distribution(None)
  tg.keras.disable()


@pytest.mark.slow  # whole Keras fits: 23 s
def test_keras_distribution_fit_inside_the_strategy_scope_runs_by_strategy_run(keras_distribution):
  """Built outside the scope, fit inside it: the strategy is picked up. Keras splits fit's
  batches over the replicas itself in the scope (its dataset distributed): they are put back
  together, then split by the step's layout. (Keras' distributed iterators are slow to tear down
  on 8 CPU devices, plain Keras too: one short fit, then the *_on_batch calls.)"""
  del keras_distribution
  strategy = mirrored()
  model = guide_model()
  fit = dict(FIT, epochs=1, validation_data=None)
  with strategy.scope():
    history = model.fit(X, Y, **fit).history
    evaluated = model.test_on_batch(X[:32], Y[:32], return_dict=True)
    predicted = model.predict_on_batch(X[:32])
  train = step_functions(model)['train_step']
  assert isinstance(train, StrategyFunction) and train.strategy is strategy
  keras.distribution.set_distribution(None)
  twin = guide_model()
  assert_close(as_float32(history), as_float32(twin.fit(X, Y, **fit).history), 'history')
  assert_close(
    as_float32(evaluated),
    as_float32(twin.test_on_batch(X[:32], Y[:32], return_dict=True)),
    'evaluate',
  )
  assert_close(predicted, twin.predict_on_batch(X[:32]), 'predict')
  assert_close(model.weights, twin.weights, 'weights')
  assert tg.keras.shard_layouts(model)['d1/kernel'] == (tg.P(None, 'model'), (16, 8))


@pytest.mark.slow  # exports and compiles per replica (make test runs it)
def test_xla_replica_programs_under_the_stand_in():
  """What of the TPU's own replica programs runs on CPUs: a data-parallel predict (no
  collectives), exported module and traced program alike. With collectives (fit), the traced
  program's XLA ops have no TF kernel; the exported module would run each replica's
  collectives alone (one XLA program per replica): refused, not run wrong."""
  mesh = tg.Mesh.create((8,), ('batch',))
  twin = guide_model()
  want = twin.predict(X[:32], batch_size=16, verbose=0)
  for exported in (True, False):
    model = tg.partition_model(
      guide_model(), mesh, 'batch', strategy=mirrored(), collectives='xla', exported=exported
    )
    assert_close(model.predict(X[:32], batch_size=16, verbose=0), want, f'exported={exported}')
    if exported:
      with pytest.raises(ValueError, match=r'exported module runs collectives \(all-reduce\)'):
        model.train_on_batch(X[:16], Y[:16])
    else:
      with pytest.raises(tf.errors.InvalidArgumentError, match="'XlaAllReduce'"):
        model.train_on_batch(X[:16], Y[:16])


def test_a_model_built_inside_the_scope_is_refused_with_what_to_do():
  mesh = tg.Mesh.create((8,), ('batch',))
  strategy = mirrored()
  with strategy.scope():
    model = guide_model()
  with pytest.raises(
    ValueError,
    match=r'built or compiled inside a tf.distribute strategy scope'
    r'.*build and compile the model outside',
  ):
    tg.partition_model(model, mesh, 'batch', strategy=strategy)
  model = guide_model()
  with pytest.raises(ValueError, match="backend='xla' is another way to run them"):
    tg.partition_model(model, mesh, 'batch', strategy=strategy, backend='xla').predict(
      X[:16], verbose=0
    )
