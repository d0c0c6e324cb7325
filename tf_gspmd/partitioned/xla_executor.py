"""backend='xla': the per-replica program exported to StableHLO (`xla_programs.export`),
compiled by XLA and run through PJRT (needs the `tf_gspmd[xla]` extra)."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional, Sequence

import tensorflow as tf

from tf_gspmd.mesh import Mesh
from tf_gspmd.partitioned import executors, xla_programs
from tf_gspmd.partitioned.compile import Compiled


@dataclasses.dataclass
class XlaRun:
  """backend='xla': the exported module, compiled, and its captures (each one array over the
  replicas, made once: never donated, the same every step)."""

  export: Any  # xla_bridge.XlaExport
  executable: Any  # xla_bridge.PjrtExecutable
  captures: list


class XlaExecutor(executors.Executor):
  """backend='xla': one StableHLO module for every replica, compiled by XLA, run by PJRT."""

  name = 'xla'

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

  def xla_executable(self, prepared) -> Any:
    return prepared().executable

  def check_python_callback(self, op: str, node: str, name: str) -> None:
    """An XLA program cannot call back into Python."""
    from tf_gspmd.xla_bridge.export import XlaLoweringError

    raise XlaLoweringError(
      f'export {name}: op type {op} (node {node}) has no XLA lowering: a Python callback '
      '(tf.py_function, tf.numpy_function) runs in the TF runtime, never inside an XLA '
      f"program. Use backend='{executors.DEFAULT}', or write it with TF ops."
    )

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


def prepare(compiled: Compiled, sharded_variables: dict, devices: list, name: str) -> XlaRun:
  """`compiled` exported, compiled for `devices`, and its captures put on them."""
  from tf_gspmd.xla_bridge import pjrt

  exported = xla_programs.export(compiled, sharded_variables, name)
  executable = pjrt.PjrtExecutable(exported, devices, donate=True)
  n_args = len(compiled.program.arg_inputs)
  capture_args = exported.args[n_args : n_args + len(compiled.capture_values)]
  captures = [
    executable.array_of(layout, pjrt.put_global(value, layout, executable.devices))
    for value, layout in zip(compiled.capture_values, capture_args)
  ]
  _return_freed_heap()
  return XlaRun(exported, executable, captures)


def _return_freed_heap() -> None:
  """Give the heap the build freed back to the OS before the program first runs.

  Capturing, lowering and compiling a program is a one-time burst of host memory (tens of MiB
  for a small model) that glibc keeps cached after it is freed; the program's temporaries are
  then allocated on top of it, so a process's peak would carry the build's memory into the
  first step. Measured on bench/memory.py's MLP: about 30 MiB less at the peak.
  """
  try:
    import ctypes

    ctypes.CDLL('libc.so.6').malloc_trim(0)
  except (OSError, AttributeError):  # not glibc: nothing to return this way
    pass


def run(compiled: Compiled, xla_run: XlaRun, flat_args, sharded_variables: dict):
  """Run the compiled module once: arguments split to device buffers, variables stay resident."""
  from tf_gspmd.xla_bridge import pjrt

  devices = xla_run.executable.devices
  inputs = [
    pjrt.put_global(value, layout, devices) for value, layout in zip(flat_args, xla_run.export.args)
  ]
  inputs += xla_run.captures
  holders = [sharded_variables[id(v)] for v in compiled.variables]
  inputs += [holder.step_input() for holder in holders]
  first_variable = len(flat_args) + len(xla_run.captures)
  executable = xla_run.executable
  flat = []
  for layout, result in zip(xla_run.export.results, executable.run_arrays(inputs)):
    if layout.kind == 'output':
      buffers = executable.buffers_of(result)
      flat.append(pjrt.assemble_global(buffers, layout.sharding, layout.shape, layout.name))
    else:  # the new value of a variable: it replaces the old one (donated to this step)
      holders[layout.updates - first_variable].array = result
  structure = compiled.program.structured_outputs
  if structure is None:
    return None
  return tf.nest.pack_sequence_as(structure, flat, expand_composites=True)
