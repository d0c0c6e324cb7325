"""Indexing shape ops: Slice, StridedSlice (and its gradient), Pad, gathers, segment
reductions, OneHot, shape queries and small integer-vector ops (family `shape`).

Slice, StridedSlice and Pad keep a sharded dim sharded and record the window
(offset, stride) the partitioner needs for the halo (rows shifted between
neighbours, as XLA's partitioner does for slices and pads); Gather's indexed
dim and a StridedSlice's shrunk (indexed) dim are reductions (a masked local
pick, then a sum over the shards).
"""

from __future__ import annotations

from tf_gspmd.propagation.halo import WindowDim
from tf_gspmd.propagation.registry import RuleError, attr, declare, op_types_of, register
from tf_gspmd.propagation.rule import NEED_REPLICATION, REDUCTION
from tf_gspmd.propagation.rule_builders import Namer, make_rule, normalize_axis, replicated_results


# --- slicing and padding -----------------------------------------------------------
def _window_or_whole(namer, in_size, out_size, start, stride, kinds, windows, sizes):
  """The factor of one sliced/padded dim: plain, windowed (offset, stride), or whole."""
  f = namer.fresh()
  if start == 0 and stride == 1 and in_size == out_size and in_size is not None:
    return f
  if start is None or stride is None or stride < 1 or in_size is None or out_size is None:
    kinds[f] = NEED_REPLICATION
    return f
  # Result row r reads input row r*stride + start: a window of one row.
  pad_lo = -start
  pad_hi = (out_size - 1) * stride + 1 - in_size - pad_lo
  windows[f] = WindowDim(in_size, 1, stride, 1, pad_lo, pad_hi)
  sizes[f] = out_size
  return f


def slice_rule(node, ctx):
  shape, out_shape = ctx.shape(node.inputs[0]), ctx.out_shape(node)
  begin = ctx.const_ints(node.inputs[1])
  namer, kinds, windows, sizes = Namer(), {}, {}, {}
  in_dims, out_dims = [], []
  for d, (s, o) in enumerate(zip(shape, out_shape)):
    start = None if begin is None else begin[d]
    f = _window_or_whole(
      namer, s, o, start if s != o or begin is not None else 0, 1, kinds, windows, sizes
    )
    in_dims.append(f)
    out_dims.append(f)
  return make_rule(
    [tuple(in_dims), None, None],
    [tuple(out_dims)],
    [shape, None, None],
    [out_shape],
    kinds=kinds,
    windows=windows,
    sizes=sizes,
  )


def strided_slice(node, ctx):
  """StridedSlice with begin/end/ellipsis/new-axis/shrink masks."""
  shape, out_shape = ctx.shape(node.inputs[0]), ctx.out_shape(node)
  begin, end, strides = (ctx.const_ints(node.inputs[i]) for i in (1, 2, 3))
  masks = {
    m: attr(node, m + '_mask', 0) for m in ('begin', 'end', 'ellipsis', 'new_axis', 'shrink_axis')
  }
  namer, kinds, windows, sizes = Namer(), {}, {}, {}
  if begin is None or end is None or strides is None:
    if len(shape) != len(out_shape) or masks['new_axis'] or masks['shrink_axis']:
      raise RuleError(f'StridedSlice {node.name}: slice bounds are not constants.')
    dims = []
    for s, o in zip(shape, out_shape):
      f = namer.fresh()
      if s != o or s is None:
        kinds[f] = NEED_REPLICATION
      dims.append(f)
    return make_rule(
      [tuple(dims), None, None, None], [tuple(dims)], [shape] + [None] * 3, [out_shape], kinds=kinds
    )
  n_spec = len(begin)
  consuming = sum(
    1
    for k in range(n_spec)
    if not (masks['new_axis'] >> k) & 1 and not (masks['ellipsis'] >> k) & 1
  )
  in_dims, out_dims = [], []
  d = 0  # input dim
  for k in range(n_spec):
    bit = 1 << k
    if masks['ellipsis'] & bit:
      for _ in range(len(shape) - consuming):
        f = namer.fresh()
        in_dims.append(f)
        out_dims.append(f)
        d += 1
      continue
    if masks['new_axis'] & bit:
      out_dims.append(None)
      continue
    size = shape[d]
    if masks['shrink_axis'] & bit:
      # One row picked and the dim dropped: each shard keeps the row if it holds it (zeros
      # otherwise), a sum over the shards gives it (a gather of one index, moving one row).
      f = namer.fresh()
      kinds[f] = REDUCTION
      in_dims.append(f)
      d += 1
      continue
    b = None if masks['begin'] & bit else begin[k]
    e = None if masks['end'] & bit else end[k]
    stride = strides[k]
    if size is None:
      start, count = None, None
    else:
      rng = range(size)[slice(b, e, stride)]
      start, count = (rng.start if len(rng) else 0), len(rng)
    f = _window_or_whole(namer, size, count, start, stride, kinds, windows, sizes)
    in_dims.append(f)
    out_dims.append(f)
    d += 1
  while d < len(shape):
    f = namer.fresh()
    in_dims.append(f)
    out_dims.append(f)
    d += 1
  return make_rule(
    [tuple(in_dims), None, None, None],
    [tuple(out_dims)],
    [shape] + [None] * 3,
    [out_shape],
    kinds=kinds,
    windows=windows,
    sizes=sizes,
  )


