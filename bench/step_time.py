"""Training-step time: partitioned on 8 logical CPUs over unpartitioned, tf_gspmd and DTensor.

Models (bench/models.py), each a whole training step (forward, GradientTape, Adam):
  (a) mlp          Keras 3 MLP, data parallel: batch split over mesh (data=8).
  (b) transformer  examples/keras/transformer.py, Megatron layout (heads and MLP hidden
                   on 'model', batch on 'data') on mesh (data=2, model=4).
  (c) cnn          Conv2D/BatchNorm/MaxPool blocks, GAP, Dense; image height split over
                   'h' (halo exchange) and batch over 'data' on mesh (data=2, h=4).

For each model two runs, each in its own subprocess (a failed or timed-out
collective poisons a TF process; one system's failure must not take out the
other's numbers):
  tf_gspmd  the Keras step under `tf_gspmd.partition` on the mesh, interleaved with
            the same Keras step unpartitioned (one device).
  DTensor   the model's plain-TF twin (Keras 3 cannot run under DTensor) with
            `DVariable`s laid out like tf_gspmd's layout and the batch packed with
            the same input layout, interleaved with the same plain-TF step
            unpartitioned. Layouts DTensor cannot express are reported as
            "unsupported: <reason>".
  tf_gspmd xla  the same Keras step under `tf_gspmd.partition(..., backend='xla')`
            (the per-partition program compiled by XLA, run through PJRT on 8 CPU
            devices), interleaved with the same step unpartitioned and compiled by XLA
            (`tf.function(jit_compile=True)`): the XLA backend against XLA on one device.
  Keras-JAX the same Keras model under Keras 3 on JAX (the .jaxenv venv: jax 0.10.2 and
            .venv's Keras; KERAS_BACKEND=jax, 8 host devices), with
            `keras.distribution` laid out like tf_gspmd: DataParallel for the MLP,
            ModelParallel with a LayoutMap of the transformer's own rules
            (examples/keras/transformer.py's `layout`) on (data=2, model=4), and for the
            CNN ModelParallel on (data=2, h=4) with the activations of every conv, BatchNorm,
            ReLU and pool layer laid out as the input (batch over 'data', height over 'h';
            Keras' `<layer>/output` layouts), GSPMD partitioning the rest. Steps are
            `model.train_on_batch` (compiled once by jax.jit; same loss, Adam defaults,
            weights copied from the Keras model of the tf_gspmd run, same batch), interleaved
            with the same model trained unpartitioned on one device.
            STEP_TIME_KERAS_JAX_CNN=data runs the CNN data parallel over all 8 devices
            instead (Keras-JAX's own simplest layout; not tf_gspmd's).
  keras_tg  the Keras-JAX child's own code on Keras with TF under `tf_gspmd.keras` (the same
            keras.distribution, weights and batch; `train_on_batch`; variables split from
            birth, as on JAX), once per backend, interleaved: tf_gspmd's Keras path against
            Keras-JAX's with nothing but the framework changed (the systems above partition
            a hand-written step over adopted plain variables, copied back after each call).
Each ratio is partitioned / unpartitioned from the same process, same cores, the
calls taken round-robin so that load from other processes hits both alike.
Ratios across systems (tf_gspmd / DTensor, tf_gspmd / Keras-JAX: the 'vs peers' lines
after the table) compare medians from different processes run one after another, so
load from other jobs on the machine can move them; rerun and compare.

Timing: the first call (capture, propagation, partitioning, tracing, first run)
is "build s"; then --warmup calls; then the median over --steps calls, each
ended by fetching the loss. All runs start from the same weights (seed 0; the
plain-TF twin copies the Keras initial weights) and see the same batch every
step, so their loss sequences must agree: tf_gspmd against Keras unpartitioned,
DTensor against plain-TF unpartitioned (and plain TF against Keras, to show the
twin is the same model). Each pair of loss sequences is compared by the oracle
(tf_gspmd/testing/oracle.py: the normwise relative error of the loss history as one
float32 tensor, bound 1e-5) by its float64 rule: the same steps run unpartitioned in
float64 (untimed, in the tf_gspmd child), and the first run of each pair may be no
further from them than twice the second, plus the bound (over 17 Adam steps float32
itself is ill-conditioned; Keras-JAX's transformer, whose sparse Embedding gradient
Keras-TF applies otherwise, by the bound alone). A disagreement is printed as MISMATCH
and the exit status is 1; a failure to run is reported in its column.

Collectives/step and bytes/step: what `pf.collectives()` lists for one call
(every collective the per-partition program runs; bytes = the local input
tensor of each, i.e. per device).

  .venv/bin/python bench/step_time.py [--models a,b,c] [--steps 15] [--quick]
                                      [--systems tf_gspmd,dtensor,xla,keras_jax]
                                      [--json PATH]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Callable, Dict, List, Optional

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')  # before TensorFlow is first imported
os.environ.setdefault('KERAS_BACKEND', 'tensorflow')

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import oracle_file  # noqa: E402  (sibling: the oracle without importing TensorFlow)
import quick_children  # noqa: E402  (sibling: --quick's children forked, TF imported once)

NUM_DEVICES = 8
RESULT_PREFIX = 'STEP_TIME_RESULT '

MODELS = {'a': 'mlp', 'b': 'transformer', 'c': 'cnn'}
CONFIGS = {
  'full': {
    'mlp': dict(batch=1024, features=256, width=512, depth=2, classes=10),
    'transformer': dict(batch=64, vocab=256, seq=32, d_model=128, heads=8, ff=512, layers=2),
    'cnn': dict(batch=64, image=64, channels=3, filters=[32, 64], classes=10),
  },
  'quick': {
    'mlp': dict(batch=64, features=32, width=64, depth=2, classes=10),
    'transformer': dict(batch=8, vocab=64, seq=8, d_model=32, heads=4, ff=64, layers=1),
    'cnn': dict(batch=8, image=16, channels=3, filters=[8], classes=10),
  },
}
MESHES = {
  'mlp': ((8,), ('data',)),
  'transformer': ((2, 4), ('data', 'model')),
  'cnn': ((2, 4), ('data', 'h')),
}
INPUT_SPECS = {
  'mlp': ('data', None),
  'transformer': ('data', None),
  'cnn': ('data', 'h', None, None),
}
SYSTEMS = ('tf_gspmd', 'dtensor', 'xla', 'keras_jax', 'keras_tg')
RUNNERS = {
  'tf_gspmd': ('unpartitioned', 'tf_gspmd'),
  'dtensor': ('plain', 'dtensor'),
  'xla': ('xla_unpartitioned', 'tf_gspmd_xla'),
  'keras_jax': ('keras_jax_unpartitioned', 'keras_jax'),
  'keras_tg': ('keras_tg', 'keras_tg_xla'),
}
# The systems that run on the tf_gspmd child's saved weights and batch (keras.distribution).
KERAS_INPUT_SYSTEMS = ('tf_gspmd', 'keras_jax', 'keras_tg')
# The CNN under keras.distribution: its activations laid out like its input (Keras matches
# `<layer path>/output` against the LayoutMap); the height split tf_gspmd propagates from
# the input annotation, written out per layer since Keras propagates no input layout.
# Keras matches a LayoutMap key against the whole path (re.fullmatch), and a Sequential's
# layer path starts with the model's name ('sequential/conv_0/output').
CNN_ACTIVATION_RULE = (r'(?:.*/)?(conv|bn|relu|pool)_\d+/output', INPUT_SPECS['cnn'])
# Models whose Keras-JAX losses match Keras-TF's only at the first step. Measured: the
# transformer's Embedding gets an IndexedSlices gradient on TF, which Keras 3's TF optimizer
# applies by scatter (Adam's m and v updated on the looked-up rows, once per occurrence);
# JAX's gradient is dense. The TF step with the gradient densified reproduces Keras-JAX's
# losses to the printed digits. So: first step (same weights, same batch: the same forward
# and loss) against Keras-TF, every step against Keras-JAX unpartitioned.
SPARSE_GRADIENT_MODELS = ('transformer',)


# ================================ child: one model, one system ================================
INTRA_OP_ENV = 'STEP_TIME_INTRA_OP_THREADS'  # --intra-op-threads, handed to the TF children


def configure_logical_cpus(n: int) -> None:
  """Split the CPU into n logical devices; must run before TF initializes its devices.

  With --intra-op-threads, TF's intra-op pool (shared by every logical device and by the
  unpartitioned runs alike) gets that many threads: 8 partitions already keep both cores
  busy with inter-op parallelism, and an op that also splits itself over the intra-op
  pool oversubscribes them.
  """
  import tensorflow as tf

  tf.config.set_logical_device_configuration(
    tf.config.list_physical_devices('CPU')[0], [tf.config.LogicalDeviceConfiguration()] * n
  )
  threads = os.environ.get(INTRA_OP_ENV)
  if threads:
    tf.config.threading.set_intra_op_parallelism_threads(int(threads))


class ModelSpec:
  """Everything the two systems need about one model at one size."""

  def __init__(self, name: str, cfg: dict):
    import numpy as np

    sys.path.insert(0, ROOT)
    sys.path.insert(0, HERE)
    sys.path.insert(0, os.path.join(ROOT, 'examples', 'keras'))
    import models
    import transformer

    self.name, self.cfg = name, cfg
    self.mesh_shape, self.mesh_axes = MESHES[name]
    self.input_spec = INPUT_SPECS[name]
    rng = np.random.RandomState(1)
    if name == 'mlp':
      self.keras = lambda: models.keras_mlp(
        0, cfg['features'], cfg['width'], cfg['depth'], cfg['classes']
      )
      self.plain = lambda w, make: models.plain_mlp(w, cfg['depth'], make)
      self.x = rng.randn(cfg['batch'], cfg['features']).astype(np.float32)
      self.y = rng.randint(0, cfg['classes'], cfg['batch']).astype(np.int32)
      self.layout = None
    elif name == 'transformer':
      dims = {k: cfg[k] for k in ('vocab', 'seq', 'd_model', 'heads', 'ff', 'layers')}
      self.keras = lambda: transformer.build(seed=0, **dims)
      self.plain = lambda w, make: models.plain_transformer(w, cfg['layers'], make)
      self.x, self.y = transformer.batch(1, cfg['batch'], vocab=cfg['vocab'], seq=cfg['seq'])
      self.layout = transformer.layout
    elif name == 'cnn':
      self.keras = lambda: models.keras_cnn(
        0, cfg['image'], cfg['channels'], cfg['filters'], cfg['classes']
      )
      self.plain = lambda w, make: models.plain_cnn(w, len(cfg['filters']), make)
      self.x = rng.randn(cfg['batch'], cfg['image'], cfg['image'], cfg['channels']).astype(
        np.float32
      )
      self.y = rng.randint(0, cfg['classes'], cfg['batch']).astype(np.int32)
      self.layout = None
    else:
      raise ValueError(f'unknown model {name!r}; choose from {sorted(MESHES)}')

  def train_step(self, model, optimizer, mesh=None):
    """The Keras step; with `mesh`, the input annotated with the model's input layout."""
    import models

    import tf_gspmd as tg

    if self.name == 'transformer':  # the example's own step, as the demo and tests use it
      import transformer

      return transformer.train_step(model, optimizer, mesh)
    annotate = None if mesh is None else (lambda x: tg.shard(x, mesh, tg.P(*self.input_spec)))
    return models.keras_train_step(model, optimizer, annotate)

  def partitioned_step(self, **partition_kwargs):
    """(the Keras step on the model laid out and partitioned, a twin model, its optimizer):
    both models start from the same weights; the twin is the unpartitioned reference."""
    import tf_gspmd as tg

    mesh = self.tg_mesh()
    model, optimizer = self.keras()
    ref_model, ref_optimizer = self.keras()
    if self.layout is not None:
      self.layout(mesh).apply(model)
    partitioned = tg.partition(self.train_step(model, optimizer, mesh), mesh, **partition_kwargs)
    return partitioned, ref_model, ref_optimizer

  def tg_mesh(self):
    import tf_gspmd as tg

    return tg.Mesh.create(self.mesh_shape, self.mesh_axes)


