"""The op sweep's cases: which operand and output shardings each program is run with.

`enumerate_cases` lists every combination of partition specs of the operands
(every assignment of mesh axes to dims, several axes on one dim in either
order, and replicated) up to a budget; past it, a deterministic subset (all
operands alike, one operand at a time, then a seeded sample). `full_cases` is
the full sweep in a fixed order and `rotating_slice` one deterministic slice
of it; `sample_cases` and `ci_sample` pick the few cases per program the CI
sample runs.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import subprocess
import zlib
from typing import TYPE_CHECKING, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from tf_gspmd.mesh import Mesh
from tf_gspmd.sharding import P
from tf_gspmd.testing.op_builders import OpSpec

if TYPE_CHECKING:
  from tf_gspmd.testing.op_sweep import Sweep

MESHES = {'1d': ((4,), ('x',)), '2d': ((2, 4), ('a', 'b'))}
DEFAULT_BUDGET = 64  # operand-sharding combinations per program and mesh before subsetting
_MESH_CACHE: Dict[str, Mesh] = {}


def mesh_named(name: str) -> Mesh:
  if name not in _MESH_CACHE:
    shape, axes = MESHES[name]
    _MESH_CACHE[name] = Mesh.create(shape, axes)
  return _MESH_CACHE[name]


def all_specs(mesh: Mesh, rank: int) -> List[P]:
  """Every partition spec of a rank-`rank` tensor on `mesh`, replicated first.

  Each mesh axis splits at most one dim; a dim split by several axes lists
  them in every order (major to minor).
  """
  axes = mesh.axis_names
  out = []
  for placement in itertools.product(range(-1, rank), repeat=len(axes)):
    per_dim = [[a for a, d in zip(axes, placement) if d == dim] for dim in range(rank)]
    for orders in itertools.product(*[itertools.permutations(g) for g in per_dim]):
      out.append(P(*[tuple(o) if o else None for o in orders]))
  unique = list(dict.fromkeys(out))
  return sorted(unique, key=lambda s: (sum(len(s.axes_of(d)) for d in range(rank)), str(s)))


def _full_split(mesh: Mesh, rank: int) -> P:
  """Dim 0 split by every mesh axis: the most (and most uneven) shards."""
  return P(*([tuple(mesh.axis_names)] + [None] * (rank - 1)))


@dataclasses.dataclass(frozen=True)
class Case:
  """One sweep case: a program, a mesh, operand specs (None: unannotated), output specs."""

  spec: str
  mesh: str
  in_specs: Tuple[Optional[P], ...]
  out_specs: Optional[Tuple[Optional[P], ...]] = None

  def label(self) -> str:
    ins = ', '.join('-' if s is None else _spec_text(s) for s in self.in_specs)
    text = f'{self.spec} [{self.mesh}] in=({ins})'
    if self.out_specs is not None:
      text += (
        ' out=(' + ', '.join('-' if s is None else _spec_text(s) for s in self.out_specs) + ')'
      )
    return text


def _spec_text(s: P) -> str:
  return (
    'P('
    + ','.join('_' if e is None else (e if isinstance(e, str) else '+'.join(e)) for e in s)
    + ')'
  )


def enumerate_cases(
  spec: OpSpec, mesh_name: str, out_ranks: Sequence[int], budget: Optional[int] = DEFAULT_BUDGET
) -> List[Case]:
  """Every operand-sharding combination (up to `budget`), then one sharded output at a time."""
  mesh = mesh_named(mesh_name)
  lists = [all_specs(mesh, o.rank) if o.shard else [None] for o in spec.operands]
  total = math.prod(len(choices) for choices in lists)
  if budget is None or total <= budget:
    combos = list(itertools.product(*lists))
  else:
    combos = _subset(spec, lists, budget, mesh)
  cases = [Case(spec.name, mesh_name, tuple(c)) for c in combos]
  if spec.shard_outputs:
    for j, rank in enumerate(out_ranks):
      for s in all_specs(mesh, rank)[1:]:  # the replicated output is what the in-cases check
        outs = tuple(s if k == j else None for k in range(len(out_ranks)))
        cases.append(Case(spec.name, mesh_name, (None,) * len(spec.operands), outs))
  return cases


def _subset(spec: OpSpec, lists, budget: int, mesh: Mesh) -> List[tuple]:
  """All operands alike (by rank), each operand alone, then a seeded sample, in that order."""
  n = len(lists)
  chosen = []
  ranks = [o.rank for o in spec.operands]
  for rank in sorted(set(r for r, o in zip(ranks, spec.operands) if o.shard)):
    for s in all_specs(mesh, rank):
      chosen.append(
        tuple(s if (o.shard and r == rank) else None for o, r in zip(spec.operands, ranks))
      )
  for i, options in enumerate(lists):
    for s in options:
      if s is not None:
        chosen.append(tuple(s if k == i else None for k in range(n)))
  rng = np.random.RandomState(zlib.crc32(spec.name.encode()))
  seen = set()
  out = []
  for c in chosen:
    if c not in seen:
      seen.add(c)
      out.append(c)
  attempts = 0
  while len(out) < max(budget, len(chosen)) and attempts < 20 * budget:
    attempts += 1
    c = tuple(options[rng.randint(len(options))] for options in lists)
    if c not in seen:
      seen.add(c)
      out.append(c)
  return out


def sample_cases(
  spec: OpSpec, mesh_name: str, out_ranks: Sequence[int], count: int = 2
) -> List[Case]:
  """A deterministic sample: every operand split on dim 0 by all mesh axes, then seeded picks."""
  mesh = mesh_named(mesh_name)
  cases = enumerate_cases(spec, mesh_name, out_ranks, budget=DEFAULT_BUDGET)
  first = None
  if any(o.shard for o in spec.operands):
    first = Case(
      spec.name,
      mesh_name,
      tuple(_full_split(mesh, o.rank) if o.shard else None for o in spec.operands),
    )
  elif spec.shard_outputs and any(out_ranks):
    j = next(k for k, r in enumerate(out_ranks) if r)
    first = Case(
      spec.name,
      mesh_name,
      (None,) * len(spec.operands),
      tuple(_full_split(mesh, r) if k == j else None for k, r in enumerate(out_ranks)),
    )
  picked = [first] if first is not None else []
  rest = [c for c in cases if c not in picked]
  rng = np.random.RandomState(zlib.crc32(f'{spec.name}/{mesh_name}'.encode()))
  while rest and len(picked) < count:
    picked.append(rest.pop(rng.randint(len(rest))))
  return picked


def ci_sample(
  sweep: 'Sweep',
  meshes: Sequence[str] = tuple(MESHES),
  count: Optional[Callable[[str, str], int]] = None,
  every_program=(),
) -> List[Case]:
  """`count(op_type, mesh)` cases (default 1) of every op type on each mesh.

  Each op type takes its programs in turn (a different one first on each
  mesh); op types in `every_program` also get one case of each of their
  programs. Cases a known issue breaks stay in: they must fail with its
  signature.
  """
  by_type: Dict[str, List[str]] = {}
  for name in sorted(sweep.specs):
    by_type.setdefault(sweep.specs[name].op_type, []).append(name)
  cases = []
  for k, mesh_name in enumerate(meshes):
    for op_type, names in sorted(by_type.items()):
      order = names[k % len(names) :] + names[: k % len(names)]
      wanted = count(op_type, mesh_name) if count else 1
      chosen = []
      for name in order:
        chosen += sweep.sample(name, mesh_name, wanted - len(chosen))
        if len(chosen) >= wanted:
          break
      if op_type in every_program:
        for name in names:
          chosen += [c for c in sweep.sample(name, mesh_name, 1) if c not in chosen]
      cases += chosen
  return cases


def full_cases(
  sweep: 'Sweep',
  names: Optional[Sequence[str]] = None,
  meshes: Sequence[str] = tuple(MESHES),
  budget: Optional[int] = DEFAULT_BUDGET,
) -> List[Case]:
  """The full sweep in a fixed order: programs by name, then meshes, then their cases."""
  out = []
  for name in sorted(names if names is not None else sweep.specs):
    for mesh_name in meshes:
      out += sweep.cases(name, mesh_name, budget)
  return out


def parse_slice(text: str) -> Tuple[int, int]:
  """'k/K' -> (k, K), with 0 <= k < K."""
  k, total = (int(v) for v in text.split('/'))
  if not 0 <= k < total:
    raise ValueError(f'op sweep slice {text!r}: want k/K with 0 <= k < K.')
  return k, total


def rotating_slice(cases: Sequence[Case], index: int, count: int) -> List[Case]:
  """Slice `index` of `count`: every `count`-th case from `index` on. The slices
  partition the sweep, and each holds cases of every part of it."""
  return list(cases[index::count])


def commit_count(root: str) -> Optional[int]:
  """Commits reachable from HEAD of the git checkout at `root` (None without git)."""
  try:
    out = subprocess.run(
      ['git', '-C', root, 'rev-list', '--count', 'HEAD'],
      capture_output=True,
      text=True,
      check=True,
      timeout=30,
    )
    return int(out.stdout.strip())
  except (OSError, subprocess.SubprocessError, ValueError):
    return None
