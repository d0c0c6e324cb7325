"""Manual regions: their entry and exit ops and the collectives written inside them.

`XlaSpmdFullToShardShape` / `XlaSpmdShardToFullShape` are region boundaries:
their layouts come from the op (`manual.boundary`), so their rules tie nothing
across them (the operand is read whole by the op, the result is seeded by
propagation). The collectives run per partition over manual mesh axes (read
from their group assignment); over the region's automatic axes, an all-reduce
or a permute acts on any layout (pass-through dims), while the dims an
all-to-all, reduce-scatter or all-gather cuts or joins must be whole.
`XlaCustomCall` is registered for tg.shard_map's own targets (`tf_gspmd.*`);
any other target has no rule and is refused when partitioned.
"""

from __future__ import annotations

from tf_gspmd.propagation.manual import custom_config, custom_target
from tf_gspmd.propagation.registry import RuleError, attr, declare, register
from tf_gspmd.propagation.rule import NEED_REPLICATION
from tf_gspmd.propagation.rule_builders import free_results, make_rule
from tf_gspmd.shard_map import ALL_GATHER_TARGET, AXIS_INDEX_TARGET

FAMILY = 'manual'
# XLA's reduce_op attr -> the reduction ('mean': a sum divided by the group size).
_REDUCE_OPS = {'Add': 'sum', 'Mul': 'prod', 'Min': 'min', 'Max': 'max', 'Mean': 'mean'}
_LETTERS = 'abcdefgh'


def _boundary(node, ctx):
  """A dim the manual axes do not split (same size on both sides) passes through: the
  region's automatic axes meet the full tensor's there (propagation never lets a manual
  axis into the region); a split dim ties nothing."""
  shape, out = ctx.shape(node.inputs[0]), ctx.out_shape(node)
  if shape is None or out is None or len(shape) != len(out):
    return free_results(node, ctx)
  ins = tuple(
    _LETTERS[d] if a == b else f'{_LETTERS[d]}_full' for d, (a, b) in enumerate(zip(shape, out))
  )
  outs = tuple(
    _LETTERS[d] if a == b else f'{_LETTERS[d]}_shard' for d, (a, b) in enumerate(zip(shape, out))
  )
  if node.op == 'XlaSpmdShardToFullShape':
    ins, outs = (
      tuple(e.replace('_full', '_shard') for e in ins),
      tuple(e.replace('_shard', '_full') for e in outs),
    )
  return make_rule([ins], [outs], [shape], [out])


def _per_element(node, ctx):
  """All-reduce, permute: every dim passes through (the group is over manual axes)."""
  shape = ctx.shape(node.inputs[0])
  if shape is None:
    raise RuleError(f'{node.op} {node.name}: operand of unknown rank')
  dims = tuple(_LETTERS[d] for d in range(len(shape)))
  aux = [None] * (len(node.inputs) - 1)
  return make_rule(
    [dims] + aux,
    [dims],
    [shape] + [ctx.shape(t) for t in node.inputs[1:]],
    [ctx.out_shape(node)],
  )


def _whole_dims(node, ctx, whole):
  """Dims in `whole` change size and must be whole; the others pass through."""
  shape = ctx.shape(node.inputs[0])
  out = ctx.out_shape(node)
  if shape is None or out is None:
    raise RuleError(f'{node.op} {node.name}: operand or result of unknown rank')
  ins = tuple(f'{_LETTERS[d]}_in' if d in whole else _LETTERS[d] for d in range(len(shape)))
  outs = tuple(f'{_LETTERS[d]}_out' if d in whole else _LETTERS[d] for d in range(len(out)))
  kinds = {f: NEED_REPLICATION for f in ins + outs if f.endswith(('_in', '_out'))}
  aux = [None] * (len(node.inputs) - 1)
  return make_rule(
    [ins] + aux, [outs], [shape] + [ctx.shape(t) for t in node.inputs[1:]], [out], kinds
  )


def _all_to_all(node, ctx):
  whole = {int(attr(node, 'split_dimension', 0)), int(attr(node, 'concat_dimension', 0))}
  return _whole_dims(node, ctx, whole)


def _reduce_scatter(node, ctx):
  dim = ctx.const_ints(node.inputs[2])
  if not dim:
    raise RuleError(f'{node.op} {node.name}: scatter_dimension is not a constant')
  return _whole_dims(node, ctx, {dim[0]})


