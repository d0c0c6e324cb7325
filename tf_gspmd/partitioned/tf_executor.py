"""backend='tf': the per-partition program launched on TF devices by `runtime.SpmdProgram`."""

from __future__ import annotations

from typing import Optional, Sequence

import tensorflow as tf

from tf_gspmd.partitioned import executors
from tf_gspmd.partitioned.compile import Compiled


class TFExecutor(executors.Executor):
  """backend='tf': TF collective ops between TF devices, the program launched by `SpmdProgram`."""

  name = 'tf'

  def collectives_class(self) -> type:
    from tf_gspmd.runtime.collectives import TFCollectives

    return TFCollectives

  def sharded_variable_class(self) -> type:
    """What holds a variable's shards: one TF variable per device."""
    from tf_gspmd.runtime import ShardedVariable

    return ShardedVariable

  def check_fits(self, layouts, mesh_size: int, devices: Optional[Sequence[str]]) -> None:
    from tf_gspmd.partitioned.variables import check_fits
    from tf_gspmd.runtime.collectives import default_devices

    check_fits(layouts, list(devices or default_devices(mesh_size)))

  def running_phase(self, mesh) -> str:
    return f'instantiating on {mesh.size} devices and running the first step'

  def prepare(self, compiled, sharded_variables: dict, devices, timeout, name: str):
    del sharded_variables, name  # the launcher takes the variables' shards at each call
    return spmd_program(compiled, devices(), timeout)

  def run(self, compiled, flat_args, sharded_variables: dict, what: str):
    return run(compiled, flat_args, sharded_variables, what)

  def working_mesh(self, main, propagation, mesh, arg_names, variables):
    """The order most layouts name: fewer boundary moves (TF devices take any order)."""
    from tf_gspmd.partitioned import boundary

    return boundary.working_order(main, propagation, mesh, arg_names, variables)

  def dtensor_devices(self, mesh) -> Optional[list]:
    """A DTensor mesh names TF devices: the program runs on them."""
    from tf_gspmd import dtensor_compat

    return dtensor_compat.mesh_devices(mesh)

  def tf_launcher(self, prepared, what: str):
    return prepared  # a runtime.SpmdProgram

  def built(self, compiled, prepare) -> None:
    prepare(compiled)  # the launcher is made at build: the first call only instantiates it


def spmd_program(compiled: Compiled, devices: Optional[Sequence[str]], timeout: Optional[float]):
  """The launcher of `compiled`'s per-partition program: arguments and captures split by
  their shardings, variables passed as their shards, outputs assembled."""
  from tf_gspmd.runtime import SpmdProgram

  kwargs = {} if timeout is None else {'timeout': timeout}
  return SpmdProgram(
    compiled.mesh,
    compiled.per_partition,
    in_shardings=(
      list(compiled.arg_shardings)
      + list(compiled.capture_shardings)
      + [None] * len(compiled.variables)
    ),
    out_shardings=compiled.out_shardings,
    out_shapes=compiled.out_shapes,
    devices=devices,
    autograph=False,  # the partitioner emits ops from the IR: no Python control flow to convert
    **kwargs,
  )


def run(compiled: Compiled, flat_args, sharded_variables: dict, what: str):
  """Call the program once: the flat tensor arguments, then captures, then variable shards.

  `what` names the function in the error raised when a task of a cluster died.
  """
  inputs = (
    list(flat_args)
    + list(compiled.capture_values)
    + [sharded_variables[id(v)] for v in compiled.variables]
  )
  try:
    flat = compiled.prepared(*inputs)
  except tf.errors.UnavailableError as error:  # a task of a cluster died: say which
    from tf_gspmd.runtime import cluster

    cluster.raise_if_task_lost(compiled.prepared.devices, error, what)
    raise
  flat = list(flat) if isinstance(flat, (list, tuple)) else [flat]
  structure = compiled.program.structured_outputs
  if structure is None:
    return None
  return tf.nest.pack_sequence_as(structure, flat, expand_composites=True)
