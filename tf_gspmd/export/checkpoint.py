"""Checkpoints in the global layout: every variable one global tensor, written in slices.

`save_checkpoint(source, directory)` writes TF's checkpoint format (the
tensor bundle that `tf.train.load_checkpoint` reads) with every variable under
its own name as one global tensor. Each device writes only the slices it holds
(TF's sliced-variable saving: `SaveV2` with a `shape_and_slices` spec such as
"8 16 0,4:-"), replicated slices once, never the padded tail of an uneven
shard; no device gathers a whole sharded variable. `restore_checkpoint(path,
target)` reads, on every device, only the slice that device holds in the
target's layout (any mesh, any layout, uneven splits), re-pads it, and assigns
it: a checkpoint saved on a (2, 4) mesh restores into 8 devices, a (4, 2)
mesh, plain variables or a Keras model, bitwise.

Sources and targets: a `PartitionedFunction` (after its first call: its
sharded variables), a `VariableStore`, a Keras model, layer or optimizer, a
`tf.Module`, a list of any of these or of variables, or a dict
`{checkpoint name: variable}`.

Names: a variable is saved under its name without the ':0' (a Keras 3
variable under its `.path`, which is also its backing tf.Variable's name).
Variables that share a name get '#2', '#3', ... appended, in the order the
source lists them (a PartitionedFunction: the order its program first touched
them); name variables uniquely rather than rely on that order. A dict gives
the names explicitly.

Atomic publishing. `directory` holds numbered checkpoints `ckpt-<k>` and a
`checkpoint` state file (TF's CheckpointState text, so
`tf.train.latest_checkpoint(directory)` and `tf.train.load_checkpoint(directory)`
find the newest). A save writes one bundle per device into a temporary
directory, merges them into `ckpt-<k>` (`MergeV2Checkpoints` moves the data
files and writes the index last), flushes the files to disk, and only then
replaces the state file with one naming `ckpt-<k>` (write, fsync, rename). A
save killed at any point leaves the previous checkpoint the newest and
restorable, and the new one either complete and named, or absent from the
state file (its leftovers are removed by the next save). One writer per
directory.

Mismatches (shape, dtype, a variable the checkpoint lacks) raise a ValueError
naming the variable, the checkpoint's shape and dtype and the target's.
backend='xla' functions are supported: their shards are device buffers,
written from and restored to each device's buffer.

Example (runs as is; `tests/test_checkpoint.py` runs it)::

    import os, tempfile
    os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
    import numpy as np
    import tensorflow as tf
    tf.config.set_logical_device_configuration(                 # 8 logical CPU devices
        tf.config.list_physical_devices('CPU')[0], [tf.config.LogicalDeviceConfiguration()] * 8)
    import tf_gspmd as tg

    def megatron(mesh):
      w1 = tf.Variable(tf.random.normal([16, 30], seed=1), name='w1')
      w2 = tf.Variable(tf.random.normal([30, 4], seed=2), name='w2')
      tg.shard_variable(w1, mesh, tg.P(None, 'model'))
      tg.shard_variable(w2, mesh, tg.P('model', None))

      @tf.function
      def train_step(x, y):
        with tf.GradientTape() as tape:
          loss = tf.reduce_mean(tf.square(tf.matmul(tf.nn.relu(tf.matmul(x, w1)), w2) - y))
        g1, g2 = tape.gradient(loss, [w1, w2])
        w1.assign_sub(0.1 * g1)
        w2.assign_sub(0.1 * g2)
        return loss
      return tg.partition(train_step, mesh), (w1, w2)

    x, y = np.ones([8, 16], np.float32), np.zeros([8, 4], np.float32)
    step, _ = megatron(tg.Mesh.create((2, 4), ('data', 'model')))
    step(x, y)
    directory = tempfile.mkdtemp()
    saved = tg.save_checkpoint(step, directory)           # each device writes only its slices
    print(saved.prefix, saved.bytes_per_device)
    w1 = tf.train.load_checkpoint(directory).get_tensor('w1')  # the global [16, 30] value

    # Another mesh: 8 devices, w1's 30 columns split 4, 4, ..., 4, 2.
    step8, (v1, v2) = megatron(tg.Mesh.create((8,), ('model',)))
    step8(x, y)                                  # its first call makes its sharded variables
    tg.restore_checkpoint(directory, step8)      # each device reads only its own slice
    assert np.array_equal(v1.numpy(), w1)        # the originals are restored too
    print(float(step8(x, y)), float(step(x, y))) # training goes on alike
    tg.restore_checkpoint(directory, [v1, v2])   # or plain variables (a Keras model: by .path)
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import uuid
from typing import Any, Dict, List, Sequence, Tuple

import numpy as np
import tensorflow as tf

from tf_gspmd.export.checkpoint_dir import (  # noqa: F401  (latest_checkpoint: public here too)
  PREFIX,
  STATE_FILE,
  TEMP_DIR,
  checkpoint_number,
  flush_bundle,
  latest_checkpoint,
  publish,
  published,
  remove_leftovers,
)
from tf_gspmd.keras.hooks import backing
from tf_gspmd.partitioned import PartitionedFunction, VariableStore
from tf_gspmd.program import held
from tf_gspmd.runtime.sharded import ShardedVariable
from tf_gspmd.tf_private import context  # async_wait: see save_checkpoint


# --- what is saved or restored ------------------------------------------------------------
@dataclasses.dataclass
class _Entry:
  """One variable of a source or target under its checkpoint name.

  `plain` is a whole tf.Variable (an original, a Keras variable's backing
  variable); `sharded` its per-device shards (a runtime.ShardedVariable or a
  backend='xla' XlaShardedVariable). A save reads the shards when there are
  any; a restore assigns both, so neither is left stale.
  """

  name: str
  shape: Tuple[int, ...]
  dtype: tf.DType
  plain: Any = None
  sharded: Any = None
  adopted: bool = False  # `plain` is its own value, copied into `sharded` around each call


def _is_keras_variable(value) -> bool:
  # Keras 3 variables are no tf.Variable; their path is their name in the checkpoint.
  return hasattr(value, 'path') and hasattr(value, 'assign') and not isinstance(value, tf.Variable)


def _base_name(variable) -> str:
  if _is_keras_variable(variable):
    return variable.path
  return re.sub(r':\d+$', '', variable.name)


def _unique(names: Sequence[str]) -> List[str]:
  """`names` with '#2', '#3', ... appended to repeats, in order."""
  seen: Dict[str, int] = {}
  out = []
  for name in names:
    seen[name] = seen.get(name, 0) + 1
    out.append(name if seen[name] == 1 else f'{name}#{seen[name]}')
  return out


def _is_variable(value) -> bool:
  return isinstance(value, tf.Variable) or _is_keras_variable(value)


def _flatten(obj, what: str) -> List[Any]:
  """Variables (and stores) of a list / model / optimizer / module, in order."""
  if isinstance(obj, PartitionedFunction):
    return [obj.store]
  if isinstance(obj, VariableStore) or _is_variable(obj):
    return [obj]
  if isinstance(obj, (list, tuple)):
    return [v for item in obj for v in _flatten(item, what)]
  variables = getattr(obj, 'variables', None)
  if variables is None:
    raise TypeError(
      f'{what}: expected a PartitionedFunction, a VariableStore, a Keras model, layer or '
      'optimizer, a tf.Module, a list of those or of variables, or a dict {name: variable}; '
      f'got {type(obj).__name__}.'
    )
  found = list(variables() if callable(variables) else variables)
  optimizer = getattr(obj, 'optimizer', None)  # a compiled Keras model's optimizer state
  if optimizer is not None and getattr(optimizer, 'variables', None) is not None:
    found += list(optimizer.variables)
  store = getattr(obj, '_tf_gspmd_store', None)  # set by tf_gspmd.partition_model
  return found + ([_ShardsOf(store)] if store is not None else [])


def _build_optimizers(obj) -> None:
  """A Keras model or optimizer whose optimizer has not made its slots yet (built lazily, on the
  first step): build it now from the model's trainable variables, as its first step would, so a
  restore fills its slots from the checkpoint instead of skipping them."""
  for item in obj if isinstance(obj, (list, tuple)) else [obj]:
    optimizer = getattr(item, 'optimizer', None)
    trainable = getattr(item, 'trainable_variables', None)
    if optimizer is None or getattr(optimizer, 'built', True) or not trainable:
      continue
    if hasattr(optimizer, 'build'):
      optimizer.build(trainable)


@dataclasses.dataclass
class _ShardsOf:
  """A store consulted only for the shards of variables listed otherwise (a model partitioned
  by partition_model: its weights and optimizer state, not the metric state its steps touch)."""

  store: VariableStore


def _entries(obj, what: str) -> List[_Entry]:
  """The variables of a source or target under their checkpoint names."""
  if isinstance(obj, dict):
    return [_entry_of(str(name), v) for name, v in obj.items()]
  items = _flatten(obj, what)
  variables, seen = [], set()
  for item in items:
    if isinstance(item, _ShardsOf):
      continue
    if isinstance(item, VariableStore):
      pairs = item.pairs()
      if not pairs and len(items) == 1:
        raise ValueError(
          f'{what}: the partitioned function has no sharded variables yet (it makes them on '
          'its first call, from the values of the tf.Variables it uses). Call it once first, '
          'or use the variables themselves (a Keras model, a list of tf.Variables): their '
          'values are what the first call shards.'
        )
      candidates = [original for original, _ in pairs]
    else:
      candidates = [item]
    for v in candidates:
      if id(backing(v)) not in seen:
        seen.add(id(backing(v)))
        variables.append(v)
  names = _unique([_base_name(v) for v in variables])
  entries = [_entry_of(name, v) for name, v in zip(names, variables)]
  for entry in entries:  # a variable made as shards: they are its value (program/held.py)
    entry.sharded = held.holder_of(entry.plain)
    entry.adopted = entry.sharded is not None and not held.is_split(entry.plain)
  return entries


def _adopted(entries: List[_Entry]) -> list:
  """The plain variables among `entries` whose shards are a copy (program/held.py): a save
  refreshes the copy from them first, a restore writes them from it after."""
  return [e.plain for e in entries if e.adopted]


def values_by_name(source) -> Dict[str, np.ndarray]:
  """Checkpoint name -> the global value `save_checkpoint(source, ...)` would write now (a
  sharded variable assembled from its shards): what a restore must reproduce bitwise."""
  return {
    e.name: (e.sharded.assemble() if e.sharded is not None and not e.adopted else e.plain).numpy()
    for e in _entries(source, 'values_by_name')
  }


def _entry_of(name: str, variable) -> _Entry:
  plain = backing(variable)
  if not isinstance(plain, tf.Variable):
    raise TypeError(f'checkpoint: {name!r} is a {type(variable).__name__}, not a variable.')
  return _Entry(name, tuple(int(d) for d in plain.shape), plain.dtype.base_dtype, plain=plain)


# --- slices ---------------------------------------------------------------------------------
def _slice_spec(shape: Sequence[int], bounds: Sequence[Tuple[int, int]]) -> str:
  """TF's shape-and-slice string: '' for the whole tensor, else 'd0 d1 start,len:-'."""
  parts = [
    '-' if (start, stop) == (0, size) else f'{start},{stop - start}'
    for size, (start, stop) in zip(shape, bounds)
  ]
  if all(p == '-' for p in parts):
    return ''
  return ' '.join(str(int(s)) for s in shape) + ' ' + ':'.join(parts)


