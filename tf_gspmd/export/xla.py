"""The XLA / TPU export of a partitioned program: `save_xla` and `load_xla`.

Reached as `tg.saved_model.save_xla` / `load_xla`. `save_xla(pf, dir, *example_args)` writes
the per-replica StableHLO module, the layouts of its parameters and results, the values it
takes after the arguments, and the unpartitioned function annotated with its propagated
shardings (a SavedModel); `load_xla(dir)` reads the module, layouts and values back.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Any, Dict

import numpy as np
import tensorflow as tf

from tf_gspmd import op_sharding
from tf_gspmd.export.programs import (
  DEFAULT_SIGNATURE,
  function_and_examples,
  mesh_json,
  pf_name,
  sharding_json,
)
from tf_gspmd.mesh import Mesh
from tf_gspmd.partitioned import Compiled, PartitionedFunction
from tf_gspmd.sharding import NamedSharding, Sharding

XLA_MODULE = 'module.mlir'
XLA_LAYOUTS = 'layouts.json'
XLA_VALUES = 'values.npz'
ANNOTATED = 'annotated'


def save_xla(pf, export_dir: str, *example_args):
  """Write the XLA/TPU export of `pf` for these example arguments; returns its `XlaExport`.

  `pf`: a `PartitionedFunction`, or a Keras 3 model prepared with
  `tg.partition_model` (its forward pass `model(x, training=False)` over the
  mesh and layouts its steps use, with the weights it holds now).

  `module.mlir`: the per-replica StableHLO module (partition id = replica id,
  native collectives). `layouts.json`: mesh and, for every parameter and
  result, its global shape, dtype, sharding (serialized OpSharding) and local
  shape. `values.npz`: global values of the captures and variables the module
  takes after the arguments (`arg<i>` by parameter index). `annotated/`: the
  unpartitioned function as a SavedModel ('serving_default' and `.function`)
  whose ops carry their propagated shardings as `_XlaSharding` attributes.
  """
  if not isinstance(pf, PartitionedFunction):
    pf, _ = function_and_examples(pf, example_args)
  compiled = pf.get_program(*example_args)
  export = pf.export_xla(*example_args)
  os.makedirs(export_dir, exist_ok=True)
  with open(os.path.join(export_dir, XLA_MODULE), 'w') as f:
    f.write(export.module)
  mesh = export.mesh
  data = {
    'format': 'tf_gspmd.xla/1',
    'name': export.name,
    'num_replicas': export.num_replicas,
    'mesh': mesh_json(mesh),
    'args': [_xla_layout_json(a) for a in export.args],
    'results': [_xla_layout_json(r) for r in export.results],
  }
  with open(os.path.join(export_dir, XLA_LAYOUTS), 'w') as f:
    json.dump(data, f, indent=1)
  n_args = len(compiled.program.arg_inputs)
  values = [np.asarray(v) for v in compiled.capture_values]
  values += [pf.store.sharded[id(v)].assemble().numpy() for v in compiled.variables]
  np.savez(
    os.path.join(export_dir, XLA_VALUES), **{f'arg{n_args + i}': v for i, v in enumerate(values)}
  )
  _save_annotated(pf, compiled, os.path.join(export_dir, ANNOTATED))
  return export


def load_xla(export_dir: str):
  """(XlaExport, {parameter index: global value}) read back from `save_xla`'s files."""
  from tf_gspmd.xla_bridge.export import ExportedValue, XlaExport

  with open(os.path.join(export_dir, XLA_LAYOUTS)) as f:
    data = json.load(f)
  with open(os.path.join(export_dir, XLA_MODULE)) as f:
    module = f.read()
  mesh = Mesh(
    np.asarray(data['mesh']['devices']).reshape(data['mesh']['shape']), data['mesh']['axis_names']
  )

  def layout(d):
    sharding = (
      None
      if d['sharding'] is None
      else op_sharding.from_proto(bytes.fromhex(d['sharding']['op_sharding']), mesh=mesh)
    )
    return ExportedValue(
      d['name'],
      d['kind'],
      tuple(d['shape']),
      tf.as_dtype(d['dtype']),
      sharding,
      tuple(d['local_shape']),
      d['updates'],
    )

  export = XlaExport(
    module,
    mesh,
    [layout(a) for a in data['args']],
    [layout(r) for r in data['results']],
    data['name'],
  )
  with np.load(os.path.join(export_dir, XLA_VALUES)) as stored:
    values = {int(k[3:]): stored[k] for k in stored.files}
  return export, values


