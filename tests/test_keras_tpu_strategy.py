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
  a keras.distribution and `fit` inside `strategy.scope()` too; XLA's traced program runs
  `predict` of a data-parallel model (no collectives) and is refused by TF in `fit`.
Results are checked by the oracle (tf_gspmd.testing: normwise relative error per tensor).
"""
import collections

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.compiler.xla.service import hlo_pb2

import tf_gspmd as tg
from tf_gspmd.keras.strategy import StrategyFunction
from tf_gspmd.testing import as_float32, assert_close
from tf_gspmd.xla_bridge import tpu
from tf_gspmd.xla_bridge.hlo import hlo_collectives

from test_keras_distribution import X, Y, guide_model

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


def backing(variable):
  return getattr(variable, '_value', variable)  # Keras private: the tf.Variable behind it


def train_runner(model, batch):
  """The TPUStrategyStep of `model`'s train step for `batch`'s signature, built but not run."""
  model.make_train_function()
  launcher = model._tf_gspmd_launcher  # pylint: disable=protected-access
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
  # metrics and the gradients (one bucket of sums each, as tf_gspmd's own records count them).
  assert found == {('all-reduce', MODEL_GROUPS): 1, ('all-reduce', DATA_GROUPS): 3}, found
  train = runner._compiled  # pylint: disable=protected-access
  assert len([c for op in train.op_records for c in op.collectives]) == 4
  entry = hlo.split('ENTRY', 1)[1].split('\n', 1)[0]
  assert 'f32[16,16]' not in entry  # local shards only (8 rows of 16 per replica)


def test_keras_train_step_trains_on_pjrt_replicas_like_plain_keras(replica_step):
  """The replica function, lowered by tf2xla and compiled for 8 PJRT CPU replicas, trained 3
  steps against `train_on_batch` of the unpartitioned twin (same seed)."""
  from jax._src.lib import xla_client  # pylint: disable=g-import-not-at-top
  from tf_gspmd.xla_bridge import export as export_lib, pjrt  # pylint: disable=g-import-not-at-top
  devices = pjrt.jax_devices(8)
  model, runner = replica_step
  twin = guide_model()
  module = hlo_pb2.HloModuleProto.FromString(_lowered(runner)(stage='hlo_serialized'))
  updates = {e.output_shape_index[0]: e.parameter_number for e in module.input_output_alias.entries}
  module.ClearField('input_output_alias')  # no donation: the state buffers are reused
  stablehlo = xla_client._xla.mlir.hlo_to_stablehlo(module.SerializeToString())  # pylint: disable=protected-access
  args = list(runner.export.args)           # x, y, captures, then every variable's shard
  outputs = [r for r in runner.export.results if r.updates is None]
  updated = [updates[j] for j in range(len(outputs), len(outputs) + len(updates))]
  executable = pjrt.PjrtExecutable(export_lib.XlaExport(
      stablehlo, runner.mesh, args, outputs + [args[p] for p in updated], 'tpu_replica'), devices)
  first_variable = len(args) - len(runner.replica_variables)
  originals = runner._originals  # pylint: disable=protected-access
  state = [pjrt.put_global(v.numpy(), layout, devices)
           for v, layout in zip(originals, args[first_variable:])]
  captures = [pjrt.put_global(np.asarray(c), layout, devices) for c, layout in zip(
      runner._compiled.capture_values, args[2:first_variable])]  # pylint: disable=protected-access
  metric_ids = {id(backing(v)) for m in model.metrics for v in m.variables}
  rng = np.random.RandomState(3)
  for i in range(3):
    x, y = rng.randn(16, 16).astype(np.float32), rng.randint(0, 4, 16).astype(np.int32)
    for j, original in enumerate(originals):
      if id(original) in metric_ids:  # train_on_batch resets the metrics first
        state[j] = pjrt.put_global(np.zeros(original.shape, original.dtype.as_numpy_dtype),
                                   args[first_variable + j], devices)
    got = executable.run([pjrt.put_global(x, args[0], devices),
                          pjrt.put_global(y, args[1], devices)] + captures + state)
    for parameter, buffers in zip(updated, got[len(outputs):]):
      state[parameter - first_variable] = buffers
    logs = tf.nest.pack_sequence_as(
        runner._compiled.program.structured_outputs,  # pylint: disable=protected-access
        [pjrt.assemble_global(b, r.sharding, r.shape, r.name) for b, r in zip(got, outputs)])
    assert_close(as_float32(logs), as_float32(twin.train_on_batch(x, y, return_dict=True)),
                 f'step {i + 1} logs')
  index = {id(v): j for j, v in enumerate(originals)}

  def trained(variable):
    j = index[id(backing(variable))]
    layout = args[first_variable + j]
    return pjrt.assemble_global(state[j], layout.sharding, layout.shape, variable.path)
  mine = list(model.weights) + list(model.optimizer.variables)
  theirs = list(twin.weights) + list(twin.optimizer.variables)
  assert_close({v.path: trained(v) for v in mine}, {v.path: t for v, t in zip(mine, theirs)},
               'weights and Adam state')
  # What XLA compiled: all-reduces over the mesh's 'model' and 'data' groups, nothing else.
  compiled = collections.Counter((c.kind, c.replica_groups)
                                 for c in hlo_collectives(executable.compiled_hlo()))
  assert set(compiled) <= {('all-reduce', MODEL_GROUPS), ('all-reduce', DATA_GROUPS)}, compiled