def _holders(sharded) -> Dict[tuple, List[int]]:
  """Global bounds of each distinct non-empty slice -> the partitions holding it."""
  out: Dict[tuple, List[int]] = {}
  for p in range(len(sharded.devices)):
    bounds = sharded.sharding.shard_bounds(sharded.shape, p)
    if bounds is not None and all(stop > start for start, stop in bounds):
      out.setdefault(tuple(bounds), []).append(p)
  return out


def _is_xla(sharded) -> bool:
  return not isinstance(sharded, ShardedVariable)


@dataclasses.dataclass
class _Piece:
  """One slice moving between one device and the checkpoint."""

  name: str
  spec: str
  dtype: tf.DType
  sizes: Tuple[int, ...]  # the slice's shape
  local: Any = None  # save: fn() -> the slice as a tensor; restore: fn(tensor) to place it

  @property
  def nbytes(self) -> int:
    return int(np.prod(self.sizes, dtype=np.int64)) * self.dtype.size


@dataclasses.dataclass
class CheckpointRecord:
  """What a save or restore did.

  `prefix`: the checkpoint; `names`: the variables saved or restored;
  `slices`: (device, variable name, shape-and-slice spec, bytes) of every
  slice a device of the mesh wrote or read; `bytes_per_device`: their sums per
  device; `original_bytes`: bytes read into whole (unsharded) variables.
  """

  prefix: str
  names: List[str]
  slices: List[Tuple[str, str, str, int]]
  original_bytes: int = 0

  @property
  def bytes_per_device(self) -> Dict[str, int]:
    out: Dict[str, int] = {}
    for device, _, _, nbytes in self.slices:
      out[device] = out.get(device, 0) + nbytes
    return out


