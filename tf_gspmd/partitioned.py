"""`tf_gspmd.partition`: an annotated tf.function as one SPMD program on a mesh.

The data flow, one stage per module:
capture (`graph_rewrite.capture`) -> propagate (`propagation`) -> partition
(`graph_rewrite.partitioner` and its handlers, with reshards planned by
`graph_rewrite.reshard_plan` and lowered by `graph_rewrite.lower_reshard`) ->
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

from tf_gspmd.graph import ir
from tf_gspmd.graph_rewrite.partitioner import Local, OpRecord, Partitioner
from tf_gspmd.mesh import Mesh
from tf_gspmd.sharding import NamedSharding, Sharding, named_for_rank


class VariableStore:
  """The sharded copies of tf.Variables, shared by every function partitioned with it.

  Two partitioned functions over the same variables (a training step and an
  evaluation step) must read and write the same shards; give both one store.
  """

  def __init__(self):
    self.sharded: Dict[int, Any] = {}    # id(tf.Variable) -> ShardedVariable
    self.originals: Dict[int, Any] = {}  # id(tf.Variable) -> tf.Variable

  def pairs(self, variables=None) -> List[tuple]:
    """(original, sharded) pairs, of `variables` only when given."""
    keys = self.sharded if variables is None else [id(v) for v in variables if id(v) in self.sharded]
    return [(self.originals[k], self.sharded[k]) for k in keys]

  def sync(self, variables=None) -> None:
    """Assign each sharded variable's global value to its original."""
    for original, sharded in self.pairs(variables):
      original.assign(sharded.assemble())

  def scatter(self, variables=None) -> None:
    """Send each original's current value out to its shards."""
    for original, sharded in self.pairs(variables):
      sharded.scatter(original.read_value())


@dataclasses.dataclass
class _Compiled:
  program: ir.Program
  plan: Any                      # propagation.api.Plan
  spmd: Any                      # runtime.SpmdProgram
  arg_shardings: List[NamedSharding]
  capture_values: List[Any]
  variables: List[Any]           # the original tf.Variables, in program order
  op_records: List[OpRecord]
  per_partition: Any = None      # fn(ctx, *local args, captures, variables): the SPMD program
  local_specs: List[Any] = dataclasses.field(default_factory=list)  # shard specs of args+captures


