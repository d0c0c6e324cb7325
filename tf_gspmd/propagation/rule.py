"""`OpRule`: the einsum-like sharding rule of one op instance.

A rule names a *factor* for every dimension of every data operand and result.
Two dims that hold the same factor are the same index space, so one sharding
of that factor means one sharding of both dims. Each factor has a kind:

- `pass_through`: present in operands and results alike (batch dims of a
  matmul, every dim of an elementwise op); sharding it needs no communication.
- `reduction`: present in operands only and summed over (the contracting dim
  of a matmul, a reduced dim); sharding it leaves partial results that the
  partitioner must combine. A pass-through factor missing from some results
  means those results reduce over it (FusedBatchNorm's batch statistics).
- `need_replication`: the op cannot run on a piece of this dim (a softmax's
  class dim, a sort axis); propagation never shards it.

A dim entry is `None` (size-1 broadcast or not mapped), a factor name, or a
tuple of factor names, major to minor, when one dim holds several factors
(Reshape merging or splitting dims, Tile). An operand entry of `None` marks an
auxiliary operand (a shape, axis list or index vector), which is always
replicated. Windowed factors (convolution and pooling spatial dims, slices,
pads) carry a `halo.WindowDim` saying which operand rows each result row reads.

The same object answers the partitioner's questions: `factor_axes` merges
operand/result shardings into one sharding per factor, `operand_specs` and
`result_specs` turn factor shardings back into partition specs.

>>> r = OpRule(operands=(('i', 'k'), ('k', 'j')), results=(('i', 'j'),),
...            kinds={'k': REDUCTION}, sizes={'i': 8, 'k': 16, 'j': 32})
>>> r.text()
'([i,k],[k,j])->([i,j]) reduction={k}'
"""

from __future__ import annotations

import dataclasses
import math
from typing import Dict, List, Mapping, Optional, Sequence, Tuple, Union

from tf_gspmd.mesh import Mesh
from tf_gspmd.propagation.halo import WindowDim
from tf_gspmd.sharding import NamedSharding, P

PASS_THROUGH = 'pass_through'
REDUCTION = 'reduction'
NEED_REPLICATION = 'need_replication'
FACTOR_KINDS = (PASS_THROUGH, REDUCTION, NEED_REPLICATION)

Axes = Tuple[str, ...]  # mesh axes splitting one dim or factor, major to minor
DimEntry = Optional[Union[str, Tuple[str, ...]]]  # None | factor name | tuple of factor names
TensorDims = Optional[Tuple[DimEntry, ...]]  # None: auxiliary (replicated) operand


def dim_factors(entry: DimEntry) -> Tuple[str, ...]:
  """The factors of one dim entry, major to minor."""
  if entry is None:
    return ()
  return (entry,) if isinstance(entry, str) else tuple(entry)


