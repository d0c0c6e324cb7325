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
  sync-on-read variable whose per-replica component is that replica's shard
  (`ReplicaVariable`, held in a `ReplicaVariables` store keyed by the original
  tf.Variable: steps over the same variables, e.g. Keras' train, test and
  predict steps in `tf_gspmd.keras.strategy`, share one).

By default (`exported=True`) the replica does not run that traced program but
the exported per-replica module (`partitioned.export_xla`: native collectives,
partition id = XLA's replica id) through one `XlaCallModule` op
(`call_module.py`), reading the shard variables into its parameters and
assigning its variable results back (`XlaExport.results[j].updates`).
That module's collectives join the replicas only when one XLA program runs
over all of them (a TPU's); outside a TPUStrategy, CPU XLA compiles each
replica's XlaCallModule on its own, so a module with collectives is refused
there. `collectives='tf'` runs the per-partition program traced once with TF
collective ops between the replicas' devices instead: a MirroredStrategy of CPUs
or GPUs then runs any program, as a stand-in for the TPU.

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
collectives (XLA collective ops run only inside a compiled program) and, with
`collectives='tf'`, Keras programs with collectives (tests/test_keras_tpu_strategy.py),
the very replica function
`strategy.run` calls -- lowered by tf2xla (the compiler TPUStrategy uses) with
its replica groups read from the HLO -- and that function run on 8 PJRT CPU
replicas with XLA's replica id standing in for `replica_id_in_sync_group`,
trained against the unpartitioned step (programs whose collectives CPU XLA
lowers: the all-reduce family).
"""

from __future__ import annotations

import itertools
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np
import tensorflow as tf
from tensorflow.compiler.tf2xla.ops import gen_xla_ops

from tf_gspmd.annotations import variable_sharding
from tf_gspmd.mesh import Mesh
from tf_gspmd.program import PartitionContext, held
from tf_gspmd.runtime import collectives as tf_collectives
from tf_gspmd.runtime import sharded as sharded_lib
from tf_gspmd.runtime.grappler import without_grappler
from tf_gspmd.runtime.launcher import trace_per_partition
from tf_gspmd.xla_bridge import call_module as call_module_lib
from tf_gspmd.xla_bridge.collectives import XlaCollectives
from tf_gspmd.xla_bridge.hlo import stablehlo_collectives

TOPOLOGY_AXES = ('x', 'y', 'z', 'core')
TPU_STRATEGIES = (tf.distribute.TPUStrategy, tf.distribute.experimental.TPUStrategy)


def is_tpu_strategy(strategy) -> bool:
  return isinstance(strategy, TPU_STRATEGIES)


# --- topology and device assignment -------------------------------------------------------------
def topology_proto(
  chips: Sequence[int] = (2, 2, 1), cores_per_chip: int = 2, num_tasks: int = 1
) -> bytes:
  """A serialized `TopologyProto` like the one TPU system initialization returns.

  Devices are numbered per task chip by chip (x fastest, then y, then z),
  the cores of a chip consecutively -- the TPU runtime's ordinal order.
  """
  from tensorflow.core.protobuf.tpu import topology_pb2

  mesh_shape = list(chips) + [cores_per_chip]
  coordinates = [
    (x, y, z, core)
    for z, y, x, core in itertools.product(
      range(chips[2]), range(chips[1]), range(chips[0]), range(cores_per_chip)
    )
  ]
  per_task, rest = divmod(len(coordinates), num_tasks)
  if rest:
    raise ValueError(
      f'topology_proto: {len(coordinates)} cores do not split over {num_tasks} tasks.'
    )
  proto = topology_pb2.TopologyProto(
    mesh_shape=mesh_shape,
    num_tasks=num_tasks,
    num_tpu_devices_per_task=per_task,
    device_coordinates=[c for coords in coordinates for c in coords],
  )
  return proto.SerializeToString()


def mesh_device_assignment(
  topology, mesh: Mesh, core_order: Sequence[str] = ('core', 'x', 'y', 'z')
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
    raise ValueError(
      f'mesh_device_assignment: core_order must order {TOPOLOGY_AXES}, got {tuple(core_order)}.'
    )
  shape = [int(s) for s in topology.mesh_shape]
  cores = int(np.prod(shape))
  if cores != mesh.size:
    raise ValueError(
      f'mesh_device_assignment: the mesh {mesh} has {mesh.size} devices but the '
      f'TPU topology {shape} (x, y, z, cores per chip) has {cores} cores; '
      'one replica per core is needed.'
    )
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


# --- the shard variables ------------------------------------------------------------------------
class ReplicaVariable:
  """One variable's shards under a strategy: a sync-on-read tf.Variable whose component on
  replica r holds partition r's shard.

  It has the surface of a sharded variable that `partitioned.VariableStore` users read:
  `sharding`, `shape`, `local_shape`, `dtype`, `label`, `assemble()`, `scatter(value)`.
  """

  # The components may live on TPU cores, which a host tf.function does not read: assembled
  # eagerly (program/held.py reads them through a host call inside a plain tf.function).
  assembles_in_graph = False

  def __init__(self, strategy, original, sharding):
    self.strategy = strategy
    self.sharding = sharding
    self.shape = tuple(int(d) for d in original.shape)
    self.dtype = original.dtype
    self.label = original.name.split(':')[0]
    self.local_shape = tuple(sharding.shard_shape(self.shape))
    with strategy.scope():
      # One component per replica, each free to hold its own shard (sync-on-read with no
      # aggregation: TF never averages or copies the components onto each other).
      self.variable = tf.Variable(
        tf.zeros(self.local_shape, self.dtype),
        trainable=False,
        synchronization=tf.VariableSynchronization.ON_READ,
        aggregation=tf.VariableAggregation.NONE,
        name=f'{self.label.replace("/", "_")}_shard',
      )
    self.scatter(original.read_value())

  def components(self) -> list:
    """The per-replica variables, replica r's at index r."""
    return list(self.strategy.experimental_local_results(self.variable))

  @property
  def template(self) -> tf.Variable:
    """A variable of one shard's shape and dtype (what a per-partition program is traced with)."""
    return self.components()[0]

  def assemble(self) -> tf.Tensor:
    """The global value, from every replica's shard (padding dropped)."""
    shards = [tf.convert_to_tensor(c) for c in self.components()]
    return sharded_lib.assemble(shards, self.sharding, self.shape, self.label)

  def scatter(self, value) -> None:
    """Each replica's component := its shard of the global `value`."""
    components = self.components()
    shards = sharded_lib.split(
      tf.convert_to_tensor(value, self.dtype), self.sharding, [None] * len(components), self.label
    )
    for component, shard in zip(components, shards):
      component.assign(shard)

  def __repr__(self):
    return (
      f'ReplicaVariable({self.label!r}, {self.dtype.name}{list(self.shape)}, '
      f'{self.sharding}, {len(self.components())} replicas of {list(self.local_shape)})'
    )


class ReplicaVariables:
  """The `ReplicaVariable` of every original tf.Variable under one strategy, keyed by it.

  Steps over the same variables (train, test, predict) given one store read and
  write the same shards. `sharded` / `originals` may be a `VariableStore`'s dicts
  (id(original) -> sharded variable / original): each variable made here is then
  registered there too, where the store's other users (keras/fit.py's mirror) find it.
  """

  def __init__(
    self,
    strategy,
    sharded: Optional[Dict[int, object]] = None,
    originals: Optional[Dict[int, object]] = None,
  ):
    self.strategy = strategy
    self.sharded = {} if sharded is None else sharded
    self.originals = {} if originals is None else originals

  def get(self, original, sharding) -> ReplicaVariable:
    """`original`'s shard variable: made (from its value) on first use, the same after.

    A variable made as shards has them as its one state (`program/held.py`); a plain one
    keeps its own value, copied in and out around each step (`scatter`, `sync`). A variable
    held by another backend or strategy moves here (assembled on the host, split again).
    """
    holder = held.holder_of(original)
    if isinstance(holder, ReplicaVariable) and holder.strategy is self.strategy:
      if not holder.sharding.is_equivalent_to(sharding):
        raise ValueError(
          f'ReplicaVariables: variable {original.name} is sharded {holder.sharding} by '
          f'an earlier step but {sharding} by this one; annotate it with '
          'shard_variable to fix its layout.'
        )
    else:
      holder = ReplicaVariable(self.strategy, original, sharding)
      if held.is_held(original):
        held.replace_holder(original, holder)
      else:
        held.hold(original, holder, annotation=variable_sharding(original))
    self.sharded[id(original)] = holder
    self.originals[id(original)] = original
    return holder

  def sync(self, originals) -> None:
    """Assemble the shards of the plain (adopted) variables among `originals` back into them;
    a variable made as shards reads them itself."""
    held.gather_adopted(originals)

  def scatter(self, originals) -> None:
    """Split the value of the plain (adopted) variables among `originals` into their shards."""
    held.scatter_adopted(originals)


def _check_options(
  strategy,
  mesh: Mesh,
  collectives: str,
  exported: Optional[bool],
  variables: Optional[ReplicaVariables],
) -> bool:
  """Refuse what cannot run, by name; returns whether the replica runs the exported module."""
  if strategy.num_replicas_in_sync != mesh.size:
    raise ValueError(
      f'TPUStrategyStep: the strategy runs {strategy.num_replicas_in_sync} '
      f'replicas but the mesh {mesh} has {mesh.size} devices.'
    )
  if collectives not in ('xla', 'tf'):
    raise ValueError(f"TPUStrategyStep: collectives must be 'xla' or 'tf', got {collectives!r}.")
  if variables is not None and variables.strategy is not strategy:
    raise ValueError('TPUStrategyStep: the ReplicaVariables given belong to another strategy.')
  exported = collectives == 'xla' if exported is None else bool(exported)
  if exported and collectives == 'tf':
    raise ValueError(
      "TPUStrategyStep: the exported module's collectives are XLA's; "
      "collectives='tf' runs the traced program (exported=False)."
    )
  return exported


class TPUStrategyStep:
  """A partitioned function's per-partition program run by `strategy.run`, one replica per device.

  `partitioned`: a `tf_gspmd.PartitionedFunction` (its layouts and program);
  `example_args`: arguments of the shapes it will be called with;
  `variables`: the `ReplicaVariables` holding the shards (default: a store of its own;
  steps over the same variables share one);
  `collectives`: 'xla' (TPU: XLA's collectives; by default the exported module) or
  'tf' (TF collective ops between the replicas' devices, for a MirroredStrategy of
  CPUs or GPUs standing in for the TPU; runs the traced program).
  """

  def __init__(
    self,
    partitioned,
    strategy,
    *example_args,
    replica_id: Callable[[], tf.Tensor] = _tpu_replica_id,
    exported: Optional[bool] = None,
    collectives: str = 'xla',
    variables: Optional[ReplicaVariables] = None,
  ):
    self.mesh: Mesh = partitioned.mesh
    exported = _check_options(strategy, self.mesh, collectives, exported, variables)
    self.strategy = strategy
    self.collectives = collectives
    self._replica_id = replica_id
    compiled = partitioned.get_program(*example_args)
    self._compiled = compiled
    self.arg_shardings = list(compiled.arg_shardings)
    self.capture_shardings = [
      compiled.propagation.target(compiled.program.main, n) for n in compiled.program.captures
    ]
    self.local_specs = list(compiled.local_specs)
    self._n_args = len(compiled.program.arg_inputs)
    self._take_variables(partitioned, compiled, variables)
    # exported: the replica runs `partitioned.export_xla`'s StableHLO module (native
    # collectives, partition id = XLA replica id) through one XlaCallModule op; otherwise the
    # per-partition TF program traced with XlaCollectives (partition id = `replica_id()`) or,
    # with collectives='tf', with TF collective ops.
    self.export = partitioned.export_xla(*example_args) if exported else None
    self._module = call_module_lib.serialized_module(self.export) if exported else None
    self._tf_program = self._trace_tf_program() if collectives == 'tf' else None
    self._collectives_checked = False
    self._step = tf.function(self._distributed_step)

  def _take_variables(self, partitioned, compiled, variables) -> None:
    """Each variable's shards from `variables` (made there from the original if new)."""
    self.variables = ReplicaVariables(self.strategy) if variables is None else variables
    shardings = [partitioned.store.sharded[id(v)].sharding for v in compiled.variables]
    self.variable_layouts = [
      (v.name, s, tuple(v.shape)) for v, s in zip(compiled.variables, shardings)
    ]
    self._originals = list(compiled.variables)
    self.replica_variables = [
      self.variables.get(v, s) for v, s in zip(compiled.variables, shardings)
    ]
    self.shard_variables = [r.variable for r in self.replica_variables]

  def _trace_tf_program(self):
    """collectives='tf': the per-partition program traced once, with TF collective ops.

    Once, not per replica: a TF collective's keys are fixed when it is traced, and
    strategy.run traces the replica function once per replica. Every replica calls
    this one function on its own device with its own ordering token (what makes TF's
    collective V2 ops run between the devices of one function).
    """
    devices = tuple(self.strategy.extended.worker_devices)
    self._tokens = [
      tf_collectives.new_token_variable(d, f'replica_token{r}') for r, d in enumerate(devices)
    ]
    by_replica = [r.components() for r in self.replica_variables]
    self._components = [list(c) for c in zip(*by_replica)] or [[] for _ in devices]
    return trace_per_partition(
      self.mesh,
      self._compiled.per_partition,
      self.local_specs + self._components[0],
      devices=devices,
      progress_markers=False,
      autograph=False,  # the partitioner emits ops from the IR: no Python control flow to convert
      name='replica_per_partition',
    )

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
    results = call_module_lib.call_module(
      self.export, local + values, module=self._module, name='tpu_replica_module'
    )
    outputs = []
    for layout, value in zip(self.export.results, results):
      if layout.updates is None:
        outputs.append(value)
      else:
        variables[layout.updates - len(local)].assign(value)
    return outputs

  def tf_replica_program(self, *local):
    """collectives='tf': the program traced once, called with this replica's components."""
    replica = tf.get_static_value(_tpu_replica_id())
    if replica is None:
      raise ValueError(
        "TPUStrategyStep: collectives='tf' needs a strategy whose replica id is "
        'known while tracing (MirroredStrategy); a TPU runs collectives="xla".'
      )
    replica = int(replica)
    # The concrete function, not the tf.function: under a MirroredStrategy a tf.function
    # retraces for each replica's device, and each trace would get new collective keys.
    return self._tf_program.function(
      tf.constant(replica, tf.int32),
      self._tokens[replica].handle,
      *local,
      *self._components[replica],
    )

  def replica_fn(self, *local):
    """The function `strategy.run` runs on every replica: partition id = replica id."""
    if self.export is not None:
      return self.exported_program(local, self.shard_variables)
    if self._tf_program is not None:
      return self.tf_replica_program(*local)
    return self.replica_program(self._replica_id(), *local, *self.shard_variables)

  def _distributed_step(self, *per_replica):
    return self.strategy.run(self.replica_fn, args=per_replica)

  # --- host side --------------------------------------------------------------------------------
  def _per_replica(self, value, sharding, what: str):
    shards = sharded_lib.split(tf.convert_to_tensor(value), sharding, [None] * self.mesh.size, what)
    return self.strategy.experimental_distribute_values_from_function(
      lambda ctx: shards[ctx.replica_id_in_sync_group]
    )

  def _refuse_unlinked_collectives(self) -> None:
    """Outside a TPU, each replica's XlaCallModule is compiled on its own (CPU XLA has a
    kernel for it): the module's collectives would join no other replica and give wrong
    numbers silently. Refused; the traced program's XLA collective ops TF refuses itself.
    Checked at the first call (building the step under a stand-in, to lower it, is fine)."""
    if self._collectives_checked or self.export is None or is_tpu_strategy(self.strategy):
      return
    found = sorted(set(stablehlo_collectives(self.export.module)))
    self._collectives_checked = not found
    if found:
      raise ValueError(
        f'TPUStrategyStep: the exported module runs collectives ({", ".join(found)}), which '
        f"join the replicas only in one XLA program over them (a TPU's); under "
        f'{type(self.strategy).__name__} each replica would run them alone. Run it under a '
        "TPUStrategy, or use collectives='tf' (TF collective ops between the replicas)."
      )

  def __call__(self, *args):
    self._refuse_unlinked_collectives()
    flat = [a for a in tf.nest.flatten(args) if a is not None]  # Keras' absent sample weights
    if len(flat) != self._n_args:
      raise ValueError(f'TPUStrategyStep: {len(flat)} tensor arguments, expected {self._n_args}.')
    inputs = [
      self._per_replica(a, s, f'argument {i}')
      for i, (a, s) in enumerate(zip(flat, self.arg_shardings))
    ]
    inputs += [
      self._per_replica(c, s, f'capture {i}')
      for i, (c, s) in enumerate(zip(self._compiled.capture_values, self.capture_shardings))
    ]
    self.scatter_variables()  # a plain variable is its own state: copied in, and out after
    if self._tf_program is None:
      outputs = self._step(*inputs)
    else:
      # TF devices run the launch itself: without Grappler specializing the program per
      # replica (see runtime.grappler.without_grappler); a TPU compiles it with XLA anyway.
      with without_grappler():
        outputs = self._step(*inputs)
    self.variables.sync(self._compiled.written_variables())
    structure = self._compiled.program.structured_outputs
    if structure is None:
      return None
    flat_out = [
      sharded_lib.assemble(
        list(self.strategy.experimental_local_results(o)), s, shape, f'output {j}'
      )
      for j, (o, s, shape) in enumerate(
        zip(tf.nest.flatten(outputs), self._compiled.out_shardings, self._compiled.out_shapes)
      )
    ]
    return tf.nest.pack_sequence_as(structure, flat_out, expand_composites=True)

  def scatter_variables(self) -> None:
    """Each replica's component of every shard variable := its shard of the original's value."""
    self.variables.scatter(self._originals)

  def sync_variables(self) -> None:
    """Assemble each variable from its per-replica shards into the original tf.Variable."""
    self.variables.sync(self._originals)

  # --- lowering without a TPU ---------------------------------------------------------------------
  def replica_function(self, replica_id: Callable[[], tf.Tensor] = xla_replica_id):
    """The replica program as a jit-compiled tf.function of (local args..., shard variables...)
    with its partition id from `replica_id()` (default: XLA's replica id, as on a TPU).

    Variables are passed in so that tf2xla makes them parameters and their new values results.
    """

    def replica(*local):
      if self.export is not None:  # the module's partition id is XLA's replica id already
        n_variables = len(self.shard_variables)
        return self.exported_program(
          local[:-n_variables] if n_variables else local, local[len(local) - n_variables :]
        )
      return self.replica_program(replica_id(), *local)

    replica.__name__ = 'tpu_replica'
    return tf.function(replica, jit_compile=True)

  def local_examples(self, variables: Optional[List[tf.Variable]] = None) -> list:
    """Example local arguments of `replica_function`: zeros of the local shapes, then variables."""
    zeros = [tf.zeros(s.shape, s.dtype) for s in self.local_specs]
    return zeros + list(self.shard_variables if variables is None else variables)
