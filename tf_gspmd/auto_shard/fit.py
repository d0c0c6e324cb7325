"""The step model fit to measured steps of this CPU, cached per CPU model.

`Constants.profile()` prices a step's features (`tf_gspmd.step_cost`) with seven numbers
that no microbenchmark gives directly: seconds per op launched on tensors, per small op
(scalars, views), per step, a core's contraction rate, the memory bandwidth other ops see,
and two scales on the measured collectives' table (a collective inside a step costs more,
or less, than alone), one for collectives over the whole mesh and one for those over a part
of it (the table times one group alone; in a step the mesh's other groups run theirs at
once). They are fit by non-negative least squares, relative error weighted, on
steps measured here (`calibrate_steps`): small models of their own (an MLP, an attention
block, a convolution stack, each an Adam step written in TF; a Keras MLP, a deeper one, a
Keras Conv1D classifier and a Keras attention block with Keras' Adam) in several layouts
on a (2, 4) mesh of 8 logical CPU devices -- never bench/auto_shard_rank.py's models, which
stay a held-out check. The fit is cached as JSON keyed by `cpu_key()` in the user cache
dir; the package ships the fits of the machines it was written on (`DEFAULT_FIT_FILE`).

  python -c "import tf_gspmd as tg; tg.auto_shard.fit.calibrate_steps()"  # needs 8 CPUs
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf

from tf_gspmd.auto_shard.constants import (
  cpu_vector_bytes,
  load_constants,
  load_step_fit,
  store_step_fit,
)
from tf_gspmd.mesh import Mesh
from tf_gspmd.sharding import NamedSharding, P
from tf_gspmd.step_cost import StepFeatures, collective_seconds, over_part

log = logging.getLogger('tf_gspmd')

# The fit's numbers, in the order of `_columns` (the rates are fit as their inverses).
FIT_KEYS = (
  'op_seconds',
  'core_flops',
  'memory_bandwidth',
  'collective_scale',
  'step_seconds',
  'small_op_seconds',
  'part_collective_scale',
)
_RATES = ('core_flops', 'memory_bandwidth')
_UNBOUNDED = 1e30  # a rate whose term the fit set to zero


# --- the fit ----------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Sample:
  """One measured step: its features and its median seconds."""

  name: str
  features: StepFeatures
  seconds: float

  def to_json(self) -> dict:
    return {
      'name': self.name,
      'features': dataclasses.asdict(self.features),
      'seconds': self.seconds,
    }

  @classmethod
  def from_json(cls, data: dict) -> 'Sample':
    f = data['features']
    features = StepFeatures(
      int(f['devices']),
      int(f['ops']),
      tuple((str(d), float(x)) for d, x in f['matmul_flops']),
      float(f['elementwise_bytes']),
      tuple((str(k), int(g), int(a), int(b)) for k, g, a, b in f['collectives']),
      int(f.get('small_ops', 0)),
    )
    return cls(data['name'], features, float(data['seconds']))


def _columns(features: StepFeatures, profile) -> List[float]:
  """The fit's regressors: what multiplies each of `FIT_KEYS` (a rate's inverse) in
  `step_cost.step_time`."""
  share = profile.share(features.devices)
  measured = {True: 0.0, False: 0.0}  # by whether the group is a part of the mesh (unscaled)
  for c in features.collectives:
    measured[over_part(c, features.devices)] += (
      collective_seconds(profile, *c) / profile.collective_scale
    )
  return [
    share * features.ops,
    share * features.flops,
    share * features.elementwise_bytes,
    measured[False],
    1.0,
    share * features.small_ops,
    measured[True],
  ]


def fit_profile(samples: Sequence[Sample], constants) -> Dict[str, float]:
  """The numbers (`FIT_KEYS`) that best predict `samples`' seconds, by non-negative
  least squares on relative error, with `constants`' measured collectives."""
  from scipy.optimize import nnls

  base = dataclasses.replace(constants, step_fit={}).profile()
  rows = np.array([_columns(s.features, base) for s in samples])
  seconds = np.array([s.seconds for s in samples])
  weights = 1.0 / seconds
  coef, _ = nnls(rows * weights[:, None], seconds * weights)
  out = {}
  for key, value in zip(FIT_KEYS, (float(c) for c in coef)):
    out[key] = (1.0 / value if value > 0 else _UNBOUNDED) if key in _RATES else value
  return out


