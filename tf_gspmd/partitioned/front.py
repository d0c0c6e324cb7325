"""`PartitionedFunction`: the object `tf_gspmd.partition` returns, a thin front.

It keeps one compiled program per call signature (`compile`), the variables' shards
(`variables.VariableStore`), and hands each call to its backend's executor (looked up by
name in `executors`); the rest is reading what was compiled.
"""

from __future__ import annotations

import threading
from typing import Any, Dict, List, Optional, Sequence

import tensorflow as tf

from tf_gspmd import build_progress
from tf_gspmd.graph import ir
from tf_gspmd.graph_rewrite.partitioner import OpRecord
from tf_gspmd.mesh import Mesh
from tf_gspmd.partitioned import compile as compile_lib
from tf_gspmd.partitioned import executors, xla_programs
from tf_gspmd.partitioned import variables as variables_lib
from tf_gspmd.partitioned.compile import Compiled
from tf_gspmd.partitioned.signature import (
  name_of,
  signature_key,
  tensor_arguments,
  with_variables_bound,
)
from tf_gspmd.partitioned.variables import VariableStore
from tf_gspmd.program import held
from tf_gspmd.runtime import grappler
from tf_gspmd.sharding import NamedSharding
from tf_gspmd.tf_private import context  # async_wait: the other tasks' copies done

BACKENDS = executors.NAMES  # the executor registry's names


