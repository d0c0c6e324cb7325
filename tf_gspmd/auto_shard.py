"""`tg.auto_shard`: choose every variable's layout and the inputs' batch split under a memory budget.

`auto_shard(fn, *arg_specs, mesh=..., memory_budget=...)` searches layouts
with `tg.plan`: each candidate is planned (exact per-device bytes and the
step's collectives, from the same partitioner `tg.partition` runs), and the
cheapest one whose per-device bytes (parameters + optimizer state +
activation peak, as `PlanReport` counts them) fit `memory_budget` wins.

What is searched. Variables are grouped: an optimizer slot follows the
variable it is named after (Keras' `adam/<path>_momentum`, `<name>_m`), or
when not named after one, the same-shape trainable variable whose name
shares the longest prefix with its own (BatchNorm's moving statistics
follow its gamma); a lower-rank variable of the same layer whose shape is
the trailing dims of another's (a bias) takes that one's layout of those
dims; the rest group by (shape, dtype, name with digit runs stripped), so
the layers of a stack share one decision. A group's candidates are every
assignment of mesh-axis groups (each axis alone, or several in mesh order)
to its dims that divide them, each axis used once; the inputs' candidates
are their batch dim unsplit or split over such an axis group. Groups holding
less than `min_group_fraction` of the parameter bytes are left to
propagation (they follow their neighbours, as in a hand-written layout),
and so are scalars. Annotations the user wrote (`fixed`, `shard_variable`,
`tg.shard` inside `fn`) are constraints, never changed.

How. Coordinate descent over the groups (largest first, then the inputs):
each group tries all its candidates with the others held, and keeps the
best; sweeps repeat until one changes nothing or, within the budget, gains
less than 1% (a move gaining less than 0.1% is no move). After the first
sweep a group tries only the `SHORTLIST` options that were best in its last
try (the others lost by a wide margin there; this keeps the plans per sweep
near the group count).
Best, while over the budget: a layout that fits (the cheapest), else the one
paying the least cost per byte saved (the one saving the most bytes at any
price strands the walk far from the cheap layouts); once within it, the
cheapest that stays within. Candidates whose variables alone exceed what
they must beat are not planned. Two starts, the better end wins: data
parallelism, and the batch on the first mesh axis alone (from data
parallelism one move cannot take the batch off the model axes and split
weights over them); small searches also start from the batch unsplit. `search='exhaustive'` plans the product of all
candidates instead (small cases: it confirms the descent's optimum). Every
plan is memoized.

The cost model (seconds per step, one device's view)::

    cost = sum over collectives c of  latency[kind_c, g_c] + bytes_c * (g_c-1)/g_c / bw[kind_c, g_c]
         + (work / N + repeated_work) * 2 / matmul_flops

`g_c` is the number of devices of the collective's mesh axes, `bytes_c` its
local operand (as `collectives()` reports it). `work` is the step's
iteration space: for every op of the propagated program with a sharding
rule, the product of its rule's factor sizes (a matmul's multiply-adds, an
elementwise op's elements); `repeated_work` is what one device computes
beyond its 1/N share because an operand is replicated over an axis (the
space over the devices that split it -- the mesh axes its operands and
results shard its factors over -- minus the space over N). The constants come from
`calibrate()` on this machine (all-reduce, all-gather, reduce-scatter and
all-to-all over 2/4/8 logical CPU devices, and matmul flops), stored as JSON
in the user cache dir; `DEFAULT_CONSTANTS_FILE` holds those measured where
the package was written. Permutes use all-to-all's constants.

>>> result = tg.auto_shard(step, *specs, mesh=mesh, memory_budget=200_000)   # doctest: +SKIP
>>> print(result.report())                                                # doctest: +SKIP
>>> result.layout_map.apply(model)                                        # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
import re
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf

from tf_gspmd import annotations
from tf_gspmd.graph.capture import capture
from tf_gspmd.keras_layout import LayoutMap
from tf_gspmd.mesh import Mesh
from tf_gspmd.planning import PlanReport, plan
from tf_gspmd.sharding import NamedSharding, P, Sharding, named_for_rank

AUTO = 'auto'  # a group left to propagation
TIE = 1e-3  # relative cost difference below which the descent does not move
SWEEP_GAIN = 0.01  # a sweep (within the budget) gaining less than this is the last one
SHORTLIST = 4  # after the first sweep a group tries only its best options of the last one
SMALL_SEARCH = 32  # candidates a sweep up to which a third start (batch unsplit) is cheap
KINDS = ('all_reduce', 'all_gather', 'reduce_scatter', 'all_to_all')
DEFAULT_CONSTANTS_FILE = os.path.join(os.path.dirname(__file__), 'auto_shard_constants.json')


# --- the cost model's constants ------------------------------------------------------------
@dataclasses.dataclass
class Constants:
  """Measured collective latency (s) and bandwidth (bytes/s) per kind and group size; flops/s."""

  collectives: Dict[str, Dict[int, Tuple[float, float]]]  # kind -> g -> (latency, bandwidth)
  matmul_flops: float
  source: str = ''

  def collective_seconds(self, kind: str, group: int, nbytes: int) -> float:
    table = self.collectives.get(kind) or self.collectives['all_to_all']
    latency, bandwidth = table[_nearest(table, group)]
    return latency + nbytes * (group - 1) / group / bandwidth

  def to_json(self) -> dict:
    return {
      'collectives': {
        k: {str(g): list(v) for g, v in t.items()} for k, t in self.collectives.items()
      },
      'matmul_flops': self.matmul_flops,
      'source': self.source,
    }

  @classmethod
  def from_json(cls, data: dict) -> 'Constants':
    table = {k: {int(g): tuple(v) for g, v in t.items()} for k, t in data['collectives'].items()}
    return cls(table, float(data['matmul_flops']), data.get('source', ''))


def _nearest(table: dict, group: int) -> int:
  """The measured group size closest to `group` on a log scale (2048 uses the largest)."""
  return min(table, key=lambda g: abs(math.log(g) - math.log(max(group, 2))))


def constants_path() -> str:
  """Where `calibrate()` stores its measurement: $TF_GSPMD_CACHE or ~/.cache/tf_gspmd."""
  root = os.environ.get('TF_GSPMD_CACHE') or os.path.join(
    os.path.expanduser('~'), '.cache', 'tf_gspmd'
  )
  return os.path.join(root, 'auto_shard_constants.json')


def load_constants() -> Constants:
  """This machine's calibration when `calibrate()` ran here, else the shipped defaults."""
  for path in (constants_path(), DEFAULT_CONSTANTS_FILE):
    if os.path.exists(path):
      with open(path) as f:
        return Constants.from_json(json.load(f))
  raise FileNotFoundError(
    f'auto_shard: no constants at {constants_path()} or '
    f'{DEFAULT_CONSTANTS_FILE}; run tf_gspmd.auto_shard.calibrate().'
  )