# --- the calibration steps -----------------------------------------------------------------
DM = ('data', 'model')


def _adam_step(loss_fn, params: Dict[str, tf.Variable]):
  """`adam_step` over `params`, with zero slots laid out like their variable."""
  slots = {
    name: tuple(
      _like(p, f'{name}_{s}', np.zeros(p.shape, np.float32), trainable=False) for s in 'mv'
    )
    for name, p in params.items()
  }
  return adam_step(loss_fn, params, slots)


def adam_step(loss_fn, params: dict, slots: dict, lr=1e-3, b1=0.9, b2=0.999, eps=1e-8):
  """A tf.function (x, target) -> loss that applies one Adam update (no bias correction)
  to `params` ({name: variable}) with `slots` ({name: (m, v)})."""

  @tf.function(autograph=False)
  def step(x, target):
    with tf.GradientTape() as tape:
      loss = loss_fn(x, target)
    names = list(params)
    grads = tape.gradient(loss, [params[n] for n in names])
    for name, grad in zip(names, grads):
      m, v = slots[name]
      m.assign(b1 * m + (1 - b1) * grad)
      v.assign(b2 * v + (1 - b2) * tf.square(grad))
      params[name].assign_sub(lr * m / (tf.sqrt(v) + eps))
    return loss

  return step


def _like(param, name, value, trainable=True):
  from tf_gspmd.annotations import shard_variable, variable_sharding

  var = tf.Variable(value, name=name, trainable=trainable)
  sharding = variable_sharding(param) if param is not None else None
  return shard_variable(var, sharding) if sharding is not None else var


def _weights(mesh: Mesh, shapes: dict, specs: dict, seed: int) -> Dict[str, tf.Variable]:
  from tf_gspmd.annotations import shard_variable

  rng = np.random.RandomState(seed)
  out = {}
  for name, shape in shapes.items():
    var = tf.Variable(
      (rng.randn(*shape) / np.sqrt(shape[-2] if len(shape) > 1 else 1)).astype(np.float32),
      name=name,
    )
    spec = specs.get(name)
    out[name] = shard_variable(var, NamedSharding(mesh, P(*spec))) if spec else var
  return out


def _mlp(mesh, specs, batch_axes, seed=0, batch=128, width=256, hidden=512, depth=3):
  shapes = {f'w{i}': (width, hidden) if i % 2 == 0 else (hidden, width) for i in range(depth)}
  shapes['head'] = (width if depth % 2 == 0 else hidden, 16)
  params = _weights(mesh, shapes, specs, seed)

  def loss_fn(x, y):
    for i in range(depth):
      x = tf.nn.relu(x @ params[f'w{i}'])
    logits = x @ params['head']
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits))

  rng = np.random.RandomState(seed)
  data = (rng.randn(batch, width).astype(np.float32), rng.randint(0, 16, batch).astype(np.int32))
  return _adam_step(loss_fn, params), data, batch_axes


def _attention(mesh, specs, batch_axes, seed=0, batch=16, seq=32, dim=64, heads=8, ff=128):
  d = dim // heads
  shapes = {
    'wq': (dim, heads, d),
    'wk': (dim, heads, d),
    'wv': (dim, heads, d),
    'wo': (heads, d, dim),
    'w1': (dim, ff),
    'w2': (ff, dim),
  }
  params = _weights(mesh, shapes, specs, seed)

  def loss_fn(x, y):
    q = tf.einsum('bsm,mnd->bsnd', x, params['wq'])
    k = tf.einsum('bsm,mnd->bsnd', x, params['wk'])
    v = tf.einsum('bsm,mnd->bsnd', x, params['wv'])
    probs = tf.nn.softmax(tf.einsum('bsnd,btnd->bnst', q, k) * (1.0 / np.sqrt(d)))
    x = x + tf.einsum('bsnd,ndm->bsm', tf.einsum('bnst,btnd->bsnd', probs, v), params['wo'])
    x = x + tf.nn.relu(tf.einsum('bsm,mh->bsh', x, params['w1'])) @ params['w2']
    return tf.reduce_mean(tf.square(x - y))

  rng = np.random.RandomState(seed)
  x = rng.randn(batch, seq, dim).astype(np.float32)
  return _adam_step(loss_fn, params), (x, np.roll(x, 1, axis=1)), batch_axes


