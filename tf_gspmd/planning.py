"""`tg.plan`: what a step costs on a mesh of any size, without its devices or its weights.

`plan(fn, *arg_specs, mesh=...)` runs the same pipeline as `tg.partition` --
capture, propagate, partition -- on abstract shapes, and stops before anything
runs: arguments are `tf.TensorSpec`s, and variables are `abstract_variable`s
(a variable handle with a shape and dtype but no buffer), so no memory
proportional to the global model is ever allocated and no device of the mesh
needs to exist. The per-partition program is traced once (its size does not
depend on the number of partitions; see bench/partition_scaling.py), and the
report (`PlanReport`) reads per-device bytes and collectives off it:

* parameters: bytes of one device's shards of the trainable variables;
* optimizer state: bytes of one device's shards of the non-trainable variables
  the step touches (the optimizer's slots: declare them
  `abstract_variable(..., trainable=False)`; nothing is derived or assumed);
* activation peak: a liveness pass over the per-partition program (see
  `activation_peak`);
* collectives per step: kind, mesh axes and bytes of each, as `tg.partition`'s
  `collectives()` reports them (they come from the same partitioner);
* build time of each phase;
* with a `HardwareProfile` (`plan(..., profile=tg.TPU_V3)`), the step's predicted time on
  it (`step_time()`: contraction flops at the profile's rate, other ops' bytes at its
  memory bandwidth, collectives over its links; see `tf_gspmd.step_cost`).

Variables are sharded exactly as `tg.partition` would shard them (the layout
propagation gives them), so a plan of a mesh small enough to run can be checked
against the real partitioned function (tests/test_planning.py does, at N=8).
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from typing import Any, Dict, List, Optional

import numpy as np
import tensorflow as tf

from tf_gspmd import partitioned
from tf_gspmd.annotations import shard_variable
from tf_gspmd.graph_rewrite.partitioner import OpRecord
from tf_gspmd.mesh import Mesh
from tf_gspmd.partitioned.variables import mark_abstract
from tf_gspmd.propagation import registry
from tf_gspmd.sharding import NamedSharding
from tf_gspmd.step_cost import HardwareProfile, StepFeatures, StepTime, step_features, step_time

# UninitializedVariable is the only TF variable that has a shape and a dtype but never
# allocates its value (tf.Variable's public constructor always materializes an initial
# value, which for a planned 2048-way model would be tens of GB).
from tf_gspmd.tf_private import UninitializedVariable


def abstract_variable(
  shape, dtype=tf.float32, sharding=None, *, name: str = 'variable', trainable: bool = True
) -> tf.Variable:
  """A tf.Variable of `shape` and `dtype` with no value, for `plan`.

  `sharding`: a Sharding (or None: left to propagation), stored as
  `shard_variable` stores it. `trainable=False` marks optimizer state (slots).
  It never gets a buffer (an eager read finds none and gives an empty tensor);
  in a traced function it is a variable like any other.
  """
  var = UninitializedVariable(shape=shape, dtype=dtype, name=name, trainable=trainable)
  mark_abstract(var)  # tg.partition refuses it, naming it, instead of splitting nothing
  if sharding is not None:
    shard_variable(var, sharding)
  return var


@dataclasses.dataclass
class VariableBytes:
  """One variable of the plan: its layout and what it costs."""

  name: str
  shape: tuple
  dtype: str
  sharding: NamedSharding
  trainable: bool
  total: int  # bytes of the global value
  per_device: int  # bytes of one (ceil-sized) shard


@dataclasses.dataclass
class PlanReport:
  """What one step partitioned over `mesh` costs on each device; `str()` gives a table."""

  name: str
  mesh: Mesh
  variables: List[VariableBytes]
  activation_peak: int  # bytes, one device (see `activation_peak`)
  activation_tensors: int  # tensors the liveness pass counted
  collective_records: List[dict]
  seconds: Dict[str, float]  # build time per phase: capture, propagate, partition
  op_records: List[OpRecord] = dataclasses.field(default_factory=list, repr=False)
  propagation: Any = dataclasses.field(default=None, repr=False)  # tg.propagate's Propagation
  profile: Optional[HardwareProfile] = None  # what `step_time()` prices on by default

  def features(self, profile: Optional[HardwareProfile] = None) -> StepFeatures:
    """What one device does in the step: ops, contraction flops (their minor dims padded to
    `profile`'s vector width; default the plan's profile), other ops' bytes, collectives
    (`tf_gspmd.step_cost.step_features`)."""
    profile = profile or self.profile
    vector_bytes = profile.vector_bytes if profile is not None else 0
    found = self.__dict__.setdefault('_features', {})
    if vector_bytes not in found:
      found[vector_bytes] = step_features(
        self.propagation, self.mesh, self.collective_records, vector_bytes=vector_bytes
      )
    return found[vector_bytes]

  @property
  def plan(self):
    """Deprecated: the step's `Propagation` is `propagation`."""
    warnings.warn(
      'PlanReport.plan is deprecated and goes in the next release; use PlanReport.propagation.',
      DeprecationWarning,
      stacklevel=2,
    )
    return self.propagation

  def step_time(self, profile: Optional[HardwareProfile] = None) -> StepTime:
    """The step's predicted seconds, by term, on `profile` (default: the plan's own)."""
    profile = profile or self.profile
    if profile is None:
      raise ValueError('step_time: no profile; pass one, or plan with profile=...')
    return step_time(self.features(profile), profile)

  @property
  def parameter_bytes(self) -> int:
    """Bytes of one device's shards of the trainable variables."""
    return sum(v.per_device for v in self.variables if v.trainable)

  @property
  def optimizer_bytes(self) -> int:
    """Bytes of one device's shards of the non-trainable variables (optimizer slots)."""
    return sum(v.per_device for v in self.variables if not v.trainable)

  @property
  def global_parameter_bytes(self) -> int:
    return sum(v.total for v in self.variables if v.trainable)

  @property
  def collective_bytes(self) -> int:
    """Bytes one device's collectives carry per step (each collective's local operand)."""
    return sum(r['bytes'] for r in self.collective_records)

  @property
  def build_seconds(self) -> float:
    return sum(self.seconds.values())

  def collectives(self) -> List[dict]:
    """One record per collective per step: kind, axes, shape, dtype, bytes, op (as
    `PartitionedFunction.collectives()`)."""
    return [dict(r) for r in self.collective_records]

  def collective_summary(self) -> Dict[tuple, Dict[str, int]]:
    """(kind, axes) -> {'count', 'bytes'} over the step's collectives."""
    out: Dict[tuple, Dict[str, int]] = {}
    for r in self.collective_records:
      entry = out.setdefault((r['kind'], tuple(r['axes'])), {'count': 0, 'bytes': 0})
      entry['count'] += 1
      entry['bytes'] += r['bytes']
    return out

  def variable_bytes(self) -> Dict[str, Dict[str, int]]:
    """Per variable name: total and per-device bytes (as `PartitionedFunction.variable_bytes()`)."""
    out = {}
    for v in self.variables:
      name, k = v.name, 1
      while name in out:
        k += 1
        name = f'{v.name}#{k}'
      out[name] = {'total': v.total, 'per_device': v.per_device}
    return out

  def report(self, path) -> str:
    """Write one self-contained HTML page of this plan to `path` (as
    `PartitionedFunction.report`, plus the activation peak); returns the path.

    >>> tg.plan(step, *specs, mesh=mesh).report('plan.html')          # doctest: +SKIP
    'plan.html'
    """
    from tf_gspmd.pictures import sources

    return sources.write_report(self, path, 'plan')

  def __str__(self) -> str:
    axes = ' x '.join(f'{a}={s}' for a, s in self.mesh.shape.items())
    lines = [
      f'plan {self.name}: {self.mesh.size} devices ({axes}); built in '
      f'{self.build_seconds:.2f} s ('
      + ', '.join(f'{k} {v:.2f} s' for k, v in self.seconds.items())
      + ')',
      f'{"per device":<28}{"bytes":>16}{"global bytes":>18}',
    ]
    n_params = sum(v.trainable for v in self.variables)
    lines.append(
      f'{f"parameters ({n_params} vars)":<28}{_b(self.parameter_bytes):>16}'
      f'{_b(self.global_parameter_bytes):>18}'
    )
    lines.append(
      f'{f"optimizer state ({len(self.variables) - n_params} vars)":<28}'
      f'{_b(self.optimizer_bytes):>16}'
      f'{_b(sum(v.total for v in self.variables if not v.trainable)):>18}'
    )
    lines.append(f'{"activation peak":<28}{_b(self.activation_peak):>16}')
    total = self.parameter_bytes + self.optimizer_bytes + self.activation_peak
    lines.append(f'{"total":<28}{_b(total):>16}')
    lines.append(
      f'collectives per step: {len(self.collective_records)}, '
      f'{_b(self.collective_bytes)} bytes per device'
    )
    lines.append(f'  {"kind":<16}{"axes":<22}{"count":>6}{"bytes":>16}')
    for (kind, axes_of), entry in sorted(self.collective_summary().items()):
      lines.append(
        f'  {kind:<16}{",".join(axes_of):<22}{entry["count"]:>6}{_b(entry["bytes"]):>16}'
      )
    if self.profile is not None:
      t = self.step_time()
      lines.append(
        f'predicted step on {self.profile.name}: {t.total * 1e3:.3f} ms (contractions '
        f'{t.compute * 1e3:.3f}, memory {t.memory * 1e3:.3f}, launch {t.launch * 1e3:.3f}, '
        f'collectives {t.collectives * 1e3:.3f}), {t.utilization:.1%} of peak flops'
      )
    return '\n'.join(lines)


