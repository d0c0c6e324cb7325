"""Keras-level fuzzing (tf_gspmd/testing/keras_fuzz.py): a budget of random Keras models under
random keras.distribution layouts and workflows, and the generator, judge and shrinker themselves.

CI runs a fixed seed and a fixed number of models, so every run and every machine judges the
same models (a campaign picks another seed with TF_GSPMD_KERAS_FUZZ_SEED and more models with
TF_GSPMD_KERAS_FUZZ_MODELS); the seed is printed, and a failure prints its case as a pytest
test, so any failure reproduces with
`python -m tf_gspmd.testing.keras_fuzz --seed S --start I --models 1`.
"""

import dataclasses
import os
import time

import numpy as np
import pytest
import tensorflow as tf

from tf_gspmd.errors import Unsupported
from tf_gspmd.graph_rewrite import uneven
from tf_gspmd.testing import keras_fuzz

SEED = 20261128  # its model 3 is kept in test_keras_fuzz_cases.py (the judge's cancellation)
MODELS = 4  # one model takes 5-30 s
SMALL = 4  # layers per model at most: small models run fastest


def _setting(name: str, default: int) -> int:
  return int(os.environ.get(name) or default)


@pytest.fixture(autouse=True, scope='module')
def _quiet():
  keras_fuzz.quiet()


@pytest.mark.slow  # 4 Keras workflows run 3 ways or more: about 35 s
def test_fixed_budget_of_random_keras_models(capsys):
  seed = _setting('TF_GSPMD_KERAS_FUZZ_SEED', SEED)
  models = _setting('TF_GSPMD_KERAS_FUZZ_MODELS', MODELS)
  with capsys.disabled():
    print(f'\nkeras fuzz seed {seed}, {models} models (TF_GSPMD_KERAS_FUZZ_SEED sets the seed)')
  start = time.time()
  lines, failures = _judged(keras_fuzz.generate(seed, i, max_layers=SMALL) for i in range(models))
  with capsys.disabled():
    print(f'{len(lines)} models in {time.time() - start:.0f} s')
    for line in lines:
      print(' ', line)
  assert not failures, '\n'.join(lines) + '\n\ncases:\n\n' + '\n\n'.join(failures)


def _judged(cases):
  """A line per case, and the printed case of each that fails by the fuzzer's own `FAILURES`
  (a refusal, tf_gspmd's `Unsupported`, passes)."""
  lines, failures = [], []
  for case in cases:
    outcome = keras_fuzz.run(case)
    lines.append(f'{case.label()}: {outcome.status} {outcome.message[:200]}')
    if outcome.status in keras_fuzz.fuzz.FAILURES:
      failures.append(keras_fuzz.test_case(case, outcome))
  return lines, failures


def test_generator_is_deterministic_per_seed():
  first = [keras_fuzz.draft(7, i)[0] for i in range(20)]
  assert first == [keras_fuzz.draft(7, i)[0] for i in range(20)]
  assert len({keras_fuzz.render(c) for c in first}) == 20
  assert keras_fuzz.draft(8, 0)[0] != first[0]
  whole = [keras_fuzz.generate(7, i) for i in range(3)]  # the layouts drawn too
  assert whole == [keras_fuzz.generate(7, i) for i in range(3)]
  assert [keras_fuzz.render(c) for c in whole] == [
    keras_fuzz.render(keras_fuzz.generate(7, i)) for i in range(3)
  ]


def test_generator_covers_layers_meshes_and_workflows():
  cases = [keras_fuzz.draft(11, i)[0] for i in range(300)]
  kinds = {layer.kind for c in cases for layer in c.layers}
  assert kinds == set(keras_fuzz.LAYER_CLASSES), set(keras_fuzz.LAYER_CLASSES) - kinds
  assert any(layer.reuse for c in cases for layer in c.layers)  # a layer used twice
  assert {c.mesh_shape for c in cases} == {m for m, _ in keras_fuzz.MESHES}
  assert any(c.devices != tuple(range(8)) for c in cases)
  assert {step[0] for c in cases for step in c.workflow} == {
    'fit',
    'set_weights',
    'evaluate',
    'predict',
    'checkpoint',
  }
  assert {c.steps_per_execution for c in cases} == {1, 2, 3}


def test_generator_covers_layouts():
  cases = [keras_fuzz.generate(12, i) for i in range(20)]
  keys = [key for c in cases for key, _ in c.layout]
  assert any(k.endswith('/output') for k in keys) and any('(' in k for k in keys)
  splits = [_split(c, key, spec) for c in cases for key, spec in c.layout if '(' not in key]
  assert any(s == 'uneven' for s in splits) and any(s == 'smaller' for s in splits)
  assert all(keras_fuzz.is_valid(c) for c in cases)


