"""Public entry point: `tf_gspmd.propagate(fn, *example_args, mesh=...)`.

>>> propagation = propagate(step, x, y, mesh=mesh)   # doctest: +SKIP
>>> propagation.sharding('dense/MatMul:0')            # doctest: +SKIP
NamedSharding(Mesh.create((2, 4), ('data', 'model')), P('data', 'model'))
>>> print(propagation.explain())                      # doctest: +SKIP
"""

from __future__ import annotations

from typing import List, Optional

from tf_gspmd.graph import ir
from tf_gspmd.mesh import Mesh
from tf_gspmd.propagation.propagate import PropagationResult, Provenance, propagate_program
from tf_gspmd.sharding import NamedSharding


class Propagation:
  """The propagated shardings of one captured function (what `propagate` returns).

  `sharding(name)` gives a tensor's NamedSharding (names as in the captured
  graph, 'node:0' or 'node'; inside a library function 'function::node:0'),
  `provenance(name)` where it came from, `explain()` a table of every op,
  `records()` the same as data.
  """

  def __init__(self, program: ir.Program, result: PropagationResult):
    self.program = program
    self.result = result

  @property
  def mesh(self) -> Mesh:
    return self.result.mesh

  def sharding(self, tensor_name: str, graph: Optional[str] = None) -> NamedSharding:
    return self.result.sharding(tensor_name, graph)

  def provenance(self, tensor_name: str, graph: Optional[str] = None) -> Provenance:
    return self.result.provenance_of(tensor_name, graph)

  def shardings(self, graph: Optional[str] = None) -> dict:
    """tensor name -> NamedSharding for one graph (default: the top level)."""
    return dict(self.result.shardings[graph or self.program.main.name])

  @property
  def manual_regions(self):
    """The program's manual regions (`manual.ManualRegions`: each `Region` named, with its
    entries, exits, manual axes and tensors; as a mapping, (graph name, tensor) -> the mesh
    axes the tensor is manual over), found once here; the partitioner reads them."""
    return self.result.manual

  def target(self, graph: ir.Graph, tensor_name: str) -> NamedSharding:
    """`target(graph, tensor)` form the partitioner takes."""
    return self.result.sharding(tensor_name, graph.name)

  def variable_sharding(self, variable) -> Optional[NamedSharding]:
    """The sharding propagation gave a variable (by its resource placeholder), None if not
    captured."""
    from tf_gspmd.annotations import _tf_variable_or_none

    target = _tf_variable_or_none(variable)  # a Keras variable: its tf.Variable
    target = variable if target is None else target
    for tensor, var in self.program.variables.items():
      if var is target or getattr(var, 'handle', None) is getattr(target, 'handle', ()):
        return self.result.sharding(tensor)
    return None

  def records(self) -> List[dict]:
    return self.result.records()

  def explain(self) -> str:
    return self.result.explain()

  @property
  def warnings(self) -> List[str]:
    return list(self.result.warnings)


def propagate(fn, *example_args, mesh: Mesh, **example_kwargs) -> Propagation:
  """Capture `fn` on the example arguments and propagate its annotations over `mesh`.

  `fn` is a tf.function, a ConcreteFunction or a plain Python function;
  annotations are those written with `tf_gspmd.shard`/`annotate`/`mesh_split`
  (or TF's `xla_sharding`) inside it and `tf_gspmd.shard_variable` on variables.
  """
  from tf_gspmd.graph.capture import capture

  if not isinstance(mesh, Mesh):
    raise TypeError(f'propagate: mesh must be a tf_gspmd.Mesh, got {type(mesh).__name__}.')
  program = capture(fn, *example_args, **example_kwargs)
  return Propagation(program, propagate_program(program, mesh))


def propagate_captured(program: ir.Program, mesh: Mesh) -> Propagation:
  """Propagate over an already captured (or hand-built) program."""
  return Propagation(program, propagate_program(program, mesh))