def _b(n: int) -> str:
  return f'{n:,}'


def plan(
  fn,
  *arg_specs,
  mesh: Mesh,
  in_shardings=None,
  out_shardings=None,
  profile: Optional[HardwareProfile] = None,
) -> PlanReport:
  """Capture, propagate and partition `fn` over `mesh` on abstract shapes; report its costs.

  `arg_specs`: `tf.TensorSpec`s of the global arguments (values work too);
  `in_shardings`/`out_shardings` as for `tg.partition`. The variables `fn` uses
  should be `abstract_variable`s (a variable with a value works, but its global
  value is then already in memory). Needs no devices: `mesh` may have 2048.
  `profile`: a `HardwareProfile` (e.g. `tg.TPU_V3`) the report's `step_time()` and its
  text price the step on.
  """
  if not isinstance(mesh, Mesh):
    raise TypeError(f'plan: mesh must be a tf_gspmd.Mesh, got {type(mesh).__name__}.')
  planner = _Planner(fn, mesh, in_shardings, out_shardings)
  start = time.perf_counter()
  compiled = planner.get_program(*arg_specs)
  traced = planner.trace(compiled)
  done = time.perf_counter()
  seconds = {
    'capture+propagate': planner.build_started - start,
    'partition': done - planner.build_started,
  }
  report = [
    _variable_bytes(v, planner.sharded_variables_of(compiled)[i])
    for i, v in enumerate(compiled.variables)
  ]
  peak, counted = activation_peak(traced.function.graph)
  return PlanReport(
    partitioned.name_of(fn),
    mesh,
    report,
    peak,
    counted,  # noqa: SLF001
    planner.collectives(),
    seconds,
    planner.op_records(),
    compiled.propagation,
    profile,
  )


