"""SavedModel export of partitioned programs: `tg.saved_model.save`, `load`, `save_xla`, `load_xla`.

`save(pf, export_dir, signatures=None)` writes a SavedModel whose signatures run
the partitioned program over its N devices. Plain TensorFlow serves it: in a
process with N logical devices, `tf.saved_model.load(export_dir)` (tf_gspmd
not imported) and `signatures['serving_default'](**inputs)` give the global
outputs. `saved_model_cli show` reads it; `saved_model_cli run --worker
grpc://localhost:P` runs it on a device server with N CPU devices
(`python -m tf_gspmd.serve --export DIR --port P`, see `tf_gspmd/serve.py`).

What the SavedModel holds:

* Variables stored as their shards, each distinct shard once: a variable the
  program only reads keeps one `tf.Variable` per distinct shard (the shard of
  the first partition holding it, on that partition's device); partitions
  holding a replica read it from there. So the files hold each variable's
  total bytes (plus the padding of uneven shards), not N copies of the
  replicated ones. A variable the program writes keeps one variable per
  partition (every replica applies the same update to its own copy).
* One signature per argument signature: a tf.function that splits the inputs,
  launches the per-partition program once per device with the same launcher
  the TF backend uses (`runtime.SpmdProgram`, here without progress markers:
  no watchdog runs in a served graph) and assembles the outputs. Collectives
  are TF collective V2 ops: their group and instance keys are constants of the
  graph, and each device's ordering token is a variable handle made in the
  graph on that device (never read, never created: a collective only needs a
  resource on its device). Tokens of saved variables would not do: a plain
  `tf.saved_model.load` puts every variable on the default device, which
  pulls all collectives there, where they wait forever.
* A device check ahead of every collective: with fewer devices than
  partitions, TF's soft placement silently moves the missing devices' work
  onto device 0 and the collectives hang. Each partition's token handle
  records the device it was really placed on, so the signature first checks
  that every partition got its own device and otherwise fails with an error
  naming both counts.
* `assets.extra/tf_gspmd.json`: the mesh, the devices, and every signature's
  input/output layouts (TF does not read `assets.extra`).
* A collective key marker for TF1 sessions (`saved_model_cli run`, TF Serving):
  a session gives a step a collective executor only when its graph has a
  collective_graph_key, which TF derives from V1 collective ops it finds at the
  top level of the graph, never from V2 ops inside function calls (the whole
  program is such a call). So each signature's call node in the MetaGraph gets
  a control input from a one-member V1 `CollectiveReduce` of a constant; TF2
  loading reads only the functions and ignores it.

`load(export_dir)` is the tf_gspmd-side loader: it checks the device count
before loading (a `ValueError` naming both counts) and loads with the
variables on the devices they were saved from (a plain load puts them all on
the default device, which costs a copy per read, not correctness).

`save_xla(pf, export_dir, *example_args)` writes the export for XLA/TPU: the
per-replica StableHLO module (`module.mlir`), the layout of every argument
and result (`layouts.json`), the global values of its captures and variables
(`values.npz`), and the unpartitioned function as a SavedModel (`annotated/`)
whose every op carries its propagated sharding as an `_XlaSharding` attribute
(the form TF's TPU partitioner reads). `load_xla` reads the module and
layouts back as an `XlaExport`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Any, Dict, List, Optional, Sequence

import numpy as np
import tensorflow as tf

from tf_gspmd import op_sharding
from tf_gspmd.mesh import Mesh
from tf_gspmd.partitioned import Compiled, PartitionedFunction
from tf_gspmd.runtime import SpmdProgram
from tf_gspmd.runtime.sharded import ShardedVariable
from tf_gspmd.sharding import NamedSharding, P, Sharding

METADATA = os.path.join('assets.extra', 'tf_gspmd.json')
DEFAULT_SIGNATURE = 'serving_default'
# Reading a variable changes nothing; any other use of its handle may write it.
_READ_ONLY_OPS = frozenset({'ReadVariableOp', 'VarIsInitializedOp', 'VariableShape'})


@dataclasses.dataclass
class ExportInfo:
  """What `save` wrote: signature names, devices, and the variable bytes stored vs held."""

  export_dir: str
  signatures: List[str]
  num_partitions: int
  devices: List[str]
  total_bytes: int  # global bytes of every variable
  stored_bytes: int  # bytes of the shard variables written (distinct shards, padding)
  per_partition_bytes: int  # what one device would hold (one shard of each variable)


# --- saving -----------------------------------------------------------------------------------
def save(fn, export_dir: str, signatures=None) -> ExportInfo:
  """Write a SavedModel whose signatures run `fn`'s partitioned program on its N devices.

  `fn`: a `PartitionedFunction` (`tg.partition`), or a Keras 3 model prepared
  with `tg.partition_model` (its forward pass `model(x, training=False)` is
  exported, the batch split as `partition_model` splits it).
  `signatures`: None (every argument signature `fn` was called or
  `get_program`-ed with; the last one is 'serving_default'), a tuple of
  example arguments or `tf.TensorSpec`s (one 'serving_default'), or a dict
  name -> such a tuple. A Keras model needs them (its batch size is free).
  """
  pf, examples = _function_and_examples(fn, signatures)
  module = tf.Module()
  by_variable = {}  # id(tf.Variable) -> its _StoredShards
  functions, described = {}, {}
  for name, args in examples.items():
    compiled = pf.get_program(*args)
    pf.store.check_annotations(compiled.variables)
    function, description = _signature_function(pf, compiled, by_variable, name)
    functions[name] = function.get_concrete_function()
    described[name] = description
  stored = list(by_variable.values())
  module.shards = stored  # tracked: the variables SavedModel writes
  options = tf.saved_model.SaveOptions(
    experimental_variable_policy=tf.saved_model.experimental.VariablePolicy.SAVE_VARIABLE_DEVICES
  )
  tf.saved_model.save(module, export_dir, signatures=functions, options=options)
  _add_session_collective_key(export_dir)
  spmd = next(iter(described.values()))['spmd']
  info = ExportInfo(
    export_dir,
    list(functions),
    spmd.mesh.size,
    list(spmd.devices),
    total_bytes=sum(s.total_bytes for s in stored),
    stored_bytes=sum(s.stored_bytes for s in stored),
    per_partition_bytes=sum(s.local_bytes for s in stored),
  )
  _write_metadata(export_dir, info, spmd.mesh, described, stored)
  return info


def _function_and_examples(fn, signatures):
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
  launcher.mirror.push_changed()  # a weight set on the model since the last step wins
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
  launcher.mirror.note_new()
  return pf


class _StoredShards(ShardedVariable):
  """A ShardedVariable as exported: partition p's variable is `shards[p]`, replicas shared.

  Built over the live shard variables of a `ShardedVariable` (no copy): with
  `distinct`, every partition holding the same piece as an earlier one gets
  that one's variable, so SavedModel writes each distinct piece once.
  """

  def __init__(self, sharded: ShardedVariable, distinct: bool):
    tf.Module.__init__(self, name=sharded.name)
    self.sharding, self.shape, self.label = sharded.sharding, sharded.shape, sharded.label
    self.devices = sharded.devices
    owner = list(range(len(sharded.shards)))
    if distinct:
      first = {}
      for p in range(len(owner)):
        owner[p] = first.setdefault(_piece_key(sharded.sharding, sharded.shape, p), p)
    self.owner = owner
    self.shards = [sharded.shards[q] for q in owner]
    size = sharded.dtype.size
    self.local_bytes = int(np.prod(sharded.local_shape, dtype=np.int64)) * size
    self.total_bytes = int(np.prod(sharded.shape, dtype=np.int64)) * size
    self.stored_bytes = len(set(owner)) * self.local_bytes


def _piece_key(sharding: Sharding, shape, p: int):
  """What partition p holds of a value of `shape`: its [start, stop) per dim (empty: zeros)."""
  bounds = tuple(tuple(b) for b in sharding.shard_bounds(shape, device=p))
  if any(stop <= start for start, stop in bounds):
    return 'empty'
  return bounds


def _written(compiled: Compiled, variable) -> bool:
  """Whether the program may write `variable` (any use of its handle but a read)."""
  main = compiled.program.main
  names = [n for n, v in compiled.program.variables.items() if v is variable]
  for node in main.nodes:
    if node.op not in _READ_ONLY_OPS and any(t in names for t in node.inputs):
      return True
  return False


def _stored(pf, compiled, by_variable, variable) -> _StoredShards:
  """The stored shards of `variable`: distinct pieces once, unless some signature writes it."""
  stored = by_variable.get(id(variable))
  distinct = not _written(compiled, variable)
  if stored is None or (not distinct and stored.owner != list(range(len(stored.owner)))):
    stored = _StoredShards(pf.store.sharded[id(variable)], distinct)
    by_variable[id(variable)] = stored
  return stored


def _signature_function(pf, compiled: Compiled, by_variable, name: str):
  """The serving tf.function of one compiled program (flat inputs -> dict of outputs)."""
  spmd = compiled.spmd
  if spmd is None:
    raise ValueError(
      "saved_model.save: the function was partitioned with backend='xla'; a "
      'SavedModel serves the TF backend (use save_xla for the XLA module).'
    )
  served = SpmdProgram(
    spmd.mesh,
    spmd.fn,
    spmd.in_shardings,
    spmd.out_shardings,
    out_shapes=spmd.out_shapes,
    devices=spmd.devices,
    timeout=None,
    progress_markers=False,
    name=f'{pf_name(pf)}_{name}',
  )
  stored = [_stored(pf, compiled, by_variable, v) for v in compiled.variables]
  main = compiled.program.main
  input_specs = [
    tf.TensorSpec(main.tensor(n).shape, main.tensor(n).dtype, name=arg_name)
    for n, arg_name in zip(compiled.program.arg_inputs, _input_names(compiled))
  ]
  captures = [
    tf.constant(v) if not isinstance(v, tf.Tensor) else v for v in compiled.capture_values
  ]
  launch = served.trace(*input_specs, *captures, *stored)
  output_names = _output_names(compiled)
  devices = spmd.devices

  def serve(*inputs):
    tokens = _device_tokens(devices)
    outputs = launch(tokens, *inputs, *captures, *[list(s.variables) for s in stored])
    outputs = outputs if isinstance(outputs, (list, tuple)) else [outputs]
    return {k: tf.identity(o, name=k) for k, o in zip(output_names, outputs)}

  serve.__name__ = re.sub(r'\W', '_', f'{pf_name(pf)}_{name}')
  function = tf.function(serve, input_signature=input_specs, autograph=False)
  layouts = {
    'inputs': [
      _layout_json(s.name, tuple(s.shape), s.dtype, sh)
      for s, sh in zip(input_specs, compiled.arg_shardings)
    ],
    'outputs': [
      _layout_json(k, shape, main.tensor(t).dtype, sh)
      for k, t, shape, sh in zip(
        output_names, main.outputs, compiled.out_shapes, compiled.out_shardings
      )
    ],
    'spmd': spmd,
  }
  return function, layouts


def pf_name(pf) -> str:
  return re.sub(
    r'\W',
    '_',
    getattr(pf.fn, '__name__', None)
    or getattr(getattr(pf.fn, 'python_function', None), '__name__', 'fn'),
  )


def _input_names(compiled: Compiled) -> List[str]:
  names, seen = [], set()
  for i, tensor in enumerate(compiled.program.arg_inputs):
    base = re.sub(r'\W', '_', tensor.split(':')[0]) or f'input_{i}'
    name, k = base, 1
    while name in seen:
      k += 1
      name = f'{base}_{k}'
    seen.add(name)
    names.append(name)
  return names


def _output_names(compiled: Compiled) -> List[str]:
  """Keys of the signature's outputs: the function's dict keys, else output_0, output_1, ..."""
  structure = compiled.program.structured_outputs
  count = len(compiled.program.main.outputs)
  if (
    isinstance(structure, dict)
    and len(structure) == count
    and all(isinstance(k, str) for k in structure)
  ):
    flat_keys = [k for k, _ in sorted(structure.items())]  # tf.nest flattens dicts by sorted key
    if all(re.fullmatch(r'[A-Za-z_]\w*', k) for k in flat_keys):
      return flat_keys
  return [f'output_{j}' for j in range(count)]


def _device_tokens(devices: Sequence[str]) -> List[tf.Tensor]:
  """One ordering token per device, made here on that device, after checking every device exists.

  A token is the handle of a variable never created (VarHandleOp only names
  it): collective V2 ops need a resource on their own device as ordering
  token, nothing more. The handle also records the device the op really ran
  on; soft placement moves ops of a missing device to another one, which
  would make collectives of two partitions meet on one device and hang.
  """
  handles, placed = [], []
  for p, device in enumerate(devices):
    with tf.device(device):
      handle = tf.raw_ops.VarHandleOp(
        dtype=tf.float64, shape=[2], shared_name=f'tf_gspmd_token_{p}', name=f'token_{p}'
      )
      # The serialized ResourceHandleProto starts with its device name (field 1), followed by
      # the container (field 2, tag byte 0x12): a device with its own name found there got
      # partition p.
      serialized = tf.raw_ops.SerializeTensor(tensor=handle, name=f'token_{p}_device')
    own = (
      '/device:'
      + tf.DeviceSpec.from_string(device).device_type
      + ':'
      + str(tf.DeviceSpec.from_string(device).device_index or 0)
      + '\x12'
    )
    placed.append(tf.size(tf.strings.split(serialized, sep=own)) > 1)
    handles.append(handle)
  found = tf.reduce_sum(tf.cast(tf.stack(placed), tf.int32))
  check = tf.debugging.Assert(
    tf.equal(found, len(devices)),
    [
      f'tf_gspmd export: this SavedModel runs {len(devices)} partitions, one on each of the '
      f'devices {devices[0]} .. {devices[-1]}, but only',
      found,
      f'of those {len(devices)} '
      'devices exist in this process. Configure them before loading, e.g. '
      f'tf.config.set_logical_device_configuration(tf.config.list_physical_devices("CPU")[0], '
      f'[tf.config.LogicalDeviceConfiguration()] * {len(devices)}).',
    ],
    name='device_check',
  )
  tokens = []
  with tf.control_dependencies([check]):
    for device, handle in zip(devices, handles):
      with tf.device(device):
        tokens.append(tf.identity(handle, name='token'))
  return tokens


# --- TF1 sessions -------------------------------------------------------------------------------
SESSION_KEY_NODE = 'tf_gspmd_session_collective_key'
# Below tf_gspmd's own group keys (collectives.tables starts them at 1.5e9): no program's group.
_SESSION_KEY_GROUP = 1_499_999_999


def _add_session_collective_key(export_dir: str) -> None:
  """Give every signature's call node a control input from a one-member V1 CollectiveReduce.

  A TF1 session (DirectSession, or a master session on a gRPC server) runs a
  step with a collective executor only if the step's graph has a
  collective_graph_key; without a RunOptions key, TF computes one from the V1
  collective ops (instance_key attribute) it finds among the top-level nodes,
  and the V2 ops inside the signature's function calls are never seen: they
  fail with "Failed to get CollectiveExecutor from OpKernelContext". The
  marker is such a top-level V1 op on a group of one (it only copies a scalar).
  TF2 loading rebuilds signatures from the function library and ignores it.
  """
  from tensorflow.core.framework import types_pb2
  from tensorflow.core.protobuf import saved_model_pb2

  path = os.path.join(export_dir, 'saved_model.pb')
  with open(path, 'rb') as f:
    proto = saved_model_pb2.SavedModel.FromString(f.read())
  for meta_graph in proto.meta_graphs:
    graph = meta_graph.graph_def
    callers = {
      info.name.split(':')[0].lstrip('^')
      for signature in meta_graph.signature_def.values()
      for info in signature.outputs.values()
    }
    if not callers:
      continue
    value = graph.node.add(name=f'{SESSION_KEY_NODE}/value', op='Const')
    value.attr['dtype'].type = types_pb2.DT_FLOAT
    value.attr['value'].tensor.dtype = types_pb2.DT_FLOAT
    value.attr['value'].tensor.tensor_shape.SetInParent()
    value.attr['value'].tensor.float_val.append(0.0)
    marker = graph.node.add(name=SESSION_KEY_NODE, op='CollectiveReduce', input=[value.name])
    marker.attr['T'].type = types_pb2.DT_FLOAT
    marker.attr['group_size'].i = 1
    marker.attr['group_key'].i = _SESSION_KEY_GROUP
    marker.attr['instance_key'].i = 1
    marker.attr['merge_op'].s = b'Add'
    marker.attr['final_op'].s = b'Id'
    marker.attr['subdiv_offsets'].list.SetInParent()
    for node in graph.node:
      if node.name in callers:
        node.input.append('^' + SESSION_KEY_NODE)
  with open(path, 'wb') as f:
    f.write(proto.SerializeToString())


# --- metadata -----------------------------------------------------------------------------------
def _sharding_json(sharding: Sharding) -> Dict[str, Any]:
  out = {'text': str(sharding)}
  if isinstance(sharding, NamedSharding):
    out['spec'] = [list(a) if isinstance(a, tuple) else a for a in sharding.spec]
  if sharding.partial is None:
    out['op_sharding'] = op_sharding.to_proto(sharding).SerializeToString().hex()
  return out


def _layout_json(name, shape, dtype, sharding: Sharding) -> Dict[str, Any]:
  shape = tuple(int(s) for s in shape)
  return {
    'name': name,
    'shape': list(shape),
    'dtype': tf.as_dtype(dtype).name,
    'sharding': _sharding_json(sharding),
    'local_shape': [int(s) for s in sharding.shard_shape(shape)],
  }


def _write_metadata(export_dir, info: ExportInfo, mesh: Mesh, described, stored) -> None:
  data = {
    'format': 'tf_gspmd.saved_model/1',
    'num_partitions': info.num_partitions,
    'devices': info.devices,
    'mesh': _mesh_json(mesh),
    'signatures': {
      n: {'inputs': d['inputs'], 'outputs': d['outputs']} for n, d in described.items()
    },
    'variables': [
      dict(
        _layout_json(s.label, s.shape, s.dtype, s.sharding),
        stored_shards=len(set(s.owner)),
        owner=s.owner,
      )
      for s in stored
    ],
    'bytes': {
      'total': info.total_bytes,
      'stored': info.stored_bytes,
      'per_partition': info.per_partition_bytes,
    },
  }
  path = os.path.join(export_dir, METADATA)
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, 'w') as f:
    json.dump(data, f, indent=1)


def metadata(export_dir: str) -> Dict[str, Any]:
  """The layouts and devices `save` recorded (`assets.extra/tf_gspmd.json`)."""
  path = os.path.join(export_dir, METADATA)
  if not os.path.exists(path):
    raise ValueError(
      f'saved_model: {export_dir} has no {METADATA}; it was not written by '
      'tf_gspmd.saved_model.save.'
    )
  with open(path) as f:
    return json.load(f)


# --- loading ------------------------------------------------------------------------------------
def check_devices(export_dir: str) -> List[str]:
  """The export's devices; a ValueError naming both counts when this process lacks some."""
  meta = metadata(export_dir)
  devices = meta['devices']
  kinds = {tf.DeviceSpec.from_string(d).device_type for d in devices}
  available = {_full_name(d.name) for d in tf.config.list_logical_devices()}
  missing = [d for d in devices if _full_name(d) not in available]
  if missing:
    have = sum(len(tf.config.list_logical_devices(k)) for k in kinds)
    raise ValueError(
      f'saved_model.load: {export_dir} runs {len(devices)} partitions on {len(devices)} '
      f'devices ({devices[0]} .. {devices[-1]}), but this process has {have} '
      f'{"/".join(sorted(kinds))} device(s); missing {missing[:4]}'
      f'{" ..." if len(missing) > 4 else ""}. Configure {len(devices)} logical devices with '
      'tf.config.set_logical_device_configuration before TensorFlow starts.'
    )
  return devices


