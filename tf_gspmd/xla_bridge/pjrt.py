"""Compile an exported per-replica module with XLA and run it on the mesh's devices via PJRT.

PJRT is reached through jaxlib (the optional `tf_gspmd[xla]` extra); jax is
imported only here and only when a program runs with backend='xla'. TF is
imported first, and both use the same numpy and ml_dtypes.

Devices: the default jax backend when it has at least N devices (GPUs, TPUs),
else N host CPU devices. XLA makes its host devices once, when jax first
initializes a backend, from `--xla_force_host_platform_device_count` in
XLA_FLAGS: `jax_devices(n)` adds that flag (at least 8) when jax has not
initialized yet, and raises naming the fix when it already has fewer.

The module runs as `num_replicas = N`, one partition per replica, replica r
on `devices[r]`; a value is one single-device buffer per replica.
`PjrtExecutable` compiles once and runs on buffers (no host copies);
`put_global`/`assemble_global` convert global host values to and from those
buffers by an `ExportedValue`; `XlaShardedVariable` keeps a variable's shards as
device buffers between calls.
"""

from __future__ import annotations

import collections
import os
import re
import sys
from typing import Dict, List, Optional, Sequence

import numpy as np
import tensorflow as tf

from tf_gspmd.runtime import sharded as sharded_lib
from tf_gspmd.sharding import Sharding
from tf_gspmd.tf_private import UninitializedVariable
from tf_gspmd.xla_bridge.export import ExportedValue, XlaExport
from tf_gspmd.xla_bridge.hlo import hlo_collectives

HOST_DEVICE_FLAG = '--xla_force_host_platform_device_count'
MIN_HOST_DEVICES = 8


def _import_jax(num_devices: int):
  """jax, with at least `num_devices` host devices asked for if its backends are not up yet."""
  if 'jax' not in sys.modules or not _backends_initialized():
    flags = os.environ.get('XLA_FLAGS', '')
    if HOST_DEVICE_FLAG not in flags:
      count = max(num_devices, MIN_HOST_DEVICES)
      os.environ['XLA_FLAGS'] = f'{flags} {HOST_DEVICE_FLAG}={count}'.strip()
  try:
    import jax
  except ImportError as error:
    raise ImportError(
      "backend='xla' runs programs through PJRT with jax/jaxlib: install them "
      'with `pip install tf_gspmd[xla]` (or `make test`).'
    ) from error
  return jax


def _backends_initialized() -> bool:
  # jax keeps no public flag for this; xla_bridge.backends_are_initialized is the one place.
  from jax._src import xla_bridge

  return xla_bridge.backends_are_initialized()


def jax_devices(num_devices: int) -> list:
  """`num_devices` jax devices: accelerators when there are enough, else host CPUs."""
  jax = _import_jax(num_devices)
  default = jax.devices()
  if default[0].platform != 'cpu' and len(default) >= num_devices:
    return list(default[:num_devices])
  cpus = jax.devices('cpu')
  if len(cpus) < num_devices:
    raise RuntimeError(
      f"backend='xla' needs {num_devices} devices but jax has {len(cpus)} CPU device(s) and "
      f'was initialized before tf_gspmd could ask for more. Set XLA_FLAGS='
      f'{HOST_DEVICE_FLAG}={max(num_devices, MIN_HOST_DEVICES)} before the first use of jax.'
    )
  return list(cpus[:num_devices])


def devices_named(names: Sequence[str]) -> list:
  """The jax device of each TF device name ('/device:CPU:3' -> jax's CPU device 3), so a
  program on the XLA backend runs on the devices a Keras DeviceMesh lists, in its order."""
  parsed = []
  for name in names:
    match = re.fullmatch(r'(?:.*device:)?([A-Za-z_]+):(\d+)', str(name))
    if match is None:
      raise ValueError(f"backend='xla': cannot read device {name!r} as a TF device name.")
    parsed.append((match.group(1).lower(), int(match.group(2))))
  jax = _import_jax(max(i for _, i in parsed) + 1)
  out = []
  for kind, index in parsed:
    available = jax.devices(kind)
    if index >= len(available):
      raise RuntimeError(
        f"backend='xla': device {kind}:{index} asked for, but jax has "
        f'{len(available)} {kind} device(s).'
      )
    out.append(available[index])
  return out


