"""Keras 3 `fit` / `evaluate` / `predict` running partitioned over a mesh.

`partition_model(model, mesh)` replaces the model's train, test and predict
functions with partitioned ones: each batch is split over the mesh's batch
axes, the whole `train_step` (forward, gradients, optimizer, metrics) runs as
one SPMD program, and all steps share one set of sharded variables. Keras
keeps driving the loop, callbacks and logs.

Each variable has one state (`tf_gspmd/program/held.py`). Under a tf_gspmd distribution
Keras makes its variables as shards (`SplitVariable`s): whatever reads a weight
(`get_weights`, `save`, a callback, `tf.train.Checkpoint`, `variable.numpy()`) assembles it
then, whatever writes one (`set_weights`, `load_weights`, a restore, `variable.assign`, a
learning-rate schedule, Keras resetting metrics) scatters to the shards at once, and no whole
copy of a split variable is kept. A variable made before (a plain tf.Variable) stays its own
state: each step copies it into its shards and writes the new value back.

Variables no layout rule annotated are replicated (as Keras' own LayoutMap
does), so the train, test and predict steps agree on every variable's layout.

>>> partition_model(model, mesh)                                  # doctest: +SKIP
>>> model.fit(x, y, batch_size=32, epochs=2)                      # doctest: +SKIP
"""

from __future__ import annotations

import re
from typing import Dict, List, Sequence, Union

import keras
import tensorflow as tf

from tf_gspmd.annotations import shard, shard_variable, variable_sharding
from tf_gspmd.keras.hooks import backing
from tf_gspmd.mesh import Mesh
from tf_gspmd.partitioned import PartitionedFunction, VariableStore
from tf_gspmd.program import held
from tf_gspmd.sharding import P
from tf_gspmd.xla_bridge.export import XlaLoweringError


def _batch_split(mesh: Mesh, axes, lead: int = 0):
  """Annotate each tensor's dim `lead` (its batch dim) as split over `axes`."""

  def split(t):
    if not isinstance(t, tf.Tensor) or t.shape.rank is None or t.shape.rank <= lead:
      return t
    spec = [None] * t.shape.rank
    spec[lead] = axes
    return shard(t, mesh, P(*spec))

  return lambda data: tf.nest.map_structure(split, data)


def _next_batch(iterator):
  if isinstance(iterator, (tf.data.Iterator, tf.distribute.DistributedIterator)):
    optional = iterator.get_next_as_optional()
    if not optional.has_value():
      raise StopIteration
    return optional.get_value()
  return next(iterator)


def _signature(batch) -> tuple:
  return tuple(
    (tuple(t.shape), t.dtype) if hasattr(t, 'shape') else repr(t) for t in tf.nest.flatten(batch)
  )


def _refuse_keras2(model) -> None:
  """tf_keras (Keras 2) models run another training loop: refuse them by name at once."""
  modules = [c.__module__ or '' for c in type(model).__mro__]
  if any(m.split('.')[0] == 'tf_keras' for m in modules) or not isinstance(model, keras.Model):
    raise TypeError(
      f'partition_model: {type(model).__module__}.{type(model).__name__} is not a Keras 3 '
      f'model (keras {keras.__version__}); tf_keras (Keras 2) models are not supported: '
      'their Model.fit, train_function and optimizer state follow Keras 2, which '
      'partition_model does not drive. Build the model with `import keras` (Keras 3), or '
      'partition its training step yourself with tf_gspmd.partition.'
    )


