"""Small, concrete TF programs that produce each registered op type, for the op sweep.

`op_specs()` returns one or more `OpSpec`s per op type of
`tf_gspmd.propagation.registry`: a Python function that emits the op (almost
always through `tf.raw_ops`, so the op type is exactly the one named) and
concrete operand values. The sweep (`op_sweep.py`) annotates the operands
with every sharding of a mesh, partitions the function and compares it with
the unpartitioned run.

Which program sweeps an op type is part of its registry entry: `Entry.sweep`
names a program kind and `Entry.sweep_params` holds what that kind reads (an
input domain, a scalar argument). The kinds live in `tf_gspmd/testing/programs/`
(registered with `@program(kind)`, found by listing that package); each is
called once with the entries naming it. `Entry.unswept` says why an op type has
no program (`UNSWEPT` collects them).

Operand values are chosen inside each op's domain (logs of positives,
inverse trig functions of values in (-1, 1), nonzero divisors) so results
are finite and comparable. Shapes hold dims that do not divide the meshes'
shard counts (10 over 4, 3 over 4, 7 over 8, 10 over 8) so uneven shards and
empty shards are exercised.

"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import pkgutil
import zlib
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np
import tensorflow as tf

from tf_gspmd.graph import static_values
from tf_gspmd.propagation import registry


@dataclasses.dataclass(frozen=True)
class Operand:
  """One input of a swept op.

  `shard`: whether the sweep enumerates shardings for it (scalars and
  auxiliary values are left unannotated). `variable`: passed as a
  `tf.Variable` holding `value` (sharded with `shard_variable`).
  """

  value: np.ndarray
  shard: bool = True
  variable: bool = False

  @property
  def rank(self) -> int:
    return int(np.ndim(self.value))


@dataclasses.dataclass(frozen=True)
class OpSpec:
  """A program producing `op_type`: `fn(*operands)` returns a tensor, a tuple, or None.

  `name` is the op type, or `op_type/variant` when one op type has several
  programs (axes, masks, modes). `shard_outputs`: whether the sweep also asks
  for sharded outputs (`out_shardings`).
  """

  name: str
  op_type: str
  fn: Callable
  operands: Tuple[Operand, ...]
  shard_outputs: bool = True
  note: str = ''

  @property
  def variables(self) -> Tuple[int, ...]:
    return tuple(i for i, o in enumerate(self.operands) if o.variable)


# --- building blocks ---------------------------------------------------------------
def raw(op_type: str, *inputs, **attrs):
  """`tf.raw_ops.<op_type>` with positional inputs (in the op def's order) and keyword attrs."""
  fn = getattr(tf.raw_ops, op_type)
  n_inputs = len(static_values.op_def(op_type).input_arg)
  # The Python names of inputs may differ from the op def's (`axis` for `dim`); order does not.
  names = list(inspect.signature(fn).parameters)[:n_inputs]
  if len(inputs) > n_inputs:
    raise TypeError(f'{op_type} takes {n_inputs} inputs ({names}), got {len(inputs)}.')
  kwargs = dict(zip(names, inputs))
  kwargs.update(attrs)
  return fn(**kwargs)


class Values:
  """Deterministic operand values for one spec (seeded by its name)."""

  def __init__(self, name: str):
    self.rng = np.random.RandomState(zlib.crc32(name.encode()))

  def uniform(self, shape, lo=-2.0, hi=2.0, dtype=np.float32) -> np.ndarray:
    return self.rng.uniform(lo, hi, size=shape).astype(dtype)

  def ints(self, shape, lo, hi, dtype=np.int32) -> np.ndarray:
    return self.rng.randint(lo, hi, size=shape).astype(dtype)

  def bools(self, shape) -> np.ndarray:
    return self.rng.rand(*shape) < 0.5

  def nonzero(self, shape, lo=0.5, hi=2.0) -> np.ndarray:
    """Floats of either sign, away from zero."""
    sign = np.where(self.rng.rand(*shape) < 0.5, -1.0, 1.0)
    return (sign * self.rng.uniform(lo, hi, size=shape)).astype(np.float32)

  def nonzero_ints(self, shape, hi=5) -> np.ndarray:
    sign = np.where(self.rng.rand(*shape) < 0.5, -1, 1)
    return (sign * self.rng.randint(1, hi, size=shape)).astype(np.int32)

  def complex(self, shape) -> np.ndarray:
    return (self.uniform(shape) + 1j * self.uniform(shape)).astype(np.complex64)

  def specials(self, shape) -> np.ndarray:
    """Floats with some inf, -inf and nan among them."""
    x = self.uniform(shape).reshape(-1)
    x[::5] = np.inf
    x[1::7] = -np.inf
    x[2::6] = np.nan
    return x.reshape(shape)


def arg(value, shard=True) -> Operand:
  value = np.asarray(value)
  return Operand(value, shard=shard and value.ndim > 0)


def var(value, shard=True) -> Operand:
  return Operand(np.asarray(value), shard=shard, variable=True)


def spec(name, fn, *operands, op_type=None, shard_outputs=True, note='') -> OpSpec:
  return OpSpec(name, op_type or name.split('/')[0], fn, tuple(operands), shard_outputs, note)


# Shapes: 7, 10 and 3 over 2, 4 and 8 shards give even, uneven and empty shards.
UNARY_SHAPE = (7, 10, 3)
BINARY_SHAPE = (10, 3)


# --- program kinds ---------------------------------------------------------------------
Program = Callable[[List[registry.Entry]], List[OpSpec]]
PROGRAMS: Dict[str, Program] = {}


def program(kind: str):
  """Register the decorated `(entries naming kind) -> specs` as the sweep program `kind`."""

  def register(fn: Program) -> Program:
    if kind in PROGRAMS:
      raise ValueError(f'op_builders: two sweep programs are called {kind!r}.')
    PROGRAMS[kind] = fn
    return fn

  return register


@functools.lru_cache(maxsize=None)
def load_programs() -> None:
  """Import every module of `tf_gspmd.testing.programs` (each registers its kinds)."""
  package = importlib.import_module('tf_gspmd.testing.programs')
  for module in pkgutil.iter_modules(package.__path__):
    importlib.import_module(f'tf_gspmd.testing.programs.{module.name}')


def unswept() -> Dict[str, str]:
  """Registered op types no tf.function can produce, with why (their entries' `unswept`)."""
  return {e.op_type: e.unswept for e in registry.entries() if e.unswept}


UNSWEPT = unswept()
_CACHE: Optional[List[OpSpec]] = None


def op_specs() -> List[OpSpec]:
  """Every swept program, sorted by name."""
  global _CACHE
  if _CACHE is None:
    load_programs()
    by_kind: Dict[str, List[registry.Entry]] = {}
    for entry in registry.entries():
      if entry.sweep is not None:
        by_kind.setdefault(entry.sweep, []).append(entry)
    missing = sorted(set(by_kind) - set(PROGRAMS))
    if missing:
      raise ValueError(f'op_builders: registry entries name unknown sweep programs {missing}.')
    specs = [s for kind, entries in sorted(by_kind.items()) for s in PROGRAMS[kind](entries)]
    names = [s.name for s in specs]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
      raise ValueError(f'op_builders: duplicate spec names {duplicates}.')
    _CACHE = sorted(specs, key=lambda s: s.name)
  return list(_CACHE)


def specs_by_op_type() -> Dict[str, List[OpSpec]]:
  out: Dict[str, List[OpSpec]] = {}
  for s in op_specs():
    out.setdefault(s.op_type, []).append(s)
  return out
