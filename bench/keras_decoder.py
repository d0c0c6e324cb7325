"""A Keras-Hub-style decoder under Keras Hub's own kind of layout map: tf_gspmd beside Keras on JAX.

The model (issue #41): a Llama-shaped causal decoder written with Keras 3 layers and
`keras.ops` only (no keras_hub dependency), so the same code runs on both backends: token
embedding, per layer an RMS norm, grouped-query attention (EinsumDense query/key/value with
4 query and 2 key-value heads, a causal softmax, EinsumDense output), an RMS norm and a gated
MLP (SiLU gate x up, down), a final norm and a vocabulary head. Vocabulary 256, 2 layers,
hidden 64, intermediate 128; Adam; batch 8 x 16 tokens; sparse cross-entropy.

Layouts on a 2x4 ('batch', 'model') mesh, as Keras Hub's `LlamaBackbone.get_layout_map`
writes them (the data axis also splits hidden dims, FSDP-style):

  token embedding            ('model', 'batch')
  query / key / value kernel ('model', 'batch', None)
  attention output kernel    ('model', None, 'batch')
  gate / up kernel           ('batch', 'model')
  down kernel                ('model', 'batch')

Sides (each in its own process, the machine otherwise idle):

  jax_none / jax_dp / jax_mp   Keras 3 on JAX: no distribution, DataParallel, ModelParallel
  tf_none                      plain Keras on TF, one device
  tg_dp / tg_mp                tf_gspmd (tf_gspmd.keras.enable()), TF backend
  tgx_mp                       tf_gspmd, backend='xla'
  tg_mp_floor                  tg_mp with every collective replaced by a local op of the
                               same shapes (all-reduce: identity; all-gather: k copies
                               concatenated; all-to-all: its chunks moved locally;
                               permute and broadcast: identity): TF's kernels for the same
                               per-device program on 8 devices, nothing communicated. Its
                               numbers are not the model's (its loss is not checked); its
                               step is the TF backend's floor for this program on this
                               machine (issue #41: what the TF backend cannot go below).
                               The same process then times TF's own collective ops (no
                               tf_gspmd): a chain of 60 dependent all-gathers and of 60
                               all-reduces of 64 floats over the 8 devices, ordered by a
                               token per device as the TF backend orders them.

The JAX sides count the collectives of their compiled train step (XLA's HLO after its
optimizations, dumped to a temporary directory): with TF's cost per collective and the floor
above, the least the TF backend's step could cost if it ran no more collectives than XLA's
own partitioner does.

Per side: the first `train_on_batch` (build + compile + run) in seconds, then the median of
--steps more steps in ms, and the first loss (every side starts from the same weights, saved by
the first TF side, so the losses agree to rounding: checked by the oracle against tf_none).

The TF sides split the CPU with `tg.configure_cpu_devices(8, threads=T)`: T = --tf-threads
(1 by default: this model's steps gain from it, docs/api.md; 'default' leaves TF's own
pools, as plain `tf.config.set_logical_device_configuration` does).

  python bench/keras_decoder.py [--steps 10] [--sides jax_mp tg_mp ...] [--tf-threads 1]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, 'bench'))
from limit import cpu_model  # noqa: E402  (sibling: stdlib only at import)

JAX_PYTHON = os.environ.get('TF_GSPMD_JAX_PYTHON', os.path.join(ROOT, '.jaxenv', 'bin', 'python'))
SIDES = ('tf_none', 'tg_dp', 'tg_mp', 'tgx_mp', 'tg_mp_floor', 'jax_none', 'jax_dp', 'jax_mp')
RESULT = 'KERAS_DECODER_RESULT '
VOCAB, LAYERS, HIDDEN, HEADS, KV_HEADS, INTERMEDIATE = 256, 2, 64, 4, 2, 128
BATCH, TOKENS, DEVICES = 8, 16, 8
HEAD_DIM = HIDDEN // HEADS

# Keras Hub's Llama map, keyed by this model's variable paths ('batch' is the data axis).
# Keras matches a key against the whole path (re.fullmatch), as Keras Hub's own keys expect
# (`.*attention.*(query|key|value).kernel`): each key below names every layer's variable.
LAYOUT = {
  r'token_embedding/embeddings': ('model', 'batch'),
  r'.*_attention/(query|key|value)/kernel': ('model', 'batch', None),
  r'.*_attention/attention_output/kernel': ('model', None, 'batch'),
  r'.*_mlp/(gate|up)/kernel': ('batch', 'model'),
  r'.*_mlp/down/kernel': ('model', 'batch'),
}


# --- the model (keras.ops only: runs on either backend) -----------------------------------------
def _layers():
  import keras
  from keras import ops

  class RMSNorm(keras.layers.Layer):
    def build(self, shape):
      self.scale = self.add_weight(name='scale', shape=(shape[-1],), initializer='ones')

    def call(self, x):
      return x * ops.rsqrt(ops.mean(ops.square(x), axis=-1, keepdims=True) + 1e-6) * self.scale

  class Attention(keras.layers.Layer):
    def __init__(self, **kw):
      super().__init__(**kw)
      dense = keras.layers.EinsumDense
      self.query = dense('btm,mnh->btnh', (None, HEADS, HEAD_DIM), name='query')
      self.key = dense('btm,mnh->btnh', (None, KV_HEADS, HEAD_DIM), name='key')
      self.value = dense('btm,mnh->btnh', (None, KV_HEADS, HEAD_DIM), name='value')
      self.attention_output = dense('btnh,nhm->btm', (None, HIDDEN), name='attention_output')

    def build(self, shape):
      for layer in (self.query, self.key, self.value):
        layer.build(shape)
      self.attention_output.build(tuple(shape[:2]) + (HEADS, HEAD_DIM))

    def call(self, x):
      q, k, v = self.query(x), self.key(x), self.value(x)
      k = ops.repeat(k, HEADS // KV_HEADS, axis=2)  # grouped-query: each kv head serves two
      v = ops.repeat(v, HEADS // KV_HEADS, axis=2)
      scores = ops.einsum('bqnh,bknh->bnqk', q, k) / float(HEAD_DIM) ** 0.5
      causal = ops.tril(ops.ones((TOKENS, TOKENS), dtype='bool'))
      scores = ops.where(causal[None, None], scores, ops.full_like(scores, -1e9))
      weights = ops.softmax(scores, axis=-1)
      return self.attention_output(ops.einsum('bnqk,bknh->bqnh', weights, v))

  class MLP(keras.layers.Layer):
    def __init__(self, **kw):
      super().__init__(**kw)
      self.gate = keras.layers.Dense(INTERMEDIATE, use_bias=False, name='gate')
      self.up = keras.layers.Dense(INTERMEDIATE, use_bias=False, name='up')
      self.down = keras.layers.Dense(HIDDEN, use_bias=False, name='down')

    def build(self, shape):
      self.gate.build(shape)
      self.up.build(shape)
      self.down.build(tuple(shape[:-1]) + (INTERMEDIATE,))

    def call(self, x):
      return self.down(ops.silu(self.gate(x)) * self.up(x))

  return RMSNorm, Attention, MLP


def build_model(seed: int = 0):
  import keras

  RMSNorm, Attention, MLP = _layers()
  keras.utils.set_random_seed(seed)
  tokens = keras.Input((TOKENS,), dtype='int32')
  x = keras.layers.Embedding(VOCAB, HIDDEN, name='token_embedding')(tokens)
  for i in range(LAYERS):
    x = x + Attention(name=f'layer_{i}_attention')(RMSNorm(name=f'layer_{i}_attention_norm')(x))
    x = x + MLP(name=f'layer_{i}_mlp')(RMSNorm(name=f'layer_{i}_mlp_norm')(x))
  x = RMSNorm(name='final_norm')(x)
  logits = keras.layers.Dense(VOCAB, use_bias=False, name='head')(x)
  model = keras.Model(tokens, logits, name='decoder')
  model.compile(
    optimizer=keras.optimizers.Adam(1e-3),
    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
  )
  return model


def batch():
  import numpy as np

  rng = np.random.RandomState(0)
  x = rng.randint(0, VOCAB, (BATCH, TOKENS)).astype(np.int32)
  return x, np.roll(x, -1, axis=1)


def distribution(keras, kind: str):
  """None, DataParallel or ModelParallel with the Keras-Hub-style map, on 8 devices."""
  if kind == 'none':
    return None
  devices = keras.distribution.list_devices()[:DEVICES]
  if kind == 'dp':
    return keras.distribution.DataParallel(devices=devices)
  mesh = keras.distribution.DeviceMesh((2, 4), ['batch', 'model'], devices)
  layout_map = keras.distribution.LayoutMap(mesh)
  for pattern, axes in LAYOUT.items():
    layout_map[pattern] = axes
  return keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name='batch')


# --- one side, in its own process ---------------------------------------------------------------
def run_side(side: str, steps: int, weights_path: str) -> dict:
  if not side.startswith('jax'):
    from tf_gspmd.runtime.cpu_devices import configure_cpu_devices

    threads = os.environ.get('KERAS_DECODER_TF_THREADS', '1')
    configure_cpu_devices(DEVICES, threads=None if threads == 'default' else int(threads))
  import keras
  import numpy as np

  if side.startswith('tg'):
    import tf_gspmd

    tf_gspmd.keras.enable('xla' if side.startswith('tgx') else 'tf')
  if side.endswith('_floor'):
    _communicate_nothing()
  kind = side.split('_')[1]
  chosen = distribution(keras, kind)
  if chosen is not None:
    keras.distribution.set_distribution(chosen)
  model = build_model()
  _check_layout_keys(model)
  if os.path.exists(weights_path):
    saved = np.load(weights_path)
    model.set_weights([saved[f'w{i}'] for i in range(len(saved.files))])
  else:
    np.savez(weights_path, **{f'w{i}': w for i, w in enumerate(model.get_weights())})
  x, y = batch()
  dump = os.environ.get('KERAS_DECODER_DUMP')
  start = time.perf_counter()
  first_loss = float(model.train_on_batch(x, y))
  first = time.perf_counter() - start
  times = []
  cpu = time.process_time()
  for _ in range(steps):
    start = time.perf_counter()
    model.train_on_batch(x, y)
    times.append(time.perf_counter() - start)
  result = {
    'side': side,
    'first_s': first,
    'step_ms': 1e3 * sorted(times)[len(times) // 2],
    'step_cpu_ms': 1e3 * (time.process_time() - cpu) / steps,
    'first_loss': first_loss,
  }
  if dump:
    result['collectives'] = _hlo_collectives(dump)
  if side.endswith('_floor'):
    result['tf_collective_ms'] = _tf_collective_ms()
  return result


_HLO_COLLECTIVE = re.compile(
  r' (all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute)(-start)?\('
)


def _hlo_collectives(dump: str) -> dict:
  """Collectives by kind in XLA's optimized HLO of the train step (the largest such module
  in the dump directory: the step itself, not the initializers)."""
  names = [n for n in os.listdir(dump) if n.endswith('train_step.cpu_after_optimizations.txt')]
  if not names:
    return {}
  path = max((os.path.join(dump, n) for n in names), key=os.path.getsize)
  with open(path) as f:
    kinds = [m.group(1) for m in _HLO_COLLECTIVE.finditer(f.read())]
  return {kind: kinds.count(kind) for kind in sorted(set(kinds))}


def _tf_collective_ms(chain: int = 60) -> dict:
  """ms per collective of TF's own V2 collective ops over the 8 devices (no tf_gspmd): a
  chain of `chain` dependent ones of 64 floats, each device's ordered by its own token."""
  import numpy as np
  import tensorflow as tf

  from tf_gspmd.tf_private import collective_ops  # TF's own collective ops (private module)

  devices = [f'/CPU:{d}' for d in range(DEVICES)]
  tokens = []
  for device in devices:
    with tf.device(device):
      tokens.append(tf.Variable(0.0, name='token'))

  def chained(kind: str, group_key: int):
    @tf.function
    def run(pieces):
      out = []
      for device, piece, token in zip(devices, pieces, tokens):
        with tf.device(device):
          y = piece
          for i in range(chain):
            keys = dict(group_size=DEVICES, group_key=group_key, instance_key=i + 1)
            if kind == 'all_gather':
              y = collective_ops.all_gather_v2(y, ordering_token=token.handle, **keys)[:64]
            else:
              y = collective_ops.all_reduce_v2(y, ordering_token=token.handle, **keys) / 8
          out.append(y)
      return out

    return run

  pieces = [tf.constant(np.ones(64, np.float32)) for _ in devices]
  result = {}
  for group_key, kind in enumerate(('all_gather', 'all_reduce'), start=101):
    run = chained(kind, group_key)
    run(pieces)
    times = []
    cpu = time.process_time()
    for _ in range(10):
      start = time.perf_counter()
      run(pieces)
      times.append(time.perf_counter() - start)
    result[kind] = 1e3 * sorted(times)[len(times) // 2] / chain
    result[f'{kind}_cpu'] = 1e3 * (time.process_time() - cpu) / (10 * chain)
  return result


def _communicate_nothing() -> None:
  """The TF backend's collectives as local ops of the same shapes (the `tg_mp_floor` side):
  the per-device program's own kernels, without the communication between devices."""
  import tensorflow as tf

  from tf_gspmd.runtime import collectives

  def all_gather(self, x, axes, dim):
    k = self.mesh.axes_size(axes)
    rows = x if x.shape.rank else x[tf.newaxis]
    return tf.concat([rows] * k, axis=dim)

  def all_to_all(self, x, axes, split_dim, concat_dim):
    return tf.concat(tf.split(x, self.mesh.axes_size(axes), axis=split_dim), axis=concat_dim)

  local = collectives.TFCollectives
  local._all_reduce = lambda self, x, axes, op: tf.identity(x)
  local._all_gather = all_gather
  local._all_to_all = all_to_all
  local._permute = lambda self, x, pairs, family: tf.identity(x)
  local._broadcast = lambda self, x, axes, root: tf.identity(x)


def _check_layout_keys(model) -> None:
  """Every LAYOUT key names some variable (as Keras matches it): a key that names none would
  leave its weights replicated on every side and the bench measuring another layout."""
  import re

  paths = [v.path for v in model.variables]
  unused = [key for key in LAYOUT if not any(re.fullmatch(key, p) for p in paths)]
  if unused:
    raise SystemExit(f'keras_decoder: LAYOUT keys {unused} match no variable of {paths[:6]}...')


def _child(side: str, steps: int, weights_path: str) -> dict:
  jax = side.startswith('jax')
  python = JAX_PYTHON if jax else sys.executable
  if jax and not os.path.exists(python):
    return {'side': side, 'error': f'{python} does not exist'}
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL='2', PYTHONPATH=ROOT, TF_GSPMD_PROGRESS='0')
  env['KERAS_BACKEND'] = 'jax' if jax else 'tensorflow'
  cmd = [python, __file__, '--child', side, '--steps', str(steps), '--weights', weights_path]
  with tempfile.TemporaryDirectory() as dump:
    if jax:
      flags = f'--xla_force_host_platform_device_count={DEVICES} --xla_dump_to={dump}'
      env.update(XLA_FLAGS=flags, KERAS_DECODER_DUMP=dump)
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
  for line in done.stdout.splitlines():
    if line.startswith(RESULT):
      return json.loads(line[len(RESULT) :])
  tail = [t for t in done.stderr.strip().splitlines() if t.strip()][-1:] or ['no output']
  return {'side': side, 'error': f'exit {done.returncode}: {tail[0][:160]}'}