def _conv(mesh, specs, batch_axes, seed=0, batch=16, image=24, channels=(4, 24, 48)):
  shapes = {f'k{i}': (3, 3, channels[i], channels[i + 1]) for i in range(len(channels) - 1)}
  shapes['head'] = (channels[-1], 10)
  params = _weights(mesh, shapes, specs, seed)

  def loss_fn(x, y):
    for i in range(len(channels) - 1):
      x = tf.nn.relu(tf.nn.conv2d(x, params[f'k{i}'], 1, 'SAME'))
    logits = tf.reduce_mean(x, axis=[1, 2]) @ params['head']
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits))

  rng = np.random.RandomState(seed)
  x = rng.randn(batch, image, image, channels[0]).astype(np.float32)
  return _adam_step(loss_fn, params), (x, rng.randint(0, 10, batch).astype(np.int32)), batch_axes


def _keras(mesh, specs, model, data, batch_axes):
  """A Keras model's training step (Adam, cross-entropy), its variables laid out by `specs`
  ({path regex: spec})."""
  import keras

  from tf_gspmd.keras.layout import LayoutMap

  optimizer = keras.optimizers.Adam(1e-3)
  optimizer.build(model.trainable_variables)
  layout = LayoutMap(mesh)
  for pattern, spec in specs.items():
    layout[pattern] = P(*spec)
  layout.apply(model)
  loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

  @tf.function
  def step(x, labels):
    with tf.GradientTape() as tape:
      loss = loss_fn(labels, model(x, training=True))
    grads = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(grads, model.trainable_variables))
    return loss

  return step, data, batch_axes


def _keras_mlp(mesh, specs, batch_axes, seed=0, batch=64, width=128, hidden=512, blocks=1):
  import keras

  keras.utils.set_random_seed(seed)
  layers = keras.layers
  stack = [keras.Input((width,))]
  for i in range(blocks):
    stack += [
      layers.Dense(hidden, activation='relu', name=f'up_{i}'),
      layers.LayerNormalization(name=f'norm_{i}'),
      layers.Dense(width, activation='relu', name=f'down_{i}'),
    ]
  model = keras.Sequential(stack + [layers.Dense(10, name='head')])
  rng = np.random.RandomState(seed)
  data = (rng.randn(batch, width).astype(np.float32), rng.randint(0, 10, batch).astype(np.int32))
  return _keras(mesh, specs, model, data, batch_axes)


def _deep_mlp(mesh, specs, batch_axes, seed=0):
  """Many small layers: a step of many ops and little work (as a Keras transformer's)."""
  return _keras_mlp(mesh, specs, batch_axes, seed, batch=32, width=64, hidden=128, blocks=8)


def _keras_conv1d(mesh, specs, batch_axes, seed=0, batch=32, seq=64, channels=8):
  import keras

  keras.utils.set_random_seed(seed)
  layers = keras.layers
  model = keras.Sequential(
    [
      keras.Input((seq, channels)),
      layers.Conv1D(32, 5, padding='same', activation='relu', name='conv_a'),
      layers.Conv1D(64, 3, padding='same', activation='relu', name='conv_b'),
      layers.GlobalAveragePooling1D(name='pool'),
      layers.Dense(10, name='head'),
    ]
  )
  rng = np.random.RandomState(seed)
  x = rng.randn(batch, seq, channels).astype(np.float32)
  return _keras(mesh, specs, model, (x, rng.randint(0, 10, batch).astype(np.int32)), batch_axes)


def _keras_attention(mesh, specs, batch_axes, seed=0, batch=16, seq=16, width=24, dim=48):
  """One Keras attention block (MultiHeadAttention's einsums, LayerNormalization, a Dense
  feed-forward) over a projected sequence: Keras' attention ops, in a model of its own."""
  import keras

  keras.utils.set_random_seed(seed)
  layers = keras.layers
  inputs = keras.Input((seq, width))
  x = layers.Dense(dim, name='project')(inputs)
  x = layers.LayerNormalization(name='norm_a')(
    x + layers.MultiHeadAttention(4, 12, name='mha')(x, x)
  )
  hidden = layers.Dense(2 * dim, activation='gelu', name='ff_in')(x)
  x = layers.LayerNormalization(name='norm_f')(x + layers.Dense(dim, name='ff_out')(hidden))
  logits = layers.Dense(10, name='head')(layers.GlobalAveragePooling1D(name='pool')(x))
  model = keras.Model(inputs, logits)
  rng = np.random.RandomState(seed)
  x = rng.randn(batch, seq, width).astype(np.float32)
  return _keras(mesh, specs, model, (x, rng.randint(0, 10, batch).astype(np.int32)), batch_axes)


