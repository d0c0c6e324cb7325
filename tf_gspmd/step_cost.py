"""What one partitioned step costs on given hardware: its features and a hardware profile.

A step is described by what one device does (`StepFeatures`): the ops its program runs,
the flops of its contractions (matmuls, einsums, convolutions) per dtype, the bytes its
other ops (elementwise, reductions, the optimizer's update) read and write, and its
collectives (kind, group size, mesh axes, local operand bytes). `step_features` reads
them off a propagated program (the same rules the partitioner applies: an op's iteration
space is split over the mesh axes its tensors' shardings give its factors), and
`auto_shard`'s simulator counts them alike while it walks a layout.

A `HardwareProfile` prices them (`step_time`)::

    seconds = share * (ops * op_seconds + flops / flops_per_s[dtype] + bytes / memory_bandwidth)
            + sum over collectives of its time + step_seconds

`share` is how many of the mesh's devices one compute unit runs (`devices / cores` for
logical CPU devices sharing the machine's cores; 1 for an accelerator per device). A
collective's time comes from a measured table (latency, bandwidth per kind and group size,
as `tg.auto_shard.calibrate()` measures them on this machine), or, without one, from the
profile's links: a ring over each mesh axis on the torus, `link_latency` per ring step and
`link_bandwidth` per link direction (see `collective_seconds`). Nothing overlaps: compute,
memory traffic and collectives add up, an upper bound where the hardware overlaps them.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from tf_gspmd.mesh import Mesh
from tf_gspmd.sharding import NamedSharding

Collective = Tuple[str, int, int, int]  # kind, group size, mesh axes spanned, operand bytes
# Ops that run nothing on a device (their cost is the graph's, not a step's).
_NOT_RUN = frozenset({'Const', 'NoOp', 'Placeholder', '_Arg', '_Retval', 'VarHandleOp'})


# --- what a step does on one device ----------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class StepFeatures:
  """What one device of a `devices`-device mesh does in one step (see the module doc)."""

  devices: int
  ops: int  # ops its program runs on tensors (`op_counts`)
  matmul_flops: Tuple[Tuple[str, float], ...]  # (dtype, flops of its contractions)
  elementwise_bytes: float  # bytes its other ruled ops read and write
  collectives: Tuple[Collective, ...]
  small_ops: int = 0  # and on scalars, or as views (a variable's read, a reshape)

  @property
  def flops(self) -> float:
    return float(sum(f for _, f in self.matmul_flops))


@dataclasses.dataclass(frozen=True)
class HardwareProfile:
  """A device's compute, memory and links, as `step_time` prices a step on them.

  `flops_per_s`: (dtype name, peak flops/s of one device), the first entry used for a
  dtype not listed; `memory_bytes`: one device's memory; `memory_bandwidth`: bytes/s;
  `link_bandwidth`: bytes/s of one link in one direction as one device sees it,
  `link_latency`: seconds per ring step; `topology`: e.g. '2d_torus' (each mesh axis a ring
  of the torus). `cores`: compute units the mesh's devices share (0: one per device).
  `op_seconds`, `small_op_seconds`, `step_seconds`: launch overhead per op on tensors, per
  op on scalars or views, and per step. `collective_table`:
  measured (kind, group, latency s, bandwidth bytes/s) rows that replace the link model,
  scaled by `collective_scale`. `vector_bytes`: a vector register's width, to which a
  contraction's minor dims are padded (`work_of_propagation`).
  """

  name: str
  flops_per_s: Tuple[Tuple[str, float], ...]
  memory_bytes: int
  memory_bandwidth: float
  link_bandwidth: float
  link_latency: float
  topology: str = '2d_torus'
  cores: int = 0
  op_seconds: float = 0.0
  step_seconds: float = 0.0
  small_op_seconds: float = 0.0
  collective_table: Tuple[Tuple[str, int, float, float], ...] = ()
  collective_scale: float = 1.0
  # The scale of a collective over a part of the mesh (`over_part`): the table times a group
  # alone, where in a step every group of the mesh runs its collective at once on the same
  # cores. None: `collective_scale` (a fit's 0 is a price, not an absence).
  part_collective_scale: Optional[float] = None
  source: str = ''
  # Bytes of one vector register (64 with AVX-512): a contraction's kernels run the minor dim
  # of each of its tensors in lanes of that width, so a local minor size of 4 floats costs
  # the 16 of a full vector (oneDNN's blocked layouts pad channels alike). 0: not modelled.
  vector_bytes: int = 0

  def flops(self, dtype: str) -> float:
    rates = dict(self.flops_per_s)
    return rates.get(dtype, self.flops_per_s[0][1])

  def share(self, devices: int) -> float:
    """Devices one compute unit runs, one after another (at least 1)."""
    return max(1.0, devices / self.cores) if self.cores else 1.0

  def to_json(self) -> dict:
    return dataclasses.asdict(self)

  @classmethod
  def from_json(cls, data: dict) -> 'HardwareProfile':
    fields = {f.name for f in dataclasses.fields(cls)}
    data = {k: v for k, v in data.items() if k in fields}
    data['flops_per_s'] = tuple((str(d), float(r)) for d, r in data['flops_per_s'])
    data['collective_table'] = tuple(
      (str(k), int(g), float(lat), float(bw)) for k, g, lat, bw in data.get('collective_table', ())
    )
    return cls(**data)


GIB = 1 << 30
# Cloud TPU v3 (https://cloud.google.com/tpu/docs/v3): 123 TFLOPS bf16 per chip, 32 GiB of
# HBM2 at 900 GB/s per chip, two TensorCores per chip, a 2-D torus of up to 1024 chips. One
# device is one TensorCore (the GSPMD paper counts its 2048 devices as cores): half a chip's
# flops, HBM and bandwidth. Links: the pod's all-reduce bandwidth, 340 TB/s over 1024 chips
# and their 4 torus links, is 83 GB/s per link; a core shares its chip's links with the
# other core, so 41.5 GB/s per link direction per core. f32 matmuls run as bf16 passes at
# a third of the rate (the MXU's default f32 precision is several bf16 passes): priced so.
TPU_V3 = HardwareProfile(
  name='TPU v3 (one TensorCore)',
  flops_per_s=(('bfloat16', 61.5e12), ('float32', 61.5e12 / 3)),
  memory_bytes=16 * GIB,
  memory_bandwidth=450e9,
  link_bandwidth=340e12 / 1024 / 4 / 2,
  link_latency=1e-6,
  topology='2d_torus',
  source='cloud.google.com/tpu/docs/v3 (per chip: 123 TFLOPS bf16, 32 GiB HBM2 at 900 GB/s, '
  '2 TensorCores; pod: 1024 chips, 2D torus, 340 TB/s all-reduce bandwidth)',
)


@dataclasses.dataclass(frozen=True)
class StepTime:
  """A step's predicted seconds by term (`step_time`) and the flops it does at that pace."""

  compute: float
  memory: float
  launch: float
  collectives: float
  flops: float  # per device
  peak_flops: float  # per device, at the step's dtype mix

  @property
  def total(self) -> float:
    return self.compute + self.memory + self.launch + self.collectives

  @property
  def utilization(self) -> float:
    """Fraction of the device's peak flops the step's contractions use."""
    return self.flops / self.total / self.peak_flops if self.total and self.peak_flops else 0.0


