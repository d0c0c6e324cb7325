"""Checkpoints in the global layout (issue #10 points 3-4), on 8 logical CPUs.

A Keras MLP (hidden 30: uneven over 4 and over 8) with Adam trains 3 steps
partitioned on a (2, 4) mesh beside the same model unpartitioned; the
checkpoint it saves holds every variable as one global tensor (bitwise the
synced values), written slice by slice (no device writes a whole sharded
variable, nothing twice, no padding). It restores bitwise into other meshes
and layouts, plain variables and a Keras model, and training continues from
there like the uninterrupted unpartitioned run. A save killed midway leaves
the previous checkpoint restorable; mismatched targets are named.
"""

import os
import signal
import subprocess
import sys
import textwrap
import time

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_gspmd as tg
from tf_gspmd.export import checkpoint as ckpt
from tf_gspmd.testing import assert_close

from helpers import keras_mlp, keras_train_step, mlp_batches, run_python  # noqa: E402

SAVED_AFTER = 3  # steps trained before the save
HIDDEN = 30


def named_mlp(seed, hidden=HIDDEN):
  """helpers' MLP with Adam, named explicitly (a checkpoint names variables by their names)."""
  return keras_mlp(seed, hidden, named=True)


def _layout(mesh, rules):
  layout = tg.LayoutMap(mesh)
  for pattern, spec in rules.items():
    layout[pattern] = spec
  return layout


def _partitioned(seed, mesh, rules):
  model, optimizer = named_mlp(seed, hidden=HIDDEN)
  assert _layout(mesh, rules).apply(model)
  data_axis = mesh.axis_names[0]
  step = tg.partition(
    keras_train_step(model, optimizer, lambda x: tg.shard(x, mesh, tg.P(data_axis, None))), mesh
  )
  return model, optimizer, step


def _values(variables):
  return {v.path: np.array(v.numpy()) for v in variables}


MEGATRON = {
  r'.*hidden_0/kernel': tg.P(None, 'model'),
  r'.*hidden_0/bias': tg.P('model'),
  r'.*hidden_1/kernel': tg.P('model', None),
}


@pytest.fixture(scope='module')
def saved(tmp_path_factory):
  """The (2, 4) run saved after 3 steps, and the unpartitioned run it is compared with."""
  directory = str(tmp_path_factory.mktemp('ckpt'))
  mesh = tg.Mesh.create((2, 4), ('data', 'model'))
  model, optimizer, step = _partitioned(0, mesh, MEGATRON)
  ref_model, ref_optimizer = named_mlp(0, hidden=HIDDEN)
  reference = keras_train_step(ref_model, ref_optimizer)
  batches = mlp_batches(8)
  for i, (x, y) in enumerate(batches[:SAVED_AFTER]):
    assert_close(step(x, y), reference(x, y), f'loss of step {i + 1}')
  record = tg.save_checkpoint(step, directory)
  variables = list(model.variables) + list(optimizer.variables)
  at_save = _values(variables)
  ref_at_save = _values(list(ref_model.variables) + list(ref_optimizer.variables))
  # The uninterrupted unpartitioned run: two more steps.
  losses = [reference(x, y).numpy() for x, y in batches[SAVED_AFTER:]]
  return dict(
    directory=directory,
    record=record,
    step=step,
    at_save=at_save,
    ref_at_save=ref_at_save,
    batches=batches,
    ref_losses=losses,
    ref_after=_values(list(ref_model.variables) + list(ref_optimizer.variables)),
  )


def _continue(step, saved):
  """Train the restored step like the uninterrupted reference; losses equal."""
  for i, ((x, y), want) in enumerate(zip(saved['batches'][SAVED_AFTER:], saved['ref_losses'])):
    assert_close(step(x, y), want, f'loss of step {SAVED_AFTER + i + 1}')


def _check_after(variables, saved):
  """Every variable (weights, Adam slots, iterations) equals the uninterrupted run's."""
  assert_close(_values(variables), saved['ref_after'], 'after restore and training')