def put_local(values: Sequence, devices: Sequence) -> list:
  """One single-device buffer per replica: `values[r]` on `devices[r]`."""
  jax = _import_jax(len(devices))
  # Under x64 jax keeps 64-bit dtypes as they are (TF programs use int64 step counters).
  with jax.enable_x64(True):
    # One call for every replica (jax batches the transfers), not one per replica.
    return jax.device_put([np.asarray(v) for v in values], list(devices))


def put_global(value, exported: ExportedValue, devices: Sequence) -> list:
  """Split a global host value by `exported.sharding` into one buffer per replica (on the host
  with numpy: the pieces never pass through TF's allocator, which would keep their memory)."""
  if exported.sharding is None:
    raise ValueError(f'{exported.name} has no global sharding; give one value per replica.')
  value = tf.convert_to_tensor(value, dtype=exported.dtype)
  if tuple(value.shape) != tuple(exported.shape):
    raise ValueError(f'{exported.name}: shape {tuple(value.shape)}, expected {exported.shape}.')
  shards = sharded_lib.split_on_host(
    np.asarray(value), exported.sharding, len(devices), exported.name
  )
  # A copy per shard: split's pieces are views of one buffer of the whole value, and a device
  # buffer made from a view on the host's memory would keep that whole buffer alive.
  return put_local([np.array(s, copy=True) for s in shards], devices)


def assemble_global(buffers: Sequence, sharding: Sharding, shape, what: str) -> tf.Tensor:
  """The global value of per-replica buffers (padding dropped, partial results reduced),
  assembled on the host from the buffers it needs (one replica of each tile)."""
  needed = sharded_lib.needed_partitions(sharding, len(buffers), what)
  arrays = [np.asarray(b) if p in needed else None for p, b in enumerate(buffers)]
  return tf.convert_to_tensor(sharded_lib.assemble_on_host(arrays, sharding, shape, what))


def buffers_by_device(array, devices: Sequence) -> list:
  """An array over the replicas as one buffer per device of `devices`, in that order."""
  by_device = {shard.device: shard.data for shard in array.addressable_shards}
  return [by_device[d] for d in devices]


