"""backend='xla' and the XLA lowerings: the per-replica program exported to StableHLO,
compiled by XLA and run through PJRT (needs the `tf_gspmd[xla]` extra), or traced with
XLA collective ops for a TPU replica."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, List, Optional, Sequence

import tensorflow as tf

from tf_gspmd.mesh import Mesh
from tf_gspmd.partitioned import executors
from tf_gspmd.partitioned.compile import Compiled
from tf_gspmd.partitioned.variables import local_variable


@dataclasses.dataclass
class XlaRun:
  """backend='xla': the exported module, compiled, and the device buffers of its captures."""

  export: Any  # xla_bridge.XlaExport
  executable: Any  # xla_bridge.PjrtExecutable
  capture_buffers: List[list]


class XlaExecutor(executors.Executor):
  """backend='xla': one StableHLO module for every replica, compiled by XLA, run by PJRT."""

  name = 'xla'
  compiles_with_xla = True
  runs_python_callbacks = False  # an XLA program cannot call into Python

  def collectives_class(self) -> type:
    from tf_gspmd.xla_bridge.native import NativeCollectives

    return NativeCollectives

  def sharded_variable_class(self) -> type:
    """What holds a variable's shards: device buffers, one per device."""
    from tf_gspmd.xla_bridge.pjrt import XlaShardedVariable

    return XlaShardedVariable

  def devices(self, mesh: Mesh, devices: Optional[Sequence]):
    return functools.partial(devices_for, mesh, devices)  # jax is imported when asked

  def devices_named(self, names: Sequence[str]) -> list:
    from tf_gspmd.xla_bridge.pjrt import devices_named

    return devices_named(names)

  def check_fits(self, layouts, mesh_size: int, devices: Optional[Sequence]) -> None:
    """Refuse shards that would not fit a PJRT device whose memory it reports (a GPU's or
    TPU's `bytes_limit`); a CPU device's memory is the host's and reports none."""
    from tf_gspmd.partitioned.variables import check_fits

    chosen = _devices_of_size(mesh_size, devices)
    by_name = {str(d): d for d in chosen}
    check_fits(layouts, [str(d) for d in chosen], lambda name: device_capacity(by_name[name]))

  def running_phase(self, mesh) -> str:
    return 'compiling with XLA and running the first step'

  def prepare(self, compiled, sharded_variables: dict, devices, timeout, name: str) -> 'XlaRun':
    del timeout  # PJRT runs have no watchdog
    return prepare(compiled, sharded_variables, devices(), name)

  def run(self, compiled, flat_args, sharded_variables: dict, what: str):
    del what
    return run(compiled, compiled.prepared, flat_args, sharded_variables)


def device_capacity(device) -> Optional[int]:
  """Bytes a PJRT device holds, where it says (`memory_stats()['bytes_limit']`); None else."""
  stats = device.memory_stats() if hasattr(device, 'memory_stats') else None
  limit = (stats or {}).get('bytes_limit')
  return int(limit) if limit else None


def devices_for(mesh: Mesh, devices: Optional[Sequence]) -> list:
  """The jax devices the program runs on: `devices` as given, or the first mesh.size."""
  return _devices_of_size(mesh.size, devices)


def _devices_of_size(size: int, devices: Optional[Sequence]) -> list:
  from tf_gspmd.xla_bridge.pjrt import jax_devices

  if devices is None:
    return jax_devices(size)
  if any(isinstance(d, str) for d in devices):
    raise ValueError(
      "partition: with backend='xla', devices are jax devices (jax.devices()), "
      f'not TF device names such as {devices[0]!r}.'
    )
  return list(devices)


