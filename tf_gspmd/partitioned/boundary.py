"""The program's boundary: the given in/out shardings, the mesh and device order it computes in.

Annotations on arguments and outputs (`in_shardings`/`out_shardings`) are checked and
written into the captured program before propagation. A tile assignment no grouping of
the mesh's axes describes makes the program compute on the mesh refined into prime-factor
sub-axes (`program_mesh`); inputs and outputs annotated in another device order than the
mesh's live in that order outside the program (`boundary_layout`), and when they all name
one such order the whole program runs in it (`working_order`).
"""

from __future__ import annotations

from typing import List, Optional

from tf_gspmd.annotations import variable_sharding
from tf_gspmd.graph import ir
from tf_gspmd.graph_rewrite.partitioner import Local, OpRecord
from tf_gspmd.mesh import Mesh
from tf_gspmd.sharding import NamedSharding, P, Sharding, named_for_rank


def given_shardings(given_in, given_out, program: ir.Program) -> list:
  """(sharding, rank) of every given in/out sharding (P specs on the partition's mesh)."""
  main, found = program.main, []
  for given, tensors in ((given_in, program.arg_inputs), (given_out, main.outputs)):
    if given is None or isinstance(given, (Sharding, P)):
      given = [given] * len(tensors)
    for tensor, sharding in zip(tensors, given if isinstance(given, (list, tuple)) else ()):
      shape = main.tensor(tensor).shape
      if isinstance(sharding, Sharding) and shape is not None:
        found.append((sharding, len(shape)))
  return found


class Annotator:
  """Writes the given in/out shardings of `fn`'s program into its main graph."""

  def __init__(self, fn_name: str, user_mesh: Mesh, mesh: Mesh):
    self.fn_name = fn_name
    self.user_mesh = user_mesh  # the mesh a P spec is on
    self.mesh = mesh  # the mesh the program computes on (see program_mesh)

  def arguments(self, program: ir.Program, in_shardings) -> None:
    if in_shardings is None:
      return
    given = self.one_per(in_shardings, program.arg_inputs, 'in_shardings', 'tensor argument')
    for tensor, sharding in zip(program.arg_inputs, given):
      if sharding is not None:
        self.annotate(program.main, tensor, sharding, 'in_shardings')

  def outputs(self, program: ir.Program, out_shardings) -> None:
    if out_shardings is None:
      return
    outs = program.main.outputs
    given = self.one_per(out_shardings, outs, 'out_shardings', 'output')
    for tensor, sharding in zip(outs, given):
      if sharding is not None:
        self.annotate(program.main, tensor, sharding, 'out_shardings')

  def one_per(self, given, tensors, what: str, noun: str) -> list:
    """`given` (one sharding or P for all, or a list) as one entry per tensor of `tensors`."""
    if given is None or isinstance(given, (Sharding, P)):
      return [given] * len(tensors)
    if not isinstance(given, (list, tuple)):
      raise TypeError(
        f'partition({self.fn_name!r}): {what} must be a Sharding, a P or a '
        f'list of them (None: left to propagation), got {given!r}.'
      )
    if len(given) != len(tensors):
      plural = '' if len(tensors) == 1 else 's'
      raise ValueError(
        f'partition({self.fn_name!r}): {len(tensors)} {noun}{plural} {list(tensors)} but '
        f'{len(given)} {what} {list(given)}; give one per {noun} (None: left to propagation).'
      )
    return list(given)

  def annotate(self, graph: ir.Graph, tensor: str, sharding, what: str) -> None:
    t = graph.tensor(tensor)
    where = f'partition({self.fn_name!r}): {what} for {tensor}'
    if isinstance(sharding, P):  # a spec on the partition's own mesh
      try:
        sharding = NamedSharding(self.user_mesh, sharding)
      except ValueError as e:
        raise ValueError(f'{where}: {e}') from None
    if not isinstance(sharding, Sharding):
      raise TypeError(
        f'{where}: expected a Sharding or a P, got {type(sharding).__name__} {sharding!r}.'
      )
    if t.shape is not None:
      sharding.check_shape(t.shape, where)  # the rank first: the clearest error
    try:
      named = named_for_rank(sharding, self.mesh, len(t.shape))
    except ValueError as e:
      raise ValueError(f'{where}: {e}') from None
    if named is None:
      raise ValueError(
        f'partition: {what} for {tensor} gives {sharding}, which no spec on {self.user_mesh} '
        f'says in any device order (its tile dims {list(sharding.tile_shape or ())} are no '
        'grouping of the mesh axes); annotate with shardings over this mesh.'
      )
    named.check_shape(t.shape, f'{what} for {tensor}')
    graph.producer(tensor).annotations[t.index] = named


def check_annotation_devices(program: ir.Program, mesh: Mesh) -> None:
  """Raise a ValueError naming the tensor when an annotation uses devices the mesh lacks."""
  devices = sorted(mesh.devices)
  for graph in program.graphs():
    for node in graph.nodes:
      for index, s in node.annotations.items():
        used = sorted(s.devices)
        if not used or s.is_manual or (s.is_maximal and used[0] in devices) or used == devices:
          continue
        what = f'device {used[0]}' if s.kind == 'maximal' else f'{len(used)} devices {_brief(used)}'
        raise ValueError(
          f'partition: the annotation {s} on {node.name}:{index} ({node.op}) puts the tensor on '
          f'{what}, but the function is partitioned over {mesh} of {mesh.size} devices '
          f"{_brief(devices)}; annotate over exactly the mesh's devices, each once (or one "
          'of them for a single-device sharding).'
        )


def _brief(devices, limit: int = 16) -> str:
  return str(devices) if len(devices) <= limit else str(devices[:limit])[:-1] + ', ...]'


