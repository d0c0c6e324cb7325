"""XLA's own SPMD partitioner run on the same annotated TF program, for comparison; not a backend.

The reference side of tests/test_vs_xla.py and bench/vs_xla.py: tf_gspmd's partitioned program
is measured against what XLA's partitioner makes of the unpartitioned one.

`XlaPartitionedStep` takes an annotated, *unpartitioned* tf.function (the one
`tg.partition` would take), lowers it through tf2xla (`experimental_get_
compiler_ir(...)(stage='hlo_serialized')`: its `XlaSharding` ops survive as
HLO `sharding=` attributes), adds the shardings tf2xla leaves out -- one per
parameter (the arguments and the captured variables) and one per result --
and compiles the module with `num_partitions=N, use_spmd_partitioning=True`
(GSPMD, not Shardy: Shardy would read the custom-call shardings differently)
on N PJRT CPU devices. XLA then partitions it itself. The step runs with
per-device shards, keeps its variables sharded between calls (the updated
values come back as results aliased to their parameters) and reads, from the
partitioned HLO, every collective with the bytes each device receives.

Bytes received per device, per collective (g = replica-group size; the rules
of tf_gspmd's reshard search and of bench/xla_reference.py):
  all-gather          result - operand bytes
  all-to-all          operand bytes * (g-1)/g
  reduce-scatter      operand bytes * (g-1)/g
  all-reduce          2*(g-1) pieces of ceil(E/g) elements per operand of E elements
  collective-permute  operand bytes on a device that receives from another device
A tuple collective (XLA combines small all-reduces) counts once, with the bytes
of all its operands.

jax/jaxlib (PJRT) is needed: XLA_FLAGS must ask for N host devices before jax
initializes (`pjrt.jax_devices` does it when jax is not initialized yet). TF is
imported first (see /work/shared/notes/xla-bridge-facts.md).
"""

from __future__ import annotations

import dataclasses
import math
import re
import time
from typing import Dict, List, Optional, Sequence

import numpy as np
import tensorflow as tf
from tensorflow.compiler.xla import xla_data_pb2
from tensorflow.compiler.xla.service import hlo_pb2

from tf_gspmd import op_sharding
from tf_gspmd.sharding import Sharding
from tf_gspmd.xla_bridge import pjrt


def _xla_client():
  # jaxlib's XLA client is the only Python handle on PJRT's compile options (num_partitions,
  # use_spmd_partitioning, the partitioner choice) and on HLO -> StableHLO conversion.
  from jax._src.lib import xla_client

  return xla_client


def _gspmd_sharding(devices, proto):
  # jax's public NamedSharding needs a mesh; GSPMDSharding takes the compiled executable's own
  # OpSharding, so arguments are laid out exactly as XLA's partitioner decided to read them.
  from jax._src.sharding_impls import GSPMDSharding

  return GSPMDSharding(tuple(devices), proto)


def spmd_compile_options(num_partitions: int):
  """CompileOptions for XLA's SPMD partitioner: one replica, `num_partitions` partitions, GSPMD."""
  xc = _xla_client()
  options = xc.CompileOptions()
  build = options.executable_build_options
  build.num_replicas = 1
  build.num_partitions = num_partitions
  build.use_spmd_partitioning = True
  build.use_shardy_partitioner = False  # GSPMD: reads the HLO sharding attributes tf2xla wrote
  build.device_assignment = xc.DeviceAssignment.create(np.arange(num_partitions).reshape(1, -1))
  return options


# --- lowering ----------------------------------------------------------------------------------
@dataclasses.dataclass
class Parameter:
  """One entry parameter of the lowered step: an argument, a variable or a captured tensor."""

  number: int
  kind: str  # 'argument', 'variable' or 'capture'
  name: str
  sharding: Sharding
  variable: Optional[tf.Variable] = None
  value: Optional[np.ndarray] = None  # captured tensors: their (constant) value