def _check_restored_bitwise(pairs, saved):
  """Every sharded variable's global value (and its original's) is the saved one, bit for bit;
  the padded tail of every uneven shard is zero again."""
  assert len(pairs) == len(saved['at_save'])
  for original, sharded in pairs:
    want = saved['at_save'][ckpt._base_name(original)]
    assert np.array_equal(sharded.numpy(), want), original.name
    assert np.array_equal(original.numpy(), want), original.name
    for p, shard in enumerate(sharded.variables):
      bounds = sharded.sharding.shard_bounds(sharded.shape, p)
      valid = (
        tuple(slice(0, b - a) for a, b in bounds)
        if bounds
        else tuple(slice(0, 0) for _ in sharded.shape)
      )
      padding = np.array(shard.numpy(), copy=True)
      padding[valid] = 0
      assert not padding.any(), (original.name, p)


def test_checkpoint_holds_each_variable_as_its_global_value(saved):
  reader = tf.train.load_checkpoint(saved['directory'])
  shapes = reader.get_variable_to_shape_map()
  assert set(shapes) == set(saved['at_save'])  # keras paths: weights, Adam slots, iterations
  for name, value in saved['at_save'].items():
    assert np.array_equal(reader.get_tensor(name), value), name
  # ... and they are the unpartitioned run's values after the same 3 steps.
  assert_close(saved['at_save'], saved['ref_at_save'], 'at save')
  assert tf.train.latest_checkpoint(saved['directory']) == saved['record'].prefix


def test_each_device_writes_only_its_own_slices_once(saved):
  record, step = saved['record'], saved['step']
  by_name = {ckpt._base_name(o): s for o, s in step.variable_pairs()}
  # Every slice of every variable written once: the bytes add up to the global sizes exactly
  # (no replica written twice, no padding written).
  per_variable = {}
  for device, name, spec, nbytes in record.slices:
    per_variable.setdefault(name, []).append((device, spec, nbytes))
  for name, sharded in by_name.items():
    total = int(np.prod(sharded.shape)) * sharded.dtype.size
    assert sum(n for _, _, n in per_variable[name]) == total, name
    tiles = int(np.prod(sharded.sharding.tile_shape)) if sharded.sharding.tile_shape else 1
    if tiles > 1:  # a sharded variable: no device wrote all of it
      assert len(per_variable[name]) == tiles and all(n < total for _, _, n in per_variable[name])
  kernel = per_variable['mlp/hidden_0/kernel']  # [16, 30] split 8, 8, 8, 6 over 'model'
  assert sorted(spec for _, spec, _ in kernel) == [
    '16 30 -:0,8',
    '16 30 -:16,8',
    '16 30 -:24,6',
    '16 30 -:8,8',
  ]
  # What each device wrote is what is on disk: one data file per writing device, in order.
  data = sorted(
    f
    for f in os.listdir(saved['directory'])
    if f.startswith(os.path.basename(record.prefix) + '.data-')
  )
  sizes = [os.path.getsize(os.path.join(saved['directory'], f)) for f in data]
  assert sizes == list(record.bytes_per_device.values())
  assert len(sizes) == 8 and sum(sizes) == sum(
    int(np.prod(s.shape)) * s.dtype.size for s in by_name.values()
  )
  whole = max(int(np.prod(s.shape)) * s.dtype.size for s in by_name.values())
  assert max(sizes) < sum(sizes) / 2 and whole < sum(sizes)


def _restore_and_continue(saved, mesh, rules):
  model, optimizer, step = _partitioned(1, mesh, rules)
  x, y = saved['batches'][0]
  step(x, y)  # the first call makes the sharded variables (in this mesh's layout)
  record = tg.restore_checkpoint(saved['directory'], step)
  _check_restored_bitwise(step.variable_pairs(), saved)
  _continue(step, saved)
  _check_after(list(model.variables) + list(optimizer.variables), saved)
  return step, record


