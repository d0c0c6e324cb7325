"""SavedModel export of partitioned programs (issue #10, points 1, 2 and the device check of 4).

The parent (8 logical CPUs) partitions four models, exports them and computes
their unpartitioned outputs; one fresh interpreter that never imports
tf_gspmd loads every export with plain `tf.saved_model.load` and compares;
another with only 4 devices must fail naming both counts. `saved_model_cli`
reads the exports. The XLA export is reloaded, recompiled on 8 PJRT devices
and its annotated graph re-captured.
"""

import contextlib
import json
import os
import pathlib
import re
import select
import subprocess
import sys
import time

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_gspmd as tg
from tf_gspmd.sharding import named_for_rank
from tf_gspmd.testing import assert_close

from helpers import run_python

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / 'examples' / 'keras'))
sys.path.insert(0, str(ROOT / 'examples'))
import moe  # noqa: E402
import transformer  # noqa: E402

CLI = str(pathlib.Path(sys.executable).parent / 'saved_model_cli')


def run_fresh(script: str, devices: int, timeout: int = 240) -> subprocess.CompletedProcess:
  """`script` in a new interpreter with `devices` logical CPUs; tf_gspmd is NOT importable."""
  head = (
    'import os, sys, json\nimport numpy as np\nimport tensorflow as tf\n'
    'tf.config.set_logical_device_configuration(tf.config.list_physical_devices("CPU")[0], '
    f'[tf.config.LogicalDeviceConfiguration()] * {devices})\n'
  )
  env = {k: v for k, v in os.environ.items() if k != 'PYTHONPATH'}
  env['TF_CPP_MIN_LOG_LEVEL'] = '2'
  return subprocess.run(
    [sys.executable, '-c', head + script],
    cwd='/',
    env=env,
    capture_output=True,
    text=True,
    timeout=timeout,
    check=False,
  )


# --- the models ---------------------------------------------------------------------------------
def transformer_forward(mesh):
  """The demo transformer (Megatron layout over 'model', batch over 'data'), inference."""
  model, _ = transformer.build(seed=0)
  transformer.layout(mesh).apply(model)

  @tf.function
  def forward(tokens):
    return model(tg.shard(tokens, mesh, tg.P('data', None)), training=False)

  tokens, _ = transformer.batch(seed=1)
  return forward, (tokens,)


def cnn_forward(mesh):
  """Image height split over 'h': both 3x3 convs and the pool exchange halos."""
  keras.utils.set_random_seed(0)
  model = keras.Sequential(
    [
      keras.Input((16, 12, 3)),
      keras.layers.Conv2D(8, 3, padding='same', activation='relu', name='conv_0'),
      keras.layers.MaxPooling2D(2, name='pool_0'),
      keras.layers.Conv2D(8, 3, padding='same', activation='relu', name='conv_1'),
      keras.layers.GlobalAveragePooling2D(),
      keras.layers.Dense(4, name='logits'),
    ]
  )

  @tf.function
  def forward(images):
    return model(tg.shard(images, mesh, tg.P('data', 'h', None, None)), training=False)

  images = np.random.RandomState(0).randn(4, 16, 12, 3).astype(np.float32)
  return forward, (images,)


def moe_forward(mesh):
  """GShard MoE layer: groups and experts on 'model', tokens moved by all-to-all."""
  w = moe.weights(0)
  moe.annotate(w, mesh)

  @tf.function
  def forward(x):
    return moe.moe_layer(x, w, mesh)

  x, _ = moe.batch(seed=0)
  return forward, (x,)


MODELS = {
  'transformer': (transformer_forward, ('data', 'model')),
  'cnn': (cnn_forward, ('data', 'h')),
  'moe': (moe_forward, ('data', 'model')),
}


@pytest.fixture(scope='module')
def exports(tmp_path_factory):
  """Every model exported; per model: dir, inputs, unpartitioned outputs, ExportInfo, pf."""
  root = tmp_path_factory.mktemp('exports')
  out = {}
  for name, (make, axes) in MODELS.items():
    mesh = tg.Mesh.create((2, 4), axes)
    forward, args = make(mesh)
    pf = tg.partition(forward, mesh)
    got = pf(*args).numpy()
    want = forward(*args).numpy()
    assert_close(got, want, f'{name} partitioned')
    info = tg.saved_model.save(pf, str(root / name))
    out[name] = dict(dir=str(root / name), args=args, want=want, info=info, pf=pf)
    np.save(root / f'{name}_in.npy', args[0])
    np.save(root / f'{name}_want.npy', want)
  out['keras'] = _keras_export(root)
  return out