def pad(node, ctx):
  """Pad/PadV2/MirrorPad: a padded dim stays sharded with its window (the partitioner pads
  edges)."""
  shape, out_shape = ctx.shape(node.inputs[0]), ctx.out_shape(node)
  paddings = ctx.const(node.inputs[1])
  namer, kinds, windows, sizes = Namer(), {}, {}, {}
  dims = []
  for d, (s, o) in enumerate(zip(shape, out_shape)):
    if paddings is None:
      f = namer.fresh()
      if s != o:
        kinds[f] = NEED_REPLICATION
    else:
      lo = int(paddings[d][0])
      f = _window_or_whole(namer, s, o, -lo, 1, kinds, windows, sizes)
    dims.append(f)
  n_aux = len(node.inputs) - 1
  return make_rule(
    [tuple(dims)] + [None] * n_aux,
    [tuple(dims)],
    [shape] + [None] * n_aux,
    [out_shape],
    kinds=kinds,
    windows=windows,
    sizes=sizes,
  )


def gather_rule(node, ctx, params_shape, axis, batch_dims, params_input, indices_input):
  """params[:axis] + indices[batch_dims:] + params[axis+1:]; the indexed dim is a reduction."""
  indices_shape = ctx.shape(node.inputs[indices_input])
  namer = Namer()
  p_dims = list(namer.take(len(params_shape)))
  i_dims = p_dims[:batch_dims] + namer.take(len(indices_shape) - batch_dims)
  out = p_dims[:axis] + i_dims[batch_dims:] + p_dims[axis + 1 :]
  operands = [None] * len(node.inputs)
  shapes = [None] * len(node.inputs)
  operands[params_input], shapes[params_input] = tuple(p_dims), params_shape
  operands[indices_input], shapes[indices_input] = tuple(i_dims), indices_shape
  return make_rule(
    operands, [tuple(out)], shapes, [ctx.out_shape(node)], kinds={p_dims[axis]: REDUCTION}
  )


def gather_v2(node, ctx):
  shape = ctx.shape(node.inputs[0])
  axis = ctx.const_ints(node.inputs[2])
  if axis is None:
    raise RuleError(f'GatherV2 {node.name}: axis {node.inputs[2]} is not a constant.')
  batch_dims = attr(node, 'batch_dims', 0)
  batch_dims = batch_dims % len(ctx.shape(node.inputs[1])) if batch_dims < 0 else batch_dims
  return gather_rule(
    node, ctx, shape, normalize_axis(axis[0], len(shape), 'GatherV2'), batch_dims, 0, 1
  )


def gather_v1(node, ctx):
  return gather_rule(node, ctx, ctx.shape(node.inputs[0]), 0, 0, 0, 1)


