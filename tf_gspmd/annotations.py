"""Sharding annotations for tensors and variables, and reading them back from graphs.

The annotation functions mirror TF's own
`tensorflow.python.compiler.xla.experimental.xla_sharding` (`split`, `tile`,
`partial_tile`, `replicate`, `assign_device`, `mesh_split`) and add
`shard(x, mesh, P(...))` for named meshes. Each builds a `Sharding`, checks it
against the tensor (rank, axes, devices) and then hands its `OpSharding` to
TF's `xla_sharding.Sharding(proto).apply_to_tensor(..., use_sharding_op=True)`,
so the graph holds exactly the `XlaSharding` op and `_XlaSharding` attr that
TF's functions with `use_sharding_op=True` would have written.

`get_sharding(tensor)` reads a sharding back whichever API wrote it: the
`_XlaSharding` attr on a producing op, an `XlaSharding` op, a variable read
under `context.enable_xla_sharding_for_resource_variables()`, or a read of a
variable annotated with `shard_variable`.

Eager tensors: outside a graph (plain eager code, a Keras layer called
eagerly) there is no graph to hold an annotation. The functions then check the
sharding against the tensor's shape and return the tensor unchanged, and
`get_sharding` returns None for an eager tensor.
"""

from __future__ import annotations

import math
import weakref
from typing import Callable, List, Optional, Sequence

import numpy as np
import tensorflow as tf
from tensorflow.compiler.xla import xla_data_pb2

from tf_gspmd import dtensor_compat, op_sharding
from tf_gspmd.mesh import Mesh
from tf_gspmd.sharding import MANUAL, REPLICATED, NamedSharding, Sharding, named_for_rank
from tf_gspmd.tf_private import xla_sharding

# AutoGraph would try to convert these when a tf.function calls them; they are
# plain Python run at trace time (and some use generators, which it refuses).
_plain_python = tf.autograph.experimental.do_not_convert

# Python attribute on a tf.Variable that holds the Sharding given to shard_variable.
_VARIABLE_ATTR = '_tf_gspmd_sharding'

# Variables annotated by shard_variable, by id of their (eager) resource handle,
# so a ReadVariableOp in a traced graph leads back to its variable.
_ANNOTATED_VARIABLES = weakref.WeakValueDictionary()


# --- annotating tensors ----------------------------------------------------------
@_plain_python
def annotate(x, sharding: Sharding, unspecified_dims: Optional[Sequence[int]] = None):
  """Annotate tensor `x` with any `Sharding`; returns the annotated tensor.

  Inside a graph (tf.function, a Keras layer traced by one) this adds an
  `XlaSharding` op; eagerly it checks the sharding and returns `x` unchanged.
  A variable is annotated with `shard_variable` and returned.
  """
  if _tf_variable_or_none(x) is not None:
    return shard_variable(x, sharding)
  _check_annotatable(x, sharding)
  shape = _static_shape(x)
  if shape is not None:
    sharding.check_shape(shape, what=f'annotating tensor {_name(x)}')
  if tf.executing_eagerly():
    return x  # no graph to annotate; documented behaviour
  proto = op_sharding.to_proto(sharding)
  return xla_sharding.Sharding(proto).apply_to_tensor(
    x, use_sharding_op=True, unspecified_dims=list(unspecified_dims or [])
  )


@_plain_python
def shard(x, mesh_or_sharding, spec=None, unspecified_dims: Optional[Sequence[int]] = None):
  """Annotate `x` as laid out by `P(...)` on `mesh`: `shard(x, mesh, P('data', None))`.

  Or by a given sharding: `shard(x, sharding)`. A TF DTensor Mesh or Layout
  stands for a mesh or sharding: `shard(x, dtensor.Layout(['batch', UNSHARDED], mesh))`.
  """
  return annotate(x, _sharding_of(mesh_or_sharding, spec, 'shard'), unspecified_dims)


@_plain_python
def mesh_split(
  x,
  device_mesh,
  dims_mapping: Sequence[int],
  manual_mesh_dims: Optional[Sequence[int]] = None,
  unspecified_dims: Optional[Sequence[int]] = None,
):
  """TF's `xla_sharding.mesh_split`: dim i of `x` split along mesh dim `dims_mapping[i]`.

  -1: not split.
  """
  sharding = mesh_split_sharding(device_mesh, dims_mapping, manual_mesh_dims)
  return annotate(x, sharding, unspecified_dims)