def load(export_dir: str):
  """`tf.saved_model.load` after checking the device count, variables on their saved devices."""
  check_devices(export_dir)
  options = tf.saved_model.LoadOptions(
    experimental_variable_policy=tf.saved_model.experimental.VariablePolicy.SAVE_VARIABLE_DEVICES
  )
  return tf.saved_model.load(export_dir, options=options)


def _full_name(device: str) -> str:
  spec = tf.DeviceSpec.from_string(device)
  return tf.DeviceSpec(
    job=spec.job or 'localhost',
    replica=spec.replica or 0,
    task=spec.task or 0,
    device_type=spec.device_type,
    device_index=spec.device_index or 0,
  ).to_string()


# --- XLA / TPU export --------------------------------------------------------------------------
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
    pf, _ = _function_and_examples(pf, example_args)
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
    'mesh': _mesh_json(mesh),
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
  from tf_gspmd.xla_bridge.export import Layout, XlaExport

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
    return Layout(
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


def _mesh_json(mesh: Mesh) -> Dict[str, Any]:
  return {
    'shape': [mesh.shape[a] for a in mesh.axis_names],
    'axis_names': list(mesh.axis_names),
    'devices': np.asarray(mesh.device_ids).reshape(-1).tolist(),
  }


def _xla_layout_json(layout) -> Dict[str, Any]:
  return {
    'name': layout.name,
    'kind': layout.kind,
    'shape': [int(s) for s in layout.shape],
    'dtype': tf.as_dtype(layout.dtype).name,
    'sharding': None if layout.sharding is None else _sharding_json(layout.sharding),
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
  main, plan = compiled.program.main, compiled.plan
  out = {}
  for node in main.nodes:
    if node.op in ('Placeholder', 'XlaSharding') or not node.outputs:
      continue
    if any(t.dtype in (tf.resource, tf.variant) for t in node.outputs):
      continue
    try:
      shardings = [resolved(plan.target(main, t.name)) for t in node.outputs]
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
