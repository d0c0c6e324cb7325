"""Capture -> annotate -> propagate -> the per-partition program, for one call signature.

`capture_annotated` captures the function and writes the given in/out shardings into
its graph; propagation then chooses every tensor's layout (`propagation.api`); `build`
gives each variable its shards and writes the per-partition program: the partitioner
run over the main graph, with the boundary moves into and out of the device order the
program computes in. Running it is an executor's job (`tf_executor`, `xla_executor`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, List, Optional

import tensorflow as tf

from tf_gspmd.graph import ir
from tf_gspmd.graph_rewrite.partitioner import Local, OpRecord, Partitioner
from tf_gspmd.mesh import Mesh
from tf_gspmd.partitioned import boundary
from tf_gspmd.sharding import NamedSharding


@dataclasses.dataclass
class Compiled:
  """One call signature's program: captured, propagated and partitioned (not yet run)."""

  program: ir.Program
  propagation: Any  # propagation.api.Propagation
  # The executor's program made ready to run (`Executor.prepare`): a runtime.SpmdProgram on
  # the TF backend, an XlaRun (export, executable, capture buffers) on XLA; None until then.
  prepared: Any
  arg_shardings: List[NamedSharding]
  capture_values: List[Any]
  variables: List[Any]  # the original tf.Variables, in program order
  op_records: List[OpRecord]
  per_partition: Any = None  # fn(ctx, *local args, captures, variables): the SPMD program
  local_specs: List[Any] = dataclasses.field(default_factory=list)  # shard specs of args+captures
  out_shardings: List[Any] = dataclasses.field(default_factory=list)
  out_shapes: List[tuple] = dataclasses.field(default_factory=list)
  mesh: Optional[Mesh] = None  # the mesh the program computes on (see boundary.program_mesh)
  capture_shardings: List[NamedSharding] = dataclasses.field(default_factory=list)
  # The shards of each variable the program was built for: a call finds them moved (another
  # program needed another layout) when the variable's holder is another object now.
  holders: List[Any] = dataclasses.field(default_factory=list)
  _written: Optional[List[Any]] = None  # written_variables(), once computed

  def written_variables(self) -> List[Any]:
    """The variables a call may write: every one whose handle reaches an op other than a read
    (an assignment, an optimizer's apply, a function or loop taking the handle)."""
    if self._written is None:
      graph = self.program.main
      self._written = [
        var
        for name, var in self.program.variables.items()
        if any(graph.node(node).op not in _READS for node, _ in graph.consumers(name))
      ]
    return self._written


# Ops that only read the variable whose handle they take.
_READS = frozenset({'ReadVariableOp', 'ResourceGather', 'ResourceGatherNd', 'VariableShape'})


def capture_annotated(fn, args, mesh: Mesh, in_shardings, out_shardings, fn_name: str):
  """`fn` captured for `args`, its arguments and outputs annotated as given.

  Returns `(program, program_mesh)`: the mesh it computes on is `mesh`, or its
  refinement when an annotation needs sub-axes (`boundary.program_mesh`).
  """
  from tf_gspmd.graph.capture import capture

  program = capture(fn, *args)
  _pin_held_layouts(program, mesh)
  boundary.check_annotation_devices(program, mesh)
  given = boundary.given_shardings(in_shardings, out_shardings, program)
  computes_on = boundary.program_mesh(program, mesh, given)
  annotator = boundary.Annotator(fn_name, mesh, computes_on)
  annotator.arguments(program, in_shardings)
  annotator.outputs(program, out_shardings)
  return program, computes_on


def _pin_held_layouts(program: ir.Program, mesh: Mesh) -> None:
  """A variable held as shards on this mesh (by an earlier program) and not annotated keeps
  that layout here too, as if annotated with it: programs over one state agree on it instead
  of moving its shards at every switch between them."""
  from tf_gspmd.program import held

  for placeholder, variable in program.variables.items():
    sharding = held.held_sharding(variable)
    if placeholder in program.variable_shardings or not isinstance(sharding, NamedSharding):
      continue
    if sharding.mesh != mesh:
      continue
    program.variable_shardings[placeholder] = sharding
    node, index = ir.split_tensor_name(placeholder)
    program.main.node(node).annotations[index] = sharding


