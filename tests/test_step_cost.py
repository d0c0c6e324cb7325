"""A step's features priced on a HardwareProfile (tg.plan(..., profile=)), and the CPU step
model's fit and its per-CPU cache (tf_gspmd.auto_shard.fit)."""

import dataclasses
import json

import pytest
import tensorflow as tf

import tf_gspmd as tg
from tf_gspmd import Mesh, NamedSharding, P
from tf_gspmd.auto_shard import constants as constants_module
from tf_gspmd.auto_shard import fit, simulate
from tf_gspmd.auto_shard.constants import load_constants
from tf_gspmd.auto_shard.cost import estimate
from tf_gspmd.graph import capture
from tf_gspmd.step_cost import StepFeatures, collective_seconds, step_time


def test_a_profile_is_an_immutable_value_that_round_trips():
  v3 = tg.TPU_V3
  with pytest.raises(dataclasses.FrozenInstanceError):
    v3.memory_bytes = 1  # type: ignore[misc]
  assert v3.flops('bfloat16') == 123e12 / 2  # one of a chip's two TensorCores
  assert v3.memory_bytes == 16 * 2**30
  assert tg.HardwareProfile.from_json(json.loads(json.dumps(v3.to_json()))) == v3
  assert hash(v3) == hash(dataclasses.replace(v3))


def _matmul_plan(profile):
  """x [4096, 16384] @ w [16384, 8192] on 2048 devices: each computes a [64, 16384] x
  [16384, 256] block."""
  mesh = Mesh.create((64, 32), ('X', 'Y'))
  w = tg.abstract_variable([16384, 8192], tf.float32, NamedSharding(mesh, P(None, 'Y')))

  @tf.function
  def step(x):
    return tf.reduce_sum(tf.matmul(x, w))

  spec = tf.TensorSpec([4096, 16384])
  return tg.plan(
    step, spec, mesh=mesh, in_shardings=NamedSharding(mesh, P('X', None)), profile=profile
  )


def test_a_plan_prices_its_flops_and_collectives_on_the_profile():
  slow = dataclasses.replace(tg.TPU_V3, flops_per_s=(('float32', 1e12),), link_bandwidth=1e9)
  report = _matmul_plan(slow)
  features = report.features()
  assert features.flops == 2 * 64 * 16384 * 256  # the local block's multiply-adds
  t = report.step_time()
  assert t.compute == pytest.approx(features.flops / 1e12)
  wire = sum(collective_seconds(slow, *c) for c in features.collectives)
  assert features.collectives and t.collectives == pytest.approx(wire)
  fast = dataclasses.replace(slow, flops_per_s=(('float32', 4e12),), link_bandwidth=4e9)
  faster = report.step_time(fast)
  assert faster.compute == pytest.approx(t.compute / 4)
  assert faster.collectives < t.collectives
  assert 'predicted step on' in str(report)


def _matmul_step(mesh, out_features: int):
  w = tg.abstract_variable([64, out_features], tf.float32, NamedSharding(mesh, P(None, 'model')))

  @tf.function
  def step(x):
    return tf.reduce_sum(tf.matmul(x, w))

  return step


def test_a_contractions_minor_dims_are_priced_in_full_vectors(monkeypatch):
  """A local minor dim of 4 floats costs a whole 64-byte vector (16 lanes) where the profile
  says so, in the plan's features and in auto_shard's simulator alike; one of 256 does not."""
  mesh = Mesh.create((8,), ('model',))
  lanes = dataclasses.replace(tg.TPU_V3, vector_bytes=64)
  spec = tf.TensorSpec([32, 64])
  narrow = tg.plan(_matmul_step(mesh, 32), spec, mesh=mesh, profile=lanes)
  assert narrow.features().flops == 2 * 32 * 64 * 16  # 4 output columns a device, padded
  assert narrow.features(tg.TPU_V3).flops == 2 * 32 * 64 * 4  # vector_bytes 0: as computed
  wide = tg.plan(_matmul_step(mesh, 2048), spec, mesh=mesh, profile=lanes)
  assert wide.features().flops == wide.features(tg.TPU_V3).flops == 2 * 32 * 64 * 256
  monkeypatch.setattr(constants_module, 'cpu_vector_bytes', lambda: 64)
  step = _matmul_step(mesh, 32)  # held: a function keeps only weak references to variables
  program = capture.capture(capture.trace(step, spec))
  simulator = tg.auto_shard.Simulator(program, mesh, load_constants())
  laid_out = {placeholder: P(None, 'model') for placeholder in program.variables}
  assert simulator.evaluate(laid_out, [None]).features.flops == narrow.features().flops


