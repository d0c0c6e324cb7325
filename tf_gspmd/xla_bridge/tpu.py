"""Running tf_gspmd's per-replica program under `tf.distribute.TPUStrategy`.

A partitioned function is one SPMD program: every partition runs the same
per-partition code, told apart only by its partition id. On a TPU that is
exactly TPUStrategy's replication: `strategy.run(fn)` runs `fn` once per
replica, and `tf.distribute.get_replica_context().replica_id_in_sync_group`
says which. `TPUStrategyStep` runs the per-partition program traced with
`XlaCollectives` (XlaAllReduce, XlaReduceScatter, AllToAll, CollectivePermute,
whose replica groups are the mesh's groups written in partition ids) with

  partition id = replica id,
  mesh device r = replica r, placed on the core that the device assignment
  gives replica r (`mesh_device_assignment`, built from the TPU topology),
  tensor arguments split on the host into per-replica shards
  (`experimental_distribute_values_from_function`), outputs assembled from
  `experimental_local_results`, and each sharded variable kept as one
  sync-on-read variable whose per-replica component is that replica's shard.

By default (`exported=True`) the replica does not run that traced program but
the exported per-replica module (`partitioned.export_xla`: native collectives,
partition id = XLA's replica id) through one `XlaCallModule` op
(`call_module.py`), reading the shard variables into its parameters and
assigning its variable results back (`XlaExport.results[j].updates`).

All of it uses TF's public TPU API: `tf.tpu.experimental.Topology`,
`tf.tpu.experimental.DeviceAssignment`, `tf.distribute.TPUStrategy(resolver,
experimental_device_assignment=...)`, `strategy.run`,
`replica_id_in_sync_group`. Typical use on a TPU VM (v3-8 / v2-8: 2x2x1 chips,
2 cores each):

    resolver = tf.distribute.cluster_resolver.TPUClusterResolver(tpu='local')
    topology = tf.tpu.experimental.initialize_tpu_system(resolver)
    mesh = tg.Mesh.create((2, 4), ('data', 'model'))
    strategy = tf.distribute.TPUStrategy(
        resolver, experimental_device_assignment=mesh_device_assignment(topology, mesh))
    step = TPUStrategyStep(tg.partition(train_step, mesh), strategy, x, y)
    loss = step(x, y)

No TPU is attached here, so that last part has never run on one. What is
tested without a TPU (tests/test_tpu_strategy.py): the topology read from a
serialized TopologyProto the way TF reads the one TPU initialization returns,
the device assignment derived from it, `TPUStrategyStep` called end to end
under a MirroredStrategy of 8 CPUs (same replica API) on a program without
collectives (XLA collective ops run only inside a compiled program), the very
replica function
`strategy.run` calls -- lowered by tf2xla (the compiler TPUStrategy uses) with
its replica groups read from the HLO -- and that function run on 8 PJRT CPU
replicas with XLA's replica id standing in for `replica_id_in_sync_group`,
trained against the unpartitioned step (programs whose collectives CPU XLA
lowers: the all-reduce family).
"""

from __future__ import annotations

import itertools
from typing import Callable, List, Optional, Sequence

import numpy as np
import tensorflow as tf
from tensorflow.compiler.tf2xla.ops import gen_xla_ops

from tf_gspmd.mesh import Mesh
from tf_gspmd.runtime import sharded as sharded_lib
from tf_gspmd.runtime.launcher import PartitionContext
from tf_gspmd.xla_bridge import call_module as call_module_lib
from tf_gspmd.xla_bridge.collectives import XlaCollectives

TOPOLOGY_AXES = ('x', 'y', 'z', 'core')


# --- topology and device assignment -------------------------------------------------------------
def topology_proto(chips: Sequence[int] = (2, 2, 1), cores_per_chip: int = 2,
                   num_tasks: int = 1) -> bytes:
  """A serialized `TopologyProto` like the one TPU system initialization returns.

  Devices are numbered per task chip by chip (x fastest, then y, then z),
  the cores of a chip consecutively -- the TPU runtime's ordinal order.
  """
  from tensorflow.core.protobuf.tpu import topology_pb2  # pylint: disable=g-import-not-at-top
  mesh_shape = list(chips) + [cores_per_chip]
  coordinates = [(x, y, z, core) for z, y, x, core in itertools.product(
      range(chips[2]), range(chips[1]), range(chips[0]), range(cores_per_chip))]
  per_task, rest = divmod(len(coordinates), num_tasks)
  if rest:
    raise ValueError(f'topology_proto: {len(coordinates)} cores do not split over '
                     f'{num_tasks} tasks.')
  proto = topology_pb2.TopologyProto(
      mesh_shape=mesh_shape, num_tasks=num_tasks, num_tpu_devices_per_task=per_task,
      device_coordinates=[c for coords in coordinates for c in coords])
  return proto.SerializeToString()