def step_time(features: StepFeatures, profile: HardwareProfile) -> StepTime:
  """`features` priced on `profile` (the module doc's formula)."""
  share = profile.share(features.devices)
  compute = sum(f / profile.flops(d) for d, f in features.matmul_flops)
  peak = features.flops / compute if compute else profile.flops_per_s[0][1]
  collectives = sum(
    collective_seconds(profile, *c, part=over_part(c, features.devices))
    for c in features.collectives
  )
  return StepTime(
    share * compute,
    share * features.elementwise_bytes / profile.memory_bandwidth,
    share * (features.ops * profile.op_seconds + features.small_ops * profile.small_op_seconds)
    + profile.step_seconds,
    collectives,
    features.flops,
    peak,
  )


def over_part(collective: Collective, devices: int) -> bool:
  """Whether `collective` (a `StepFeatures` entry) spans fewer devices than the step's mesh."""
  return collective[1] < devices


def collective_seconds(
  profile: HardwareProfile, kind: str, group: int, axes: int, nbytes: int, part: bool = False
) -> float:
  """One collective's seconds: from the measured table when the profile has one (latency +
  bytes * (g-1)/g / bandwidth, at the nearest measured group size, times the profile's scale:
  `part_collective_scale` for a group that is a `part` of the step's mesh), else from the
  links.

  Links: a ring over the group (both directions of each torus dimension it spans, so
  2 * min(axes, 2) links carry it); all-reduce moves 2(g-1)/g of its operand over 2(g-1)
  steps, reduce-scatter (g-1)/g over g-1, all-gather (g-1) times its shard over g-1,
  all-to-all (g-1)/g of its operand an average g/4 hops, a permute one hop.
  """
  if group <= 1:
    return 0.0
  if profile.collective_table:
    scale = profile.collective_scale
    if part and profile.part_collective_scale is not None:
      scale = profile.part_collective_scale
    return scale * _measured_seconds(profile, kind, group, nbytes)
  links = 2 * max(1, min(axes, 2 if profile.topology == '2d_torus' else 3))
  bandwidth = profile.link_bandwidth * links
  fraction, steps = {
    'all_reduce': (2 * (group - 1) / group, 2 * (group - 1)),
    'reduce_scatter': ((group - 1) / group, group - 1),
    'all_gather': (group - 1, group - 1),
    'permute': (1.0, 1),
  }.get(kind, ((group - 1) / group * max(1.0, group / 4), group - 1))
  return steps * profile.link_latency + nbytes * fraction / bandwidth