def _loss_check(runs: dict) -> str:
  """Every side's first loss against plain Keras on TF's, by the oracle (normwise, f32)."""
  want = runs.get('tf_none', {}).get('first_loss')
  if want is None:
    return 'first losses: no tf_none run to compare with'
  checked = {s: r for s, r in runs.items() if 'first_loss' in r and not s.endswith('_floor')}
  worst = max(abs(r['first_loss'] - want) / abs(want) for r in checked.values())
  losses = ', '.join(f'{side} {r["first_loss"]:.7f}' for side, r in checked.items())
  verdict = 'ok' if worst <= 1e-5 else 'MISMATCH'
  return f'first losses ({losses}): worst relative error vs tf_none {worst:.2e} ({verdict})'


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--steps', type=int, default=10)
  parser.add_argument('--sides', nargs='+', default=list(SIDES), choices=SIDES)
  parser.add_argument('--child', choices=SIDES)
  parser.add_argument('--weights', default='')
  parser.add_argument(
    '--tf-threads',
    default='1',
    help="TF's inter-op and intra-op threads in the TF sides (tg.configure_cpu_devices' "
    "threads; 'default': TF's own)",
  )
  args = parser.parse_args(argv)
  if args.child:
    print(RESULT + json.dumps(run_side(args.child, args.steps, args.weights)), flush=True)
    return 0
  os.environ['KERAS_DECODER_TF_THREADS'] = args.tf_threads
  print(
    f'cpu: {cpu_model()}, {os.cpu_count()} cores; {DEVICES} logical devices; TF sides: '
    f'tg.configure_cpu_devices({DEVICES}, threads={args.tf_threads})'
  )
  print(
    f'model: Llama-shaped decoder, vocab {VOCAB}, {LAYERS} layers, hidden {HIDDEN}, '
    f'{HEADS}/{KV_HEADS} heads, intermediate {INTERMEDIATE}; Adam; batch {BATCH} x {TOKENS}'
  )
  runs = {}
  with tempfile.TemporaryDirectory() as tmp:
    weights_path = os.path.join(tmp, 'weights.npz')
    # A TF side first: it saves the weights every other side starts from.
    order = sorted(args.sides, key=lambda s: s.startswith('jax'))
    for side in order:
      runs[side] = _child(side, args.steps, weights_path)
  print(f'  {"side":12s} {"step":>10s} {"first step":>11s}')
  for side in args.sides:
    r = runs[side]
    if 'error' in r:
      print(f'  {side:12s} {r["error"]}')
      continue
    print(f'  {side:12s} {r["step_ms"]:8.1f} ms {r["first_s"]:9.2f} s')
  pairs = (('tg_mp', 'jax_mp'), ('tgx_mp', 'jax_mp'), ('tg_dp', 'jax_dp'))
  for ours, peer in pairs + (('tg_mp_floor', 'jax_mp'), ('tg_mp', 'tg_mp_floor')):
    if 'step_ms' in runs.get(ours, {}) and 'step_ms' in runs.get(peer, {}):
      a, b = runs[ours], runs[peer]
      print(
        f'  {ours} / {peer}: step {a["step_ms"] / b["step_ms"]:.2f}x, '
        f'first step {a["first_s"] / b["first_s"]:.2f}x'
      )
  print(_floor(runs))
  print(_loss_check(runs))
  return 0