def mesh_device_assignment(topology, mesh: Mesh,
                           core_order: Sequence[str] = ('core', 'x', 'y', 'z')
                           ) -> tf.tpu.experimental.DeviceAssignment:
  """Replica r (= partition r = mesh device r) on one physical core, mesh-aligned.

  The mesh's devices in row-major order (the last mesh axis fastest) are laid
  on the topology's cores walked with `core_order[0]` fastest: by default the
  two cores of a chip first, then x, y, z. So the last (usually the
  model-parallel) mesh axis stays on a chip and its neighbours, and every
  replica group of that axis is a compact block of the torus.
  `topology`: a `tf.tpu.experimental.Topology` or a serialized TopologyProto.
  """
  if isinstance(topology, bytes):
    topology = tf.tpu.experimental.Topology(serialized=topology)
  if sorted(core_order) != sorted(TOPOLOGY_AXES):
    raise ValueError(f'mesh_device_assignment: core_order must order {TOPOLOGY_AXES}, '
                     f'got {tuple(core_order)}.')
  shape = [int(s) for s in topology.mesh_shape]
  cores = int(np.prod(shape))
  if cores != mesh.size:
    raise ValueError(f'mesh_device_assignment: the mesh {mesh} has {mesh.size} devices but the '
                     f'TPU topology {shape} (x, y, z, cores per chip) has {cores} cores; '
                     'one replica per core is needed.')
  slowest_first = [TOPOLOGY_AXES.index(a) for a in reversed(core_order)]
  walk = np.indices(shape).transpose(*(i + 1 for i in slowest_first), 0).reshape(-1, 4)
  assignment = np.zeros((mesh.size, 1, 4), np.int32)
  for position, device in enumerate(np.asarray(mesh.device_ids).reshape(-1)):
    assignment[int(device), 0] = walk[position]
  return tf.tpu.experimental.DeviceAssignment(topology, assignment)


# --- the replica program --------------------------------------------------------------------------
def _tpu_replica_id() -> tf.Tensor:
  """This replica's id under TPUStrategy (the partition id of the program it runs)."""
  return tf.cast(tf.distribute.get_replica_context().replica_id_in_sync_group, tf.int32)


def xla_replica_id() -> tf.Tensor:
  """XLA's own replica id: what `replica_id_in_sync_group` is inside a TPU computation."""
  return gen_xla_ops.xla_replica_id()