class Run:
  """One runner's measurements."""

  def __init__(self):
    self.build_s: Optional[float] = None
    self.step_s: List[float] = []
    self.losses: List[float] = []
    self.error: Optional[str] = None

  def as_dict(self) -> dict:
    return {
      'build_s': self.build_s,
      'step_ms': 1e3 * statistics.median(self.step_s) if self.step_s else None,
      'losses': self.losses,
      'error': self.error,
    }


def measure(
  runners: Dict[str, Callable], steps: int, warmup: int, failure: Callable[[Exception], str]
) -> Dict[str, Run]:
  """Build call, warm-up calls, then `steps` timed calls of every runner, round-robin."""
  runs = {name: Run() for name in runners}

  def call(name, timed=None):
    start = time.perf_counter()
    try:
      loss = float(runners[name]())
    except Exception as e:  # noqa: BLE001
      runs[name].error = failure(e)
      print(f'[{name}] failed: {e}', file=sys.stderr)
      return
    elapsed = time.perf_counter() - start
    runs[name].losses.append(loss)
    if timed is not None:
      timed.append(elapsed)
    else:
      runs[name].build_s = runs[name].build_s or elapsed

  for name in runners:
    call(name)
  for _ in range(warmup):
    for name in runners:
      if runs[name].error is None:
        call(name, timed=[])
  for _ in range(steps):
    for name in runners:
      if runs[name].error is None:
        call(name, timed=runs[name].step_s)
  return runs