def _entry(module: hlo_pb2.HloModuleProto):
  return next(c for c in module.computations if c.id == module.entry_computation_id)


def _root(module: hlo_pb2.HloModuleProto):
  entry = _entry(module)
  return next(i for i in entry.instructions if i.id == entry.root_id)


def _proto(sharding: Sharding) -> xla_data_pb2.OpSharding:
  proto = xla_data_pb2.OpSharding()
  proto.CopyFrom(op_sharding.to_proto(sharding))
  return proto


def _replicated() -> xla_data_pb2.OpSharding:
  return xla_data_pb2.OpSharding(type=xla_data_pb2.OpSharding.REPLICATED)


def _check_even(sharding: Sharding, shape: tuple, what: str) -> None:
  """Parameters are fed as jax arrays, which hold only even shards (XLA itself would pad)."""
  sharding.check_shape(shape, what)
  tiles = sharding.tile_shape if sharding.is_tiled else None
  if tiles and any(size % t for size, t in zip(shape, tiles)):
    raise ValueError(
      f'{what}: sharding {sharding} splits shape {shape} unevenly; the XLA '
      'partitioner side feeds its parameters as jax arrays, which need every '
      'split dim divisible by its shard count.'
    )


def lower_annotated(
  fn,
  args: Sequence,
  arg_shardings: Sequence[Optional[Sharding]],
  variable_sharding,
  out_shardings=None,
) -> tuple:
  """(HloModuleProto with parameter and result shardings, [Parameter], {result: parameter} of
  the variables' new values, number of results).

  `fn`: the annotated tf.function; `args`: example arguments (tensors);
  `arg_shardings`: one Sharding (None: replicated) per argument;
  `variable_sharding(variable)`: the Sharding the variable is kept in (None: replicated);
  `out_shardings`: one Sharding (None: replicated) per result that is not a variable's new
  value, in order (None: all replicated).
  """
  from tf_gspmd.graph.capture import partition_trace

  jitted = tf.function(getattr(fn, 'python_function', fn), jit_compile=True)
  tensors = [tf.convert_to_tensor(a) for a in args]
  # Traced as the program it is: a variable tf_gspmd holds as shards reads its own handle here
  # (its value is read and written eagerly below, which assembles and scatters the shards).
  with partition_trace():
    module = hlo_pb2.HloModuleProto.FromString(
      jitted.experimental_get_compiler_ir(*tensors)(stage='hlo_serialized')
    )
    concrete = jitted.get_concrete_function(*tensors)
  step_name = getattr(fn, '__name__', None) or concrete.name.decode()
  entry = _entry(module)
  hlo_params = sorted(
    (i for i in entry.instructions if i.opcode == 'parameter'), key=lambda i: i.parameter_number
  )
  captured = list(concrete.captured_inputs)
  if len(hlo_params) != len(tensors) + len(captured):
    raise ValueError(
      f'XLA partitioner: step {step_name} lowered to {len(hlo_params)} parameters, expected '
      f'{len(tensors)} arguments + {len(captured)} captured inputs.'
    )
  variables = {id(v.handle): v for v in concrete.variables}
  params = []
  for number, hlo_param in enumerate(hlo_params):
    if number < len(tensors):
      param = Parameter(number, 'argument', f'arg{number}', arg_shardings[number])
    else:
      handle = captured[number - len(tensors)]
      var = variables.get(id(handle))
      if var is not None:
        param = Parameter(number, 'variable', var.name, variable_sharding(var), variable=var)
      else:
        param = Parameter(number, 'capture', f'capture{number}', None, value=handle.numpy())
    if param.sharding is not None:
      _check_even(
        param.sharding,
        tuple(hlo_param.shape.dimensions),
        f'XLA partitioner: {param.kind} {param.name} of {step_name}',
      )
    hlo_param.sharding.CopyFrom(
      _proto(param.sharding) if param.sharding is not None else _replicated()
    )
    params.append(param)
  alias = {e.output_shape_index[0]: e.parameter_number for e in module.input_output_alias.entries}
  # No donation, as in tf_gspmd's exported program: both sides keep their inputs alive, so
  # peak memory compares like with like and an input may be fed again (benchmarks do).
  module.ClearField('input_output_alias')
  root = _root(module)
  outputs = len(root.shape.tuple_shapes) if root.shape.tuple_shapes else 1
  given = iter(_proto(s) if s is not None else _replicated() for s in out_shardings or ())
  results = [
    hlo_params[alias[k]].sharding if k in alias else next(given, _replicated())
    for k in range(outputs)
  ]
  root.sharding.CopyFrom(
    xla_data_pb2.OpSharding(type=xla_data_pb2.OpSharding.TUPLE, tuple_shardings=results)
    if root.shape.tuple_shapes
    else results[0]
  )
  return module, params, alias, outputs


