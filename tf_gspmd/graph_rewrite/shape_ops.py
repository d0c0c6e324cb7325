"""Partitioning ops whose attributes or constant inputs carry global shapes or offsets.

The rule-driven path (`factors.py`) re-emits a node with its original
attributes and constant inputs, which is wrong whenever those hold global
sizes or offsets: a Slice's `size` on a dim that stays sharded, a Range or
LinSpace asked for a sharded result. The handlers here rewrite them:

- Slice / StridedSlice (every mask: begin, end, ellipsis, new axis, shrink;
  negative indices and strides), in the layouts of their rules: dims taken
  whole keep their sharding; a sliced range of a split dim stays split, its
  rows shifted from the neighbours by halo exchange (a width-1 window, as
  XLA's partitioner does; a prefix whose shards keep their size moves
  nothing); an indexed (shrunk) row of a split dim is picked locally (each
  partition keeps it if it holds it, zeros elsewhere), leaving a pending sum
  that the result's reshard resolves, moving one row; a reversed range is
  taken whole.
- StridedSliceGrad: the transpose of the above: dims taken whole stay sharded,
  the others are computed whole.
- Pad / PadV2 / MirrorPad, in the layouts of their rules: a padded split dim
  stays split, rows shifted by halo exchange with the pad value as fill; a
  pad value known only at run time fills the end of shards that keep their
  size (a local mask), else the dim is taken whole; MirrorPad's padded dims
  are taken whole.
- Range / LinSpace: a sharded result computes its local values from this
  partition's offset (a table indexed by the partition id).
- UnsortedSegmentSum/Max/Min/Prod: data rows and ids split alike give
  partial segment results combined by the matching all-reduce; the padding of
  uneven id shards is set to -1, which the ops drop.
- Gather (v1): the table-sharded gather of `gather.py` on axis 0.
- OneHot: a split depth dim one-hots against this partition's depth range.
- VariableShape: the variable's global shape, a constant.
- Stateless random ops of the first generation (shape input = global shape):
  generated whole like the other random ops (`handlers.random_handler`).

Every handler first checks whether the node's outputs are statically known
(shape arithmetic such as `tf.shape(x)[0]`): those are constants.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import List, Sequence

import numpy as np
import tensorflow as tf

from tf_gspmd.graph import emit
from tf_gspmd.graph_rewrite import uneven
from tf_gspmd.graph_rewrite.halo_exchange import SpatialDim, gather_window, trimmed_halo
from tf_gspmd.graph_rewrite.handlers import (
  _shape_input,
  check_local_shape,
  computes,
  emit_outputs,
  global_shape,
  local_params,
  static_handler,
)
from tf_gspmd.graph_rewrite.partitioner import Local
from tf_gspmd.propagation.rule import dim_factors
from tf_gspmd.sharding import NamedSharding, P

# Dtypes a pending sum over partitions can hold (what the collectives reduce).
_SUMMABLE = (tf.float16, tf.float32, tf.float64, tf.int32, tf.int64)


# --- helpers ---------------------------------------------------------------------------
def _static_first(handler):
  """Outputs known before run time (shape arithmetic) become constants, whatever the op."""

  @functools.wraps(handler)
  def wrapped(p, graph, node, operands):
    if node.outputs and all(p.static_value(graph, t.name) is not None for t in node.outputs):
      return static_handler(p, graph, node, operands)
    return handler(p, graph, node, operands)

  return wrapped


def _named(p, axes_per_dim: Sequence[tuple], partial=(), reduction='sum') -> NamedSharding:
  return NamedSharding(
    p.mesh,
    P(*[tuple(a) if a else None for a in axes_per_dim]),
    partial=tuple(partial),
    reduction=reduction,
  )


def _axes(sharding: NamedSharding, rank: int) -> List[tuple]:
  return [tuple(sharding.spec.axes_of(d)) for d in range(rank)]


def _result(p, graph, node, tensor: tf.Tensor, sharding: NamedSharding, index: int = 0) -> Local:
  """Wrap a local result, check its shape against its layout, move it to its target."""
  name = node.outputs[index].name
  value = Local(tensor, sharding, global_shape(graph, name))
  check_local_shape(node, value)
  return p.finish(graph, value, name)


def _chunk(size: int, shards: int) -> int:
  return -(-size // shards)


def _take_rows(p, x: tf.Tensor, sharding: NamedSharding, shape, dim: int, rows) -> tf.Tensor:
  """Rows `rows` (global indices) of a dim split over partitions, as a pending sum.

  Each partition keeps the requested rows that fall in its shard (never its
  padding) and zeros for the others; summing over the dim's axes gives the
  rows themselves.
  """
  rows = np.asarray(rows, np.int32)
  local_rows = int(x.shape[dim])
  offset = uneven.shard_offset(sharding, shape, dim, p.backend.partition_id)
  local = tf.constant(rows) - offset
  valid = tf.minimum(local_rows, shape[dim] - offset)
  hit = tf.logical_and(local >= 0, local < valid)
  picked = tf.gather(x, tf.where(hit, local, tf.zeros_like(local)), axis=dim)
  mask_shape = [1] * x.shape.rank
  mask_shape[dim] = len(rows)
  return tf.where(tf.reshape(hit, mask_shape), picked, tf.zeros_like(picked))


# --- slicing -------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class DimSlice:
  """What a slice does to one dim.

  kind: 'keep' (whole dim), 'range' (`count` rows from `start` by `stride`),
  'index' (one row, the dim is dropped) or 'new' (a new size-1 result dim).
  """

  kind: str
  dim: int = -1
  start: int = 0
  count: int = 0
  stride: int = 1

  def rows(self) -> np.ndarray:
    if self.kind == 'index':
      return np.array([self.start], np.int32)
    return np.arange(self.count, dtype=np.int64) * self.stride + self.start


def dim_slices(shape, begin, size) -> List[DimSlice]:
  """What `Slice(x, begin, size)` does to each dim (size -1: to the end)."""
  slices = []
  for d, (n, b, s) in enumerate(zip(shape, begin, size)):
    b, s = int(b), int(s)
    s = n - b if s == -1 else s
    slices.append(DimSlice('keep', d) if (b, s) == (0, n) else DimSlice('range', d, b, s, 1))
  return slices


def strided_dim_slices(
  shape,
  begin,
  end,
  strides,
  begin_mask=0,
  end_mask=0,
  ellipsis_mask=0,
  new_axis_mask=0,
  shrink_axis_mask=0,
) -> List[DimSlice]:
  """What a StridedSlice does to each dim, with TensorFlow's (= Python's) index semantics.

  Covers every input dim: dims past the spec (or under the ellipsis) are kept.
  """
  rank = len(shape)
  n_spec = len(begin)
  ellipsis = next((k for k in range(n_spec) if (ellipsis_mask >> k) & 1), None)
  consuming = sum(1 for k in range(n_spec) if k != ellipsis and not (new_axis_mask >> k) & 1)
  slices, d = [], 0
  specs = list(range(n_spec)) + ([] if ellipsis is not None else ['rest'])
  for k in specs:
    if k == 'rest' or k == ellipsis:
      for _ in range(rank - consuming):
        slices.append(DimSlice('keep', d))
        d += 1
      continue
    bit = 1 << k
    if new_axis_mask & bit:
      slices.append(DimSlice('new'))
      continue
    n = shape[d]
    if shrink_axis_mask & bit:
      index = int(begin[k])
      index = index + n if index < 0 else index
      if not 0 <= index < n:
        raise ValueError(f'StridedSlice: index {begin[k]} is out of range for a dim of {n}.')
      slices.append(DimSlice('index', d, index, 1, 1))
      d += 1
      continue
    stride = int(strides[k])
    b = None if begin_mask & bit else int(begin[k])
    e = None if end_mask & bit else int(end[k])
    rng = range(n)[slice(b, e, stride)]
    if len(rng) == n and stride == 1:
      slices.append(DimSlice('keep', d))
    else:
      slices.append(DimSlice('range', d, rng.start if len(rng) else 0, len(rng), stride))
    d += 1
  if d != rank:
    raise ValueError(f'StridedSlice: the slice spec covers {d} dims of a rank-{rank} tensor.')
  return slices


def _local_strided_slice_args(slices: Sequence[DimSlice], whole: Sequence[bool]):
  """begin, end, strides and masks of the local StridedSlice.

  `whole[i]`: entry i is taken whole locally (kept, or already reduced
  to its rows). Ranges on dims held whole use their global indices.
  """
  begin, end, strides = [], [], []
  masks = dict(begin_mask=0, end_mask=0, new_axis_mask=0, shrink_axis_mask=0)
  for i, e in enumerate(slices):
    bit = 1 << i
    if e.kind == 'new':
      masks['new_axis_mask'] |= bit
      begin.append(0), end.append(0), strides.append(1)
    elif e.kind == 'index':
      start = 0 if whole[i] else e.start
      begin.append(start), end.append(start + 1), strides.append(1)
      masks['shrink_axis_mask'] |= bit
    elif whole[i] or e.kind == 'keep':
      begin.append(0), end.append(0), strides.append(1)
      masks['begin_mask'] |= bit
      masks['end_mask'] |= bit
    else:
      stop = e.start + e.count * e.stride
      begin.append(e.start), strides.append(e.stride)
      if e.count == 0:
        end.append(e.start)
      elif stop < 0:  # a negative stride running past row 0
        end.append(0)
        masks['end_mask'] |= bit
      else:
        end.append(stop)
  return begin, end, strides, masks


def shift_window(p, tensor: tf.Tensor, x: Local, windows) -> tf.Tensor:
  """This partition's input window for `windows` ({dim: (WindowDim, fill)}) along split dims
  of `x`: (local output rows - 1) * stride + 1 rows, the window's first row first.

  Pad and Slice along a split dim shift rows between shards: each output shard reads a
  width-1 window of the input, with the pads (or the cut rows, as negative pads) as the
  window's padding, so its rows come from the neighbours by the halo exchange of windowed
  ops (permutes, several hops when the shift outgrows a shard), never from gathering the
  dim. Rows outside the input get the dim's fill.
  """
  for d, (window, fill) in sorted(windows.items()):
    axes = tuple(x.sharding.spec.axes_of(d))
    halo, tail = trimmed_halo(window, p.mesh.axes_size(axes))
    tensor = gather_window(p, tensor, x.sharding, [SpatialDim(d, axes, window, halo, tail)], fill)
  return tensor


def _factor_of(rule, dim: int) -> str:
  (f,) = dim_factors(rule.operands[0][dim])
  return f


def partitioned_slice(p, graph, node, operands: Sequence[Local], slices: Sequence[DimSlice]):
  """(local tensor, sharding) of `operands[0]` sliced by `slices`, in the layouts of the rule.

  The rule's factor of each sliced dim says how (`ops_indexing.slice_rule`,
  `strided_slice`): a kept dim passes through; a range is a width-1 window
  whose split keeps the result split, rows shifted from the neighbours by halo
  exchange (`shift_window`), as XLA's partitioner keeps a slice of a split dim
  split; an indexed (shrunk) row is a reduction: each shard picks the row if it
  holds it, the result is a pending sum over the dim's axes (one row moved,
  not the dim); a reversed range needs the dim whole.
  """
  from tf_gspmd.graph_rewrite import factors

  chosen = factors.choose_layouts(
    p, graph, node, operands, windowed=True, combinable=operands[0].dtype in _SUMMABLE
  )
  x = p.reshard(operands[0], chosen.operands[0], f'{node.op} {node.name}: sliced operand')
  tensor, windows, local_slices = x.tensor, {}, list(slices)
  for i, e in enumerate(slices):
    if e.kind in ('new', 'keep') or not x.sharding.spec.axes_of(e.dim):
      continue
    f = _factor_of(chosen.rule, e.dim)
    if e.kind == 'index':
      tensor = _take_rows(p, tensor, x.sharding, x.shape, e.dim, e.rows())
      local_slices[i] = DimSlice('index', e.dim, 0, 1, 1)
    elif e.count:  # an empty range is empty locally too: nothing to move
      windows[e.dim] = (chosen.rule.windows[f], 0)
      rows = chosen.results[0].shard_shape(global_shape(graph, node.outputs[0].name))
      local_slices[i] = DimSlice('range', e.dim, 0, _local_rows(rows, slices, i), e.stride)
  tensor = shift_window(p, tensor, x, windows)
  begin, end, strides, masks = _local_strided_slice_args(local_slices, [False] * len(slices))
  local = tf.strided_slice(tensor, begin, end, strides, name=node.name, **masks)
  return local, chosen.results[0]


def _local_rows(out_local_shape, slices: Sequence[DimSlice], i: int) -> int:
  """Rows of entry i of `slices` in the local result (result dims: every entry but 'index')."""
  return out_local_shape[sum(1 for e in slices[:i] if e.kind != 'index')]


def _masks(node) -> dict:
  return {
    m: node.attrs[m].i if m in node.attrs else 0
    for m in ('begin_mask', 'end_mask', 'ellipsis_mask', 'new_axis_mask', 'shrink_axis_mask')
  }


@computes('slice')
@_static_first
def slice_handler(p, graph, node, operands):
  x = operands[0]
  slices = dim_slices(x.shape, _shape_input(p, graph, node, 1), _shape_input(p, graph, node, 2))
  local, sharding = partitioned_slice(p, graph, node, operands, slices)
  return [_result(p, graph, node, local, sharding)]


@computes('strided_slice')
@_static_first
def strided_slice_handler(p, graph, node, operands):
  x = operands[0]
  begin, end, strides = (_shape_input(p, graph, node, i) for i in (1, 2, 3))
  slices = strided_dim_slices(x.shape, begin, end, strides, **_masks(node))
  local, sharding = partitioned_slice(p, graph, node, operands, slices)
  return [_result(p, graph, node, local, sharding)]


@computes('strided_slice_grad')
@_static_first
def strided_slice_grad_handler(p, graph, node, operands):
  """dx = zeros(shape) with dy written into the slice. Layouts from the rule: dims the
  slice keeps whole pass through from dy to dx; sliced and shrunk dims are whole."""
  from tf_gspmd.graph_rewrite import factors

  shape = tuple(int(s) for s in _shape_input(p, graph, node, 0))
  begin, end, strides = (_shape_input(p, graph, node, i) for i in (1, 2, 3))
  slices = strided_dim_slices(shape, begin, end, strides, **_masks(node))
  chosen = factors.choose_layouts(p, graph, node, operands)
  dy = p.reshard(operands[4], chosen.operands[4], f'StridedSliceGrad {node.name}: sliced dims')
  out_sharding = chosen.results[0]
  local_shape = out_sharding.shard_shape(shape)
  begin, end, strides, masks = _local_strided_slice_args(slices, [False] * len(slices))
  local = tf.raw_ops.StridedSliceGrad(
    shape=tf.constant(local_shape, dtype=operands[0].dtype),
    begin=tf.constant(begin, dtype=operands[1].dtype),
    end=tf.constant(end, dtype=operands[2].dtype),
    strides=tf.constant(strides, dtype=operands[3].dtype),
    dy=dy.tensor,
    ellipsis_mask=0,
    name=node.name,
    **masks,
  )
  return [_result(p, graph, node, local, out_sharding)]


# --- padding -------------------------------------------------------------------------------
@computes('pad')
@_static_first
def pad_handler(p, graph, node, operands):
  """Layouts from the rule (`ops_indexing.pad`): a padded dim is a width-1 window. The local
  computation: dims held whole are padded by the op itself; split padded dims shift rows
  between shards by halo exchange with the pad value as fill (`shift_window`). A pad value
  known only at run time (PadV2) can fill only the end of shards that keep their size (a
  local mask); MirrorPad reflects rows, not a shift: those dims are taken whole."""
  from tf_gspmd.graph_rewrite import factors

  x = operands[0]
  rank = len(x.shape)
  paddings = [
    tuple(int(v) for v in row)
    for row in np.asarray(_shape_input(p, graph, node, 1)).reshape(rank, 2)
  ]
  fill = _static_pad_value(p, graph, node)
  rule = factors.rule_for(p, node, graph)
  whole = []
  while True:
    chosen = factors.choose_layouts(p, graph, node, operands, rule, windowed=True, whole=whole)
    split = {
      d: chosen.axes(_factor_of(rule, d))
      for d in range(rank)
      if paddings[d] != (0, 0) and chosen.axes(_factor_of(rule, d))
    }
    unfit = [
      _factor_of(rule, d)
      for d, axes in split.items()
      if fill is None
      and not _pads_shard_tails(node, x.shape[d], paddings[d], p.mesh.axes_size(axes))
    ]
    if not unfit:
      break
    whole += unfit
  x = p.reshard(x, chosen.operands[0], f'{node.op} {node.name}: padded operand')
  local_paddings = [(0, 0) if d in split else paddings[d] for d in range(rank)]
  inputs = [x.tensor, tf.constant(local_paddings, dtype=operands[1].dtype)]
  if local_params(node)['fill'] == 'operand':  # PadV2: the pad value, operand 2
    inputs.append(p.replicate(operands[2], 'pad value').tensor)
  tensor = x.tensor
  if any(pads != (0, 0) for pads in local_paddings):
    tensor = emit.emit_node(node, inputs, name=node.name + '/gspmd/local_pad').outputs[0]
  padded = Local(
    tensor, x.sharding, tuple(n + sum(local_paddings[d]) for d, n in enumerate(x.shape))
  )
  if fill is None and split:  # PadV2 with a pad value known only at run time
    tensor = _fill_tails(p, padded, tensor, split, inputs[2])
  elif split:
    windows = {d: (chosen.rule.windows[_factor_of(rule, d)], fill) for d in split}
    tensor = shift_window(p, tensor, padded, windows)
  return [_result(p, graph, node, tf.identity(tensor, name=node.name), chosen.results[0])]


def _pads_shard_tails(node, n: int, pads, shards: int) -> bool:
  """A constant pad at the end of a dim whose shards keep their size: the new rows are the
  tail of the last shards (a local mask, no rows move)."""
  return (
    local_params(node)['fill'] != 'reflect'
    and pads[0] == 0
    and _chunk(n + pads[1], shards) == _chunk(n, shards)
  )


def _fill_tails(p, x: Local, tensor: tf.Tensor, dims, value: tf.Tensor) -> tf.Tensor:
  """Rows past the end of the input along split `dims` set to `value` (`_pads_shard_tails`)."""
  valid = None
  for d in sorted(dims):
    m = uneven.valid_mask(
      x.sharding, x.shape, d, int(tensor.shape[d]), p.backend.partition_id, len(x.shape)
    )
    valid = m if valid is None else tf.logical_and(valid, m)
  return tf.where(valid, tensor, tf.broadcast_to(tf.cast(value, tensor.dtype), tf.shape(tensor)))


def _static_pad_value(p, graph, node):
  """The constant a Pad/PadV2 fills with, when known before run time (else None)."""
  fill = local_params(node)['fill']  # the registry entry's: 'zero', 'operand' or 'reflect'
  if fill == 'zero':
    return 0
  if fill == 'operand':
    value = p.static_value(graph, node.inputs[2])
    producer = graph.producer(node.inputs[2])
    if value is None and producer.op == 'Const':  # folding keeps int/bool tensors only
      value = tf.make_ndarray(producer.attrs['value'].tensor)
    return None if value is None else np.asarray(value).item()
  return None  # MirrorPad reflects rows: not a shift


# --- generated sequences -------------------------------------------------------------------
def _sequence(p, graph, node, values_at):
  """A rank-1 generated result: `values_at(global indices)` on this partition's shard."""
  out = node.outputs[0].name
  target = p.target(graph, out)
  (n,) = global_shape(graph, out)
  (chunk,) = target.shard_shape((n,))
  offset = uneven.shard_offset(target, (n,), 0, p.backend.partition_id)
  index = tf.range(chunk, dtype=tf.int32) + offset
  return [_result(p, graph, node, values_at(index, n), target)]


