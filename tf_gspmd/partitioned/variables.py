"""The sharded copies of the tf.Variables a partitioned function touches."""

from typing import Any, Dict, List, Optional

import numpy as np
import tensorflow as tf

from tf_gspmd.annotations import variable_sharding
from tf_gspmd.sharding import NamedSharding, Sharding


class VariableStore:
  """The sharded copies of tf.Variables, shared by every function partitioned with it.

  Two partitioned functions over the same variables (a training step and an
  evaluation step) must read and write the same shards; give both one store.
  """

  def __init__(self):
    self.sharded: Dict[int, Any] = {}  # id(tf.Variable) -> ShardedVariable
    self.originals: Dict[int, Any] = {}  # id(tf.Variable) -> tf.Variable
    # id(tf.Variable) -> its shard_variable annotation when its shards were made (None: none),
    # so an annotation changed afterwards is refused instead of silently ignored.
    self.annotations: Dict[int, Optional[Sharding]] = {}

  def check_annotations(self, variables) -> None:
    """Raise a ValueError for a variable annotated differently since its shards were made."""
    for var in variables:
      then, now = self.annotations.get(id(var)), variable_sharding(var)
      if now is not None and (then is None or now != then):
        raise ValueError(
          f'partition: variable {var.name} was annotated {now} after partitioning; its shards '
          f'already live as {self.sharded[id(var)].sharding} (annotated {then} then). '
          'Annotate variables before the first call, or partition the function again '
          '(with a new VariableStore) to use the new layout.'
        )

  def pairs(self, variables=None) -> List[tuple]:
    """(original, sharded) pairs, of `variables` only when given."""
    keys = (
      self.sharded if variables is None else [id(v) for v in variables if id(v) in self.sharded]
    )
    return [(self.originals[k], self.sharded[k]) for k in keys]

  def sync(self, variables=None) -> None:
    """Assign each sharded variable's global value to its original."""
    for original, sharded in self.pairs(variables):
      original.assign(sharded.assemble())

  def scatter(self, variables=None) -> None:
    """Send each original's current value out to its shards."""
    for original, sharded in self.pairs(variables):
      sharded.scatter(original.read_value())

  def add(self, var, sharding: NamedSharding, sharded_cls, devices, backend: str) -> None:
    """Give `var` shards of `sharding` (a `sharded_cls`), unless it has them already.

    A variable sharded otherwise by an earlier trace, or held by another backend's
    sharded class, is refused: one store holds one layout of each variable. `devices`:
    the devices, or a function giving them, asked only when shards are made.
    """
    key = id(var)
    existing = self.sharded.get(key)
    if existing is not None and not isinstance(existing, sharded_cls):
      raise ValueError(
        f'partition: variable {var.name} is held by another backend ({type(existing).__name__}) '
        f'in this VariableStore; functions with backend={backend!r} need their own store.'
      )
    if existing is not None:
      if not existing.sharding.is_equivalent_to(sharding):
        raise ValueError(
          f'partition: variable {var.name} is sharded {existing.sharding} by an earlier trace '
          f'but {sharding} by this one; annotate it with shard_variable to fix its layout.'
        )
      return
    self.originals[key] = var
    self.annotations[key] = variable_sharding(var)
    self.sharded[key] = sharded_cls(
      var.read_value(),
      sharding,
      devices=devices() if callable(devices) else devices,
      name=var.name.split(':')[0],
      trainable=getattr(var, 'trainable', True),
    )

  def byte_counts(self) -> Dict[str, Dict[str, int]]:
    """Per variable name: its total bytes and the bytes one device holds.

    Variables that share a name get '#2', '#3', ... appended to it.
    """
    out = {}
    for key, sharded in self.sharded.items():
      name, k = self.originals[key].name, 1
      while name in out:
        k += 1
        name = f'{self.originals[key].name}#{k}'
      size = sharded.dtype.size
      out[name] = {
        'total': int(np.prod(sharded.shape, dtype=np.int64)) * size,
        'per_device': int(np.prod(sharded.local_shape, dtype=np.int64)) * size,
      }
    return out


def local_variable(sharded) -> tf.Variable:
  """A TF variable of one shard's shape and dtype, to trace a per-partition program with."""
  return sharded.template if hasattr(sharded, 'template') else sharded.shards[0]