def _keras_export(root):
  """A Keras model trained one step with partition_model, exported with its forward pass."""
  mesh = tg.Mesh.create((2, 4), ('data', 'model'))
  keras.utils.set_random_seed(0)
  model = keras.Sequential(
    [
      keras.Input((16,)),
      keras.layers.Dense(32, activation='relu', name='h'),
      keras.layers.Dense(4, name='out'),
    ]
  )
  model.compile(optimizer=keras.optimizers.SGD(0.1), loss='mse')
  layout = tg.LayoutMap(mesh)
  layout[r'.*h/kernel'] = tg.P(None, 'model')
  layout[r'.*out/kernel'] = tg.P('model', None)
  layout.apply(model)
  tg.partition_model(model, mesh)
  rng = np.random.RandomState(0)
  model.fit(
    rng.randn(16, 16).astype(np.float32),
    rng.randn(16, 4).astype(np.float32),
    batch_size=16,
    epochs=1,
    verbose=0,
  )
  x = rng.randn(8, 16).astype(np.float32)
  want = model(x, training=False).numpy()  # the trained weights, unpartitioned
  info = tg.saved_model.save(model, str(root / 'keras'), signatures=(tf.TensorSpec([8, 16]),))
  np.save(root / 'keras_in.npy', x)
  np.save(root / 'keras_want.npy', want)
  return dict(dir=str(root / 'keras'), args=(x,), want=want, info=info)


# --- point 1: serving ---------------------------------------------------------------------------
def test_exports_store_each_distinct_shard_once(exports):
  for name, e in exports.items():
    info = e['info']
    assert info.num_partitions == 8 and info.signatures == ['serving_default'], name
    # Replicated pieces are stored once: the files hold the total bytes (these shapes divide).
    assert info.stored_bytes == info.total_bytes, (name, info)
    data = sum(f.stat().st_size for f in pathlib.Path(e['dir'], 'variables').glob('*.data*'))
    print(
      f'{name}: total {info.total_bytes} B, stored {info.stored_bytes} B, data file {data} B, '
      f'one device {info.per_partition_bytes} B'
    )
    assert info.total_bytes <= data <= info.total_bytes + 16384, (name, data, info.total_bytes)
    meta = tg.saved_model.metadata(e['dir'])
    assert meta['num_partitions'] == 8 and len(meta['signatures']['serving_default']['inputs']) == 1


def test_collectives_are_in_the_served_graph(exports):
  """The CNN's halos (send/recv) and the MoE's all-to-all run inside the saved signature."""
  for name, wanted in (
    ('cnn', 'CollectiveBcastSendV2'),
    ('moe', 'CollectiveAllToAllV2'),
    ('transformer', 'CollectiveReduceV2'),
  ):
    from tensorflow.core.protobuf import saved_model_pb2

    proto = saved_model_pb2.SavedModel.FromString(
      pathlib.Path(exports[name]['dir'], 'saved_model.pb').read_bytes()
    )
    ops = {n.op for f in proto.meta_graphs[0].graph_def.library.function for n in f.node_def}
    assert wanted in ops, (name, sorted(ops))
    kinds = {r['kind'] for r in exports[name]['pf'].collectives()}
    assert {'cnn': 'permute', 'moe': 'all_to_all', 'transformer': 'all_reduce'}[name] in kinds


@pytest.mark.slow  # a page or a fresh interpreter: `make test` runs it, the edit loop not
def test_plain_tensorflow_serves_every_export_in_a_fresh_process(exports, tmp_path):
  """The fresh process (no tf_gspmd) writes what it served; the oracle compares it here."""
  cases = {
    name: (
      e['dir'],
      str(pathlib.Path(e['dir']).parent / f'{name}_in.npy'),
      str(tmp_path / f'{name}_served.npy'),
    )
    for name, e in exports.items()
  }
  script = f"""
cases = {cases!r}
for name, (path, inp, out_path) in cases.items():
  loaded = tf.saved_model.load(path)
  serve = loaded.signatures['serving_default']
  (key,) = serve.structured_input_signature[1]
  np.save(out_path, serve(**{{key: tf.constant(np.load(inp))}})['output_0'].numpy())
print(json.dumps({{'tf_gspmd_imported': any(m.startswith('tf_gspmd') for m in sys.modules)}}))
"""
  done = run_fresh(script, devices=8)
  assert done.returncode == 0, done.stderr[-3000:]
  result = json.loads(done.stdout.strip().splitlines()[-1])
  assert result['tf_gspmd_imported'] is False
  assert set(cases) == {'transformer', 'cnn', 'moe', 'keras'}
  served = {name: np.load(out_path) for name, (_, _, out_path) in cases.items()}
  assert_close(served, {name: e['want'] for name, e in exports.items()}, 'served by plain TF')


