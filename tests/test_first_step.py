"""Time to first step and per-call host work (issue #15 points 1 and 3).

* bench/first_step.py's phase timer reports every phase of a first call;
* propagation and partitioning grow linearly with the number of layers
  (CPU time of this thread at 4 and 16 layers: ratio < 6, where linear is 4
  and quadratic 16);
* a call does not rebuild argument specs nor pass V x N variables: the spec
  builder runs once over 3 calls, the variables are captured by the launch
  function, and the 3 steps still equal the unpartitioned ones.
"""

import os
import sys
import time

import numpy as np
import pytest
import tensorflow as tf

import tf_gspmd as tg
from tf_gspmd.graph.capture import capture
from tf_gspmd.graph_rewrite import factors
from tf_gspmd.propagation.api import propagate_captured
from tf_gspmd.propagation.propagate import Propagator
from tf_gspmd.runtime import launcher
from tf_gspmd.testing import assert_close

from helpers import randn

sys.path.insert(
  0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'bench')
)
import first_step  # noqa: E402


def mlp_step(layers: int, mesh=None, width: int = 8, seed: int = 0):
  """A training step of `layers` Dense+ReLU layers (SGD), the batch split over 'data'."""
  weights = [tf.Variable(randn(seed + i, width, width) * 0.3, name=f'w{i}') for i in range(layers)]
  biases = [tf.Variable(np.zeros(width, np.float32), name=f'b{i}') for i in range(layers)]

  @tf.function
  def step(x):
    if mesh is not None:
      x = tg.shard(x, mesh, tg.P('data', None))
    with tf.GradientTape() as tape:
      h = x
      for w, b in zip(weights, biases):
        h = tf.nn.relu(tf.matmul(h, w) + b)
      loss = tf.reduce_mean(h * h)
    grads = tape.gradient(loss, weights + biases)
    for v, g in zip(weights + biases, grads):
      v.assign_sub(0.1 * g)
    return loss

  return step, weights + biases


def test_phase_timer_reports_every_phase():
  mesh = tg.Mesh.create((8,), ('data',))
  step, _ = mlp_step(2, mesh)
  pf = tg.partition(step, mesh)
  timer = first_step.PhaseTimer()
  x = randn(9, 16, 8)
  with timer.installed():
    start = time.perf_counter()
    float(pf(x))
    first = time.perf_counter() - start
  phases = timer.phases(steady=0.0)
  print({k: round(v, 3) for k, v in phases.items()}, f'first call {first:.2f} s')
  assert set(phases) == set(first_step.PHASES)
  for phase in (
    'capture',
    'propagate',
    'build',
    'partition',
    'trace',
    'launch trace',
    'instantiate',
  ):
    assert phases[phase] > 0, phase
  assert sum(phases.values()) <= first * 1.05 + 0.05  # phases do not overlap


def _propagate_and_partition_seconds(layers: int) -> tuple:
  """CPU seconds of this thread: (propagation, partitioning) of an `layers`-layer step."""
  mesh = tg.Mesh.create((8,), ('data',))
  step, _ = mlp_step(layers, mesh)
  x = randn(0, 16, 8)
  pf = tg.partition(step, mesh)
  program = capture(step, x)
  start = time.thread_time()
  propagate_captured(program, mesh)
  propagate = time.thread_time() - start
  compiled = pf.get_program(x)
  start = time.thread_time()
  compiled.prepared.build_per_partition(
    x, *compiled.capture_values, *[pf.store.sharded[id(v)] for v in compiled.variables]
  )
  return propagate, time.thread_time() - start


def test_propagation_and_partitioning_grow_linearly_with_layers():
  runs = {n: [_propagate_and_partition_seconds(n) for _ in range(2)] for n in (4, 16)}
  prop = {n: min(r[0] for r in runs[n]) for n in runs}
  part = {n: min(r[1] for r in runs[n]) for n in runs}
  print(
    f'propagate 4 -> 16 layers: {prop[4]:.3f} -> {prop[16]:.3f} s; '
    f'partition+trace: {part[4]:.3f} -> {part[16]:.3f} s'
  )
  assert prop[16] / prop[4] < 6
  assert part[16] / part[4] < 6


def _propagated(program, mesh, skip_unchanged: bool):
  """(records, sweeps per level, rules applied) of one propagation of `program`."""
  propagator = Propagator(program, mesh)
  propagator.skip_unchanged = skip_unchanged
  applied, apply = [0], propagator._apply  # noqa: SLF001

  def counting(info, forward):
    applied[0] += 1
    return apply(info, forward)

  propagator._apply = counting  # noqa: SLF001
  result = propagator.run()
  return result.records(), result.iterations, applied[0]


