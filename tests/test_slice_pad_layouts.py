"""Slice, StridedSlice and Pad along split dims, in the layouts of their rules.

Each case runs partitioned (op sweep: 4 devices '1d', 2x4 '2d') against the
unpartitioned op (values exact), with its collectives counted exactly:
- a sliced range of a split dim stays split, rows shifted from neighbours
  (permutes only; strided and multi-hop too), never gathered;
- an indexed (shrunk) row of a split dim is picked and summed (one all-reduce
  of one row) when the dtype can be summed, else the dim is gathered;
- a constant pad shifts rows by halo exchange; a pad value known only at run
  time fills the tail of shards that keep their size (no collective) and
  otherwise needs the dim whole; MirrorPad pads whole dims.
"""

import pytest
import tensorflow as tf

from tf_gspmd.sharding import P
from tf_gspmd.testing import op_sweep
from tf_gspmd.testing.op_builders import Values, arg, raw, spec


def _specs():
  v = Values('slice_pad_layouts')
  x = v.uniform((16, 5))
  y = v.uniform((10, 5))
  flags = v.bools((10, 3))

  # A pad value known only at run time (float arithmetic is not folded): the largest value,
  # itself one all-reduce (max) over the split rows.
  def largest(a):
    return tf.reduce_max(a)

  return [
    spec('Slice/middle', lambda a: raw('Slice', a, [5, 0], [6, 5]), arg(x)),
    spec('Slice/far', lambda a: raw('Slice', a, [11, 0], [4, 5]), arg(x)),
    spec('StridedSlice/step3', lambda a: a[1:14:3], arg(x)),
    spec('StridedSlice/row', lambda a: a[9], arg(x)),
    spec('StridedSlice/bool_row', lambda a: a[7], arg(flags)),
    spec('PadV2/runtime_tail', lambda a: raw('PadV2', a, [[0, 2], [0, 0]], largest(a)), arg(y)),
    spec('PadV2/runtime_front', lambda a: raw('PadV2', a, [[2, 0], [0, 0]], largest(a)), arg(x)),
    spec('PadV2/static_front', lambda a: raw('PadV2', a, [[2, 1], [0, 0]], -1.5), arg(x)),
    spec('MirrorPad/rows', lambda a: raw('MirrorPad', a, [[1, 2], [0, 0]], mode='REFLECT'), arg(x)),
  ]


ROWS = P('x', None)
BOTH = P(('a', 'b'), None)


@pytest.mark.parametrize(
  'name,mesh,in_specs,expected',
  [
    # 6 rows from row 5 of 16 over 4 (4 per shard, 2 kept): rows from the right neighbour.
    ('Slice/middle', '1d', (ROWS,), {'permute': 1}),
    ('Slice/far', '1d', (ROWS,), {'permute': 2}),  # rows 11..14: three shards away
    ('StridedSlice/step3', '1d', (ROWS,), {'permute': 1}),  # rows 1, 4, .., 13: 2 per shard
    ('StridedSlice/step3', '2d', (BOTH,), {'permute': 2}),
    ('StridedSlice/row', '1d', (ROWS,), {'all_reduce': 1}),  # one row, not 16
    ('StridedSlice/bool_row', '1d', (ROWS,), {'all_gather': 1}),  # bools are not summed
    # 12 rows of 10 over 4: shards keep 3 rows, the tail masked (the all-reduce: the value).
    ('PadV2/runtime_tail', '1d', (ROWS,), {'all_reduce': 1}),
    ('PadV2/runtime_front', '1d', (ROWS,), {'all_reduce': 1, 'all_gather': 1}),
    ('PadV2/static_front', '1d', (ROWS,), {'permute': 2}),  # halos from both sides
    ('PadV2/static_front', '2d', (BOTH,), {'permute': 3}),
    ('MirrorPad/rows', '1d', (ROWS,), {'all_gather': 1}),
  ],
)
def test_slice_and_pad_along_split_dims(name, mesh, in_specs, expected):
  previous = op_sweep.fast_first_runs()
  try:
    specs = _specs()
    in_specs = in_specs + (None,) * (len(next(s for s in specs if s.name == name).operands) - 1)
    result = op_sweep.Sweep(specs=specs).run(op_sweep.Case(name, mesh, in_specs))
  finally:
    op_sweep.restore_optimizer(previous)
  assert result.status == 'pass', result.message
  assert result.how == 'hand-written'
  assert result.max_error == 0.0
  assert result.collectives == expected, result.collectives
