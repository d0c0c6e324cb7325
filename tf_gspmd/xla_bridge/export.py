"""Export a per-partition program as one StableHLO module for every XLA replica.

`export_per_replica(mesh, fn, local_args)` traces `fn(ctx, *local_args)` with
`NativeCollectives` (partition id = replica id, every collective native) and
lowers it with tf2xla (`experimental_get_compiler_ir(stage='stablehlo')`), the
route that also turns the variables the program assigns into results (the
MLIR bridge route keeps resource ops and leaves `XlaAllReduce` unlowered; see
shared/notes/xla-bridge-facts.md). The result is an `XlaExport`: the module
text (entry `@main`), the mesh, and one `ExportedValue` per argument and result
telling how the global value is spread over the replicas (replica r holds
the shard of mesh device r, padded to the ceil shard shape).

Results are the program's outputs followed by the new values of the
variables it assigns (tf2xla appends them and says which argument each one
updates; a variable only read has no result).

A program with an op XLA cannot compile raises `XlaLoweringError` naming the
op type and node; nothing falls back to another path.
"""

from __future__ import annotations

import dataclasses
import re
from typing import List, Optional, Sequence

import numpy as np
import tensorflow as tf

from tf_gspmd.mesh import Mesh
from tf_gspmd.sharding import Sharding
from tf_gspmd.xla_bridge import native


class XlaLoweringError(ValueError):
  """An op of the per-partition program has no XLA lowering."""


@dataclasses.dataclass(frozen=True)
class ExportedValue:
  """How one global argument or result of an exported program lies on the replicas.

  `sharding` is None for a value with no global form (a hand-written
  per-replica program's local values): replica r simply holds its own value.
  """

  name: str
  kind: str  # 'argument', 'capture', 'variable' (argument or result), 'output'
  shape: tuple  # global shape (the local shape when sharding is None)
  dtype: tf.DType
  sharding: Optional[Sharding]
  local_shape: tuple  # what one replica holds (ceil shard shape, padded)
  updates: Optional[int] = None  # for a variable result: the argument index it replaces

  def describe(self) -> str:
    where = 'per replica' if self.sharding is None else str(self.sharding)
    target = f' (new value of argument {self.updates})' if self.updates is not None else ''
    return (
      f'{self.kind} {self.name}: {self.dtype.name}{list(self.shape)} as {where}, '
      f'{self.dtype.name}{list(self.local_shape)} per replica{target}'
    )


@dataclasses.dataclass
class XlaExport:
  """A per-replica StableHLO program and how its global values map onto the replicas.

  `module` runs with `num_replicas = mesh.size`, one partition per replica,
  replica r on mesh device id r; `args[i]`/`results[j]` describe parameter i
  and result j of `@main`.
  """

  module: str
  mesh: Mesh
  args: List[ExportedValue]
  results: List[ExportedValue]
  name: str
  # The same module with tf2xla's input/output aliases kept: run through PJRT, each assigned
  # variable's old buffer is donated to its new value (no second copy of it during a step).
  donating_module: Optional[str] = None

  @property
  def num_replicas(self) -> int:
    return self.mesh.size

  def describe(self) -> str:
    lines = [f'{self.name}: one StableHLO program for {self.num_replicas} replicas of {self.mesh}']
    lines += [f'  arg {i}: {a.describe()}' for i, a in enumerate(self.args)]
    lines += [f'  result {j}: {r.describe()}' for j, r in enumerate(self.results)]
    return '\n'.join(lines)