def test_restore_into_eight_devices_one_dim_uneven(saved):
  mesh = tg.Mesh.create((8,), ('model',))
  rules = {
    r'.*hidden_0/kernel': tg.P('model', None),  # 16 rows over 8
    r'.*hidden_1/kernel': tg.P(None, 'model'),  # 30 columns over 8: 4 x 7, then 2
    r'.*hidden_1/bias': tg.P('model'),
  }
  step, record = _restore_and_continue(saved, mesh, rules)
  kernel = {s for _, name, s, _ in record.slices if name == 'mlp/hidden_1/kernel'}
  assert '30 30 -:28,2' in kernel  # the last device read only its 2 columns
  # Each device read its own slices: none read a whole sharded variable.
  total = sum(int(np.prod(s.shape)) * s.dtype.size for s in step.sharded_variables())
  assert max(record.bytes_per_device.values()) < total / 4


@pytest.mark.slow  # saves and restores across meshes (make test runs it)
def test_restore_into_four_by_two_mesh_two_dim_slices(saved):
  mesh = tg.Mesh.create((4, 2), ('data', 'model'))
  rules = {
    r'.*hidden_1/kernel': tg.P('data', 'model'),  # [30, 30]: 8, 8, 8, 6 rows x 15 cols
    r'.*hidden_0/kernel': tg.P(None, 'model'),
  }
  _, record = _restore_and_continue(saved, mesh, rules)
  kernel = {s for _, name, s, _ in record.slices if name == 'mlp/hidden_1/kernel'}
  assert kernel == {
    f'30 30 {r}:{c}' for r in ('0,8', '8,8', '16,8', '24,6') for c in ('0,15', '15,15')
  }


def test_restore_into_plain_variables_and_keras_model(saved):
  """A Keras model and optimizer, unpartitioned: bitwise, then trains like the reference."""
  model, optimizer = named_mlp(2, hidden=HIDDEN)
  record = tg.restore_checkpoint(saved['directory'], [model, optimizer])
  assert record.original_bytes > 0 and not record.slices
  got = _values(list(model.variables) + list(optimizer.variables))
  assert all(np.array_equal(got[n], saved['at_save'][n]) for n in saved['at_save'])
  step = keras_train_step(model, optimizer)
  _continue(step, saved)
  _check_after(list(model.variables) + list(optimizer.variables), saved)
  # Plain tf.Variables by name (a dict gives the names).
  plain = {'mlp/hidden_1/kernel': tf.Variable(tf.zeros([HIDDEN, HIDDEN]))}
  tg.restore_checkpoint(saved['directory'], plain)
  assert np.array_equal(
    plain['mlp/hidden_1/kernel'].numpy(), saved['at_save']['mlp/hidden_1/kernel']
  )


def test_restore_into_a_model_partitioned_before_its_first_call(saved):
  """Restored into the model before partitioning: the first call shards the restored values."""
  mesh = tg.Mesh.create((2, 4), ('data', 'model'))
  model, optimizer, step = _partitioned(3, mesh, {r'.*hidden_1/kernel': tg.P(None, 'model')})
  with pytest.raises(ValueError, match='no sharded variables yet'):
    tg.restore_checkpoint(saved['directory'], step)
  tg.restore_checkpoint(saved['directory'], [model, optimizer])
  _continue(step, saved)
  _check_after(list(model.variables) + list(optimizer.variables), saved)


def test_mismatched_shape_dtype_or_missing_variable_is_named(saved):
  model, _ = named_mlp(0, hidden=HIDDEN + 1)
  with pytest.raises(ValueError) as err:
    tg.restore_checkpoint(saved['directory'], model)
  message = str(err.value)
  assert "'mlp/hidden_0/kernel'" in message
  assert 'float32[16, 30] in the checkpoint' in message
  assert 'float32[16, 31] in the target' in message
  wrong_dtype = {'mlp/hidden_0/bias': tf.Variable(tf.zeros([HIDDEN], tf.float64))}
  with pytest.raises(
    ValueError,
    match=r"'mlp/hidden_0/bias' is float32\[30\] in the "
    r'checkpoint .* but float64\[30\] in the target',
  ):
    tg.restore_checkpoint(saved['directory'], wrong_dtype)
  with pytest.raises(
    ValueError,
    match=r"variable 'encoder/kernel' \(float32\[16, 30\]\) is not "
    'in the checkpoint',
  ):
    tg.restore_checkpoint(
      saved['directory'], [tf.Variable(tf.zeros([16, 30]), name='encoder/kernel')]
    )