# --- the step ----------------------------------------------------------------------------------
class XlaPartitionedStep:
  """`fn` lowered as written (annotations included) and partitioned by XLA on `num_devices`.

  Call it like `fn` with global arguments; variables live sharded on the PJRT
  devices between calls (`read_variables()` gives their global values) and are
  written back into the tf.Variables by `sync_variables()`.
  """

  def __init__(
    self,
    fn,
    args: Sequence,
    num_devices: int,
    *,
    arg_shardings: Optional[Sequence[Optional[Sharding]]] = None,
    variable_sharding=lambda v: None,
    out_shardings: Optional[Sequence[Optional[Sharding]]] = None,
  ):
    import jax

    self._jax = jax
    self.devices = pjrt.jax_devices(num_devices)
    arg_shardings = list(arg_shardings) if arg_shardings is not None else [None] * len(args)
    self.module, self.parameters, self.alias, self.num_outputs = lower_annotated(
      fn, args, arg_shardings, variable_sharding, out_shardings
    )
    xc = _xla_client()
    stablehlo = xc._xla.mlir.hlo_to_stablehlo(self.module.SerializeToString())  # noqa: SLF001
    start = time.perf_counter()
    self.executable = self.devices[0].client.compile_and_load(
      stablehlo, xc.DeviceList(tuple(self.devices)), spmd_compile_options(num_devices)
    )
    self.compile_seconds = time.perf_counter() - start
    self._in_shardings = [
      _gspmd_sharding(self.devices, s) for s in self.executable.get_parameter_shardings()
    ]
    self._out_shardings = [
      _gspmd_sharding(self.devices, s) for s in self.executable.get_output_shardings()
    ]
    root = _root(self.module)
    self._output_shapes = [
      tuple(s.dimensions)
      for s in (root.shape.tuple_shapes if root.shape.tuple_shapes else [root.shape])
    ]
    self._state = {
      p.number: self._put(p, p.variable.numpy() if p.variable is not None else p.value)
      for p in self.parameters
      if p.kind != 'argument'
    }

  def _put(self, param: Parameter, value):
    # 64-bit on: TF steps hold int64 state (Keras's iteration count), which jax would narrow.
    with self._jax.enable_x64(True):
      return self._jax.device_put(np.asarray(value), self._in_shardings[param.number])

  def run(self, *args) -> list:
    """One step on device arrays: returns the outputs of `fn` as jax arrays (variables stay)."""
    inputs = [
      self._put(p, args[p.number]) if p.kind == 'argument' else self._state[p.number]
      for p in self.parameters
    ]
    results = self.executable.execute_sharded(inputs)
    per_device = results.disassemble_into_single_device_arrays()
    with self._jax.enable_x64(True):
      outputs = [
        self._jax.make_array_from_single_device_arrays(
          self._output_shapes[k], self._out_shardings[k], shards
        )
        for k, shards in enumerate(per_device)
      ]
    for k, number in self.alias.items():
      self._state[number] = outputs[k]
    return [outputs[k] for k in range(self.num_outputs) if k not in self.alias]

  def __call__(self, *args):
    outputs = [np.asarray(o) for o in self.run(*args)]
    return outputs[0] if len(outputs) == 1 else outputs

  def read_variables(self) -> Dict[str, np.ndarray]:
    """Global value of every variable, by variable name."""
    return {
      p.name: np.asarray(self._state[p.number]) for p in self.parameters if p.kind == 'variable'
    }

  def sync_variables(self) -> None:
    for p in self.parameters:
      if p.kind == 'variable':
        p.variable.assign(np.asarray(self._state[p.number]))

  # --- what XLA made of it ---------------------------------------------------------------------
  def partitioned_hlo(self) -> str:
    return self.executable.hlo_modules()[0].to_string()

  def collectives(self) -> List[dict]:
    return partitioned_collectives(self.partitioned_hlo(), len(self.devices))

  def memory(self) -> dict:
    return compiled_memory(self.executable)


