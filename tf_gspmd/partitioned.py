"""`tf_gspmd.partition`: an annotated tf.function as one SPMD program on a mesh.

The data flow, one stage per module:
capture (`graph_rewrite.capture`) -> propagate (`propagation`) -> partition
(`graph_rewrite.partitioner` and its handlers, with reshards planned by
`graph_rewrite.reshard` and lowered by `graph_rewrite.lower_reshard`) ->
run (`runtime.SpmdProgram`: one per-partition program launched on every device).

Variables the function touches live sharded across the devices between calls
(`ShardedVariable`s, laid out as propagation decided); `sync_variables()`
copies their global values back into the original `tf.Variable`s and
`scatter_variables()` sends changed originals out again.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional, Sequence

import numpy as np
import tensorflow as tf

from tf_gspmd import build_progress
from tf_gspmd.graph import ir
from tf_gspmd.graph_rewrite.partitioner import Local, OpRecord, Partitioner
from tf_gspmd.mesh import Mesh
from tf_gspmd.sharding import NamedSharding, P, Sharding, named_for_rank


class VariableStore:
  """The sharded copies of tf.Variables, shared by every function partitioned with it.

  Two partitioned functions over the same variables (a training step and an
  evaluation step) must read and write the same shards; give both one store.
  """

  def __init__(self):
    self.sharded: Dict[int, Any] = {}  # id(tf.Variable) -> ShardedVariable
    self.originals: Dict[int, Any] = {}  # id(tf.Variable) -> tf.Variable
    # id(tf.Variable) -> its shard_variable annotation when its shards were made (None: none),
    # so an annotation changed afterwards is refused instead of silently ignored.
    self.annotations: Dict[int, Optional[Sharding]] = {}

  def check_annotations(self, variables) -> None:
    """Raise a ValueError for a variable annotated differently since its shards were made."""
    from tf_gspmd.annotations import variable_sharding

    for var in variables:
      then, now = self.annotations.get(id(var)), variable_sharding(var)
      if now is not None and (then is None or now != then):
        raise ValueError(
          f'partition: variable {var.name} was annotated {now} after partitioning; its shards '
          f'already live as {self.sharded[id(var)].sharding} (annotated {then} then). '
          'Annotate variables before the first call, or partition the function again '
          '(with a new VariableStore) to use the new layout.'
        )

  def pairs(self, variables=None) -> List[tuple]:
    """(original, sharded) pairs, of `variables` only when given."""
    keys = (
      self.sharded if variables is None else [id(v) for v in variables if id(v) in self.sharded]
    )
    return [(self.originals[k], self.sharded[k]) for k in keys]

  def sync(self, variables=None) -> None:
    """Assign each sharded variable's global value to its original."""
    for original, sharded in self.pairs(variables):
      original.assign(sharded.assemble())

  def scatter(self, variables=None) -> None:
    """Send each original's current value out to its shards."""
    for original, sharded in self.pairs(variables):
      sharded.scatter(original.read_value())


BACKENDS = ('tf', 'xla')  # TF collectives on TF devices (default); XLA through PJRT


@dataclasses.dataclass
class _XlaRun:
  """backend='xla': the exported module, compiled, and the device buffers of its captures."""

  export: Any  # xla_bridge.XlaExport
  executable: Any  # xla_bridge.PjrtExecutable
  capture_buffers: List[list]


@dataclasses.dataclass
class _Compiled:
  program: ir.Program
  plan: Any  # propagation.api.Plan
  spmd: Any  # runtime.SpmdProgram
  arg_shardings: List[NamedSharding]
  capture_values: List[Any]
  variables: List[Any]  # the original tf.Variables, in program order
  op_records: List[OpRecord]
  per_partition: Any = None  # fn(ctx, *local args, captures, variables): the SPMD program
  local_specs: List[Any] = dataclasses.field(default_factory=list)  # shard specs of args+captures
  out_shardings: List[Any] = dataclasses.field(default_factory=list)
  out_shapes: List[tuple] = dataclasses.field(default_factory=list)
  xla: Any = None  # backend='xla': the _XlaRun (export, executable, capture buffers)
  mesh: Optional[Mesh] = None  # the mesh the program computes on (see _program_mesh)