class _Launcher:
  """The partitioned steps of one model and the bookkeeping around each launch."""

  def __init__(
    self,
    model,
    mesh: Mesh,
    axes,
    replicate_unannotated: bool,
    kwargs,
    pull_every_step: bool = False,
    strategy=None,
  ):
    self.model = model
    self.pull_every_step = pull_every_step
    self.mesh = mesh
    self.axes = axes
    self.replicate_unannotated = replicate_unannotated
    self.kwargs = kwargs
    self.store = VariableStore()
    self.strategy = None  # with a tf.distribute strategy: the steps run by strategy.run
    if strategy is not None:
      # Imported here: tf_gspmd.keras (the package) imports this module.
      from tf_gspmd.keras.strategy import StrategySteps

      self.strategy = StrategySteps(model, strategy, self.store)
    self.launches = 0  # partitioned programs run (one per step, or per chunk of steps)
    self.functions: Dict[str, PartitionedFunction] = {}  # e.g. 'train_step', 'train_step_looped'
    self._annotated_for = set()  # id of each partitioned function whose variables were annotated

  # --- layouts ------------------------------------------------------------------
  def annotate_unmatched(self) -> List[str]:
    """Replicate every model and metric variable no rule annotated (and not yet sharded)."""
    if not self.replicate_unannotated:
      return []
    done = []
    variables = list(self.model.variables) + [v for m in self.model.metrics for v in m.variables]
    for var in variables:
      if held.is_held(backing(var)) or variable_sharding(var) is not None:
        continue
      shard_variable(var, self.mesh, P(*([None] * len(var.shape))))
      done.append(getattr(var, 'path', var.name))
    return done

  def _metric_variables(self) -> list:
    return [backing(v) for m in self.model.metrics for v in m.variables]

  # --- launching ----------------------------------------------------------------
  def partitioned(self, step) -> PartitionedFunction:
    """`step` (a tf.function of one batch) partitioned over the mesh, on the shared store
    (with a strategy: run by `strategy.run`, see tf_gspmd/keras/strategy.py)."""
    if self.strategy is not None:
      return self.strategy.partitioned(step, self.mesh, **self.kwargs)
    return PartitionedFunction(step, self.mesh, store=self.store, **self.kwargs)

  def launch(self, fn, batch):
    """One partitioned call (the model's variables are views of the shards it reads)."""
    if id(fn) not in self._annotated_for:  # before its first trace makes shards
      self.annotate_unmatched()
      self._annotated_for.add(id(fn))
    try:
      out = fn(batch)
    except XlaLoweringError as error:  # backend='xla': name the Keras layers, not only nodes
      raise XlaLoweringError(f'{error}{_in_layers(self.model, str(error))}') from None
    self.launches += 1
    return out

  def check_batch_size(self, call: str, args, kwargs) -> None:
    """Refuse a declared batch size (fit's `batch_size`, a dataset batched with
    `drop_remainder=True`) that does not split evenly over the batch axes: every batch of the
    call would be padded. An epoch's short last batch is fine (it runs unpadded)."""
    size = self.mesh.axis_size(self.axes) if self.axes else 1
    data = args[0] if args else kwargs.get('x')
    rows = _rows(data)
    if isinstance(data, tf.data.Dataset):
      batch = tf.nest.flatten(data.element_spec)[0].shape[0] if data.element_spec else None
      declared = f"the dataset's batches of {batch} rows (batched with drop_remainder=True)"
    else:
      # Keras' own default of 32 applies to array inputs only; a generator makes its batches.
      given = kwargs.get('batch_size')
      if given is None and len(args) > _BATCH_SIZE_POSITION[call]:
        given = args[_BATCH_SIZE_POSITION[call]]
      batch = given or (32 if rows is not None else None)
      declared = f'batch_size={batch}'
      if rows is not None and batch is not None and rows < batch:
        return  # one short batch: nothing runs padded but it
    if batch is None or batch % size == 0:
      return
    raise ValueError(
      f'{self.model.name}.{call}: {declared}: {batch} rows do not split over the batch axis '
      f'{self.axes!r} of {size} devices ({batch} is not a multiple of {size}), so every batch '
      f'would run padded. Use a batch size that is a multiple of {size}; only the last batch of an '
      'epoch may be shorter.'
    )

  def step_function(self, step_method):
    """Keras' `train_function` / `test_function`: up to `steps_per_execution` batches per call."""
    split = _batch_split(self.mesh, self.axes)

    @tf.function
    def one_step(data):
      return step_method(split(data))

    one, many = self.partitioned(one_step), self.partitioned(self._looped(step_method))
    name = getattr(step_method, '__name__', 'step')
    self.functions[name], self.functions[f'{name}_looped'] = one, many

    def function(iterator):
      batches = []
      for _ in range(max(1, int(self.model.steps_per_execution))):
        try:
          batches.append(_next_batch(iterator))
        except (StopIteration, tf.errors.OutOfRangeError):
          break
      if not batches:
        raise StopIteration
      logs = None
      for group in _same_shape_runs(batches):
        if len(group) == 1:
          logs = self.launch(one, group[0])
        else:
          stacked = tf.nest.map_structure(lambda *ts: tf.stack(ts), *group)
          logs = self.launch(many, stacked)
      return logs

    return function

  def _looped(self, step_method):
    """k steps in one program: a While loop over batches stacked along a new leading dim."""
    split = _batch_split(self.mesh, self.axes)
    split_stacked = _batch_split(self.mesh, self.axes, lead=1)

    @tf.function
    def looped_steps(stacked):
      stacked = split_stacked(stacked)
      k = tf.nest.flatten(stacked)[0].shape[0]
      nth = lambda i: tf.nest.map_structure(lambda t: tf.gather(t, i), stacked)  # noqa: E731
      first_logs = step_method(split(nth(0)))

      def body(i, logs):
        del logs  # the last step's logs are the chunk's logs
        return i + 1, step_method(split(nth(i)))

      _, logs = tf.while_loop(
        lambda i, _: i < k, body, (tf.constant(1), first_logs), name='steps_per_execution'
      )
      return logs

    return looped_steps

  def predict_function(self):
    split = _batch_split(self.mesh, self.axes)

    @tf.function
    def predict_step(data):
      return self.model.predict_step(split(data))

    fn = self.functions['predict_step'] = self.partitioned(predict_step)

    def function(data):
      outputs = [self.launch(fn, batch) for batch in data]
      return tf.nest.map_structure(lambda *ts: tf.concat(ts, 0), *outputs)

    return function