def gist(error: Exception) -> str:
  """The line of a TF/MLIR error message that says what went wrong, shortened."""
  lines = [t.strip() for t in str(error).splitlines() if t.strip()]
  for line in lines:  # MLIR diagnostics (DTensor): "<loc>: error: <what>"
    what = line.split('error:', 1)[1].strip() if 'error:' in line else ''
    if what:
      return what[:90]
  for line in lines:
    for code in (
      'INVALID_ARGUMENT',
      'UNIMPLEMENTED',
      'INTERNAL',
      'FAILED_PRECONDITION',
      'DEADLINE_EXCEEDED',
      'ABORTED',
      'UNKNOWN',
    ):
      if code in line:
        return line[line.index(code) :][:90]
  return f'{type(error).__name__}: {lines[0] if lines else ""}'[:90]


def tf_gspmd_failure(error: Exception) -> str:
  return 'error: ' + gist(error)


def dtensor_failure(error: Exception) -> str:
  text = str(error)
  unsupported = any(
    s in text
    for s in (
      'only supported',
      'not supported',
      'Unimplemented',
      'UNIMPLEMENTED',
      'unsupported',
      'Unsupported',
    )
  )
  return ('unsupported: ' if unsupported else 'error: ') + gist(error)


def child_tf_gspmd(spec: ModelSpec, steps: int, warmup: int) -> dict:
  """The Keras step partitioned by tf_gspmd, beside the same step unpartitioned."""
  import tensorflow as tf

  partitioned, ref_model, ref_optimizer = spec.partitioned_step()
  reference = spec.train_step(ref_model, ref_optimizer)
  x, y = tf.constant(spec.x), tf.constant(spec.y)
  runs = measure(
    {'unpartitioned': lambda: reference(x, y), 'tf_gspmd': lambda: partitioned(x, y)},
    steps,
    warmup,
    tf_gspmd_failure,
  )
  out = {name: run.as_dict() for name, run in runs.items()}
  out['float64'] = float64_losses(spec, len(runs['unpartitioned'].losses))
  if runs['tf_gspmd'].error is None:
    records = partitioned.collectives()
    kinds = collections.Counter(f'{r["kind"]}({",".join(r["axes"])})' for r in records)
    # A coalesced all-reduce resolves several pending sums at once ('fused': how many).
    sums = collections.Counter()
    for r in records:
      sums[f'{r["kind"]}({",".join(r["axes"])})'] += int(r.get('fused', 1))
    out['collectives'] = {
      'count': len(records),
      'bytes': sum(int(r['bytes']) for r in records),
      'kinds': dict(kinds),
      'sums': dict(sums),
    }
  return out


def float64_losses(spec: ModelSpec, calls: int) -> dict:
  """The unpartitioned Keras step in float64, from the float32 models' initial weights, as
  many calls as the timed runs made (untimed): the exact losses the oracle's float64 rule
  measures each pair of float32 runs against. Over 17 Adam steps float32 is ill-conditioned
  (the CNN's BatchNorm, conv biases with a zero gradient): two correct float32 runs drift
  apart by about the bound (measured, full sizes: XLA unpartitioned vs Keras 6.4e-6)."""
  import numpy as np
  import tensorflow as tf

  from tf_gspmd.testing.float64 import float64_policy, float64_twin

  try:
    model, optimizer = float64_twin(spec.keras)
    with float64_policy():
      step = spec.train_step(model, optimizer)  # its Keras loss takes the policy: float64
    x = tf.constant(spec.x.astype(np.float64) if spec.x.dtype == np.float32 else spec.x)
    y = tf.constant(spec.y)
    return {'losses': [float(step(x, y)) for _ in range(calls)], 'error': None}
  except Exception as e:  # noqa: BLE001
    print(f'[float64] failed: {e}', file=sys.stderr)
    return {'losses': None, 'error': f'error: {gist(e)}'}


