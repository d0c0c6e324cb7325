"""Build and read the XLA form of a per-partition program.

`per_partition_hlo` compiles a per-partition function with the XLA backend to
HLO text (on CPU XLA, which lowers XlaAllReduce and XlaReduceScatter);
`hlo_collectives` lists the collectives of HLO text with their replica groups;
`graph_collectives` lists the XLA collective ops of a traced graph with their
constant group assignments or source-target pairs (for the ops CPU XLA cannot
lower: AllToAll, CollectivePermute).
"""

from __future__ import annotations

import dataclasses
import re
from typing import List, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf

from tf_gspmd.mesh import Mesh

HLO_COLLECTIVES = (
  'all-reduce',
  'reduce-scatter',
  'all-gather',
  'all-to-all',
  'collective-permute',
  'collective-broadcast',
)
XLA_COLLECTIVE_OPS = ('XlaAllReduce', 'XlaReduceScatter', 'AllToAll', 'CollectivePermute')


@dataclasses.dataclass(frozen=True)
class HloCollective:
  kind: str  # HLO opcode, e.g. 'all-reduce'
  shape: str  # result shape text, e.g. 'f32[8,3]'
  replica_groups: Tuple[Tuple[int, ...], ...]
  source_target_pairs: Tuple[Tuple[int, int], ...]
  dimensions: Tuple[int, ...]
  op_name: str  # TF op name from the metadata ('' if absent)


def per_partition_hlo(mesh: Mesh, fn, local_args: Sequence, partition_id: int = 0) -> str:
  """HLO text of `fn(ctx, *local_args)` traced with `XlaCollectives` and jit-compiled."""
  from tf_gspmd.program import trace_per_partition
  from tf_gspmd.xla_bridge.collectives import XlaCollectives

  args = [tf.convert_to_tensor(a) for a in local_args]
  program = trace_per_partition(
    mesh,
    fn,
    [tf.TensorSpec(a.shape, a.dtype) for a in args],
    backend=XlaCollectives,
    jit_compile=True,
  )
  pid = tf.constant(partition_id, tf.int32)
  return program.tf_function.experimental_get_compiler_ir(pid, *args)(stage='hlo')


_INSTRUCTION = re.compile(
  r'^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(?P<shape>\([^)]*\)|\S+)\s+(?P<kind>[a-z\-]+)\((?P<rest>.*)$'
)


def hlo_collectives(hlo_text: str) -> List[HloCollective]:
  """Every collective instruction of `hlo_text`, in order."""
  found = []
  for line in hlo_text.splitlines():
    match = _INSTRUCTION.match(line)
    # Async forms (GPU/TPU) split a collective into '<kind>-start' and '<kind>-done':
    # count the start.
    kind = match.group('kind').removesuffix('-start') if match else None
    if kind not in HLO_COLLECTIVES:
      continue
    rest = match.group('rest')
    shape = re.sub(r'\{[^}]*\}$', '', match.group('shape'))
    op_name = re.search(r'op_name="([^"]*)"', rest)
    dims = re.search(r'dimensions=\{([\d,]*)\}', rest)
    pairs = re.search(r'source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}', rest)
    found.append(
      HloCollective(
        kind=kind,
        shape=shape,
        replica_groups=_replica_groups(rest),
        source_target_pairs=tuple(
          tuple(int(v) for v in p.split(',')) for p in re.findall(r'\{(\d+,\d+)\}', pairs.group(1))
        )
        if pairs
        else (),
        dimensions=tuple(int(d) for d in dims.group(1).split(',') if d) if dims else (),
        op_name=op_name.group(1) if op_name else '',
      )
    )
  return found


def _replica_groups(text: str) -> Tuple[Tuple[int, ...], ...]:
  explicit = re.search(r'replica_groups=\{((?:\{[\d,]*\},?)*)\}', text)
  if explicit:
    return tuple(
      tuple(int(v) for v in g.split(',') if v)
      for g in re.findall(r'\{([\d,]*)\}', explicit.group(1))
    )
  # Iota form: replica_groups=[G,k]<=[dims]T(perm) -- reshape iota to dims, transpose, reshape.
  iota = re.search(r'replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?', text)
  if iota:
    groups, size = int(iota.group(1)), int(iota.group(2))
    dims = [int(d) for d in iota.group(3).split(',')]
    ids = np.arange(int(np.prod(dims))).reshape(dims)
    if iota.group(4):
      ids = ids.transpose([int(p) for p in iota.group(4).split(',')])
    return tuple(tuple(int(v) for v in row) for row in ids.reshape(groups, size))
  return ()


_STABLEHLO_COLLECTIVE = re.compile(
  r'"?stablehlo\.(all_reduce|reduce_scatter|all_gather|all_to_all|collective_permute|'
  r'collective_broadcast)\b'
)


_FUNC = re.compile(r'^  func\.func (?:private )?@(?P<name>[\w.$\-]+)\(', re.M)
_CALL = re.compile(r'\bcall @(?P<name>[\w.$\-]+)')


def stablehlo_collectives(module_text: str) -> List[str]:
  """The collective ops that `@main` runs (itself and the functions it calls), HLO-spelled.

  tf2xla's module also keeps a while body as an uncalled private function beside the
  copy inlined in the loop: that copy is not counted.
  """
  starts = list(_FUNC.finditer(module_text))
  bodies = {
    m.group('name'): module_text[
      m.start() : (starts[i + 1].start() if i + 1 < len(starts) else len(module_text))
    ]
    for i, m in enumerate(starts)
  }
  seen, todo, kinds = set(), ['main'], []
  while todo:
    name = todo.pop()
    if name in seen or name not in bodies:
      continue
    seen.add(name)
    kinds += [m.group(1).replace('_', '-') for m in _STABLEHLO_COLLECTIVE.finditer(bodies[name])]
    todo += [m.group('name') for m in _CALL.finditer(bodies[name])]
  return kinds


@dataclasses.dataclass(frozen=True)
class GraphCollective:
  op_type: str
  name: str
  groups: Optional[np.ndarray]  # group_assignment, or source_target_pairs for CollectivePermute
  attrs: Tuple[Tuple[str, object], ...]


def graph_collectives(graph: tf.Graph) -> List[GraphCollective]:
  """The XLA collective ops of `graph` (a FuncGraph), with their constant groups/pairs."""
  found = []
  for op in graph.get_operations():
    if op.type not in XLA_COLLECTIVE_OPS:
      continue
    groups = _constant(op.inputs[1])
    attrs = tuple(
      (a, op.get_attr(a))
      for a in ('concat_dimension', 'split_dimension', 'split_count', 'reduce_op', 'mode')
      if a in op.node_def.attr
    )
    found.append(GraphCollective(op.type, op.name, groups, attrs))
  return found


def _constant(tensor: tf.Tensor) -> Optional[np.ndarray]:
  op = tensor.op
  while op.type == 'Identity':
    op = op.inputs[0].op
  if op.type != 'Const':
    return None
  return tf.make_ndarray(op.get_attr('value'))