def _xla_layout_json(layout) -> Dict[str, Any]:
  return {
    'name': layout.name,
    'kind': layout.kind,
    'shape': [int(s) for s in layout.shape],
    'dtype': tf.as_dtype(layout.dtype).name,
    'sharding': None if layout.sharding is None else sharding_json(layout.sharding),
    'local_shape': [int(s) for s in layout.local_shape],
    'updates': layout.updates,
  }


def resolved(sharding: NamedSharding) -> NamedSharding:
  """A sharding as OpSharding can say it: a pending reduction shown as its result's layout."""
  if isinstance(sharding, NamedSharding) and sharding.partial is not None:
    return NamedSharding(sharding.mesh, sharding.spec)
  return sharding


def annotated_shardings(pf: PartitionedFunction, *example_args) -> Dict[str, Sharding]:
  """node name -> the sharding `save_xla` writes on it (resolved propagated shardings)."""
  compiled = pf.get_program(*example_args)
  return _node_shardings(compiled)


def _node_shardings(compiled: Compiled) -> Dict[str, Any]:
  """Per node of the top-level graph: its outputs' propagated shardings (one or a tuple).

  Placeholders (arguments, variables, captures: rebuilt as the function's
  inputs), XlaSharding ops (they keep the user's annotation) and ops with
  resource or variant outputs are left as they are.
  """
  main, propagation = compiled.program.main, compiled.propagation
  out = {}
  for node in main.nodes:
    if node.op in ('Placeholder', 'XlaSharding') or not node.outputs:
      continue
    if any(t.dtype in (tf.resource, tf.variant) for t in node.outputs):
      continue
    try:
      shardings = [resolved(propagation.target(main, t.name)) for t in node.outputs]
    except KeyError:
      continue
    out[node.name] = shardings[0] if len(shardings) == 1 else tuple(shardings)
  return out


def _sharding_attr(shardings):
  from tensorflow.core.framework import attr_value_pb2

  if isinstance(shardings, tuple):
    proto = op_sharding._pb().OpSharding(  # noqa: SLF001
      type=op_sharding._pb().OpSharding.TUPLE,  # noqa: SLF001
      tuple_shardings=[op_sharding.to_proto(s) for s in shardings],
    )
  else:
    proto = op_sharding.to_proto(shardings)
  return attr_value_pb2.AttrValue(s=proto.SerializeToString())


def _save_annotated(pf, compiled: Compiled, export_dir: str) -> None:
  """The unpartitioned function, every op annotated with `_XlaSharding`, as a SavedModel."""
  import copy

  from tf_gspmd.graph.rebuild import rebuild

  program = compiled.program
  annotations = _node_shardings(compiled)
  nodes = []
  for node in program.main.nodes:
    if node.name in annotations:
      node = dataclasses.replace(
        node, attrs=dict(node.attrs, _XlaSharding=_sharding_attr(annotations[node.name]))
      )
    nodes.append(node)
  annotated = copy.copy(program)
  annotated.main = dataclasses.replace(program.main, nodes=nodes)
  # Fresh variables with the current global values: the export does not hold the user's own.
  module = tf.Module()
  replaced = {}
  for name, var in program.variables.items():
    sharded = pf.store.sharded[id(var)]
    replaced[name] = tf.Variable(sharded.assemble(), name=var.name.split(':')[0])
  annotated.variables = replaced
  module.held = list(replaced.values())
  main = program.main
  specs = [
    tf.TensorSpec(
      main.tensor(n).shape, main.tensor(n).dtype, name=re.sub(r'\W', '_', n.split(':')[0])
    )
    for n in program.arg_inputs
  ]
  body = rebuild(annotated, name=f'{pf_name(pf)}_annotated')

  @tf.function(input_signature=specs, autograph=False)
  def function(*args):
    outputs = tf.nest.flatten(body(*args), expand_composites=True)
    return {f'output_{j}': o for j, o in enumerate(outputs)}

  module.function = function
  tf.saved_model.save(module, export_dir, signatures={DEFAULT_SIGNATURE: function})