@computes('range')
@_static_first
def range_handler(p, graph, node, operands):
  start, _, delta = (p.replicate(o, 'Range operand').tensor for o in operands)
  dtype = node.outputs[0].dtype

  def values_at(index, n):
    return tf.add(start, tf.cast(index, dtype) * delta, name=node.name)

  return _sequence(p, graph, node, values_at)


@computes('lin_space')
@_static_first
def lin_space_handler(p, graph, node, operands):
  start, stop, _ = (p.replicate(o, 'LinSpace operand').tensor for o in operands)
  dtype = node.outputs[0].dtype

  def values_at(index, n):
    if n <= 1:
      return tf.fill(tf.shape(index), start, name=node.name)
    step = (stop - start) / tf.cast(n - 1, dtype)
    values = start + tf.cast(index, dtype) * step
    return tf.where(tf.equal(index, n - 1), tf.fill(tf.shape(index), stop), values, name=node.name)

  return _sequence(p, graph, node, values_at)


# --- segment reductions ------------------------------------------------------------------
@computes('unsorted_segment')
@_static_first
def unsorted_segment_handler(p, graph, node, operands):
  """Rows split over partitions reduce into partial segments, combined by one all-reduce.

  Layouts from the rule: the id dims of data and ids are split alike (a
  reduction factor), data's other dims pass through, the segment dim is
  whole. Ids in the padding of uneven shards become -1, which every
  UnsortedSegment op drops.
  """
  from tf_gspmd.graph_rewrite import factors

  data, ids, num = operands
  r = len(ids.shape)
  from tf_gspmd.propagation import registry

  reduction = registry.entry_of(node.op).reduction
  chosen = factors.choose_layouts(
    p, graph, node, operands, reduction=reduction, combinable=data.dtype in _SUMMABLE
  )
  data = p.reshard(data, chosen.operands[0], f'{node.op} data')
  ids = p.reshard(ids, chosen.operands[1], f'{node.op} segment ids')
  ids_local = uneven.mask_padding(
    ids.tensor, ids.sharding, ids.shape, range(r), -1, p.backend.partition_id
  )
  num_local = p.replicate(num, 'number of segments').tensor
  return emit_outputs(p, graph, node, [data.tensor, ids_local, num_local], chosen.results)