@_plain_python
def split(x, split_dimension: int, num_devices: int, input_shape: Optional[Sequence[int]] = None):
  """TF's `xla_sharding.split`: dim `split_dimension` over devices 0..num_devices-1.

  Unlike TF's, a dimension smaller than `num_devices` is accepted: the
  trailing shards are then empty.
  """
  shape = list(input_shape) if input_shape is not None else _static_shape(x)
  if shape is None:
    raise ValueError(
      f'split: tensor {_name(x)} has unknown rank; pass input_shape so the split '
      'sharding can name every dim.'
    )
  rank = len(shape)
  if not -rank <= split_dimension < rank:
    raise ValueError(
      f'split: split_dimension {split_dimension} is out of range for tensor {_name(x)} of '
      f'shape {tuple(shape)}; use a dim in [{-rank}, {rank}).'
    )
  dims = [1] * rank
  dims[split_dimension] = int(num_devices)
  sharding = Sharding.tiled(np.arange(int(num_devices)).reshape(dims))
  if input_shape is not None:
    sharding.check_shape(shape, what=f'split of tensor {_name(x)} (input_shape)')
  return annotate(x, sharding)


@_plain_python
def tile(x, tile_assignment, unspecified_dims: Optional[Sequence[int]] = None):
  """TF's `xla_sharding.tile`: one tile per tensor dim entry of `tile_assignment`."""
  return annotate(x, Sharding.tiled(tile_assignment), unspecified_dims)


@_plain_python
def partial_tile(x, tile_assignment, unspecified_dims: Optional[Sequence[int]] = None):
  """TF's `xla_sharding.partial_tile`: the last tile dim holds replicas."""
  return annotate(x, Sharding.partial_tile(tile_assignment), unspecified_dims)


@_plain_python
def replicate(x):
  """TF's `xla_sharding.replicate`: every device holds all of `x`."""
  return annotate(x, Sharding.replicated())


@_plain_python
def assign_device(x, device: int):
  """TF's `xla_sharding.assign_device`: one device holds all of `x`."""
  return annotate(x, Sharding.maximal(device))


@_plain_python
def mesh_split_sharding(
  device_mesh, dims_mapping: Sequence[int], manual_mesh_dims: Optional[Sequence[int]] = None
) -> Sharding:
  """The `Sharding` TF's `mesh_split` means, with errors for bad mappings.

  Tensor dim i is split along mesh dim `dims_mapping[i]` (-1: not split);
  `manual_mesh_dims` become manual subgroup dims, and the mesh dims used by
  neither become one replicated subgroup dim (as TF writes it, even when
  those dims have size 1).
  """
  mesh = np.asarray(device_mesh)
  mapping = [int(d) for d in dims_mapping]
  manual = [int(d) for d in (manual_mesh_dims or [])]
  what = (
    f'mesh_split(device mesh of shape {mesh.shape}, dims_mapping={mapping}, '
    f'manual_mesh_dims={manual})'
  )
  used = [d for d in mapping if d >= 0] + manual
  for d in mapping + manual:
    if not -1 <= d < mesh.ndim or (d == -1 and d in manual):
      raise ValueError(
        f'{what}: mesh dim {d} does not exist; use 0..{mesh.ndim - 1} (or -1 in '
        'dims_mapping for a dim that is not split).'
      )
  repeated = sorted({d for d in used if used.count(d) > 1})
  if repeated:
    raise ValueError(
      f'{what}: mesh dims {repeated} are used twice; each mesh dim may split one tensor '
      'dim or be manual, once.'
    )
  rest = [d for d in range(mesh.ndim) if d not in used]
  tile_dims = [1 if d < 0 else mesh.shape[d] for d in mapping] + [mesh.shape[d] for d in manual]
  subgroups = [MANUAL] * len(manual)
  if rest:
    tile_dims.append(math.prod(mesh.shape[d] for d in rest))
    subgroups.append(REPLICATED)
  return Sharding.tiled(mesh.transpose(used + rest).reshape(tile_dims), subgroups)


