"""Roll along split dims: whole shards and shard edges move between partitions.

A dim of n rows split evenly over k partitions (c rows each) and rolled by s
rows: with s = q*c + r (mod n), partition j's result is the last r rows of the
shard q+1 positions back along the ring, then the first c-r rows of the shard
q positions back. That is at most two cyclic collective-permutes of slices
(one when r is 0: a pipeline's stage shift), never a gather. The layout comes
from Roll's rule (every dim passes through); a rolled dim the rule's choice
splits unevenly is kept whole instead (`choose_layouts(whole=...)`), since the
rows a partition needs then cross uneven shard boundaries.
"""

from __future__ import annotations

from typing import Dict

import numpy as np
import tensorflow as tf

from tf_gspmd.graph_rewrite import factors
from tf_gspmd.graph_rewrite.handlers import check_local_shape, computes, global_shape
from tf_gspmd.graph_rewrite.partitioner import Local


def _shifts(p, graph, node, rank: int) -> Dict[int, int]:
  """dim -> total shift (TF adds the shifts of repeated axes)."""
  shift = np.ravel(p.static_value(graph, node.inputs[1]))
  axis = np.ravel(p.static_value(graph, node.inputs[2]))
  if shift.size == 1 and axis.size > 1:
    shift = np.repeat(shift, axis.size)
  out: Dict[int, int] = {}
  for s, a in zip(shift.tolist(), axis.tolist()):
    d = a % rank
    out[d] = out.get(d, 0) + int(s)
  return out


def _ring_shift(p, x: tf.Tensor, axes, offset: int, dim: int, why: str) -> tf.Tensor:
  """Position i along `axes` (row-major) gets `x` of position i - offset, cyclically."""
  pairs = []
  for group in p.mesh.groups(axes):
    k = len(group)
    if offset % k == 0:
      return x
    pairs += [(group[(j - offset) % k], dst) for j, dst in enumerate(group)]
  p.note_collective(
    {
      'kind': 'permute',
      'axes': tuple(axes),
      'shape': tuple(x.shape),
      'dtype': x.dtype.name,
      'bytes': int(x.shape.num_elements() or 0) * x.dtype.size,
      'why': why,
    }
  )
  return p.backend.permute(x, pairs)


def _roll_split(p, x: tf.Tensor, dim: int, axes, n: int, shift: int, name: str) -> tf.Tensor:
  k = p.mesh.axes_size(axes)
  c = n // k
  q, r = divmod(shift % n, c)
  why = f'Roll {name}: dim {dim} rolled by {shift}'
  if r == 0:
    return _ring_shift(p, x, axes, q, dim, why)
  size = x.shape.as_list()
  head = tf.slice(x, [0] * len(size), [c - r if i == dim else -1 for i in range(len(size))])
  tail = tf.slice(
    x,
    [c - r if i == dim else 0 for i in range(len(size))],
    [r if i == dim else -1 for i in range(len(size))],
  )
  return tf.concat(
    [
      _ring_shift(p, tail, axes, q + 1, dim, why + ' (edge)'),
      _ring_shift(p, head, axes, q, dim, why),
    ],
    axis=dim,
  )


def _unevenly_split(chosen, shape, shifts, mesh) -> list:
  """Factors of rolled dims that the chosen layout splits unevenly."""
  spec, dims = chosen.operands[0].spec, chosen.rule.operands[0]
  return [dims[d] for d in shifts if spec.axes_of(d) and shape[d] % mesh.axes_size(spec.axes_of(d))]


@computes('roll')
def roll_handler(p, graph, node, operands):
  """Roll in its rule's layout; split rolled dims exchange shards (see the module doc)."""
  shape = global_shape(graph, node.inputs[0])
  shifts = _shifts(p, graph, node, len(shape))
  chosen = factors.choose_layouts(p, graph, node, operands)
  uneven_factors = _unevenly_split(chosen, shape, shifts, p.mesh)
  if uneven_factors:
    chosen = factors.choose_layouts(p, graph, node, operands, whole=uneven_factors)
  x = p.reshard(operands[0], chosen.operands[0], 'roll operand')
  local, spec = x.tensor, chosen.operands[0].spec
  for dim, shift in sorted(shifts.items()):
    axes = spec.axes_of(dim)
    if shift % shape[dim] == 0:
      continue
    if axes:
      local = _roll_split(p, local, dim, axes, shape[dim], shift, node.name)
    else:
      local = tf.roll(local, shift, dim)
  local = tf.identity(local, name=node.name)
  value = Local(local, chosen.results[0], global_shape(graph, node.outputs[0].name))
  check_local_shape(node, value)
  return [p.finish(graph, value, node.outputs[0].name)]