# --- gathers --------------------------------------------------------------------------------
@computes('gather_v1')
@_static_first
def gather_v1_handler(p, graph, node, operands):
  """Gather (v1) is GatherV2 on axis 0: the table-sharded gather of `gather.py`, in the
  layouts of its rule."""
  from tf_gspmd.graph_rewrite import gather

  return gather.rule_gather(p, graph, node, operands, axis=0)


# --- shapes of variables, random values ------------------------------------------------------
@computes('variable_shape')
def variable_shape_handler(p, graph, node, operands):
  """The global shape of the variable (its handle's Local knows it), not its shard's."""
  out = node.outputs[0]
  value = np.array(operands[0].shape, dtype=out.dtype.as_numpy_dtype)
  local = Local(tf.constant(value, name=node.name), _named(p, [()]), value.shape)
  return [p.finish(graph, local, out.name)]


# --- one-hot ------------------------------------------------------------------------------------
@computes('one_hot')
@_static_first
def one_hot_handler(p, graph, node, operands):
  """OneHot with its depth dim split: each partition one-hots against its own depth range.

  Indices are shifted by this partition's first depth row; indices outside
  the local range give `off_value`, as out-of-range indices do globally (an
  index past the global depth can only land in the padding of the last shard).
  Layouts (index dims, depth dim) from the rule.
  """
  from tensorflow.core.framework import attr_value_pb2

  from tf_gspmd.graph_rewrite import factors

  indices, depth, on, off = operands
  out = node.outputs[0].name
  out_shape = global_shape(graph, out)
  rank = len(indices.shape)
  axis = node.attrs['axis'].i if 'axis' in node.attrs else -1
  axis = rank if axis == -1 else axis
  chosen = factors.choose_layouts(p, graph, node, operands)
  indices = p.reshard(indices, chosen.operands[0], 'OneHot indices')
  sharding = chosen.results[0]
  depth_axes = sharding.spec.axes_of(axis)
  values = [p.replicate(v, 'OneHot value').tensor for v in (on, off)]
  if not depth_axes:
    return emit_outputs(
      p, graph, node, [indices.tensor, p.replicate(depth).tensor] + values, [sharding]
    )
  offset = uneven.shard_offset(sharding, out_shape, axis, p.backend.partition_id)
  shifted = tf.cast(indices.tensor, tf.int32) - offset
  chunk = sharding.shard_shape(out_shape)[axis]
  attrs = {'TI': attr_value_pb2.AttrValue(type=tf.int32.as_datatype_enum)}
  return emit_outputs(
    p, graph, node, [shifted, tf.constant(chunk, tf.int32)] + values, [sharding], attrs=attrs
  )
