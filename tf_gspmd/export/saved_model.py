"""SavedModel export of partitioned programs: `tg.saved_model.save`, `load`, `save_xla`, `load_xla`.

`save(pf, export_dir, signatures=None)` writes a SavedModel whose signatures run
the partitioned program over its N devices. Plain TensorFlow serves it: in a
process with N logical devices, `tf.saved_model.load(export_dir)` (tf_gspmd
not imported) and `signatures['serving_default'](**inputs)` give the global
outputs. `saved_model_cli show` reads it; `saved_model_cli run --worker
grpc://localhost:P` runs it on a device server with N CPU devices
(`python -m tf_gspmd.export.serve --export DIR --port P`, see `tf_gspmd/export/serve.py`).

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
from typing import Any, Dict, List, Sequence

import numpy as np
import tensorflow as tf

from tf_gspmd.device_names import full_name
from tf_gspmd.export.programs import (  # noqa: F401  (DEFAULT_SIGNATURE: tg.saved_model's too)
  DEFAULT_SIGNATURE,
  function_and_examples,
  mesh_json,
  pf_name,
  sharding_json,
)

# The XLA / TPU export, reached as tg.saved_model.save_xla / load_xla.
from tf_gspmd.export.xla import (  # noqa: F401
  ANNOTATED,
  XLA_LAYOUTS,
  XLA_MODULE,
  XLA_VALUES,
  annotated_shardings,
  load_xla,
  resolved,
  save_xla,
)
from tf_gspmd.mesh import Mesh
from tf_gspmd.partitioned import Compiled
from tf_gspmd.propagation import registry
from tf_gspmd.runtime import SpmdProgram
from tf_gspmd.runtime.sharded import ShardedVariable
from tf_gspmd.sharding import Sharding

METADATA = os.path.join('assets.extra', 'tf_gspmd.json')


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
  pf, examples = function_and_examples(fn, signatures)
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


def _reads_only(op_type: str) -> bool:
  return registry.entry_of(op_type).reads_variable_only


def _written(compiled: Compiled, variable) -> bool:
  """Whether the program may write `variable` (any use of its handle but a read)."""
  main = compiled.program.main
  names = [n for n, v in compiled.program.variables.items() if v is variable]
  for node in main.nodes:
    # Reading a variable changes nothing; any other use of its handle may write it.
    if not _reads_only(node.op) and any(t in names for t in node.inputs):
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
  spmd = pf.executor.tf_launcher(compiled.prepared, 'saved_model.save')
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
    inputs = _checked_inputs(input_specs, inputs)
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


def _checked_inputs(specs: Sequence[tf.TensorSpec], inputs) -> list:
  """`inputs`, each checked at run time to have its spec's (fixed) shape.

  The program was partitioned for these shapes, but a served signature may be fed any: without
  the check another batch size fails deep in the program, in a reshape of each device's shard,
  once per device. An EnsureShape is the check that survives Grappler (an Assert on tf.shape
  of an argument is folded away: the argument's static shape is the spec's); TF's message
  names the shape fed and the fixed one, the node's name says whose fixed shape it is.
  """
  return [
    tf.ensure_shape(
      value,
      spec.shape,
      name=f'{spec.name}_has_the_fixed_shape_{"x".join(map(str, spec.shape))}_of_this_signature',
    )
    for spec, value in zip(specs, inputs)
  ]


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
def _layout_json(name, shape, dtype, sharding: Sharding) -> Dict[str, Any]:
  shape = tuple(int(s) for s in shape)
  return {
    'name': name,
    'shape': list(shape),
    'dtype': tf.as_dtype(dtype).name,
    'sharding': sharding_json(sharding),
    'local_shape': [int(s) for s in sharding.shard_shape(shape)],
  }


def _write_metadata(export_dir, info: ExportInfo, mesh: Mesh, described, stored) -> None:
  data = {
    'format': 'tf_gspmd.saved_model/1',
    'num_partitions': info.num_partitions,
    'devices': info.devices,
    'mesh': mesh_json(mesh),
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
  available = {full_name(d.name) for d in tf.config.list_logical_devices()}
  missing = [d for d in devices if full_name(d) not in available]
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