def lower(compiled: Compiled, sharded_variables: dict, partition_id: int, name: str):
  """`(program, hlo_text)`: the per-partition program traced with XLA collective ops and
  its HLO, jit-compiled for this machine's XLA device (see PartitionedFunction.lower_xla)."""
  from tf_gspmd.program import trace_per_partition
  from tf_gspmd.xla_bridge import XlaCollectives

  shard_variables = [local_variable(sharded_variables[id(v)]) for v in compiled.variables]
  program = trace_per_partition(
    compiled.mesh,
    compiled.per_partition,
    compiled.local_specs + shard_variables,
    backend=XlaCollectives,
    jit_compile=True,
    name=f'{name}_xla',
  )
  zeros = [tf.zeros(spec.shape, spec.dtype) for spec in compiled.local_specs]
  hlo = program.tf_function.experimental_get_compiler_ir(
    tf.constant(partition_id, tf.int32), *zeros, *shard_variables
  )(stage='hlo')
  return program, hlo


def export(compiled: Compiled, sharded_variables: dict, name: str):
  """The per-replica StableHLO module of `compiled` (an `xla_bridge.XlaExport`), with the
  layout of every argument, capture, variable and output."""
  from tf_gspmd.xla_bridge.export import Layout, export_per_replica

  program, main = compiled.program, compiled.program.main
  names = list(program.arg_inputs) + list(program.captures)
  layouts = []
  for i, (tensor, spec) in enumerate(zip(names, compiled.local_specs)):
    kind = 'argument' if i < len(program.arg_inputs) else 'capture'
    layouts.append(
      Layout(
        tensor,
        kind,
        tuple(main.tensor(tensor).shape),
        spec.dtype,
        compiled.plan.target(main, tensor),
        tuple(spec.shape),
      )
    )
  templates = []
  for var in compiled.variables:
    sharded = sharded_variables[id(var)]
    layouts.append(
      Layout(
        var.name,
        'variable',
        sharded.shape,
        sharded.dtype,
        sharded.sharding,
        tuple(sharded.local_shape),
      )
    )
    templates.append(local_variable(sharded))
  outputs = [
    Layout(t, 'output', shape, main.tensor(t).dtype, sharding, tuple(sharding.shard_shape(shape)))
    for t, sharding, shape in zip(main.outputs, compiled.out_shardings, compiled.out_shapes)
  ]
  examples = [tf.zeros(spec.shape, spec.dtype) for spec in compiled.local_specs] + templates
  return export_per_replica(
    compiled.mesh,
    compiled.per_partition,
    examples,
    name=f'{name}_per_replica',
    arg_layouts=layouts,
    output_layouts=outputs,
  )


def prepare(compiled: Compiled, sharded_variables: dict, devices: list, name: str) -> XlaRun:
  """`compiled` exported, compiled for `devices`, and its captures put on them."""
  from tf_gspmd.xla_bridge import pjrt

  exported = export(compiled, sharded_variables, name)
  executable = pjrt.PjrtExecutable(exported, devices, donate=True)
  n_args = len(compiled.program.arg_inputs)
  captures = [
    pjrt.put_global(value, layout, executable.devices)
    for value, layout in zip(
      compiled.capture_values, exported.args[n_args : n_args + len(compiled.capture_values)]
    )
  ]
  return XlaRun(exported, executable, captures)


def run(compiled: Compiled, xla_run: XlaRun, flat_args, sharded_variables: dict):
  """Run the compiled module once: arguments split to device buffers, variables stay resident."""
  from tf_gspmd.xla_bridge import pjrt

  devices = xla_run.executable.devices
  inputs = [
    pjrt.put_global(value, layout, devices) for value, layout in zip(flat_args, xla_run.export.args)
  ]
  inputs += xla_run.capture_buffers
  inputs += [sharded_variables[id(v)].shards for v in compiled.variables]
  first_variable = len(flat_args) + len(xla_run.capture_buffers)
  flat = []
  for layout, buffers in zip(xla_run.export.results, xla_run.executable.run(inputs)):
    if layout.kind == 'output':
      flat.append(pjrt.assemble_global(buffers, layout.sharding, layout.shape, layout.name))
    else:  # the new value of a variable: its device buffers replace the old ones
      variable = compiled.variables[layout.updates - first_variable]
      sharded_variables[id(variable)].shards = buffers
  structure = compiled.program.structured_outputs
  if structure is None:
    return None
  return tf.nest.pack_sequence_as(structure, flat, expand_composites=True)