def export_per_replica(
  mesh: Mesh,
  fn,
  local_args: Sequence,
  *,
  name: str = 'per_replica',
  arg_values: Optional[Sequence[ExportedValue]] = None,
  output_values: Optional[Sequence[ExportedValue]] = None,
) -> XlaExport:
  """Trace `fn(ctx, *local_args)` per replica and lower it to StableHLO with native collectives.

  `local_args` are example local values: tensors (or numpy arrays) of the
  local shapes, and `tf.Variable`s for variables the program reads or
  assigns. Layouts default to per-replica values named by position.
  """
  from tf_gspmd.program import PartitionContext

  local_args = [a if isinstance(a, tf.Variable) else tf.convert_to_tensor(a) for a in local_args]

  def per_replica(*local):
    ctx = PartitionContext(mesh, native.NativeCollectives(mesh))
    outputs = fn(ctx, *local)
    return [] if outputs is None else [tf.convert_to_tensor(o) for o in tf.nest.flatten(outputs)]

  per_replica.__name__ = re.sub(r'\W', '_', name)
  function = tf.function(per_replica, jit_compile=True)
  concrete = function.get_concrete_function(*local_args)
  try:
    text = function.experimental_get_compiler_ir(*local_args)(stage='stablehlo')
  except (tf.errors.OpError, ValueError) as error:  # TF wraps tf2xla's refusal in a ValueError
    raise _lowering_error(error, name) from None
  args = (
    list(arg_values)
    if arg_values is not None
    else [
      _local_value(f'arg{i}', 'variable' if isinstance(a, tf.Variable) else 'argument', a)
      for i, a in enumerate(local_args)
    ]
  )
  _check_parameters(text, local_args, [a.name for a in args], name)
  aliases = _input_output_aliases(text)
  module = native.to_native(_clean_module(text, per_replica.__name__))
  donating = native.to_native(_clean_module(text, per_replica.__name__, keep_aliases=True))
  outputs = [tf.TensorSpec(t.shape, t.dtype) for t in concrete.outputs]
  results = (
    list(output_values)
    if output_values is not None
    else [_local_value(f'output{j}', 'output', spec) for j, spec in enumerate(outputs)]
  )
  if len(args) != len(local_args) or len(results) != len(outputs):
    raise ValueError(
      f'export {name}: {len(args)} argument descriptions for {len(local_args)} '
      f'arguments, {len(results)} output descriptions for {len(outputs)} outputs.'
    )
  for output_index, param in sorted(aliases):
    if output_index != len(results):
      raise ValueError(
        f'export {name}: tf2xla put the new value of argument {param} at result '
        f'{output_index}, expected {len(results)} (after the outputs).'
      )
    results.append(dataclasses.replace(args[param], kind='variable', updates=param))
  return XlaExport(module, mesh, args, results, name, donating_module=donating)


_MAIN_SIGNATURE = re.compile(r'func\.func @main\((?P<params>.*?)\) -> ')
_PARAM_TYPE = re.compile(r'%arg\d+: (?P<type>tensor<[^>]*>)')
_ELEMENT_TYPES = {
  'float32': 'f32',
  'float64': 'f64',
  'float16': 'f16',
  'bfloat16': 'bf16',
  'int8': 'i8',
  'int16': 'i16',
  'int32': 'i32',
  'int64': 'i64',
  'uint8': 'ui8',
  'uint16': 'ui16',
  'uint32': 'ui32',
  'uint64': 'ui64',
  'bool': 'i1',
}


def _tensor_type(value) -> str:
  shape = tuple(int(d) for d in value.shape)
  element = _ELEMENT_TYPES.get(tf.as_dtype(value.dtype).name, tf.as_dtype(value.dtype).name)
  return 'tensor<' + ''.join(f'{d}x' for d in shape) + element + '>'


def _check_parameters(text: str, local_args: Sequence, arg_names: Sequence[str], name: str) -> None:
  """Raise when tf2xla folded an argument into the program as a compile-time constant.

  XLA needs some inputs as constants (a `tf.range` bound, a shape); tf2xla then
  drops that parameter and bakes in the example value, which would silently run
  every call with it.
  """
  match = _MAIN_SIGNATURE.search(text)
  params = [m.group('type') for m in _PARAM_TYPE.finditer(match.group('params'))] if match else []
  if len(params) == len(local_args):
    return
  dropped, j = [], 0
  for i, value in enumerate(local_args):  # tf2xla keeps the order of the parameters it keeps
    if j < len(params) and params[j] == _tensor_type(value):
      j += 1
    else:
      dropped.append(arg_names[i] if i < len(arg_names) else f'#{i}')
  raise XlaLoweringError(
    f'export {name}: XLA needs argument(s) {dropped} as compile-time '
    'constants (e.g. the bound of a tf.range loop or a shape), so they cannot be run-time '
    'inputs of the exported program. Pass such values as Python numbers (they become part '
    'of the traced function) instead of tensors.'
  )


