"""The variables a partitioned function touches, and their shards.

A variable made as shards (`Variable`, `sharded_variables`: a `held.SplitVariable`) has them
as its one state; a plain variable a function adopts keeps its own value, copied into its
shards and back around each partitioned call (`program/held.py`). Every partitioned function
over a variable finds the same shards, with no store to pass. A `VariableStore` is one
function's index of the variables it touches (`pairs`, `byte_counts`, the id -> shards mapping
its executors read); two stores over the same variables see the same shards.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import MutableMapping
from typing import Any, Dict, Iterator, List, Optional

import numpy as np
import tensorflow as tf

from tf_gspmd.annotations import shard_variable, variable_sharding
from tf_gspmd.partitioned import executors
from tf_gspmd.program import held
from tf_gspmd.runtime import grappler
from tf_gspmd.sharding import NamedSharding, Sharding

# Set by `tg.abstract_variable` on the variables it makes: a shape and a dtype, no value.
_ABSTRACT = '_tf_gspmd_abstract_variable'


def mark_abstract(variable) -> None:
  """Record that `variable` has no value and never will (`tg.abstract_variable`)."""
  setattr(variable, _ABSTRACT, True)


def refuse_abstract(variable) -> None:
  """Refuse to give shards to an abstract variable: it has nothing to split (a read of it gives
  an empty tensor, whose shape no sharding of the variable's fits)."""
  if getattr(variable, _ABSTRACT, False):
    raise ValueError(
      f'partition: variable {variable.name} (shape {tuple(variable.shape)}, '
      f'{variable.dtype.name}) is a tg.abstract_variable: a shape with no value. Abstract '
      'variables are for planning (tg.plan, tg.auto_shard); to run the step, make the '
      'variable with a value (tf.Variable, or tg.Variable(value, sharding) to create it '
      'sharded).'
    )


def _on_mesh(sharding, other) -> str:
  """The mesh of `sharding`, written out when its spec reads as `other`'s: the same spec over
  other devices is another layout."""
  mesh = getattr(sharding, 'mesh', None)
  return f' on {mesh!r}' if mesh is not None and str(sharding) == str(other) else ''


def _made_under(annotation) -> str:
  """What chose a held variable's layout when its shards were made."""
  if annotation is None:
    return 'the layout propagation chose at the first call: it was not annotated then'
  return f'the layout it was annotated with then, {annotation}'


class _Shards(MutableMapping):
  """id(tf.Variable) -> the holder of its shards, read live from the variable (a program built
  for another layout may have moved them). Entries set directly (a planner's abstract shards,
  a strategy's replica variables) are kept here for variables that are not held."""

  def __init__(self, variables: Dict[int, Any]):
    self._variables = variables
    self._local: Dict[int, Any] = {}

  def __getitem__(self, key: int):
    variable = self._variables.get(key)
    holder = held.holder_of(variable) if variable is not None else None
    if holder is not None:
      return holder
    return self._local[key]

  def __setitem__(self, key: int, holder) -> None:
    self._local[key] = holder

  def __delitem__(self, key: int) -> None:
    self._local.pop(key, None)
    self._variables.pop(key, None)

  def __iter__(self) -> Iterator[int]:
    keys = [k for k, v in self._variables.items() if held.is_held(v)]
    return iter(keys + [k for k in self._local if k not in keys])

  def __len__(self) -> int:
    return sum(1 for _ in self)


class VariableStore:
  """The variables of one or more partitioned functions, each held once as its shards.

  Kept for code that passes one (`partition(..., store=...)`): every function shares the
  shards of a variable anyway, since they live on the variable itself.
  """

  def __init__(self):
    self.originals: Dict[int, Any] = {}  # id(tf.Variable) -> tf.Variable
    self.sharded = _Shards(self.originals)  # id(tf.Variable) -> its shards (live)

  def check_annotations(self, variables) -> None:
    """Raise a ValueError for a variable annotated differently since its shards were made."""
    for var in variables:
      holder = held.holder_of(var)
      if holder is None:
        continue
      then, now = held.annotation_when_held(var), variable_sharding(var)
      if now is None or now.is_equivalent_to(holder.sharding):
        continue  # no annotation, or the layout its shards have: nothing changes
      if then is not None and now == then:
        continue  # the annotation its shards were made under (they moved since, for a program)
      raise ValueError(
        f'partition: variable {var.name} was annotated {now}{_on_mesh(now, holder.sharding)} '
        f'after its shards were made; they live as {holder.sharding}'
        f'{_on_mesh(holder.sharding, now)} ({_made_under(then)}), and a layout does not change '
        'under a live variable. Annotate variables before the first call, or make a new '
        'variable with the new layout and assign the old value to it.'
      )

  def pairs(self, variables=None) -> List[tuple]:
    """(variable, shards) pairs, of `variables` only when given."""
    keys = (
      list(self.sharded)
      if variables is None
      else [id(v) for v in variables if id(v) in self.sharded]
    )
    return [(self.originals[k], self.sharded[k]) for k in keys if k in self.originals]

  def sync(self, variables=None) -> None:
    """Deprecated, does nothing: a held variable reads its shards whenever it is read."""
    _deprecated('sync_variables')

  def scatter(self, variables=None) -> None:
    """Deprecated, does nothing: a write to a held variable goes to its shards at once."""
    _deprecated('scatter_variables')

  def add(self, var, sharding: NamedSharding, sharded_cls, devices, backend: str) -> None:
    """Give `var` shards of `sharding` (a `sharded_cls`), unless it has such shards already.

    A variable already held as shards of another layout, device list or backend keeps one
    state: its shards are moved to what this program needs (`move_shards`). `devices`: a
    function giving the devices (`executors.DeviceSource`), asked only when shards are made
    or compared.
    """
    del backend  # the class says it
    refuse_abstract(var)
    key = id(var)
    self.originals[key] = var
    holder = held.holder_of(var)
    if holder is not None and fits(holder, sharding, sharded_cls, devices):
      return
    devices = devices()
    if holder is not None and _lost(holder):
      value = None  # an adopted plain variable kept its own value: new shards are made from it
      if held.is_split(var):  # its shards were its only state
        warnings.warn(
          f'partition: the shards of variable {var.name} lived on a cluster connection that '
          'is gone (tf_gspmd.runtime.cluster.connect ran again): its value is lost; it starts '
          'from zeros on the new devices. Restore a checkpoint (tg.restore_checkpoint) before '
          'reading it.',
          stacklevel=3,
        )
        value = tf.zeros(var.shape, var.dtype)
      held.replace_holder(var, _shards_of(var, sharding, sharded_cls, devices, value))
      return
    if holder is not None:
      move_shards(var, sharding, sharded_cls, devices)
      return
    held.hold(
      var, _shards_of(var, sharding, sharded_cls, devices), annotation=variable_sharding(var)
    )
    if tf.executing_eagerly():  # its shards were made from its value: nothing to copy in yet
      held.note_in_sync([var])

  def byte_counts(self) -> Dict[str, Dict[str, int]]:
    """Per variable name: its total bytes and the bytes one device holds.

    Variables that share a name get '#2', '#3', ... appended to it.
    """
    out: Dict[str, Dict[str, int]] = {}
    for original, sharded in self.pairs():
      name, k = original.name, 1
      while name in out:
        k += 1
        name = f'{original.name}#{k}'
      size = sharded.dtype.size
      out[name] = {
        'total': int(np.prod(sharded.shape, dtype=np.int64)) * size,
        'per_device': int(np.prod(sharded.local_shape, dtype=np.int64)) * size,
      }
    return out


def _deprecated(name: str) -> None:
  warnings.warn(
    f'{name}() does nothing and will be removed: a variable partitioned by tf_gspmd is held '
    'once, as its shards; reads assemble them and writes scatter to them.',
    DeprecationWarning,
    stacklevel=3,
  )


def _shards_of(var, sharding: Sharding, sharded_cls, devices, value=None):
  """Shards of `sharding` (a `sharded_cls`) on `devices`, made from `value` (default: `var`'s
  current value)."""
  return sharded_cls(
    var.read_value() if value is None else value,
    sharding,
    devices=devices,
    name=var.name.split(':')[0],
    trainable=getattr(var, 'trainable', True),
  )


def _devices_of(holder) -> Optional[tuple]:
  devices = getattr(holder, 'devices', None)
  return tuple(devices) if devices is not None else None


def _lost(holder) -> bool:
  """Whether `holder`'s shards lived in a remote context a later cluster connect replaced."""
  made_under = getattr(holder, 'connection', None)
  remote = [d for d in getattr(holder, 'devices', ()) if '/job:' in str(d)]
  if made_under is None or not any('/job:localhost' not in str(d) for d in remote):
    return False  # local devices outlive a connect
  from tf_gspmd.runtime.cluster import connection_count

  return made_under != connection_count()


def fits(holder, sharding: Sharding, sharded_cls, devices) -> bool:
  """Whether `holder` is what a program needing `sharding` on `devices` (an
  `executors.DeviceSource`) reads as it is."""
  if _lost(holder):
    return False
  if not isinstance(holder, sharded_cls) or not holder.sharding.is_equivalent_to(sharding):
    return False
  mesh = getattr(sharding, 'mesh', None)
  held_on = _devices_of(holder)
  if mesh is not None and held_on is not None and len(held_on) != mesh.size:
    return False  # equivalent layouts (replicated, say) over another number of devices
  wanted = devices()
  if wanted is None:
    return True  # the default devices of the backend: the ones the holder was made on
  return _devices_of(holder) == tuple(wanted)


def move_shards(var, sharding: Sharding, sharded_cls, devices) -> None:
  """Move a held variable's shards to another layout, device list or backend: its value is
  assembled on the host (this one variable's), split again, and the old shards dropped."""
  holder = held.holder_of(var)
  with tf.device('/device:CPU:0'):
    value = holder.assemble()
  made = sharded_cls(
    value,
    sharding,
    devices=devices,
    name=var.name.split(':')[0],
    trainable=getattr(var, 'trainable', True),
  )
  held.replace_holder(var, made)


def local_variable(sharded) -> tf.Variable:
  """A TF variable of one shard's shape and dtype, to trace a per-partition program with."""
  return sharded.template if hasattr(sharded, 'template') else sharded.shards[0]


# --- variables made as shards ------------------------------------------------------------------
# Set while a holder makes its per-device variables: creator scopes let those through as they are.
_MAKING = threading.local()


def making_shards() -> int:
  """Nonzero while shards are being made (their own tf.Variables are plain ones)."""
  return getattr(_MAKING, 'depth', 0)


# An initial value at least this large, from a callable whose shape is known, is computed in
# one TF graph: there each op may write into its input's buffer (a uniform draw scaled and
# shifted is one whole buffer), where eagerly every op's result is a new whole buffer (three
# for Keras' uniform initializers) and TF's CPU allocator (oneDNN's pool) keeps what it once
# held for the rest of the process. Below it, a trace costs more than the buffers it saves.
GRAPH_INITIAL_VALUE_BYTES = 8 * 2**20


class _MadeAVariable(Exception):
  """Raised when an initializer traced in a graph makes a variable (a seed generator's state):
  that initializer is then called eagerly, as TF would."""


def _refuse_variables(next_creator, **kwargs):
  raise _MadeAVariable


def _computed_in_a_graph(initial_value):
  """`initial_value()` run as one TF graph (its Python called once, by the trace), or None
  if computing it makes a variable."""
  traced = tf.function(initial_value, autograph=False)
  try:
    with tf.variable_creator_scope(_refuse_variables):
      concrete = traced.get_concrete_function()
  except _MadeAVariable:
    return None
  # Without Grappler: its constant folding of the draw's scale (max - min) leaves the draw's
  # buffer unforwarded (measured: two whole buffers at once, one without it); and it runs once.
  with grappler.without_grappler():
    return concrete()


def _graph_worthy(initial_value, shape, dtype) -> bool:
  if not callable(initial_value) or shape is None or None in tuple(shape):
    return False
  itemsize = tf.as_dtype(dtype or tf.float32).size
  return int(np.prod(tuple(shape), dtype=np.int64)) * itemsize >= GRAPH_INITIAL_VALUE_BYTES


def _whole_value(initial_value, dtype, shape=None) -> tf.Tensor:
  """The initial value, computed on the host (a callable is called here, once; a large one of
  known `shape` in one graph, see GRAPH_INITIAL_VALUE_BYTES)."""
  with tf.init_scope(), tf.device('/device:CPU:0'):
    value = None
    if _graph_worthy(initial_value, shape, dtype):
      value = _computed_in_a_graph(initial_value)
    if value is None:
      value = initial_value() if callable(initial_value) else initial_value
    return tf.convert_to_tensor(value, dtype=dtype)


def Variable(  # noqa: N802  (a constructor, named as tf.Variable)
  initial_value,
  sharding: Sharding,
  *,
  name: Optional[str] = None,
  trainable: bool = True,
  dtype=None,
  backend: str = executors.DEFAULT,
  devices=None,
  shape=None,
) -> tf.Variable:
  """A `tf.Variable` made as shards of `sharding` (a `SplitVariable`): its whole value is
  never kept on a device.

  `initial_value` (a value, or a callable computing it) is computed on the host, split into
  the shards of `sharding` on `devices` (default: the backend's first `mesh.size` devices) and
  dropped. The variable is annotated with `sharding` and reads (assembling the shards) and
  writes (scattering) like any variable; every function partitioned over it runs on its shards.
  `shape`, when the caller knows it before computing a callable `initial_value`, lets a large
  one be computed as one TF graph (one whole buffer on the host where eager ops make several).

  >>> w = Variable(np.zeros((8, 4)), NamedSharding(mesh, P('x', None)))  # doctest: +SKIP
  """
  value = _whole_value(initial_value, dtype, shape)
  if not isinstance(sharding, Sharding):
    raise TypeError(f'tg.Variable: sharding must be a Sharding, got {type(sharding).__name__}.')
  sharding.check_shape(value.shape.as_list(), what=f'tg.Variable({name or "Variable"})')
  executor = executors.get(backend, 'tg.Variable')
  executor.check_fits(
    [(name or 'Variable', tuple(value.shape), value.dtype, sharding)], sharding.mesh.size, devices
  )
  _MAKING.depth = making_shards() + 1
  try:
    holder = executor.sharded_variable_class()(
      value, sharding, devices=devices, name=name or 'Variable', trainable=trainable
    )
  finally:
    _MAKING.depth -= 1
  del value  # the shards hold it now
  variable = held.SplitVariable(
    holder, name=name or 'Variable', trainable=trainable, annotation=sharding
  )
  shard_variable(variable, sharding)
  return variable


def _layout_rule(layout):
  """`layout` as a function of (variable name, shape) -> its Sharding or None."""
  if callable(layout) and not hasattr(layout, '_matching'):
    return layout
  if hasattr(layout, '_matching'):  # a tf_gspmd.LayoutMap: its mesh and rules
    mesh, rules = layout.mesh, [(p, s) for p, s in layout._rules.items()]  # noqa: SLF001
  else:
    mesh, rules = layout
  import re

  def rule(name: str, shape) -> Optional[Sharding]:
    for pattern, spec in rules:
      if re.fullmatch(pattern, name):
        return spec if isinstance(spec, Sharding) else NamedSharding(mesh, spec)
    return None

  return rule


@contextlib.contextmanager
def sharded_variables(
  mesh, layout, *, backend: str = executors.DEFAULT, devices=None
) -> Iterator[None]:
  """Make every `tf.Variable` created inside as shards, when `layout` splits it.

  `layout`: a `tg.LayoutMap`, a dict {name regex: P or Sharding} (matched whole against the
  variable's name with its name scope, without ':0'), or a function (name, shape) -> Sharding
  or None. A matched variable is made as `tg.Variable` makes it (its initial value computed on
  the host and split, never kept whole); others are made as usual. TF's own hook for this,
  `tf.variable_creator_scope`, is what tf.distribute uses.

  >>> with sharded_variables(mesh, {r'.*kernel': P(None, 'model')}):   # doctest: +SKIP
  ...   w = tf.Variable(tf.random.normal([512, 1024]), name='dense/kernel')
  """
  rule = _layout_rule(layout if not isinstance(layout, dict) else (mesh, list(layout.items())))

  def creator(next_creator, **kwargs):
    name = kwargs.get('name') or 'Variable'
    if making_shards() or (tf.inside_function() and not tf.executing_eagerly()):
      return next_creator(**kwargs)  # made while a function is traced: TF lifts it as usual
    value = _whole_value(kwargs['initial_value'], kwargs.get('dtype'), _known_shape(kwargs))
    scoped = _scoped_name(name)
    sharding = rule(scoped, tuple(value.shape))
    if sharding is None or not _splits(sharding):
      return next_creator(**dict(kwargs, initial_value=value))
    return Variable(
      value,
      sharding,
      name=name,
      trainable=kwargs.get('trainable', True) is not False,
      backend=backend,
      devices=devices,
    )

  with tf.variable_creator_scope(creator):
    yield


def _known_shape(kwargs):
  """The shape a variable's creator was told, when fully known (else None)."""
  shape = kwargs.get('shape')
  if shape is None:
    return None
  shape = tf.TensorShape(shape)
  return tuple(shape.as_list()) if shape.is_fully_defined() else None


def _scoped_name(name: str) -> str:
  """`name` under the current name scope (what the variable will be called), without ':0'."""
  with tf.name_scope(name) as scope:
    return scope.rstrip('/')


def _splits(sharding: Sharding) -> bool:
  """Whether `sharding` gives each device less than the whole value."""
  return sharding.kind == 'tiled' and any(t > 1 for t in sharding.tile_shape)


# --- will the shards fit? --------------------------------------------------------------------
def device_capacity(device: str) -> Optional[int]:
  """Bytes `device` can hold, where TF can tell: a GPU given a memory limit by its logical
  device configuration (`tf.config.set_logical_device_configuration`). None elsewhere (a CPU
  device's memory is the host's; TF reports a GPU's use, not its size, otherwise)."""
  spec = tf.DeviceSpec.from_string(device)
  if (spec.device_type or '').upper() != 'GPU':
    return None
  gpus = tf.config.list_physical_devices('GPU')
  index, seen = spec.device_index or 0, 0
  for gpu in gpus:
    configs = tf.config.get_logical_device_configuration(gpu) or []
    for config in configs:
      if seen == index:
        limit = getattr(config, 'memory_limit', None)
        return None if limit is None else int(limit) * 2**20
      seen += 1
  return None


def check_fits(layouts, devices, capacity=None) -> None:
  """Refuse, before anything is allocated, shards that would not fit a device.

  `layouts`: (name, shape, dtype, sharding) of the variables about to be made; `devices`: the
  devices, partition p's at index p. Where a device's capacity is known (`capacity(device)`),
  the bytes of the shards it would hold (every variable's padded shard: what tg.plan predicts
  for the variables) must fit in it; the error names the bytes per device and the largest
  variables.
  """
  if not devices:
    return
  capacity = capacity or device_capacity
  limits = {p: capacity(str(d)) for p, d in enumerate(devices)}
  if all(v is None for v in limits.values()):
    return
  per_device = np.zeros(len(devices), dtype=np.int64)
  sizes = []
  for name, shape, dtype, sharding in layouts:
    local = (
      int(np.prod(sharding.shard_shape(tuple(shape)), dtype=np.int64)) * tf.as_dtype(dtype).size
    )
    holders = _devices_holding(sharding, len(devices))
    per_device[holders] += local
    sizes.append(
      (local, int(np.prod(shape, dtype=np.int64)) * tf.as_dtype(dtype).size, name, sharding)
    )
  over = [p for p, limit in limits.items() if limit is not None and per_device[p] > limit]
  if not over:
    return
  p = max(over, key=lambda q: per_device[q] - limits[q])
  largest = sorted(sizes, key=lambda s: -s[0])[:5]
  lines = '\n'.join(
    f'  {name}: {_size(total)} in all, {_size(local)} per device as {sharding}'
    for local, total, name, sharding in largest
  )
  raise ValueError(
    f"partition: the variables' shards need {_size(per_device[p])} on device {devices[p]}, "
    f'which holds {_size(limits[p])} (tg.plan predicts {_size(per_device.max())} of variables '
    f'on the fullest device, {_size(per_device.sum())} over all {len(devices)}). Largest '
    f'variables:\n{lines}\nSplit the largest ones over more devices (their layout), or use '
    'more devices.'
  )


def _size(n) -> str:
  """Bytes, readably: '512 B', '1.2 KiB', '3.0 GiB'."""
  n = float(n)
  if n < 1024:
    return f'{n:.0f} B'
  for unit in ('KiB', 'MiB', 'GiB'):
    n /= 1024
    if n < 1024 or unit == 'GiB':
      break
  return f'{n:.1f} {unit}'


def _devices_holding(sharding, n: int) -> List[int]:
  """The partitions that hold a shard of `sharding` (a maximal sharding: its one device)."""
  if getattr(sharding, 'is_maximal', False):
    return [int(sharding.devices[0])]
  return list(range(n))