class PartitionedFunction:
  """A tf.function partitioned over a mesh; call it with global values.

  See `partition` for the arguments.
  """

  def __init__(
    self,
    fn,
    mesh: Mesh,
    in_shardings=None,
    out_shardings=None,
    *,
    devices: Optional[Sequence[str]] = None,
    timeout: Optional[float] = None,
    store: Optional[VariableStore] = None,
    backend: str = 'tf',
    progress: Optional[bool] = None,
  ):
    from tf_gspmd import dtensor_compat

    if dtensor_compat.is_dtensor_mesh(mesh) and devices is None and backend == 'tf':
      devices = dtensor_compat.mesh_devices(mesh)  # a DTensor mesh runs on the devices it names
    mesh = dtensor_compat.converted(mesh)
    # DTensor Layouts (one for all, or one per tensor) converted once here: every later reader
    # (_boundary_shardings, _one_per, _annotate, subclasses) sees tf_gspmd Shardings.
    in_shardings = dtensor_compat.converted(in_shardings)
    out_shardings = dtensor_compat.converted(out_shardings)
    if not isinstance(mesh, Mesh):
      raise TypeError(f'partition: mesh must be a tf_gspmd.Mesh, got {type(mesh).__name__}.')
    if backend not in BACKENDS:
      raise ValueError(f'partition: backend must be one of {BACKENDS}, got {backend!r}.')
    self.backend = backend
    self.fn = fn
    self.mesh = mesh
    self.in_shardings = in_shardings
    self.out_shardings = out_shardings
    self.devices = devices
    self.timeout = timeout
    self._compiled: Dict[Any, _Compiled] = {}
    self.store = store if store is not None else VariableStore()
    self._sharded_variables = self.store.sharded  # id(tf.Variable) -> ShardedVariable
    self._originals = self.store.originals
    self._last: Optional[_Compiled] = None
    self.progress = build_progress.enabled_by_default() if progress is None else bool(progress)
    self.last_build: Optional[build_progress.BuildProgress] = None  # its .phases: (phase, s)
    self._building: Optional[build_progress.BuildProgress] = None

  # --- calling ------------------------------------------------------------------
  def __call__(self, *args):
    compiled = self._compiled.get(_signature_key(args))
    if compiled is not None:
      return self._call(args, compiled)
    what = f'{_name_of(self.fn)} on {self.mesh.size} devices'
    with build_progress.BuildProgress(what, self.progress) as progress:
      self._building = self.last_build = progress
      try:
        return self._call(args, self._compile(args))
      finally:
        self._building = None

  def _phase(self, text: str) -> None:
    """Mark the phase of the first call being built (shown when the build takes long)."""
    if self._building is not None:
      self._building.phase(text)

  def _call(self, args, compiled: _Compiled):
    self.store.check_annotations(compiled.variables)
    self._last = compiled
    flat_args = [a for a in tf.nest.flatten(args) if _is_tensor_like(a)]
    if self.backend == 'xla':
      return self._call_xla(compiled, flat_args)
    inputs = (
      list(flat_args)
      + list(compiled.capture_values)
      + [self._sharded_variables[id(v)] for v in compiled.variables]
    )
    try:
      flat = compiled.spmd(*inputs)
    except tf.errors.UnavailableError as error:  # a task of a cluster died: say which
      from tf_gspmd.runtime import cluster

      cluster.raise_if_task_lost(compiled.spmd.devices, error, f'partition({_name_of(self.fn)!r})')
      raise
    flat = list(flat) if isinstance(flat, (list, tuple)) else [flat]
    structure = compiled.program.structured_outputs
    if structure is None:
      return None
    return tf.nest.pack_sequence_as(structure, flat, expand_composites=True)

  def get_program(self, *args) -> _Compiled:
    """Capture, propagate and build (without running) for these example arguments."""
    return self._compile(args)

  # --- variables ------------------------------------------------------------------
  def sharded_variables(self) -> List[Any]:
    return list(self._sharded_variables.values())

  def variable_pairs(self) -> List[tuple]:
    """(original tf.Variable, its ShardedVariable) for every variable the function touches."""
    return self.store.pairs()

  def sync_variables(self, variables=None) -> None:
    """Assign the global value of every sharded variable (or of `variables`) to its original."""
    self.store.sync(variables)

  def scatter_variables(self, variables=None) -> None:
    """Send the current value of every original tf.Variable (or of `variables`) to its shards."""
    self.store.scatter(variables)

  def variable_bytes(self) -> Dict[str, Dict[str, int]]:
    """Per variable name: its total bytes and the bytes one device holds.

    Variables that share a name get '#2', '#3', ... appended to it.
    """
    out = {}
    for key, sharded in self._sharded_variables.items():
      name, k = self._originals[key].name, 1
      while name in out:
        k += 1
        name = f'{self._originals[key].name}#{k}'
      size = sharded.dtype.size
      out[name] = {
        'total': int(np.prod(sharded.shape, dtype=np.int64)) * size,
        'per_device': int(np.prod(sharded.local_shape, dtype=np.int64)) * size,
      }
    return out

  # --- TPU ---------------------------------------------------------------------------
  def lower_xla(self, *args, partition_id: int = 0):
    """The same per-partition program with XLA collective ops, for one SPMD program per
    TPU replica (under TPUStrategy the replica id is the partition id).

    Returns `(program, hlo_text)`: the traced `PerPartitionProgram` (a function of
    `(partition_id, *local shards, *shard variables)`) and its HLO, jit-compiled for
    this machine's XLA device, where the all-reduce family lowers (XLA on CPU has no
    all-to-all or collective-permute; a program that needs them traces here and
    compiles on TPU).
    """
    from tf_gspmd.runtime import trace_per_partition
    from tf_gspmd.xla_bridge import XlaCollectives

    compiled = self._compile(args)
    shard_variables = [_local_variable(self._sharded_variables[id(v)]) for v in compiled.variables]
    program = trace_per_partition(
      compiled.mesh,
      compiled.per_partition,
      compiled.local_specs + shard_variables,
      backend=XlaCollectives,
      jit_compile=True,
      name=f'{_name_of(self.fn)}_xla',
    )
    zeros = [tf.zeros(spec.shape, spec.dtype) for spec in compiled.local_specs]
    hlo = program.tf_function.experimental_get_compiler_ir(
      tf.constant(partition_id, tf.int32), *zeros, *shard_variables
    )(stage='hlo')
    return program, hlo

  # --- XLA: export and backend='xla' ---------------------------------------------------
  def export_xla(self, *args):
    """The per-replica StableHLO program for these example arguments (an `xla_bridge.XlaExport`).

    One module for all replicas (partition id = XLA replica id), every collective
    native, replica groups from the mesh. Its parameters are the local shards of
    the tensor arguments, the captured tensors, then the variables; its results
    the outputs, then the new values of the variables the function assigns.
    `XlaExport.args`/`results` say how each global value is sharded over the
    replicas. Runs nothing; works with either backend.
    """
    return self._export_xla(self._compile(args))

  def xla_executable(self, *args):
    """backend='xla': the compiled `xla_bridge.PjrtExecutable` for these arguments."""
    if self.backend != 'xla':
      raise ValueError("xla_executable(): this function was partitioned with backend='tf'.")
    return self._xla_run(self._compile(args)).executable

  def _export_xla(self, compiled: _Compiled):
    from tf_gspmd.xla_bridge.export import Layout, export_per_replica

    program, main = compiled.program, compiled.program.main
    names = list(program.arg_inputs) + list(program.captures)
    layouts = []
    for i, (name, spec) in enumerate(zip(names, compiled.local_specs)):
      kind = 'argument' if i < len(program.arg_inputs) else 'capture'
      layouts.append(
        Layout(
          name,
          kind,
          tuple(main.tensor(name).shape),
          spec.dtype,
          compiled.plan.target(main, name),
          tuple(spec.shape),
        )
      )
    templates = []
    for var in compiled.variables:
      sharded = self._sharded_variables[id(var)]
      layouts.append(
        Layout(
          var.name,
          'variable',
          sharded.shape,
          sharded.dtype,
          sharded.sharding,
          tuple(sharded.local_shape),
        )
      )
      templates.append(_local_variable(sharded))
    outputs = [
      Layout(t, 'output', shape, main.tensor(t).dtype, sharding, tuple(sharding.shard_shape(shape)))
      for t, sharding, shape in zip(main.outputs, compiled.out_shardings, compiled.out_shapes)
    ]
    examples = [tf.zeros(spec.shape, spec.dtype) for spec in compiled.local_specs] + templates
    return export_per_replica(
      compiled.mesh,
      compiled.per_partition,
      examples,
      name=f'{_name_of(self.fn)}_per_replica',
      arg_layouts=layouts,
      output_layouts=outputs,
    )

  def _xla_devices(self) -> list:
    from tf_gspmd.xla_bridge.pjrt import jax_devices

    if self.devices is None:
      return jax_devices(self.mesh.size)
    if any(isinstance(d, str) for d in self.devices):
      raise ValueError(
        "partition: with backend='xla', devices are jax devices (jax.devices()), "
        f'not TF device names such as {self.devices[0]!r}.'
      )
    return list(self.devices)

  def _xla_run(self, compiled: _Compiled) -> _XlaRun:
    if compiled.xla is None:
      from tf_gspmd.xla_bridge import pjrt

      export = self._export_xla(compiled)
      executable = pjrt.PjrtExecutable(export, self._xla_devices())
      n_args = len(compiled.program.arg_inputs)
      captures = [
        pjrt.put_global(value, layout, executable.devices)
        for value, layout in zip(
          compiled.capture_values, export.args[n_args : n_args + len(compiled.capture_values)]
        )
      ]
      compiled.xla = _XlaRun(export, executable, captures)
    return compiled.xla

  def _call_xla(self, compiled: _Compiled, flat_args):
    """Run the compiled module once: arguments split to device buffers, variables stay resident."""
    from tf_gspmd.xla_bridge import pjrt

    run = self._xla_run(compiled)
    devices = run.executable.devices
    inputs = [
      pjrt.put_global(value, layout, devices) for value, layout in zip(flat_args, run.export.args)
    ]
    inputs += run.capture_buffers
    inputs += [self._sharded_variables[id(v)].shards for v in compiled.variables]
    first_variable = len(flat_args) + len(run.capture_buffers)
    flat = []
    for layout, buffers in zip(run.export.results, run.executable.run(inputs)):
      if layout.kind == 'output':
        flat.append(pjrt.assemble_global(buffers, layout.sharding, layout.shape, layout.name))
      else:  # the new value of a variable: its device buffers replace the old ones
        variable = compiled.variables[layout.updates - first_variable]
        self._sharded_variables[id(variable)].shards = buffers
    structure = compiled.program.structured_outputs
    if structure is None:
      return None
    return tf.nest.pack_sequence_as(structure, flat, expand_composites=True)

  # --- explaining ------------------------------------------------------------------
  def explain(self) -> str:
    """Propagated shardings of every op and where they came from."""
    self._require_compiled('explain')
    return self._last.plan.explain()

  def collectives(self) -> List[dict]:
    """One record per collective the program runs per call: kind, axes, shape, bytes, op."""
    self._require_compiled('collectives')
    out = []
    for op in self._last.op_records:
      for rec in op.collectives:
        out.append(dict(rec, op=op.node, op_type=op.op, graph=op.graph))
    return out

  def op_records(self) -> List[OpRecord]:
    self._require_compiled('op_records')
    return list(self._last.op_records)

  def _require_compiled(self, what):
    if self._last is None:
      raise RuntimeError(f'{what}(): call the partitioned function (or get_program) first.')

  # --- pictures ---------------------------------------------------------------------
  def visualize(self, name: str) -> str:
    """Print (and return) which devices hold which block of variable or tensor `name`.

    `name`: a variable's name ('w1', 'w1:0') or a tensor of the main graph
    ('MatMul:0', or 'MatMul' for output 0), laid out as propagation chose. An
    unknown name raises a KeyError naming the nearest ones. See `tg.visualize`.

    >>> step(x); step.visualize('w1')                                 # doctest: +SKIP
    w1:0: (16, 32) P(None, 'model') on mesh data=2 x model=4; each device holds (16, 8)
    ...
    """
    self._require_compiled('visualize')
    from tf_gspmd.pictures import sources

    return sources.visualize_named(self, name)

  def report(self, path) -> str:
    """Write one self-contained HTML page about the last compiled program to `path`.

    The page draws every variable's layout as a device grid, the collectives
    per step as a bar chart of bytes by kind and mesh axes, each device's
    memory (parameters / optimizer state) and where each sharding came from.
    No network needed to view it. Returns the path written.

    >>> step(x); step.report('report.html')                           # doctest: +SKIP
    'report.html'
    """
    self._require_compiled('report')
    from tf_gspmd.pictures import sources

    return sources.write_report(self, path, 'function')

  # --- building ---------------------------------------------------------------------
  def _compile(self, args) -> _Compiled:
    from tf_gspmd.graph.capture import capture
    from tf_gspmd.propagation.api import propagate_captured

    key = _signature_key(args)
    if key in self._compiled:
      return self._compiled[key]
    self._phase('capturing the step')
    program = capture(self.fn, *args)
    _check_annotation_devices(program, self.mesh)
    mesh = _program_mesh(program, self.mesh, self._boundary_shardings(program))
    self._annotate_arguments(program, mesh)
    self._annotate_outputs(program, mesh)
    self._phase('propagating shardings')
    plan = propagate_captured(program, mesh)
    self._phase('making the sharded variables')
    compiled = self._build(program, plan, mesh)
    self._compiled[key] = compiled
    return compiled

  def _boundary_shardings(self, program: ir.Program) -> list:
    """(sharding, rank) of every given in/out sharding (P specs on the partition's mesh)."""
    main, found = program.main, []
    for given, tensors in (
      (self.in_shardings, program.arg_inputs),
      (self.out_shardings, main.outputs),
    ):
      if given is None or isinstance(given, (Sharding, P)):
        given = [given] * len(tensors)
      for tensor, sharding in zip(tensors, given if isinstance(given, (list, tuple)) else ()):
        shape = main.tensor(tensor).shape
        if isinstance(sharding, Sharding) and shape is not None:
          found.append((sharding, len(shape)))
    return found

  def _annotate_arguments(self, program: ir.Program, mesh: Mesh) -> None:
    if self.in_shardings is None:
      return
    given = self._one_per(self.in_shardings, program.arg_inputs, 'in_shardings', 'tensor argument')
    for tensor, sharding in zip(program.arg_inputs, given):
      if sharding is not None:
        self._annotate(program.main, tensor, sharding, 'in_shardings', mesh)

  def _annotate_outputs(self, program: ir.Program, mesh: Mesh) -> None:
    if self.out_shardings is None:
      return
    outs = program.main.outputs
    given = self._one_per(self.out_shardings, outs, 'out_shardings', 'output')
    for tensor, sharding in zip(outs, given):
      if sharding is not None:
        self._annotate(program.main, tensor, sharding, 'out_shardings', mesh)

  def _one_per(self, given, tensors, what: str, noun: str) -> list:
    """`given` (one sharding or P for all, or a list) as one entry per tensor of `tensors`."""
    if given is None or isinstance(given, (Sharding, P)):
      return [given] * len(tensors)
    if not isinstance(given, (list, tuple)):
      raise TypeError(
        f'partition({_name_of(self.fn)!r}): {what} must be a Sharding, a P or a '
        f'list of them (None: left to propagation), got {given!r}.'
      )
    if len(given) != len(tensors):
      plural = '' if len(tensors) == 1 else 's'
      raise ValueError(
        f'partition({_name_of(self.fn)!r}): {len(tensors)} {noun}{plural} {list(tensors)} but '
        f'{len(given)} {what} {list(given)}; give one per {noun} (None: left to propagation).'
      )
    return list(given)

  def _annotate(self, graph: ir.Graph, tensor: str, sharding, what: str, mesh: Mesh) -> None:
    t = graph.tensor(tensor)
    where = f'partition({_name_of(self.fn)!r}): {what} for {tensor}'
    if isinstance(sharding, P):  # a spec on the partition's own mesh
      try:
        sharding = NamedSharding(self.mesh, sharding)
      except ValueError as e:
        raise ValueError(f'{where}: {e}') from None
    if not isinstance(sharding, Sharding):
      raise TypeError(
        f'{where}: expected a Sharding or a P, got {type(sharding).__name__} {sharding!r}.'
      )
    if t.shape is not None:
      sharding.check_shape(t.shape, where)  # the rank first: the clearest error
    try:
      named = named_for_rank(sharding, mesh, len(t.shape))
    except ValueError as e:
      raise ValueError(f'{where}: {e}') from None
    if named is None:
      raise ValueError(
        f'partition: {what} for {tensor} gives {sharding}, which no spec on {self.mesh} says '
        f'in any device order (its tile dims {list(sharding.tile_shape or ())} are no grouping '
        'of the mesh axes); annotate with shardings over this mesh.'
      )
    named.check_shape(t.shape, f'{what} for {tensor}')
    graph.producer(tensor).annotations[t.index] = named

  def _build(self, program: ir.Program, plan, program_mesh: Mesh) -> _Compiled:
    from tf_gspmd.graph_rewrite import coalesce, dispatch, lower_reshard
    from tf_gspmd.runtime import ShardedVariable, SpmdProgram

    main = program.main
    arg_names = list(program.arg_inputs)
    capture_names = list(program.captures)
    var_names = list(program.variables)
    variables = [program.variables[n] for n in var_names]
    mesh = program_mesh
    if self.backend == 'tf':
      mesh = _working_order(main, plan, mesh, arg_names, program.variables)
    target = plan.target if mesh == program_mesh else _in_order(plan.target, mesh)
    arg_targets = [target(main, n) for n in arg_names]
    # Inputs and outputs keep the device order their annotation names (see _boundary_layout).
    arg_shardings = [_boundary_layout(main, n, s, mesh) for n, s in zip(arg_names, arg_targets)]
    capture_shardings = [target(main, n) for n in capture_names]
    sharded_cls = ShardedVariable
    if self.backend == 'xla':
      from tf_gspmd.xla_bridge.pjrt import XlaShardedVariable

      sharded_cls = XlaShardedVariable
    for name, var in zip(var_names, variables):
      self._shard_variable(var, target(main, name), sharded_cls)
    arg_shapes = [tuple(main.tensor(n).shape) for n in arg_names + capture_names]
    var_layouts = [(self._sharded_variables[id(v)].sharding, tuple(v.shape)) for v in variables]
    for t in main.outputs:
      shape = main.tensor(t).shape
      if shape is None or None in shape:
        maker = _through_identities(main, t)
        raise ValueError(
          f'partition: output {t} ({main.producer(t).op}, made by {maker.name} of type '
          f'{maker.op}) has shape {shape}, known only at run time; a partitioned function '
          'returns tensors of static shape.'
        )
    out_targets = [target(main, t) for t in main.outputs]
    out_shardings = [_boundary_layout(main, t, s, mesh) for t, s in zip(main.outputs, out_targets)]
    out_shapes = [tuple(main.tensor(t).shape) for t in main.outputs]
    op_records: List[OpRecord] = []

    @tf.autograph.experimental.do_not_convert  # plain Python emitting ops: no autograph
    def per_partition(ctx, *local):
      self._phase('partitioning the program')
      n_args = len(arg_shapes)
      values = [
        Local(t, s, shape)
        for t, s, shape in zip(local[:n_args], arg_shardings + capture_shardings, arg_shapes)
      ]
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
      )
      move = _BoundaryMove(ctx.collectives, lower_reshard.reshard)
      values = [
        move(main, n, v, s, 'argument')
        for n, v, s in zip(arg_names + capture_names, values, arg_targets + capture_shardings)
      ]
      bound.update(zip(arg_names + capture_names, values))
      outs = partitioner.run_graph(main, [], bound)
      entry = list(move.records)
      outs = [move(main, t, v, s, 'output') for t, v, s in zip(main.outputs, outs, out_shardings)]
      op_records[:] = entry + partitioner.records + move.records[len(entry) :]
      self._phase(
        'compiling with XLA and running the first step'
        if self.backend == 'xla'
        else f'instantiating on {mesh.size} devices and running the first step'
      )
      return [o.tensor for o in outs]

    per_partition.__name__ = _name_of(self.fn)
    kwargs = {} if self.timeout is None else {'timeout': self.timeout}
    spmd = (
      None
      if self.backend == 'xla'
      else SpmdProgram(
        mesh,
        per_partition,
        in_shardings=arg_shardings + capture_shardings + [None] * len(variables),
        out_shardings=out_shardings,
        out_shapes=out_shapes,
        devices=self.devices,
        **kwargs,
      )
    )
    capture_values = [program.captures[n] for n in capture_names]
    local_specs = [
      tf.TensorSpec(s.shard_shape(shape), main.tensor(n).dtype)
      for n, s, shape in zip(
        arg_names + capture_names, arg_shardings + capture_shardings, arg_shapes
      )
    ]
    return _Compiled(
      program,
      plan,
      spmd,
      arg_shardings,
      capture_values,
      variables,
      op_records,
      per_partition,
      local_specs,
      out_shardings,
      out_shapes,
      mesh=mesh,
    )

  def _shard_variable(self, var, sharding: NamedSharding, sharded_cls) -> None:
    key = id(var)
    existing = self._sharded_variables.get(key)
    if existing is not None and not isinstance(existing, sharded_cls):
      raise ValueError(
        f'partition: variable {var.name} is held by another backend ({type(existing).__name__}) '
        f'in this VariableStore; functions with backend={self.backend!r} need their own store.'
      )
    if existing is not None:
      if not existing.sharding.is_equivalent_to(sharding):
        raise ValueError(
          f'partition: variable {var.name} is sharded {existing.sharding} by an earlier trace '
          f'but {sharding} by this one; annotate it with shard_variable to fix its layout.'
        )
      return
    self._originals[key] = var
    from tf_gspmd.annotations import variable_sharding

    self.store.annotations[key] = variable_sharding(var)
    devices = self._xla_devices() if self.backend == 'xla' else self.devices
    self._sharded_variables[key] = sharded_cls(
      var.read_value(),
      sharding,
      devices=devices,
      name=var.name.split(':')[0],
      trainable=getattr(var, 'trainable', True),
    )