def _keras_encoder(mesh, specs, batch_axes, seed=0, batch=24, seq=12, vocab=96, dim=48):
  """A one-block Keras encoder over token ids (Embedding, MultiHeadAttention, two
  LayerNormalizations, a ReLU feed-forward): the ops of a Keras language model, at sizes of
  its own (the bench's transformer stays held out)."""
  import keras

  keras.utils.set_random_seed(seed)
  layers = keras.layers
  tokens = keras.Input((seq,), dtype='int32')
  x = layers.Embedding(vocab, dim, name='embed')(tokens)
  attended = layers.MultiHeadAttention(3, 16, name='mha')(x, x)
  x = layers.LayerNormalization(name='norm_a')(x + attended)
  hidden = layers.Dense(2 * dim, activation='relu', name='ff_in')(x)
  x = layers.LayerNormalization(name='norm_f')(x + layers.Dense(dim, name='ff_out')(hidden))
  logits = layers.Dense(vocab, name='head')(layers.GlobalAveragePooling1D(name='pool')(x))
  model = keras.Model(tokens, logits)
  rng = np.random.RandomState(seed)
  ids = rng.randint(0, vocab, (batch, seq)).astype(np.int32)
  labels = rng.randint(0, vocab, batch).astype(np.int32)
  return _keras(mesh, specs, model, (ids, labels), batch_axes)


def _keras_conv2d(mesh, specs, batch_axes, seed=0, batch=24, image=12):
  """A Keras image classifier of its own shape (a 5x5 Conv2D, BatchNormalization in training,
  ReLU, average pooling, a 3x3 Conv2D, BatchNormalization, ReLU, global pooling, a Dense
  head): Keras' convolution and BatchNormalization ops, unlike the bench's CNN's blocks."""
  import keras

  keras.utils.set_random_seed(seed)
  layers = keras.layers
  model = keras.Sequential(
    [
      keras.Input((image, image, 3)),
      layers.Conv2D(10, 5, padding='same', name='conv_0'),
      layers.BatchNormalization(name='bn_0'),
      layers.ReLU(name='relu_0'),
      layers.AveragePooling2D(2, name='pool_0'),
      layers.Conv2D(20, 3, padding='same', name='conv_1'),
      layers.BatchNormalization(name='bn_1'),
      layers.ReLU(name='relu_1'),
      layers.GlobalAveragePooling2D(name='gap'),
      layers.Dense(10, name='head'),
    ]
  )
  rng = np.random.RandomState(seed)
  x = rng.randn(batch, image, image, 3).astype(np.float32)
  data = (x, rng.randint(0, 10, batch).astype(np.int32))
  return _keras(mesh, specs, model, data, batch_axes)


_MHA_HEADS = {
  r'.*mha/(query|key|value)/kernel': (None, 'model', None),
  r'.*mha/attention_output/kernel': ('model', None, None),
}