def gather_nd(node, ctx):
  """GatherNd: the indexed leading params dims and the index-tuple dim must be whole."""
  p_shape, i_shape = ctx.shape(node.inputs[0]), ctx.shape(node.inputs[1])
  q = i_shape[-1]
  if q is None:
    raise RuleError(f'GatherNd {node.name}: index depth unknown.')
  namer = Namer()
  p_dims = namer.take(len(p_shape))
  i_dims = namer.take(len(i_shape))
  kinds = {f: NEED_REPLICATION for f in p_dims[:q] + i_dims[-1:]}
  out = tuple(i_dims[:-1] + p_dims[q:])
  return make_rule(
    [tuple(p_dims), tuple(i_dims)], [out], [p_shape, i_shape], [ctx.out_shape(node)], kinds=kinds
  )


def unsorted_segment(node, ctx):
  """UnsortedSegment{Sum,Max,Min,Prod}(data, ids, n): data's id dims reduce into n segments."""
  d_shape, i_shape = ctx.shape(node.inputs[0]), ctx.shape(node.inputs[1])
  namer = Namer()
  d_dims = namer.take(len(d_shape))
  r = len(i_shape)
  seg = namer.fresh()
  kinds = {f: REDUCTION for f in d_dims[:r]}
  kinds[seg] = NEED_REPLICATION
  return make_rule(
    [tuple(d_dims), tuple(d_dims[:r]), None],
    [(seg,) + tuple(d_dims[r:])],
    [d_shape, i_shape, None],
    [ctx.out_shape(node)],
    kinds=kinds,
  )


def one_hot(node, ctx):
  """OneHot(indices, depth, on, off): the new depth dim is free."""
  i_shape = ctx.shape(node.inputs[0])
  out_shape = ctx.out_shape(node)
  axis = attr(node, 'axis', -1)
  axis = len(i_shape) if axis == -1 else axis
  namer = Namer()
  dims = namer.take(len(i_shape))
  depth = namer.fresh()
  out = tuple(dims[:axis] + [depth] + dims[axis:])
  return make_rule([tuple(dims), None, None, None], [out], [i_shape] + [None] * 3, [out_shape])


def shape_query(node, ctx):
  """Shape/ShapeN/Size/Rank and friends: small integer results, replicated; inputs unconstrained."""
  return replicated_results(node, ctx, data_operands=range(len(node.inputs)))


def int_vector_op(node, ctx):
  """Shape arithmetic (BroadcastGradientArgs, InvertPermutation, ConcatOffset): replicated
  results."""
  return replicated_results(node, ctx)


class _GradientView:
  """A StridedSliceGrad's context seen as its forward StridedSlice's: the input is the
  tensor of the shape operand's value, the result is dy (the operand order is the same)."""

  def __init__(self, node, ctx):
    self._node, self._ctx = node, ctx

  def shape(self, tensor):
    if tensor == self._node.inputs[0]:
      value = self._ctx.const_ints(tensor)
      return None if value is None else tuple(value)
    return self._ctx.shape(tensor)

  def out_shape(self, node, index=0):
    return self._ctx.shape(node.inputs[4])

  def const_ints(self, tensor):
    return self._ctx.const_ints(tensor)


def strided_slice_grad(node, ctx):
  """StridedSliceGrad(shape, begin, end, strides, dy): dy written into zeros of `shape`.

  The forward slice's factors, transposed: dims the slice keeps whole pass
  through from dy to the result; sliced and shrunk dims stay whole.
  """
  view = _GradientView(node, ctx)
  if view.shape(node.inputs[0]) is None:
    raise RuleError(f'StridedSliceGrad {node.name}: shape {node.inputs[0]} is not a constant.')
  forward = strided_slice(node, view)
  kinds = {
    f: NEED_REPLICATION
    for f in forward.factors()
    if f in forward.windows or forward.kind(f) != 'pass_through'
  }
  return make_rule(
    [None] * 4 + [forward.results[0]],
    [forward.operands[0]],
    [None] * 4 + [ctx.shape(node.inputs[4])],
    [view.shape(node.inputs[0])],
    kinds=kinds,
  )