def _measured_seconds(profile: HardwareProfile, kind: str, group: int, nbytes: int) -> float:
  rows = [r for r in profile.collective_table if r[0] == kind] or [
    r for r in profile.collective_table if r[0] == 'all_to_all'
  ]
  row = min(rows, key=lambda r: abs(math.log(r[1]) - math.log(max(group, 2))))
  return row[2] + nbytes * (group - 1) / group / row[3]


# --- features read off a propagated program ----------------------------------------------------
def op_counts(program) -> Tuple[int, int]:
  """(ops on tensors, small ops) the program runs on each device: every graph's nodes but
  constants and arguments; small: results of at most one element each, or views of other
  buffers (the registry's `aliasing` ops: a variable's read, a reshape, an identity)."""
  from tf_gspmd.propagation import registry

  ops = small = 0
  for graph in program.graphs():
    for node in graph.nodes:
      if node.op in _NOT_RUN:
        continue
      if registry.entry_of(node.op).aliasing or _scalars(node.outputs):
        small += 1
      else:
        ops += 1
  return ops, small


def _scalars(outputs) -> bool:
  shapes = [t.shape for t in outputs if _dtype_size(t.dtype)]
  return bool(shapes) and all(
    s is not None and None not in s and int(np.prod(s, dtype=np.int64)) <= 1 for s in shapes
  )


def space_weights(rule, spaces: List[List[str]], sizes: Sequence[int]) -> List[Tuple[bool, float]]:
  """Per iteration space of `rule`: (is a contraction, bytes per point if not).

  A contraction (matmul, einsum, convolution) sums a factor that two of its operands hold:
  2 flops a point. Any other op reads and writes each of its tensors over the space once:
  `sizes` are the tensors' dtype sizes (operands, then results).
  """
  from tf_gspmd.propagation.rule import REDUCTION, dim_factors

  tensors = rule.tensor_dims()
  holders: Dict[str, int] = {}
  for dims in rule.operands:
    for f in {f for e in dims or () for f in dim_factors(e)}:
      holders[f] = holders.get(f, 0) + 1
  out = []
  for space in spaces:
    contraction = any(rule.kind(f) == REDUCTION and holders.get(f, 0) >= 2 for f in space)
    touched = [
      size
      for dims, size in zip(tensors, sizes)
      if dims and any(f in space for e in dims for f in dim_factors(e))
    ]
    out.append((contraction, float(sum(touched))))
  return out


def step_features(
  propagation,
  mesh: Mesh,
  records: Sequence[dict],
  work: Optional['Work'] = None,
  vector_bytes: int = 0,
) -> StepFeatures:
  """A step's features: every ruled op's iteration space split as its tensors' shardings
  (`propagation`) split its factors (`work`, when already computed; else with contractions'
  minor dims padded to `vector_bytes`), and its collectives (`records`)."""
  work = work or work_of_propagation(propagation, mesh, vector_bytes)
  collectives = tuple(
    (r['kind'], axes_size(mesh, r['axes']), len(r['axes']) or len(mesh.axis_names), r['bytes'])
    for r in records
  )
  ops, small = op_counts(propagation.program)
  return StepFeatures(
    mesh.size, ops, tuple(sorted(work.flops.items())), work.elementwise_bytes, collectives, small
  )


@dataclasses.dataclass
class Work:
  """Iteration-space points one device computes, and what they cost."""

  points: float = 0.0
  repeated: float = 0.0  # beyond its 1/N share
  flops: Dict[str, float] = dataclasses.field(default_factory=dict)  # dtype -> contraction flops
  elementwise_bytes: float = 0.0

  def add(self, local: float, whole: float, devices: int, weight, dtype: str, run: float) -> None:
    """One iteration space: `local` of its `whole` points on one device; a contraction
    runs `run` points (`local` with its minor dims padded to whole vectors)."""
    self.points += local
    self.repeated += max(0.0, local - whole / devices)
    contraction, nbytes = weight
    if contraction:
      self.flops[dtype] = self.flops.get(dtype, 0.0) + 2.0 * run
    else:
      self.elementwise_bytes += nbytes * local