# --- variables ---------------------------------------------------------------------
@_plain_python
def shard_variable(v, mesh_or_sharding, spec=None):
  """Annotate variable `v` with `NamedSharding(mesh, spec)` (or a given `Sharding`); returns `v`.

  The sharding is stored on the variable twice: as TF's own resource-variable
  sharding (`v._set_xla_sharding(proto)`, which makes every later read carry an
  `XlaSharding` op when `context.enable_xla_sharding_for_resource_variables()`
  is on) and as a Python attribute that keeps the mesh, read by
  `variable_sharding(v)` and by `get_sharding` on the variable's reads.
  Works on `tf.Variable` and on built Keras 3 variables. A TF DTensor Mesh or
  Layout stands for a mesh or sharding: `shard_variable(v, dtensor.Layout(...))`.
  """
  var = _tf_variable(v)
  sharding = _sharding_of(mesh_or_sharding, spec)
  sharding.check_shape(var.shape.as_list(), what=f'shard_variable({var.name})')
  proto = op_sharding.to_proto(sharding)
  if hasattr(var, '_set_xla_sharding'):
    var._set_xla_sharding(proto)  # noqa: SLF001
  setattr(var, _VARIABLE_ATTR, sharding)
  _ANNOTATED_VARIABLES[id(var.handle)] = var
  return v


@_plain_python
def variable_sharding(v) -> Optional[Sharding]:
  """The sharding stored on variable `v` (by `shard_variable` or TF's own API), or None."""
  var = _tf_variable(v)
  stored = getattr(var, _VARIABLE_ATTR, None)
  if stored is not None:
    return stored
  proto = var._get_xla_sharding() if hasattr(var, '_get_xla_sharding') else None  # noqa: SLF001
  return None if proto is None else op_sharding.from_proto(proto, tuple_index=0)


# --- reading back ----------------------------------------------------------------
@_plain_python
def get_sharding(x, mesh: Optional[Mesh] = None) -> Optional[Sharding]:
  """The sharding annotated on graph tensor (or variable) `x`, or None.

  With `mesh`, a sharding some `P(...)` on `mesh` expresses comes back as that
  `NamedSharding` (replicated ones too, when the rank is known).
  """
  if _tf_variable_or_none(x) is not None:
    return _on_mesh(variable_sharding(x), mesh, _static_shape(x))
  try:
    op = x.op
  except AttributeError:  # eager tensors have no op; plain values neither
    op = None
  if op is None:
    return None  # eager tensors and plain values carry no annotation
  serialized = xla_sharding.get_op_sharding(op)
  if serialized is None and op.type == 'XlaSharding':
    serialized = op.get_attr('sharding')  # an empty string means REPLICATED
  if serialized is not None:
    proto = xla_data_pb2.OpSharding.FromString(serialized)
    sharding = op_sharding.from_proto(proto, tuple_index=x.value_index)
  elif op.type == 'ReadVariableOp':
    var = _variable_of_handle(op.inputs[0])
    sharding = None if var is None else variable_sharding(var)
  elif op.type == 'Identity' and _is_variable_read(op.inputs[0]):
    return get_sharding(op.inputs[0], mesh)  # v.read_value() wraps the read in an Identity
  else:
    return None
  return _on_mesh(sharding, mesh, _static_shape(x))


def _is_variable_read(t) -> bool:
  """Whether `t` is a variable's value: a read, its XlaSharding, or Identities of those."""
  while t.op.type in ('Identity', 'XlaSharding'):
    t = t.op.inputs[0]
  return t.op.type == 'ReadVariableOp'


def _on_mesh(sharding: Optional[Sharding], mesh: Optional[Mesh], shape) -> Optional[Sharding]:
  """`sharding` as a NamedSharding on `mesh` when one means the same, else unchanged."""
  if sharding is None or mesh is None or shape is None:
    return sharding
  if sharding.is_replicated or sorted(sharding.devices) == sorted(mesh.devices):
    return named_for_rank(sharding, mesh, len(shape)) or sharding
  return sharding


