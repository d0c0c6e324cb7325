"""Sweep programs of shape ops: reshapes, transposes, tiles, slices, pads, gathers, concats,
splits, one-hot, shape queries and segment reductions.

Segment reductions have `sweep_params['form']` 'segment' and read `order` (the order their
values are drawn in) and `near_one` (values near 1, so a product stays finite).
"""

from __future__ import annotations

from typing import List

import numpy as np
import tensorflow as tf

from tf_gspmd.testing.op_builders import (
  BINARY_SHAPE,
  UNARY_SHAPE,
  OpSpec,
  Values,
  arg,
  program,
  raw,
  spec,
)
from tf_gspmd.testing.programs import in_draw_order

# The order segment reductions' values were always drawn in (see `in_draw_order`).
SEGMENT_DRAW_ORDER = (
  'UnsortedSegmentSum',
  'UnsortedSegmentMax',
  'UnsortedSegmentMin',
  'UnsortedSegmentProd',
)


def _strided(begin, end, strides, **masks):
  return lambda a: raw('StridedSlice', a, begin, end, strides, **masks)


def _broadcast_gradient(grad):
  _, reduce_b = raw('BroadcastGradientArgs', list(BINARY_SHAPE), [3])
  return tf.reshape(tf.reduce_sum(grad, reduce_b), [3])


