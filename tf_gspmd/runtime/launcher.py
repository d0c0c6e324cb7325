"""Run one per-partition program on every device of a mesh.

`SpmdProgram(mesh, fn, in_shardings, out_shardings)` turns a Python function
`fn(ctx, *local_args)` -- written for one partition, talking to the others
through `ctx.collectives` -- into a callable on global values:

1. The per-partition `tf.function` is traced once per set of local shard
   shapes (`trace_per_partition`, over `tf_gspmd.program`'s), with inputs
   `(partition_id: int32 scalar, token: resource, *local_args)`. It carries
   `_noinline`, so the outer graph holds N call ops to one library function
   (not N inlined copies), and While loops with collectives inside work: an
   inlined copy would give each device a different loop frame name, which
   ends up in the collective rendezvous key and hangs.
2. An outer `tf.function` splits host inputs by their Sharding (uneven shards
   padded to the ceil size), calls the per-partition function once per
   device under `tf.device(devices[p])` with partition id `p` and that
   device's ordering token, and assembles the outputs into global tensors
   (padding removed) or returns them as `ShardedValue`s.

Partition `p` is mesh device id `p` and runs on `devices[p]` (`/device:CPU:p`
by default, GPUs when there are enough). The ordering tokens are handles of
one small variable per device; they order each device's collectives and carry
progress markers (which collective a device is in, since when). A watchdog
thread (`runtime.watchdog`) times collectives out from those markers (TF's own per-op timeouts
cost a sleeping thread per op execution), and when a collective fails or
times out, `__call__` raises a `CollectiveError` naming the collective, its
group, which partitions were waiting in it and which never arrived. A failed
collective aborts TF's collective executor for the whole process: later
collectives fail at once. Which Grappler passes run on the program: `runtime.grappler`.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable, List, Optional, Sequence

import numpy as np
import tensorflow as tf

from tf_gspmd import program as program_lib
from tf_gspmd.collectives import tables
from tf_gspmd.device_names import full_name
from tf_gspmd.mesh import Mesh
from tf_gspmd.program import PARTITION_ID_SPEC, TOKEN_SPEC, PerPartitionProgram
from tf_gspmd.runtime import collectives as collectives_lib
from tf_gspmd.runtime import remote_watch
from tf_gspmd.runtime import sharded as sharded_lib
from tf_gspmd.runtime.errors import CollectiveError
from tf_gspmd.runtime.grappler import call_config, without_grappler
from tf_gspmd.runtime.sharded import ShardedValue, ShardedVariable
from tf_gspmd.runtime.watchdog import WATCHDOG, CallWatch, collective_error
from tf_gspmd.sharding import NamedSharding, P, Sharding
from tf_gspmd.tf_private import fast_graph_building, own_function, without_op_tracebacks

DEFAULT_TIMEOUT = collectives_lib.DEFAULT_TIMEOUT


def trace_per_partition(
  mesh: Mesh,
  fn: Callable,
  local_specs: Sequence,
  *,
  backend=None,
  devices: Optional[Sequence[str]] = None,
  op_timeout: float = 0.0,
  jit_compile: Optional[bool] = None,
  progress_markers: bool = True,
  autograph: bool = True,
  name: Optional[str] = None,
) -> PerPartitionProgram:
  """Trace `fn(ctx, *local_args)` once as the per-partition program (see `tf_gspmd.program`).

  The default backend (None: the TF runtime) gives a function of
  `(partition_id, token, *local_args)` that runs collectives with TF ops between
  `devices` (default: see `default_devices`); `op_timeout` is TF's per-op collective
  timeout (0: none; see `TFCollectives` for why the launcher uses a watchdog instead).
  Any other backend (a `Collectives` subclass such as `tf_gspmd.xla_bridge.XlaCollectives`,
  or a `program.Backend`) is traced as `program.trace_per_partition` does.
  """
  if backend is None:
    backend = tf_backend(devices, op_timeout, progress_markers)
  return program_lib.trace_per_partition(
    mesh, fn, local_specs, backend=backend, jit_compile=jit_compile, autograph=autograph, name=name
  )


def tf_backend(
  devices: Optional[Sequence[str]] = None, op_timeout: float = 0.0, progress_markers: bool = True
) -> program_lib.Backend:
  """The TF runtime as a `program.Backend`: collective V2 ops between TF devices, ordered by
  a per-device token (whose progress markers the watchdog reads)."""

  def collectives(mesh, partition_id, token):
    made = collectives_lib.TFCollectives(
      mesh,
      partition_id,
      token,
      devices=devices,
      timeout=op_timeout,
      progress_markers=progress_markers,
    )
    if progress_markers:  # 0: entered the program, no collective finished yet
      collectives_lib.set_marker(token, 0, name='entered')
    return made

  return program_lib.Backend(
    'tf', (PARTITION_ID_SPEC, TOKEN_SPEC), collectives, {'_noinline': True}
  )


def default_devices(num_partitions: int) -> tuple:
  """GPUs when there are at least N, else /device:CPU:0..N-1."""
  gpus = tf.config.list_logical_devices('GPU')
  if len(gpus) >= num_partitions:
    return tuple(d.name for d in gpus[:num_partitions])
  return collectives_lib.default_devices(num_partitions)


@dataclasses.dataclass(frozen=True)
class _Arg:
  kind: str  # 'global' (split in the outer graph), 'sharded' (ShardedValue), 'variable'
  sharding: Sharding
  local_spec: Any


@dataclasses.dataclass(frozen=True)
class _Out:
  sharding: Sharding
  shape: tuple
  keep_sharded: bool


class SpmdProgram:
  """A per-partition function run on every device of `mesh`; called with global values.

  Args:
    mesh: the Mesh; its device ids are the partition ids.
    fn: `fn(ctx, *local_args)` -> a tensor or a (nested) structure of tensors,
      written for one partition (`ctx` is a `PartitionContext`).
    in_shardings: one per positional argument (None: replicated, or for a
      `ShardedValue`/`ShardedVariable` argument its own sharding).
    out_shardings: one Sharding for every output, or one per flattened output
      (default: replicated, the value of partition 0 is returned).
    out_shapes: global shapes of the flattened outputs where the local shape
      times the number of tiles overstates them (uneven shards); None entries
      mean no padding.
    keep_sharded: True (or one bool per flattened output) to get `ShardedValue`s.
    devices: the device of each partition (default: see `default_devices`).
    timeout: seconds a collective may wait for its peers (None: forever). A watchdog
      thread reads the progress markers and aborts the process's collectives when one
      device has waited longer; the call then raises `CollectiveError`.
    autograph: convert Python control flow in `fn` (default True).
    progress_markers: record each device's collective progress in its token
      variable, so a failed collective is reported by name and group (default True).

  Arguments at call time: host values (numpy, tensors) are split by their
  in_sharding; a `ShardedValue` passes its shards; a `ShardedVariable` passes
  each device's variable, which the per-partition function can read and assign.
  """

  def __init__(
    self,
    mesh: Mesh,
    fn: Callable,
    in_shardings: Optional[Sequence] = None,
    out_shardings=None,
    *,
    out_shapes: Optional[Sequence] = None,
    keep_sharded=False,
    devices: Optional[Sequence[str]] = None,
    timeout: Optional[float] = DEFAULT_TIMEOUT,
    autograph: bool = True,
    progress_markers: bool = True,
    name: Optional[str] = None,
  ):
    tables.check_mesh(mesh)
    self.mesh = mesh
    self.fn = fn
    self.in_shardings = None if in_shardings is None else tuple(in_shardings)
    self.out_shardings = out_shardings
    self.out_shapes = out_shapes
    self.keep_sharded = keep_sharded
    self.devices = tuple(devices) if devices is not None else default_devices(mesh.size)
    if len(self.devices) != mesh.size:
      raise ValueError(f'SpmdProgram: {len(self.devices)} devices for a mesh of {mesh.size}.')
    self.timeout = None if timeout is None else float(timeout)
    self.autograph = autograph
    self.progress_markers = progress_markers
    self.name = re.sub(r'\W', '_', name or getattr(fn, '__name__', 'spmd')).strip('_') or 'spmd'
    self._programs = {}
    self._outer = {}
    self._layouts = {}  # id(per-partition program) -> its output layouts
    self._described = {}  # argument key -> (described args, the ShardedVariables they name)
    self._tokens = None
    self._last = None

  # --- public -------------------------------------------------------------------------------
  @property
  def records(self) -> List[collectives_lib.CollectiveRecord]:
    """Collectives of the most recently traced or called per-partition program."""
    return [] if self._last is None else self._last.records

  @property
  def per_partition(self) -> Optional[PerPartitionProgram]:
    return self._last

  def __call__(self, *args):
    args_spec = self._described_args(args)
    program = self._program(args_spec)
    outer = self._outer_function(args_spec, program, args)
    self._last = program
    # Variables are captured by the outer function (see _outer_function): only the
    # other arguments are passed, so a call does not hand TF V x N variables to check.
    inputs = [
      self._outer_input(a, value) for a, value in zip(args_spec, args) if a.kind != 'variable'
    ]
    remote = self.timeout is not None and remote_watch.spans_other_tasks(self.devices)
    watch = None
    try:
      token_variables = self._token_variables(remote)
      tokens = [t.handle for t in token_variables]

      def launch():
        with without_grappler():  # per thread: the call may run on remote_watch's thread
          return outer(tokens, *inputs)

      if remote:  # partitions in other processes: watched for a task that stops answering
        flat = remote_watch.run_watched(
          launch, token_variables, self.devices, self.timeout, self.name
        )
      else:
        watch = WATCHDOG.watch(self.name, self.timeout, self.progress_markers, token_variables)
        flat = launch()
    except remote_watch.Hang as hang:
      raise CollectiveError(str(hang)) from None
    except tf.errors.OpError as error:
      self._raise_collective_error(program, error, watch)
      raise
    finally:
      WATCHDOG.unwatch(watch)
    return self._pack(program, flat)

  def build_per_partition(self, *args) -> PerPartitionProgram:
    """Trace (or fetch the cached) per-partition program for these arguments; runs nothing."""
    program = self._program(self._describe_args(args))
    self._last = program
    return program

  def trace(self, *args):
    """Trace the per-partition program and the outer launch without running them.

    Args may be values or `tf.TensorSpec`s of the global inputs. Returns the
    outer concrete function; needs no devices.
    """
    args_spec = self._describe_args(args)
    program = self._program(args_spec)
    self._last = program
    outer = self._outer_function(args_spec, program)
    inputs = []
    for a, value in zip(args_spec, args):
      if a.kind == 'global':
        inputs.append(
          value
          if isinstance(value, tf.TensorSpec)
          else tf.TensorSpec(np.shape(value), tf.convert_to_tensor(value).dtype)
        )
      else:
        inputs.append(self._outer_input(a, value))
    return outer.get_concrete_function([TOKEN_SPEC] * self.mesh.size, *inputs)

  # --- arguments ----------------------------------------------------------------------------
  def _described_args(self, args) -> tuple:
    """`_describe_args(args)`, built once per argument kind, shape and variable identity.

    A step calls with the same shapes and the same sharded variables every time;
    the cache entry holds those variables, so their ids cannot be reused while it lives.
    """
    key = tuple(_arg_key(value) for value in args)
    if any(k is None for k in key):  # a ShardedValue: its shards change with every value
      return self._describe_args(args)
    entry = self._described.get(key)
    if entry is None:
      kept = [v for v in args if isinstance(v, ShardedVariable)]
      entry = self._described[key] = (self._describe_args(args), kept)
    return entry[0]

  def _describe_args(self, args) -> tuple:
    if self.in_shardings is not None and len(self.in_shardings) != len(args):
      raise ValueError(
        f'{self.name}: {len(args)} arguments but {len(self.in_shardings)} in_shardings.'
      )
    described = []
    for i, value in enumerate(args):
      given = self.in_shardings[i] if self.in_shardings is not None else None
      what = f'{self.name} argument {i}'
      if isinstance(value, (ShardedVariable, ShardedValue)):
        kind = 'variable' if isinstance(value, ShardedVariable) else 'sharded'
        if given is not None and not given.is_equivalent_to(value.sharding):
          raise ValueError(
            f'{what}: it is sharded as {value.sharding} but in_shardings says '
            f'{given}; reshard it first.'
          )
        count = len(value.variables) if kind == 'variable' else len(value.shards)
        if count != self.mesh.size:
          raise ValueError(f'{what}: {count} shards for a mesh of {self.mesh.size} partitions.')
        local = (
          value.variables[0]
          if kind == 'variable'
          else tf.TensorSpec(value.shards[0].shape, value.shards[0].dtype)
        )
        described.append(_Arg(kind, value.sharding, local))
        continue
      if isinstance(value, tf.TensorSpec):
        shape, dtype = tuple(value.shape), value.dtype
      else:
        tensor = tf.convert_to_tensor(value)
        shape, dtype = tuple(tensor.shape), tensor.dtype
      sharding = given if given is not None else NamedSharding(self.mesh, P(*[None] * len(shape)))
      sharding.check_shape(shape, what)
      described.append(
        _Arg('global', sharding, tf.TensorSpec(sharding.shard_shape(shape), dtype, name=f'arg{i}'))
      )
    return tuple(described)

  def _outer_input(self, arg: _Arg, value):
    if arg.kind == 'variable':
      return list(value.variables)
    if arg.kind == 'sharded':
      return list(value.shards)
    return value

  # --- tracing --------------------------------------------------------------------------------
  def _program(self, args_spec) -> PerPartitionProgram:
    key = tuple((a.kind, _spec_key(a.local_spec)) for a in args_spec)
    program = self._programs.get(key)
    if program is None:
      program = trace_per_partition(
        self.mesh,
        self.fn,
        [a.local_spec for a in args_spec],
        devices=self.devices,
        autograph=self.autograph,
        progress_markers=self.progress_markers,
        name=f'{self.name}_per_partition',
      )
      self._programs[key] = program
    return program

  def _out_layouts(self, program: PerPartitionProgram) -> List[_Out]:
    specs = program.output_specs
    shardings = self.out_shardings
    if shardings is None or isinstance(shardings, Sharding):
      shardings = [shardings] * len(specs)
    shardings = list(shardings)
    shapes = list(self.out_shapes) if self.out_shapes is not None else [None] * len(specs)
    keep = self.keep_sharded
    keep = [bool(keep)] * len(specs) if isinstance(keep, bool) else list(keep)
    for what, values in (
      ('out_shardings', shardings),
      ('out_shapes', shapes),
      ('keep_sharded', keep),
    ):
      if len(values) != len(specs):
        raise ValueError(
          f'{self.name}: the per-partition function has {len(specs)} outputs '
          f'but {what} has {len(values)} entries.'
        )
    layouts = []
    for j, (spec, sharding, shape, keep_j) in enumerate(zip(specs, shardings, shapes, keep)):
      local = tuple(spec.shape)
      if sharding is None:
        sharding = NamedSharding(self.mesh, P(*[None] * len(local)))
      if shape is None:
        tiles = sharding.tile_shape if sharding.kind == 'tiled' else (1,) * len(local)
        shape = tuple(int(s) * t for s, t in zip(local, tiles))
      shape = tuple(int(s) for s in shape)
      if tuple(sharding.shard_shape(shape)) != local:
        raise ValueError(
          f'{self.name} output {j}: local shape {local} is not the shard shape '
          f'{tuple(sharding.shard_shape(shape))} of global shape {shape} under {sharding}.'
        )
      layouts.append(_Out(sharding, shape, keep_j))
    return layouts

  def _outer_function(self, args_spec, program, args=None):
    # One outer function per per-partition program (the same local specs give the same
    # kinds and shardings) and, when called with `args`, per set of sharded variables:
    # those are captured (their handles taken once, at tracing), not passed per call.
    # tf.function retraces it for other global shapes. Without `args` (`trace`),
    # variables are arguments.
    bound = (
      None
      if args is None
      else {i: value for i, (a, value) in enumerate(zip(args_spec, args)) if a.kind == 'variable'}
    )
    key = (id(program), None if bound is None else tuple(id(v) for v in bound.values()))
    outer = self._outer.get(key)
    if outer is not None:
      return outer[0]
    layouts = self._layouts.get(id(program))
    if layouts is None:
      layouts = self._layouts[id(program)] = self._out_layouts(program)
    devices = self.devices

    def launch_ops(tokens, *passed):
      n = len(devices)
      per_device = [[] for _ in devices]
      passed = iter(passed)
      for i, arg in enumerate(args_spec):
        value = bound[i] if bound is not None and i in bound else next(passed)
        if arg.kind == 'global':
          shards = sharded_lib.split(value, arg.sharding, devices, f'{self.name} argument {i}')
        elif arg.kind == 'variable':
          shards = [v.handle for v in (value.variables if bound is not None else value)]
        else:
          shards = value
        for p in range(n):
          per_device[p].append(shards[p])
      # One call op per device, made directly: ConcreteFunction.__call__ costs ~7 ms of Python
      # per call. And the function joins the graph's library only after the call ops exist:
      # TF infers a call op's output shapes by walking the whole body when it can find the
      # function, which made each call op cost O(program size) (3 ms for 500 ops); the shapes
      # are known anyway and set below.
      function = program.function
      captured = list(function.captured_inputs)
      out_types = [spec.dtype for spec in program.output_specs]
      partition_ids = tf.unstack(tf.range(n, dtype=tf.int32), num=n)
      read_only = _read_only_inputs(function)
      results = []
      for p, device in enumerate(devices):
        with tf.device(device):
          call = tf.raw_ops.StatefulPartitionedCall(
            args=[partition_ids[p], tokens[p]] + per_device[p] + captured,
            Tout=out_types,
            f=function.name,
            config_proto=call_config(),
            name=f'partition_{p}',
          )
        if read_only is not None:
          (call[0].op if out_types else call)._set_attr(*read_only)  # noqa: SLF001
        call = call if out_types else []  # with no outputs TF hands back the Operation
        for tensor, spec in zip(call, program.output_specs):
          tensor.set_shape(spec.shape)
        results.append(call)
      function.add_to_graph(tf.compat.v1.get_default_graph())
      outputs = []
      for j, layout in enumerate(layouts):
        shards = [results[p][j] for p in range(n)]
        outputs.append(
          shards
          if layout.keep_sharded
          else sharded_lib.assemble(
            shards, layout.sharding, layout.shape, f'{self.name} output {j}'
          )
        )
      return outputs

    def launch(tokens, *passed):
      # Splits, calls and assembly are tf_gspmd's ops: no Python stacks for TF to convert
      # on the first run of each of the mesh's devices (`without_op_tracebacks`).
      with without_op_tracebacks(), fast_graph_building():
        return launch_ops(tokens, *passed)

    launch.__name__ = f'{self.name}_launch'
    outer = own_function(launch, autograph=False)
    self._outer[key] = (outer, bound)  # `bound` keeps the captured variables' ids unique
    return outer

  def _pack(self, program, flat):
    layouts = self._layouts[id(program)]
    values = [
      ShardedValue(out, layout.sharding, layout.shape) if layout.keep_sharded else out
      for out, layout in zip(flat, layouts)
    ]
    if program.output_structure is None:
      return None
    return tf.nest.pack_sequence_as(program.output_structure, values)

  # --- tokens and failures -----------------------------------------------------------------
  def _token_variables(self, remote: bool = False):
    """Each partition's token variable, made on its device at the first call. On other tasks'
    devices (`remote`) within the call's timeout: a stopped task would block it for good."""
    if self._tokens is None:
      available = {full_name(d.name) for d in tf.config.list_logical_devices()}
      missing = [d for d in self.devices if full_name(d) not in available]
      if missing:
        raise ValueError(
          f'{self.name}: devices {missing[:4]}{"..." if len(missing) > 4 else ""} do not exist '
          f'({len(available)} logical devices here). Configure {self.mesh.size} logical devices '
          'with tf.config.set_logical_device_configuration before TF starts.'
        )
      name = f'{self.name}_token'
      if remote:
        self._tokens = remote_watch.made_on_each_device(
          lambda p, device: collectives_lib.new_token_variable(device, f'{name}{p}'),
          self.devices,
          self.timeout,
          self.name,
        )
      else:
        self._tokens = [
          collectives_lib.new_token_variable(device, f'{name}{p}')
          for p, device in enumerate(self.devices)
        ]
    return self._tokens

  def _raise_collective_error(
    self, program: PerPartitionProgram, error: Exception, watch: Optional[CallWatch]
  ) -> None:
    """Raise a CollectiveError naming the failed collective, when the markers say which."""
    told = collective_error(program.records, self._tokens, self.timeout, error, watch)
    if told is not None:
      raise told from error