def _variable_of_handle(handle):
  """The variable whose resource handle `handle` is, following captures out of function graphs."""
  graphs = []
  while True:
    graph = getattr(handle, 'graph', None)
    graphs.append(graph)
    outer = next(
      (ext for ext, internal in getattr(graph, 'captures', ()) if internal is handle), None
    )
    if outer is None:
      break
    handle = outer
  var = _ANNOTATED_VARIABLES.get(id(handle))
  if var is not None and var.handle is handle:
    return var
  # A variable annotated by TF's own API: look among the variables the graphs touched.
  for graph in graphs:
    for candidate in getattr(graph, 'variables', ()):
      if getattr(candidate, 'handle', None) is handle:
        return candidate
  return None


# --- helpers -------------------------------------------------------------------------
def _check_annotatable(x, sharding) -> None:
  """TypeErrors for what `annotate` cannot mean: a Python value, or a sharding of another type."""
  if not isinstance(sharding, Sharding):
    hint = (
      ' Build one with NamedSharding(mesh, spec), or call shard(x, mesh, spec).'
      if isinstance(sharding, tuple)
      else ''
    )
    raise TypeError(
      f'annotate: tensor {_name(x)} needs a Sharding, got '
      f'{type(sharding).__name__} {sharding!r}.{hint}'
    )
  if isinstance(x, (bool, int, float, complex, str, bytes, list, tuple)):
    raise TypeError(
      f'annotate: got the Python {type(x).__name__} {x!r} for sharding {sharding}, not a '
      'tensor; an annotation marks a tensor of the traced function. Pass a tensor, e.g. '
      'tf.constant(value), if you mean a constant.'
    )


def _sharding_of(mesh_or_sharding, spec, what: str = 'shard_variable') -> Sharding:
  """The sharding `(mesh, spec)` or `(sharding, None)` means; a DTensor Mesh or Layout converted."""
  mesh_or_sharding = dtensor_compat.converted(mesh_or_sharding)
  if isinstance(mesh_or_sharding, Mesh):
    if spec is None:
      raise ValueError(f'{what}(x, mesh, spec): a mesh needs a spec such as P(None, "model").')
    return NamedSharding(mesh_or_sharding, spec)
  if isinstance(mesh_or_sharding, Sharding) and spec is None:
    return mesh_or_sharding
  raise TypeError(
    f'{what}: expected (mesh, P(...)) or a Sharding, got {mesh_or_sharding!r}, {spec!r}.'
  )


# How to reach the tf.Variable inside an object wrapping one (a Keras 3 variable). This module
# sits below Keras and imports none of it: tf_gspmd.keras.hooks registers Keras' unwrapper when
# imported (tf_gspmd's __init__ imports it). An unwrapper returns the tf.Variable, None for an
# object it does not wrap, and raises a ValueError for a wrapper whose variable does not exist yet.
_VARIABLE_UNWRAPPERS: List[Callable] = []


def register_variable_unwrapper(unwrap: Callable) -> None:
  """Let `shard_variable`, `variable_sharding` and `annotate` take objects `unwrap` unwraps."""
  if unwrap not in _VARIABLE_UNWRAPPERS:
    _VARIABLE_UNWRAPPERS.append(unwrap)


def _tf_variable_or_none(v):
  """The tf.Variable behind `v` (itself, or a Keras 3 variable's value), None if not a variable."""
  if isinstance(v, tf.Variable):
    return v
  for unwrap in _VARIABLE_UNWRAPPERS:
    inner = unwrap(v)
    if inner is not None:
      return inner
  return None


def _tf_variable(v):
  var = _tf_variable_or_none(v)
  if var is None:
    raise TypeError(f'Expected a tf.Variable or Keras variable, got {type(v).__name__}: {v!r}.')
  return var


def _static_shape(x):
  """Static shape of `x` as a list (entries may be None), or None for unknown rank."""
  shape = getattr(x, 'shape', None)
  if shape is None:
    shape = np.shape(x)
  shape = tf.TensorShape(shape)
  return None if shape.rank is None else shape.as_list()


def _name(x) -> str:
  try:
    return repr(x.name)
  except (AttributeError, ValueError):
    return f'of type {type(x).__name__}'


__all__ = [
  'annotate',
  'shard',
  'mesh_split',
  'mesh_split_sharding',
  'split',
  'tile',
  'partial_tile',
  'replicate',
  'assign_device',
  'shard_variable',
  'variable_sharding',
  'get_sharding',
]