def _custom_call(node, ctx):
  target = custom_target(node)
  if target == ALL_GATHER_TARGET:
    return _whole_dims(node, ctx, {int(custom_config(node)['dim'])})
  if target == AXIS_INDEX_TARGET:
    return free_results(node, ctx)
  raise RuleError(
    f'XlaCustomCall {node.name}: custom call target {target!r} is not one tf_gspmd can run'
  )


def _example(op, n_aux=1, attrs=None, out=(8, 4)):
  def build(b):
    import numpy as np
    import tensorflow as tf

    x = b.placeholder('x', (8, 4))
    aux = [b.const(np.array([[0, 1]], np.int32), name=f'groups{i}') for i in range(n_aux)]
    if op == 'XlaReduceScatter':
      aux = [aux[0], b.const(np.int32(0), name='dim')]
    b.op(op, [x] + aux, [out], name='y', attrs=attrs or {}, dtypes=[tf.float32])
    return 'y'

  return build


def _boundary_example(op):
  def build(b):
    full, shard = (8, 4), (2, 4)
    x = b.placeholder('x', full if op == 'XlaSpmdFullToShardShape' else shard)
    attrs = {'manual_sharding': b'', 'dim': -1}
    b.op(op, [x], [shard if op == 'XlaSpmdFullToShardShape' else full], name='y', attrs=attrs)
    return 'y'

  return build


def _custom_example(b):
  import json

  x = b.placeholder('x', (8, 4))
  config = json.dumps({'axes': ['x'], 'dim': 0, 'region': ['x']})
  attrs = {'target_name': ALL_GATHER_TARGET, 'backend_config': config}
  b.op('XlaCustomCall', [x], [(16, 4)], name='y', attrs=attrs)
  return 'y'


register('XlaSpmdFullToShardShape', FAMILY, _boundary, _boundary_example('XlaSpmdFullToShardShape'))
register('XlaSpmdShardToFullShape', FAMILY, _boundary, _boundary_example('XlaSpmdShardToFullShape'))
register('CrossReplicaSum', FAMILY, _per_element, _example('CrossReplicaSum'))
register('CollectivePermute', FAMILY, _per_element, _example('CollectivePermute'))
register(
  'XlaAllReduce',
  FAMILY,
  _per_element,
  _example('XlaAllReduce', attrs={'reduce_op': 'Add', 'mode': 'CrossReplica'}),
)
register(
  'AllToAll',
  FAMILY,
  _all_to_all,
  _example(
    'AllToAll', attrs={'split_dimension': 0, 'concat_dimension': 1, 'split_count': 2}, out=(4, 8)
  ),
)
register(
  'XlaReduceScatter',
  FAMILY,
  _reduce_scatter,
  _example('XlaReduceScatter', attrs={'reduce_op': 'Add'}, out=(4, 4)),
)
register('XlaCustomCall', FAMILY, _custom_call, _custom_example)

# --- properties ---------------------------------------------------------------------
declare('XlaSpmdFullToShardShape', local='manual_enter')
declare('XlaSpmdShardToFullShape', local='manual_exit')
# `replicates`: every member of the group holds the result (over the group's axes);
# `moves`: members hold one another's data (no longer replicated over the group's axes).
_COLLECTIVE = 'manual_collective'
declare(
  'CrossReplicaSum',
  local=_COLLECTIVE,
  local_params={'kind': 'all_reduce', 'reduction': 'sum', 'replicates': True},
)
declare(
  'XlaAllReduce',
  local=_COLLECTIVE,
  local_params={
    'kind': 'all_reduce',
    'reduce_attr': 'reduce_op',
    'reductions': _REDUCE_OPS,
    'replicates': True,
  },
)
declare('CollectivePermute', local=_COLLECTIVE, local_params={'kind': 'permute', 'moves': True})
declare('AllToAll', local=_COLLECTIVE, local_params={'kind': 'all_to_all', 'moves': True})
declare(
  'XlaReduceScatter',
  local=_COLLECTIVE,
  local_params={
    'kind': 'reduce_scatter',
    'reduce_attr': 'reduce_op',
    'reductions': _REDUCE_OPS,
    'moves': True,
  },
)
declare('XlaCustomCall', local=_COLLECTIVE, local_params={'kind': 'custom_call'})
declare(
  [
    'XlaSpmdFullToShardShape',
    'XlaSpmdShardToFullShape',
    'CrossReplicaSum',
    'XlaAllReduce',
    'CollectivePermute',
    'AllToAll',
    'XlaReduceScatter',
    'XlaCustomCall',
  ],
  unswept='a manual-region op: runs only between region boundaries, on per-partition values '
  '(tests/test_manual.py runs each inside regions, against its automatic twin)',
)