def _record(prefix: str, entries, by_device: Dict[str, List[_Piece]], original_bytes: int = 0):
  return CheckpointRecord(
    prefix,
    [e.name for e in entries],
    [(device, p.name, p.spec, p.nbytes) for device, pieces in by_device.items() for p in pieces],
    original_bytes,
  )


def _writer(sharded, p: int) -> str:
  """The key of partition p's writer: its TF device, or 'xla:<p>' for a device buffer."""
  return f'xla:{p}' if _is_xla(sharded) else sharded.devices[p]


def _tf_device(key: str) -> str:
  # A device buffer's slice is copied to the host, which writes it.
  return '/device:CPU:0' if key.startswith('xla:') else key


# --- saving ---------------------------------------------------------------------------------
def _save_pieces(entries: List[_Entry]) -> Dict[str, List[_Piece]]:
  """Writer key -> the slices it writes: each distinct slice once, by one of its holders."""
  by_writer: Dict[str, List[_Piece]] = {}
  for k, entry in enumerate(entries):
    if entry.sharded is None:
      read = entry.plain.read_value
      by_writer.setdefault(entry.plain.device or '/device:CPU:0', []).append(
        _Piece(entry.name, '', entry.dtype, entry.shape, read)
      )
      continue
    holders = _holders(entry.sharded)
    if not holders:  # an empty tensor: its (empty) whole value from partition 0
      by_writer.setdefault(_writer(entry.sharded, 0), []).append(
        _Piece(entry.name, '', entry.dtype, entry.shape, entry.sharded.assemble)
      )
      continue
    for bounds, partitions in holders.items():
      p = partitions[k % len(partitions)]  # replicas take turns writing, variable by variable
      sizes = tuple(stop - start for start, stop in bounds)
      by_writer.setdefault(_writer(entry.sharded, p), []).append(
        _Piece(
          entry.name,
          _slice_spec(entry.shape, bounds),
          entry.dtype,
          sizes,
          _shard_reader(entry.sharded, p, sizes),
        )
      )
  return by_writer