def program_mesh(program: ir.Program, mesh: Mesh, boundary: list) -> Mesh:
  """`mesh`, or its refinement into prime-factor sub-axes when an annotation needs them.

  GSPMD takes any tile assignment; one whose tile dims are no grouping of the
  mesh's axes (tile [2, 2, 2] on a 2x4 mesh, [2, 4] on a 1-D mesh of 8) is
  still a grouping of their prime factors: 'y' of 4 is 'y#0' x 'y#1', the
  same devices in the same order. Then the whole program computes on the
  refined mesh (a P('y') elsewhere is P(('y#0', 'y#1')), the same layout), and
  its collectives name sub-axes. `boundary`: the given in/out shardings
  (`given_shardings`).
  """
  from tf_gspmd.graph_rewrite.reshard import refined_mesh

  fine, _ = refined_mesh(mesh)
  if fine == mesh:
    return mesh
  found = list(boundary)
  for graph in program.graphs():
    for node in graph.nodes:
      for index, sharding in node.annotations.items():
        shape = graph.tensor(node.outputs[index].name).shape
        found.append((sharding, None if shape is None else len(shape)))
  for var in program.variables.values():
    sharding = variable_sharding(var)
    if sharding is not None:
      found.append((sharding, len(var.shape)))
  # The mesh itself first: a search over the refined mesh's many sub-axes is slow (minutes on
  # 64 x 32), and most annotations are spelled on the mesh.
  needs_sub_axes = any(
    rank is not None and not _spelled_on(s, mesh, rank) and _spelled_on(s, fine, rank)
    for s, rank in found
  )
  return fine if needs_sub_axes else mesh


def _spelled_on(sharding: Sharding, mesh: Mesh, rank: int) -> bool:
  try:
    return named_for_rank(sharding, mesh, rank) is not None
  except ValueError:
    return False


def working_order(graph: ir.Graph, propagation, mesh: Mesh, args, variables) -> Mesh:
  """The device order the program computes in: `mesh`'s, or one the annotations name.

  When the inputs, outputs and variables annotated in an order other than the
  mesh's all name one order D (a TPU program written against its own
  hand-ordered mesh), and running in D changes the layout of no input, output
  or variable annotated in the mesh's order (or left to propagation: a
  variable's layout may be fixed by an earlier trace), the whole program runs
  in D: variables are stored in D, and partition p
  is still device p, it just sits elsewhere in the mesh. Those inputs and
  outputs then need no permute at all.
  """
  layouts = [
    (_in_given_order(variable_sharding(var), propagation.target(graph, name), mesh), True)
    for name, var in variables.items()
  ]
  layouts += [
    (
      boundary_layout(graph, name, propagation.target(graph, name), mesh),
      _annotation(graph, name) is not None,
    )
    for name in list(args) + list(graph.outputs)
  ]
  orders = {layout.mesh for layout, _ in layouts if layout.mesh != mesh}
  pinned = [layout for layout, fixed in layouts if fixed and layout.mesh == mesh]
  if len(orders) != 1:
    return mesh
  order = orders.pop()
  return order if all(_on_order(s, order).is_equivalent_to(s) for s in pinned) else mesh


def _on_order(s: NamedSharding, order: Mesh) -> NamedSharding:
  """`s`'s spec (and pending reduction) on another device order of its mesh."""
  if not isinstance(s, NamedSharding) or s.mesh == order:
    return s
  return NamedSharding(order, s.spec, s.partial_axes, s.partial or 'sum')


def in_order(target, order: Mesh):
  """Propagation's `target(graph, tensor)` re-expressed in the program's device order."""
  return lambda graph, tensor: _on_order(target(graph, tensor), order)


def _annotation(graph: ir.Graph, tensor: str):
  t = graph.tensor(tensor)
  return graph.producer(tensor).annotations.get(t.index)


def boundary_layout(
  graph: ir.Graph, tensor: str, target: NamedSharding, mesh: Mesh
) -> NamedSharding:
  """How the program takes or returns `tensor`: `target` in its annotation's device order.

  An argument or output annotated with a tile assignment in another device
  order than the mesh's (a TPU program's hand-ordered device mesh) lives in
  that order outside the program: the launcher splits and assembles it so,
  and the program moves its shards to the mesh's order on entry (or from it
  on exit) with one permute of whole shards. Elsewhere the order changes no
  value, so every op computes in the mesh's order.
  """
  return _in_given_order(_annotation(graph, tensor), target, mesh)


def _in_given_order(given: Optional[Sharding], target: NamedSharding, mesh: Mesh) -> NamedSharding:
  """`target` in the device order `given` (an annotation) names, when that is not `mesh`'s."""
  if given is None or target.partial_axes or target.rank is None:
    return target
  try:
    named = named_for_rank(given, mesh, target.rank)
  except ValueError:
    return target
  if named is None or named.mesh == mesh:
    return target
  there = NamedSharding(named.mesh, target.spec)
  return target if there == target else there


class BoundaryMove:
  """Moves program inputs (outputs) from (to) their annotation's device order.

  It is what `lower_reshard.reshard` asks of a partitioner (the backend and a
  log of collectives): each move gets an OpRecord of its own, so the moves
  show in `collectives()` and `op_records()` like any op's.
  """

  def __init__(self, backend, resharder):
    self.backend = backend
    self.records: List[OpRecord] = []
    self._resharder = resharder

  def note_collective(self, record: dict) -> None:
    self.records[-1].collectives.append(record)

  def __call__(
    self, graph: ir.Graph, tensor: str, value: Local, target: NamedSharding, what: str
  ) -> Local:
    if value.sharding is target:
      return value
    self.records.append(OpRecord(graph.name, tensor, what, 'device order of its annotation'))
    return self._resharder(self, value, target, f'{what} {tensor}: device order')