class PjrtExecutable:
  """An `XlaExport` compiled for its mesh's devices; `run` maps per-replica buffers to buffers."""

  def __init__(self, export: XlaExport, devices: Optional[Sequence] = None, donate: bool = False):
    n = export.num_replicas
    self.export = export
    self.devices = list(devices) if devices is not None else jax_devices(n)
    if len(self.devices) != n:
      raise ValueError(f'{export.name}: {len(self.devices)} devices for {n} replicas.')
    jax = _import_jax(n)
    from jax._src.lib import xla_client

    options = xla_client.CompileOptions()
    build = options.executable_build_options
    build.num_replicas, build.num_partitions = n, 1
    build.device_assignment = xla_client.DeviceAssignment.create(
      np.array([[d.id] for d in self.devices])
    )
    client = self.devices[0].client
    # donate: each assigned variable's buffers are given to its new value (they are gone after
    # `run`; the caller keeps the returned ones), so a step never holds a variable twice.
    self.donates = donate and export.donating_module is not None
    module = export.donating_module if self.donates else export.module
    self.executable = client.compile_and_load(
      module, xla_client.DeviceList(tuple(self.devices)), options
    )
    # execute_sharded takes one array per parameter; an array replicated over the devices
    # is the container for "one buffer per replica" (the values differ, as replicas' do).
    self._replicated = jax.sharding.NamedSharding(
      jax.sharding.Mesh(np.array(self.devices), ('replicas',)), jax.sharding.PartitionSpec()
    )
    self._jax = jax
    self._makers: Optional[list] = None

  def run(self, inputs: Sequence[Sequence]) -> List[list]:
    """`inputs[i][r]`: parameter i's buffer on replica r; returns `outputs[j][r]` alike."""
    return [self.buffers_of(result) for result in self.run_arrays(inputs)]

  def run_arrays(self, inputs: Sequence) -> list:
    """`run` on arrays: `inputs[i]` is parameter i's buffers (one per replica) or an array
    `array_of` made; returns one such array per result, with no per-replica list built (a
    step's variables go from one step to the next as arrays)."""
    args = self.export.args
    if len(inputs) != len(args):
      raise ValueError(f'{self.export.name}: {len(inputs)} inputs for {len(args)} parameters.')
    arrays = [self.array_of(described, given) for described, given in zip(args, inputs)]
    results = self.executable.execute_sharded(arrays)
    return results.consume_with_handlers(self._array_makers())

  def array_of(self, described: ExportedValue, given):
    """One array over the replicas from per-replica buffers (`given` as is if it is one)."""
    if isinstance(given, self._jax.Array):
      if given.sharding == self._replicated:
        return given
      given = self.buffers_of(given)  # another program's: its buffers, by device
    with self._jax.enable_x64(True):
      return self._jax.make_array_from_single_device_arrays(
        tuple(described.local_shape), self._replicated, list(given)
      )

  def buffers_of(self, array) -> list:
    """An array over the replicas as its per-replica buffers, replica r's at index r."""
    return buffers_by_device(array, self.devices)

  def _array_makers(self) -> list:
    """Per result, what makes its array from the executable's buffers: jax's own (a jitted
    function's call uses it, calling it a result handler), built once."""
    if self._makers is None:
      # Private (jax._src): jax has no public way to wrap an executable's raw results in
      # arrays; its handler does it in C++, where make_array_from_single_device_arrays checks
      # every buffer in Python again on each call.
      from jax._src import core
      from jax._src.lib import xla_client

      self._makers = [
        xla_client.array_result_handler(
          core.ShapedArray(tuple(r.local_shape), np.dtype(r.dtype.as_numpy_dtype)),
          self._replicated,
          committed=True,
          _skip_checks=True,
        )
        for r in self.export.results
      ]
    return self._makers

  def compiled_hlo(self) -> str:
    """The optimized HLO XLA compiled (what runs, collectives included)."""
    return '\n'.join(m.to_string() for m in self.executable.hlo_modules())

  def collective_counts(self) -> Dict[str, int]:
    """How many collectives of each HLO kind the compiled program has."""
    return dict(collections.Counter(c.kind for c in hlo_collectives(self.compiled_hlo())))