def refuse_python_callbacks(program: ir.Program, executor, name: str) -> None:
  """Refuse, naming the op, a Python callback (tf.py_function, tf.numpy_function) the
  partitioned program could not run as plain TF does.

  On an executor that cannot run them (backend='xla': an XLA program cannot call back into
  Python): any. On the TF backend: a tf.py_function's gradient. TF pairs it with the forward
  call through a tape it keeps per py_function (and pops once per gradient call); the
  partitioned program runs the callback on every partition, so the N gradient calls find one
  tape, or none (a KeyError, or a collective that hangs, depending on the order the devices
  ran in).
  """
  from tf_gspmd.tf_private import is_py_function_gradient

  for graph in program.graphs():
    for node in graph.nodes:
      if node.op not in ('EagerPyFunc', 'PyFunc', 'PyFuncStateless'):
        continue
      executor.check_python_callback(node.op, node.name, name)
      token = node.attrs.get('token')
      if token is not None and is_py_function_gradient(token.s.decode()):
        # TF's gradient runs under a control dependency on the forward call.
        forward = [
          c for c in node.control_inputs if graph.has_node(c) and graph.node(c).op == node.op
        ]
        raise ValueError(
          f'partition {name}: node {node.name} is the gradient of a tf.py_function (op type '
          f'{node.op}, in graph {graph.name}; the forward call: node '
          f'{" or ".join(forward) or "unknown"}). A partitioned program runs a Python callback '
          'on every partition, and TF pairs a py_function with its gradient through one tape '
          'per function, which the partitions would share. Give the function a gradient of TF '
          'ops (tf.custom_gradient), or keep the py_function out of what is differentiated '
          '(tf.stop_gradient on its result).'
        )


def build(
  program: ir.Program,
  propagation,
  program_mesh: Mesh,
  *,
  executor,
  shard_variable: Callable,
  sharded_variables: dict,
  phase: Callable[[str], None],
  name: str,
  check_fits: Optional[Callable[[list], None]] = None,
) -> Compiled:
  """The per-partition program of `program` as `propagation` lays it out (`prepared` left to
  the caller).

  `shard_variable(var, sharding)` gives a variable its shards (kept in
  `sharded_variables`, keyed by the variable's id); `executor`: the backend's
  `executors.Executor`; `phase(text)` names the build
  phase a first call is in; `check_fits(layouts)` refuses layouts whose shards would not
  fit the devices, before any is made.
  """
  main = program.main
  arg_names, capture_names = list(program.arg_inputs), list(program.captures)
  var_names = list(program.variables)
  variables = [program.variables[n] for n in var_names]
  mesh = program_mesh
  mesh = executor.working_mesh(main, propagation, mesh, arg_names, program.variables)
  target = (
    propagation.target if mesh == program_mesh else boundary.in_order(propagation.target, mesh)
  )
  arg_targets = [target(main, n) for n in arg_names]
  # Inputs and outputs keep the device order their annotation names (see boundary_layout).
  arg_shardings = [
    boundary.boundary_layout(main, n, s, mesh) for n, s in zip(arg_names, arg_targets)
  ]
  capture_shardings = [target(main, n) for n in capture_names]
  if check_fits is not None:  # before any shard is made
    check_fits(
      [(v.name, tuple(v.shape), v.dtype, target(main, n)) for n, v in zip(var_names, variables)]
    )
  for var_name, var in zip(var_names, variables):
    shard_variable(var, target(main, var_name))
  arg_shapes = [tuple(main.tensor(n).shape) for n in arg_names + capture_names]
  _check_static_outputs(main)
  out_targets = [target(main, t) for t in main.outputs]
  out_shardings = [
    boundary.boundary_layout(main, t, s, mesh) for t, s in zip(main.outputs, out_targets)
  ]
  op_records: List[OpRecord] = []
  per_partition = _per_partition_function(
    program,
    target,
    propagation.manual_regions,
    mesh,
    inputs=(arg_names + capture_names, arg_shardings + capture_shardings, arg_shapes),
    input_targets=arg_targets + capture_shardings,
    variables=(var_names, [(sharded_variables[id(v)].sharding, tuple(v.shape)) for v in variables]),
    out_shardings=out_shardings,
    op_records=op_records,
    phase=phase,
    running=executor.running_phase(mesh),
  )
  per_partition.__name__ = name
  local_specs = [
    tf.TensorSpec(s.shard_shape(shape), main.tensor(n).dtype)
    for n, s, shape in zip(arg_names + capture_names, arg_shardings + capture_shardings, arg_shapes)
  ]
  return Compiled(
    program,
    propagation,
    None,
    arg_shardings,
    [program.captures[n] for n in capture_names],
    variables,
    op_records,
    per_partition,
    local_specs,
    out_shardings,
    [tuple(main.tensor(t).shape) for t in main.outputs],
    mesh=mesh,
    capture_shardings=capture_shardings,
  )