class PartitionedFunction:
  """A tf.function partitioned over a mesh; call it with global values.

  See `partition` for the arguments. Subclasses change how variables get their
  shards (`_shard_variable`) or what a build makes (`_build`).
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
    backend: str = executors.DEFAULT,
    progress: Optional[bool] = None,
  ):
    from tf_gspmd import dtensor_compat

    executor = executors.get(backend)
    if dtensor_compat.is_dtensor_mesh(mesh) and devices is None:
      devices = executor.dtensor_devices(mesh)  # the devices it names, on a TF backend
    mesh = dtensor_compat.converted(mesh)
    # DTensor Layouts (one for all, or one per tensor) converted once here: every later reader
    # (boundary.given_shardings, boundary.Annotator, subclasses) sees tf_gspmd Shardings.
    in_shardings = dtensor_compat.converted(in_shardings)
    out_shardings = dtensor_compat.converted(out_shardings)
    if not isinstance(mesh, Mesh):
      raise TypeError(f'partition: mesh must be a tf_gspmd.Mesh, got {type(mesh).__name__}.')
    self.backend = backend
    self.executor = executor
    self.fn = fn
    self.mesh = mesh
    self.in_shardings = in_shardings
    self.out_shardings = out_shardings
    self.devices = devices
    self.timeout = timeout
    self._compiled: Dict[Any, Compiled] = {}
    self.store = store if store is not None else VariableStore()
    self._sharded_variables = self.store.sharded  # id(tf.Variable) -> ShardedVariable
    self._originals = self.store.originals
    self._last: Optional[Compiled] = None
    self.progress = build_progress.enabled_by_default() if progress is None else bool(progress)
    self.last_build: Optional[build_progress.BuildProgress] = None  # its .phases: (phase, s)
    self._building: Optional[build_progress.BuildProgress] = None
    # (copy, the adopted variables and their holders) -> held.adopted_copier's function.
    self._copiers: Dict[tuple, Any] = {}

  # --- calling ------------------------------------------------------------------
  def __call__(self, *args):
    compiled = self._compiled.get(signature_key(args))
    if compiled is not None:
      return self._call(args, compiled)
    what = f'{name_of(self.fn)} on {self.mesh.size} devices'
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

  def _call(self, args, compiled: Compiled):
    self.store.check_annotations(compiled.variables)
    self._own_layouts(compiled)
    self._last = compiled
    flat_args = tensor_arguments(args)
    what = f'partition({name_of(self.fn)!r})'
    self._prepared(compiled)
    # A plain variable is its own state: copied into its shards, and what the call wrote back.
    self._copy(held.scatter_adopted, compiled.variables, what)
    written = compiled.written_variables()
    held.forget_in_sync(written)  # their shards change now: equal again once copied back
    outputs = self.executor.run(compiled, flat_args, self._sharded_variables, what)
    self._copy(held.gather_adopted, written, what)
    return outputs

  def _copy(self, copy, variables, what: str) -> None:
    """`copy` (scatter_adopted or gather_adopted) of the adopted variables among `variables`:
    into their shards only those written since their last copy (a step after a step copies
    nothing in), back all the call wrote."""
    adopted = [v for v in variables if held.is_held(v) and not held.is_split(v)]
    if copy is held.scatter_adopted:  # a variable nothing wrote since the last copy is its shards
      adopted = held.out_of_sync(adopted)
    if not adopted:
      return
    self._copy_now(copy, adopted, what)
    held.note_in_sync(adopted)

  def _copy_now(self, copy, adopted, what: str) -> None:
    """`copy(adopted)`. With shards on other tasks' devices, within the call's timeout: a task
    that died or stopped fails it with a CollectiveError, as the step's own collectives would,
    instead of an RPC error or a wait without end."""
    if not any(_on_other_tasks(held.holder_of(v)) for v in adopted):
      key = (copy.__name__, tuple((id(v), id(held.holder_of(v))) for v in adopted))
      run = self._copiers.get(key)
      if run is None:
        if len(self._copiers) > 64:  # holders that moved: their copiers are of no more use
          self._copiers.clear()
        run = self._copiers[key] = held.adopted_copier(adopted, copy)
      # Data movement only: Grappler's pipeline would cost its first call seconds on a model
      # of a hundred variables (a ResNet's copy-in: 3.2 -> 0.9 s) and save nothing.
      with grappler.without_grappler():
        run()
      return
    # Other tasks: eager ops, each a call the thread below can abandon.
    from tf_gspmd.runtime import cluster
    from tf_gspmd.runtime.errors import CollectiveError

    done, failed = threading.Event(), []

    def in_thread():
      try:
        copy(adopted)
        # Another task runs the writes (and reads) asynchronously: wait for them, so that they
        # are done before the step that follows and a failure is this copy's.
        context.async_wait()
      except Exception as error:  # noqa: BLE001 (handed to the caller's thread)
        failed.append(error)
      done.set()

    threading.Thread(target=in_thread, daemon=True, name='tf_gspmd_copy').start()
    timeout = self.timeout if self.timeout is not None else 60.0
    holder = held.holder_of(adopted[0])
    devices = [str(d) for d in holder.devices]
    if not done.wait(timeout):
      raise CollectiveError(_silent_tasks(holder, devices, timeout, what))
    if failed and isinstance(failed[0], tf.errors.OpError):
      cluster.raise_if_task_lost(devices, failed[0], what)
      raise CollectiveError(
        f'{what}: copying plain variables to or from their shards on other tasks failed: '
        f'{failed[0].message}'
      ) from failed[0]
    if failed:
      raise failed[0]

  def _own_layouts(self, compiled: Compiled) -> None:
    """Move back the shards another program moved to its own layout (one state per variable)."""
    for i, var in enumerate(compiled.variables):
      holder = held.holder_of(var)
      built_for = compiled.holders[i] if i < len(compiled.holders) else None
      if built_for is None or holder is built_for:
        continue
      if holder is None:  # its shards dropped (unpartition_model): give it shards again
        self.store.add(
          var, built_for.sharding, type(built_for), lambda on=built_for.devices: on, self.backend
        )
        compiled.holders[i] = held.holder_of(var)
        continue
      if variables_lib.fits(
        holder, built_for.sharding, type(built_for), lambda on=built_for.devices: on
      ):
        compiled.holders[i] = holder
        continue
      variables_lib.move_shards(var, built_for.sharding, type(built_for), built_for.devices)
      compiled.holders[i] = held.holder_of(var)

  def get_program(self, *args) -> Compiled:
    """Capture, propagate and build (without running) for these example arguments; `explain`,
    `collectives` and `op_records` describe it afterwards."""
    self._last = self._compile(args)
    return self._last

  # --- variables ------------------------------------------------------------------
  def sharded_variables(self) -> List[Any]:
    return list(self._sharded_variables.values())

  def variable_pairs(self) -> List[tuple]:
    """(original tf.Variable, its ShardedVariable) for every variable the function touches."""
    return self.store.pairs()

  def sync_variables(self, variables=None) -> None:
    """Deprecated, does nothing: a partitioned variable's reads assemble its shards."""
    self.store.sync(variables)

  def scatter_variables(self, variables=None) -> None:
    """Deprecated, does nothing: a write to a partitioned variable goes to its shards."""
    self.store.scatter(variables)

  def variable_bytes(self) -> Dict[str, Dict[str, int]]:
    """Per variable name: its total bytes and the bytes one device holds.

    Variables that share a name get '#2', '#3', ... appended to it.
    """
    return self.store.byte_counts()

  # --- XLA: TPU lowering, export and backend='xla' ------------------------------------
  def lower_xla(self, *args, partition_id: int = 0):
    """The same per-partition program with XLA collective ops, for one SPMD program per
    TPU replica (under TPUStrategy the replica id is the partition id).

    Returns `(program, hlo_text)`: the traced `PerPartitionProgram` (a function of
    `(partition_id, *local shards, *shard variables)`) and its HLO, jit-compiled for
    this machine's XLA device, where the all-reduce family lowers (XLA on CPU has no
    all-to-all or collective-permute; a program that needs them traces here and
    compiles on TPU).
    """
    compiled = self._compile(args)
    return xla_programs.lower(compiled, self._sharded_variables, partition_id, name_of(self.fn))

  def export_xla(self, *args):
    """The per-replica StableHLO program for these example arguments (an `xla_bridge.XlaExport`).

    One module for all replicas (partition id = XLA replica id), every collective
    native, replica groups from the mesh. Its parameters are the local shards of
    the tensor arguments, the captured tensors, then the variables; its results
    the outputs, then the new values of the variables the function assigns.
    `XlaExport.args`/`results` say how each global value is sharded over the
    replicas. Runs nothing; works with either backend.
    """
    return xla_programs.export(self._compile(args), self._sharded_variables, name_of(self.fn))

  def xla_executable(self, *args):
    """backend='xla': the compiled `xla_bridge.PjrtExecutable` for these arguments."""
    return self.executor.xla_executable(lambda: self._prepared(self._compile(args)))

  def _prepared(self, compiled: Compiled):
    """`compiled` made ready to run by the executor (once: kept as `compiled.prepared`)."""
    if compiled.prepared is None:
      compiled.prepared = self.executor.prepare(
        compiled,
        self._sharded_variables,
        self.executor.devices(self.mesh, self.devices),
        self.timeout,
        name_of(self.fn),
      )
    return compiled.prepared

  # --- explaining ------------------------------------------------------------------
  def explain(self) -> str:
    """Propagated shardings of every op and where they came from."""
    self._require_compiled('explain')
    return self._last.propagation.explain()

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
  def _compile(self, args) -> Compiled:
    from tf_gspmd.propagation.api import propagate_captured

    key = signature_key(args)
    if key in self._compiled:
      return self._compiled[key]
    self._phase('capturing the step')
    fn, args = with_variables_bound(self.fn, args)
    program, mesh = compile_lib.capture_annotated(
      fn, args, self.mesh, self.in_shardings, self.out_shardings, name_of(self.fn)
    )
    compile_lib.refuse_python_callbacks(program, self.executor, name_of(self.fn))
    self._phase('propagating shardings')
    propagation = propagate_captured(program, mesh)
    self._phase('making the sharded variables')
    compiled = self._build(program, propagation, mesh)
    self._compiled[key] = compiled
    return compiled

  def _build(self, program: ir.Program, propagation, program_mesh: Mesh) -> Compiled:
    """The per-partition program, prepared to run when its executor prepares at build."""
    sharded_cls = self.executor.sharded_variable_class()
    compiled = compile_lib.build(
      program,
      propagation,
      program_mesh,
      executor=self.executor,
      shard_variable=lambda var, sharding: self._shard_variable(var, sharding, sharded_cls),
      sharded_variables=self._sharded_variables,
      phase=self._phase,
      name=name_of(self.fn),
      check_fits=self._check_fits,
    )
    compiled.holders = [self._sharded_variables.get(id(v)) for v in compiled.variables]
    self.executor.built(compiled, self._prepared)
    return compiled

  def _check_fits(self, layouts) -> None:
    """Refuse shards that would not fit a device whose memory TF can tell (a GPU's limit)."""
    self.executor.check_fits(layouts, self.mesh.size, self.devices)

  def _shard_variable(self, var, sharding: NamedSharding, sharded_cls) -> None:
    """Give `var` its shards in the store (subclasses hold them elsewhere)."""
    devices = self.executor.devices(self.mesh, self.devices)
    self.store.add(var, sharding, sharded_cls, devices, self.backend)


