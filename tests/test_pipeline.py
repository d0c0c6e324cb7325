"""GSPMD pipelining (`tg.pipeline`): stacked stages over a mesh axis, activations shifted by a
collective-permute each iteration, against the same stages run in sequence unpartitioned.

Each training step (forward, GradientTape gradients, an Adam update whose moments live in
variables) runs partitioned twice and is compared with the sequential unpartitioned step by
the oracle (tf_gspmd.testing): losses, weights and Adam moments. Collectives are counted (one
permute per iteration per direction, no all-gather), and per-device weight and optimizer
bytes are 1/S of the total.
"""

import collections
import re

import pytest
import tensorflow as tf

import tf_gspmd as tg
from tf_gspmd.testing import assert_close

from helpers import randn, run_python


def dense_stage(p, h):
  return tf.tanh(tf.matmul(h, p['w']) + p['b'])


def megatron_stage(p, h):
  return h + tf.matmul(tf.nn.relu(tf.matmul(h, p['w1'])), p['w2'])


def adam_step(variables, grads, moments, t, lr=0.05):
  for v, g, (m, s) in zip(variables, grads, moments):
    m.assign(0.9 * m + 0.1 * g)
    s.assign(0.999 * s + 0.001 * g * g)
    v.assign_sub(lr * (m / (1 - 0.9**t)) / (tf.sqrt(s / (1 - 0.999**t)) + 1e-7))


def build(stage_fn, params, mesh, microbatches, piped, batch_spec):
  names = sorted(params)
  variables = [tf.Variable(params[n], name=n) for n in names]
  moments = [
    (tf.Variable(tf.zeros_like(v), name=f'{n}_m'), tf.Variable(tf.zeros_like(v), name=f'{n}_s'))
    for n, v in zip(names, variables)
  ]
  stages = params[names[0]].shape[0]

  @tf.function
  def step(x, y, t):
    x = tg.shard(x, mesh, batch_spec)
    with tf.GradientTape() as tape:
      stacked = dict(zip(names, variables))
      if piped:
        h = tg.pipeline(stage_fn, stacked, x, mesh, num_microbatches=microbatches)
      else:
        h = x
        for s in range(stages):
          h = stage_fn({n: v[s] for n, v in stacked.items()}, h)
      loss = tf.reduce_mean(tf.square(h - y))
    grads = tape.gradient(loss, variables)
    adam_step(variables, grads, moments, t)
    return loss

  return step, variables, moments


def run_both(stage_fn, params, specs, mesh, microbatches, x, y, batch_spec):
  step, variables, moments = build(stage_fn, params, mesh, microbatches, True, batch_spec)
  for v in variables:
    tg.shard_variable(v, mesh, specs[v.name.split(':')[0]])
  ref, ref_variables, ref_moments = build(stage_fn, params, mesh, microbatches, False, batch_spec)
  pf = tg.partition(step, mesh)
  for t in (1.0, 2.0):
    assert_close(pf(x, y, t), ref(x, y, t), name=f'loss at step {t:g}')
  assert_close(variables, ref_variables, name='weights')
  assert_close(moments, ref_moments, name='adam moments')
  return pf, variables, moments


def counts(pf):
  return collections.Counter((c['kind'], tuple(c['axes'])) for c in pf.collectives())


@pytest.mark.slow  # a model-level pipeline: 13 s
def test_four_stages_with_data_parallelism_and_eight_microbatches():
  mesh = tg.Mesh.create((4, 2), ('stage', 'data'))
  stages, d, batch, microbatches = 4, 16, 32, 8
  params = {'w': randn(0, stages, d, d, scale=0.3), 'b': randn(1, stages, d, scale=0.1)}
  specs = {'w': tg.P('stage', None, None), 'b': tg.P('stage', None)}
  x, y = randn(2, batch, d), randn(3, batch, d)
  pf, variables, moments = run_both(
    dense_stage, params, specs, mesh, microbatches, x, y, tg.P('data', None)
  )
  got = counts(pf)
  iterations = microbatches + stages - 1
  # The activation shift: a permute after every iteration but the last, and its gradient back.
  assert got[('permute', ('stage',))] == 2 * (iterations - 1)
  assert not [k for k in got if k[0] == 'all_gather'], got
  assert got[('all_reduce', ('stage',))] == 1  # the last stage's outputs, once
  sizes = pf.variable_bytes()
  for v, (m, s) in zip(variables, moments):
    for held in (v, m, s):
      entry = sizes[held.name]
      assert entry['per_device'] * stages == entry['total'], (held.name, entry)