def compiled_memory(executable) -> dict:
  """Per-device bytes from XLA's buffer assignment; peak = arguments + outputs - aliased + temps."""
  stats = executable.get_compiled_memory_stats()
  peak = (
    stats.argument_size_in_bytes
    + stats.output_size_in_bytes
    - stats.alias_size_in_bytes
    + stats.temp_size_in_bytes
  )
  return dict(
    arguments=stats.argument_size_in_bytes,
    outputs=stats.output_size_in_bytes,
    aliased=stats.alias_size_in_bytes,
    temps=stats.temp_size_in_bytes,
    peak=peak,
  )


# --- reading collectives from HLO text ---------------------------------------------------------
# Bytes per element of each HLO element type: the one table (bench/xla_reference.py, which
# runs where TensorFlow cannot be imported, reads it from this file's source). Every 8-bit
# float XLA names is here: an fp8 program's HLO must not stop the byte count.
_DTYPE_BYTES = {
  'pred': 1,
  's8': 1,
  'u8': 1,
  'f8e5m2': 1,
  'f8e4m3fn': 1,
  'f8e4m3': 1,
  'f8e3m4': 1,
  'f8e4m3b11fnuz': 1,
  'f8e4m3fnuz': 1,
  'f8e5m2fnuz': 1,
  'f8e8m0fnu': 1,
  's16': 2,
  'u16': 2,
  'f16': 2,
  'bf16': 2,
  's32': 4,
  'u32': 4,
  'f32': 4,
  's64': 8,
  'u64': 8,
  'f64': 8,
  'c64': 8,
  'c128': 16,
}
_COLLECTIVES = ('all-gather', 'all-to-all', 'collective-permute', 'all-reduce', 'reduce-scatter')
_OTHER_COMMUNICATION = ('send', 'recv', 'collective-broadcast', 'ragged-all-to-all')
_INSTRUCTION = re.compile(r'^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$')
_ARRAY = re.compile(r'\b([a-z][a-z0-9]*)\[([0-9,]*)\]')


def _arrays(shape: str) -> List[tuple]:
  found = []
  for dtype, dims in _ARRAY.findall(shape):
    if dtype == 'token':
      continue
    if dtype not in _DTYPE_BYTES:
      raise ValueError(f'HLO shape {shape!r}: no byte size known for element type {dtype!r}.')
    found.append((dtype, [int(d) for d in dims.split(',') if d]))
  return found


def _bytes(shape: str) -> int:
  return sum(_DTYPE_BYTES[t] * math.prod(d) for t, d in _arrays(shape))