# name -> (builder, {variable: spec}, the inputs' batch axes); none of them is a bench layout's
# model (bench/auto_shard_rank.py: the Keras transformer and CNN).
CALIBRATION = {
  'mlp dp8': (_mlp, {}, DM),
  'mlp dp2': (_mlp, {}, 'data'),
  'mlp replicated': (_mlp, {}, None),
  'mlp columns+data': (_mlp, {'w0': (None, 'model'), 'w1': ('model', None)}, 'data'),
  'mlp fsdp8': (_mlp, {'w0': (DM, None), 'w1': (DM, None), 'w2': (DM, None)}, DM),
  'attention dp8': (_attention, {}, DM),
  'attention heads+data': (
    _attention,
    {
      'wq': (None, 'model', None),
      'wk': (None, 'model', None),
      'wv': (None, 'model', None),
      'wo': ('model', None, None),
      'w1': (None, 'model'),
      'w2': ('model', None),
    },
    'data',
  ),
  'attention replicated': (_attention, {}, None),
  'attention ff-over-8': (_attention, {'w1': (None, DM), 'w2': (DM, None)}, None),
  'conv dp8': (_conv, {}, DM),
  'conv dp2': (_conv, {}, 'data'),
  'conv replicated': (_conv, {}, None),
  'conv channels+data': (
    _conv,
    {'k0': (None, None, None, 'model'), 'k1': (None, None, 'model', None)},
    'data',
  ),
  'keras mlp dp8': (_keras_mlp, {}, DM),
  'keras mlp dp2': (_keras_mlp, {}, 'data'),
  'keras mlp replicated': (_keras_mlp, {}, None),
  'keras mlp columns+data': (
    _keras_mlp,
    {r'.*up_\d+/kernel': (None, 'model'), r'.*down_\d+/kernel': ('model', None)},
    'data',
  ),
  'keras deep mlp dp8': (_deep_mlp, {}, DM),
  'keras deep mlp replicated': (_deep_mlp, {}, None),
  'keras deep mlp columns+data': (
    _deep_mlp,
    {r'.*up_\d+/kernel': (None, 'model'), r'.*down_\d+/kernel': ('model', None)},
    'data',
  ),
  'keras deep mlp fsdp8': (
    _deep_mlp,
    {r'.*up_\d+/kernel': (DM, None), r'.*down_\d+/kernel': (None, DM)},
    DM,
  ),
  'keras conv1d dp8': (_keras_conv1d, {}, DM),
  'keras conv1d replicated': (_keras_conv1d, {}, None),
  'keras conv1d filters+data': (
    _keras_conv1d,
    {r'.*conv_a/kernel': (None, None, 'model'), r'.*conv_b/kernel': (None, 'model', None)},
    'data',
  ),
  'keras conv1d filters': (_keras_conv1d, {r'.*conv_b/kernel': (None, None, 'model')}, None),
  'keras attention dp8': (_keras_attention, {}, DM),
  'keras attention replicated': (_keras_attention, {}, None),
  'keras attention heads+data': (_keras_attention, _MHA_HEADS, 'data'),
  'keras attention ff over 8': (
    _keras_attention,
    {r'.*ff_in/kernel': (None, DM), r'.*ff_out/kernel': (DM, None)},
    None,
  ),
  'keras encoder dp8': (_keras_encoder, {}, DM),
  'keras encoder replicated': (_keras_encoder, {}, None),
  'keras encoder heads+data': (
    _keras_encoder,
    dict(_MHA_HEADS, **{r'.*ff_in/kernel': (None, 'model'), r'.*ff_out/kernel': ('model', None)}),
    'data',
  ),
  'keras conv2d dp8': (_keras_conv2d, {}, DM),
  'keras conv2d replicated': (_keras_conv2d, {}, None),
  'keras conv2d channels+data': (
    _keras_conv2d,
    {r'.*conv_\d+/kernel': (None, None, None, 'model'), r'.*head/kernel': ('model', None)},
    'data',
  ),
}


def _shardings(mesh: Mesh, batch_axes, data) -> list:
  return [NamedSharding(mesh, P(batch_axes, *([None] * (np.ndim(d) - 1)))) for d in data]


def features_of(mesh: Mesh, build, specs, batch_axes) -> StepFeatures:
  """The features of a calibration step, planned (no device runs it), priced for this CPU's
  vector width."""
  from tf_gspmd.planning import plan
  from tf_gspmd.step_cost import step_features

  step, data, axes = build(mesh, specs, batch_axes)
  shardings = _shardings(mesh, axes, data)
  specs_of = [tf.TensorSpec(np.shape(d), tf.as_dtype(np.asarray(d).dtype)) for d in data]
  report = plan(step, *specs_of, mesh=mesh, in_shardings=shardings)
  return step_features(
    report.propagation, mesh, report.collective_records, vector_bytes=cpu_vector_bytes()
  )


def prepare(mesh: Mesh, build, specs, batch_axes, warmup: int = 1) -> Tuple[StepFeatures, Callable]:
  """(features of the planned step, a callable running one partitioned step), warmed up."""
  from tf_gspmd.partitioned import partition

  features = features_of(mesh, build, specs, batch_axes)
  step, data, axes = build(mesh, specs, batch_axes)
  shardings = _shardings(mesh, axes, data)
  partitioned = partition(step, mesh, in_shardings=shardings, progress=False)

  def run():
    return float(partitioned(*data))

  for _ in range(1 + warmup):
    run()
  return features, run