def dtensor_layout(dtensor, mesh, spec, shape, what: str):
  """A DTensor Layout for a tf_gspmd spec (None/axis per dim); ValueError where DTensor can't."""
  sharding = []
  for dim, (size, axis) in enumerate(zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec)))):
    if isinstance(axis, (tuple, list)):
      if len(axis) != 1:
        raise ValueError(f'unsupported: {what} dim {dim} over several mesh axes {axis}')
      axis = axis[0]
    if axis is None:
      sharding.append(dtensor.UNSHARDED)
      continue
    if size % mesh.dim_size(axis):
      raise ValueError(
        f'unsupported: uneven shards ({what} dim {dim} of {size} over {axis}={mesh.dim_size(axis)})'
      )
    sharding.append(axis)
  return dtensor.Layout(sharding, mesh)


def child_dtensor(spec: ModelSpec, steps: int, warmup: int) -> dict:
  """The plain-TF twin under DTensor, beside the same plain-TF step unpartitioned."""
  import models
  import numpy as np
  import tensorflow as tf
  from tensorflow.experimental import dtensor

  keras_model, _ = spec.keras()
  weights = models.initial_weights(keras_model)
  plain = spec.plain(weights, models.make_tf_variable)
  plain_step = models.plain_train_step(plain, models.PlainAdam(plain))
  x, y = tf.constant(spec.x), tf.constant(spec.y)
  runners = {'plain': lambda: plain_step(x, y)}

  mesh = dtensor.create_mesh(
    list(zip(spec.mesh_axes, spec.mesh_shape)), devices=[f'CPU:{i}' for i in range(NUM_DEVICES)]
  )
  layout_map = spec.layout(spec.tg_mesh()) if spec.layout is not None else None

  def put(value, tf_spec, what):
    layout = dtensor_layout(dtensor, mesh, tf_spec, np.shape(value), what)
    replicated = dtensor.copy_to_mesh(
      tf.constant(value), dtensor.Layout.replicated(mesh, np.ndim(value))
    )
    return dtensor.relayout(replicated, layout)

  def variable_for(name, value):
    rule = layout_map[name] if layout_map is not None else None
    return dtensor.DVariable(put(value, tuple(rule) if rule is not None else (), name))

  setup_error = None
  try:
    dmodel = spec.plain(weights, variable_for)
    optimizer = models.PlainAdam(
      dmodel, variable_for, lambda n, v: dtensor.DVariable(put(v, (), n))
    )
    dstep = models.plain_train_step(dmodel, optimizer)
    xd = put(spec.x, spec.input_spec, 'input')
    yd = put(spec.y, spec.input_spec[:1], 'labels')
    runners['dtensor'] = lambda: dstep(xd, yd)
  except Exception as e:  # noqa: BLE001
    setup_error = dtensor_failure(e) if not str(e).startswith('unsupported') else str(e)
  runs = measure(runners, steps, warmup, dtensor_failure)
  out = {name: run.as_dict() for name, run in runs.items()}
  if setup_error is not None:
    out['dtensor'] = Run().as_dict() | {'error': setup_error}
  return out


def child_xla_backend(spec: ModelSpec, steps: int, warmup: int) -> dict:
  """The Keras step partitioned with backend='xla', beside it unpartitioned under XLA."""
  import tensorflow as tf

  partitioned, ref_model, ref_optimizer = spec.partitioned_step(backend='xla')
  reference = tf.function(
    spec.train_step(ref_model, ref_optimizer).python_function, jit_compile=True
  )
  x, y = tf.constant(spec.x), tf.constant(spec.y)
  runs = measure(
    {'xla_unpartitioned': lambda: reference(x, y), 'tf_gspmd_xla': lambda: partitioned(x, y)},
    steps,
    warmup,
    tf_gspmd_failure,
  )
  return {name: run.as_dict() for name, run in runs.items()}


def save_inputs(spec: ModelSpec, path: str) -> None:
  """The Keras model's initial weights (by path) and the batch, for the Keras-JAX child."""
  import models
  import numpy as np

  model, _ = spec.keras()  # seed 0: the initial weights every run starts from
  arrays = {'w:' + k.replace('/', '|'): v for k, v in models.initial_weights(model).items()}
  np.savez(
    path, x=spec.x, y=spec.y, rules=np.array(json.dumps(keras_jax_layout_rules(spec))), **arrays
  )


def keras_jax_layout_rules(spec: ModelSpec) -> list:
  """[(anchored regex, spec)] for keras.distribution: tf_gspmd's LayoutMap rules, as JSON."""
  if spec.name == 'cnn' and os.environ.get('STEP_TIME_KERAS_JAX_CNN') == 'data':
    return []  # DataParallel over all 8 devices (Keras-JAX's own best layout, for a note)
  if spec.name == 'cnn':
    pattern, rule = CNN_ACTIVATION_RULE
    return [[pattern, list(rule)]]
  if spec.layout is None:
    return []
  rules = spec.layout(spec.tg_mesh())._rules  # noqa: SLF001
  # tf_gspmd's LayoutMap uses re.fullmatch; Keras' uses re.search: anchor the patterns.
  return [
    [f'^(?:{pattern})$', [None if a is None else a for a in rule]]
    for pattern, rule in rules.items()
  ]