class XlaShardedVariable:
  """A variable's shards kept as device buffers between calls (backend='xla').

  The same surface as `runtime.ShardedVariable`: `assemble()`, `scatter()`,
  `sharding`, `shape`, `local_shape`, `dtype`. `template` is a TF variable of
  the local shape, used only to trace the per-replica program.
  """

  def __init__(
    self,
    initial_value,
    sharding: Sharding,
    *,
    devices: Optional[Sequence] = None,
    name: str = 'sharded',
    trainable: bool = True,
    **unused,
  ):
    del unused  # TF device options of runtime.ShardedVariable do not apply
    value = tf.convert_to_tensor(initial_value)
    if sharding.partial is not None:
      raise ValueError(f'XlaShardedVariable {name!r}: a variable cannot hold partial results.')
    self.sharding = sharding
    self.shape = tuple(int(s) for s in value.shape)
    self.dtype = value.dtype
    self.label = name
    self.trainable = trainable
    self.local_shape = tuple(int(d) for d in sharding.shard_shape(self.shape))
    self.devices = list(devices) if devices is not None else jax_devices(sharding.mesh.size)
    self.exported = ExportedValue(
      name, 'variable', self.shape, self.dtype, sharding, self.local_shape
    )
    self.mirror: Optional[tf.Variable] = None  # see tf_mirror
    # The value is held as per-replica buffers, or as the one array over the replicas a step
    # returned (`array`, split into buffers only when something asks for them).
    self._array = None
    self._needed: Optional[set] = None  # the replicas assemble reads (see _buffers_needed)
    self.shards = put_global(value, self.exported, self.devices)
    self._template = None

  @property
  def shards(self) -> list:
    """The device buffers, partition p's at index p."""
    if self._shards is None:
      self._shards = buffers_by_device(self._array, self.devices)
    return self._shards

  @shards.setter
  def shards(self, buffers) -> None:
    self._shards, self._array = buffers, None
    self._refresh_mirror()

  def step_input(self):
    """What a program takes as this variable's parameter: the array a step left, as it is,
    else the per-replica buffers (`PjrtExecutable.array_of` takes either)."""
    return self._array if self._array is not None else self.shards

  @property
  def array(self):
    """The array over the replicas a step left (None when the value is held as buffers)."""
    return self._array

  @array.setter
  def array(self, array) -> None:
    self._shards, self._array = None, array
    self._refresh_mirror()

  def _refresh_mirror(self) -> None:
    if self.mirror is not None:  # a traced function reads it: kept current with every write
      self.mirror.assign(self.assemble())

  def tf_mirror(self) -> tf.Variable:
    """A TF variable holding the whole value, current from now on: what a plain traced
    function reads (and a SavedModel exports), since a TF graph cannot read PJRT buffers. Made
    at the first such read; every later write (a step, an assignment) refreshes it, a copy of
    the value per write that only variables read that way pay."""
    if self.mirror is None:
      with tf.init_scope(), tf.device('/device:CPU:0'):
        # Made directly, not through tf.Variable: a tf.function being traced a second time
        # refuses variables made through its creator scope, and this one is the holder's.
        mirror = UninitializedVariable(
          shape=self.shape,
          dtype=self.dtype,
          trainable=False,
          name=f'{self.label.replace("/", "_")}_whole',
        )
        mirror.assign(self.assemble())
        self.mirror = mirror
    return self.mirror

  def take_from_mirror(self, value) -> None:
    """The buffers := `value`, already written to the mirror (by a traced function)."""
    # Not through the setter (the mirror holds `value` already), but the step's array goes.
    self._shards, self._array = put_global(value, self.exported, self.devices), None

  @property
  def template(self) -> tf.Variable:
    if self._template is None:
      self._template = tf.Variable(
        tf.zeros(self.local_shape, self.dtype), name=f'{self.label}_template', trainable=False
      )
    return self._template

  # Its shards are PJRT buffers, which a traced TF function cannot read: assemble eagerly.
  assembles_in_graph = False

  def assemble(self) -> tf.Tensor:
    if not tf.executing_eagerly():
      raise RuntimeError(
        f'XlaShardedVariable {self.label!r}: its shards are device buffers '
        'outside TF; assemble() runs eagerly, not inside a tf.function.'
      )
    what = f'XlaShardedVariable {self.label!r}'
    return assemble_global(self._buffers_needed(what), self.sharding, self.shape, what)

  def _buffers_needed(self, what: str) -> list:
    """The per-replica buffers, or, for a value whose replica 0 holds all of it (replicated),
    a list holding that one buffer: split out of a step's array without listing every
    replica's (building jax's shard list of each array cost a copy-back of a hundred
    variables several ms)."""
    array = self._array
    if self._needed is None:  # fixed by the sharding: computed once
      self._needed = sharded_lib.needed_partitions(self.sharding, len(self.devices), what)
    if array is None or self._needed != {0}:
      return self.shards
    if array.sharding.mesh.devices.flat[0] != self.devices[0]:
      return self.shards  # another device order: found by device
    return [array.addressable_data(0)] + [None] * (len(self.devices) - 1)

  def numpy(self) -> np.ndarray:
    return self.assemble().numpy()

  def scatter(self, value) -> None:
    self.shards = put_global(value, self.exported, self.devices)

  def __repr__(self):
    return (
      f'XlaShardedVariable({self.label!r}, {self.dtype.name}{list(self.shape)}, '
      f'{self.sharding}, {len(self.shards)} device buffers of {list(self.local_shape)})'
    )
