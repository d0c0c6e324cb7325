"""What an export is made from: the partitioned program, its example arguments, its name.

Shared by the SavedModel export (`saved_model.save`) and the XLA one (`xla.save_xla`): a
`PartitionedFunction`, or a Keras model prepared with `tg.partition_model` (its forward pass),
and the argument signatures to export it for.
"""

from __future__ import annotations

import re
from typing import Any, Dict

import numpy as np
import tensorflow as tf

from tf_gspmd import op_sharding
from tf_gspmd.mesh import Mesh
from tf_gspmd.partitioned import Compiled, PartitionedFunction
from tf_gspmd.sharding import NamedSharding, P, Sharding

DEFAULT_SIGNATURE = 'serving_default'


def function_and_examples(fn, signatures):
  """The PartitionedFunction to export and {signature name: example args}."""
  if isinstance(fn, PartitionedFunction):
    pf = fn
  elif hasattr(fn, '_tf_gspmd_launcher'):
    pf = _keras_forward(fn)
  else:
    raise TypeError(
      f'saved_model: expected a tf_gspmd.PartitionedFunction or a Keras model '
      f'prepared with partition_model, got {type(fn).__name__}.'
    )
  if signatures is None:
    compiled = list(pf._compiled.values())  # noqa: SLF001
    if not compiled:
      raise ValueError(
        'saved_model.save: the function has no argument signature yet; call it (or '
        'get_program) once, or pass signatures=(example args or TensorSpecs).'
      )
    last = pf._last if pf._last is not None else compiled[-1]  # noqa: SLF001
    ordered = [last] + [c for c in compiled if c is not last]
    names = [DEFAULT_SIGNATURE] + [f'serving_{k}' for k in range(1, len(ordered))]
    return pf, {n: _example_args(c) for n, c in zip(names, ordered)}
  if isinstance(signatures, dict):
    return pf, {str(n): _as_examples(a) for n, a in signatures.items()}
  return pf, {DEFAULT_SIGNATURE: _as_examples(signatures)}


def _as_examples(args) -> tuple:
  args = tuple(args) if isinstance(args, (list, tuple)) else (args,)
  return tuple(tf.zeros(a.shape, a.dtype) if isinstance(a, tf.TensorSpec) else a for a in args)


def _example_args(compiled: Compiled) -> tuple:
  """Zeros in the shapes of a compiled program's arguments (it was compiled from such args)."""
  main = compiled.program.main
  return tuple(
    tf.zeros(main.tensor(n).shape, main.tensor(n).dtype) for n in compiled.program.arg_inputs
  )


def _keras_forward(model) -> PartitionedFunction:
  """`model(x, training=False)` partitioned over the mesh and variables `partition_model` uses."""
  from tf_gspmd.annotations import shard

  launcher = model._tf_gspmd_launcher  # noqa: SLF001
  mesh, axes = launcher.mesh, launcher.axes

  def split(t):
    if not isinstance(t, tf.Tensor) or t.shape.rank is None or t.shape.rank == 0:
      return t
    return shard(t, mesh, P(axes, *([None] * (t.shape.rank - 1))))

  @tf.function
  def forward(inputs):
    return model(tf.nest.map_structure(split, inputs), training=False)

  launcher.annotate_unmatched()
  pf = PartitionedFunction(forward, mesh, store=launcher.store, **launcher.kwargs)
  return pf


def pf_name(pf) -> str:
  return re.sub(
    r'\W',
    '_',
    getattr(pf.fn, '__name__', None)
    or getattr(getattr(pf.fn, 'python_function', None), '__name__', 'fn'),
  )


def sharding_json(sharding: Sharding) -> Dict[str, Any]:
  out = {'text': str(sharding)}
  if isinstance(sharding, NamedSharding):
    out['spec'] = [list(a) if isinstance(a, tuple) else a for a in sharding.spec]
  if sharding.partial is None:
    out['op_sharding'] = op_sharding.to_proto(sharding).SerializeToString().hex()
  return out


def mesh_json(mesh: Mesh) -> Dict[str, Any]:
  return {
    'shape': [mesh.shape[a] for a in mesh.axis_names],
    'axis_names': list(mesh.axis_names),
    'devices': np.asarray(mesh.device_ids).reshape(-1).tolist(),
  }