def _check_annotation_devices(program: ir.Program, mesh: Mesh) -> None:
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


def _program_mesh(program: ir.Program, mesh: Mesh, boundary: list) -> Mesh:
  """`mesh`, or its refinement into prime-factor sub-axes when an annotation needs them.

  GSPMD takes any tile assignment; one whose tile dims are no grouping of the
  mesh's axes (tile [2, 2, 2] on a 2x4 mesh, [2, 4] on a 1-D mesh of 8) is
  still a grouping of their prime factors: 'y' of 4 is 'y#0' x 'y#1', the
  same devices in the same order. Then the whole program computes on the
  refined mesh (a P('y') elsewhere is P(('y#0', 'y#1')), the same layout), and
  its collectives name sub-axes.
  """
  from tf_gspmd.annotations import variable_sharding
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


def _through_identities(graph: ir.Graph, tensor: str) -> ir.Node:
  """The op that made `tensor`, looking through Identity and XlaSharding ops."""
  node = graph.producer(tensor)
  while node.op in ('Identity', 'XlaSharding') and node.inputs:
    node = graph.producer(node.inputs[0])
  return node


def _working_order(graph: ir.Graph, plan, mesh: Mesh, args, variables) -> Mesh:
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
  from tf_gspmd.annotations import variable_sharding

  layouts = [
    (_in_given_order(variable_sharding(var), plan.target(graph, name), mesh), True)
    for name, var in variables.items()
  ]
  layouts += [
    (
      _boundary_layout(graph, name, plan.target(graph, name), mesh),
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


def _in_order(target, order: Mesh):
  """Propagation's `target(graph, tensor)` re-expressed in the program's device order."""
  return lambda graph, tensor: _on_order(target(graph, tensor), order)


def _annotation(graph: ir.Graph, tensor: str):
  t = graph.tensor(tensor)
  return graph.producer(tensor).annotations.get(t.index)


def _boundary_layout(
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


class _BoundaryMove:
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


def partition(
  fn=None, mesh: Optional[Mesh] = None, in_shardings=None, out_shardings=None, **kwargs
):
  """Partition an annotated tf.function over `mesh`; usable as a decorator.

  `in_shardings`/`out_shardings`: one Sharding (or None: leave it to
  propagation) per flattened tensor argument / output, or one for all.
  `backend`: 'tf' (default: TF collectives between TF devices) or 'xla' (the
  per-replica program exported to StableHLO, compiled by XLA and run on the
  mesh's devices through PJRT; needs the `tf_gspmd[xla]` extra).
  `progress`: while a first call builds for longer than a few seconds, show
  which phase it is in (one updating line on a terminal, INFO log lines
  otherwise; see `tf_gspmd.build_progress`); default on unless TF_GSPMD_PROGRESS=0.

  >>> mesh = Mesh.create((8,), ('data',))                          # doctest: +SKIP
  >>> step = partition(train_step, mesh, in_shardings=NamedSharding(mesh, P('data', None)))  # doctest: +SKIP
  >>> loss = step(x)                                               # doctest: +SKIP
  """
  if fn is None:
    return lambda f: PartitionedFunction(f, mesh, in_shardings, out_shardings, **kwargs)
  return PartitionedFunction(fn, mesh, in_shardings, out_shardings, **kwargs)


def _local_variable(sharded) -> tf.Variable:
  """A TF variable of one shard's shape and dtype, to trace a per-partition program with."""
  return sharded.template if hasattr(sharded, 'template') else sharded.shards[0]


def _is_tensor_like(value) -> bool:
  return isinstance(value, (tf.Tensor, tf.Variable, np.ndarray, np.generic)) or (
    hasattr(value, 'dtype') and hasattr(value, 'shape')
  )


def _signature_key(args):
  flat = tf.nest.flatten(args)
  return tuple(
    (tuple(np.shape(a)), str(getattr(a, 'dtype', type(a).__name__)))
    if _is_tensor_like(a)
    else ('py', repr(a))
    for a in flat
  )


def _name_of(fn) -> str:
  name = getattr(fn, '__name__', None) or getattr(
    getattr(fn, 'python_function', None), '__name__', 'fn'
  )
  return ''.join(c if c.isalnum() or c == '_' else '_' for c in name)
