"""The variables a partitioned function touches, each held once as its shards.

A variable's shards are the one state of the variable (`program/held.py`): the user's
`tf.Variable` becomes a view of them, and every partitioned function over it finds the same
shards, with no store to pass. A `VariableStore` is one function's index of the variables it
touches (`pairs`, `byte_counts`, the id -> shards mapping its executors read); two stores over
the same variables see the same shards.
"""

from __future__ import annotations

import warnings
from collections.abc import MutableMapping
from typing import Any, Dict, Iterator, List, Optional

import numpy as np
import tensorflow as tf

from tf_gspmd.annotations import variable_sharding
from tf_gspmd.program import held
from tf_gspmd.sharding import NamedSharding, Sharding


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
      if (
        now is not None
        and (then is None or now != then)
        and not now.is_equivalent_to(holder.sharding)
      ):
        raise ValueError(
          f'partition: variable {var.name} was annotated {now} after partitioning; its shards '
          f'already live as {holder.sharding} (annotated {then} then). '
          'Annotate variables before the first call, or make a new variable with the new '
          'layout and assign the old value to it.'
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
    state: its shards are moved to what this program needs (`move_shards`). `devices`: the
    devices, or a function giving them, asked only when shards are made.
    """
    del backend  # the class says it
    key = id(var)
    self.originals[key] = var
    holder = held.holder_of(var)
    if holder is not None and fits(holder, sharding, sharded_cls, devices):
      return
    devices = devices() if callable(devices) else devices
    if holder is not None:
      move_shards(var, sharding, sharded_cls, devices)
      return
    made = sharded_cls(
      var.read_value(),
      sharding,
      devices=devices,
      name=var.name.split(':')[0],
      trainable=getattr(var, 'trainable', True),
    )
    held.hold(var, made, annotation=variable_sharding(var))

  def release(self) -> None:
    """Free the own buffers of the variables this store's functions hold as shards."""
    held.release(list(self.originals.values()))

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


def _devices_of(holder) -> Optional[tuple]:
  devices = getattr(holder, 'devices', None)
  return tuple(devices) if devices is not None else None


def fits(holder, sharding: Sharding, sharded_cls, devices) -> bool:
  """Whether `holder` is what a program needing `sharding` on `devices` reads as it is."""
  if not isinstance(holder, sharded_cls) or not holder.sharding.is_equivalent_to(sharding):
    return False
  if devices is None or callable(devices):
    return True  # the default devices of the backend: the ones the holder was made on
  return _devices_of(holder) == tuple(devices)


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
