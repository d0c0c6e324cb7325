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

from tf_gspmd.testing import keras_fuzz

SEED = 20261128  # its model 3 is kept in test_keras_fuzz_cases.py (the judge's cancellation)
MODELS = 4  # one model takes 5-30 s
SMALL = 4  # layers per model at most: small models run fastest


def _setting(name: str, default: int) -> int:
  return int(os.environ.get(name) or default)


@pytest.fixture(autouse=True, scope='module')
def _quiet():
  keras_fuzz.quiet()


def test_fixed_budget_of_random_keras_models(capsys):
  seed = _setting('TF_GSPMD_KERAS_FUZZ_SEED', SEED)
  models = _setting('TF_GSPMD_KERAS_FUZZ_MODELS', MODELS)
  with capsys.disabled():
    print(f'\nkeras fuzz seed {seed}, {models} models (TF_GSPMD_KERAS_FUZZ_SEED sets the seed)')
  start, lines, failures = time.time(), [], []
  for index in range(models):
    case = keras_fuzz.generate(seed, index, max_layers=SMALL)
    outcome = keras_fuzz.run(case)
    lines.append(f'{case.label()}: {outcome.status} {outcome.message[:200]}')
    if outcome.status in ('mismatch', 'crash', 'invalid'):
      failures.append(keras_fuzz.test_case(case, outcome))
  with capsys.disabled():
    print(f'{len(lines)} models in {time.time() - start:.0f} s')
    for line in lines:
      print(' ', line)
  assert not failures, '\n'.join(lines) + '\n\ncases:\n\n' + '\n\n'.join(failures)


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


def test_refusal_crash_and_mismatch_are_told_apart():
  def refuse():
    raise keras_fuzz.fuzz.classify.__globals__['ValueError']('refused')

  outcome = keras_fuzz.fuzz.outcome_of(lambda: 1, lambda: 1, lambda got, want: 'differs')
  assert outcome.status == 'mismatch'
  outcome = keras_fuzz.fuzz.outcome_of(lambda: 1, lambda: 1 / 0, lambda got, want: None)
  assert outcome.status == 'crash' and outcome.error_type == 'ZeroDivisionError'
  outcome = keras_fuzz.fuzz.outcome_of(lambda: 1 / 0, lambda: 1, lambda got, want: None)
  assert outcome.status == 'invalid'
  outcome = keras_fuzz.fuzz.outcome_of(lambda: 1, lambda: 1, lambda got, want: '')
  assert outcome.status == 'pass' and outcome.float64


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
