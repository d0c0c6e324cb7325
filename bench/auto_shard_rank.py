"""Does auto_shard's cost model order layouts as the clock does? Spearman over measured steps.

For each layout of two models on a (data=2, model=4) mesh of 8 logical CPUs:
  predicted  `tf_gspmd.auto_shard.estimate` of the step planned with `tg.plan`: its features
             (ops, contraction flops, elementwise bytes, collectives) priced on this CPU's
             profile -- the measured collectives' table, and the step model fit by
             `tf_gspmd.auto_shard.fit` to steps of OTHER models measured on this CPU (an MLP,
             an attention block, a conv stack): these two models are a held-out check;
  measured   the same Keras training step under `tg.partition` on fresh weights: the
             median of --steps steps after --warmup, every layout built first and the
             steps then taken round-robin (load from other processes hits all alike).
Models (bench/models.py): the transformer (examples/keras/transformer.py, Adam) and the
CNN (Conv2D/BatchNorm/ReLU/MaxPool blocks, GAP, Dense; Adam). Layouts: data parallel
over 8 or over 'data' alone, Megatron with and without the batch split, 2-D and ZeRO-like
weight splits, replicated steps, and for the CNN output- or input-channel splits.

Prints the fit used (and its error on its own calibration steps), one row per layout
(predicted ms, measured ms, predicted/measured), the predicted order against the measured
order, Spearman's rank correlation per model and over all layouts (numpy: Pearson of the
ranks, ties averaged) and the range of predicted/measured; without --refit also the clock's
agreement with itself (Spearman between the medians of the odd and of the even rounds, per
model: where layouts differ by less than the noise, no model can rank them better than
that). The timings share the machine
with whatever else runs on it: say so when quoting them. The machine's speed itself moves
between hours (a shared virtual machine: the same step 1.8x slower in one hour than in
another), so the calibration steps of `fit.PROBE` are timed in the same rounds as the
layouts, and each layout is also priced "at this speed": the fit's time times the median
ratio of those steps' seconds now to their calibrated seconds (`fit.speed_factor`;
`--no-probe` skips it); predicted/measured is then taken at this speed. `--refit` measures the
calibration steps again (`fit.calibrate_steps`) in the same rounds as the layouts (so
under the same load), fits on them alone and caches the fit for this CPU; `--save PATH`
writes each layout's features and times as JSON.

The process splits the CPU with `tg.configure_cpu_devices(8, threads=T)` (--tf-threads, 1 by
default: TF's pools at one thread each, as this Intel CPU's shipped calibration was
measured; with TF's default pools the clock ordered the same
layouts against itself at 0.42-0.83 in one session, at 0.71-0.99 with one thread).

  .venv/bin/python bench/auto_shard_rank.py [--steps 9] [--warmup 2] [--quick] [--refit]
      [--tf-threads 1]
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [ROOT, HERE, os.path.join(ROOT, 'examples', 'keras')]

import numpy as np  # noqa: E402

TRANSFORMER = dict(layers=2, vocab=128, seq=16, d_model=64, heads=4, ff=256)
TRANSFORMER_BATCH = 32
CNN = dict(image=16, channels=3, filters=[16, 32], classes=10)
CNN_BATCH = 32
DM = ('data', 'model')

# name -> (input batch axes, {variable regex: spec}); specs are tuples of axes per dim.
TRANSFORMER_LAYOUTS = {
  'dp8': (DM, {}),
  'dp2': ('data', {}),
  'replicated': (None, {}),
  'megatron+data': ('data', 'megatron'),
  'megatron': (None, 'megatron'),
  'megatron ffn+data': (
    'data',
    {r'.*ffn_in_\d+/kernel': (None, 'model'), r'.*ffn_out_\d+/kernel': ('model', None)},
  ),
  'ffn over 8': (None, {r'.*ffn_in_\d+/kernel': (None, DM), r'.*ffn_out_\d+/kernel': (DM, None)}),
  'zero8': (
    DM,
    {
      r'.*(ffn_in_\d+|head)/kernel': (DM, None),
      r'.*ffn_out_\d+/kernel': (DM, None),
      r'.*(query|key|value)/kernel': (DM, None, None),
      r'.*embed.*': (DM, None),
    },
  ),
  '2d': (
    'data',
    {
      r'.*ffn_in_\d+/kernel': ('data', 'model'),
      r'.*ffn_out_\d+/kernel': ('model', 'data'),
      r'.*(query|key|value)/kernel': ('data', 'model', None),
      r'.*attention_output/kernel': ('model', None, 'data'),
    },
  ),
  'megatron+data, vocab split': ('data', 'megatron+embed'),
}
CNN_LAYOUTS = {
  'dp8': (DM, {}),
  'dp2': ('data', {}),
  'replicated': (None, {}),
  'channels out+data': (
    'data',
    {r'.*conv_\d+/kernel': (None, None, None, 'model'), r'.*head/kernel': ('model', None)},
  ),
  'channels in+data': ('data', {r'.*conv_1/kernel': (None, None, 'model', None)}),
  'channels out': (None, {r'.*conv_\d+/kernel': (None, None, None, 'model')}),
}
QUICK = {'transformer': ['dp8', 'megatron+data'], 'cnn': ['dp8', 'replicated']}


def spearman(a, b) -> float:
  """Spearman's rank correlation: Pearson's correlation of the ranks (ties get mean ranks)."""
  ra, rb = _ranks(np.asarray(a, float)), _ranks(np.asarray(b, float))
  ra, rb = ra - ra.mean(), rb - rb.mean()
  return float((ra * rb).sum() / np.sqrt((ra * ra).sum() * (rb * rb).sum()))


def _ranks(x: np.ndarray) -> np.ndarray:
  order = np.argsort(x, kind='stable')
  ranks = np.empty(len(x))
  ranks[order] = np.arange(1, len(x) + 1)
  for value in np.unique(x):
    tied = x == value
    ranks[tied] = ranks[tied].mean()
  return ranks


# --- models and their steps ----------------------------------------------------------------------
def _transformer(mesh, rules, seed=0):
  import tensorflow as tf
  import transformer

  import tf_gspmd as tg

  model, optimizer = transformer.build(seed=seed, **TRANSFORMER)
  layout = (
    transformer.layout(mesh) if rules in ('megatron', 'megatron+embed') else tg.LayoutMap(mesh)
  )
  if rules == 'megatron+embed':
    layout[r'.*embed/embeddings'] = tg.P('model', None)
  for pattern, spec in ({} if isinstance(rules, str) else rules).items():
    layout[pattern] = tg.P(*spec)
  layout.apply(model)
  step = transformer.train_step(model, optimizer)
  rng = np.random.RandomState(0)
  tokens = rng.randint(0, TRANSFORMER['vocab'], (TRANSFORMER_BATCH, TRANSFORMER['seq']))
  labels = rng.randint(0, TRANSFORMER['vocab'], (TRANSFORMER_BATCH,))
  data = (tokens.astype(np.int32), labels.astype(np.int32))
  return step, data, [tf.TensorSpec(d.shape, tf.int32) for d in data]


def _cnn(mesh, rules, seed=0):
  import models
  import tensorflow as tf

  import tf_gspmd as tg

  model, optimizer = models.keras_cnn(
    seed, CNN['image'], CNN['channels'], CNN['filters'], CNN['classes']
  )
  layout = tg.LayoutMap(mesh)
  for pattern, spec in rules.items():
    layout[pattern] = tg.P(*spec)
  layout.apply(model)
  step = models.keras_train_step(model, optimizer)
  rng = np.random.RandomState(0)
  images = rng.randn(CNN_BATCH, CNN['image'], CNN['image'], CNN['channels']).astype(np.float32)
  labels = rng.randint(0, CNN['classes'], (CNN_BATCH,)).astype(np.int32)
  return (
    step,
    (images, labels),
    [tf.TensorSpec(images.shape), tf.TensorSpec(labels.shape, tf.int32)],
  )


def _input_shardings(mesh, axes, specs):
  import tf_gspmd as tg

  return [tg.NamedSharding(mesh, tg.P(axes, *([None] * (len(s.shape) - 1)))) for s in specs]


def prepare(build, mesh, axes, rules, warmup: int) -> tuple:
  """(the planned step's `Evaluation`, a callable running one step) of one layout, built and
  warmed up."""
  import tf_gspmd as tg

  auto = importlib.import_module('tf_gspmd.auto_shard')
  step, data, specs = build(mesh, rules)
  shardings = _input_shardings(mesh, axes, specs)
  predicted = auto.estimate(tg.plan(step, *specs, mesh=mesh, in_shardings=shardings))
  step, data, specs = build(mesh, rules)  # fresh weights for the run
  partitioned = tg.partition(step, mesh, in_shardings=shardings, progress=False)
  run = lambda: float(partitioned(*data))  # noqa: E731
  for _ in range(1 + warmup):
    run()
  return predicted, run


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--steps', type=int, default=9)
  parser.add_argument('--warmup', type=int, default=2)
  parser.add_argument('--quick', action='store_true', help='two layouts per model, 2 steps')
  parser.add_argument('--refit', action='store_true', help='measure the calibration steps again')
  parser.add_argument('--save', help='write features and times of each layout to this JSON')
  parser.add_argument(
    '--no-probe',
    dest='probe',
    action='store_false',
    help="don't time the probe calibration steps (the machine's speed now) beside the layouts",
  )
  parser.add_argument(
    '--tf-threads',
    default='1',
    help="TF's inter-op and intra-op threads (tg.configure_cpu_devices' threads, 1 as the "
    "shipped calibration of this Intel CPU was measured); 'default': TF's own pools",
  )
  args = parser.parse_args(argv)
  if args.quick:
    args.steps, args.warmup = 2, 1
  from tf_gspmd.runtime.cpu_devices import configure_cpu_devices

  configure_cpu_devices(8, threads=None if args.tf_threads == 'default' else int(args.tf_threads))
  import tf_gspmd as tg
  from tf_gspmd.auto_shard import fit
  from tf_gspmd.auto_shard.constants import step_fit_entry
  from tf_gspmd.step_cost import step_time

  mesh = tg.Mesh.create((2, 4), DM)
  labels, predicted, runs = [], [], []
  for model, build, layouts in (
    ('transformer', _transformer, TRANSFORMER_LAYOUTS),
    ('cnn', _cnn, CNN_LAYOUTS),
  ):
    for name in QUICK[model] if args.quick else list(layouts):
      axes, rules = layouts[name]
      evaluation, run = prepare(build, mesh, axes, rules, args.warmup)
      labels.append((model, name))
      predicted.append(evaluation)
      runs.append(run)
  factor = 1.0
  if args.refit:  # the calibration steps timed in the same rounds as the layouts: same load
    times = fit.calibrate_steps(steps=args.steps, also=runs)['also']
    halves = None
  else:
    entry = (step_fit_entry() or {}) if args.probe else {}
    probes = fit.probe_runs(mesh, entry) if entry else []
    rounds = fit.timed_rounds(runs + [run for _, run in probes], args.steps)
    rounds, probed = rounds[: len(runs)], rounds[len(runs) :]
    times = [float(np.median(t)) for t in rounds]
    # the clock against itself: the medians of the odd and of the even rounds
    halves = [[float(np.median(t[k::2])) for t in rounds] for k in (0, 1)]
    now = {name: float(np.median(t)) for (name, _), t in zip(probes, probed)}
    factor = fit.speed_factor(entry, now)
  profile = _print_fit()
  if factor != 1.0:
    print(
      f'the machine now: the calibration steps {", ".join(now)} take {factor:.2f}x their '
      f'calibrated time ({_ratios(entry, now)}); "at this speed" is the fit times {factor:.2f}'
    )
  rows, saved = [], []
  for (model, name), evaluation, measured in zip(labels, predicted, times):
    fitted = step_time(evaluation.features, profile).total
    cost = fitted * factor
    rows.append((model, name, cost, measured))
    saved.append(fit.Sample(f'{model}:{name}', evaluation.features, measured).to_json())
    print(
      f'{model:<12}{name:<28}predicted {fitted * 1e3:8.2f} ms'
      + (f', at this speed {cost * 1e3:8.2f} ms' if factor != 1.0 else '')
      + f'   measured {measured * 1e3:8.2f} ms   predicted/measured {cost / measured:5.2f}',
      flush=True,
    )
  _print_orders(rows)
  if halves is not None and args.steps >= 4:
    _print_self_agreement(labels, halves)
  if args.save:
    with open(args.save, 'w') as f:
      json.dump(saved, f, indent=1)
  return 0


def _print_fit():
  """This CPU's profile (the step model in use); prints it and how well it predicts its own
  calibration steps."""
  from tf_gspmd.auto_shard import fit
  from tf_gspmd.auto_shard.constants import cpu_key, load_constants, step_fit_entry
  from tf_gspmd.step_cost import step_time

  constants = load_constants()
  profile = constants.profile()
  numbers = ', '.join(f'{k} {v:.4g}' for k, v in sorted(constants.step_fit.items()))
  print(f'step model for {cpu_key()}: {numbers}')
  entry = step_fit_entry()
  if not entry:
    print('  (no calibration samples for this CPU: run with --refit)')
    return profile
  samples = [fit.Sample.from_json(s) for s in entry['samples']]
  ratios = [step_time(s.features, profile).total / s.seconds for s in samples]
  models = sorted({s.name.rsplit(' ', 1)[0] for s in samples})
  print(
    f'  fit on {len(samples)} calibration steps of other models ({", ".join(models)}), '
    f'held out: every layout below; {entry["source"]}; predicted/measured on them '
    f'{min(ratios):.2f}-{max(ratios):.2f}'
  )
  return profile


def _ratios(entry: dict, now: dict) -> str:
  from tf_gspmd.auto_shard.fit import calibrated_seconds

  then = calibrated_seconds(entry)
  return ', '.join(f'{n} {1e3 * now[n]:.1f} vs {1e3 * then[n]:.1f} ms' for n in now)


def _print_orders(rows) -> None:
  for model in ('transformer', 'cnn', 'all'):
    mine = [r for r in rows if model in ('all', r[0])]

    def label(r, model=model):
      return r[1] if model != 'all' else f'{r[0]}:{r[1]}'

    by_predicted = [label(r) for r in sorted(mine, key=lambda r: r[2])]
    by_measured = [label(r) for r in sorted(mine, key=lambda r: r[3])]
    rho = spearman([r[2] for r in mine], [r[3] for r in mine])
    ratios = [r[2] / r[3] for r in mine]
    print(f'{model}: predicted order: {" < ".join(by_predicted)}')
    print(f'{model}: measured order:  {" < ".join(by_measured)}')
    print(
      f'{model}: Spearman rank correlation {rho:.3f} over {len(mine)} layouts; '
      f'predicted/measured {min(ratios):.2f}-{max(ratios):.2f}'
    )


def _print_self_agreement(labels, halves) -> None:
  """How well the clock orders the layouts against itself: Spearman between the medians of
  the odd and of the even rounds, per model (a model's layouts whose steps differ by less
  than the noise cannot be ranked above what this says)."""
  for model in ('transformer', 'cnn'):
    mine = [i for i, (m, _) in enumerate(labels) if m == model]
    odd, even = ([h[i] for i in mine] for h in halves)
    print(
      f'{model}: the clock against itself (odd rounds vs even rounds): Spearman '
      f'{spearman(odd, even):.3f} over {len(mine)} layouts'
    )


if __name__ == '__main__':
  sys.exit(main())