def test_the_simulator_prices_the_same_op_of_two_layers_once_and_alike(monkeypatch):
  """A repeated layer's op (same rule, shapes and dtypes) shares its memoized answers with
  the first layer's: fewer answers computed, every layout priced exactly as when each op
  keeps its own (a key blind to the factor sizes prices the third layer's matmul as the
  first's: caught here)."""
  mesh = Mesh.create((2, 4), ('data', 'model'))
  weights = [  # two alike, then one of other shapes: it must not take their answers
    tg.abstract_variable([64, n], tf.float32, NamedSharding(mesh, P(None, 'model')))
    for n in (64, 64, 32)
  ]

  @tf.function
  def step(x):
    for w in weights:
      x = tf.nn.relu(tf.matmul(x, w))
    return tf.reduce_sum(x)

  program = capture.capture(capture.trace(step, tf.TensorSpec([32, 64])))
  specs = [P(None, 'model'), P('model', None), P('data', 'model'), P(None, None)]

  def priced(structure):
    monkeypatch.setattr(simulate, '_structure', structure)
    simulator = tg.auto_shard.Simulator(program, mesh, load_constants())
    evaluations = [
      simulator.evaluate(dict(zip(program.variables, (a, b, b))), [arg])
      for a in specs
      for b in specs
      for arg in (None, P('data', None))
    ]
    return [(e.memory, e.features) for e in evaluations], len(simulator._cores)

  shared, answers_shared = priced(simulate._structure)
  alone, answers_alone = priced(lambda op: op.index)
  assert shared == alone
  assert answers_shared < answers_alone


@pytest.mark.parametrize('batch', [2, 8])
def test_the_simulator_holds_what_the_plan_holds_at_its_peak(batch):
  """The simulator's per-device memory is the plan's, within 1%: a weight gradient bound for
  a split weight is reduce-scattered where it is made, and the plan holds its unreduced block
  and the all-reduced block TF makes before slicing (no CPU reduce-scatter) at once (batch
  2: the peak is there); a free value (the loss gradient's broadcast) is made in its user's
  layout, not split over every device (batch 8). The simulator counted the kept slice only
  and the free value over 8 devices: under the plan, so auto_shard planned layouts the
  budget then refused."""
  mesh = Mesh.create((2, 4), ('data', 'model'))
  biases = [tf.Variable(tf.ones([64, 64]) * 0.01, name=f'b{i}') for i in range(2)]
  for b in biases:
    tg.shard_variable(b, mesh, P('data', None))

  @tf.function
  def step(x):
    with tf.GradientTape() as tape:
      y = x
      for b in biases:
        y = tf.nn.relu(y + b)
      loss = tf.reduce_sum(y)
    for b, g in zip(biases, tape.gradient(loss, biases)):
      b.assign_sub(0.1 * g)
    return loss

  spec = tf.TensorSpec([batch, 64, 64])
  program = capture.capture(capture.trace(step, spec))
  simulator = tg.auto_shard.Simulator(program, mesh, load_constants())
  priced = simulator.evaluate(dict(program.variable_shardings), [P('data', None, None)])
  planned = estimate(
    tg.plan(step, spec, mesh=mesh, in_shardings=[NamedSharding(mesh, P('data', None, None))]),
    load_constants(),
  )
  kinds = [c['kind'] for c in planned.report.collectives()]
  assert 'reduce_scatter' in kinds, kinds
  assert abs(priced.memory - planned.memory) <= 0.01 * planned.memory, (
    priced.memory,
    planned.memory,
  )