@dataclasses.dataclass(frozen=True)
class OpRule:
  """Factors of every dim of every operand and result of one node."""

  operands: Tuple[TensorDims, ...]
  results: Tuple[TensorDims, ...]
  kinds: Mapping[str, str] = dataclasses.field(default_factory=dict)  # default: pass_through
  sizes: Mapping[str, Optional[int]] = dataclasses.field(default_factory=dict)
  windows: Mapping[str, WindowDim] = dataclasses.field(default_factory=dict)
  # Operands whose dims are broadcast into the results (a bias, a BroadcastTo
  # input). Propagation lets them take shardings from the results early but
  # lets them shard the results only late (XLA and Shardy do the same).
  broadcast_operands: Tuple[int, ...] = ()
  # Pass-through factors whose rows move between shards when split (a Roll's rolled dims:
  # each partition's result rows come from the partitions `shift` rows away).
  shifted: Tuple[str, ...] = ()

  def __post_init__(self):
    object.__setattr__(
      self, 'operands', tuple(None if o is None else tuple(o) for o in self.operands)
    )
    object.__setattr__(
      self, 'results', tuple(None if r is None else tuple(r) for r in self.results)
    )
    for f, k in self.kinds.items():
      if k not in FACTOR_KINDS:
        raise ValueError(f'OpRule: factor {f!r} has unknown kind {k!r}; use one of {FACTOR_KINDS}.')
    in_results = {f for r in self.results if r is not None for e in r for f in dim_factors(e)}
    for f in in_results:
      if self.kind(f) == REDUCTION:
        raise ValueError(f'OpRule: reduction factor {f!r} must not appear in a result.')

  # --- structure ---------------------------------------------------------------
  def structure(self) -> tuple:
    """Every field, as one tuple that hashes (a rule holds dicts): a memo's key part for
    answers that depend on the rule alone. TypeError when a field's value does not hash."""
    key = (
      self.operands,
      self.results,
      tuple(sorted(self.kinds.items())),
      tuple(sorted(self.sizes.items())),
      tuple(sorted(self.windows.items())),
      self.broadcast_operands,
      self.shifted,
    )
    hash(key)
    return key

  def factors(self) -> Tuple[str, ...]:
    """Every factor in order of first appearance (operands, then results)."""
    cached = self.__dict__.get('_factors')  # a rule is frozen: computed once (hot in sweeps)
    if cached is None:
      seen = []
      for dims in self.operands + self.results:
        for e in dims or ():
          for f in dim_factors(e):
            if f not in seen:
              seen.append(f)
      cached = self.__dict__['_factors'] = tuple(seen)
    return cached

  def kind(self, factor: str) -> str:
    return self.kinds.get(factor, PASS_THROUGH)

  def size(self, factor: str) -> Optional[int]:
    return self.sizes.get(factor)

  def tensor_dims(self) -> Tuple[TensorDims, ...]:
    """Operand dims then result dims, the order `factor_axes` takes shardings in."""
    return self.operands + self.results

  @property
  def is_pass_through(self) -> bool:
    """True for ops XLA calls pass-through: every data tensor holds the same plain factors
    as every other it shares one with."""
    cached = self.__dict__.get('_is_pass_through')  # a rule is frozen: computed once
    if cached is None:
      cached = self.__dict__['_is_pass_through'] = self._pass_through()
    return cached

  def _pass_through(self) -> bool:
    if self.windows or self.broadcast_operands or self.shifted:
      return False
    if any(self.kind(f) != PASS_THROUGH for f in self.factors()):
      return False
    sets = []
    for dims in self.tensor_dims():
      if dims is None or not dims:
        continue
      if any(not isinstance(e, str) for e in dims):
        return False
      sets.append(frozenset(dims))
    # Equal or disjoint: one identity, or independent ones side by side (IdentityN's pairs).
    return all(a == b or not (a & b) for a in sets for b in sets)

  # --- text form ---------------------------------------------------------------
  def text(self) -> str:
    """One-line form, e.g. `([i,k],[k,j])->([i,j]) reduction={k}`."""

    def dim_text(e):
      fs = dim_factors(e)
      return '-' if not fs else '*'.join(fs)

    def tensor_text(dims):
      return '_' if dims is None else '[' + ','.join(dim_text(e) for e in dims) + ']'

    out = '(' + ','.join(tensor_text(d) for d in self.operands) + ')->('
    out += ','.join(tensor_text(d) for d in self.results) + ')'
    for kind in (REDUCTION, NEED_REPLICATION):
      fs = [f for f in self.factors() if self.kind(f) == kind]
      if fs:
        out += f' {kind}={{' + ','.join(fs) + '}'
    for f in self.factors():
      w = self.windows.get(f)
      if w is not None:
        out += (
          f' window({f})={{size={w.window},stride={w.stride},dilation={w.dilation},'
          f'pad={w.pad_lo}:{w.pad_hi}}}'
        )
    if self.shifted:
      out += ' shifted={' + ','.join(self.shifted) + '}'
    compound = [
      f
      for dims in self.tensor_dims()
      for e in dims or ()
      if not isinstance(e, str)
      for f in dim_factors(e)
    ]
    if compound:
      out += ' {' + ','.join(f'{f}={self.size(f)}' for f in self.factors() if f in compound) + '}'
    return out

  def __str__(self):
    return self.text()

  # --- shardings <-> factors (used by propagation and the partitioner) ---------
  def split_dim(self, entry: DimEntry, axes: Axes, mesh: Mesh) -> List[Tuple[str, Axes]]:
    """Which factor of a (compound) dim each of `axes` shards.

    A minor factor can be sharded only when every factor before it is split
    into pieces of size 1; axes that fit no factor are dropped.
    """
    fs = dim_factors(entry)
    if len(fs) == 1:
      return [(fs[0], tuple(axes))]
    out, rest = [], list(axes)
    for f in fs:
      size, taken = self.size(f), list[str]()
      while (
        rest and size is not None and size % (_product(mesh, taken) * mesh.axis_size(rest[0])) == 0
      ):
        taken.append(rest.pop(0))
      out.append((f, tuple(taken)))
      if size is None or _product(mesh, taken) != size:
        break
    return out

  def join_dim(
    self, entry: DimEntry, factor_axes: Mapping[str, Axes], mesh: Mesh, dim_size: Optional[int]
  ) -> Axes:
    """Mesh axes of one dim given each factor's axes (the inverse of `split_dim`).

    A plain dim keeps its factor's axes even when it is smaller than their
    shard count: the trailing shards are empty (padding only), as in any
    uneven split. Dropping the axes there would replicate the tensor and cost
    a reshard wherever it meets a tensor that keeps them (4 experts over 8
    devices: an all-gather and back at every annotation). `dim_size` does
    not change the result: compound dims split by their factors' sizes.
    """
    fs = dim_factors(entry)
    if not fs:
      return ()
    if len(fs) == 1:
      return tuple(factor_axes.get(fs[0], ()))
    out = []
    for f in fs:
      size, axes = self.size(f), list[str]()
      for a in factor_axes.get(f, ()):
        if size is None or size % (_product(mesh, axes) * mesh.axis_size(a)) != 0:
          break
        axes.append(a)
      out.extend(axes)
      if size is None or _product(mesh, axes) != size:
        break
    return tuple(out)

  def factor_axes(self, specs: Sequence[Optional[Sequence[Axes]]], mesh: Mesh) -> Dict[str, Axes]:
    """One sharding per factor from the shardings of operands then results.

    `specs[t]` holds per-dim mesh axes of tensor t (or None when unknown).
    Where tensors disagree on a factor, the sharding over more devices wins,
    then the earlier tensor; an axis claimed by two factors stays with the
    first factor; need-replication factors get no axes.
    """
    candidates = self.factor_candidates(specs, mesh)
    chosen = {f: pick_candidate(c, mesh)[0] if c else () for f, c in candidates.items()}
    return self.resolve_axes(chosen)

  def factor_candidates(self, specs, mesh) -> Dict[str, List[Tuple[Axes, int]]]:
    """Per factor: (axes, tensor index) proposals from every tensor that shards it."""
    candidates: Dict[str, List[Tuple[Axes, int]]] = {f: [] for f in self.factors()}
    for t, (dims, spec) in enumerate(zip(self.tensor_dims(), specs)):
      if dims is None or spec is None:
        continue
      for entry, axes in zip(dims, spec):
        if not axes or entry is None:
          continue
        for f, fax in self.split_dim(entry, tuple(axes), mesh):
          if fax:
            candidates[f].append((fax, t))
    return candidates

  def resolve_axes(self, chosen: Mapping[str, Axes], first: Sequence[str] = ()) -> Dict[str, Axes]:
    """Drop need-replication factors, and axes an earlier factor of the same tensor claimed.

    A mesh axis may split two factors only when no tensor holds both (the
    independent inputs of IdentityN may use the same axes). Factors claim in
    rule order, those in `first` before the others (a conflict settled by bytes).
    """
    together = self._cooccurring()
    out: Dict[str, Axes] = {}
    order = [f for f in first if f in together] + [f for f in self.factors() if f not in first]
    for f in order:
      axes = () if self.kind(f) == NEED_REPLICATION else tuple(chosen.get(f, ()))
      used = {a for g in together[f] if g in out for a in out[g]}
      keep = []
      for a in axes:
        if a in used:
          break  # keep a prefix: a dim's axes are major to minor
        keep.append(a)
      out[f] = tuple(keep)
    return out

  def _cooccurring(self) -> Dict[str, frozenset]:
    cached = self.__dict__.get('_together')  # a rule is frozen: computed once
    if cached is None:
      cached = self.__dict__['_together'] = {
        f: frozenset(g) for f, g in self._cooccurring_sets().items()
      }
    return cached

  def _cooccurring_sets(self) -> Dict[str, set]:
    together: Dict[str, set] = {f: set() for f in self.factors()}
    for dims in self.tensor_dims():
      fs = [f for e in dims or () for f in dim_factors(e)]
      for f in fs:
        together[f].update(g for g in fs if g != f)
    # A sharded reduction factor leaves the results partial over its axes, so the results
    # hold it too (a gather's table rows and its indices' dims cannot share an axis).
    in_results = {f for dims in self.results for e in dims or () for f in dim_factors(e)}
    for f in self.factors():
      if self.kind(f) == REDUCTION:
        together[f].update(in_results)
        for g in in_results:
          together[g].add(f)
    return together

  def representable(
    self, factor_axes: Mapping[str, Axes], mesh: Mesh, shapes: Optional[Sequence] = None
  ) -> Dict[str, Axes]:
    """`factor_axes` cut until every tensor's dims can hold them.

    A factor sharded in one tensor must be sharded alike in every tensor that
    holds it, or the local op sees blocks that do not match (a depthwise
    filter split on its multiplier while the output's (channel, multiplier)
    dim cannot show that split). A minor factor of a compound dim keeps axes
    only when the factors before it are split into size-1 pieces; whatever
    one tensor cannot hold, the factor loses everywhere. `shapes` lists operand
    then result shapes (None where unknown).
    """
    dims_list = self.tensor_dims()
    shapes = list(shapes) if shapes is not None else [None] * len(dims_list)
    out = {f: tuple(factor_axes.get(f, ())) for f in self.factors()}
    changed = True
    while changed:
      changed = False
      for dims, shape in zip(dims_list, shapes):
        for d, entry in enumerate(dims or ()):
          fs = dim_factors(entry)
          if not fs:
            continue
          size = None if shape is None or d >= len(shape) else shape[d]
          joined = self.join_dim(entry, out, mesh, size)
          kept = dict(self.split_dim(entry, joined, mesh)) if joined else {}
          for f in fs:
            if out[f] != tuple(kept.get(f, ())):
              out[f] = tuple(kept.get(f, ()))
              changed = True
    return out

  def tensor_spec(
    self,
    dims: TensorDims,
    factor_axes: Mapping[str, Axes],
    mesh: Mesh,
    shape: Optional[Sequence[Optional[int]]],
  ) -> Optional[Tuple[Axes, ...]]:
    if dims is None:
      return None
    shape = shape if shape is not None else (None,) * len(dims)
    return tuple(self.join_dim(e, factor_axes, mesh, s) for e, s in zip(dims, shape))

  def operand_specs(self, factor_axes, mesh, shapes=None) -> List[Optional[P]]:
    """Partition spec each operand must have for `factor_axes` (None: auxiliary operand)."""
    return self._specs(self.operands, factor_axes, mesh, shapes)

  def result_specs(self, factor_axes, mesh, shapes=None) -> List[Optional[P]]:
    """Partition spec of each result for `factor_axes` (reduction factors are not in results)."""
    return self._specs(self.results, factor_axes, mesh, shapes)

  def _specs(self, tensors, factor_axes, mesh, shapes):
    out = []
    for i, dims in enumerate(tensors):
      spec = self.tensor_spec(dims, factor_axes, mesh, None if shapes is None else shapes[i])
      out.append(None if spec is None else P(*spec))
    return out

  def infer_results(
    self, operand_shardings: Sequence[Optional[NamedSharding]], mesh: Mesh, result_shapes=None
  ) -> List[Optional[NamedSharding]]:
    """Result shardings the operands' shardings imply (partial sums resolved, as propagation
    does)."""
    specs = [
      None if s is None or d is None else _axes_of(s)
      for s, d in zip(operand_shardings, self.operands)
    ]
    fa = self.factor_axes(specs + [None] * len(self.results), mesh)
    return [
      None if p is None else NamedSharding(mesh, p)
      for p in self.result_specs(fa, mesh, result_shapes)
    ]

  def required_operands(
    self, result_shardings: Sequence[Optional[NamedSharding]], mesh: Mesh, operand_shapes=None
  ) -> List[Optional[NamedSharding]]:
    """Operand shardings that produce `result_shardings` with no communication but reductions."""
    specs = [None] * len(self.operands) + [
      None if s is None or d is None else _axes_of(s)
      for s, d in zip(result_shardings, self.results)
    ]
    fa = self.factor_axes(specs, mesh)
    return [
      None if p is None else NamedSharding(mesh, p)
      for p in self.operand_specs(fa, mesh, operand_shapes)
    ]


def pick_candidate(candidates: Sequence[Tuple[Axes, int]], mesh: Mesh) -> Tuple[Axes, int]:
  """The proposal over the most devices; among equals the one with more axes, then the first.

  A proposal that extends another (same axes plus more minor ones) covers
  more devices, so compatible proposals merge into the longest.
  """
  best = candidates[0]
  for cand in candidates[1:]:
    if _score(cand[0], mesh) > _score(best[0], mesh):
      best = cand
  return best


def _score(axes: Axes, mesh: Mesh) -> tuple:
  return (_product(mesh, axes), len(axes))


def _product(mesh: Mesh, axes) -> int:
  return math.prod(mesh.axis_size(a) for a in axes)


def _axes_of(s: NamedSharding) -> Tuple[Axes, ...]:
  return tuple(s.spec.axes_of(d) for d in range(len(s.spec)))