def keras_model(name: str, cfg: dict):
  """bench/models.py's and examples/keras/transformer.py's Keras models, without TF imports
  (the JAX venv has no TensorFlow); the weights come from the TF run, by variable path, and a
  missing or extra path fails the run, so the two definitions cannot drift apart."""
  import keras

  if name == 'mlp':
    layers = [keras.Input((cfg['features'],))]
    layers += [
      keras.layers.Dense(cfg['width'], activation='relu', name=f'hidden_{i}')
      for i in range(cfg['depth'])
    ]
    return keras.Sequential(layers + [keras.layers.Dense(cfg['classes'], name='logits')])
  if name == 'cnn':
    layers = [keras.Input((cfg['image'], cfg['image'], cfg['channels']))]
    for i, f in enumerate(cfg['filters']):
      layers += [
        keras.layers.Conv2D(f, 3, padding='same', name=f'conv_{i}'),
        keras.layers.BatchNormalization(name=f'bn_{i}'),
        keras.layers.ReLU(name=f'relu_{i}'),
        keras.layers.MaxPooling2D(2, name=f'pool_{i}'),
      ]
    layers += [
      keras.layers.GlobalAveragePooling2D(name='gap'),
      keras.layers.Dense(cfg['classes'], name='head'),
    ]
    return keras.Sequential(layers)
  tokens = keras.Input((cfg['seq'],), dtype='int32')
  x = keras.layers.Embedding(cfg['vocab'], cfg['d_model'], name='embed')(tokens)
  for i in range(cfg['layers']):
    attn = keras.layers.MultiHeadAttention(
      cfg['heads'], cfg['d_model'] // cfg['heads'], name=f'attn_{i}'
    )(x, x)
    x = keras.layers.LayerNormalization(name=f'norm_attn_{i}')(x + attn)
    hidden = keras.layers.Dense(cfg['ff'], activation='relu', name=f'ffn_in_{i}')(x)
    hidden = keras.layers.Dropout(0.0, name=f'drop_{i}')(hidden)
    x = keras.layers.LayerNormalization(name=f'norm_ffn_{i}')(
      x + keras.layers.Dense(cfg['d_model'], name=f'ffn_out_{i}')(hidden)
    )
  logits = keras.layers.Dense(cfg['vocab'], name='head')(keras.layers.GlobalAveragePooling1D()(x))
  return keras.Model(tokens, logits)


def _compiled_keras_model(name: str, cfg: dict, weights: dict, jit_compile: bool = True):
  import keras

  model = keras_model(name, cfg)
  by_path = {}
  for v in model.variables:  # Sequential paths start with the model's name: drop it
    path = v.path[len(model.name) + 1 :] if v.path.startswith(model.name + '/') else v.path
    by_path[path] = v
  if sorted(by_path) != sorted(weights):
    raise ValueError(
      f'Keras-JAX {name}: variable paths {sorted(by_path)} differ from the TF '
      f"model's {sorted(weights)}"
    )
  for path, v in by_path.items():
    v.assign(weights[path])
  model.compile(
    optimizer=keras.optimizers.Adam(1e-3),
    jit_compile=jit_compile,
    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
  )
  return model


def _saved_inputs(inputs_path: str):
  """(weights by path, x, y, layout rules) the tf_gspmd child saved for the systems that run
  the model through keras.distribution."""
  import numpy as np

  data = np.load(inputs_path)
  weights = {k[2:].replace('|', '/'): data[k] for k in data.files if k.startswith('w:')}
  return weights, data['x'], data['y'], json.loads(str(data['rules']))


def _keras_distribution(name: str, rules: list):
  """The keras.distribution of `rules` on the model's mesh (DataParallel without rules): the
  same layouts for every system that runs the model through keras.distribution."""
  import keras

  dist_lib = keras.distribution
  devices = dist_lib.list_devices()[:NUM_DEVICES]
  shape, axes = MESHES[name]
  if not rules:
    return dist_lib.DataParallel(devices=devices)
  layout_map = dist_lib.LayoutMap(dist_lib.DeviceMesh(shape, axes, devices))
  for pattern, rule in rules:
    layout_map[pattern] = tuple(rule)
  return dist_lib.ModelParallel(layout_map=layout_map, batch_dim_name='data')


def child_keras_tg(name: str, cfg: dict, inputs_path: str, steps: int, warmup: int) -> dict:
  """The Keras-JAX child's code on Keras 3 with TF under tf_gspmd.keras (`keras.distribution`
  with the same layouts, `train_on_batch`): the TF backend and backend='xla', one model
  each, interleaved. The variables are split from birth, as Keras on JAX makes them."""
  import contextlib

  import tf_gspmd

  weights, x, y, rules = _saved_inputs(inputs_path)

  @contextlib.contextmanager
  def enabled(backend: str):
    tf_gspmd.keras.enable(backend)
    try:
      yield
    finally:
      tf_gspmd.keras.disable()

  def distributed(backend: str):
    with enabled(backend):
      distribution = _keras_distribution(name, rules)
      with distribution.scope():
        model = _compiled_keras_model(name, cfg, weights, jit_compile=False)

    def step():
      with enabled(backend), distribution.scope():
        return model.train_on_batch(x, y)

    return step

  runs = measure(
    {'keras_tg': distributed('tf'), 'keras_tg_xla': distributed('xla')},
    steps,
    warmup,
    tf_gspmd_failure,
  )
  return {runner: run.as_dict() for runner, run in runs.items()}


def child_keras_jax(name: str, cfg: dict, inputs_path: str, steps: int, warmup: int) -> dict:
  """Keras 3 on JAX with keras.distribution, beside the same model on one device."""
  weights, x, y, rules = _saved_inputs(inputs_path)
  distribution = _keras_distribution(name, rules)
  reference = _compiled_keras_model(name, cfg, weights)
  with distribution.scope():
    distributed = _compiled_keras_model(name, cfg, weights)

  def distributed_step():
    with distribution.scope():
      return distributed.train_on_batch(x, y)

  runs = measure(
    {
      'keras_jax_unpartitioned': lambda: reference.train_on_batch(x, y),
      'keras_jax': distributed_step,
    },
    steps,
    warmup,
    tf_gspmd_failure,
  )
  return {name: run.as_dict() for name, run in runs.items()}


def run_child(args) -> None:
  if args.child_system == 'keras_jax':  # in the JAX venv: no TensorFlow here
    result = child_keras_jax(
      args.child_model, json.loads(args.child_config), args.inputs, args.steps, args.warmup
    )
    print(RESULT_PREFIX + json.dumps(result), flush=True)
    return
  configure_logical_cpus(NUM_DEVICES)
  spec = ModelSpec(args.child_model, json.loads(args.child_config))
  if args.inputs:
    save_inputs(spec, args.inputs)
  if args.child_system == 'keras_tg':
    result = child_keras_tg(
      args.child_model, json.loads(args.child_config), args.inputs, args.steps, args.warmup
    )
    print(RESULT_PREFIX + json.dumps(result), flush=True)
    return
  body = {'tf_gspmd': child_tf_gspmd, 'dtensor': child_dtensor, 'xla': child_xla_backend}[
    args.child_system
  ]
  result = body(spec, args.steps, args.warmup)
  print(RESULT_PREFIX + json.dumps(result), flush=True)


