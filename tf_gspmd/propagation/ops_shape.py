"""Shape ops: Reshape and its kin, Transpose, Tile, Broadcast, Pack/Concat/Split, Slice, Pad,
Gather and segment sums, shape queries, Fill/Range/OneHot.

Reshape (and ExpandDims/Squeeze, which are reshapes) factor both shapes into
common pieces: a dim that is split or merged becomes a compound dim of
several factors, so a sharded dim keeps its sharding across the reshape
wherever the split lines up with shard boundaries. Slice, StridedSlice and Pad
keep a sharded dim sharded and record the window (offset, stride) the
partitioner needs for the halo (rows shifted between neighbours, as XLA's
partitioner does for slices and pads); Gather's indexed dim and a
StridedSlice's shrunk (indexed) dim are reductions (a masked local pick, then
a sum over the shards).
"""

from __future__ import annotations

import dataclasses
import math

from tf_gspmd.propagation.halo import WindowDim
from tf_gspmd.propagation.ops_elementwise import broadcasting_rule
from tf_gspmd.propagation.registry import RuleError, attr, declare, op_types_of, register
from tf_gspmd.propagation.rule import NEED_REPLICATION, REDUCTION
from tf_gspmd.propagation.rule_builders import Namer, make_rule, normalize_axis, replicated_results


# --- reshape ---------------------------------------------------------------------
def reshape_factors(in_shape, out_shape, namer: Namer):
  """Factor two shapes of one element count into shared factors.

  Returns (in_dims, out_dims, sizes, kinds): per dim a factor, a tuple of
  factors (major to minor) or None for size-1 dims. Parts that cannot be
  matched (coprime remainders, unknown sizes) get need-replication factors.
  """
  in_f = [[] for _ in in_shape]
  out_f = [[] for _ in out_shape]
  sizes, kinds = {}, {}

  def new(size, kind=None):
    f = namer.fresh()
    sizes[f] = size
    if kind:
      kinds[f] = kind
    return f

  if None in in_shape or None in out_shape:
    # Unknown sizes: match equal dims from both ends, the middle stays whole.
    lo = 0
    while lo < min(len(in_shape), len(out_shape)) and in_shape[lo] == out_shape[lo]:
      f = new(in_shape[lo])
      in_f[lo].append(f)
      out_f[lo].append(f)
      lo += 1
    hi = 0
    while hi < min(len(in_shape), len(out_shape)) - lo and in_shape[-1 - hi] == out_shape[-1 - hi]:
      f = new(in_shape[-1 - hi])
      in_f[len(in_shape) - 1 - hi].append(f)
      out_f[len(out_shape) - 1 - hi].append(f)
      hi += 1
    for d in range(lo, len(in_shape) - hi):
      if in_shape[d] != 1:
        in_f[d].append(new(in_shape[d], NEED_REPLICATION))
    for d in range(lo, len(out_shape) - hi):
      if out_shape[d] != 1:
        out_f[d].append(new(out_shape[d], NEED_REPLICATION))
    return _entries(in_f), _entries(out_f), sizes, kinds

  a = [(d, s) for d, s in enumerate(in_shape) if s != 1]
  b = [(d, s) for d, s in enumerate(out_shape) if s != 1]
  ia = ib = 0
  ra = a[0][1] if a else 1
  rb = b[0][1] if b else 1
  while ia < len(a) and ib < len(b):
    if ra == rb:
      f = new(ra)
      in_f[a[ia][0]].append(f)
      out_f[b[ib][0]].append(f)
      ia, ib = ia + 1, ib + 1
      ra = a[ia][1] if ia < len(a) else 1
      rb = b[ib][1] if ib < len(b) else 1
    elif ra % rb == 0:
      f = new(rb)
      in_f[a[ia][0]].append(f)
      out_f[b[ib][0]].append(f)
      ra //= rb
      ib += 1
      rb = b[ib][1] if ib < len(b) else 1
    elif rb % ra == 0:
      f = new(ra)
      in_f[a[ia][0]].append(f)
      out_f[b[ib][0]].append(f)
      rb //= ra
      ia += 1
      ra = a[ia][1] if ia < len(a) else 1
    elif math.gcd(ra, rb) > 1:
      g = math.gcd(ra, rb)
      f = new(g)
      in_f[a[ia][0]].append(f)
      out_f[b[ib][0]].append(f)
      ra, rb = ra // g, rb // g
    else:
      # Coprime remainders: the rest of this group of dims has no common factors.
      ja, jb, pa, pb = ia, ib, ra, rb
      while pa != pb:
        if pa < pb:
          ja += 1
          pa *= a[ja][1]
        else:
          jb += 1
          pb *= b[jb][1]
      for k in range(ia, ja + 1):
        in_f[a[k][0]].append(new(ra if k == ia else a[k][1], NEED_REPLICATION))
      for k in range(ib, jb + 1):
        out_f[b[k][0]].append(new(rb if k == ib else b[k][1], NEED_REPLICATION))
      ia, ib = ja + 1, jb + 1
      ra = a[ia][1] if ia < len(a) else 1
      rb = b[ib][1] if ib < len(b) else 1
  return _entries(in_f), _entries(out_f), sizes, kinds