def work_of_propagation(propagation, mesh: Mesh, vector_bytes: int = 0) -> Work:
  """Every ruled op's iteration space, split over the mesh axes its operands' and results'
  shardings give its factors (`OpRule.factor_axes`, the partitioner's own merge); a factor
  nobody splits is computed whole on every device. A contraction's minor-dim factors count
  padded to the lanes of a `vector_bytes` register (`whole_vectors`)."""
  result, work = propagation.result, Work()
  for graph in propagation.program.graphs():
    shardings = result.shardings.get(graph.name, {})
    for node in graph.nodes:
      rule = result.rule(node.name, graph.name)
      if rule is None:
        continue
      tensors = [graph.tensor(t) for t in node.inputs] + list(node.outputs)
      sizes = factor_sizes(rule, [t.shape for t in tensors])
      if not sizes:
        continue
      specs = [per_dim_axes(shardings.get(t.name)) for t in tensors]
      axes = rule.factor_axes(specs, result.mesh)
      spaces = independent_spaces(rule, sizes)
      dtype = _dtype_name(node.outputs[0].dtype) if node.outputs else 'float32'
      weights = space_weights(rule, spaces, [_dtype_size(t.dtype) for t in tensors])
      lanes = vector_lanes(vector_bytes, _dtype_size(node.outputs[0].dtype) if node.outputs else 0)
      minor = minor_factors(rule) if lanes > 1 else frozenset()
      devices = {f: axes_size(result.mesh, axes.get(f, ())) for f in sizes}
      for space, weight in zip(spaces, weights):
        whole = float(np.prod([sizes[f] for f in space], dtype=np.float64))
        local, run = local_points(space, sizes, devices, minor, lanes)
        work.add(local, whole, mesh.size, weight, dtype, run)
  return work


def minor_factors(rule) -> frozenset:
  """The innermost factor of each of `rule`'s tensors (what a kernel runs in vector lanes)."""
  from tf_gspmd.propagation.rule import dim_factors

  innermost = [dim_factors(dims[-1]) for dims in rule.tensor_dims() if dims]
  return frozenset(factors[-1] for factors in innermost if factors)


def local_points(space, sizes, devices, minor, lanes: int) -> Tuple[float, float]:
  """(points of `space` one device computes, those points with its `minor` factors padded to
  whole vectors of `lanes`): each factor's size over the `devices[factor]` sharing it."""
  local = run = 1.0
  for f in space:
    n = -(-sizes[f] // devices[f])
    local *= n
    run *= whole_vectors(n, lanes) if f in minor else n
  return local, run


def vector_lanes(vector_bytes: int, dtype_size: int) -> int:
  """Elements of `dtype_size` bytes (4 when unknown) one `vector_bytes` register holds."""
  return vector_bytes // (dtype_size or 4)


def whole_vectors(n: int, lanes: int) -> int:
  """`n` elements rounded up to whole vectors of `lanes`."""
  return -(-n // lanes) * lanes


def axes_size(mesh: Mesh, axes) -> int:
  """Devices along `axes` (names of the mesh or of its refinement)."""
  from tf_gspmd.graph_rewrite.reshard import refined_mesh

  if not axes:
    return 1
  names = set(mesh.axis_names)
  source = mesh if all(a in names for a in axes) else refined_mesh(mesh)[0]
  return int(np.prod([source.axis_size(a) for a in axes], dtype=np.int64))


def independent_spaces(rule, sizes: Dict[str, int]) -> List[List[str]]:
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


def factor_sizes(rule, shapes) -> Dict[str, int]:
  """Each factor's size, read off the tensors' shapes (or the rule's own sizes)."""
  from tf_gspmd.propagation.rule import dim_factors

  sizes: Dict[str, int] = {}
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


def per_dim_axes(sharding) -> Optional[list]:
  if not isinstance(sharding, NamedSharding) or sharding.rank is None:
    return None
  return [tuple(sharding.spec.axes_of(d)) for d in range(sharding.rank)]


def _dtype_name(dtype) -> str:
  return getattr(dtype, 'name', str(dtype))


def _dtype_size(dtype) -> int:
  import tensorflow as tf

  try:
    d = tf.as_dtype(dtype)
  except TypeError:
    return 0
  return 0 if d in (tf.resource, tf.variant, tf.string) else d.size