# --- examples ---------------------------------------------------------------------------
def _strided_slice_grad_example(b):
  shape = b.const([4, 6, 8], name='shape')
  begin, end = b.const([0, 1, 0], name='begin'), b.const([4, 5, 8], name='end')
  strides = b.const([1, 1, 1], name='strides')
  dy = b.placeholder('dy', (4, 4, 8))
  b.op('StridedSliceGrad', [shape, begin, end, strides, dy], [(4, 6, 8)], name='y')
  return 'y'


def _concat_offset_example(b):
  import tensorflow as tf

  axis = b.const(1, name='axis')
  s0, s1 = b.const([2, 3], name='s0'), b.const([2, 5], name='s1')
  b.op('ConcatOffset', [axis, s0, s1], [(2,), (2,)], name='y', dtypes=[tf.int32] * 2)
  return 'y'


def _slice_example(b):
  x = b.placeholder('x', (4, 8))
  begin = b.const([0, 2], name='begin')
  size = b.const([4, 5], name='size')
  b.op('Slice', [x, begin, size], [(4, 5)], name='y')
  return 'y'


def _strided_slice_example(b):
  x = b.placeholder('x', (4, 8, 6))
  begin = b.const([0, 1, 2], name='begin')
  end = b.const([0, 8, 3], name='end')
  strides = b.const([1, 2, 1], name='strides')
  b.op(
    'StridedSlice',
    [x, begin, end, strides],
    [(4, 4)],
    name='y',
    attrs={'begin_mask': 1, 'end_mask': 1, 'shrink_axis_mask': 4},
  )
  return 'y'


def _pad_example(op):
  def build(b):
    x = b.placeholder('x', (4, 8))
    p = b.const([[0, 0], [1, 2]], name='paddings')
    inputs = [x, p] + ([b.const(0.0, name='value')] if op == 'PadV2' else [])
    b.op(op, inputs, [(4, 11)], name='y', attrs={'mode': 'REFLECT'} if op == 'MirrorPad' else {})
    return 'y'

  return build


def _gather_v2_example(b):
  import tensorflow as tf

  p = b.placeholder('params', (50, 16))
  i = b.placeholder('indices', (4, 10), dtype=tf.int32)
  a = b.const(0, name='axis')
  b.op('GatherV2', [p, i, a], [(4, 10, 16)], name='y', attrs={'batch_dims': 0})
  return 'y'


def _gather_example(b):
  import tensorflow as tf

  p = b.placeholder('params', (50, 16))
  i = b.placeholder('indices', (4, 10), dtype=tf.int32)
  b.op('Gather', [p, i], [(4, 10, 16)], name='y')
  return 'y'


def _gather_nd_example(b):
  import tensorflow as tf

  p = b.placeholder('params', (6, 7, 16))
  i = b.placeholder('indices', (4, 2), dtype=tf.int32)
  b.op('GatherNd', [p, i], [(4, 16)], name='y')
  return 'y'


def _segment_example(op):
  def build(b):
    import tensorflow as tf

    d = b.placeholder('data', (40, 16))
    i = b.placeholder('ids', (40,), dtype=tf.int32)
    n = b.const(50, name='num_segments')
    b.op(op, [d, i, n], [(50, 16)], name='y')
    return 'y'

  return build


def _one_hot_example(b):
  import tensorflow as tf

  i = b.placeholder('indices', (4,), dtype=tf.int32)
  depth = b.const(8, name='depth')
  on, off = b.const(1.0, name='on'), b.const(0.0, name='off')
  b.op('OneHot', [i, depth, on, off], [(4, 8)], name='y', attrs={'axis': -1})
  return 'y'