class PartitionedFunction:
  """A tf.function partitioned over a mesh; call it with global values.

  See `partition` for the arguments.
  """

  def __init__(self, fn, mesh: Mesh, in_shardings=None, out_shardings=None, *,
               devices: Optional[Sequence[str]] = None, timeout: Optional[float] = None,
               store: Optional[VariableStore] = None):
    if not isinstance(mesh, Mesh):
      raise TypeError(f'partition: mesh must be a tf_gspmd.Mesh, got {type(mesh).__name__}.')
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

  # --- calling ------------------------------------------------------------------
  def __call__(self, *args):
    compiled = self._compile(args)
    self._last = compiled
    flat_args = [a for a in tf.nest.flatten(args) if _is_tensor_like(a)]
    inputs = list(flat_args) + list(compiled.capture_values) + [
        self._sharded_variables[id(v)] for v in compiled.variables]
    flat = compiled.spmd(*inputs)
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
      out[name] = {'total': int(np.prod(sharded.shape, dtype=np.int64)) * size,
                       'per_device': int(np.prod(sharded.local_shape, dtype=np.int64)) * size}
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
    from tf_gspmd.runtime import trace_per_partition  # pylint: disable=g-import-not-at-top
    from tf_gspmd.xla_bridge import XlaCollectives  # pylint: disable=g-import-not-at-top
    compiled = self._compile(args)
    shard_variables = [self._sharded_variables[id(v)].shards[0] for v in compiled.variables]
    program = trace_per_partition(self.mesh, compiled.per_partition,
                                  compiled.local_specs + shard_variables, backend=XlaCollectives,
                                  jit_compile=True, name=f'{_name_of(self.fn)}_xla')
    zeros = [tf.zeros(spec.shape, spec.dtype) for spec in compiled.local_specs]
    hlo = program.tf_function.experimental_get_compiler_ir(
        tf.constant(partition_id, tf.int32), *zeros, *shard_variables)(stage='hlo')
    return program, hlo

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

  # --- building ---------------------------------------------------------------------
  def _compile(self, args) -> _Compiled:
    from tf_gspmd.graph.capture import capture  # pylint: disable=g-import-not-at-top
    from tf_gspmd.propagation.api import propagate_captured  # pylint: disable=g-import-not-at-top
    key = _signature_key(args)
    if key in self._compiled:
      return self._compiled[key]
    program = capture(self.fn, *args)
    self._annotate_arguments(program)
    self._annotate_outputs(program)
    plan = propagate_captured(program, self.mesh)
    compiled = self._build(program, plan)
    self._compiled[key] = compiled
    return compiled

  def _annotate_arguments(self, program: ir.Program) -> None:
    if self.in_shardings is None:
      return
    given = list(self.in_shardings) if isinstance(self.in_shardings, (list, tuple)) else [
        self.in_shardings] * len(program.arg_inputs)
    if len(given) != len(program.arg_inputs):
      raise ValueError(f'partition: {len(program.arg_inputs)} tensor arguments but '
                       f'{len(given)} in_shardings.')
    for tensor, sharding in zip(program.arg_inputs, given):
      if sharding is not None:
        self._annotate(program.main, tensor, sharding, 'in_shardings')

  def _annotate_outputs(self, program: ir.Program) -> None:
    if self.out_shardings is None:
      return
    outs = program.main.outputs
    given = list(self.out_shardings) if isinstance(self.out_shardings, (list, tuple)) else [
        self.out_shardings] * len(outs)
    if len(given) != len(outs):
      raise ValueError(f'partition: {len(outs)} outputs but {len(given)} out_shardings.')
    for tensor, sharding in zip(outs, given):
      if sharding is not None:
        self._annotate(program.main, tensor, sharding, 'out_shardings')

  def _annotate(self, graph: ir.Graph, tensor: str, sharding: Sharding, what: str) -> None:
    t = graph.tensor(tensor)
    named = named_for_rank(sharding, self.mesh, len(t.shape))
    named.check_shape(t.shape, f'{what} for {tensor}')
    graph.producer(tensor).annotations[t.index] = named

  def _build(self, program: ir.Program, plan) -> _Compiled:
    from tf_gspmd.graph_rewrite import dispatch, lower_reshard  # pylint: disable=g-import-not-at-top
    from tf_gspmd.runtime import ShardedVariable, SpmdProgram  # pylint: disable=g-import-not-at-top
    main = program.main
    arg_names = list(program.arg_inputs)
    capture_names = list(program.captures)
    var_names = list(program.variables)
    variables = [program.variables[n] for n in var_names]
    arg_shardings = [plan.target(main, n) for n in arg_names]
    capture_shardings = [plan.target(main, n) for n in capture_names]
    for name, var in zip(var_names, variables):
      self._shard_variable(var, plan.target(main, name), ShardedVariable)
    arg_shapes = [tuple(main.tensor(n).shape) for n in arg_names + capture_names]
    var_layouts = [(self._sharded_variables[id(v)].sharding, tuple(v.shape)) for v in variables]
    for t in main.outputs:
      shape = main.tensor(t).shape
      if shape is None or None in shape:
        raise ValueError(
            f'partition: output {t} ({main.producer(t).op}) has shape {shape}, known only at run '
            'time; a partitioned function returns tensors of static shape.')
    out_shardings = [plan.target(main, t) for t in main.outputs]
    out_shapes = [tuple(main.tensor(t).shape) for t in main.outputs]
    op_records: List[OpRecord] = []
    mesh = self.mesh

    @tf.autograph.experimental.do_not_convert  # plain Python emitting ops: no autograph
    def per_partition(ctx, *local):
      n_args = len(arg_shapes)
      values = [Local(t, s, shape) for t, s, shape in
                zip(local[:n_args], arg_shardings + capture_shardings, arg_shapes)]
      bound = {name: Local(v.handle, s, shape)
               for name, v, (s, shape) in zip(var_names, local[n_args:], var_layouts)}
      partitioner = Partitioner(program, plan.target, mesh, ctx.collectives, lower_reshard.reshard,
                                dispatch.lookup)
      bound.update(zip(arg_names + capture_names, values))
      outs = partitioner.run_graph(main, [], bound)
      op_records[:] = partitioner.records
      return [o.tensor for o in outs]

    per_partition.__name__ = _name_of(self.fn)
    kwargs = {} if self.timeout is None else {'timeout': self.timeout}
    spmd = SpmdProgram(
        mesh, per_partition,
        in_shardings=arg_shardings + capture_shardings + [None] * len(variables),
        out_shardings=out_shardings, out_shapes=out_shapes, devices=self.devices, **kwargs)
    capture_values = [program.captures[n] for n in capture_names]
    local_specs = [tf.TensorSpec(s.shard_shape(shape), main.tensor(n).dtype)
                   for n, s, shape in zip(arg_names + capture_names,
                                          arg_shardings + capture_shardings, arg_shapes)]
    return _Compiled(program, plan, spmd, arg_shardings, capture_values, variables, op_records,
                     per_partition, local_specs)

  def _shard_variable(self, var, sharding: NamedSharding, sharded_cls) -> None:
    key = id(var)
    existing = self._sharded_variables.get(key)
    if existing is not None:
      if existing.sharding != sharding:
        raise ValueError(
            f'partition: variable {var.name} is sharded {existing.sharding} by an earlier trace '
            f'but {sharding} by this one; annotate it with shard_variable to fix its layout.')
      return
    self._originals[key] = var
    self._sharded_variables[key] = sharded_cls(
        var.read_value(), sharding, devices=self.devices, name=var.name.split(':')[0],
        trainable=getattr(var, 'trainable', True))


def partition(fn=None, mesh: Optional[Mesh] = None, in_shardings=None, out_shardings=None, **kwargs):
  """Partition an annotated tf.function over `mesh`; usable as a decorator.

  `in_shardings`/`out_shardings`: one Sharding (or None: leave it to
  propagation) per flattened tensor argument / output, or one for all.

  >>> mesh = Mesh.create((8,), ('data',))                          # doctest: +SKIP
  >>> step = partition(train_step, mesh, in_shardings=NamedSharding(mesh, P('data', None)))  # doctest: +SKIP
  >>> loss = step(x)                                               # doctest: +SKIP
  """
  if fn is None:
    return lambda f: PartitionedFunction(f, mesh, in_shardings, out_shardings, **kwargs)
  return PartitionedFunction(fn, mesh, in_shardings, out_shardings, **kwargs)


def _is_tensor_like(value) -> bool:
  return isinstance(value, (tf.Tensor, tf.Variable, np.ndarray, np.generic)) or (
      hasattr(value, 'dtype') and hasattr(value, 'shape'))


def _signature_key(args):
  flat = tf.nest.flatten(args)
  return tuple((tuple(np.shape(a)), str(getattr(a, 'dtype', type(a).__name__)))
               if _is_tensor_like(a) else ('py', repr(a)) for a in flat)


def _name_of(fn) -> str:
  name = getattr(fn, '__name__', None) or getattr(getattr(fn, 'python_function', None),
                                                  '__name__', 'fn')
  return ''.join(c if c.isalnum() or c == '_' else '_' for c in name)
