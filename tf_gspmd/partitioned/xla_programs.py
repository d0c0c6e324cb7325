"""The XLA programs of a compiled partition, whatever backend runs it: the per-partition
program traced with XLA collective ops for a TPU replica (`lower`), and one StableHLO module for
every replica (`export`), which backend='xla' compiles and `export_xla` hands out."""

from __future__ import annotations

import tensorflow as tf

from tf_gspmd.partitioned.compile import Compiled
from tf_gspmd.partitioned.variables import local_variable


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
    autograph=False,  # the partitioner emits ops from the IR: no Python control flow to convert
    name=f'{name}_xla',
  )
  zeros = [tf.zeros(spec.shape, spec.dtype) for spec in compiled.local_specs]
  hlo = program.tf_function.experimental_get_compiler_ir(
    tf.constant(partition_id, tf.int32), *zeros, *shard_variables
  )(stage='hlo')
  return program, hlo


def export(compiled: Compiled, sharded_variables: dict, name: str):
  """The per-replica StableHLO module of `compiled` (an `xla_bridge.XlaExport`), with the
  sharding of every argument, capture, variable and output."""
  from tf_gspmd.xla_bridge.export import ExportedValue, export_per_replica

  program, main = compiled.program, compiled.program.main
  names = list(program.arg_inputs) + list(program.captures)
  values = []
  for i, (tensor, spec) in enumerate(zip(names, compiled.local_specs)):
    kind = 'argument' if i < len(program.arg_inputs) else 'capture'
    values.append(
      ExportedValue(
        tensor,
        kind,
        tuple(main.tensor(tensor).shape),
        spec.dtype,
        compiled.propagation.target(main, tensor),
        tuple(spec.shape),
      )
    )
  templates = []
  for var in compiled.variables:
    sharded = sharded_variables[id(var)]
    values.append(
      ExportedValue(
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
    ExportedValue(
      t, 'output', shape, main.tensor(t).dtype, sharding, tuple(sharding.shard_shape(shape))
    )
    for t, sharding, shape in zip(main.outputs, compiled.out_shardings, compiled.out_shapes)
  ]
  examples = [tf.zeros(spec.shape, spec.dtype) for spec in compiled.local_specs] + templates
  return export_per_replica(
    compiled.mesh,
    compiled.per_partition,
    examples,
    name=f'{name}_per_replica',
    arg_values=values,
    output_values=outputs,
  )