class _AbstractShards:
  """What `tg.partition` keeps for a variable (a ShardedVariable), without any shard's value.

  Holds the layout and one shard-shaped variable with no buffer (`template`),
  which the per-partition program is traced with.
  """

  def __init__(self, variable, sharding: NamedSharding):
    self.sharding = sharding
    self.shape = tuple(int(s) for s in variable.shape)
    self.dtype = variable.dtype
    self.local_shape = tuple(sharding.shard_shape(self.shape))
    self.template = UninitializedVariable(
      shape=self.local_shape, dtype=variable.dtype, name=f'{variable.name.split(":")[0]}_shard'
    )


class _Planner(partitioned.PartitionedFunction):
  """`tg.partition`'s own capture, propagation and build, with abstract variable shards.

  Only how a variable's shards are made differs (no values: `_AbstractShards`),
  and the per-partition program is traced instead of run, so a plan cannot
  drift from what `tg.partition` builds.
  """

  build_started = 0.0

  def __init__(self, *args, **kwargs):
    super().__init__(*args, **kwargs)
    # Its own abstract shards, never a variable's real ones (a plan changes no state).
    self._sharded_variables = {}

  def _shard_variable(self, var, sharding, *unused):
    key = id(var)
    if key not in self._sharded_variables:
      self._originals[key] = var
      self._sharded_variables[key] = _AbstractShards(var, sharding)

  def _build(self, *args, **kwargs):
    self.build_started = time.perf_counter()
    return super()._build(*args, **kwargs)

  def sharded_variables_of(self, compiled) -> list:
    return [self._sharded_variables[id(v)] for v in compiled.variables]

  def trace(self, compiled):
    """The per-partition program traced for its local shapes (what each device would run)."""
    from tf_gspmd.runtime import trace_per_partition

    templates = [shards.template for shards in self.sharded_variables_of(compiled)]
    self._last = compiled
    return trace_per_partition(
      compiled.prepared.mesh,
      compiled.per_partition,
      list(compiled.local_specs) + templates,
      autograph=False,
      name=f'{partitioned.name_of(self.fn)}_plan',
    )