# --- small plain programs: empty shards, duplicate names, the kill test ----------------------


def _plain_step(mesh, w, v, spec_w, spec_v):
  tg.shard_variable(w, mesh, spec_w)
  tg.shard_variable(v, mesh, spec_v)

  @tf.function
  def step(x):
    w.assign_add(tf.reduce_sum(x) * tf.ones_like(w))
    v.assign_sub(tf.cast(tf.reduce_max(x), v.dtype) * tf.ones_like(v))
    return tf.reduce_sum(w) + tf.cast(tf.reduce_sum(v), tf.float32)

  return tg.partition(step, mesh)


def test_empty_shards_integers_and_duplicate_names(tmp_path):
  """[5, 6] over 4 rows leaves device 3 nothing; restored into 6 columns over 4 (2, 2, 2, 0)."""
  rng = np.random.RandomState(0)
  w = tf.Variable(rng.randn(5, 6).astype(np.float32), name='w')
  v = tf.Variable(rng.randint(-9, 9, size=(7,)).astype(np.int64), name='w')  # the same name
  step = _plain_step(tg.Mesh.create((4,), ('x',)), w, v, tg.P('x', None), tg.P('x'))
  step(np.ones((4, 3), np.float32))
  record = tg.save_checkpoint(step, str(tmp_path))
  assert record.names == ['w', 'w#2']
  reader = tf.train.load_checkpoint(str(tmp_path))
  assert np.array_equal(reader.get_tensor('w'), w.numpy())
  assert np.array_equal(reader.get_tensor('w#2'), v.numpy())
  assert reader.get_tensor('w#2').dtype == np.int64
  assert '/device:CPU:3' not in {d for d, name, _, _ in record.slices if name == 'w'}
  w2 = tf.Variable(tf.zeros([5, 6]), name='w')
  v2 = tf.Variable(tf.zeros([7], tf.int64), name='w')
  mesh = tg.Mesh.create((2, 4), ('a', 'b'))
  again = _plain_step(mesh, w2, v2, tg.P(None, 'b'), tg.P('a'))
  again(np.zeros((4, 3), np.float32))
  tg.restore_checkpoint(str(tmp_path), again)
  for (original, sharded), want in zip(again.variable_pairs(), [w.numpy(), v.numpy()]):
    assert np.array_equal(sharded.numpy(), want) and np.array_equal(original.numpy(), want)
  x = np.arange(12, dtype=np.float32).reshape(4, 3)
  assert_close(again(x), step(x), 'restored on (2, 4) vs saved on (4,)')


KILLED_SAVE = textwrap.dedent("""
    import os, sys, time
    sys.path.insert(0, {tests!r})
    import conftest  # 8 logical devices
    import numpy as np, tensorflow as tf
    import tf_gspmd as tg
    from tf_gspmd.export import checkpoint as ckpt
    directory, phase, marker = sys.argv[1:4]
    mesh = tg.Mesh.create((2, 4), ('data', 'model'))
    w = tf.Variable(np.arange(16 * 30, dtype=np.float32).reshape(16, 30), name='w')
    b = tf.Variable(np.arange(30, dtype=np.float32), name='b')
    tg.shard_variable(w, mesh, tg.P(None, 'model'))
    tg.shard_variable(b, mesh, tg.P('model'))

    @tf.function
    def step(x):
      w.assign_add(tf.matmul(x[:, :16], x, transpose_a=True))
      b.assign_sub(tf.reduce_sum(x, 0))
      return tf.reduce_sum(w)

    pf = tg.partition(step, mesh)
    x = np.random.RandomState(0).randn(8, 30).astype(np.float32)
    pf(x)
    tg.save_checkpoint(pf, directory)
    np.save(os.path.join(directory, '..', 'w.npy'), w.numpy())
    np.save(os.path.join(directory, '..', 'b.npy'), b.numpy())
    pf(x)

    def stall(original):
      def stalled(*args, **kwargs):
        if phase == 'publish':
          open(marker, 'w').close(); time.sleep(600)
        original(*args, **kwargs)
        if phase == 'slices':  # after the first device's slices, before the others'
          open(marker, 'w').close(); time.sleep(600)
      return stalled
    name = 'publish' if phase == 'publish' else '_write_device'
    setattr(ckpt, name, stall(getattr(ckpt, name)))
    tg.save_checkpoint(pf, directory)
    print('the save finished; it should have been killed', flush=True)
""")