def calibrate(
  groups: Sequence[int] = (2, 4, 8), path: Optional[str] = None, repeats: int = 9
) -> Constants:
  """Measure collective latency/bandwidth over `groups` logical CPU devices and matmul flops.

  Each kind runs `_CHAIN` times inside one SPMD program (as a step's
  collectives do), at a small and a large size, against the same program
  without the collective; the per-collective difference at the small size is
  the latency, the slope between the sizes the bandwidth (in the model's
  bytes * (g-1)/g). Needs max(groups) logical devices. Stores JSON at `path`
  (default `constants_path()`) and returns the constants.
  """
  table = {kind: {g: _latency_and_bandwidth(kind, g, repeats) for g in groups} for kind in KINDS}
  measured = Constants(table, _matmul_flops(max(groups)), source=f'calibrate() {time.ctime()}')
  path = path or constants_path()
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, 'w') as f:
    json.dump(measured.to_json(), f, indent=1)
  return measured


_CHAIN = 8  # collectives per measured program
_SIZES = (64, 256 * 1024)  # float32 elements of one device's operand: 256 B, 1 MB


def _latency_and_bandwidth(kind: str, group: int, repeats: int) -> Tuple[float, float]:
  seconds = {n: _collective_seconds(kind, group, n, repeats) for n in _SIZES}
  small, large = _SIZES
  latency = max(seconds[small], 1e-7)
  moved = (large - small) * 4 * (group - 1) / group
  bandwidth = moved / max(seconds[large] - seconds[small], 1e-9)
  return latency, bandwidth


def _collective_seconds(kind: str, group: int, elements: int, repeats: int) -> float:
  """Seconds one collective of `kind` adds to a program, operand `elements` floats per device."""
  from tf_gspmd.runtime import ShardedValue, SpmdProgram, split
  from tf_gspmd.runtime.launcher import default_devices

  mesh = Mesh.create((group,), ('d',))
  sharding = NamedSharding(mesh, P('d'))
  with_it = SpmdProgram(mesh, _chained(kind, True), [sharding], keep_sharded=True)
  without = SpmdProgram(mesh, _chained(kind, False), [sharding], keep_sharded=True)
  value = np.ones(elements * group, np.float32)
  x = ShardedValue(split(value, sharding, default_devices(group)), sharding, value.shape)
  return (_median_call(with_it, x, repeats) - _median_call(without, x, repeats)) / _CHAIN


def _chained(kind: str, collective: bool):
  def run(ctx, x):
    c, total = ctx.collectives, tf.zeros([])
    for i in range(_CHAIN):
      y = x + float(i)
      if collective:
        y = _one(c, kind, y)
      total += y[0]
    return total

  return run


def _one(c, kind: str, y):
  if kind == 'all_reduce':
    return c.all_reduce(y, ('d',))
  if kind == 'all_gather':
    return c.all_gather(y, ('d',), 0)
  if kind == 'reduce_scatter':
    return c.reduce_scatter(y, ('d',), 0)
  return c.all_to_all(y, ('d',), 0, 0)


def _median_call(program, x, repeats: int) -> float:
  program(x)  # build and warm up
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    out = program(x)
    np.asarray(out.shards[0] if hasattr(out, 'shards') else out)
    times.append(time.perf_counter() - start)
  return float(np.median(times))