@pytest.mark.slow  # a fresh interpreter: `make test` runs it, the edit loop not
def test_fewer_devices_fail_naming_both_counts(exports):
  path, inp = exports['moe']['dir'], str(pathlib.Path(exports['moe']['dir']).parent / 'moe_in.npy')
  script = f"""
serve = tf.saved_model.load({path!r}).signatures['serving_default']
try:
  serve(x=tf.constant(np.load({inp!r})))
  print('NO ERROR')
except tf.errors.InvalidArgumentError as e:
  print('PLAIN:', str(e).splitlines()[-1] if False else ' '.join(str(e).split()))
sys.path.insert(0, {str(ROOT)!r})
import tf_gspmd as tg
try:
  tg.saved_model.load({path!r})
  print('NO ERROR')
except ValueError as e:
  print('TG:', e)
"""
  done = run_fresh(script, devices=4, timeout=120)
  assert done.returncode == 0, done.stderr[-3000:]
  out = done.stdout
  assert 'NO ERROR' not in out, out
  plain = next(line for line in out.splitlines() if line.startswith('PLAIN:'))
  assert 'runs 8 partitions' in plain and '[4] [of those 8 devices exist' in plain, plain
  ours = next(line for line in out.splitlines() if line.startswith('TG:'))
  assert 'runs 8 partitions' in ours and 'this process has 4 CPU device(s)' in ours, ours


def cli(*args, timeout=120) -> subprocess.CompletedProcess:
  """TF's `saved_model_cli` (a Python script: the console entry point pip wrote), run as a
  fresh interpreter would run it, forked from one that imported TF (`helpers.run_python`)."""
  return run_python(pathlib.Path(CLI), timeout, args)


def printed_result(stdout: str, key: str) -> np.ndarray:
  """The numbers `saved_model_cli run` printed after 'Result for output key KEY:'."""
  text = stdout.split(f'Result for output key {key}:', 1)[1]
  text = text[text.index('[') : text.rindex(']') + 1]  # the array, not the --outdir line after it
  return np.array(
    [float(v) for v in re.findall(r'[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?', text)], np.float32
  )


@contextlib.contextmanager
def device_server(export_dir: str, wait: float = 120):
  """`python -m tf_gspmd.export.serve --export DIR --expose-to-network` (as docs/export.md
  says); yields its target."""
  env = dict(os.environ, PYTHONPATH=str(ROOT), TF_CPP_MIN_LOG_LEVEL='2')
  server = subprocess.Popen(
    [sys.executable, '-m', 'tf_gspmd.export.serve', '--export', export_dir, '--expose-to-network'],
    cwd=ROOT,
    env=env,
    stdout=subprocess.PIPE,
    stderr=subprocess.DEVNULL,
    text=True,
  )
  try:
    deadline = time.monotonic() + wait
    line = ''
    while 'tf_gspmd device server:' not in line:
      remaining = deadline - time.monotonic()
      ready, _, _ = select.select([server.stdout], [], [], max(remaining, 0))
      assert ready and server.poll() is None, f'the device server did not start: {line!r}'
      line = server.stdout.readline()
    assert line.rstrip().endswith(', 8 CPU devices'), line
    yield line.split('server: ', 1)[1].split(',', 1)[0]
  finally:
    server.terminate()
    server.wait(timeout=30)


@pytest.mark.slow  # TF's saved_model_cli in subprocesses: 22 s
def test_saved_model_cli_show_and_run(exports, tmp_path):
  path = exports['cnn']['dir']
  show = cli('show', '--dir', path, '--all')
  assert show.returncode == 0, show.stderr[-2000:]
  assert "signature_def['serving_default']" in show.stdout
  assert 'shape: (4, 16, 12, 3)' in show.stdout and 'shape: (4, 4)' in show.stdout, show.stdout
  # A local TF1 session has one CPU device: the export says so instead of hanging.
  inp = str(pathlib.Path(path).parent / 'cnn_in.npy')
  run = cli(
    'run',
    '--dir',
    path,
    '--tag_set',
    'serve',
    '--signature_def',
    'serving_default',
    '--inputs',
    f'images={inp}',
  )
  assert run.returncode != 0
  assert 'runs 8 partitions' in run.stderr and '[1] [of those 8 devices exist' in run.stderr, (
    run.stderr[-2000:]
  )
  # On the device server (8 CPU devices), `run --worker` executes the partitioned program: the
  # CNN's halo exchange (collective send/recv) and the MoE's all-to-all.
  with device_server(path) as target:
    for name, arg in (('cnn', 'images'), ('moe', 'x')):
      e = exports[name]
      inp = str(pathlib.Path(e['dir']).parent / f'{name}_in.npy')
      run = cli(
        'run',
        '--dir',
        e['dir'],
        '--tag_set',
        'serve',
        '--signature_def',
        'serving_default',
        '--inputs',
        f'{arg}={inp}',
        '--worker',
        target,
        '--outdir',
        str(tmp_path / name),
      )
      assert run.returncode == 0, run.stderr[-3000:]
      saved = np.load(tmp_path / name / 'output_0.npy')
      want = e['want']
      assert_close(saved, want, f'saved_model_cli run {name} on {target}')
      if want.size <= 1000:  # printed whole (numpy summarizes larger arrays with '...')
        printed = printed_result(run.stdout, 'output_0')
        assert printed.size == want.size, run.stdout[-2000:]
        # (numpy prints 8 digits: far below the bound)
        assert_close(printed, want.reshape(-1), f'saved_model_cli run {name}, printed')