def _floor(runs: dict) -> str:
  """What the TF backend's step cannot go below for this model, two ways: TF's collectives
  alone, as many as XLA's own partitioner runs for Keras on JAX (wall: a chain of them);
  and the CPU seconds of the program without communication plus those collectives' CPU
  seconds, spread over every core (the step is CPU-bound: 8 programs on the cores)."""
  floor, peer = runs.get('tg_mp_floor', {}), runs.get('jax_mp', {})
  if 'tf_collective_ms' not in floor or not peer.get('collectives'):
    return 'TF backend floor: needs the tg_mp_floor and jax_mp sides'
  count = sum(peer['collectives'].values())
  per = floor['tf_collective_ms']
  wall = count * min(per['all_gather'], per['all_reduce'])
  cpu = count * min(per['all_gather_cpu'], per['all_reduce_cpu'])
  cores = os.cpu_count() or 1
  least = (floor['step_cpu_ms'] + cpu) / cores
  kinds = ', '.join(f'{n} {k}' for k, n in peer['collectives'].items())
  jax_ms = peer['step_ms']
  return (
    f"TF backend floor: XLA runs {count} collectives per step for jax_mp ({kinds}). TF's own "
    f'collectives (a chain of 60 over 8 devices, no tf_gspmd): {per["all_gather"]:.3f} / '
    f'{per["all_reduce"]:.3f} ms per all-gather / all-reduce ({per["all_gather_cpu"]:.3f} / '
    f'{per["all_reduce_cpu"]:.3f} CPU ms); {count} of them {wall:.1f} ms in a chain '
    f"({wall / jax_ms:.2f}x jax_mp's step). CPU: the program without communication "
    f'{floor["step_cpu_ms"]:.1f} CPU ms per step + {count} collectives {cpu:.1f} CPU ms, over '
    f'{cores} cores: at least {least:.1f} ms, {least / jax_ms:.2f}x jax_mp'
  )


if __name__ == '__main__':
  sys.exit(main())