def _matmul_flops(devices: int, n: int = 256, chain: int = 16, repeats: int = 9) -> float:
  """Flops/s of one device while all `devices` multiply at once (logical CPU devices share
  the machine's cores: what a device computes costs what the whole step pays for it)."""
  from tf_gspmd.runtime import SpmdProgram

  mesh = Mesh.create((devices,), ('d',))

  def run(ctx, x):
    del ctx
    for _ in range(chain):
      x = tf.matmul(x, x) * (1.0 / n)
    return x[0, 0]

  program = SpmdProgram(mesh, run, [None], keep_sharded=True)
  x = np.eye(n, dtype=np.float32)
  return 2.0 * n**3 * chain / _median_call(program, x, repeats)


# --- the variables and their groups ----------------------------------------------------------
@dataclasses.dataclass
class _Var:
  """One variable the step touches."""

  variable: Any  # the tf.Variable
  name: str  # Keras path or TF name without ':0'
  shape: tuple
  dtype: str
  trainable: bool

  @property
  def nbytes(self) -> int:
    return int(np.prod(self.shape, dtype=np.int64)) * tf.as_dtype(self.dtype).size

  @property
  def flat_name(self) -> str:
    return self.name.replace('/', '_')


@dataclasses.dataclass
class Group:
  """Variables that share one layout decision: members, and who follows them."""

  key: str  # the role: shape, dtype and name, digits stripped
  members: List[_Var]
  followers: List[Tuple[_Var, int]] = dataclasses.field(default_factory=list)  # (var, dims kept)
  candidates: List[Any] = dataclasses.field(default_factory=list)  # P specs, or AUTO
  fixed: Optional[P] = None  # the user's layout: not searched

  @property
  def nbytes(self) -> int:
    return sum(v.nbytes for v in self.members)

  @property
  def shape(self) -> tuple:
    return self.members[0].shape


INPUTS = '<inputs: batch dim>'


def _variables_of(fn, arg_specs) -> List[_Var]:
  program = capture(fn, *arg_specs)
  out = []
  for var in program.variables.values():
    name = getattr(var, 'path', None) or var.name.split(':')[0]
    out.append(
      _Var(
        var,
        name,
        tuple(int(d) for d in var.shape),
        var.dtype.name,
        bool(getattr(var, 'trainable', True)),
      )
    )
  return out


def _leader_of(slot: _Var, candidates: List[_Var]) -> Optional[_Var]:
  """The variable `slot` is optimizer state of: named after it, else same shape and prefix."""
  named = [
    v
    for v in candidates
    if v is not slot
    and v.shape == slot.shape
    and re.search(rf'(^|_){re.escape(v.flat_name)}(_|$)', slot.flat_name)
  ]
  if named:
    return max(named, key=lambda v: len(v.flat_name))
  if slot.trainable:
    return None
  same = [v for v in candidates if v.trainable and v.shape == slot.shape]
  return max(same, key=lambda v: len(os.path.commonprefix([v.name, slot.name])), default=None)


def _owner_of(var: _Var, leaders: List[_Var]) -> Optional[_Var]:
  """The variable of the same layer whose trailing dims `var` is (a bias of its kernel)."""
  parent = var.name.rsplit('/', 1)[0] if '/' in var.name else None
  if parent is None:
    return None
  owners = [
    v
    for v in leaders
    if len(v.shape) > len(var.shape)
    and v.shape[len(v.shape) - len(var.shape) :] == var.shape
    and v.name.rsplit('/', 1)[0] == parent
  ]
  return owners[0] if owners else None


def _role(var: _Var) -> str:
  """What the variable is, whatever its layer: digit runs stripped, and the name of its
  sub-layer (`attn_0/query/kernel`, `layer0_wq`) too, so the same-shaped projections of
  one kind of layer (query, key, value) decide together."""
  parts = re.sub(r'[0-9]+', '#', var.name).split('/')
  if len(parts) >= 3:
    parts[-2] = '*'
  elif len(parts) == 1 and '_' in parts[0]:
    parts[0] = parts[0].rsplit('_', 1)[0] + '_*'
  return f'{"/".join(parts)} {list(var.shape)} {var.dtype}'


def group_variables(variables: List[_Var], fixed: Optional[Dict[int, Any]] = None) -> List[Group]:
  """Groups of layout decisions: slots follow their variable, biases their kernel.

  `fixed`: id(_Var) -> the user's layout; such a variable is a group of
  its own (its slots follow it), or, when it is a slot, left alone.
  """
  fixed = fixed or {}
  leaders, slots = [], []
  for var in variables:
    first_of_name = all(v.name != var.name for v in leaders)
    if var.trainable and first_of_name:
      leaders.append(var)
    else:
      slots.append(var)
  follows: Dict[int, Tuple[_Var, Optional[int]]] = {}
  for slot in slots:
    leader = _leader_of(slot, leaders)
    if id(slot) in fixed and leader is not None:
      continue  # the user laid this slot out: it keeps that
    if leader is None:
      leaders.append(slot)
    else:
      follows[id(slot)] = (leader, None)
  owned = {}
  for var in list(leaders):
    owner = None if id(var) in fixed else _owner_of(var, leaders)
    if owner is not None:
      owned[id(var)] = owner
  groups: Dict[str, Group] = {}
  for var in leaders:
    if id(var) in owned or not var.shape:
      continue
    role = f'{var.name} (fixed)' if id(var) in fixed else _role(var)
    groups.setdefault(role, Group(role, [], fixed=fixed.get(id(var)))).members.append(var)
  by_var = {id(v): g for g in groups.values() for v in g.members}
  for var in leaders:
    if id(var) in owned:
      by_var[id(owned[id(var)])].followers.append((var, len(var.shape)))
      by_var[id(var)] = by_var[id(owned[id(var)])]
  for slot in slots:
    leader = follows.get(id(slot), (None,))[0]
    if leader is not None and id(leader) in by_var:
      rank = len(slot.shape) if id(leader) in owned else None
      by_var[id(leader)].followers.append((slot, rank))
  return sorted(groups.values(), key=lambda g: -g.nbytes)