def test_propagation_skips_nodes_whose_tensors_did_not_change_with_the_same_result(monkeypatch):
  mesh = tg.Mesh.create((8,), ('data',))
  step, _ = mlp_step(4, mesh)
  program = capture(step, randn(0, 16, 8))
  every, sweeps, all_applied = _propagated(program, mesh, skip_unchanged=False)
  skipping, skipping_sweeps, applied = _propagated(program, mesh, skip_unchanged=True)
  assert skipping == every and skipping_sweeps == sweeps
  assert applied < 0.8 * all_applied, (applied, all_applied)

  @tf.function
  def late(x):  # x's sharding comes back from the annotation, then goes on to x + 1
    kept = tg.shard(tf.nn.relu(x * 2.0), mesh, tg.P('data', None))
    return kept, x + 1.0

  sibling = capture(late, randn(0, 16, 8))
  every = _propagated(sibling, mesh, skip_unchanged=False)[0]
  assert _propagated(sibling, mesh, skip_unchanged=True)[0] == every
  # The comparison can fail: a change not recorded skips `x + 1` when x's sharding arrives.
  monkeypatch.setattr(
    Propagator,
    '_set_state',
    lambda self, key, state: self.states.__setitem__(key, state),
  )
  assert _propagated(sibling, mesh, skip_unchanged=True)[0] != every


def _planned_and_costed(monkeypatch, layers: int):
  """(collectives, op records, assignments costed) of planning an `layers`-layer step."""
  mesh = tg.Mesh.create((8,), ('data',))
  step, _ = mlp_step(layers, mesh)
  costed, cheapest = [0], factors._cheapest  # noqa: SLF001

  def counting(*args):
    costed[0] += 1
    return cheapest(*args)

  monkeypatch.setattr(factors, '_cheapest', counting)
  report = tg.plan(step, tf.TensorSpec((16, 8), tf.float32), mesh=mesh)
  return report.collective_records, report.op_records, costed[0]


def test_an_ops_layouts_are_costed_once_per_repeated_layer_with_the_same_choice(monkeypatch):
  collectives, ops, costed = _planned_and_costed(monkeypatch, 4)
  monkeypatch.setattr(factors, '_choice_key', lambda *args: None)  # every op costed again
  again, again_ops, uncached = _planned_and_costed(monkeypatch, 4)
  assert (again, again_ops) == (collectives, ops) and collectives and ops
  assert costed < 0.7 * uncached, (costed, uncached)


def test_a_call_builds_no_specs_and_passes_no_variables(monkeypatch):
  mesh = tg.Mesh.create((8,), ('data',))
  step, variables = mlp_step(3, mesh, seed=3)
  reference, ref_variables = mlp_step(3, seed=3)
  built = []
  describe = launcher.SpmdProgram._describe_args  # noqa: SLF001

  def counting(self, args):
    built.append(len(args))
    return describe(self, args)

  monkeypatch.setattr(launcher.SpmdProgram, '_describe_args', counting)
  pf = tg.partition(step, mesh)
  for i in range(3):
    x = randn(10 + i, 16, 8)
    assert_close(pf(x), reference(x), f'loss of call {i}')
  assert len(built) == 1, built  # described once, for the first call
  assert_close(variables, ref_variables, 'variables')
  # The launch function captured the 6 sharded variables (x 8 devices): a call passes
  # only the tokens and the batch.
  spmd = pf.get_program(randn(0, 16, 8)).prepared
  ((outer, bound),) = spmd._outer.values()  # noqa: SLF001
  assert len(bound) == len(variables)
  (concrete,) = outer._list_all_concrete_functions()  # noqa: SLF001
  assert len(concrete.structured_input_signature[0]) == 1 + 1  # tokens, batch
  assert len(concrete.captured_inputs) >= len(variables) * 8


def test_per_partition_calls_and_the_launch_run_no_grappler(monkeypatch):
  """Per-device instantiation would run Grappler over the body N times: by default the
  per-partition calls run none (TF_GSPMD_GRAPPLER names passes to bring back), nor does the
  outer launch (whose Grappler specialized the body per call site)."""
  from tensorflow.core.protobuf import (
    config_pb2,
    rewriter_config_pb2,
  )
  from tensorflow.python.eager import context

  mesh = tg.Mesh.create((8,), ('data',))

  def call_configs(seed):
    step, _ = mlp_step(1, mesh, seed=seed)
    reference, _ = mlp_step(1, seed=seed)
    pf = tg.partition(step, mesh)
    before = context.context().function_call_options
    x = randn(4, 16, 8)
    assert_close(pf(x), reference(x), 'loss')
    assert context.context().function_call_options is before  # the caller's options restored
    ((outer, _),) = pf.get_program(x).prepared._outer.values()  # noqa: SLF001
    (concrete,) = outer._list_all_concrete_functions()  # noqa: SLF001
    calls = [op for op in concrete.graph.get_operations() if op.type == 'StatefulPartitionedCall']
    assert len(calls) == 8
    configs = []
    for call in calls:
      config = config_pb2.ConfigProto()
      config.ParseFromString(call.get_attr('config_proto'))
      configs.append(config.graph_options.rewrite_options)
    return configs

  assert all(r.disable_meta_optimizer for r in call_configs(1))
  monkeypatch.setenv('TF_GSPMD_GRAPPLER', 'remapping')
  off = rewriter_config_pb2.RewriterConfig.OFF
  for rewrite in call_configs(2):
    assert not rewrite.disable_meta_optimizer and rewrite.remapping != off
    assert rewrite.constant_folding == off and rewrite.arithmetic_optimization == off
    assert rewrite.function_optimization == off and rewrite.layout_optimizer == off