class TPUStrategyStep:
  """A partitioned function's per-partition program run by `strategy.run`, one replica per device.

  `partitioned`: a `tf_gspmd.PartitionedFunction` (its layouts and program);
  `example_args`: arguments of the shapes it will be called with.
  """

  def __init__(self, partitioned, strategy, *example_args,
               replica_id: Callable[[], tf.Tensor] = _tpu_replica_id, exported: bool = True):
    self.mesh: Mesh = partitioned.mesh
    if strategy.num_replicas_in_sync != self.mesh.size:
      raise ValueError(f'TPUStrategyStep: the strategy runs {strategy.num_replicas_in_sync} '
                       f'replicas but the mesh {self.mesh} has {self.mesh.size} devices.')
    self.strategy = strategy
    self._replica_id = replica_id
    compiled = partitioned.get_program(*example_args)
    self._compiled = compiled
    self.arg_shardings = list(compiled.arg_shardings)
    n_args = len(compiled.program.arg_inputs)
    self.capture_shardings = [
        compiled.plan.target(compiled.program.main, n) for n in compiled.program.captures]
    self.local_specs = list(compiled.local_specs)
    self._n_args = n_args
    self.variable_layouts = [(v.name, partitioned.store.sharded[id(v)].sharding, tuple(v.shape))
                             for v in compiled.variables]
    self._originals = list(compiled.variables)
    with strategy.scope():
      # One component per replica, each free to hold its own shard (sync-on-read with no
      # aggregation: TF never averages or copies the components onto each other).
      self.shard_variables = [
          tf.Variable(tf.zeros(sharding.shard_shape(shape), v.dtype), trainable=False,
                      synchronization=tf.VariableSynchronization.ON_READ,
                      aggregation=tf.VariableAggregation.NONE,
                      name=f'{name.split(":")[0].replace("/", "_")}_shard')
          for (name, sharding, shape), v in zip(self.variable_layouts, compiled.variables)]
    self.scatter_variables()
    # exported: the replica runs `partitioned.export_xla`'s StableHLO module (native
    # collectives, partition id = XLA replica id) through one XlaCallModule op; otherwise the
    # per-partition TF program traced with XlaCollectives (partition id = `replica_id()`).
    self.export = partitioned.export_xla(*example_args) if exported else None
    self._module = call_module_lib.serialized_module(self.export) if exported else None
    self._step = tf.function(self._distributed_step)

  # --- what strategy.run calls ------------------------------------------------------------------
  def replica_program(self, partition_id, *local):
    """The per-partition program of one replica: local shards in, local outputs out."""
    ctx = PartitionContext(self.mesh, XlaCollectives(self.mesh, partition_id))
    outputs = self._compiled.per_partition(ctx, *local)
    return [tf.convert_to_tensor(o) for o in outputs]

  def exported_program(self, local: Sequence, variables: Sequence[tf.Variable]) -> list:
    """The exported module on one replica's local arguments and shard variables.

    The variables are read into the module's variable parameters; each result
    that `export.results[j].updates` marks as a variable's new value is assigned
    back to that variable; the other results (the outputs) are returned.
    """
    local = list(local)
    values = [v.read_value() for v in variables]
    results = call_module_lib.call_module(self.export, local + values, module=self._module,
                                          name='tpu_replica_module')
    outputs = []
    for layout, value in zip(self.export.results, results):
      if layout.updates is None:
        outputs.append(value)
      else:
        variables[layout.updates - len(local)].assign(value)
    return outputs

  def replica_fn(self, *local):
    """The function `strategy.run` runs on every replica: partition id = replica id."""
    if self.export is not None:
      return self.exported_program(local, self.shard_variables)
    return self.replica_program(self._replica_id(), *local, *self.shard_variables)

  def _distributed_step(self, *per_replica):
    return self.strategy.run(self.replica_fn, args=per_replica)

  # --- host side --------------------------------------------------------------------------------
  def _per_replica(self, value, sharding, what: str):
    shards = sharded_lib.split(tf.convert_to_tensor(value), sharding, [None] * self.mesh.size,
                               what)
    return self.strategy.experimental_distribute_values_from_function(
        lambda ctx: shards[ctx.replica_id_in_sync_group])

  def __call__(self, *args):
    flat = list(tf.nest.flatten(args))
    if len(flat) != self._n_args:
      raise ValueError(f'TPUStrategyStep: {len(flat)} tensor arguments, expected {self._n_args}.')
    inputs = [self._per_replica(a, s, f'argument {i}')
              for i, (a, s) in enumerate(zip(flat, self.arg_shardings))]
    inputs += [self._per_replica(c, s, f'capture {i}') for i, (c, s) in
               enumerate(zip(self._compiled.capture_values, self.capture_shardings))]
    outputs = self._step(*inputs)
    structure = self._compiled.program.structured_outputs
    if structure is None:
      return None
    flat_out = [sharded_lib.assemble(list(self.strategy.experimental_local_results(o)), s, shape,
                                     f'output {j}')
                for j, (o, s, shape) in enumerate(zip(tf.nest.flatten(outputs),
                                                     self._compiled.out_shardings,
                                                     self._compiled.out_shapes))]
    return tf.nest.pack_sequence_as(structure, flat_out, expand_composites=True)

  def scatter_variables(self) -> None:
    """Each replica's component of every shard variable := its shard of the original's value."""
    values = [self._per_replica(original.read_value(), sharding, name)
              for original, (name, sharding, _) in zip(self._originals, self.variable_layouts)]

    def assign(*shards):
      for variable, shard in zip(self.shard_variables, shards):
        variable.assign(shard)
    tf.function(lambda *v: self.strategy.run(assign, args=v))(*values)

  def sync_variables(self) -> None:
    """Assemble each variable from its per-replica shards into the original tf.Variable."""
    for original, variable, (name, sharding, shape) in zip(
        self._originals, self.shard_variables, self.variable_layouts):
      shards = [tf.convert_to_tensor(c) for c in self.strategy.experimental_local_results(variable)]
      original.assign(sharded_lib.assemble(shards, sharding, shape, name))

  # --- lowering without a TPU ---------------------------------------------------------------------
  def replica_function(self, replica_id: Callable[[], tf.Tensor] = xla_replica_id):
    """The replica program as a jit-compiled tf.function of (local args..., shard variables...)
    with its partition id from `replica_id()` (default: XLA's replica id, as on a TPU).

    Variables are passed in so that tf2xla makes them parameters and their new values results.
    """
    def replica(*local):
      if self.export is not None:  # the module's partition id is XLA's replica id already
        n_variables = len(self.shard_variables)
        return self.exported_program(local[:-n_variables] if n_variables else local,
                                     local[len(local) - n_variables:])
      return self.replica_program(replica_id(), *local)
    replica.__name__ = 'tpu_replica'
    return tf.function(replica, jit_compile=True)

  def local_examples(self, variables: Optional[List[tf.Variable]] = None) -> list:
    """Example local arguments of `replica_function`: zeros of the local shapes, then variables."""
    zeros = [tf.zeros(s.shape, s.dtype) for s in self.local_specs]
    return zeros + list(self.shard_variables if variables is None else variables)