def _split(case, key, spec) -> str:
  """'smaller' when a split dim is smaller than its shard count, 'uneven' when it does not
  divide, else 'even'."""
  if key.endswith('/output'):
    return 'even'
  shape = keras_fuzz.variable_shapes(case)[key]
  sizes = dict(zip(case.axes, case.mesh_shape))
  kinds = ['even']
  for dim, axis in zip(shape, spec):
    if axis is not None:
      kinds.append('smaller' if dim < sizes[axis] else 'uneven' if dim % sizes[axis] else 'even')
  return min(kinds, key=['smaller', 'uneven', 'even'].index)


def _tiny_case():
  case = keras_fuzz.generate(5, 0, max_layers=2)
  return dataclasses.replace(case, workflow=(('predict',),))


def test_the_judge_catches_a_wrong_partitioned_run():
  """A record moved by a block (what a missing collective does) is a mismatch; the same
  records pass."""
  build = keras_fuzz.load(keras_fuzz.render(_tiny_case()))
  want = keras_fuzz.execute(build, 'plain')
  assert keras_fuzz.compare(build, want, want) is None
  broken = [(label, _moved(value)) for label, value in want]
  why = keras_fuzz.compare(build, broken, want)
  assert why and 'predict' in why, why


def _moved(value):
  if isinstance(value, dict):
    return {k: _moved(v) for k, v in value.items()}
  value = np.array(value)
  if value.dtype.kind == 'f' and value.size:
    value.reshape(-1)[: max(1, value.size // 4)] += 1.0
  return value


def _raise(error):
  raise error


def test_refusal_crash_and_mismatch_are_told_apart():
  outcome = keras_fuzz.fuzz.outcome_of(lambda: 1, lambda: _raise(Unsupported('no')), None)
  assert outcome.status == 'refusal'
  outcome = keras_fuzz.fuzz.outcome_of(lambda: 1, lambda: _raise(ValueError('inner')), None)
  assert outcome.status == 'crash' and outcome.error_type == 'ValueError'
  outcome = keras_fuzz.fuzz.outcome_of(lambda: 1, lambda: 1, lambda got, want: 'differs')
  assert outcome.status == 'mismatch'
  outcome = keras_fuzz.fuzz.outcome_of(lambda: 1, lambda: 1 / 0, lambda got, want: None)
  assert outcome.status == 'crash' and outcome.error_type == 'ZeroDivisionError'
  outcome = keras_fuzz.fuzz.outcome_of(lambda: 1 / 0, lambda: 1, lambda got, want: None)
  assert outcome.status == 'invalid'
  outcome = keras_fuzz.fuzz.outcome_of(lambda: 1, lambda: 1, lambda got, want: '')
  assert outcome.status == 'pass' and outcome.float64


def test_a_planted_internal_value_error_fails_the_budget(monkeypatch):
  """The partitioned run raising a plain ValueError inside tf_gspmd (a handler asking for the
  identity of a reduction that has none) is a crash, which fails the budget test."""
  plain = keras_fuzz.execute

  def execute(build, mode, initial=None):
    if mode == 'partitioned':
      uneven.identity_value('median', tf.float32)
    return plain(build, mode, initial)

  monkeypatch.setattr(keras_fuzz, 'execute', execute)
  lines, failures = _judged([_tiny_case()])
  assert ': crash ValueError' in lines[0] and len(failures) == 1, lines


def test_every_failure_kind_fails_the_budget(monkeypatch):
  statuses = iter(keras_fuzz.fuzz.FAILURES + ('refusal', 'pass'))
  monkeypatch.setattr(keras_fuzz, 'run', lambda case: keras_fuzz.Outcome(next(statuses)))
  lines, failures = _judged([_tiny_case()] * (len(keras_fuzz.fuzz.FAILURES) + 2))
  assert 'nondeterministic' in keras_fuzz.fuzz.FAILURES
  assert len(failures) == len(keras_fuzz.fuzz.FAILURES), lines


def test_shrinker_keeps_the_failure_and_cuts_the_rest():
  """With a stand-in failure (any case with a layer norm 'fails'), the shrinker ends on a
  valid case that still has one and has no more than it needs."""
  case = next(
    c
    for i in range(200)
    for c in [keras_fuzz.generate(13, i)]
    if any(layer.kind == 'layernorm' for layer in c.layers) and len(c.layers) >= 4
  )

  def fails(candidate):
    return any(layer.kind == 'layernorm' for layer in candidate.layers)

  small = keras_fuzz.shrink(case, fails, budget=200)
  assert fails(small) and keras_fuzz.is_valid(small)
  assert len(small.workflow) == 1 and not small.layout
  assert len(small.layers) < len(case.layers)