def test_keras_step_is_traced_once_and_trains_like_keras():
  """partition_model builds the optimizer before the step is captured, so TF traces the
  Keras step once (a trace that creates Adam's variables would be traced again)."""
  import keras

  def build():
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
      [keras.Input((6,)), keras.layers.Dense(8, activation='relu'), keras.layers.Dense(3)]
    )
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss='mse')
    return model

  x, y = randn(1, 16, 6), randn(2, 16, 3)
  reference, model = build(), build()
  tg.partition_model(model, tg.Mesh.create((8,), ('data',)))
  traced = []
  train_step = model.train_step

  def counting(data):
    traced.append(1)
    return train_step(data)

  model.train_step = counting
  # Keras returns the float32 loss as a Python float: back to float32.
  got = np.float32([model.train_on_batch(x, y) for _ in range(2)])
  want = np.float32([reference.train_on_batch(x, y) for _ in range(2)])
  assert len(traced) == 1, f'the step was traced {len(traced)} times'
  assert_close(got, want, 'losses')
  assert_close(model.get_weights(), reference.get_weights(), 'weights')


@pytest.mark.parametrize('made', ['as_shards', 'plain'])
def test_keras_steps_copy_weights_only_of_variables_made_plain(monkeypatch, made):
  """After each train_on_batch the model's own variables read the trained values (here
  straight from a layer, not through get_weights). Variables made as shards (under a
  keras.distribution) are never assembled by a step; plain ones (a model made before
  partition_model) are their own state, written back from the shards after each step."""
  import contextlib

  import keras

  from tf_gspmd.runtime import sharded

  def build():
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
      [
        keras.Input((6,)),
        keras.layers.Dense(8, activation='relu'),
        keras.layers.BatchNormalization(),
        keras.layers.Dense(3),
      ]
    )
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss='mse')
    return model

  x, y = randn(3, 16, 6), randn(4, 16, 3)
  reference = build()
  if made == 'as_shards':
    tg.keras.enable()
    distributed = keras.distribution.DataParallel().scope
  else:
    distributed = contextlib.nullcontext
  try:
    with distributed():
      model = build()
    if made == 'plain':
      tg.partition_model(model, tg.Mesh.create((8,), ('data',)))

    def train():
      with distributed():
        model.train_on_batch(x, y)
      reference.train_on_batch(x, y)

    train()
    eager = []
    assemble = sharded.ShardedVariable.assemble

    def counting(self):
      if tf.executing_eagerly():
        eager.append(self.label)
      return assemble(self)

    monkeypatch.setattr(sharded.ShardedVariable, 'assemble', counting)
    for _ in range(3):
      train()
      if made == 'as_shards':  # (the optimizer's step counter is made from a value: plain)
        weights = {v.path for v in model.weights + model.optimizer.variables[2:]}
        assert not weights & set(eager), f'assembled by a step: {eager}'
      # (plain: written back by one traced copy per step; the values below show it)
      eager.clear()
      assert_close(model.layers[0].kernel.numpy(), reference.layers[0].kernel.numpy(), 'kernel')
      assert_close(
        model.layers[1].moving_variance.numpy(),
        reference.layers[1].moving_variance.numpy(),
        'moving variance',
      )
      if made == 'as_shards':
        assert eager, 'the reads above assemble the shards'
      eager.clear()
  finally:
    if made == 'as_shards':
      tg.keras.disable()


def test_a_replicated_variable_is_assembled_from_one_shard():
  """assemble() reads only the shards a value is made of: a replicated variable's first."""
  from tf_gspmd.runtime import ShardedVariable

  mesh = tg.Mesh.create((8,), ('data',))
  value = randn(5, 4, 3)
  variable = ShardedVariable(value, tg.NamedSharding(mesh, tg.P(None, None)))
  variable.shards[3].assign(value + 1)  # a shard no one reads must not matter

  @tf.function
  def whole():
    return variable.assemble()

  assert_close(whole(), value, 'assembled')
  reads = [
    op for op in whole.get_concrete_function().graph.get_operations() if op.type == 'ReadVariableOp'
  ]
  assert len(reads) == 1, reads


def test_shard_variables_share_one_tf_name_and_keep_a_readable_label():
  """Eager TF caches a kernel per variable-handle attributes (the name is one) and device:
  the V x N shards share one name, so a first call makes few kernels, not one per shard."""
  from tf_gspmd.runtime import sharded

  mesh = tg.Mesh.create((8,), ('data',))
  step, variables = mlp_step(2, mesh)
  pf = tg.partition(step, mesh)
  pf(randn(7, 16, 8))
  held = pf.sharded_variables()
  assert len(held) == len(variables)
  assert {v.name for s in held for v in s.variables} == {sharded.SHARD_NAME + ':0'}
  assert sorted(s.label for s in held) == sorted(v.name.split(':')[0] for v in variables)