def _split_instruction(line: str):
  """(name, shape, opcode, operand names, attributes) of an HLO instruction line, else None."""
  match = _INSTRUCTION.match(line)
  if not match:
    return None
  name, rest = match.groups()
  depth, end = 0, None
  for i, c in enumerate(rest):  # the shape ends at the first space outside brackets
    depth += c in '([{'
    depth -= c in ')]}'
    if c == ' ' and depth == 0:
      end = i
      break
  if end is None:
    return None
  shape, rest = rest[:end], rest[end + 1 :]
  opcode = re.match(r'([\w\-]+)\(', rest)
  if not opcode:
    return None
  depth = 0
  for i in range(opcode.end() - 1, len(rest)):
    depth += rest[i] == '('
    depth -= rest[i] == ')'
    if depth == 0:
      break
  operands = re.findall(r'%([\w.\-]+)', rest[opcode.end() : i])
  return name, shape, opcode.group(1), operands, rest[i + 1 :]


def _group_size(attrs: str, num_devices: int) -> int:
  iota = re.search(r'replica_groups=\[(\d+),(\d+)\]<=', attrs)
  if iota:
    return int(iota.group(2))
  # Mesh form: replica_groups=mesh['a'=2,'b'=4](, device_ids=...)? {'b'} -- one group spans the
  # listed axes (or sub-axes 'b':(pre)size).
  mesh = re.search(r'replica_groups=mesh\[([^\]]*)\][^{]*\{([^}]*)\}', attrs)
  if mesh:
    sizes = dict((n, int(s)) for n, s in re.findall(r"'([^']+)'=(\d+)", mesh.group(1)))
    return math.prod(
      int(sub) if sub else sizes[name]
      for name, sub in re.findall(r"'([^']+)'(?::\(\d+\)(\d+))?", mesh.group(2))
    )
  explicit = re.search(r'replica_groups=\{(\{[\d,]*\})?', attrs)
  if explicit:
    first = explicit.group(1)
    return len([v for v in first.strip('{}').split(',') if v]) if first else num_devices
  raise ValueError(f'cannot read the replica groups of collective attributes {attrs[:200]!r}')


def partitioned_collectives(hlo_text: str, num_devices: int) -> List[dict]:
  """Every collective of (partitioned) HLO text: kind, shapes, group size, bytes per device."""
  lines = [s for s in (_split_instruction(line) for line in hlo_text.splitlines()) if s is not None]
  shapes = {name: shape for name, shape, *_ in lines}
  done_shape = {
    operands[0]: shape
    for _, shape, opcode, operands, _ in lines
    if opcode.endswith('-done') and operands
  }
  found = []
  for name, shape, opcode, operands, attrs in lines:
    kind = re.sub(r'-(start|done)$', '', opcode)
    if kind in _OTHER_COMMUNICATION:
      raise ValueError(f'{opcode} {name}: communication without a bytes rule here.')
    if kind not in _COLLECTIVES or opcode.endswith('-done'):
      continue
    result = done_shape.get(name, shape) if opcode.endswith('-start') else shape
    operand_bytes = sum(_bytes(shapes[o]) for o in operands)
    if kind == 'collective-permute':
      pairs = re.findall(r'\{(\d+),(\d+)\}', attrs.split('source_target_pairs=')[-1])
      size = 2
      received = operand_bytes if any(s != t for s, t in pairs) else 0
    else:
      size = _group_size(attrs, num_devices)
      received = _received(
        kind, operand_bytes, _bytes(result), [_arrays(shapes[o]) for o in operands], size
      )
    found.append(dict(kind=kind, name=name, shape=result, group_size=size, bytes=received))
  return found


def _received(kind: str, operand: int, result: int, operand_arrays, g: int) -> int:
  if g == 1:
    return 0
  if kind == 'all-gather':
    return result - operand
  if kind in ('all-to-all', 'reduce-scatter'):
    return operand * (g - 1) // g
  # all-reduce: ring reduce-scatter then ring all-gather, per operand array
  return sum(
    2 * (g - 1) * -(-math.prod(dims) // g) * _DTYPE_BYTES[dtype]
    for arrays in operand_arrays
    for dtype, dims in arrays
  )