def _features(ops, flops, nbytes, collectives=(), small=0) -> StepFeatures:
  return StepFeatures(8, ops, (('float32', flops),), nbytes, collectives, small)


def test_the_fit_recovers_the_numbers_that_made_the_times():
  constants = load_constants(fit=False)
  truth = {
    'op_seconds': 2e-5,
    'core_flops': 3e10,
    'memory_bandwidth': 1e10,
    'collective_scale': 1.5,
    'step_seconds': 1e-3,
    'small_op_seconds': 3e-6,
    'part_collective_scale': 2.5,  # the groups of 4 and 2 below, on a mesh of 8
  }
  made = dataclasses.replace(constants, step_fit=truth).profile()
  cases = [
    _features(100, 1e7, 1e6, (('all_reduce', 8, 2, 1 << 20),), 40),
    _features(300, 4e8, 2e6, small=900),
    _features(50, 1e6, 6e7),
    _features(120, 2e7, 1e6, (('all_gather', 4, 1, 1 << 16),) * 8),
    _features(10, 1e5, 1e4, small=5),
    _features(80, 3e6, 2e5, small=3000),
    _features(200, 1e8, 3e7, (('reduce_scatter', 2, 1, 1 << 18),)),
  ]
  samples = [fit.Sample(str(i), f, step_time(f, made).total) for i, f in enumerate(cases)]
  fitted = fit.fit_profile(samples, constants)
  for key, value in truth.items():
    assert fitted[key] == pytest.approx(value, rel=1e-6), key


def test_the_fit_is_cached_per_cpu_and_recomputed_when_absent(tmp_path):
  path = str(tmp_path / 'fit.json')
  calls = []

  def recompute():
    calls.append(1)
    return {'fit': {'op_seconds': float(len(calls))}, 'samples': [], 'source': 'test'}

  assert fit.load_step_fit(path, key='a test CPU', recompute=recompute) == {'op_seconds': 1.0}
  assert fit.load_step_fit(path, key='a test CPU', recompute=recompute) == {'op_seconds': 1.0}
  assert len(calls) == 1  # the second came from the cache
  with open(path) as f:
    assert json.load(f)['a test CPU']['source'] == 'test'
  tmp_path.joinpath('fit.json').unlink()
  assert fit.load_step_fit(path, key='a test CPU', recompute=recompute) == {'op_seconds': 2.0}
  assert len(calls) == 2


def test_the_speed_factor_is_the_median_ratio_of_the_probe_steps_now_to_then():
  entry = {
    'samples': [
      {'name': 'mlp dp8', 'seconds': 0.020},
      {'name': 'conv dp8', 'seconds': 0.010},
      {'name': 'keras mlp dp8', 'seconds': 0.040},
    ]
  }
  # now: 1.5x, 2x and 1.2x slower; a probe the entry never measured is ignored
  now = {'mlp dp8': 0.030, 'conv dp8': 0.020, 'keras mlp dp8': 0.048, 'absent': 1.0}
  assert fit.speed_factor(entry, now) == pytest.approx(1.5)
  assert fit.speed_factor(entry, {}) == 1.0
  assert fit.speed_factor({'samples': []}, now) == 1.0


def test_every_probe_step_is_a_calibration_step_and_the_shipped_fit_measured_them():
  from tf_gspmd.auto_shard.constants import DEFAULT_FIT_FILE

  assert set(fit.PROBE) <= set(fit.CALIBRATION)
  with open(DEFAULT_FIT_FILE) as f:
    shipped = json.load(f)
  latest = max(shipped.values(), key=lambda e: len(e['samples']))
  assert set(fit.PROBE) <= {s['name'] for s in latest['samples']}