def _read_only_inputs(function):
  """The `_read_only_resource_inputs` attr TF puts on its own call ops of `function`, or None.

  Automatic control dependencies order call ops that share a resource unless it
  is marked read-only; partitions sharing a variable they only read (a
  SavedModel stores a replicated shard once) would otherwise run one after the
  other, and the first would wait in a collective for the second forever. The
  call ops here are made directly (see `launch`), so they get the mark here
  (`auto_control_deps_utils` is TF-private: it is what TF's own calls use).
  """
  from tensorflow.core.framework import attr_value_pb2

  from tf_gspmd.tf_private import auto_control_deps_utils

  indices = auto_control_deps_utils.get_read_only_resource_input_indices_graph(function.graph)
  if not indices:
    return None
  return (
    auto_control_deps_utils.READ_ONLY_RESOURCE_INPUTS_ATTR,
    attr_value_pb2.AttrValue(list=attr_value_pb2.AttrValue.ListValue(i=indices)),
  )


# Grappler passes run on the per-partition function (TF_GSPMD_GRAPPLER overrides: a comma-
# separated list such as 'remapping', 'all' for TF's default pipeline, 'none' for none).


def _arg_key(value):
  """What `_describe_args` depends on in one argument (None: describe it every call)."""
  if isinstance(value, ShardedVariable):
    return ('variable', id(value))
  if isinstance(value, ShardedValue):
    return None
  if isinstance(value, tf.TensorSpec):
    return ('spec', tuple(value.shape), value.dtype)
  dtype = getattr(value, 'dtype', None)
  if dtype is None or not hasattr(value, 'shape'):  # a Python number or list
    return ('py', type(value), repr(value)) if isinstance(value, (int, float, bool)) else None
  return ('value', tuple(value.shape), str(dtype))


def _spec_key(spec):
  if isinstance(spec, tf.Variable):
    return ('variable', tuple(spec.shape), spec.dtype.name)
  return (tuple(spec.shape), spec.dtype.name)
