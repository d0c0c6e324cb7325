"""The variables of a step, grouped so that one decision lays out a group (an optimizer slot
with its variable, a bias with its kernel, a stack's layers together), and the specs each
group and the inputs' batch dim may take."""

from __future__ import annotations

import dataclasses
import itertools
import os
import re
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import tensorflow as tf

from tf_gspmd.graph.capture import capture
from tf_gspmd.mesh import Mesh
from tf_gspmd.sharding import P

AUTO = 'auto'  # a group left to propagation


# --- the variables and their groups ----------------------------------------------------------
@dataclasses.dataclass
class Var:
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
  members: List[Var]
  followers: List[Tuple[Var, int]] = dataclasses.field(default_factory=list)  # (var, dims kept)
  candidates: List[Any] = dataclasses.field(default_factory=list)  # P specs, or AUTO
  fixed: Optional[P] = None  # the user's layout: not searched

  @property
  def nbytes(self) -> int:
    return sum(v.nbytes for v in self.members)

  @property
  def shape(self) -> tuple:
    return self.members[0].shape


INPUTS = '<inputs: batch dim>'


def variables_of(fn, arg_specs) -> List[Var]:
  return variables_in(capture(fn, *arg_specs))


def variables_in(program) -> List[Var]:
  """The variables a captured program touches."""
  out = []
  for var in program.variables.values():
    name = getattr(var, 'path', None) or var.name.split(':')[0]
    out.append(
      Var(
        var,
        name,
        tuple(int(d) for d in var.shape),
        var.dtype.name,
        bool(getattr(var, 'trainable', True)),
      )
    )
  return out


def _leader_of(slot: Var, candidates: List[Var]) -> Optional[Var]:
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


def _owner_of(var: Var, leaders: List[Var]) -> Optional[Var]:
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


def _role(var: Var) -> str:
  """What the variable is, whatever its layer: digit runs stripped, and the name of its
  sub-layer (`attn_0/query/kernel`, `layer0_wq`) too, so the same-shaped projections of
  one kind of layer (query, key, value) decide together."""
  parts = re.sub(r'[0-9]+', '#', var.name).split('/')
  if len(parts) >= 3:
    parts[-2] = '*'
  elif len(parts) == 1 and '_' in parts[0]:
    parts[0] = parts[0].rsplit('_', 1)[0] + '_*'
  return f'{"/".join(parts)} {list(var.shape)} {var.dtype}'


def group_variables(variables: List[Var], fixed: Optional[Dict[int, Any]] = None) -> List[Group]:
  """Groups of layout decisions: slots follow their variable, biases their kernel.

  `fixed`: id(Var) -> the user's layout; such a variable is a group of
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
  follows: Dict[int, Tuple[Var, Optional[int]]] = {}
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


def spec_candidates(shape: tuple, mesh: Mesh, axes_per_dim: Optional[int] = None) -> List[P]:
  """Every spec splitting dims of `shape` over disjoint axis groups that divide them (of at
  most `axes_per_dim` axes each: Keras' TensorLayout names one axis a dim)."""
  groups = [g for g in axis_groups(mesh) if axes_per_dim is None or len(g) <= axes_per_dim]
  options = [[None] + [g for g in groups if _divides(mesh, g, d)] for d in shape]
  out = []
  for choice in itertools.product(*options):
    used = [a for g in choice if g for a in g]
    if len(used) == len(set(used)):
      out.append(P(*[None if g is None else (g[0] if len(g) == 1 else g) for g in choice]))
  return out


def _divides(mesh: Mesh, axes: Tuple[str, ...], size: int) -> bool:
  n = int(np.prod([mesh.axis_size(a) for a in axes]))
  return size >= n and size % n == 0


def input_candidates(
  arg_specs, mesh: Mesh, splits: Optional[List[Tuple[str, ...]]] = None
) -> List[Optional[Tuple[str, ...]]]:
  """The batch dim unsplit or split over an axis group dividing it; or `splits` (those that
  divide it) alone: Keras' ModelParallel splits the batch over one axis, always."""
  batches = [int(s.shape[0]) for s in arg_specs if len(s.shape)]
  options = [None] + axis_groups(mesh) if splits is None else list(splits)
  return [g for g in options if g is None or all(_divides(mesh, g, b) for b in batches)]