def test_two_stages_with_megatron_inside_each_stage():
  mesh = tg.Mesh.create((2, 4), ('stage', 'model'))
  stages, d, ff, batch, microbatches = 2, 8, 32, 16, 4
  params = {'w1': randn(4, stages, d, ff, scale=0.3), 'w2': randn(5, stages, ff, d, scale=0.3)}
  specs = {'w1': tg.P('stage', None, 'model'), 'w2': tg.P('stage', 'model', None)}
  x, y = randn(6, batch, d), randn(7, batch, d)
  pf, variables, moments = run_both(
    megatron_stage, params, specs, mesh, microbatches, x, y, tg.P(None, None)
  )
  got = counts(pf)
  iterations = microbatches + stages - 1
  assert got[('permute', ('stage',))] == 2 * (iterations - 1)
  assert not [k for k in got if k[0] == 'all_gather'], got
  assert got[('all_reduce', ('model',))] >= iterations  # the row-parallel matmul of each stage
  sizes = pf.variable_bytes()
  for held in variables + [m for pair in moments for m in pair]:
    entry = sizes[held.name]
    assert entry['per_device'] * stages * 4 == entry['total'], (held.name, entry)


def test_bubble_fraction():
  assert tg.pipeline_bubble_fraction(4, 8) == pytest.approx(3 / 11)
  assert tg.pipeline_bubble_fraction(1, 5) == 0.0


@pytest.mark.parametrize(
  'shape, microbatches, match',
  [((3, 4, 4), 2, 'leading dim of 4'), ((4, 4, 4), 3, 'not divisible into 3 microbatches')],
)
def test_bad_calls_name_what_is_wrong(shape, microbatches, match):
  mesh = tg.Mesh.create((4, 2), ('stage', 'data'))
  with pytest.raises(ValueError, match=match):
    tg.pipeline(
      lambda w, h: tf.matmul(h, w),
      tf.zeros(shape),
      tf.zeros([8, 4]),
      mesh,
      num_microbatches=microbatches,
    )
  with pytest.raises(ValueError, match="stage_axis 'pipe'"):
    tg.pipeline(lambda w, h: h, tf.zeros([4, 2]), tf.zeros([8, 4]), mesh, stage_axis='pipe')


ROOT = __import__('pathlib').Path(__file__).resolve().parent.parent


def _run(script, timeout=300):
  return run_python(script, timeout)


@pytest.mark.slow  # a page or a fresh interpreter: `make test` runs it, the edit loop not
def test_readme_pipeline_section_runs(tmp_path):
  import re

  section = (ROOT / 'docs' / 'pipeline.md').read_text()
  (block,) = re.findall(r'```python\n(.*?)```', section, re.S)
  script = tmp_path / 'readme_pipeline.py'
  script.write_text(block)
  result = _run(script)
  assert result.returncode == 0, result.stderr[-3000:]
  lines = result.stdout.splitlines()
  assert float(lines[0]) > 0
  kinds = eval(lines[1])
  assert kinds == [
    ('all_reduce', ('data',)),
    ('all_reduce', ('stage',)),
    ('permute', ('stage',)),
  ], kinds
  assert lines[2].startswith('0.2727')


@pytest.mark.slow
def test_pipeline_example_matches_sequential():
  result = _run(ROOT / 'examples' / 'pipeline.py')
  assert result.returncode == 0, result.stderr[-3000:]
  out = result.stdout
  error = float(re.search(r'max relative error vs unpartitioned: (\S+)', out).group(1))
  assert error <= 1e-5, out
  assert 'permute over stage: 20' in out.replace("'", '').replace('{', ' ').replace(',', ''), out
  for line in out.splitlines():
    if 'per device' in line:
      per, total = map(int, re.findall(r'(\d+) of (\d+)', line)[0])
      assert per * 4 == total, line


@pytest.mark.slow  # a pipeline at three microbatch counts (make test runs it)
def test_activation_memory_per_device_does_not_grow_with_microbatches():
  # The same batch in 4, 8 or 16 microbatches: each device holds one stage's activations of
  # the microbatches in flight (the bubble included), about (M+S-1)/M / (S*data) of what
  # one device holds running the sequential step whole; and the weight gradients are summed
  # as they arrive, not kept per iteration. Measured by the planner's liveness pass over the
  # per-device program (tg.plan: the program tg.partition builds).
  import sys

  from tf_gspmd.planning import activation_peak

  sys.path.insert(0, str(ROOT / 'examples'))
  import pipeline as example

  x = tf.TensorSpec([example.BATCH, example.WIDTH])
  peaks = {}
  for microbatches in (4, 16):
    example.MICROBATCHES = microbatches
    piped, _, _ = example.make_step(piped=True)
    peaks[microbatches] = tg.plan(piped, x, x, mesh=example.mesh).activation_peak
  sequential, _, _ = example.make_step(piped=False)
  whole = activation_peak(sequential.get_concrete_function(x, x).graph)[0]
  assert peaks[16] <= peaks[4], peaks
  assert max(peaks.values()) <= 0.25 * whole, (peaks, whole)  # S * data = 8 devices