# --- candidates ---------------------------------------------------------------------------------
def axis_groups(mesh: Mesh) -> List[Tuple[str, ...]]:
  """Every non-empty set of mesh axes, in mesh order: what one dim may be split over."""
  names = list(mesh.axis_names)
  return [tuple(c) for k in range(1, len(names) + 1) for c in itertools.combinations(names, k)]


def spec_candidates(shape: tuple, mesh: Mesh) -> List[P]:
  """Every spec splitting dims of `shape` over disjoint axis groups that divide them."""
  options = [[None] + [g for g in axis_groups(mesh) if _divides(mesh, g, d)] for d in shape]
  out = []
  for choice in itertools.product(*options):
    used = [a for g in choice if g for a in g]
    if len(used) == len(set(used)):
      out.append(P(*[None if g is None else (g[0] if len(g) == 1 else g) for g in choice]))
  return out


def _divides(mesh: Mesh, axes: Tuple[str, ...], size: int) -> bool:
  n = int(np.prod([mesh.axis_size(a) for a in axes]))
  return size >= n and size % n == 0


def _input_candidates(arg_specs, mesh: Mesh) -> List[Optional[Tuple[str, ...]]]:
  batches = [int(s.shape[0]) for s in arg_specs if len(s.shape)]
  return [None] + [g for g in axis_groups(mesh) if all(_divides(mesh, g, b) for b in batches)]


# --- evaluating a layout: plan it, price it -------------------------------------------------------
@dataclasses.dataclass
class Evaluation:
  """One planned layout and the cost model's terms."""

  choice: tuple  # per group: a P or AUTO; last: the inputs' batch axes (or None)
  report: PlanReport
  memory: int  # per-device bytes: parameters + optimizer state + activation peak
  collective_seconds: float
  collective_bytes: Dict[str, int]  # per kind, one device, per step
  repeated_work: int  # iteration-space points each device computes beyond its 1/N
  compute_seconds: float  # all the points one device computes, at the matmul rate

  @property
  def cost(self) -> float:
    return self.collective_seconds + self.compute_seconds

  def overflow(self, budget: int) -> int:
    return max(0, self.memory - budget)

  def key(self, budget: int) -> tuple:
    """Smaller is better: over the budget by less, then cheaper."""
    return (self.overflow(budget), self.cost)


def _axes_size(mesh: Mesh, axes) -> int:
  from tf_gspmd.graph_rewrite.reshard import refined_mesh

  names = set(mesh.axis_names)
  source = mesh if all(a in names for a in axes) else refined_mesh(mesh)[0]
  return int(np.prod([source.axis_size(a) for a in axes], dtype=np.int64))


def collective_cost(report: PlanReport, constants: Constants) -> Tuple[float, Dict[str, int]]:
  """(seconds, bytes per kind) of the step's collectives under the cost model."""
  seconds, by_kind = 0.0, {}
  for rec in report.collective_records:
    group = _axes_size(report.mesh, rec['axes'])
    seconds += constants.collective_seconds(rec['kind'], group, rec['bytes'])
    by_kind[rec['kind']] = by_kind.get(rec['kind'], 0) + rec['bytes']
  return seconds, by_kind