def _shard_reader(sharded, p: int, sizes):
  """fn() -> the valid (unpadded) part of partition p's shard, on its device."""

  def read():
    if _is_xla(sharded):
      host = np.asarray(sharded.shards[p])
      return tf.constant(host[tuple(slice(0, s) for s in sizes)])
    value = sharded.shards[p].read_value()
    if tuple(value.shape) == tuple(sizes):
      return value
    return tf.slice(value, [0] * len(sizes), list(sizes))

  return read


def _write_device(prefix: str, key: str, pieces: List[_Piece]) -> None:
  """One device's SaveV2 of its own slices into its own bundle."""
  with tf.device(_tf_device(key)):
    tensors = [piece.local() for piece in pieces]
    tf.raw_ops.SaveV2(
      prefix=prefix,
      tensor_names=[p.name for p in pieces],
      shape_and_slices=[p.spec for p in pieces],
      tensors=tensors,
    )


def save_checkpoint(source, directory: str, *, max_to_keep: int = 3) -> CheckpointRecord:
  """Save every variable of `source` into `directory` as one global tensor per variable.

  Each device writes only the slices it holds (replicated slices once, padding
  never); the new checkpoint becomes `directory/ckpt-<k>` and the newest in the
  directory's state file only once complete on disk. Keeps the newest
  `max_to_keep` checkpoints. Returns a `CheckpointRecord` with the bytes each
  device wrote.
  """
  entries = _entries(source, 'save_checkpoint')
  held.scatter_adopted(_adopted(entries))  # each device writes its slices of the current value
  if max_to_keep < 1:
    raise ValueError(f'save_checkpoint: max_to_keep must be at least 1, got {max_to_keep}.')
  os.makedirs(directory, exist_ok=True)
  kept = published(directory)
  remove_leftovers(directory, kept)
  number = 1 + max([checkpoint_number(p) for p in kept] + [0])
  prefix = os.path.join(directory, f'{PREFIX}-{number}')
  temp = os.path.join(directory, f'{TEMP_DIR}{PREFIX}-{number}-{uuid.uuid4().hex[:8]}')
  os.makedirs(temp)
  by_writer = _save_pieces(entries)
  parts = []
  for i, (key, pieces) in enumerate(by_writer.items()):
    part = os.path.join(temp, f'device-{i}')
    _write_device(part, key, pieces)
    parts.append(part)
  # A device of another task (a cluster, runtime/cluster.py) runs its SaveV2 asynchronously:
  # wait for every write before merging. context.async_wait is TF-private; it is the one call
  # that also waits for the remote executors.
  context.async_wait()
  tf.raw_ops.MergeV2Checkpoints(
    checkpoint_prefixes=parts, destination_prefix=prefix, delete_old_dirs=True
  )
  flush_bundle(prefix)
  publish(directory, kept + [os.path.basename(prefix)], max_to_keep)
  shutil.rmtree(temp, ignore_errors=True)
  return _record(prefix, entries, by_writer)


