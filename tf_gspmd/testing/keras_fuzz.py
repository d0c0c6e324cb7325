"""Differential fuzzing of Keras 3 models under `keras.distribution`, partitioned vs plain Keras.

The program fuzzer (`fuzz`) draws TF programs; this one draws what a Keras user writes: a
functional model of 2 to 8 layers (Dense, EinsumDense, Conv1D/Conv2D with strides and
padding, pooling, BatchNormalization, LayerNormalization, MultiHeadAttention,
GroupQueryAttention, Embedding, Dropout with a seed, residual adds, a layer called twice),
a `ModelParallel` over a 1-D, 2-D or 3-D `DeviceMesh` of the 8 devices (sometimes in another
device order) with a random `LayoutMap` (exact paths and regexes, layer '/output' entries,
dims split unevenly and dims smaller than their shard count), and a workflow (`fit` with
`steps_per_execution`, `set_weights` between fits, `evaluate`, `predict` with an uneven last
batch, a checkpoint written, trained past and restored).

A model is data (`Case`, in `keras_fuzz_model`); `render` prints it as Python (a
`build_<tag>()` returning the model function, the distribution function, the data and the
workflow) and that text is what runs (`run`), so a printed case reproduces exactly. `run`
executes the workflow on the model built under the distribution (tf_gspmd.keras.enable(),
partitioned) and on the same model built plainly (same seed: the same starting weights),
recording after every step the history, evaluation, predictions, weights, variables and
optimizer state, and compares the records by the oracle; where float32 is ill-conditioned
(BatchNorm in training, Adam's first steps) the float64 rule decides against the same workflow
run plainly in float64 from the same values (`testing.float64`). tf_gspmd's own refusal
(`tf_gspmd.errors.Unsupported`) is a refusal, any other exception a crash, a failing plain run
'invalid' (a fuzzer bug). `shrink` cuts a failing case (workflow steps, layout entries,
layers, the optimizer, device order) while it fails the same way and `test_case` prints it as
a pytest test. CLI:

  python -m tf_gspmd.testing.keras_fuzz --models N --seed S [--start I] [--out DIR] [--jobs J]
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import tempfile
import time
import warnings
from typing import Any, Callable, List, Optional, Sequence, Tuple

import numpy as np

from tf_gspmd.testing import fuzz, fuzz_pool
from tf_gspmd.testing.fuzz import Outcome, _error_text, _nudge
from tf_gspmd.testing.keras_fuzz_model import (
  BATCH,
  HEADER,
  LAYER_CLASSES,
  MESHES,
  PREDICT_SAMPLES,
  SAMPLES,
  Case,
  Layer,
  draft,
  generate,
  load,
  render,
  shapes_of,
  variable_shapes,
)

# The case as data lives in `keras_fuzz_model`; tests and printed cases read it from here.
__all__ = [
  'LAYER_CLASSES',
  'MESHES',
  'Case',
  'Layer',
  'check',
  'draft',
  'generate',
  'judge',
  'load',
  'render',
  'run',
  'shrink',
  'test_case',
  'variable_shapes',
]


# --- running a workflow ---------------------------------------------------------------------
def make_data(model, data: dict) -> Tuple[np.ndarray, np.ndarray]:
  """PREDICT_SAMPLES inputs and targets for `model` (fit and evaluate use the first SAMPLES)."""
  rng = np.random.RandomState(data['seed'])
  shape = (PREDICT_SAMPLES,) + tuple(model.input_shape[1:])
  if data['vocab']:
    x = rng.randint(0, data['vocab'], shape).astype(np.int32)
  else:
    x = rng.randn(*shape).astype(np.float32)
  y = rng.randn(PREDICT_SAMPLES, *model.output_shape[1:]).astype(np.float32)
  return x, y


def fresh_weights(model, seed: int) -> List[np.ndarray]:
  """Values for `model.set_weights` drawn from `seed` and the weights' paths and shapes only
  (the same for every run of a case); variances stay positive."""
  rng = np.random.RandomState(seed)
  values = []
  for variable in model.weights:
    shape, path = tuple(variable.shape), variable.path
    if path.endswith('moving_variance'):
      value = rng.uniform(0.5, 1.5, shape)
    elif path.endswith('gamma'):
      value = 1 + 0.1 * rng.randn(*shape)
    else:
      value = 0.3 * rng.randn(*shape)
    values.append(value.astype(np.float32))
  return values


def _state(model, floating) -> dict:
  """Every model and optimizer variable, by path (optimizer slots by place: Keras numbers
  optimizers per instance)."""
  state = {
    v.path: _cast(np.asarray(w), floating) for v, w in zip(model.weights, model.get_weights())
  }
  for i, v in enumerate(model.variables):  # seed generators' states: numbered per instance
    if v.path not in state:
      state[f'variables[{i}]'] = _cast(v.numpy(), floating)
  if model.optimizer is not None and model.optimizer.built:
    for i, v in enumerate(model.optimizer.variables):
      state[f'optimizer[{i}]'] = _cast(v.numpy(), floating)
  return state


def _cast(value, floating):
  value = np.asarray(value)
  return value.astype(floating) if value.dtype.kind == 'f' else value


class _Run:
  """One run of a workflow: a model, its data and where its checkpoints go."""

  def __init__(self, model, data, directory, floating):
    self.model = model
    self.x, self.y = make_data(model, data)
    self.directory = directory
    self.floating = floating
    self.records: List[Tuple[str, Any]] = [('built', _state(model, floating))]

  def fit(self):
    n = SAMPLES
    history = self.model.fit(
      self.x[:n], self.y[:n], batch_size=BATCH, epochs=1, shuffle=False, verbose=0
    )
    return {'loss': _cast(history.history['loss'], self.floating)}

  def step(self, k: int, step: tuple) -> None:
    kind = step[0]
    if kind == 'fit':
      result = self.fit()
    elif kind == 'set_weights':
      values = fresh_weights(self.model, step[1])
      self.model.set_weights([v.astype(self.floating) for v in values])
      result = {}
    elif kind == 'evaluate':
      loss = self.model.evaluate(self.x[:SAMPLES], self.y[:SAMPLES], batch_size=BATCH, verbose=0)
      result = {'loss': _cast(loss, self.floating)}
    elif kind == 'predict':
      result = {'predict': self.model.predict(self.x, batch_size=BATCH, verbose=0)}
    else:
      result = self.checkpoint(k)
    result['state'] = _state(self.model, self.floating)
    self.records.append((f'{k}:{kind}', result))

  def checkpoint(self, k: int) -> dict:
    """Write a checkpoint, fit past it, restore it: the restored values are what is left."""
    import tensorflow as tf

    checkpoint = tf.train.Checkpoint(model=self.model, optimizer=self.model.optimizer)
    path = checkpoint.write(os.path.join(self.directory, f'ckpt{k}'))
    moved = self.fit()
    tf.train.Checkpoint(model=self.model, optimizer=self.model.optimizer).read(
      path
    ).assert_consumed()
    return {'fit past the checkpoint': moved}


def execute(build, mode: str, initial: Optional[List[np.ndarray]] = None):
  """The workflow's records run `mode`: 'partitioned' (under the case's distribution),
  'plain', 'jit' (plain, compiled by XLA on one device) or 'float64' (plain, in float64);
  a plain run starts from `initial` (values for the plain build's variables) when given."""
  import keras

  from tf_gspmd import keras as tg_keras
  from tf_gspmd.testing.float64 import float64_policy

  model_fn, distribution_fn, data, workflow = build()
  floating = np.float64 if mode == 'float64' else np.float32
  with tempfile.TemporaryDirectory() as directory:
    if mode == 'partitioned':
      tg_keras.enable()
      try:
        distribution = distribution_fn()
        with distribution.scope():
          model = model_fn()
          records = _steps(model, data, workflow, directory, floating)
        _check_layouts(model, distribution, tg_keras.shard_layouts(model))
        return records
      finally:
        keras.distribution.set_distribution(None)
        tg_keras.disable()
    if mode in ('plain', 'jit'):
      model = _assigned(model_fn(jit_compile=mode == 'jit'), initial)
      return _steps(model, data, workflow, directory, floating)
    with float64_policy():
      return _steps(_assigned(model_fn(), initial), data, workflow, directory, floating)


def _assigned(model, initial: Optional[List[np.ndarray]]):
  for variable, value in zip(model.variables, initial or ()):
    variable.assign(np.asarray(value, variable.dtype))
  return model


def _check_layouts(model, distribution, held) -> None:
  """Each model variable's shards are split as its layout says: a layout quietly dropped
  (the variable replicated) would still give the plain results."""
  for variable in model.variables:
    if variable.path not in held:
      continue
    want = tuple(distribution.get_variable_layout(variable).axes)
    got = tuple(held[variable.path][0])
    if got != want:
      raise AssertionError(
        f'{variable.path} {tuple(variable.shape)}: its layout is {want}, its shards are {got}'
      )


def _steps(model, data, workflow, directory, floating):
  run = _Run(model, data, directory, floating)
  for k, step in enumerate(workflow):
    run.step(k, step)
  return run.records


def _initial(build) -> List[np.ndarray]:
  model_fn = build()[0]
  return [v.numpy() for v in model_fn().variables]


# --- judging --------------------------------------------------------------------------------
def _records_tree(records) -> dict:
  return {label: value for label, value in records}


def compare(build, got, want) -> Optional[str]:
  """None when the partitioned records are the plain ones by the oracle; '' when they pass
  only by the float64 rule; else why not."""
  from tf_gspmd.testing.oracle import assert_close

  got, want = _records_tree(got), _records_tree(want)
  try:
    assert_close(got, want, 'workflow')
    return None
  except AssertionError as error:
    first = str(error)
  exact = _records_tree(execute(build, 'float64', _initial(build)))
  why = fuzz.by_witnesses(got, want, exact, _witnesses(build))
  return '' if not why else f'{first}\n{why}'


def _witnesses(build):
  """More float32 runs of the plain model, as the program fuzzer takes (fuzz.compare), made
  one at a time: compiled by XLA (other summation orders), then from starting weights
  rounded to float32 other ways (`fuzz._nudge`: up to `fuzz.nudge_ulps(k)` units in the last
  place)."""
  try:
    yield _records_tree(execute(build, 'jit'))
  except Exception:  # noqa: BLE001  (an op XLA cannot compile: no witness)
    yield None
  initial = _initial(build)
  for k in range(fuzz.NUDGED_WITNESSES):
    rng = np.random.RandomState(k)
    ulps = fuzz.nudge_ulps(k)
    nudged = [_nudge(v, rng, ulps) if v.dtype.kind == 'f' else v for v in initial]
    yield _records_tree(execute(build, 'plain', nudged))


def judge(build) -> Outcome:
  """Run `build`'s case plainly and partitioned and say how it went."""
  return fuzz.outcome_of(
    lambda: execute(build, 'plain'),
    lambda: execute(build, 'partitioned'),
    lambda got, want: _compare_or_say(build, got, want),
  )


def _compare_or_say(build, got, want) -> Optional[str]:
  try:
    return compare(build, got, want)
  except Exception as error:  # noqa: BLE001  (the float64 or XLA run itself failed)
    return f'the float64 run failed: {_error_text(error)}'


def run(case: Case) -> Outcome:
  return judge(load(render(case)))


def check(build) -> None:
  """For tests: raise unless `build`'s case runs partitioned as it runs plainly."""
  want = execute(build, 'plain')
  why = compare(build, execute(build, 'partitioned'), want)
  if why:
    raise AssertionError(why)


# --- shrinking ------------------------------------------------------------------------------
def shrink(
  case: Case,
  fails: Callable[[Case], bool],
  budget: int = 60,
  log: Callable[[str], None] = lambda _: None,
  seconds: float = math.inf,
) -> Case:
  """The smallest case found (greedily) that still `fails` (the program fuzzer's shrinker on
  this fuzzer's `candidates`)."""
  return fuzz.shrink(case, fails, budget, log, seconds, candidates, is_valid)


def candidates(case: Case):
  """Smaller cases, the biggest cuts first."""
  for k in range(len(case.workflow) - 1, 0, -1):
    yield dataclasses.replace(case, workflow=case.workflow[:k])
  for k in range(len(case.workflow)):
    if len(case.workflow) > 1:
      yield dataclasses.replace(case, workflow=case.workflow[:k] + case.workflow[k + 1 :])
  for k in range(len(case.layout)):
    yield dataclasses.replace(case, layout=case.layout[:k] + case.layout[k + 1 :])
  for layer in reversed(case.layers[:-1]):
    for source in layer.inputs:
      yield _bypass(case, layer, source)
  if case.steps_per_execution > 1:
    yield dataclasses.replace(case, steps_per_execution=1)
  if case.optimizer != 'sgd':
    yield dataclasses.replace(case, optimizer='sgd')
  if case.devices != tuple(range(8)):
    yield dataclasses.replace(case, devices=tuple(range(8)))


def _bypass(case: Case, layer: Layer, source: str) -> Case:
  """`layer` removed, its readers reading `source` instead (valid when the shapes agree);
  its layout entries go with it."""
  layers = tuple(
    dataclasses.replace(x, inputs=tuple(source if n == layer.name else n for n in x.inputs))
    for x in case.layers
    if x is not layer and x.reuse != layer.name
  )
  layout = tuple((k, v) for k, v in case.layout if k.split('/')[0] != layer.name)
  output = source if case.output == layer.name else case.output
  return dataclasses.replace(case, layers=layers, layout=layout, output=output)


def is_valid(case: Case) -> bool:
  """Every layer's input exists with a shape it takes, and every layout names a variable or
  layer output of the rank it gives."""
  try:
    shapes = shapes_of(case)
  except (KeyError, IndexError, TypeError):
    return False
  names = {layer.name for layer in case.layers if not layer.reuse}
  if any(layer.reuse and layer.reuse not in names for layer in case.layers):
    return False
  if any(min(s) < 1 for s in shapes.values()):
    return False
  try:
    variables = variable_shapes(case)
  except Exception:  # noqa: BLE001  (Keras refuses the model: a shape a layer cannot take)
    return False
  for key, spec in case.layout:
    if key.endswith('/output'):
      layer = key.split('/')[0]
      if layer not in shapes or len(shapes[layer]) + 1 != len(spec):
        return False
    elif '(' not in key and (key not in variables or len(variables[key]) != len(spec)):
      return False
  return True


def failing_like(outcome: Outcome) -> Callable[[Case], bool]:
  def fails(candidate: Case) -> bool:
    return run(candidate).same_failure(outcome)

  return fails


def test_case(case: Case, outcome: Outcome) -> str:
  """A pytest module reproducing `case`'s failure."""
  tag = f'{case.seed}_{case.index}'
  why = '\n'.join(outcome.message.splitlines()[:2]) if outcome.message else outcome.status
  return (
    f'"""Shrunk by tf_gspmd.testing.keras_fuzz (seed {case.seed}, model {case.index}): '
    f'{outcome.status}.\n\n{why}\n"""\n'
    + HEADER
    + '\n\n'
    + render(case, f'build_{tag}')
    + f'\n\ndef test_keras_fuzz_{tag}():\n  keras_fuzz.check(build_{tag})\n'
  )


# --- the campaign ---------------------------------------------------------------------------
class Tally(fuzz.Tally):
  """The program fuzzer's tally (its `programs` are models here), in the Keras fuzzer's words."""

  def line(self, seconds: float) -> str:
    c = self.counts
    return (
      f'models run {self.programs}, passed {c["pass"]} (float64 rule {c["float64"]}), '
      f'mismatches {c["mismatch"]}, crashes {c["crash"]}, refusals {c["refusal"]}, '
      f'invalid {c["invalid"]}; {seconds:.1f} s ({self.programs / max(seconds, 1e-9):.3f} models/s)'
    )


def campaign(
  seed: int,
  models: int,
  start: int = 0,
  out: str = '',
  shrink_budget: int = 40,
  shrink_seconds: float = 600,
  echo=print,
  max_layers: int = 7,
  jobs: int = 1,
  prepare_here: bool = False,
) -> Tally:
  """Run models start..start+models-1 of `seed`; shrink and write each failure (with `jobs`
  > 1 on this process and `jobs` - 1 workers: `fuzz.judge_all`; `prepare_here` as there)."""
  tally = Tally()
  began = time.time()
  args = (seed, max_layers, (shrink_budget, shrink_seconds))
  label_of = lambda index: generate(seed, index, max_layers).label()  # noqa: E731
  indices = range(start, start + models)
  prepare = _prepare, prepare_here
  fuzz.judge_all(indices, judge_model, args, jobs, prepare, label_of, tally, out, echo)
  seconds = time.time() - began
  echo(tally.line(seconds))
  for reason, n in tally.refusals.most_common():
    echo(f'  refusal x{n}: {reason}')
  echo(tally.table(seconds, jobs, 'models'))
  return tally


def judge_model(index, seed, max_layers, limits, emit) -> bool:
  """Run model `index` of `seed`, shrinking a failure within `limits` (candidates, seconds);
  events go to `emit` (as the program fuzzer's `judge_program`). True when a collective
  failed."""
  case = generate(seed, index, max_layers)
  outcome = run(case)
  emit(('record', case.label(), 'tf', outcome, False))  # the program fuzzer's counts and line
  if outcome.poisoned:
    return True
  if outcome.status in fuzz.FAILURES:
    small = case
    if outcome.status != 'invalid' and limits[0]:
      log = lambda s: emit(('log', s))  # noqa: E731
      small = shrink(case, failing_like(outcome), limits[0], log, limits[1])
    emit(('case', f'test_keras_fuzz_case_{case.seed}_{case.index}.py', test_case(small, outcome)))
  return False


def _prepare() -> None:
  """A campaign's process, before its first model (see `fuzz._prepare`)."""
  os.environ.setdefault('KERAS_BACKEND', 'tensorflow')
  from tf_gspmd.testing.op_sweep import configure_devices
  from tf_gspmd.tf_private import iterators_without_autotuning

  configure_devices(8)
  quiet()
  iterators_without_autotuning()  # an iterator's end waited for autotuning's sleep
  import keras  # noqa: F401  (imported before the freeze, so that it is frozen too)

  import tf_gspmd.keras  # noqa: F401

  fuzz_pool.quiet_collector()


def quiet() -> None:
  """The warnings every fuzz model would print (Keras' and tf_gspmd's notes on ops without
  rules), off: the campaign's lines are its verdicts."""
  warnings.filterwarnings('ignore', message='tf_gspmd propagation: no sharding rule')
  warnings.filterwarnings('ignore', module='keras')
  import absl.logging

  absl.logging.set_verbosity(absl.logging.ERROR)


def main(argv: Optional[Sequence[str]] = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--models', type=int, default=50)
  parser.add_argument('--seed', type=int, default=0)
  parser.add_argument('--start', type=int, default=0, help='first model index (to resume)')
  parser.add_argument('--out', default='', help='directory for shrunk test cases')
  parser.add_argument('--shrink-budget', type=int, default=40, help='candidates per failure')
  parser.add_argument('--shrink-seconds', type=float, default=600, help='time per failure')
  parser.add_argument('--max-layers', type=int, default=7)
  parser.add_argument('--jobs', type=int, default=1, help='worker processes (one per core)')
  args = parser.parse_args(argv)
  # This process judges too (with --jobs J, J - 1 workers): configured by the campaign once
  # its workers have started (forked before TF's runtime starts here, with Keras imported:
  # importing it starts no TF runtime, and a forked worker then need not import it again).
  os.environ.setdefault('KERAS_BACKEND', 'tensorflow')
  import keras  # noqa: F401

  import tf_gspmd.keras  # noqa: F401

  tally = campaign(
    args.seed,
    args.models,
    args.start,
    args.out,
    args.shrink_budget,
    args.shrink_seconds,
    echo=lambda s: print(s, flush=True),
    max_layers=args.max_layers,
    jobs=args.jobs,
    prepare_here=True,
  )
  return 1 if any(tally.counts[s] for s in fuzz.FAILURES) else 0


if __name__ == '__main__':
  os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
  # The module's own copy (not __main__'s): what worker processes unpickle is its functions.
  from tf_gspmd.testing import keras_fuzz

  sys.exit(keras_fuzz.main())