@program('shape')
def shape(entries) -> List[OpSpec]:
  v = Values('shape')
  x2, x3 = v.uniform((10, 7)), v.uniform(UNARY_SHAPE)
  ids = v.ints((10,), 0, 6)
  out = [
    spec('Reshape', lambda a: raw('Reshape', a, [5, 2, 7]), arg(x2)),
    spec('Reshape/merge', lambda a: raw('Reshape', a, [70, 3]), arg(x3)),
    spec('Reshape/flatten', lambda a: raw('Reshape', a, [-1]), arg(x2)),
    spec('ExpandDims', lambda a: raw('ExpandDims', a, 1), arg(x2)),
    spec('ExpandDims/last', lambda a: raw('ExpandDims', a, -1), arg(x2)),
    spec('Squeeze', lambda a: raw('Squeeze', a, axis=[1]), arg(v.uniform((10, 1, 3)))),
    spec('Transpose', lambda a: raw('Transpose', a, [2, 0, 1]), arg(x3)),
    spec('Transpose/2d', lambda a: raw('Transpose', a, [1, 0]), arg(x2)),
    spec('Tile', lambda a: raw('Tile', a, [2, 1]), arg(x2)),
    spec('Tile/broadcast_dim', lambda a: raw('Tile', a, [10, 2]), arg(v.uniform((1, 3)))),
    spec('BroadcastTo', lambda a: raw('BroadcastTo', a, [10, 3]), arg(v.uniform((1, 3)))),
    spec('BroadcastTo/new_dims', lambda a: raw('BroadcastTo', a, [7, 10, 3]), arg(v.uniform((3,)))),
    spec('ReverseV2', lambda a: raw('ReverseV2', a, [1]), arg(x2)),
    spec('ReverseV2/axis0', lambda a: raw('ReverseV2', a, [0]), arg(x2)),
    spec('Roll', lambda a: raw('Roll', a, [3], [0]), arg(v.uniform((8, 6)))),
    spec('Roll/edges', lambda a: raw('Roll', a, [-5, 2, 1], [0, 1, 0]), arg(x2)),
    spec(
      'Pack',
      lambda a, b, c: raw('Pack', [a, b, c], axis=1),
      arg(v.uniform(BINARY_SHAPE)),
      arg(v.uniform(BINARY_SHAPE)),
      arg(v.uniform(BINARY_SHAPE)),
    ),
    spec(
      'Pack/axis0',
      lambda a, b: raw('Pack', [a, b], axis=0),
      arg(v.uniform(BINARY_SHAPE)),
      arg(v.uniform(BINARY_SHAPE)),
    ),
    spec('Unpack', lambda a: tuple(raw('Unpack', a, num=3, axis=1)), arg(v.uniform(BINARY_SHAPE))),
    spec('Unpack/axis0', lambda a: tuple(raw('Unpack', a, num=7, axis=0)), arg(v.uniform((7, 10)))),
    spec(
      'ConcatV2',
      lambda a, b: raw('ConcatV2', [a, b], 1),
      arg(v.uniform((10, 3))),
      arg(v.uniform((10, 4))),
    ),
    spec(
      'ConcatV2/axis0',
      lambda a, b, c: raw('ConcatV2', [a, b, c], 0),
      arg(v.uniform((3, 7))),
      arg(v.uniform((5, 7))),
      arg(v.uniform((2, 7))),
    ),
    spec(
      'Concat',
      lambda a, b: raw('Concat', 0, [a, b]),
      arg(v.uniform((3, 7))),
      arg(v.uniform((7, 7))),
    ),
    spec('Split', lambda a: tuple(raw('Split', 0, a, num_split=2)), arg(x2)),
    spec('Split/axis1', lambda a: tuple(raw('Split', 1, a, num_split=3)), arg(v.uniform((10, 6)))),
    spec('SplitV', lambda a: tuple(raw('SplitV', a, [3, 7], 0, num_split=2)), arg(x2)),
    spec('SplitV/inferred', lambda a: tuple(raw('SplitV', a, [2, -1, 1], 1, num_split=3)), arg(x2)),
    spec('Slice', lambda a: raw('Slice', a, [1, 2], [8, 3]), arg(x2)),
    spec('Slice/to_end', lambda a: raw('Slice', a, [3, 0, 1], [-1, 10, -1]), arg(x3)),
    spec('Slice/whole_dim0', lambda a: raw('Slice', a, [0, 4], [10, 2]), arg(x2)),
    spec('StridedSlice', _strided([1, 0], [8, 7], [2, 1]), arg(x2)),
    spec('StridedSlice/negative', _strided([-3, 0], [0, -1], [1, 1], end_mask=1), arg(x2)),
    spec(
      'StridedSlice/shrink',
      _strided([0, 2], [0, 3], [1, 1], begin_mask=1, end_mask=1, shrink_axis_mask=2),
      arg(x2),
    ),
    spec('StridedSlice/shrink_dim0', _strided([-2], [-1], [1], shrink_axis_mask=1), arg(x3)),
    spec(
      'StridedSlice/new_axis',
      _strided([0, 0, 1], [0, 0, 5], [1, 1, 1], begin_mask=1, end_mask=1, new_axis_mask=2),
      arg(x2),
    ),
    spec('StridedSlice/ellipsis', _strided([0, 1], [0, 3], [1, 1], ellipsis_mask=1), arg(x3)),
    spec(
      'StridedSlice/reverse', _strided([0, 0], [0, 0], [-1, 2], begin_mask=3, end_mask=3), arg(x2)
    ),
    spec('StridedSlice/step3', _strided([2, 1, 0], [9, 10, 3], [3, 4, 1]), arg(x3)),
    spec('StridedSlice/empty', _strided([5, 0], [2, 7], [1, 1]), arg(x2)),
    spec(
      'StridedSlice/keras_last_step',
      _strided([0, -1, 0], [0, 0, 0], [1, 1, 1], begin_mask=5, end_mask=5, shrink_axis_mask=2),
      arg(x3),
    ),
    spec('Pad', lambda a: raw('Pad', a, [[1, 2], [0, 0]]), arg(x2)),
    spec('Pad/both_dims', lambda a: raw('Pad', a, [[3, 0], [1, 1]]), arg(x2)),
    spec('PadV2', lambda a: raw('PadV2', a, [[0, 0], [2, 1]], 7.0), arg(x2)),
    spec('MirrorPad', lambda a: raw('MirrorPad', a, [[2, 1], [1, 2]], mode='REFLECT'), arg(x2)),
    spec(
      'MirrorPad/symmetric',
      lambda a: raw('MirrorPad', a, [[1, 3], [0, 0]], mode='SYMMETRIC'),
      arg(x2),
    ),
    spec('GatherV2', lambda p, i: raw('GatherV2', p, i, 0), arg(x2), arg(v.ints((4, 5), 0, 10))),
    spec('GatherV2/axis1', lambda p, i: raw('GatherV2', p, i, 1), arg(x2), arg(v.ints((6,), 0, 7))),
    spec(
      'GatherV2/batch_dims',
      lambda p, i: raw('GatherV2', p, i, 1, batch_dims=1),
      arg(x2),
      arg(v.ints((10, 4), 0, 7)),
    ),
    spec('Gather', lambda p, i: raw('Gather', p, i), arg(x2), arg(v.ints((4, 5), 0, 10))),
    spec('GatherNd', lambda p, i: raw('GatherNd', p, i), arg(x3), arg(v.ints((4, 2), 0, 7))),
    spec('OneHot', lambda i: raw('OneHot', i, 7, 1.0, 0.0), arg(v.ints((10,), -1, 7))),
    spec(
      'OneHot/axis0', lambda i: raw('OneHot', i, 5, 2.0, -1.0, axis=0), arg(v.ints((10, 3), 0, 5))
    ),
    spec(
      'OneHot/middle_axis_int64',
      lambda i: raw('OneHot', i, 9, 1, 0, axis=1),
      arg(v.ints((10, 3), -2, 11).astype(np.int64)),
    ),
    spec(
      'InvertPermutation',
      lambda p: raw('InvertPermutation', p),
      arg(v.rng.permutation(10).astype(np.int32)),
    ),
    spec(
      'ConcatOffset',
      lambda a, b: tuple(raw('ConcatOffset', 1, [a, b])),
      arg(np.array([10, 3], np.int32)),
      arg(np.array([10, 4], np.int32)),
      note='shapes as arguments (constants would be folded): offsets of a concat on axis 1',
    ),
    spec('Shape', lambda a: raw('Shape', a), arg(x2)),
    spec('ShapeN', lambda a, b: tuple(raw('ShapeN', [a, b])), arg(x2), arg(x3)),
    spec('Size', lambda a: raw('Size', a), arg(x2)),
    spec('Rank', lambda a: raw('Rank', a), arg(x2)),
    # Value-dependent result shapes (unknown when traced): no out_shardings for them.
    spec('BroadcastArgs', lambda: raw('BroadcastArgs', [10, 1], [3]), shard_outputs=False),
    spec(
      'BroadcastGradientArgs',
      _broadcast_gradient,
      arg(v.uniform(BINARY_SHAPE)),
      note='as gradients use it: reduction axes of a broadcast, then a reshape',
    ),
  ]
  out.append(
    spec(
      'StridedSliceGrad',
      lambda dy: raw('StridedSliceGrad', [10, 7], [1, 0], [8, 7], [2, 1], dy),
      arg(v.uniform((4, 7))),
      note='not a registered op type: swept because slicing gradients emit it',
    )
  )
  out.append(
    spec(
      'StridedSliceGrad/shrink_new_axis',
      lambda dy: raw(
        'StridedSliceGrad',
        list(UNARY_SHAPE),
        [0, 2, 0, -1],
        [0, 3, 0, 0],
        [1, 1, 1, -1],
        dy,
        begin_mask=13,
        end_mask=13,
        new_axis_mask=4,
        shrink_axis_mask=2,
      ),
      arg(v.uniform((7, 1, 3))),
    )
  )
  # Segment reductions, in the order their values were always drawn (one seeded stream).
  segments = in_draw_order(entries, 'segment', SEGMENT_DRAW_ORDER)
  for e in segments:
    op = e.op_type
    # A product of values near 1 stays finite.
    near_one = e.sweep_params.get('near_one')
    data = v.uniform(BINARY_SHAPE, 0.7, 1.3) if near_one else v.uniform(BINARY_SHAPE)
    out.append(spec(op, lambda d, i, op=op: raw(op, d, i, 6), arg(data), arg(ids)))
  out.append(
    spec(
      'UnsortedSegmentSum/ids_2d',
      lambda d, i: raw('UnsortedSegmentSum', d, i, 4),
      arg(v.uniform((10, 3, 2))),
      arg(v.ints((10, 3), -1, 4)),
    )
  )
  out += _band_parts()
  return out


def _band_parts() -> List[OpSpec]:
  """MatrixBandPart: a band, the lower triangle and the whole matrix, on uneven matrices
  (its own value stream: the draws above keep their values)."""
  x = Values('MatrixBandPart').uniform((3, 10, 7))
  return [
    spec('MatrixBandPart', lambda a: raw('MatrixBandPart', a, 2, 1), arg(x)),
    spec('MatrixBandPart/lower', lambda a: raw('MatrixBandPart', a, -1, 0), arg(x)),
    spec('MatrixBandPart/all', lambda a: raw('MatrixBandPart', a, -1, -1), arg(x)),
  ]
