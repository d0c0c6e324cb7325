"""Manual regions: the tensors each partition computes on by hand.

TF writes a manual region as XLA reads it. `XlaSpmdFullToShardShape` turns a
full-shaped tensor, laid out by its `manual_sharding`, into this partition's
shard; the ops after it run per partition on shards (with explicit collectives
such as `CrossReplicaSum`); `XlaSpmdShardToFullShape` turns shards back into a
full-shaped tensor of that layout. With `dim=-1` the region is manual over every
mesh axis; with `dim=d` only over the mesh axes splitting dim `d`, and the other
axes stay automatic inside it (propagated and partitioned as usual, on the
region's shard-shaped tensors). `tg.shard_map` writes the same ops and names its
manual axes in the attr `_tf_gspmd_manual_axes`.

`regions(program, mesh)` finds the regions once, as `Region` objects: each is
named (`manual_region_0`, ...), with its graph, the mesh axes it is manual over,
its entries (the `XlaSpmdFullToShardShape` ops, and `tg.axis_index`'s custom
calls), its exits and every tensor computed inside it: forward from each entry,
through every op with a manual operand, up to the exits, entries whose values
meet in one op joining one region. The `ManualRegions` it returns maps a
tensor to its axes and to its region; propagation reads it (a region is a
boundary: its in and out layouts are fixed by its entry and exit ops) and hands
the same object to the partitioner, which computes the region's ops on
per-partition values and names the region in the collectives written inside
it. `boundary(node, graph, mesh)` reads an entry or exit op.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Dict, FrozenSet, Iterator, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from tf_gspmd.graph import ir
from tf_gspmd.mesh import Mesh
from tf_gspmd.shard_map import ALL_GATHER_TARGET, AXIS_INDEX_TARGET, CHECK_ATTR, MANUAL_AXES_ATTR
from tf_gspmd.sharding import MANUAL, NamedSharding, Sharding, named_for_rank

ENTER = 'XlaSpmdFullToShardShape'
EXIT = 'XlaSpmdShardToFullShape'

Key = Tuple[str, str]
ManualAxes = Mapping[Key, Tuple[str, ...]]  # (graph, tensor) -> the mesh axes it is manual over
__all__ = ['ALL_GATHER_TARGET', 'AXIS_INDEX_TARGET', 'CHECK_ATTR', 'MANUAL_AXES_ATTR']


class ManualRegionError(ValueError):
  """A manual region that cannot be partitioned as written."""


@dataclasses.dataclass(frozen=True)
class Boundary:
  """An entry (`XlaSpmdFullToShardShape`) or exit (`XlaSpmdShardToFullShape`) of a region.

  `sharding` is the full-shaped tensor's layout (manual axes included); `manual`
  the mesh axes the region is manual over, in mesh order; `region_spec[d]` the
  automatic axes the region's shard-shaped value keeps on dim d (fixed unless d is
  in `open_dims`); `region_shape` the shard shape every partition computes on.
  """

  node: str
  op: str
  sharding: NamedSharding
  manual: Tuple[str, ...]
  region_spec: Tuple[Tuple[str, ...], ...]
  open_dims: Tuple[int, ...]
  full_shape: Tuple[int, ...]
  region_shape: Tuple[int, ...]

  def manual_on(self, dim: int) -> Tuple[str, ...]:
    """The manual axes splitting dim `dim` of the full-shaped tensor (major first)."""
    return tuple(a for a in self.sharding.spec.axes_of(dim) if a in self.manual)

  def describe(self) -> str:
    return (
      f'{self.op} {self.node} (layout {self.sharding}, manual over mesh axes '
      f'{self.manual}, full shape {list(self.full_shape)}, shard shape '
      f'{list(self.region_shape)})'
    )


def is_manual_sharding(s: Optional[Sharding]) -> bool:
  """Whether `s` marks a tensor as manual (all of it, or over subgroup dims)."""
  return s is not None and (s.is_manual or MANUAL in s.subgroups)


def _raw_attr(node: ir.Node, name: str):
  value = node.attrs.get(name)
  if value is None:
    return None
  return value.s if value.WhichOneof('value') == 's' else value


def _int_attr(node: ir.Node, name: str, default: int) -> int:
  value = node.attrs.get(name)
  return default if value is None or value.WhichOneof('value') != 'i' else int(value.i)


def _ints_attr(node: ir.Node, name: str) -> Tuple[int, ...]:
  value = node.attrs.get(name)
  if value is None or not value.HasField('list'):
    return ()
  return tuple(int(i) for i in value.list.i)


def manual_axes_attr(node: ir.Node) -> Optional[Tuple[str, ...]]:
  """The manual axes `tg.shard_map` wrote on an entry or exit op, or None."""
  value = node.attrs.get(MANUAL_AXES_ATTR)
  if value is None or not value.HasField('list'):
    return None
  return tuple(s.decode() for s in value.list.s)


def custom_target(node: ir.Node) -> str:
  raw = _raw_attr(node, 'target_name')
  return raw.decode() if isinstance(raw, bytes) else ''


def custom_config(node: ir.Node) -> dict:
  import json

  raw = _raw_attr(node, 'backend_config')
  return json.loads(raw.decode()) if isinstance(raw, bytes) and raw else {}


def boundary(node: ir.Node, graph: ir.Graph, mesh: Mesh) -> Boundary:
  """Read an entry or exit op of a manual region (a ManualRegionError names what is wrong)."""
  from tf_gspmd import op_sharding

  what = f'{node.op} {node.name}'
  if node.op == ENTER:
    shape = graph.tensor(node.inputs[0]).shape
  else:
    full = node.attrs['full_shape'].shape
    shape = None if full.unknown_rank else tuple(d.size for d in full.dim)
  if shape is None or any(d is None or d < 0 for d in shape):
    raise ManualRegionError(f'{what}: the full shape {shape} must be static.')
  shape = tuple(int(d) for d in shape)
  raw = _raw_attr(node, 'manual_sharding') or b''
  sharding = op_sharding.from_proto(raw) if raw else Sharding.replicated()
  named = None
  if not is_manual_sharding(sharding):
    try:
      named = named_for_rank(sharding, mesh, len(shape))
    except ValueError:
      named = None
  if named is None or named.mesh != mesh:
    raise ManualRegionError(
      f'{what}: its manual_sharding {sharding} is no layout of this rank-{len(shape)} tensor '
      f'on mesh {mesh} in the mesh device order; a manual region splits a tensor over the '
      "mesh's axes, device p holding shard p."
    )
  given = manual_axes_attr(node)
  dim = _int_attr(node, 'dim', -1)
  if given is not None:
    unknown = [a for a in given if a not in mesh.axis_names]
    if unknown:
      raise ManualRegionError(f'{what}: manual axes {unknown} are not axes of mesh {mesh}.')
    manual = tuple(a for a in mesh.axis_names if a in given)
  elif dim < 0:
    manual = tuple(mesh.axis_names)
  else:
    if dim >= len(shape):
      raise ManualRegionError(f'{what}: dim={dim} is out of range for shape {list(shape)}.')
    manual = tuple(a for a in mesh.axis_names if a in named.spec.axes_of(dim))
  region_spec, region_shape = [], []
  for d, size in enumerate(shape):
    axes = named.spec.axes_of(d)
    on = [a for a in axes if a in manual]
    if tuple(axes[: len(on)]) != tuple(on):
      raise ManualRegionError(
        f'{what}: dim {d} is split over mesh axes {axes}, the manual ones {tuple(on)} not '
        'major: a manual shard must be one contiguous block of the dim.'
      )
    region_spec.append(tuple(a for a in axes if a not in manual))
    region_shape.append(-(-size // mesh.axes_size(tuple(on))) if on else size)
  open_dims = _ints_attr(node, 'unspecified_dims')
  return Boundary(
    node.name,
    node.op,
    named,
    manual,
    tuple(region_spec),
    tuple(int(d) for d in open_dims),
    shape,
    tuple(region_shape),
  )


@dataclasses.dataclass(frozen=True)
class Region:
  """One manual region: where it is entered and left, and what is computed inside it.

  `entries`: the nodes making its first per-partition values (`XlaSpmdFullToShardShape`,
  `tg.axis_index`'s custom call); `exits`: its `XlaSpmdShardToFullShape` nodes;
  `tensors`: every tensor inside it (the entries' results included).
  """

  name: str
  graph: str
  axes: Tuple[str, ...]
  entries: Tuple[str, ...]
  exits: Tuple[str, ...]
  tensors: FrozenSet[str]

  def describe(self) -> str:
    return (
      f'{self.name} (manual over mesh axes {self.axes}; entered at {list(self.entries)}, '
      f'left at {list(self.exits)})'
    )


class ManualRegions(Mapping[Key, Tuple[str, ...]]):
  """Every manual region of a program, found once (`regions`).

  As a mapping: (graph name, tensor) -> the mesh axes the tensor is manual over, for
  every tensor inside a region; `region_of_tensor` gives the `Region` itself.
  """

  def __init__(self, regions: Sequence[Region] = ()):
    self.regions: Tuple[Region, ...] = tuple(regions)
    self._of: Dict[Key, Region] = {(r.graph, t): r for r in self.regions for t in r.tensors}

  def __getitem__(self, key: Key) -> Tuple[str, ...]:
    return self._of[key].axes

  def __iter__(self) -> Iterator[Key]:
    return iter(self._of)

  def __len__(self) -> int:
    return len(self._of)

  def region_of_tensor(self, graph: str, tensor: str) -> Optional[Region]:
    return self._of.get((graph, tensor))


def regions(program: ir.Program, mesh: Mesh) -> ManualRegions:
  """Every manual region of `program` (see the module doc), each found once."""
  found: List[Region] = []
  for graph in program.graphs():
    found.extend(_flood(graph, mesh))
  named = [dataclasses.replace(r, name=f'manual_region_{i}') for i, r in enumerate(found)]
  return ManualRegions(named)


class _Members:
  """The regions of one graph as they are found: union-find over region ids (two
  entries whose values meet in one op are one region)."""

  def __init__(self):
    self.parent: List[int] = []
    self.axes: List[Tuple[str, ...]] = []
    self.of: Dict[str, int] = {}  # tensor -> region id
    self.entries: Dict[int, List[str]] = {}
    self.exits: Dict[int, List[str]] = {}

  def new(self, axes: Tuple[str, ...], entry: str) -> int:
    self.parent.append(len(self.parent))
    self.axes.append(axes)
    self.entries[len(self.parent) - 1] = [entry]
    return len(self.parent) - 1

  def root(self, i: int) -> int:
    while self.parent[i] != i:
      self.parent[i] = self.parent[self.parent[i]]
      i = self.parent[i]
    return i

  def axes_of(self, tensor: str) -> Optional[Tuple[str, ...]]:
    i = self.of.get(tensor)
    return None if i is None else self.axes[i]

  def join(self, tensors: Sequence[str]) -> int:
    roots = sorted({self.root(self.of[t]) for t in tensors})
    for r in roots[1:]:
      self.parent[r] = roots[0]
    return roots[0]

  def regions(self, graph: str) -> List[Region]:
    members: Dict[int, List[str]] = {}
    for tensor, i in self.of.items():
      members.setdefault(self.root(i), []).append(tensor)
    joined: Dict[int, List[int]] = {}  # root -> the ids joined into it
    for i in range(len(self.parent)):
      joined.setdefault(self.root(i), []).append(i)
    out = []
    for r in sorted(members):
      ids = joined[r]
      entries = tuple(e for i in ids for e in self.entries.get(i, ()))
      exits = tuple(e for i in ids for e in self.exits.get(i, ()))
      out.append(Region('', graph, self.axes[r], entries, exits, frozenset(members[r])))
    return out


def _flood(graph: ir.Graph, mesh: Mesh) -> List[Region]:
  found = _Members()
  for node in graph.nodes:
    inside = [t for t in node.inputs if t in found.of]
    ins = {found.axes_of(t) for t in inside}
    if node.op == ENTER:
      b = boundary(node, graph, mesh)
      if ins:
        raise ManualRegionError(
          f'{node.op} {node.name}: its operand is already inside a manual region '
          f'(manual over {sorted(ins)}); nested manual regions are not supported.'
        )
      found.of[node.outputs[0].name] = found.new(b.manual, node.name)
      continue
    if node.op == EXIT:
      b = boundary(node, graph, mesh)
      if ins and ins != {b.manual}:
        raise ManualRegionError(
          f'{node.op} {node.name}: its operand is manual over mesh axes {sorted(ins)[0]}, '
          f'but its manual_sharding makes it leave a region manual over {b.manual}.'
        )
      if inside:
        found.exits.setdefault(found.join(inside), []).append(node.name)
      continue
    if custom_target(node) == AXIS_INDEX_TARGET:
      axes = tuple(custom_config(node).get('region', ()))
      found.of[node.outputs[0].name] = found.new(axes, node.name)
      continue
    if _per_output(node):  # IdentityN (tf.custom_gradient's): result i is operand i
      for t, out in zip(node.inputs, node.outputs):
        if t in found.of:
          found.of[out.name] = found.of[t]
      continue
    annotated = [s for s in node.annotations.values() if is_manual_sharding(s)]
    if not ins:
      if annotated:
        raise ManualRegionError(
          f'{node.op} {node.name}: annotated with the manual sharding {annotated[0]}, but '
          f'its operands {node.inputs} are not inside a manual region; enter one with '
          'XlaSpmdFullToShardShape (xla_sharding.auto_to_manual_spmd_partition) first.'
        )
      continue
    if len(ins) > 1:
      raise ManualRegionError(
        f'{node.op} {node.name}: its operands come from manual regions over different mesh '
        f'axes ({sorted(ins)}); leave one region before entering another.'
      )
    (axes,) = ins
    if node.called_functions():
      raise ManualRegionError(
        f'{node.op} {node.name}: calls a function ({node.called_functions()}) inside a '
        f'manual region over {axes}; control flow and function calls inside a manual region '
        'are not supported yet: unroll the loop or move the region inside the function.'
      )
    for s in annotated:
      if s.is_manual and axes != tuple(mesh.axis_names):
        raise ManualRegionError(
          f'{node.op} {node.name}: annotated fully manual ({s}) inside a region manual only '
          f'over {axes} of mesh {mesh}.'
        )
    region = found.join(inside)
    for out in node.outputs:
      found.of[out.name] = region
  return found.regions(graph.name)


def _per_output(node: ir.Node) -> bool:
  from tf_gspmd.propagation import registry

  return registry.entry_of(node.op).local == 'identity_n'


def per_output(node: ir.Node) -> bool:
  """Whether result i of `node` is its operand i, each where it was (no computation)."""
  return _per_output(node)


def region_of(found: ManualAxes, graph: ir.Graph, node: ir.Node):
  """The manual axes of the region `node` computes in (from its results), or ()."""
  for out in node.outputs:
    axes = found.get((graph.name, out.name))
    if axes:
      return axes
  return ()


def axes_of_groups(mesh: Mesh, groups, what: str) -> Tuple[str, ...]:
  """The mesh axes (in group-member order) whose groups are exactly `groups`.

  `groups` is a [G, k] array of partition ids, as TF's `group_assignment`
  lists them (XLA's replica groups); member order is position order.
  """
  arr = np.asarray(groups, dtype=np.int64)
  if arr.ndim != 2:
    raise ManualRegionError(f'{what}: group_assignment must be 2-D, got shape {arr.shape}.')
  if arr.shape[1] == 1 and sorted(arr.reshape(-1).tolist()) == list(range(mesh.size)):
    return ()
  covered = sorted(arr.reshape(-1).tolist())
  if covered != list(range(mesh.size)):
    raise ManualRegionError(
      f'{what}: group_assignment {arr.tolist()} does not put each of the {mesh.size} '
      'partitions in exactly one group. (tpu_ops.cross_replica_sum without a '
      'group_assignment outside a TPU context gives [[0]]: pass one, e.g. '
      f'[{list(range(mesh.size))}].)'
    )
  want = {tuple(row) for row in arr.tolist()}
  names = mesh.axis_names
  for n in range(1, len(names) + 1):
    for axes in itertools.permutations(names, n):
      if mesh.axes_size(axes) != arr.shape[1]:
        continue
      have = set(mesh.groups(axes))
      if have == want:
        return tuple(axes)
  raise ManualRegionError(
    f'{what}: group_assignment {arr.tolist()} is not the groups of any mesh axes of mesh '
    f'{mesh} (axes {names}, shape {mesh.shape}); write groups along mesh axes (e.g. '
    f'{[list(g) for g in mesh.groups((names[-1],))]} for {names[-1]!r}).'
  )


def region_size(mesh: Mesh, axes: Sequence[str]) -> int:
  return math.prod(mesh.axis_size(a) for a in axes)


def manual_axes_list(found: ManualAxes) -> List[Tuple[str, ...]]:
  return sorted(set(found.values()))


# --- replication a region can be seen to produce -------------------------------------
def check_replication(program: ir.Program, mesh: Mesh, found: ManualAxes) -> None:
  """Refuse an exit asserting replication over manual axes (`tg.shard_map`'s out spec leaving
  them out, with `check`) whose value the graph does not show to be replicated over them."""
  for graph in program.graphs():
    seen: Dict[str, frozenset] = {}
    for node in graph.nodes:
      flag = node.attrs.get(CHECK_ATTR)
      if node.op != EXIT or flag is None or not flag.b:
        continue
      b = boundary(node, graph, mesh)
      need = [a for a in b.manual if a not in b.sharding.spec.used_axes()]
      have = _replicated(graph, node.inputs[0], mesh, found, seen)
      missing = [a for a in need if a not in have]
      if missing:
        source = graph.producer(node.inputs[0])
        raise ManualRegionError(
          f'{node.op} {node.name}: the out spec {b.sharding.spec} leaves mesh axes {missing} '
          f'out, asserting the value ({source.op} {source.name}, shape '
          f'{list(b.region_shape)}) is the same on each of their members, but it is not seen '
          f'to be: psum or all_gather it over {missing}, name them in the out spec, or pass '
          'check=False.'
        )


def _replicated(graph: ir.Graph, tensor: str, mesh: Mesh, found, seen) -> frozenset:
  """The manual axes over which every member holds the same `tensor`."""
  if tensor in seen:
    return seen[tensor]
  region = found.get((graph.name, tensor))
  every = frozenset(mesh.axis_names)
  if not region:
    seen[tensor] = every  # a value outside any region is the same everywhere
    return every
  seen[tensor] = frozenset()
  node = graph.producer(tensor)
  if _per_output(node):
    index = ir.split_tensor_name(tensor)[1]
    seen[tensor] = _replicated(graph, node.inputs[index], mesh, found, seen)
  else:
    seen[tensor] = _replicated_by(graph, node, mesh, found, seen, every)
  return seen[tensor]


def _replicated_by(graph, node, mesh, found, seen, every) -> frozenset:
  from tf_gspmd.graph import static_values
  from tf_gspmd.propagation import registry

  if node.op == ENTER:
    b = boundary(node, graph, mesh)
    return every - set(b.sharding.spec.used_axes())
  entry = registry.entry_of(node.op)
  params = entry.local_params
  target = custom_target(node)
  if target == AXIS_INDEX_TARGET:
    return every - set(custom_config(node).get('axes', ()))
  data = [t for t in node.inputs if not _is_handle(graph, t)]
  if target == ALL_GATHER_TARGET:
    return _replicated(graph, data[0], mesh, found, seen) | set(custom_config(node)['axes'])
  if params.get('replicates') or params.get('moves'):
    groups = registry.RuleContext(graph).const(node.inputs[1])
    axes: Tuple[str, ...] = ()
    if groups is not None and not params.get('kind') == 'permute':
      axes = axes_of_groups(mesh, groups, f'{node.op} {node.name}')
    elif groups is not None:
      pairs = np.asarray(groups).reshape(-1, 2)
      axes = tuple(
        a for a in mesh.axis_names if any(mesh.coords(s)[a] != mesh.coords(d)[a] for s, d in pairs)
      )
    have = _replicated(graph, data[0], mesh, found, seen)
    return have | set(axes) if params.get('replicates') else have - set(axes)
  op_def = static_values.op_def(node.op)
  if op_def is not None and op_def.is_stateful and entry.resource != registry.RESOURCE_READS:
    return frozenset()  # a random draw (or any stateful op) may differ per member
  result = every
  for t in data:
    result &= _replicated(graph, t, mesh, found, seen)
  return result


def _is_handle(graph: ir.Graph, tensor: str) -> bool:
  from tf_gspmd.propagation.registry import is_resource

  return is_resource(graph.tensor(tensor).dtype)


# --- collectives written inside regions, checked before anything is traced ---------------
def check_collectives(program: ir.Program, mesh: Mesh, found: ManualAxes) -> None:
  """Refuse a collective written by hand that cannot run as written: outside any region,
  over an axis not manual in its region, groups that are no mesh axes' groups, a permute
  that is not a permutation, a split the group does not divide; and an exit whose operand is
  not the shard shape of its full shape."""
  from tf_gspmd.propagation import registry

  for graph in program.graphs():
    ctx = registry.RuleContext(graph)
    for node in graph.nodes:
      what = f'{node.op} {node.name}'
      if node.op == EXIT:
        b = boundary(node, graph, mesh)
        have = graph.tensor(node.inputs[0]).shape
        if have is not None and tuple(have) != b.region_shape:
          raise ManualRegionError(
            f'{b.describe()}: its operand has shape {list(have)}, but the full shape '
            f'{list(b.full_shape)} split by {b.sharding} over the manual axes gives shards of '
            f'{list(b.region_shape)}; the full shape must be what the shard shape divides into.'
          )
        continue
      entry = registry.entry_of(node.op)
      if entry.local != 'manual_collective':
        continue
      region = region_of(found, graph, node)
      axes = collective_axes(node, ctx, mesh, entry.local_params)
      outside = [a for a in axes if a not in region]
      if outside or (not region and node.inputs):
        raise ManualRegionError(
          f'{what}: a collective over mesh axes {tuple(axes)}, but '
          + (
            f'{outside} are not manual in this region (manual over {region})'
            if region
            else 'it is in no manual region'
          )
          + f" of mesh {mesh}; collectives written by hand run over a manual region's axes "
          'only.'
        )
      _check_sizes(node, ctx, mesh, entry.local_params, axes)


def collective_axes(node: ir.Node, ctx, mesh: Mesh, params) -> Tuple[str, ...]:
  """The mesh axes a collective written by hand runs over (read from its constant groups)."""
  what = f'{node.op} {node.name}'
  kind = params.get('kind')
  if kind == 'custom_call':
    target = custom_target(node)
    if target not in (ALL_GATHER_TARGET, AXIS_INDEX_TARGET):
      raise ManualRegionError(
        f'{what}: custom call target {target!r} has no kernel outside XLA on TPU, and '
        "tf_gspmd runs tg.shard_map's own targets only."
      )
    return tuple(custom_config(node)['axes'])
  value = ctx.const(node.inputs[1])
  if value is None:
    raise ManualRegionError(
      f'{what}: its group assignment {node.inputs[1]} is not known before the program '
      'runs; write it as a constant.'
    )
  if kind == 'permute':
    pairs = np.asarray(value, np.int64).reshape(-1, 2)
    srcs, dsts = pairs[:, 0].tolist(), pairs[:, 1].tolist()
    if (
      (pairs < 0).any()
      or (pairs >= mesh.size).any()
      or len(set(srcs)) != len(srcs)
      or len(set(dsts)) != len(dsts)
    ):
      raise ManualRegionError(
        f'{what}: source_target_pairs {pairs.tolist()} are not a permutation of partitions '
        f'0..{mesh.size - 1}: each is a source at most once and a target at most once.'
      )
    return tuple(
      a
      for a in mesh.axis_names
      if any(mesh.coords(int(s))[a] != mesh.coords(int(d))[a] for s, d in pairs)
    )
  return axes_of_groups(mesh, value, what)


def _check_sizes(node: ir.Node, ctx, mesh: Mesh, params, axes) -> None:
  kind = params.get('kind')
  k = mesh.axes_size(axes)
  shape = ctx.shape(node.inputs[0]) if node.inputs else None
  what = f'{node.op} {node.name}'
  if kind == 'all_to_all':
    from tf_gspmd.propagation.registry import attr

    split, count = int(attr(node, 'split_dimension', 0)), int(attr(node, 'split_count', 0))
    if count != k or (shape is not None and shape[split] % k):
      raise ManualRegionError(
        f'{what}: split_count {count} over mesh axes {axes} (group size {k}); '
        f'split_dimension {split} of shape {list(shape or ())} must divide into the group.'
      )
  if kind == 'reduce_scatter':
    dim = ctx.const_ints(node.inputs[2])
    if dim is None or (shape is not None and shape[dim[0]] % k):
      raise ManualRegionError(
        f'{what}: scatter_dimension {dim} of shape {list(shape or ())} must be a constant '
        f'dim that divides into the {k} members of mesh axes {axes}.'
      )
