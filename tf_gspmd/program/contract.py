"""The per-partition program: how it is traced and what the trace holds.

`trace_per_partition(mesh, fn, local_specs, backend=...)` traces `fn(ctx, *local_args)`
once as a `tf.function` of `(*head, *local_args)`: the head is what the backend
passes every partition (its partition id first, then e.g. the TF runtime's ordering
token), the local arguments are the partition's shards. Inside the trace `ctx` is a
`PartitionContext` holding the backend's `Collectives`, built from the head. Tracing
needs only the mesh, no devices, so it can be timed for any number of partitions.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable, List, Optional, Sequence, Union

import tensorflow as tf

from tf_gspmd.collectives import tables
from tf_gspmd.collectives.interface import CollectiveRecord, Collectives, no_autograph
from tf_gspmd.mesh import Mesh
from tf_gspmd.sharding import Sharding
from tf_gspmd.tf_private import fast_graph_building, shared_values, without_op_tracebacks

PARTITION_ID_SPEC = tf.TensorSpec([], tf.int32, name='partition_id')
TOKEN_SPEC = tf.TensorSpec([], tf.resource, name='token')


@no_autograph
class PartitionContext:
  """What a per-partition function receives as `ctx`.

  `ctx.collectives` is the collective backend (a `Collectives`), `ctx.partition_id`
  this partition's id (int32 scalar tensor), `ctx.mesh` the mesh.
  """

  def __init__(self, mesh: Mesh, collectives: Collectives):
    self.mesh = mesh
    self.collectives = collectives

  @property
  def partition_id(self) -> tf.Tensor:
    return self.collectives.partition_id

  def axis_index(self, axes) -> tf.Tensor:
    return self.collectives.axis_index(axes)

  def shard_offsets(self, sharding: Sharding, shape) -> tf.Tensor:
    return self.collectives.shard_offsets(sharding, shape)

  def table(self, values, name: str = 'table') -> tf.Tensor:
    return self.collectives.table(values, name)


@dataclasses.dataclass
class PerPartitionProgram:
  """A traced per-partition program.

  `function` is the concrete function, `records` the collectives it emits,
  `output_specs` its flat local outputs and `output_structure` how to pack them.
  """

  tf_function: Any
  function: Any
  records: List[CollectiveRecord]
  output_specs: List[tf.TensorSpec]
  output_structure: Any
  backend: str


@dataclasses.dataclass(frozen=True)
class Backend:
  """How a backend's per-partition function begins.

  `head`: the specs of the inputs before the local arguments (named; the partition id
  first). `collectives(mesh, *head)`: the backend's `Collectives` for one partition, made
  inside the trace from those inputs. `attributes`: the tf.function's experimental
  attributes. `name`: what `PerPartitionProgram.backend` records.
  """

  name: str
  head: tuple
  collectives: Callable[..., Collectives]
  attributes: Optional[dict] = None


def compiled_backend(collectives_cls: type) -> Backend:
  """A backend whose collectives are compiled ops (the XLA bridge's `XlaCollectives`): the
  program takes the partition id only, no token."""
  return Backend(
    getattr(collectives_cls, 'backend', collectives_cls),
    (PARTITION_ID_SPEC,),
    collectives_cls,
  )


def trace_per_partition(
  mesh: Mesh,
  fn: Callable,
  local_specs: Sequence,
  *,
  backend: Union[Backend, type],
  jit_compile: Optional[bool] = None,
  autograph: bool = True,
  name: Optional[str] = None,
) -> PerPartitionProgram:
  """Trace `fn(ctx, *local_args)` once as the per-partition program.

  `local_specs`: the local shard specs (`tf.TensorSpec`s, or variables for variable
  arguments). `backend`: a `Backend`, or a `Collectives` subclass whose program takes
  `(partition_id, *local_args)` (see `compiled_backend`).
  """
  tables.check_mesh(mesh)
  if isinstance(backend, type) and issubclass(backend, Collectives):
    backend = compiled_backend(backend)
  if not isinstance(backend, Backend):
    raise ValueError(
      f'trace_per_partition: unknown backend {backend!r}; use a program.Backend or a '
      "Collectives subclass (e.g. tf_gspmd.xla_bridge.XlaCollectives; 'tf' through "
      'tf_gspmd.runtime.trace_per_partition).'
    )
  captured = {}
  n_head = len(backend.head)

  def per_partition(*inputs):
    # One node per constant value and per value computed from them and the partition id
    # alone: TF prepares every node of this body once per device.
    with shared_values(tf.compat.v1.get_default_graph(), seeds=inputs[: min(n_head, 1)]):
      ctx = PartitionContext(mesh, backend.collectives(mesh, *inputs[:n_head]))
      outputs = fn(ctx, *inputs[n_head:])
    captured['records'] = ctx.collectives.records
    captured['structure'] = outputs
    if outputs is None:  # a step that only updates variables
      return []
    return [tf.convert_to_tensor(o) for o in tf.nest.flatten(outputs)]

  # Named parameters, so the traced function's inputs are named as the head specs and
  # `local_args_<i>` (what TF names an unnamed spec of a `*local_args` parameter).
  per_partition.__signature__ = _signature([spec.name for spec in backend.head])
  per_partition.__name__ = name or f'{getattr(fn, "__name__", "fn")}_per_partition'
  tf_function = tf.function(
    per_partition,
    jit_compile=jit_compile,
    autograph=autograph,
    experimental_attributes=backend.attributes,
  )
  # Its ops' Python stacks would name the partitioner's lines, and TF converts each one on
  # every device's first run (`without_op_tracebacks`); TF's C++ op building is faster.
  with without_op_tracebacks(), fast_graph_building():
    concrete = tf_function.get_concrete_function(*backend.head, *local_specs)
  output_specs = [tf.TensorSpec(t.shape, t.dtype) for t in concrete.structured_outputs]
  return PerPartitionProgram(
    tf_function,
    concrete,
    captured.get('records', []),
    output_specs,
    captured.get('structure'),
    backend.name,
  )


def _signature(head_names) -> inspect.Signature:
  positional = inspect.Parameter.POSITIONAL_OR_KEYWORD
  return inspect.Signature(
    [inspect.Parameter(n, positional) for n in head_names]
    + [inspect.Parameter('local_args', inspect.Parameter.VAR_POSITIONAL)]
  )