@pytest.mark.parametrize(
  'phase',
  ['slices', pytest.param('publish', marks=pytest.mark.slow)],  # a process each
)
def test_save_killed_midway_leaves_previous_checkpoint(tmp_path, phase):
  directory, marker = tmp_path / 'ckpt', tmp_path / 'writing'
  script = tmp_path / 'save.py'
  script.write_text(KILLED_SAVE.format(tests=os.path.dirname(os.path.abspath(__file__))))
  child = subprocess.Popen(
    [sys.executable, str(script), str(directory), phase, str(marker)],
    stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT,
  )
  deadline = time.time() + 240
  while not marker.exists() and child.poll() is None and time.time() < deadline:
    time.sleep(0.1)
  assert marker.exists(), child.communicate()[0].decode()[-3000:]
  child.send_signal(signal.SIGKILL)
  child.wait()
  assert child.returncode == -signal.SIGKILL
  # The new save left files behind, but the previous checkpoint is still the newest.
  leftovers = sorted(os.listdir(directory))
  assert any(name.startswith('.tmp-') or name.startswith('ckpt-2') for name in leftovers), leftovers
  assert tf.train.latest_checkpoint(str(directory)) == str(directory / 'ckpt-1')
  w = tf.Variable(tf.zeros([16, 30]), name='w')
  b = tf.Variable(tf.zeros([30]), name='b')
  tg.restore_checkpoint(str(directory), [w, b])
  assert np.array_equal(w.numpy(), np.load(tmp_path / 'w.npy'))
  assert np.array_equal(b.numpy(), np.load(tmp_path / 'b.npy'))
  # The next save cleans up and publishes ckpt-2, complete.
  w.assign_add(tf.ones_like(w))
  record = tg.save_checkpoint([w, b], str(directory))
  assert record.prefix == str(directory / 'ckpt-2')
  assert not [n for n in os.listdir(directory) if n.startswith('.tmp-')]
  assert np.array_equal(tf.train.load_checkpoint(str(directory)).get_tensor('w'), w.numpy())
  kept = tf.train.get_checkpoint_state(str(directory)).all_model_checkpoint_paths
  assert [os.path.basename(p) for p in kept] == ['ckpt-1', 'ckpt-2']