# ================================ parent: spawn, check, print ================================
def jax_python() -> Optional[str]:
  """A Python with jax and Keras: $TF_GSPMD_JAX_PYTHON (`make test` passes .venv's), else the
  repository's .jaxenv (jax and Keras without TensorFlow; `make bench` makes it)."""
  for candidate in (
    os.environ.get('TF_GSPMD_JAX_PYTHON'),
    os.path.join(ROOT, '.jaxenv', 'bin', 'python'),
  ):
    if candidate and os.path.exists(candidate):
      return candidate
  return None


def spawn(model: str, system: str, cfg: dict, args, inputs: Optional[str] = None) -> dict:
  """Run one (model, system) child; its result dict, or errors filled in on failure."""
  names = RUNNERS[system]
  python, env = sys.executable, None
  if system == 'keras_jax':
    python = jax_python()
    if python is None or inputs is None or not os.path.exists(inputs):
      why = (
        'no JAX venv (.jaxenv or $TF_GSPMD_JAX_PYTHON)'
        if python is None
        else 'no weights from the tf_gspmd run'
      )
      return {n: {'error': f'error: {why}'} for n in names}
    env = dict(
      os.environ,
      KERAS_BACKEND='jax',
      XLA_FLAGS=f'--xla_force_host_platform_device_count={NUM_DEVICES}',
    )
  cmd = [
    python,
    os.path.abspath(__file__),
    '--child-model',
    model,
    '--child-system',
    system,
    '--child-config',
    json.dumps(cfg),
    '--steps',
    str(args.steps),
    '--warmup',
    str(args.warmup),
  ] + (['--inputs', inputs] if inputs else [])
  start = time.perf_counter()
  try:
    proc = quick_children.run(cmd, env, ROOT, args.timeout, args.quick)
  except subprocess.TimeoutExpired:
    return {n: {'error': f'error: timed out after {args.timeout:.0f} s'} for n in names}
  print(f'  {model} / {system}: {time.perf_counter() - start:.0f} s', file=sys.stderr)
  for line in proc.stdout.splitlines():
    if line.startswith(RESULT_PREFIX):
      return json.loads(line[len(RESULT_PREFIX) :])
  tail = [t for t in proc.stderr.strip().splitlines() if t.strip()][-1:] or ['no output']
  sys.stderr.write(proc.stderr[-3000:])
  return {n: {'error': f'error: exit {proc.returncode}: {tail[0][:80]}'} for n in names}


def loss_verdict(
  what: str, got: List[float], want: List[float], exact: Optional[List[float]] = None
) -> Optional[tuple]:
  """(ok, error, note): the oracle on two loss sequences (their common prefix, as float32:
  the losses are float32 values carried as Python floats), or None if one is empty.

  With `exact` (the same steps in float64), by the oracle's float64 rule: `got` no further
  from float64 than twice `want`, plus the float32 bound; error is still got against want.
  """
  import numpy as np

  n = min(len(got), len(want), len(exact) if exact else len(got))
  if n == 0:
    return None
  check = oracle_file.load()
  g, w = np.float32(got[:n]), np.float32(want[:n])
  error = check.relative_error(g, w)
  if not exact:
    verdict = check.check(g, w, what)
    return verdict.ok, error, '' if verdict.ok else str(verdict)
  e = np.float64(exact[:n])
  note = (
    f'to float64 {check.relative_error(np.float64(g), e):.1e} vs '
    f'{check.relative_error(np.float64(w), e):.1e}'
  )
  try:
    check.assert_close_to_float64(g, w, e, what)
  except AssertionError as failure:
    return False, error, str(failure)
  return True, error, note


def fmt_ms(run: dict) -> str:
  if run.get('error'):
    return run['error']
  return f'{run["step_ms"]:.1f}' if run.get('step_ms') is not None else '-'


def fmt_ratio(part: dict, whole: dict) -> str:
  if part.get('step_ms') is None or whole.get('step_ms') is None:
    return '-'
  return f'{part["step_ms"] / whole["step_ms"]:.2f}'


def mesh_label(name: str) -> str:
  shape, axes = MESHES[name]
  return '(' + ', '.join(f'{a}={s}' for a, s in zip(axes, shape)) + ')'


def table(rows: List[List[str]], header: List[str]) -> str:
  widths = [max(len(r[i]) for r in rows + [header]) for i in range(len(header))]

  def line(cells):
    return ' | '.join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()

  return '\n'.join([line(header), '-+-'.join('-' * w for w in widths)] + [line(r) for r in rows])


HEADER = [
  'model',
  'mesh',
  'build s',
  'step ms unpartitioned',
  'step ms tf_gspmd',
  'ratio',
  'step ms plain-TF unpart.',
  'step ms DTensor',
  'ratio',
  'collectives/step',
  'bytes/step',
  'step ms XLA unpart.',
  'step ms tf_gspmd xla',
  'ratio',
  'step ms Keras-JAX unpart.',
  'step ms Keras-JAX',
  'ratio',
]
# Issue #15's step-time goals (checked, never tuned for): partitioned / unpartitioned of the
# transformer with each backend, and tf_gspmd against its peers (all models).
GOALS = {
  'transformer ratio, TF backend': 1.3,
  'transformer ratio, XLA backend': 1.0,
  'tf_gspmd / DTensor': 0.7,
  'tf_gspmd / Keras-JAX': 1.0,
}