# Where fit / evaluate / predict take batch_size positionally (after x, y; predict: after x).
_BATCH_SIZE_POSITION = {'fit': 2, 'evaluate': 2, 'predict': 1}


def _rows(data):
  """The leading dim of array-like `data` (the first of a structure), else None."""
  flat = tf.nest.flatten(data) if not isinstance(data, tf.data.Dataset) else []
  shape = getattr(flat[0], 'shape', None) if flat else None
  return int(shape[0]) if shape is not None and len(shape) and shape[0] is not None else None


def layer_paths(model) -> set:
  """Every layer path of `model` that Keras' public API shows: its layers' names and the
  layer part of each variable's path ('attention/query' of 'attention/query/kernel')."""
  paths = {layer.name for layer in model.layers}
  for variable in model.variables:
    parts = variable.path.split('/')[:-1]
    paths.update('/'.join(parts[:k]) for k in range(1, len(parts) + 1))
  return paths


def _in_layers(model, message: str) -> str:
  """`" In Keras layer 'a/b', ... of model 'm'."` for the nodes a lowering error names.

  The layers are found by the nodes' name scopes.

  TF names a layer's scope by the layer's name, uniquified with a '_<n>' suffix per trace."""
  found = []
  paths = layer_paths(model)
  for node in sorted(set(re.findall(r'node ([^\s(){}]+)', message))):
    scopes = [[c, re.sub(r'_\d+$', '', c)] for c in node.split('/')[:-1]]
    best = ''
    for path in paths:
      parts = path.split('/')
      for start in range(len(scopes) - len(parts) + 1):
        if all(p in scopes[start + i] for i, p in enumerate(parts)) and len(path) > len(best):
          best = path
    if best and best not in found:
      found.append(best)
  if not found:
    return ''
  return f' In Keras layer {", ".join(repr(p) for p in found)} of model {model.name!r}.'


def _build_optimizer(model) -> None:
  """Create the optimizer's variables before the train step is traced.

  Keras builds its optimizer lazily, inside the first trace of the step; a
  tf.function that creates variables while tracing is traced again without them
  (TF's rule), so the whole step would be traced twice before it is captured
  (measured: half of the capture time of a 50-layer residual CNN). Keras' own
  `apply` builds it from the same list (`model.trainable_variables`), so the
  variables are the same, only made earlier.
  """
  optimizer = getattr(model, 'optimizer', None)
  if optimizer is not None and not optimizer.built and model.trainable_variables:
    optimizer.build(model.trainable_variables)