def _silent_tasks(holder, devices: List[str], timeout: float, what: str) -> str:
  """Which tasks stopped answering, asked by reading one shard on each within 5 s: what a
  copy that did not complete within `timeout` waits for."""
  from tf_gspmd.runtime import cluster

  by_task: Dict[str, List[int]] = {}
  for p, device in enumerate(devices):
    by_task.setdefault(cluster.task_of(device), []).append(p)
  answered: Dict[str, bool] = {}

  def ask(task: str, p: int) -> None:
    try:
      holder.shards[p].read_value()
      answered[task] = True
    except Exception:  # noqa: BLE001 (an unreadable task counts as silent)
      pass

  askers = [
    threading.Thread(target=ask, args=(task, ps[0]), daemon=True) for task, ps in by_task.items()
  ]
  for asker in askers:
    asker.start()
  for asker in askers:
    asker.join(5.0)
  addresses = cluster.task_addresses()
  lines = [
    f'{what}: task {task} ({addresses.get(task, "address unknown")}), which runs partitions '
    f'{ps}, stopped responding (partition {ps[0]}: the copy of plain variables to or from '
    f'their shards did not complete within {timeout:g} s).'
    for task, ps in sorted(by_task.items())
    if not answered.get(task)
  ]
  lines.append(
    'Kill and restart every task (the hung one first), connect again '
    '(tf_gspmd.runtime.cluster.connect), partition again and restore the last checkpoint '
    '(tg.restore_checkpoint).'
  )
  return '\n'.join(lines)