@pytest.mark.slow  # a page or a fresh interpreter: `make test` runs it, the edit loop not
def test_readme_checkpoint_example_runs(tmp_path):
  """docs/export.md's checkpoint example runs as is (and is the module docstring's)."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  with open(os.path.join(root, 'docs', 'export.md')) as f:
    section = f.read().split('## Checkpoints', 1)[1].split('\n## ', 1)[0]
  example = section.split('```python\n', 1)[1].split('```', 1)[0]
  doc = ckpt.__doc__
  assert example.strip() == textwrap.dedent(doc[doc.index('::\n') + 3 :]).strip()
  script = tmp_path / 'example.py'
  script.write_text(example)
  result = run_python(script)
  assert result.returncode == 0, result.stderr[-3000:]
  prefix_line, losses = result.stdout.splitlines()
  assert prefix_line.split()[0].endswith('ckpt-1')
  got, want = (np.float32(v) for v in losses.split())  # float32 losses, printed as floats
  assert_close(got, want, 'README example loss after restore')


def test_xla_backend_saves_and_restores_device_buffers(tmp_path):
  """backend='xla': each replica's buffer is written slice by slice and restored into buffers."""
  pytest.importorskip('jax')
  rng = np.random.RandomState(0)
  w = tf.Variable(rng.randn(5, 6).astype(np.float32), name='w')
  v = tf.Variable(rng.randn(7).astype(np.float32), name='v')
  mesh = tg.Mesh.create((2, 4), ('a', 'b'))
  tg.shard_variable(w, mesh, tg.P('b', None))
  tg.shard_variable(v, mesh, tg.P('b'))

  @tf.function
  def step(x):
    w.assign_add(tf.reduce_sum(x) * tf.ones_like(w))
    v.assign_sub(tf.reduce_max(x) * tf.ones_like(v))
    return tf.reduce_sum(w) + tf.reduce_sum(v)

  xla = tg.partition(step, mesh, backend='xla')
  x = np.arange(12, dtype=np.float32).reshape(4, 3)
  xla(x)
  record = tg.save_checkpoint(xla, str(tmp_path))
  # w's 5 rows over 4 are 2, 2, 1, 0: the fourth column of the mesh (devices 3, 7) holds none.
  assert sorted(d for d, name, _, _ in record.slices if name == 'w') == ['xla:0', 'xla:1', 'xla:2']
  assert sorted(s for _, name, s, _ in record.slices if name == 'v') == [
    '7 0,2',
    '7 2,2',
    '7 4,2',
    '7 6,1',
  ]
  reader = tf.train.load_checkpoint(str(tmp_path))
  assert np.array_equal(reader.get_tensor('w'), w.numpy())  # the variables read their buffers
  assert np.array_equal(reader.get_tensor('v'), v.numpy())
  w.assign(tf.zeros_like(w))  # the variables are their own state: a write wipes them
  v.assign(tf.zeros_like(v))
  assert not w.numpy().any() and not v.numpy().any()
  tg.restore_checkpoint(str(tmp_path), xla)
  for original, sharded in xla.variable_pairs():
    assert np.array_equal(sharded.numpy(), reader.get_tensor(original.name[:-2]))
  assert np.array_equal(w.numpy(), reader.get_tensor('w'))  # one state: the variable restored
  # The plain function on the restored state (it reads and writes the buffers), then the
  # partitioned one on the state restored again: alike (sums in another order: not bitwise).
  want = step(x)
  tg.restore_checkpoint(str(tmp_path), xla)
  assert_close(xla(x), want, 'xla backend after restore vs unpartitioned')


def test_keras_fit_model_saves_its_shards_and_restores_on_another_mesh(tmp_path):
  """partition_model: saved from the shards after fit on (2, 4), slice by slice; restored into a
  model fit on 8 devices: its shards and its own variables, bitwise."""

  def build(seed):
    model, _ = named_mlp(seed)
    model.compile(
      optimizer=keras.optimizers.Adam(1e-2, name='adam'),
      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model

  rng = np.random.RandomState(0)
  x, y = rng.randn(16, 16).astype(np.float32), rng.randint(0, 4, 16).astype(np.int32)
  mesh = tg.Mesh.create((2, 4), ('data', 'model'))
  source = build(0)
  _layout(mesh, MEGATRON).apply(source)
  tg.partition_model(source, mesh)
  source.fit(x, y, batch_size=8, epochs=1, verbose=0)  # ends with the shards synced back
  want = _values(list(source.variables) + list(source.optimizer.variables))
  record = tg.save_checkpoint(source, str(tmp_path))
  assert 'adam/mlp_hidden_0_kernel_momentum' in record.names and 'loss/total' not in record.names
  writers = {d for d, name, _, _ in record.slices if name == 'mlp/hidden_0/kernel'}
  assert len(writers) == 4  # from the shards: four column slices, four devices
  reader = tf.train.load_checkpoint(str(tmp_path))
  assert all(np.array_equal(reader.get_tensor(n), want[n]) for n in want)
  mesh8 = tg.Mesh.create((8,), ('data',))
  target = build(1)
  _layout(mesh8, {r'.*hidden_1/kernel': tg.P('data', None)}).apply(target)
  tg.partition_model(target, mesh8)
  target.fit(x[:8], y[:8], batch_size=8, epochs=1, verbose=0)  # makes its shards
  tg.restore_checkpoint(str(tmp_path), target)
  got = _values(list(target.variables) + list(target.optimizer.variables))
  assert all(np.array_equal(got[n], want[n]) for n in want)
  restored = 0
  for original, sharded in target._tf_gspmd_store.pairs():  # noqa: SLF001
    if ckpt._base_name(original) in want:
      assert np.array_equal(sharded.numpy(), want[ckpt._base_name(original)]), original.name
      restored += 1
  assert restored == len(want)
