"""Shape ops: Reshape and its kin, Transpose, Tile, BroadcastTo, ReverseV2, Roll,
MatrixBandPart, Pack/Unpack, Concat and Split (slices, pads, gathers and shape queries:
`ops_indexing`).

Reshape (and ExpandDims/Squeeze, which are reshapes) factor both shapes into
common pieces: a dim that is split or merged becomes a compound dim of
several factors, so a sharded dim keeps its sharding across the reshape
wherever the split lines up with shard boundaries.
"""

from __future__ import annotations

import dataclasses
import math

from tf_gspmd.propagation.ops_elementwise import broadcasting_rule
from tf_gspmd.propagation.registry import RuleError, attr, declare, op_types_of, register
from tf_gspmd.propagation.rule import NEED_REPLICATION
from tf_gspmd.propagation.rule_builders import Namer, make_rule, normalize_axis


# --- reshape ---------------------------------------------------------------------
def reshape_factors(in_shape, out_shape, namer: Namer):
  """Factor two shapes of one element count into shared factors.

  Returns (in_dims, out_dims, sizes, kinds): per dim a factor, a tuple of
  factors (major to minor) or None for size-1 dims. Parts that cannot be
  matched (coprime remainders, unknown sizes) get need-replication factors.
  """
  in_f: list[list] = [[] for _ in in_shape]
  out_f: list[list] = [[] for _ in out_shape]
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


def matrix_band_part(node, ctx):
  """MatrixBandPart(x, num_lower, num_upper): which elements of a matrix it keeps depends on
  their global row and column, so the two matrix dims must be whole; batch dims pass through."""
  shape = ctx.shape(node.inputs[0])
  dims = tuple(Namer().take(len(shape)))
  kinds = {d: NEED_REPLICATION for d in dims[-2:]}
  return make_rule(
    [dims, None, None], [dims], [shape, None, None], [ctx.out_shape(node)], kinds=kinds
  )


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


# --- examples ---------------------------------------------------------------------------


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


def _matrix_band_part_example(b):
  x = b.placeholder('x', (2, 4, 8))
  lower, upper = b.const(1, name='num_lower'), b.const(-1, name='num_upper')
  b.op('MatrixBandPart', [x, lower, upper], [(2, 4, 8)], name='y')
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


register('Reshape', 'shape', reshape, _reshape_example)
register('ExpandDims', 'shape', reshape, _expand_dims_example)
register('Squeeze', 'shape', reshape, _squeeze_example)
register('Transpose', 'shape', transpose, _transpose_example)
register('Tile', 'shape', tile, _tile_example)
register('BroadcastTo', 'shape', broadcast_to, _broadcast_to_example)
register('ReverseV2', 'shape', reverse, _reverse_example)
register('Roll', 'shape', roll, _roll_example)
register('MatrixBandPart', 'shape', matrix_band_part, _matrix_band_part_example)
register('Pack', 'shape', pack, _pack_example)
register('Unpack', 'shape', unpack, _unpack_example)
register('ConcatV2', 'shape', concat_v2, _concat_v2_example)
register('Concat', 'shape', concat_v1, _concat_example)
register('Split', 'shape', split, _split_example)
register('SplitV', 'shape', split_v, _split_v_example)


# --- properties ---------------------------------------------------------------------
declare('Reshape', local='reshape', linear='reshape')
declare('Squeeze', local='squeeze')
declare(['Reshape', 'ExpandDims', 'Squeeze'], aliasing=True)
declare('Tile', local='tile')
declare('BroadcastTo', local='broadcast_to')
declare('Roll', local='roll')

# --- sweep programs (testing/programs/shape.py) -----------------------------------
declare(op_types_of('shape'), sweep='shape')