def work_per_device(propagation_plan, mesh: Mesh) -> Tuple[int, int]:
  """(points, repeated points) of iteration space one device computes, over every ruled op.

  An op's iteration space is the product of its rule's factor sizes (one
  space per group of factors joined by a tensor); it is split over the mesh
  axes its operands' and results' shardings give its factors
  (`OpRule.factor_axes`, the partitioner's own merge); a factor nobody
  splits is computed whole on every device. Repeated: beyond the 1/N share.
  """
  result, local_total, repeated = propagation_plan.result, 0.0, 0.0
  for graph in propagation_plan.program.graphs():
    shardings = result.shardings.get(graph.name, {})
    for node in graph.nodes:
      rule = result.rule(node.name, graph.name)
      if rule is None:
        continue
      tensors = list(node.inputs) + [o.name for o in node.outputs]
      sizes = _factor_sizes(rule, [graph.tensor(t).shape for t in tensors])
      if not sizes:
        continue
      axes = rule.factor_axes([_per_dim_axes(shardings.get(t)) for t in tensors], result.mesh)
      for space in _independent_spaces(rule, sizes):
        work = float(np.prod([sizes[f] for f in space], dtype=np.float64))
        local = float(
          np.prod(
            [-(-sizes[f] // _axes_size(result.mesh, axes.get(f, ()))) for f in space],
            dtype=np.float64,
          )
        )
        local_total += local
        repeated += max(0.0, local - work / mesh.size)
  return int(local_total), int(repeated)


def estimate(
  report: PlanReport, constants: Optional[Constants] = None, choice: tuple = ()
) -> 'Evaluation':
  """The cost model's terms for one planned step (see the module doc)."""
  constants = constants or load_constants()
  seconds, by_kind = collective_cost(report, constants)
  local, repeated = work_per_device(report.plan, report.mesh)
  memory = report.parameter_bytes + report.optimizer_bytes + report.activation_peak
  return Evaluation(
    choice, report, memory, seconds, by_kind, repeated, 2.0 * local / constants.matmul_flops
  )


def _independent_spaces(rule, sizes: Dict[str, int]) -> List[List[str]]:
  """Factors joined by a common tensor: one iteration space each (IdentityN's operands are
  several independent spaces, a matmul's one)."""
  from tf_gspmd.propagation.rule import dim_factors

  root = {f: f for f in sizes}

  def find(f):
    while root[f] != f:
      f = root[f]
    return f

  for dims in rule.tensor_dims():
    present = [f for e in dims or () for f in dim_factors(e) if f in sizes]
    for f in present[1:]:
      root[find(f)] = find(present[0])
  spaces: Dict[str, List[str]] = {}
  for f in sizes:
    spaces.setdefault(find(f), []).append(f)
  return list(spaces.values())


def _factor_sizes(rule, shapes) -> Dict[str, int]:
  from tf_gspmd.propagation.rule import dim_factors

  sizes = {}
  for dims, shape in zip(rule.tensor_dims(), shapes):
    if dims is None or shape is None or len(shape) != len(dims):
      continue
    for entry, size in zip(dims, shape):
      factors = dim_factors(entry)
      if len(factors) == 1 and size is not None:
        sizes.setdefault(factors[0], int(size))
      for f in factors[1:] if len(factors) > 1 else ():
        if rule.size(f):
          sizes.setdefault(f, int(rule.size(f)))
      if len(factors) > 1 and rule.size(factors[0]):
        sizes.setdefault(factors[0], int(rule.size(factors[0])))
  return sizes


def _per_dim_axes(sharding) -> Optional[list]:
  if not isinstance(sharding, NamedSharding) or sharding.rank is None:
    return None
  return [tuple(sharding.spec.axes_of(d)) for d in range(sharding.rank)]


class _Search:
  """Plans layouts of `fn` (memoized) and walks the candidates."""

  def __init__(
    self,
    fn,
    arg_specs,
    mesh: Mesh,
    budget: int,
    groups: List[Group],
    inputs: list,
    constants: Constants,
  ):
    self.fn, self.arg_specs, self.mesh, self.budget = fn, list(arg_specs), mesh, budget
    self.groups, self.inputs, self.constants = groups, inputs, constants
    self.seen: Dict[tuple, Evaluation] = {}

  @property
  def spaces(self) -> List[list]:
    return [g.candidates for g in self.groups] + [self.inputs]

  def evaluate(self, choice: tuple) -> Evaluation:
    if choice not in self.seen:
      self._annotate(choice)
      report = plan(
        self.fn, *self.arg_specs, mesh=self.mesh, in_shardings=self.input_shardings(choice[-1])
      )
      self.seen[choice] = estimate(report, self.constants, choice)
    return self.seen[choice]

  def better(self, a: Evaluation, b: Evaluation) -> bool:
    return a.key(self.budget) < b.key(self.budget)

  def input_shardings(self, axes) -> list:
    out = []
    for spec in self.arg_specs:
      rank = len(spec.shape)
      head = (axes if axes is None or len(axes) > 1 else axes[0],) if rank else ()
      out.append(NamedSharding(self.mesh, P(*head, *([None] * (rank - 1)))))
    return out

  def _annotate(self, choice: tuple) -> None:
    for group, spec in zip(self.groups, choice):
      spec = group.fixed if group.fixed is not None else spec
      for var in group.members:
        _set_layout(var.variable, self.mesh, spec)
      for var, rank in group.followers:
        _set_layout(
          var.variable,
          self.mesh,
          spec if rank is None or spec is AUTO else _trailing(spec, len(group.shape), rank),
        )

  # --- the two searches ------------------------------------------------------------------------
  def descend(self, starts: List[tuple]) -> Evaluation:
    """The best of the descents from `starts`."""
    ends = [self._descend(start) for start in starts]
    return min(ends, key=lambda e: e.key(self.budget))

  def _descend(self, start: tuple, max_sweeps: int = 4) -> Evaluation:
    """Coordinate descent: each group (then the inputs) takes its best candidate, others held.

    Best, while the layout is over the budget: one that fits (the cheapest), else the
    one paying the least cost per byte saved (a move saving the most bytes at any
    price strands the walk far from the cheap layouts); once it fits, the cheapest
    that still fits. Candidates whose variables alone rule them out are not planned.
    """
    best = self.evaluate(start)
    order = list(range(len(self.groups))) + [len(self.groups)]
    shortlist = {i: list(self.spaces[i]) for i in order}
    for _ in range(max_sweeps):
      before = best
      for i in order:
        choices = [best.choice[:i] + (option,) + best.choice[i + 1 :] for option in shortlist[i]]
        trials = [
          self.evaluate(c) for c in choices if c != best.choice and not self.cannot_beat(c, best)
        ]
        shortlist[i] = self._shortlist(best, i, trials)
        best = self._pick(best, trials)
      settled = before.memory <= self.budget and best.cost > before.cost * (1 - SWEEP_GAIN)
      if best is before or settled:
        break
    return best

  def _shortlist(self, best: Evaluation, i: int, trials: List[Evaluation]) -> list:
    """Group `i`'s options the next sweeps try: the best ones of this sweep by the budget
    and by cost alone, SHORTLIST in all (while over the budget the cheap options rank
    last by the budget, yet one of them is often best once the rest fits)."""
    tried = trials + [best]
    by_budget = sorted(tried, key=lambda e: e.key(self.budget))
    by_cost = sorted(tried, key=lambda e: e.cost)
    half = SHORTLIST // 2
    ranked = by_budget[:half] + by_cost[:half] + by_budget[half:]
    return list(dict.fromkeys(e.choice[i] for e in ranked))[:SHORTLIST]

  def _pick(self, best: Evaluation, trials: List[Evaluation]) -> Evaluation:
    fitting = [t for t in trials if t.memory <= self.budget]
    if best.memory <= self.budget or fitting:
      cheapest = min(fitting + [best], key=lambda e: e.key(self.budget))
      # A near tie (within TIE of the cost) is no move: it would only add sweeps.
      keep = best.memory <= self.budget and cheapest.cost > best.cost * (1 - TIE)
      return best if keep else cheapest
    saving = [t for t in trials if t.memory < best.memory]
    if not saving:
      return best
    return min(saving, key=lambda t: ((t.cost - best.cost) / (best.memory - t.memory), t.cost))

  def cannot_beat(self, choice: tuple, best: Evaluation) -> bool:
    """True when `choice`'s variables alone (exact bytes, no plan needed) rule it out: they
    exceed the budget a fitting `best` meets, or the bytes an overflowing `best` needs."""
    bound = sum(self.variable_bytes(i, spec) for i, spec in enumerate(choice[:-1]))
    return bound > (self.budget if best.memory <= self.budget else best.memory)

  def variable_bytes(self, i: int, spec) -> int:
    """Per-device bytes of group `i`'s members and followers under `spec` (0 when left to
    propagation: unknown until planned)."""
    group = self.groups[i]
    spec = group.fixed if group.fixed is not None else spec
    if spec is AUTO:
      return 0
    total = 0
    for var, rank in [(v, None) for v in group.members] + group.followers:
      kept = (
        spec
        if rank is None or isinstance(spec, Sharding)
        else _trailing(spec, len(group.shape), rank)
      )
      sharding = kept if isinstance(kept, Sharding) else NamedSharding(self.mesh, kept)
      size = tf.as_dtype(var.dtype).size
      total += int(np.prod(sharding.shard_shape(var.shape), dtype=np.int64)) * size
    return total

  def exhaustive(self) -> Evaluation:
    best = None
    for choice in itertools.product(*self.spaces):
      trial = self.evaluate(tuple(choice))
      if best is None or self.better(trial, best):
        best = trial
    return best

  def runner_up(self, best: Evaluation) -> Optional[Evaluation]:
    others = [e for e in self.seen.values() if e.choice != best.choice]
    return min(others, key=lambda e: e.key(self.budget), default=None)

  def group_runner_up(self, best: Evaluation, i: int) -> Optional[Evaluation]:
    """The best planned layout that differs from `best` in group `i` only."""
    others = [
      e
      for e in self.seen.values()
      if e.choice[i] != best.choice[i]
      and all(a == b for j, (a, b) in enumerate(zip(e.choice, best.choice)) if j != i)
    ]
    return min(others, key=lambda e: e.key(self.budget), default=None)


def _trailing(spec: P, rank: int, kept: int) -> P:
  entries = list(spec) + [None] * (rank - len(spec))
  return P(*entries[rank - kept :])


def _set_layout(variable, mesh: Mesh, spec) -> None:
  if spec is AUTO:
    _clear_layout(variable)
  elif isinstance(spec, Sharding):
    annotations.shard_variable(variable, spec)
  else:
    annotations.shard_variable(variable, mesh, spec)


def _clear_layout(variable) -> None:
  """No annotation at all: propagation decides (TF's own proto and tf_gspmd's attribute)."""
  setattr(variable, annotations._VARIABLE_ATTR, None)  # noqa: SLF001
  if hasattr(variable, '_set_xla_sharding'):
    variable._set_xla_sharding(None)  # noqa: SLF001


# --- the entry point ------------------------------------------------------------------------------
def auto_shard(
  fn,
  *arg_specs,
  mesh: Mesh,
  memory_budget: int,
  fixed: Optional[dict] = None,
  search: str = 'descent',
  constants: Optional[Constants] = None,
  min_group_fraction: float = 0.01,
) -> 'AutoShardResult':
  """Choose a layout for every variable of `fn` and the inputs' batch dim (see the module doc).

  `arg_specs`: `tf.TensorSpec`s (or values) of `fn`'s tensor arguments, dim 0
  the batch. `memory_budget`: bytes one device may hold (parameters +
  optimizer state + activation peak). `fixed`: {variable name or regex: P or
  Sharding} the search must keep (as are `shard_variable` annotations already
  on the variables and `tg.shard` inside `fn`). `search`: 'descent'
  (coordinate descent, scales with distinct layers) or 'exhaustive' (every
  combination: small cases). The variables' own annotations are restored
  afterwards; apply the result with `.layout_map` or `.shardings`.
  Raises a ValueError naming the smallest per-device bytes found when no
  layout fits.
  """
  if search not in ('descent', 'exhaustive'):
    raise ValueError(f"auto_shard: search must be 'descent' or 'exhaustive', got {search!r}.")
  started = time.perf_counter()
  variables = _variables_of(fn, arg_specs)
  saved = {id(v.variable): annotations.variable_sharding(v.variable) for v in variables}
  groups = group_variables(variables, _fixed_layouts(variables, saved, fixed))
  _give_candidates(groups, mesh, min_group_fraction)
  inputs = _input_candidates(arg_specs, mesh)
  searcher = _Search(
    fn, arg_specs, mesh, int(memory_budget), groups, inputs, constants or load_constants()
  )
  try:
    best = (
      searcher.exhaustive() if search == 'exhaustive' else searcher.descend(_starts(groups, inputs))
    )
  finally:
    for var in variables:
      _set_layout(
        var.variable, mesh, AUTO if saved[id(var.variable)] is None else saved[id(var.variable)]
      )
  if best.overflow(searcher.budget):
    raise ValueError(
      f'auto_shard: no layout of {len(groups)} variable groups over {mesh.size} devices fits '
      f'{searcher.budget:,} bytes per device; the smallest found needs {best.memory:,} bytes '
      f'(parameters {best.report.parameter_bytes:,} + optimizer state '
      f'{best.report.optimizer_bytes:,} + activation peak {best.report.activation_peak:,}). '
      'Raise the budget, use a larger mesh or a smaller batch.'
    )
  return AutoShardResult(
    mesh, searcher.budget, best, searcher, variables, search, time.perf_counter() - started
  )


def _fixed_layouts(variables: List[_Var], saved: dict, fixed: Optional[dict]) -> Dict[int, Any]:
  """id(_Var) -> the layout the user gave it (annotation, or a `fixed` pattern)."""
  out = {id(v): saved[id(v.variable)] for v in variables if saved[id(v.variable)] is not None}
  for pattern, layout in (fixed or {}).items():
    layout = layout if isinstance(layout, (P, Sharding)) else P(*layout)
    matched = [v for v in variables if re.fullmatch(pattern, v.name) or v.name == pattern]
    if not matched:
      raise ValueError(
        f'auto_shard: fixed layout {pattern!r} matches no variable of the step '
        f'(names: {sorted(v.name for v in variables)[:8]} ...).'
      )
    for var in matched:
      out[id(var)] = layout
  return out


def _starts(groups: List[Group], inputs: list) -> List[tuple]:
  """Variables replicated, the batch split over the most devices (data parallelism) or over
  the first axis group only (a batch axis beside model axes): a descent moves one group at
  a time, and from data parallelism alone it cannot take the batch off the model axes and
  split the weights over them in one move. A small search (at most SMALL_SEARCH
  candidates a sweep) also starts from the batch unsplit."""
  replicated = tuple(g.candidates[0] for g in groups)
  split = inputs[1:] or [None]
  most = max(split, key=lambda axes: len(axes or ()))
  small = sum(len(g.candidates) for g in groups) + len(inputs) <= SMALL_SEARCH
  batches = [most, split[0]] + ([None] if small else [])
  return [replicated + (axes,) for axes in dict.fromkeys(batches)]


def _give_candidates(groups: List[Group], mesh: Mesh, min_fraction: float) -> None:
  """Searched specs per group (replicated first); small groups are left to propagation."""
  total = sum(g.nbytes for g in groups)
  for group in groups:
    if group.fixed is not None:
      group.candidates = [group.fixed]
    elif group.nbytes < min_fraction * total:
      group.candidates = [AUTO]
    else:
      group.candidates = spec_candidates(group.shape, mesh)


# --- the result -------------------------------------------------------------------------------------
class AutoShardResult:
  """What `auto_shard` chose: layouts, input shardings, and `report()` saying why."""

  def __init__(
    self,
    mesh: Mesh,
    budget: int,
    best: Evaluation,
    searcher: _Search,
    variables: List[_Var],
    search: str,
    seconds: float,
  ):
    self.mesh, self.budget, self.best, self.search = mesh, budget, best, search
    self._searcher, self._variables, self.seconds = searcher, variables, seconds
    self.groups = searcher.groups
    self.runner_up = searcher.runner_up(best)
    names = {v.variable.name: v.name for v in variables}
    self.shardings: Dict[str, NamedSharding] = {
      names.get(v.name, v.name): v.sharding for v in best.report.variables
    }
    self.input_shardings: List[NamedSharding] = searcher.input_shardings(best.choice[-1])

  @property
  def plan_report(self) -> PlanReport:
    return self.best.report

  @property
  def evaluations(self) -> int:
    """Layouts planned."""
    return len(self._searcher.seen)

  @property
  def model_shardings(self) -> Dict[str, NamedSharding]:
    """`shardings` without optimizer state: slots follow their variable by propagation."""
    model = {v.name for g in self.groups for v in g.members}
    model |= {v.name for g in self.groups for v, rank in g.followers if rank is not None}
    return {n: s for n, s in self.shardings.items() if n in model}

  @property
  def layout_map(self) -> LayoutMap:
    """One rule per model variable (its exact name): `.apply(model)` annotates a Keras model."""
    layout = LayoutMap(self.mesh)
    for name, sharding in self.model_shardings.items():
      layout[re.escape(name)] = sharding.spec
    return layout

  def apply(self) -> None:
    """Annotate every variable of the step with its chosen sharding (`shard_variable`)."""
    by_name = {v.name: v.variable for v in self._variables}
    for name, sharding in self.shardings.items():
      annotations.shard_variable(by_name[name], self.mesh, sharding.spec)

  def keras_layout_map(self):
    """A `keras.distribution.LayoutMap` keyed by variable path, on a DeviceMesh of this mesh."""
    import keras

    device_mesh = keras.distribution.DeviceMesh(
      tuple(self.mesh.shape.values()),
      list(self.mesh.axis_names),
      [f'cpu:{d}' for d in np.ravel(self.mesh.device_ids)],
    )
    layout = keras.distribution.LayoutMap(device_mesh)
    for name, sharding in self.model_shardings.items():
      layout[name] = tuple(sharding.spec) + (None,) * (sharding.rank - len(sharding.spec))
    return layout

  def layout_of(self, name: str) -> P:
    return self.shardings[name].spec

  def report(self) -> str:
    return _format_report(self)

  def __str__(self) -> str:
    return self.report()


def _format_report(result: AutoShardResult) -> str:
  best, budget, mesh = result.best, result.budget, result.mesh
  axes = ' x '.join(f'{a}={s}' for a, s in mesh.shape.items())
  lines = [
    f'auto_shard {best.report.name}: {mesh.size} devices ({axes}), budget '
    f'{budget:,} bytes per device; {result.evaluations} layouts planned in '
    f'{result.seconds:.1f} s ({result.search})',
    f'chosen: {_summary(best, budget)}',
    f'  {_terms(best)}',
  ]
  if result.runner_up is not None:
    lines += [
      f'runner-up: {_summary(result.runner_up, budget)}',
      f'  differs in: {_difference(result, result.runner_up)}',
    ]
  lines.append(f'{"group":<40}{"vars":>5}  {"chosen":<26}runner-up (cost, bytes per device)')
  for i, group in enumerate(result.groups + [None]):
    name = INPUTS if group is None else group.key
    count = '' if group is None else str(len(group.members) + len(group.followers))
    other = result._searcher.group_runner_up(best, i)  # noqa: SLF001
    alt = (
      '-'
      if other is None
      else (
        f'{_spec_text(other.choice[i])} ({_ms(other.cost)}, '
        f'{other.memory:,}{"" if other.memory <= budget else " over"})'
      )
    )
    lines.append(f'{name[:39]:<40}{count:>5}  {_spec_text(best.choice[i]):<26}{alt}')
  return '\n'.join(lines)


def _summary(e: Evaluation, budget: int) -> str:
  r = e.report
  fits = 'fits' if e.memory <= budget else 'over budget'
  return (
    f'predicted {_ms(e.cost)} per step; {e.memory:,} bytes per device ({fits}: '
    f'parameters {r.parameter_bytes:,} + optimizer {r.optimizer_bytes:,} + activations '
    f'{r.activation_peak:,})'
  )


def _terms(e: Evaluation) -> str:
  kinds = ', '.join(f'{k} {b:,}' for k, b in sorted(e.collective_bytes.items())) or 'none'
  return (
    f'collectives {_ms(e.collective_seconds)}: {len(e.report.collective_records)} per '
    f'step, bytes {kinds}; compute {_ms(e.compute_seconds)} of which repeated work '
    f'{e.repeated_work:,} points'
  )


def _difference(result: AutoShardResult, other: Evaluation) -> str:
  names = [g.key for g in result.groups] + [INPUTS]
  diffs = [
    f'{n}: {_spec_text(b)}' for n, a, b in zip(names, result.best.choice, other.choice) if a != b
  ]
  return '; '.join(diffs)


def _spec_text(spec) -> str:
  if spec is AUTO:
    return 'propagated'
  if spec is None:
    return 'replicated'
  if isinstance(spec, tuple) and not isinstance(spec, P):
    return ','.join(spec)
  return str(spec)


def _ms(seconds: float) -> str:
  return f'{seconds * 1e3:.2f} ms'


auto_shard.calibrate = calibrate