def _local_value(name: str, kind: str, value) -> ExportedValue:
  shape = tuple(int(d) for d in value.shape)
  return ExportedValue(name, kind, shape, tf.as_dtype(value.dtype), None, shape)


# --- reading and cleaning tf2xla's module text -------------------------------------------------
_ALIAS_ATTR = re.compile(r'mhlo\.input_output_alias = \[(?P<body>.*?)\](?=, mhlo\.|\})')
_ALIAS = re.compile(
  r'parameter_number = (?P<param>\d+) : i64\}, output_index = array<i64: '
  r'(?P<output>\d+)>'
)


def _input_output_aliases(text: str) -> List[tuple]:
  """(result index, parameter number) of every result that is a variable's new value."""
  header = text.split('{', 1)[0] + '{' + text.split('{', 1)[1].split('\n', 1)[0]
  match = _ALIAS_ATTR.search(header)
  if not match:
    return []
  return [
    (int(m.group('output')), int(m.group('param'))) for m in _ALIAS.finditer(match.group('body'))
  ]


_PACKED_BOOLS = re.compile(
  r'dense<"0x(?P<hex>[0-9A-Fa-f]*)">(?P<type> : tensor<(?P<dims>[0-9x]*?)x?i1>)'
)


def _bool_per_byte(match: 're.Match') -> str:
  """A boolean constant's hex data, one byte per element. TF 2.21's MLIR prints an i1 tensor
  packed eight elements to a byte (least significant bit first); the StableHLO parser of
  jaxlib 0.10.2 reads one byte per element and refuses the packed form ('elements hex data
  size is invalid'): every program with a non-splat boolean constant (an attention's causal
  mask) failed on backend='xla'."""
  data = bytes.fromhex(match.group('hex'))
  dims = [int(d) for d in match.group('dims').split('x') if d]
  count = int(np.prod(dims)) if dims else 1
  if len(data) == count or len(data) != (count + 7) // 8:
    return match.group(0)  # already one byte per element (or a form this does not know)
  bits = np.unpackbits(np.frombuffer(data, np.uint8), bitorder='little')[:count]
  return f'dense<"0x{bits.astype(np.uint8).tobytes().hex().upper()}">{match.group("type")}'


def _clean_module(text: str, name: str, keep_aliases: bool = False) -> str:
  """The module named `name`, without tf2xla's aliasing unless `keep_aliases` (an exported
  module's runner, TF's XlaCallModule or a TPU, does not donate its arguments), its boolean
  constants one byte per element (`_bool_per_byte`)."""
  text = _PACKED_BOOLS.sub(_bool_per_byte, text)
  lines = text.splitlines()
  for i, line in enumerate(lines):
    if line.startswith('module @'):
      if not keep_aliases:
        line = re.sub(r'mhlo\.input_output_alias = \[.*?\](?=, mhlo\.|\})(, )?', '', line)
      lines[i] = re.sub(r'^module @[\w.\-]+', f'module @{name}', line)
      break
  return '\n'.join(lines)


_UNSUPPORTED = re.compile(r'(?P<op>[A-Za-z0-9_]+) \(No registered \'[A-Za-z0-9_]+\' OpKernel')
_NODE = re.compile(r'\{\{node (?P<node>[^}]+)\}\}')


def _lowering_error(error: Exception, name: str) -> XlaLoweringError:
  message = str(error)
  ops = sorted({m.group('op') for m in _UNSUPPORTED.finditer(message)})
  nodes = sorted({m.group('node') for m in _NODE.finditer(message)})
  if ops:
    what = f'op type {", ".join(ops)} (node {", ".join(nodes) or "unknown"}) has no XLA lowering'
  else:
    what = f'XLA could not compile it (nodes: {", ".join(nodes) or "unknown"})'
  gist = next((line.strip() for line in message.splitlines() if line.strip()), '')
  return XlaLoweringError(
    f'export {name}: {what}; the XLA backend cannot run this program. (tf2xla: {gist[:400]})'
  )