def _on_other_tasks(holder) -> bool:
  """Whether any of `holder`'s shards lives on a device of another task (a cluster's worker)."""
  devices = getattr(holder, 'devices', None) or ()
  return any('/job:' in str(d) and '/job:localhost' not in str(d) for d in devices)


def partition(
  fn=None, mesh: Optional[Mesh] = None, in_shardings=None, out_shardings=None, **kwargs
):
  """Partition an annotated tf.function over `mesh`; usable as a decorator.

  `in_shardings`/`out_shardings`: one Sharding (or None: leave it to
  propagation) per flattened tensor argument / output, or one for all. A
  `tf.Variable` argument (passed, or a parameter's default) is the step's state,
  as a captured variable is: held as shards and updated in place, not a tensor
  argument; a call with another variable builds anew.
  `backend`: 'tf' (default: TF collectives between TF devices) or 'xla' (the
  per-replica program exported to StableHLO, compiled by XLA and run on the
  mesh's devices through PJRT; needs the `tf_gspmd[xla]` extra).
  `progress`: while a first call builds for longer than a few seconds, show
  which phase it is in (one updating line on a terminal, INFO log lines
  otherwise; see `tf_gspmd.build_progress`); default on unless TF_GSPMD_PROGRESS=0.

  >>> mesh = Mesh.create((8,), ('data',))                          # doctest: +SKIP
  >>> by_rows = NamedSharding(mesh, P('data', None))                # doctest: +SKIP
  >>> step = partition(train_step, mesh, in_shardings=by_rows)     # doctest: +SKIP
  >>> loss = step(x)                                               # doctest: +SKIP
  """
  if fn is None:
    return lambda f: PartitionedFunction(f, mesh, in_shardings, out_shardings, **kwargs)
  return PartitionedFunction(fn, mesh, in_shardings, out_shardings, **kwargs)