def _check_static_outputs(main: ir.Graph) -> None:
  """Refuse an output whose shape is known only at run time, naming the op that made it."""
  for t in main.outputs:
    shape = main.tensor(t).shape
    if shape is None or None in shape:
      maker = _through_identities(main, t)
      raise ValueError(
        f'partition: output {t} ({main.producer(t).op}, made by {maker.name} of type '
        f'{maker.op}) has shape {shape}, known only at run time; a partitioned function '
        'returns tensors of static shape.'
      )


def _through_identities(graph: ir.Graph, tensor: str) -> ir.Node:
  """The op that made `tensor`, looking through Identity and XlaSharding ops."""
  node = graph.producer(tensor)
  while node.op in ('Identity', 'XlaSharding') and node.inputs:
    node = graph.producer(node.inputs[0])
  return node


def _per_partition_function(
  program: ir.Program,
  target,
  manual_regions,
  mesh: Mesh,
  *,
  inputs,
  input_targets,
  variables,
  out_shardings,
  op_records: list,
  phase,
  running: str,
):
  """`per_partition(ctx, *local)`: the partitioner run over the main graph for one partition.

  `inputs`: (names, shardings the program takes them in, global shapes) of the
  arguments and captures, which the program moves to `input_targets` on entry;
  `variables`: (names, (sharding, shape) of each). The records of every op and move
  land in `op_records`; `running` is the phase named once the program is written.
  """
  from tf_gspmd.graph_rewrite import coalesce, dispatch, lower_reshard

  main = program.main
  names, shardings, shapes = inputs
  var_names, var_layouts = variables

  @tf.autograph.experimental.do_not_convert  # plain Python emitting ops: no autograph
  def per_partition(ctx, *local):
    phase('partitioning the program')
    n_args = len(shapes)
    values = [Local(t, s, shape) for t, s, shape in zip(local[:n_args], shardings, shapes)]
    bound = {
      name: Local(v.handle, s, shape)
      for name, v, (s, shape) in zip(var_names, local[n_args:], var_layouts)
    }
    partitioner = Partitioner(
      program,
      target,
      mesh,
      ctx.collectives,
      lower_reshard.reshard,
      dispatch.lookup,
      coalesce.coalescer(),
      manual_regions,
    )
    move = boundary.BoundaryMove(ctx.collectives, lower_reshard.reshard)
    values = [move(main, n, v, s, 'argument') for n, v, s in zip(names, values, input_targets)]
    bound.update(zip(names, values))
    outs = partitioner.run_graph(main, [], bound)
    entry = list(move.records)
    outs = [move(main, t, v, s, 'output') for t, v, s in zip(main.outputs, outs, out_shardings)]
    op_records[:] = entry + partitioner.records + move.records[len(entry) :]
    phase(running)
    return [o.tensor for o in outs]

  return per_partition