def _shape_example(op):
  def build(b):
    import tensorflow as tf

    x = b.placeholder('x', (4, 8))
    if op == 'ShapeN':
      z = b.placeholder('z', (2,))
      b.op(op, [x, z], [(2,), (1,)], name='y', dtypes=[tf.int32] * 2)
    else:
      b.op(op, [x], [(2,)] if op == 'Shape' else [()], name='y', dtypes=[tf.int32])
    return 'y'

  return build


def _bga_example(b):
  import tensorflow as tf

  s0 = b.const([4, 8], name='s0')
  s1 = b.const([8], name='s1')
  b.op('BroadcastGradientArgs', [s0, s1], [(0,), (1,)], name='y', dtypes=[tf.int32] * 2)
  return 'y'


def _invert_perm_example(b):
  import tensorflow as tf

  p = b.const([1, 0], name='perm')
  b.op('InvertPermutation', [p], [(2,)], name='y', dtypes=[tf.int32])
  return 'y'


register('Slice', 'indexing', slice_rule, _slice_example)
register('StridedSlice', 'indexing', strided_slice, _strided_slice_example)
register(['Pad', 'PadV2', 'MirrorPad'], 'indexing', pad, _pad_example('Pad'))
register('GatherV2', 'indexing', gather_v2, _gather_v2_example)
register('Gather', 'indexing', gather_v1, _gather_example)
register('GatherNd', 'indexing', gather_nd, _gather_nd_example)
register(
  ['UnsortedSegmentSum', 'UnsortedSegmentMax', 'UnsortedSegmentMin', 'UnsortedSegmentProd'],
  'indexing',
  unsorted_segment,
  _segment_example('UnsortedSegmentSum'),
)
register('OneHot', 'indexing', one_hot, _one_hot_example)
register(['Shape', 'Size', 'Rank'], 'indexing', shape_query, _shape_example('Shape'))
register('ShapeN', 'indexing', shape_query, _shape_example('ShapeN'))
register(['BroadcastGradientArgs', 'BroadcastArgs'], 'indexing', int_vector_op, _bga_example)
register('InvertPermutation', 'indexing', int_vector_op, _invert_perm_example)
register('ConcatOffset', 'indexing', int_vector_op, _concat_offset_example)
register('StridedSliceGrad', 'indexing', strided_slice_grad, _strided_slice_grad_example)


# --- properties ---------------------------------------------------------------------
declare('Slice', local='slice')
declare('StridedSlice', local='strided_slice')
declare('StridedSliceGrad', local='strided_slice_grad')
# The pad value: zero, operand 2, or rows reflected (not a shift).
declare('Pad', local='pad', local_params={'fill': 'zero'})
declare('PadV2', local='pad', local_params={'fill': 'operand'})
declare('MirrorPad', local='pad', local_params={'fill': 'reflect'})
declare('GatherV2', local='gather_v2')
declare('Gather', local='gather_v1')
declare('UnsortedSegmentSum', local='unsorted_segment', reduction='sum')
declare('UnsortedSegmentMax', local='unsorted_segment', reduction='max')
declare('UnsortedSegmentMin', local='unsorted_segment', reduction='min')
declare('UnsortedSegmentProd', local='unsorted_segment', reduction='prod')
declare('OneHot', local='one_hot')
# A table against its ids, segment rows against their sums: which split to keep is by bytes.
_SEGMENTS = [
  'UnsortedSegmentSum',
  'UnsortedSegmentMax',
  'UnsortedSegmentMin',
  'UnsortedSegmentProd',
]
declare(['GatherV2', 'Gather', 'GatherNd'] + _SEGMENTS, settles_by_bytes=True)
declare(['Shape', 'ShapeN', 'Size', 'Rank'], local='static')

# --- sweep programs (testing/programs/shape.py) -----------------------------------
declare(op_types_of('indexing'), sweep='shape')
# Segment reductions: `near_one` for a product that stays finite.
for _op in [
  'UnsortedSegmentSum',
  'UnsortedSegmentMax',
  'UnsortedSegmentMin',
  'UnsortedSegmentProd',
]:
  _params = {'form': 'segment', 'near_one': _op == 'UnsortedSegmentProd'}
  declare(_op, sweep_params=_params)
