"""Keras `fit` / `evaluate` / `predict` run by `strategy.run` of a `tf.distribute.TPUStrategy`.

`tg.partition_model(model, mesh, strategy=strategy)` -- or, after
`tf_gspmd.keras.enable()` with a keras.distribution set, any Keras entry point
called inside `strategy.scope()` -- makes each of the model's steps a
`StrategyFunction`: the step is captured and partitioned over the mesh as
usual, and each input signature gets a `tpu.TPUStrategyStep` that runs the
per-partition program through `strategy.run`, one replica per mesh device,
partition id = replica id (what Keras' own TF trainer does under a
distribution strategy, with tf_gspmd's program as the replica function).
Train, test and predict steps share one set of shard variables
(`tpu.ReplicaVariables`): they are the variables' one state, as on the other
backends (`program/held.py`: the model's own variables become views of them).

How variables are made: build and compile the model *outside*
`strategy.scope()`. Its variables (and its optimizer's, built here before any
step is traced, and its metrics', built while a step is traced as plain Keras)
are then plain tf.Variables: the values Keras, callbacks, checkpoints and the
user read and write. tf_gspmd owns the placement of their shards: each
variable's shards are the per-replica components of one sync-on-read variable
it makes under the scope (on a TPU, replica r's component on replica r's
core). A model made inside the scope has TF's distributed variables (a full
copy per replica, kept equal by TF), which is what the shards replace; it is
refused by name.

What each replica runs:
* under a TPUStrategy (`collectives='xla'`): by default the exported
  per-replica module (native XLA collectives) through one XlaCallModule op;
  `exported=False`: the program traced with XlaCollectives;
* under any other strategy, e.g. a MirroredStrategy of CPUs or GPUs standing
  in for the TPU (`collectives='tf'`): the traced program with TF collective
  ops between the replicas' devices. XLA's collective ops have no kernel
  outside a compiled program, so the XLA paths run only programs without
  collectives there.
Pass `collectives=` / `exported=` to `partition_model` to choose.

Steps are traced as plain Keras, outside every strategy scope (`plain_keras`):
while tracing, Keras reads the current strategy -- it divides the loss by the
number of replicas and lets the replica context sum the gradients, right when
each replica computes on its own batch, wrong for tf_gspmd's program, which
computes the global step itself. A batch Keras split over the replicas (its
dataset distributed by the strategy when `fit` runs inside the scope) is put
back together first, then split by the step's layout.
"""

from __future__ import annotations

import contextlib
from typing import Dict, Optional

import tensorflow as tf

from tf_gspmd.keras.hooks import backing, distribute_strategy_of
from tf_gspmd.mesh import Mesh
from tf_gspmd.partitioned import PartitionedFunction, executors
from tf_gspmd.xla_bridge import tpu


def default_collectives(strategy) -> str:
  """'xla' on a TPU; 'tf' (TF collective ops between TF devices) under any other strategy."""
  return 'xla' if tpu.is_tpu_strategy(strategy) else 'tf'


def strategy_of(model):
  """The tf.distribute strategy a Keras entry point runs under: the scope entered, else the
  one the model was built in; None when there is neither."""
  if tf.distribute.has_strategy():
    return tf.distribute.get_strategy()
  return distribute_strategy_of(model)


@contextlib.contextmanager
def plain_keras():
  """Run the code inside outside every tf.distribute scope, as plain Keras.

  TF has no public way to leave a strategy's scope; entering the default
  strategy's is refused. A scope is two stacks of the default graph (TF
  private): the strategy stack (`tf.distribute.get_strategy()`) and the
  variable creators (a variable made in the scope becomes a distributed one).
  Both are emptied inside and put back after.
  """
  graph = tf.compat.v1.get_default_graph()
  saved = _creation_stacks(graph)
  _set_creation_stacks(graph, ([], []))
  try:
    yield
  finally:
    _set_creation_stacks(graph, saved)


# TF keeps both stacks as private attributes of the graph; no public API empties them.
def _creation_stacks(graph):
  return graph._distribution_strategy_stack, graph._variable_creator_stack  # noqa: SLF001


def _set_creation_stacks(graph, stacks) -> None:
  graph._distribution_strategy_stack, graph._variable_creator_stack = stacks  # noqa: SLF001