def _variable_bytes(variable, shards: _AbstractShards) -> VariableBytes:
  size = variable.dtype.size
  return VariableBytes(
    variable.name,
    shards.shape,
    variable.dtype.name,
    shards.sharding,
    bool(getattr(variable, 'trainable', True)),
    int(np.prod(shards.shape, dtype=np.int64)) * size,
    int(np.prod(shards.local_shape, dtype=np.int64)) * size,
  )


def activation_peak(graph: tf.Graph) -> tuple:
  """(peak bytes, tensors counted): the most local tensor bytes live at once in `graph`.

  The model: ops run in the graph's creation order (a topological order of a
  traced function); an op's outputs become live when it runs and die after
  their last consumer ran (outputs of the function live to the end). Live
  bytes are counted right after each op, so its inputs and outputs count
  together. Not counted: the function's own arguments (the local shards of
  the inputs: the caller holds them), variables (parameters and optimizer
  state, reported apart) and outputs of ops that alias another buffer
  (their registry entry's `aliasing`, e.g. a variable read), resources and variants, and tensors
  of unknown shape. Ops inside called functions and loop bodies count only
  through the call's outputs.
  """
  ops = graph.get_operations()
  position = {op: i for i, op in enumerate(ops)}
  outputs_of_graph = {id(t) for t in graph.outputs}
  last_use: Dict[int, int] = {}
  for i, op in enumerate(ops):
    for t in op.inputs:
      last_use[id(t)] = i
  dies_at: Dict[int, int] = {}
  born_at: Dict[int, int] = {}
  counted = 0
  for op in ops:
    if registry.entry_of(op.type).aliasing:
      continue
    for t in op.outputs:
      size = _tensor_bytes(t)
      if not size:
        continue
      counted += 1
      start = position[op]
      end = len(ops) if id(t) in outputs_of_graph else last_use.get(id(t), start)
      born_at[start] = born_at.get(start, 0) + size
      dies_at[end] = dies_at.get(end, 0) + size
  live = peak = 0
  for i in range(len(ops) + 1):
    live += born_at.get(i, 0)
    peak = max(peak, live)
    live -= dies_at.get(i, 0)
  return peak, counted


def _tensor_bytes(t: tf.Tensor) -> int:
  if t.dtype in (tf.resource, tf.variant, tf.string) or not t.shape.is_fully_defined():
    return 0
  return int(t.shape.num_elements()) * t.dtype.size