def describe(name: str, cfg: dict) -> str:
  if name == 'mlp':
    return (
      f'batch {cfg["batch"]}, {cfg["features"]} -> {cfg["width"]} x{cfg["depth"]} -> '
      f'{cfg["classes"]}, Adam'
    )
  if name == 'transformer':
    return (
      f'batch {cfg["batch"]}, seq {cfg["seq"]}, vocab {cfg["vocab"]}, d_model '
      f'{cfg["d_model"]}, heads {cfg["heads"]}, ff {cfg["ff"]}, layers {cfg["layers"]}, Adam'
    )
  return (
    f'batch {cfg["batch"]}, {cfg["image"]}x{cfg["image"]}x{cfg["channels"]}, filters '
    f'{cfg["filters"]}, BatchNorm, MaxPool, Adam'
  )


def merge_repeats(runs: List[dict]) -> dict:
  """One result from --repeat runs: losses, build and collectives of the first run, each
  runner's step time the median over the runs that timed it (an error only if all failed)."""
  merged = json.loads(json.dumps(runs[0]))
  for runner, first in merged.items():
    if runner == 'collectives':
      continue
    timed = [r[runner]['step_ms'] for r in runs if r.get(runner, {}).get('step_ms') is not None]
    if timed:
      first.update(step_ms=statistics.median(timed), step_ms_runs=timed, error=None)
      if first.get('losses') is None:
        first.update(
          next(r[runner] for r in runs if r[runner].get('step_ms') is not None),
          step_ms=statistics.median(timed),
          step_ms_runs=timed,
        )
  return merged


def _ms(run: dict) -> Optional[float]:
  return run.get('step_ms') if not run.get('error') else None