def test_signature_calls_carry_the_session_collective_key(exports):
  """A TF1 session derives a collective_graph_key only from top-level V1 collective ops."""
  from tensorflow.core.protobuf import saved_model_pb2

  proto = saved_model_pb2.SavedModel.FromString(
    pathlib.Path(exports['moe']['dir'], 'saved_model.pb').read_bytes()
  )
  graph = proto.meta_graphs[0].graph_def
  nodes = {n.name: n for n in graph.node}
  marker = nodes[tg.saved_model.SESSION_KEY_NODE]
  assert marker.op == 'CollectiveReduce' and marker.attr['group_size'].i == 1
  signature = proto.meta_graphs[0].signature_def['serving_default']
  for info in signature.outputs.values():
    caller = nodes[info.name.split(':')[0]]
    assert '^' + marker.name in caller.input, caller


# --- point 2: XLA / TPU export ------------------------------------------------------------------
def test_xla_export_recompiles_and_its_annotated_graph_reads_back(exports, tmp_path):
  pytest.importorskip('jax')
  from tf_gspmd.graph.capture import capture
  from tf_gspmd.xla_bridge import pjrt

  e = exports['transformer']
  pf, args, want = e['pf'], e['args'], e['want']
  tg.saved_model.save_xla(pf, str(tmp_path / 'xla'), *args)
  export, values = tg.saved_model.load_xla(str(tmp_path / 'xla'))
  executable = pjrt.PjrtExecutable(export)
  inputs = [pjrt.put_global(args[0], export.args[0], executable.devices)]
  inputs += [
    pjrt.put_global(values[i], export.args[i], executable.devices)
    for i in range(1, len(export.args))
  ]
  outputs = executable.run(inputs)
  got = pjrt.assemble_global(
    outputs[0], export.results[0].sharding, export.results[0].shape, 'output'
  )
  assert_close(got.numpy(), want, 'the XLA export recompiled')
  assert executable.collective_counts().get('all-reduce', 0) >= 4

  written = tg.saved_model.annotated_shardings(pf, *args)
  assert len(written) > 50
  loaded = tf.saved_model.load(str(tmp_path / 'xla' / 'annotated'))
  out = loaded.signatures['serving_default'](tokens=tf.constant(args[0]))['output_0']
  assert_close(out.numpy(), want, 'annotated graph')  # the annotated graph runs unpartitioned
  program = capture(loaded.function, *args)
  read = {}
  for graph in program.graphs():
    for node in graph.nodes:
      if node.annotations and node.op != 'XlaSharding':
        read[node.name.split('/', 1)[-1]] = node.annotations
  mesh = pf.mesh
  checked = 0
  for name, sharding in written.items():
    shardings = sharding if isinstance(sharding, tuple) else (sharding,)
    assert name in read, name
    for i, s in enumerate(shardings):
      back = named_for_rank(read[name][i], mesh, s.rank)
      assert back == s, (name, i, back, s)
      checked += 1
  assert checked >= len(written)


# --- docs/export.md's "Save, serve, restore" example ---------------------------------------------
@pytest.mark.slow  # a page or a fresh interpreter: `make test` runs it, the edit loop not
def test_readme_save_serve_restore_example_runs_verbatim(tmp_path):
  readme = (ROOT / 'docs' / 'export.md').read_text()
  section = readme.split('## Save, serve, restore', 1)[1].split('\n## ', 1)[0]
  block = section.split('```python\n', 1)[1].split('```', 1)[0]
  script = tmp_path / 'readme_save_serve.py'
  script.write_text(block)  # a file, as tests/test_readme.py runs README blocks
  done = run_python(script)
  assert done.returncode == 0, done.stderr[-3000:]
  assert done.stdout.splitlines() == [
    '5120 5120',
    'True',
    "['annotated', 'layouts.json', 'module.mlir', 'values.npz']",
  ], done.stdout