def refuse_distributed_variables(model) -> None:
  """Raise a ValueError, saying what to do, for a model built inside a strategy's scope."""
  optimizer = getattr(model, 'optimizer', None)
  variables = list(model.variables) + (list(optimizer.variables) if optimizer else [])
  for variable in variables:
    if isinstance(backing(variable), tf.distribute.DistributedValues):
      raise ValueError(
        f'tf_gspmd: model {model.name} has TF distributed variables ({variable.path}: '
        f'{type(backing(variable)).__name__}): it was built or compiled inside a '
        'tf.distribute strategy scope. tf_gspmd places the shards on the replicas itself: '
        'build and compile the model outside strategy.scope(), then fit inside it (or pass '
        'strategy= to tg.partition_model).'
      )


def global_values(args, strategy):
  """`args` with every value Keras split over the replicas put back together.

  Keras' distributed dataset gives replica r the r-th slice of each batch; the
  slices, concatenated in replica order, are the batch.
  """

  def whole(value):
    if isinstance(value, tf.distribute.DistributedValues):
      return tf.concat(strategy.experimental_local_results(value), 0)
    return value

  return tf.nest.map_structure(whole, args)


class StrategySteps:
  """One model's steps under one strategy: the shard variables they share, and their making.

  Made when the model is partitioned (keras/fit.py's launcher): it refuses a model
  with distributed variables and builds the optimizer's variables at once,
  outside the scope (Keras would build them in the first `fit`, perhaps inside
  it, making them distributed).
  """

  def __init__(self, model, strategy, store):
    refuse_distributed_variables(model)
    optimizer = getattr(model, 'optimizer', None)
    if optimizer is not None and not optimizer.built and model.trainable_variables:
      with plain_keras():
        optimizer.build(model.trainable_variables)  # what Keras' `apply` builds it from
    self.strategy = strategy
    self.store = store
    self.replicas = tpu.ReplicaVariables(strategy, store.sharded, store.originals)

  def partitioned(self, step, mesh: Mesh, **kwargs) -> 'StrategyFunction':
    return StrategyFunction(step, mesh, self.strategy, self.replicas, store=self.store, **kwargs)


class StrategyFunction(PartitionedFunction):
  """A step partitioned over the mesh and run by `strategy.run`, one replica per mesh device.

  PartitionedFunction captures, propagates and builds the per-partition program;
  each input signature gets a `tpu.TPUStrategyStep` (`runner`) running it. The
  shards are `replicas`' per-replica variables. `collectives` / `exported`:
  see the module docstring (default: 'xla' and the exported module on a TPU,
  'tf' elsewhere).
  """

  def __init__(
    self,
    fn,
    mesh: Mesh,
    strategy,
    replicas: tpu.ReplicaVariables,
    *,
    collectives: Optional[str] = None,
    exported: Optional[bool] = None,
    **kwargs,
  ):
    if kwargs.get('backend', executors.DEFAULT) != executors.DEFAULT:
      raise ValueError(
        f'partition_model: strategy= runs the steps by strategy.run; backend='
        f'{kwargs["backend"]!r} is another way to run them: give one of the two.'
      )
    super().__init__(fn, mesh, **kwargs)
    self.strategy = strategy
    self.replicas = replicas
    self.replica_collectives = collectives or default_collectives(strategy)
    self.exported = exported
    self._runners: Dict[int, tpu.TPUStrategyStep] = {}  # id(Compiled) -> its runner

  def _shard_variable(self, var, sharding, sharded_cls) -> None:
    # PartitionedFunction's hook where a variable gets its shards (partitioned/front.py): here the
    # per-replica components of one strategy variable, registered in the shared store, not
    # TF variables on the mesh's devices.
    del sharded_cls
    self.store.originals[id(var)] = var
    self.replicas.get(var, sharding)

  def runner(self, *args) -> tpu.TPUStrategyStep:
    """The TPUStrategyStep for these arguments' signature (captured and built on first use)."""
    with plain_keras():
      compiled = self.get_program(*args)
      runner = self._runners.get(id(compiled))
      if runner is None:
        runner = self._runners[id(compiled)] = tpu.TPUStrategyStep(
          self,
          self.strategy,
          *args,
          collectives=self.replica_collectives,
          exported=self.exported,
          variables=self.replicas,
        )
    self._last = compiled
    return runner

  def __call__(self, *args):
    args = global_values(args, self.strategy)
    runner = self.runner(*args)
    self.store.check_annotations(self._last.variables)
    return runner(*args)