def goal_lines(letter: str, name: str, result: dict) -> List[str]:
  """Issue #15's step-time goals for one model, each with its numbers and met / NOT met."""
  lines = []

  def check(what: str, part: dict, whole: dict, goal_key: str):
    a, b = _ms(part), _ms(whole)
    if a is None or b is None:
      lines.append(f'  ({letter}) {name}: {what}: not measured')
      return
    goal = GOALS[goal_key]
    lines.append(
      f'  ({letter}) {name}: {what} = {a:.1f} / {b:.1f} ms = {a / b:.2f} '
      f'(goal <= {goal}: {"met" if a / b <= goal else "NOT met"})'
    )

  if name == 'transformer':
    check(
      'tf_gspmd / unpartitioned, TF backend',
      result['tf_gspmd'],
      result['unpartitioned'],
      'transformer ratio, TF backend',
    )
    check(
      'tf_gspmd / unpartitioned, XLA backend',
      result['tf_gspmd_xla'],
      result['xla_unpartitioned'],
      'transformer ratio, XLA backend',
    )
  check('tf_gspmd / DTensor', result['tf_gspmd'], result['dtensor'], 'tf_gspmd / DTensor')
  check(
    'tf_gspmd (TF backend) / Keras-JAX',
    result['tf_gspmd'],
    result['keras_jax'],
    'tf_gspmd / Keras-JAX',
  )
  check(
    'tf_gspmd (XLA backend) / Keras-JAX',
    result['tf_gspmd_xla'],
    result['keras_jax'],
    'tf_gspmd / Keras-JAX',
  )
  # The same Keras code through keras.distribution on both sides (variables split from birth).
  for runner, backend in (('keras_tg', 'TF backend'), ('keras_tg_xla', 'XLA backend')):
    if runner in result and not result[runner].get('error') == 'not run':
      check(
        f'tf_gspmd.keras ({backend}) / Keras-JAX',
        result[runner],
        result['keras_jax'],
        'tf_gspmd / Keras-JAX',
      )
  return lines


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--models', default='a,b,c', help='comma list of a (mlp), b, c')
  parser.add_argument('--steps', type=int, default=None, help='timed steps (default 15; quick 2)')
  parser.add_argument('--warmup', type=int, default=None, help='untimed calls after the build')
  parser.add_argument('--quick', action='store_true', help='tiny sizes, 2 steps, model (a) only')
  parser.add_argument('--timeout', type=float, default=420, help='seconds per subprocess')
  parser.add_argument('--json', help='also write the raw results here')
  parser.add_argument(
    '--systems',
    default=','.join(SYSTEMS),
    help=f'comma list of {", ".join(SYSTEMS)} (tf_gspmd always runs)',
  )
  parser.add_argument(
    '--repeat',
    type=int,
    default=1,
    help='run every child this many times, systems in turn; each step time is '
    'the median over the runs of their medians',
  )
  parser.add_argument(
    '--intra-op-threads',
    type=int,
    default=None,
    help="TF's intra-op threads in every TF child, partitioned and "
    'unpartitioned alike (default: TF picks, one per core)',
  )
  parser.add_argument('--inputs', help=argparse.SUPPRESS)
  parser.add_argument('--child-model', help=argparse.SUPPRESS)
  parser.add_argument('--child-system', help=argparse.SUPPRESS)
  parser.add_argument('--child-config', help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.steps is None:
    args.steps = 2 if args.quick else 15
  if args.warmup is None:
    args.warmup = 0 if args.quick else 2
  if args.child_model:
    run_child(args)
    return 0
  if args.intra_op_threads:
    os.environ[INTRA_OP_ENV] = str(args.intra_op_threads)  # children inherit it

  letters = ['a'] if args.quick and args.models == 'a,b,c' else args.models.split(',')
  unknown = [m for m in letters if m not in MODELS]
  if unknown:
    parser.error(f'unknown models {unknown}; choose from {sorted(MODELS)}')
  systems = ['tf_gspmd'] + [s for s in args.systems.split(',') if s and s != 'tf_gspmd']
  unknown = [s for s in systems if s not in SYSTEMS]
  if unknown:
    parser.error(f'unknown systems {unknown}; choose from {list(SYSTEMS)}')
  sizes = CONFIGS['quick' if args.quick else 'full']
  print(
    f'step_time: {NUM_DEVICES} logical CPUs on {os.cpu_count()} cores; {args.steps} timed '
    f'steps after {args.warmup} warm-up calls; {args.repeat} run(s) per system',
    file=sys.stderr,
  )
  results, rows, notes, mismatches, goals = {}, [], [], [], []
  for letter in letters:
    name = MODELS[letter]
    cfg = sizes[name]
    with tempfile.TemporaryDirectory() as tmp:
      inputs = os.path.join(tmp, 'inputs.npz')  # written by the tf_gspmd child
      runs = [
        {
          k: v
          for system in systems
          for k, v in spawn(
            name, system, cfg, args, inputs if system in KERAS_INPUT_SYSTEMS else None
          ).items()
        }
        for _ in range(args.repeat)
      ]
    result = merge_repeats(runs)
    for system in SYSTEMS:
      for runner in RUNNERS[system]:
        result.setdefault(runner, {'error': 'not run'} if system not in systems else {})
    results[name] = {'config': cfg, **result}
    unpart, gspmd = result['unpartitioned'], result['tf_gspmd']
    plain, dt = result['plain'], result['dtensor']
    xla_unpart, gspmd_xla = result['xla_unpartitioned'], result['tf_gspmd_xla']
    kj_unpart, kj = result['keras_jax_unpartitioned'], result['keras_jax']
    ktg, ktg_xla = result['keras_tg'], result['keras_tg_xla']
    coll = result.get('collectives')
    rows.append(
      [
        f'({letter}) {name}',
        mesh_label(name),
        f'{gspmd["build_s"]:.1f}' if gspmd.get('build_s') else '-',
        fmt_ms(unpart),
        fmt_ms(gspmd),
        fmt_ratio(gspmd, unpart),
        fmt_ms(plain),
        fmt_ms(dt),
        fmt_ratio(dt, plain),
        str(coll['count']) if coll else '-',
        f'{coll["bytes"]:,}' if coll else '-',
        fmt_ms(xla_unpart),
        fmt_ms(gspmd_xla),
        fmt_ratio(gspmd_xla, xla_unpart),
        fmt_ms(kj_unpart),
        fmt_ms(kj),
        fmt_ratio(kj, kj_unpart),
      ]
    )
    goals += goal_lines(letter, name, result)
    checks = []
    for what, got, want in (
      ('tf_gspmd vs Keras unpartitioned', gspmd, unpart),
      ('DTensor vs plain-TF unpartitioned', dt, plain),
      ('plain-TF twin vs Keras unpartitioned', plain, unpart),
      ('tf_gspmd xla vs Keras unpartitioned', gspmd_xla, unpart),
      ('XLA unpartitioned vs Keras unpartitioned', xla_unpart, unpart),
      ('Keras-JAX vs Keras-JAX unpartitioned', kj, kj_unpart),
      ('tf_gspmd.keras (TF backend) vs Keras unpartitioned', ktg, unpart),
      ('tf_gspmd.keras (xla) vs Keras unpartitioned', ktg_xla, unpart),
      (
        'Keras-JAX unpartitioned vs Keras unpartitioned'
        + (', first step' if name in SPARSE_GRADIENT_MODELS else ''),
        kj_unpart,
        unpart,
      ),
    ):
      got_losses, want_losses = got.get('losses') or [], want.get('losses') or []
      if what.endswith('first step'):
        got_losses, want_losses = got_losses[:1], want_losses[:1]
      # The float64 run is Keras-TF's step; Keras-JAX's differs where its gradient is sparse.
      exact = (
        None
        if ('Keras-JAX' in what and name in SPARSE_GRADIENT_MODELS)
        else (result.get('float64', {}).get('losses'))
      )
      verdict = loss_verdict(what, got_losses, want_losses, exact)
      if verdict is None:
        continue
      ok, error, note = verdict
      checks.append(
        f'{what} {error:.1e}' + (f' ({note})' if ok and note else '') + ('' if ok else ' MISMATCH')
      )
      if not ok:
        mismatches.append(f'({letter}) {note}')
    build = ', '.join(
      f'{label} {r["build_s"]:.1f} s'
      for label, r in (
        ('tf_gspmd', gspmd),
        ('unpartitioned', unpart),
        ('DTensor', dt),
        ('plain-TF', plain),
        ('tf_gspmd xla', gspmd_xla),
        ('XLA unpartitioned', xla_unpart),
        ('Keras-JAX', kj),
        ('Keras-JAX unpartitioned', kj_unpart),
        ('tf_gspmd.keras', ktg),
        ('tf_gspmd.keras xla', ktg_xla),
      )
      if r.get('build_s')
    )
    notes.append(f'({letter}) {name}: {describe(name, cfg)}')
    notes.append(f'    build (first call): {build}')
    if coll:
      fused = coll.get('sums', {})
      notes.append(
        '    collectives: '
        + ', '.join(
          f'{k} x{v}' + (f' ({fused[k]} sums)' if fused.get(k, v) != v else '')
          for k, v in sorted(coll['kinds'].items())
        )
      )
    rule = (
      "float64 rule: within 2 x the second run's distance to float64 + the bound"
      if result.get('float64', {}).get('losses')
      else f'float64 run {result.get("float64", {}).get("error") or "missing"}: bound alone'
    )
    notes.append(
      f'    losses over {len(unpart.get("losses") or [])} steps, normwise relative '
      f'error (oracle, bound {oracle_file.load().bound("float32"):g}; {rule}): '
      + ('; '.join(checks) or 'nothing to compare')
    )
  print(table(rows, HEADER))
  print('\n'.join(notes))
  print(
    'vs peers and goals (issue #15; step medians'
    + (f', median of {args.repeat} runs' if args.repeat > 1 else '')
    + '):'
  )
  print('\n'.join(goals))
  if args.json:
    with open(args.json, 'w') as f:
      json.dump(results, f, indent=1)
  if mismatches:
    print('MISMATCH: ' + '; '.join(mismatches))
    return 1
  return 0


if __name__ == '__main__':
  sys.exit(main())