def _same_shape_runs(batches) -> List[list]:
  """Consecutive batches grouped by shape (an epoch's short last batch runs on its own)."""
  groups = []
  for batch in batches:
    if groups and _signature(groups[-1][0]) == _signature(batch):
      groups[-1].append(batch)
    else:
      groups.append([batch])
  return groups


def partition_model(
  model,
  mesh: Mesh,
  batch_axes: Union[str, Sequence[str]] = 'data',
  *,
  replicate_unannotated: bool = True,
  pull_every_step: bool = False,
  strategy=None,
  **kwargs,
):
  """Make `fit`, `evaluate`, `predict`, `*_on_batch` run partitioned over `mesh`; returns `model`.

  The model's variables are annotated as usual (`shard_variable`, `LayoutMap`)
  before this call; every input and target is split along its first dim over
  `batch_axes`. Model and metric variables no annotation covers are
  replicated (`replicate_unannotated=False`: left to propagation, as before;
  then the train and test steps may disagree on a layout). With
  `steps_per_execution=k`, k train (test) steps run inside one partitioned
  program. The model's own variables are views of their shards: every read sees the
  trained value, every write reaches the next step (`pull_every_step` is accepted and
  ignored: there is nothing to copy).
  `strategy`: a `tf.distribute.TPUStrategy` (one replica per mesh device, see
  `xla_bridge.tpu.mesh_device_assignment`) or a stand-in such as a MirroredStrategy
  of the mesh's CPUs: every step runs through `strategy.run`, partition id = replica
  id (tf_gspmd/keras/strategy.py; build and compile the model outside its scope;
  `collectives=` / `exported=` choose the replica program).
  `kwargs` go to `tf_gspmd.partition` (devices, timeout).
  """
  _refuse_keras2(model)
  unpartition_model(model)  # partitioned before: its trained values back, Keras' methods back
  axes = batch_axes if isinstance(batch_axes, str) else tuple(batch_axes)
  launcher = _Launcher(model, mesh, axes, replicate_unannotated, kwargs, pull_every_step, strategy)

  def make_train_function(force=False):
    if model.train_function is None or force:
      _build_optimizer(model)
      model.train_function = launcher.step_function(model.train_step)
    return model.train_function

  def make_test_function(force=False):
    if model.test_function is None or force:
      model.test_function = launcher.step_function(model.test_step)
    return model.test_function

  def make_predict_function(force=False):
    if model.predict_function is None or force:
      model.predict_function = launcher.predict_function()
    return model.predict_function

  replaced = {
    name: model.__dict__.get(name)  # what the instance held before (None: nothing)
    for name in ('make_train_function', 'make_test_function', 'make_predict_function')
  }
  model.make_train_function = make_train_function
  model.make_test_function = make_test_function
  model.make_predict_function = make_predict_function
  model.train_function = model.test_function = model.predict_function = None

  def checked(name):
    """`name` (fit, evaluate, predict) refusing a batch size the batch axes do not split."""
    original = getattr(model, name)
    replaced[name] = model.__dict__.get(name)

    def wrapped(*args, **kw):
      launcher.check_batch_size(name, args, kw)
      return original(*args, **kw)

    wrapped.__name__ = name
    wrapped.__doc__ = original.__doc__
    setattr(model, name, wrapped)

  for name in ('fit', 'evaluate', 'predict'):
    checked(name)
  launcher.replaced = replaced
  model._tf_gspmd_store = launcher.store  # noqa: SLF001
  model._tf_gspmd_launcher = launcher  # noqa: SLF001
  return model


def unpartition_model(model):
  """Undo `partition_model`: Keras' own steps are back, plain variables' shards are dropped
  (they hold their value), a variable made as shards keeps them (its value). A no-op for a model
  never partitioned; returns `model`.
  """
  launcher = model.__dict__.get('_tf_gspmd_launcher')
  if launcher is None:
    return model
  for variable in list(launcher.store.originals.values()):
    held.unhold(variable)
  for name, before in launcher.replaced.items():
    if before is None:
      model.__dict__.pop(name, None)
    else:
      setattr(model, name, before)
  model.train_function = model.test_function = model.predict_function = None
  del model._tf_gspmd_launcher, model._tf_gspmd_store  # noqa: SLF001
  return model