# --- restoring ------------------------------------------------------------------------------
def _check(entries: List[_Entry], reader, prefix: str) -> None:
  shapes, dtypes = reader.get_variable_to_shape_map(), reader.get_variable_to_dtype_map()
  for entry in entries:
    if entry.name not in shapes:
      close = [n for n in shapes if n.split('/')[-1] == entry.name.split('/')[-1]][:5]
      hint = f' (names there ending alike: {close})' if close else ''
      raise ValueError(
        f'restore_checkpoint: variable {entry.name!r} ({entry.dtype.name}{list(entry.shape)}) '
        f'is not in the checkpoint {prefix}{hint}; it holds {len(shapes)} variables.'
      )
    have_shape, have_dtype = tuple(shapes[entry.name]), dtypes[entry.name].base_dtype
    if have_shape != entry.shape or have_dtype != entry.dtype:
      raise ValueError(
        f'restore_checkpoint: variable {entry.name!r} is {have_dtype.name}{list(have_shape)} '
        f'in the checkpoint {prefix} but {entry.dtype.name}{list(entry.shape)} in the target; '
        'restore into variables of the saved shape and dtype.'
      )


def _restore_pieces(entries: List[_Entry]) -> Tuple[Dict[str, List[_Piece]], Dict[str, list]]:
  """(reader key -> the slices a device reads for its shards,
  device -> the whole values read for its plain variables)."""
  by_reader: Dict[str, List[_Piece]] = {}
  whole: Dict[str, List[_Piece]] = {}
  for entry in entries:
    if entry.plain is not None and entry.sharded is None:
      whole.setdefault(entry.plain.device or '/device:CPU:0', []).append(
        _Piece(entry.name, '', entry.dtype, entry.shape, entry.plain.assign)
      )
    if entry.sharded is None:
      continue
    placed = _ShardPlacer(entry.sharded)
    for p in range(len(entry.sharded.devices)):
      bounds = entry.sharded.sharding.shard_bounds(entry.shape, p)
      if bounds is None or any(stop <= start for start, stop in bounds):
        placed.zeros(p)  # a device holding nothing (or only padding) keeps zeros, as split does
        continue
      sizes = tuple(stop - start for start, stop in bounds)
      by_reader.setdefault(_writer(entry.sharded, p), []).append(
        _Piece(entry.name, _slice_spec(entry.shape, bounds), entry.dtype, sizes, placed.setter(p))
      )
  return by_reader, whole