def measure_round_robin(runs: Sequence[Callable], steps: int) -> List[float]:
  """Median seconds of each run's step, taken in turn so that load from other processes
  falls on every one alike."""
  return [float(np.median(t)) for t in timed_rounds(runs, steps)]


def timed_rounds(runs: Sequence[Callable], steps: int) -> List[List[float]]:
  """Per run, the seconds of each of its `steps` steps, the runs taken in turn each round."""
  times: List[List[float]] = [[] for _ in runs]
  for _ in range(steps):
    for i, run in enumerate(runs):
      start = time.perf_counter()
      run()
      times[i].append(time.perf_counter() - start)
  return times


# Calibration steps timed again to tell how fast the machine runs now against when it was
# calibrated: on a shared virtual machine the same step took 1.8x longer in some hours than
# in others (bench/auto_shard_rank.py, sessions 26-27), more than any feature explains.
PROBE = ('mlp dp8', 'conv dp8', 'keras mlp dp8', 'keras encoder dp8')


def calibrated_seconds(entry: dict) -> Dict[str, float]:
  """Each calibration step's measured seconds in `entry` (as `calibrate_steps` makes it)."""
  return {s['name']: float(s['seconds']) for s in entry.get('samples', ())}


def probe_runs(mesh: Mesh, entry: dict) -> List[Tuple[str, Callable]]:
  """(name, a callable running one step) of the `PROBE` steps `entry`'s samples have."""
  measured = calibrated_seconds(entry)
  return [(n, prepare(mesh, *CALIBRATION[n])[1]) for n in PROBE if n in measured]


def speed_factor(entry: dict, seconds_now: Dict[str, float]) -> float:
  """How many times longer the probe steps take now (`seconds_now`, by name) than when
  `entry` was calibrated: the median of their ratios (1.0 without any)."""
  then = calibrated_seconds(entry)
  ratios = [seconds_now[n] / then[n] for n in seconds_now if then.get(n)]
  return float(np.median(ratios)) if ratios else 1.0


def calibrate_steps(
  path: Optional[str] = None,
  steps: int = 7,
  cases: Optional[dict] = None,
  also: Sequence[Callable] = (),
) -> dict:
  """Measure the calibration steps (`CALIBRATION`, or `cases`) on a (2, 4) mesh of 8 logical
  CPU devices, fit the step model, cache it for this CPU at `path` and return the entry
  ({'fit', 'samples', 'source'}). `also`: more steps to time in the same rounds (under the
  same load), not fit; their median seconds are the entry's 'also' (not cached)."""
  mesh = Mesh.create((2, 4), DM)
  cases = cases or CALIBRATION
  prepared = [prepare(mesh, *cases[name]) for name in cases]
  timed = measure_round_robin([run for _, run in prepared] + list(also), steps)
  seconds, others = timed[: len(prepared)], timed[len(prepared) :]
  samples = [Sample(n, f, s) for n, (f, _), s in zip(cases, prepared, seconds)]
  constants = load_constants(fit=False)
  entry = {
    'fit': fit_profile(samples, constants),
    'samples': [s.to_json() for s in samples],
    'source': f'calibrate_steps() {time.ctime()}: {len(samples)} steps, median of {steps}',
  }
  store_step_fit(entry, path)
  return dict(entry, also=others)


def refeatured(entry: dict, note: str = '') -> dict:
  """`entry` (as `calibrate_steps` makes it) with its samples' features computed again by
  this code and the model fit again on them, with the seconds measured then: for when what a
  feature counts changes (the steps are the same programs). Samples not in `CALIBRATION`
  are dropped. Needs no devices."""
  mesh = Mesh.create((2, 4), DM)
  samples = [
    Sample(data['name'], features_of(mesh, *CALIBRATION[data['name']]), float(data['seconds']))
    for data in entry['samples']
    if data['name'] in CALIBRATION
  ]
  return {
    'fit': fit_profile(samples, load_constants(fit=False)),
    'samples': [s.to_json() for s in samples],
    'source': entry.get('source', '') + (f'; {note}' if note else ''),
  }


def ensure_step_fit(path: Optional[str] = None) -> Dict[str, float]:
  """This CPU's fit, measured now (`calibrate_steps`) and cached when no cache has it."""
  return load_step_fit(path, recompute=lambda: calibrate_steps(path))