def _entries(lists):
  return tuple(None if not fs else (fs[0] if len(fs) == 1 else tuple(fs)) for fs in lists)


def reshape(node, ctx):
  """Reshape, ExpandDims, Squeeze: a reshape between the two static shapes."""
  in_shape, out_shape = ctx.shape(node.inputs[0]), ctx.out_shape(node)
  if in_shape is None or out_shape is None:
    raise RuleError(f'{node.op} {node.name}: needs the ranks of input and result.')
  in_dims, out_dims, sizes, kinds = reshape_factors(in_shape, out_shape, Namer())
  operands = [in_dims] + [None] * (len(node.inputs) - 1)
  shapes = [in_shape] + [None] * (len(node.inputs) - 1)
  return make_rule(operands, [out_dims], shapes, [out_shape], kinds=kinds, sizes=sizes)


# --- permutations, tiling, broadcasting ----------------------------------------------
def transpose(node, ctx):
  shape = ctx.shape(node.inputs[0])
  perm = ctx.const_ints(node.inputs[1])
  if perm is None:
    raise RuleError(f'Transpose {node.name}: permutation {node.inputs[1]} is not a constant.')
  dims = tuple(Namer().take(len(shape)))
  return make_rule(
    [dims, None], [tuple(dims[p] for p in perm)], [shape, None], [ctx.out_shape(node)]
  )