class _ShardPlacer:
  """Puts restored slices, re-padded to the shard shape, into a sharded variable's shards."""

  def __init__(self, sharded):
    self.sharded = sharded
    self.local = tuple(int(d) for d in sharded.local_shape)
    self.host: Dict[int, np.ndarray] = {}  # backend='xla': shards collected on the host

  def _padded(self, value):
    have = [int(d) for d in value.shape]
    if have == list(self.local):
      return value
    return tf.pad(value, [[0, want - got] for want, got in zip(self.local, have)])

  def zeros(self, p: int) -> None:
    self._place(p, tf.zeros(self.local, self.sharded.dtype))

  def setter(self, p: int):
    return lambda value: self._place(p, self._padded(value))

  def _place(self, p: int, value) -> None:
    if not _is_xla(self.sharded):
      self.sharded.shards[p].assign(value)
      return
    self.host[p] = value.numpy()
    if len(self.host) == len(self.sharded.devices):  # every buffer at once: shards stay whole
      from tf_gspmd.xla_bridge.pjrt import put_local

      self.sharded.shards = put_local(
        [self.host[q] for q in range(len(self.host))], self.sharded.devices
      )


def _read_device(prefix: str, key: str, pieces: List[_Piece]) -> None:
  """One device's RestoreV2 of exactly its slices, then each placed into its shard."""
  with tf.device(_tf_device(key)):
    values = tf.raw_ops.RestoreV2(
      prefix=prefix,
      tensor_names=[p.name for p in pieces],
      shape_and_slices=[p.spec for p in pieces],
      dtypes=[p.dtype for p in pieces],
    )
    for piece, value in zip(pieces, values):
      piece.local(value)


def restore_checkpoint(path: str, target) -> CheckpointRecord:
  """Restore `target`'s variables from the checkpoint at `path` (a directory: its newest).

  Sharded variables (a PartitionedFunction's, any mesh and layout) are read
  slice by slice, each device reading only what it holds; whole variables
  (the originals of sharded ones, plain variables, a Keras model's) are read
  whole. Checkpoint variables the target lacks are ignored; a target variable
  the checkpoint lacks, or of another shape or dtype, is an error naming it.
  Returns a `CheckpointRecord` with the bytes each device read.
  """
  prefix = latest_checkpoint(path)
  _build_optimizers(target)
  entries = _entries(target, 'restore_checkpoint')
  _check(entries, tf.train.load_checkpoint(prefix), prefix)
  by_reader, whole = _restore_pieces(entries)
  held.forget_in_sync(_adopted(entries))  # their shards are written now, then copied back
  for key, pieces in list(by_reader.items()) + list(whole.items()):
    _read_device(prefix, key, pieces)
  # Another task's device runs its reads and writes asynchronously: all done before the copy
  # back and the next step read the shards.
  context.async_wait()
  held.gather_adopted(_adopted(entries))  # the restored shards are their variables' value
  return _record(
    prefix, entries, by_reader, sum(p.nbytes for pieces in whole.values() for p in pieces)
  )
