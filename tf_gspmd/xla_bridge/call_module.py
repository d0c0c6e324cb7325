"""Embed an exported per-replica StableHLO module in a TF graph with the `XlaCallModule` op.

`export_per_replica` (export.py) gives one StableHLO module for every replica:
partition id = XLA replica id, every collective native (all-gather,
all-to-all, collective-permute, all-reduce, reduce-scatter). `call_module`
runs THAT module from TF: the op `XlaCallModule` carries the module as a
serialized StableHLO portable artifact, and tf2xla (the compiler TPUStrategy
uses) inlines it into the replica computation, so the collectives and the
replica id it holds become the TPU program's own.

Two things of tf2xla's text are not what `XlaCallModule` reads, and
`serialized_module` fixes them:

* tf2xla writes the new value of an assigned variable through an
  `mhlo.copy` (an identity); a portable artifact holds StableHLO only, so it
  becomes an identity `stablehlo.reshape` of the same type.
* With more than one platform (TPU and CPU: TPU to run, CPU to be lowered
  and tested on this machine), `XlaCallModule` passes the platform index as
  the first argument of `@main`. The module's `@main` becomes a private
  function and a new `@main` takes the index first and calls it.

The MLIR python bindings that parse the text and write the artifact come
with jaxlib (the optional `tf_gspmd[xla]` extra), imported only here.
"""

from __future__ import annotations

import re
from typing import List, Sequence

import tensorflow as tf
from tensorflow.compiler.tf2xla.ops import gen_xla_ops

from tf_gspmd.xla_bridge.export import XlaExport

# XlaCallModule's calling convention (the op's `version` attribute): 9 is the
# oldest with platform-index arguments that TF 2.21 and jax 0.10.2 both accept.
CALL_MODULE_VERSION = 9
DEFAULT_PLATFORMS = ('TPU', 'CPU')
_BODY = 'per_replica_body'

_COPY = re.compile(r'= mhlo\.copy (?P<operand>%[\w.#]+) : (?P<type>tensor<[^>]*>)')
_MHLO_OP = re.compile(r'(?:= |")(mhlo\.\w+)(?: |"\()')
_MODULE_END = re.compile(r'^\}', re.MULTILINE)
_MAIN = re.compile(r'func\.func (public )?@main\(')


def _stablehlo_only(text: str) -> str:
  """tf2xla's `mhlo.copy` (an identity) as the StableHLO identity of the same type."""
  text = _COPY.sub(
    lambda m: (
      f'= stablehlo.reshape {m.group("operand")} : ({m.group("type")}) -> {m.group("type")}'
    ),
    text,
  )
  leftover = sorted(set(_MHLO_OP.findall(text)))
  if leftover:
    raise ValueError(
      f'call_module: the exported module has non-StableHLO ops {leftover}; '
      'a portable artifact holds StableHLO only.'
    )
  return text


def _with_platform_index(text: str, context) -> str:
  """The module with `@main(platform index, args...)` calling the original `@main(args...)`."""
  from jaxlib.mlir import ir

  if not _MAIN.search(text):
    raise ValueError('call_module: the exported module has no @main function.')
  text = _MAIN.sub(f'func.func private @{_BODY}(', text, count=1)
  module = ir.Module.parse(text, context=context)
  body = next(
    op for op in module.body.operations if ir.StringAttr(op.attributes['sym_name']).value == _BODY
  )
  signature = ir.FunctionType(ir.TypeAttr(body.attributes['function_type']).value)
  inputs = [str(t) for t in signature.inputs]
  results = [str(t) for t in signature.results]
  params = ', '.join(
    ['%platform_index: tensor<i32>'] + [f'%arg{i}: {t}' for i, t in enumerate(inputs)]
  )
  operands = ', '.join(f'%arg{i}' for i in range(len(inputs)))
  call = f'func.call @{_BODY}({operands}) : ({", ".join(inputs)}) -> ({", ".join(results)})'
  if results:
    values = ', '.join(f'%outputs#{j}' for j in range(len(results)))
    lines = [f'    %outputs:{len(results)} = {call}', f'    return {values} : {", ".join(results)}']
  else:
    lines = [f'    {call}', '    return']
  main = '\n'.join(
    [f'  func.func public @main({params}) -> ({", ".join(results)}) {{'] + lines + ['  }']
  )
  # Before the module's closing brace (the location aliases that follow it stay).
  end = _MODULE_END.search(text).start()
  return text[:end] + main + '\n' + text[end:]


def serialized_module(export: XlaExport, platforms: Sequence[str] = DEFAULT_PLATFORMS) -> bytes:
  """`export.module` as a StableHLO portable artifact that `XlaCallModule` can run."""
  from jax._src.interpreters import mlir as jax_mlir
  from jaxlib.mlir import ir
  from jaxlib.mlir.dialects import stablehlo

  text = _stablehlo_only(export.module)
  # jax's context registers the dialects the text uses (func, stablehlo, chlo).
  with jax_mlir.make_ir_context() as context:
    if len(platforms) > 1:
      text = _with_platform_index(text, context)
    module = ir.Module.parse(text)
    # The oldest StableHLO version: the ops of a per-replica program are all old, and the
    # deserializer built into TF may be older than jaxlib's serializer.
    return stablehlo.serialize_portable_artifact(module, stablehlo.get_minimum_version())


def call_module(
  export: XlaExport,
  local_args: Sequence,
  *,
  module: bytes = None,
  platforms: Sequence[str] = DEFAULT_PLATFORMS,
  name: str = None,
) -> List[tf.Tensor]:
  """Run `export`'s module on this replica's local arguments (an `XlaCallModule` op).

  Returns the module's results: the outputs, then the new values of the
  variables it assigns (`export.results[j].updates` names the argument).
  Outside a compiled program (tf.function(jit_compile=True), a TPU
  computation) the op has no kernel: it runs only through XLA.
  """
  if len(local_args) != len(export.args):
    raise ValueError(
      f'call_module {export.name}: {len(local_args)} arguments for '
      f'{len(export.args)} parameters ({[a.name for a in export.args]}).'
    )
  args = []
  for value, described in zip(local_args, export.args):
    value = tf.convert_to_tensor(value)
    if tuple(value.shape) != tuple(described.local_shape) or value.dtype != described.dtype:
      raise ValueError(
        f'call_module {export.name}: {described.kind} {described.name} is '
        f'{value.dtype.name}{list(value.shape)} here, the module takes '
        f'{described.dtype.name}{list(described.local_shape)}.'
      )
    args.append(value)
  if module is None:
    module = serialized_module(export, platforms)
  return list(
    gen_xla_ops.xla_call_module(
      args,
      version=CALL_MODULE_VERSION,
      module=module,
      Sout=[tf.TensorShape(r.local_shape) for r in export.results],
      Tout=[r.dtype for r in export.results],
      dim_args_spec=[],
      platforms=list(platforms),
      name=name or re.sub(r'\W', '_', export.name),
    )
  )