def tile(node, ctx):
  """Tile: result dim d is (copy, d) with the copies major; a size-1 input dim is copies only."""
  shape = ctx.shape(node.inputs[0])
  out_shape = ctx.out_shape(node)
  multiples = ctx.const_ints(node.inputs[1])
  if multiples is None:
    multiples = [None if s in (None, 0) or o is None else o // s for s, o in zip(shape, out_shape)]
  namer = Namer()
  in_dims, out_dims, sizes = [], [], {}
  for s, m in zip(shape, multiples):
    f = namer.fresh()
    sizes[f] = s
    if m == 1:
      in_dims.append(f)
      out_dims.append(f)
      continue
    copies = namer.fresh()
    sizes[copies] = m
    if s == 1:
      in_dims.append(None)
      out_dims.append(copies)
    else:
      in_dims.append(f)
      out_dims.append((copies, f))
  return make_rule(
    [tuple(in_dims), None],
    [tuple(out_dims)],
    [shape, None],
    [out_shape],
    sizes=sizes,
    broadcast_operands=[0],
  )


def broadcast_to(node, ctx):
  return broadcasting_rule(node, ctx, data_operands=[0])


def reverse(node, ctx):
  """ReverseV2(x, axes): a reversed dim must be whole."""
  shape = ctx.shape(node.inputs[0])
  axes = ctx.const_ints(node.inputs[1])
  if axes is None:
    raise RuleError(f'ReverseV2 {node.name}: axes {node.inputs[1]} are not a constant.')
  dims = tuple(Namer().take(len(shape)))
  kinds = {dims[normalize_axis(a, len(shape), 'ReverseV2')]: NEED_REPLICATION for a in axes}
  return make_rule([dims, None], [dims], [shape, None], [ctx.out_shape(node)], kinds=kinds)


def roll(node, ctx):
  """Roll(x, shift, axis): every dim passes through; a rolled dim split over mesh axes
  takes whole shards and shard edges from the partitions `shift` rows away
  (`graph_rewrite/roll.py`). Without constant shifts and axes, the rolled dims are whole."""
  shape = ctx.shape(node.inputs[0])
  dims = tuple(Namer().take(len(shape)))
  shift, axes = ctx.const_ints(node.inputs[1]), ctx.const_ints(node.inputs[2])
  if axes is None:
    kinds = {d: NEED_REPLICATION for d in dims}
  elif shift is None:
    kinds = {dims[normalize_axis(a, len(shape), 'Roll')]: NEED_REPLICATION for a in axes}
  else:
    kinds = {}
  rule = make_rule(
    [dims, None, None], [dims], [shape, None, None], [ctx.out_shape(node)], kinds=kinds
  )
  if axes is None or shift is None:
    return rule
  rolled = tuple(dims[normalize_axis(a, len(shape), 'Roll')] for a in axes)
  return dataclasses.replace(rule, shifted=tuple(f for f in dims if f in rolled))


# --- stacking, concatenating, splitting ----------------------------------------------
def pack(node, ctx):
  """Pack: the new dim (one slot per operand) must be whole; other dims pass through."""
  shape = ctx.shape(node.inputs[0])
  axis = normalize_axis(attr(node, 'axis', 0), len(shape) + 1, f'Pack {node.name}')
  namer = Namer()
  dims = tuple(namer.take(len(shape)))
  new = namer.fresh()
  out = dims[:axis] + (new,) + dims[axis:]
  return make_rule(
    [dims] * len(node.inputs),
    [out],
    [ctx.shape(t) for t in node.inputs],
    [ctx.out_shape(node)],
    kinds={new: NEED_REPLICATION},
  )


def unpack(node, ctx):
  shape = ctx.shape(node.inputs[0])
  axis = normalize_axis(attr(node, 'axis', 0), len(shape), f'Unpack {node.name}')
  dims = tuple(Namer().take(len(shape)))
  out = dims[:axis] + dims[axis + 1 :]
  return make_rule(
    [dims],
    [out] * len(node.outputs),
    [shape],
    [ctx.shape(o.name) for o in node.outputs],
    kinds={dims[axis]: NEED_REPLICATION},
  )


def _concat_like(node, ctx, data, axis_input, outputs_split):
  """Concat/Split: other dims pass through; the joined dim of each tensor must be whole."""
  shape = ctx.shape(node.inputs[data[0]]) if not outputs_split else ctx.shape(node.inputs[data[0]])
  axis = ctx.const_ints(node.inputs[axis_input])
  if axis is None:
    raise RuleError(f'{node.op} {node.name}: axis {node.inputs[axis_input]} is not a constant.')
  axis = normalize_axis(axis[0], len(shape), f'{node.op} {node.name}')
  namer = Namer()
  dims = list(namer.take(len(shape)))
  kinds = {}

  def with_own_axis():
    f = namer.fresh()
    kinds[f] = NEED_REPLICATION
    return tuple(dims[:axis] + [f] + dims[axis + 1 :])

  operands = [with_own_axis() if i in data else None for i in range(len(node.inputs))]
  results = [with_own_axis() for _ in node.outputs]
  return make_rule(
    operands,
    results,
    [ctx.shape(t) for t in node.inputs],
    [ctx.shape(o.name) for o in node.outputs],
    kinds=kinds,
  )


def concat_v2(node, ctx):
  n = len(node.inputs) - 1
  return _concat_like(node, ctx, list(range(n)), n, False)


def concat_v1(node, ctx):
  return _concat_like(node, ctx, list(range(1, len(node.inputs))), 0, False)


def split(node, ctx):
  return _concat_like(node, ctx, [1], 0, True)


def split_v(node, ctx):
  return _concat_like(node, ctx, [0], 2, True)


# --- slicing and padding ---------------------------------------------------------------
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


# --- gathers and segment sums ------------------------------------------------------------
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


# --- generated values -------------------------------------------------------------------
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


def _reshape_example(b):
  x = b.placeholder('x', (4, 6, 8))
  s = b.const([24, 2, 4], name='shape')
  b.op('Reshape', [x, s], [(24, 2, 4)], name='y')
  return 'y'


def _expand_dims_example(b):
  x = b.placeholder('x', (4, 8))
  a = b.const(1, name='axis')
  b.op('ExpandDims', [x, a], [(4, 1, 8)], name='y')
  return 'y'


def _squeeze_example(b):
  x = b.placeholder('x', (4, 1, 8))
  b.op('Squeeze', [x], [(4, 8)], name='y', attrs={'squeeze_dims': [1]})
  return 'y'


def _transpose_example(b):
  x = b.placeholder('x', (2, 4, 8))
  p = b.const([0, 2, 1], name='perm')
  b.op('Transpose', [x, p], [(2, 8, 4)], name='y')
  return 'y'


def _tile_example(b):
  x = b.placeholder('x', (4, 1, 8))
  m = b.const([1, 3, 2], name='multiples')
  b.op('Tile', [x, m], [(4, 3, 16)], name='y')
  return 'y'


def _broadcast_to_example(b):
  x = b.placeholder('x', (1, 8))
  s = b.const([4, 8], name='shape')
  b.op('BroadcastTo', [x, s], [(4, 8)], name='y')
  return 'y'


def _reverse_example(b):
  x = b.placeholder('x', (4, 8))
  a = b.const([1], name='axis')
  b.op('ReverseV2', [x, a], [(4, 8)], name='y')
  return 'y'


def _roll_example(b):
  x = b.placeholder('x', (8, 6))
  shift, axis = b.const([3], name='shift'), b.const([0], name='axis')
  b.op('Roll', [x, shift, axis], [(8, 6)], name='y')
  return 'y'


def _pack_example(b):
  xs = [b.placeholder(f'x{i}', (4, 8)) for i in range(3)]
  b.op('Pack', xs, [(4, 3, 8)], name='y', attrs={'axis': 1, 'N': 3})
  return 'y'


def _unpack_example(b):
  x = b.placeholder('x', (4, 3, 8))
  b.op('Unpack', [x], [(4, 8)] * 3, name='y', attrs={'axis': 1, 'num': 3})
  return 'y'


def _concat_v2_example(b):
  x = b.placeholder('x', (4, 8))
  z = b.placeholder('z', (4, 2))
  a = b.const(1, name='axis')
  b.op('ConcatV2', [x, z, a], [(4, 10)], name='y', attrs={'N': 2})
  return 'y'


def _concat_example(b):
  a = b.const(1, name='axis')
  x = b.placeholder('x', (4, 8))
  z = b.placeholder('z', (4, 2))
  b.op('Concat', [a, x, z], [(4, 10)], name='y', attrs={'N': 2})
  return 'y'


def _split_example(b):
  a = b.const(1, name='axis')
  x = b.placeholder('x', (4, 8))
  b.op('Split', [a, x], [(4, 4), (4, 4)], name='y', attrs={'num_split': 2})
  return 'y'


def _split_v_example(b):
  x = b.placeholder('x', (4, 8))
  s = b.const([3, 5], name='sizes')
  a = b.const(1, name='axis')
  b.op('SplitV', [x, s, a], [(4, 3), (4, 5)], name='y', attrs={'num_split': 2})
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


register('Reshape', 'shape', reshape, _reshape_example)
register('ExpandDims', 'shape', reshape, _expand_dims_example)
register('Squeeze', 'shape', reshape, _squeeze_example)
register('Transpose', 'shape', transpose, _transpose_example)
register('Tile', 'shape', tile, _tile_example)
register('BroadcastTo', 'shape', broadcast_to, _broadcast_to_example)
register('ReverseV2', 'shape', reverse, _reverse_example)
register('Roll', 'shape', roll, _roll_example)
register('Pack', 'shape', pack, _pack_example)
register('Unpack', 'shape', unpack, _unpack_example)
register('ConcatV2', 'shape', concat_v2, _concat_v2_example)
register('Concat', 'shape', concat_v1, _concat_example)
register('Split', 'shape', split, _split_example)
register('SplitV', 'shape', split_v, _split_v_example)
register('Slice', 'shape', slice_rule, _slice_example)
register('StridedSlice', 'shape', strided_slice, _strided_slice_example)
register(['Pad', 'PadV2', 'MirrorPad'], 'shape', pad, _pad_example('Pad'))
register('GatherV2', 'shape', gather_v2, _gather_v2_example)
register('Gather', 'shape', gather_v1, _gather_example)
register('GatherNd', 'shape', gather_nd, _gather_nd_example)
register(
  ['UnsortedSegmentSum', 'UnsortedSegmentMax', 'UnsortedSegmentMin', 'UnsortedSegmentProd'],
  'shape',
  unsorted_segment,
  _segment_example('UnsortedSegmentSum'),
)
register('OneHot', 'shape', one_hot, _one_hot_example)
register(['Shape', 'Size', 'Rank'], 'shape', shape_query, _shape_example('Shape'))
register('ShapeN', 'shape', shape_query, _shape_example('ShapeN'))
register(['BroadcastGradientArgs', 'BroadcastArgs'], 'shape', int_vector_op, _bga_example)
register('InvertPermutation', 'shape', int_vector_op, _invert_perm_example)
register('ConcatOffset', 'shape', int_vector_op, _concat_offset_example)
register('StridedSliceGrad', 'shape', strided_slice_grad, _strided_slice_grad_example)


# --- properties ---------------------------------------------------------------------
declare('Reshape', local='reshape', linear='reshape')
declare(['Reshape', 'ExpandDims', 'Squeeze'], aliasing=True)
declare('Tile', local='tile')
declare('BroadcastTo', local='broadcast_to')
declare('Roll', local='roll')
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
declare(['Shape', 'ShapeN', 'Size', 'Rank'], local='static')

# --- sweep programs (testing/programs/shape.py) -----------------------------------
declare(op_types_of('shape'), sweep='shape')
# Segment reductions: `order` of their value draws (one seeded stream), `near_one` for a
# product that stays finite.
for _order, _op in enumerate(
  ['UnsortedSegmentSum', 'UnsortedSegmentMax', 'UnsortedSegmentMin', 'UnsortedSegmentProd']
):
  _params = {'form': 'segment', 'order': _order, 'near_one': _op == 'UnsortedSegmentProd'}
  declare(_op, sweep_params=_params)
