"""Reductions, and ops that normalize along a dim (softmax, cross-entropy, cumsum, top-k).

A reduced dim is a `reduction` factor when partial results combine with one
all-reduce (sum, mean, max, min, prod, all, any); a dim the op must see whole
(softmax's class dim, an arg-max or cumulative-sum axis) is `need_replication`.
"""

from __future__ import annotations

from tf_gspmd.propagation.registry import RuleError, attr, declare, op_types_of, register
from tf_gspmd.propagation.rule import NEED_REPLICATION, REDUCTION
from tf_gspmd.propagation.rule_builders import Namer, make_rule, normalize_axis

SUM_LIKE = ['Sum', 'Mean', 'Max', 'Min', 'Prod', 'All', 'Any', 'EuclideanNorm']


def _axes(node, ctx, rank):
  axes = ctx.const_ints(node.inputs[1])
  if axes is None:
    raise RuleError(f'{node.op} {node.name}: reduction axes {node.inputs[1]} are not a constant.')
  return sorted({normalize_axis(a, rank, f'{node.op} {node.name}') for a in axes})


def reduce_rule(node, ctx, kind=REDUCTION):
  shape = ctx.shape(node.inputs[0])
  out_shape = ctx.out_shape(node)
  axes = _axes(node, ctx, len(shape))
  keep = attr(node, 'keep_dims', False)
  dims = tuple(Namer().take(len(shape)))
  out = []
  for d, f in enumerate(dims):
    if d not in axes:
      out.append(f)
    elif keep:
      out.append(None)
  return make_rule(
    [dims, None], [tuple(out)], [shape, None], [out_shape], kinds={dims[a]: kind for a in axes}
  )


def arg_reduce(node, ctx):
  """ArgMax/ArgMin: the searched dim must be whole."""
  shape = ctx.shape(node.inputs[0])
  axis = ctx.const_ints(node.inputs[1])
  if axis is None:
    raise RuleError(f'{node.op} {node.name}: dimension {node.inputs[1]} is not a constant.')
  axis = normalize_axis(axis[0], len(shape), f'{node.op} {node.name}')
  dims = tuple(Namer().take(len(shape)))
  out = tuple(f for d, f in enumerate(dims) if d != axis)
  return make_rule(
    [dims, None], [out], [shape, None], [ctx.out_shape(node)], kinds={dims[axis]: NEED_REPLICATION}
  )


def last_dim_whole(node, ctx):
  """Softmax/LogSoftmax: the last dim must be whole."""
  shape = ctx.shape(node.inputs[0])
  dims = tuple(Namer().take(len(shape)))
  return make_rule(
    [dims], [dims], [shape], [ctx.out_shape(node)], kinds={dims[-1]: NEED_REPLICATION}
  )


def sparse_xent(node, ctx):
  """SparseSoftmaxCrossEntropyWithLogits(features[b,c], labels[b]) -> loss[b], backprop[b,c]."""
  f_shape, l_shape = ctx.shape(node.inputs[0]), ctx.shape(node.inputs[1])
  return make_rule(
    [('i', 'j'), ('i',)],
    [('i',), ('i', 'j')],
    [f_shape, l_shape],
    [ctx.out_shape(node, 0), ctx.out_shape(node, 1)],
    kinds={'j': NEED_REPLICATION},
  )


def dense_xent(node, ctx):
  """SoftmaxCrossEntropyWithLogits(features[b,c], labels[b,c]) -> loss[b], backprop[b,c]."""
  f_shape, l_shape = ctx.shape(node.inputs[0]), ctx.shape(node.inputs[1])
  return make_rule(
    [('i', 'j'), ('i', 'j')],
    [('i',), ('i', 'j')],
    [f_shape, l_shape],
    [ctx.out_shape(node, 0), ctx.out_shape(node, 1)],
    kinds={'j': NEED_REPLICATION},
  )


def bias_add_grad(node, ctx):
  """BiasAddGrad: sums every dim but the channel dim."""
  shape = ctx.shape(node.inputs[0])
  dims = tuple(Namer().take(len(shape)))
  channel = 1 if attr(node, 'data_format', 'NHWC').startswith('NC') else len(shape) - 1
  return make_rule(
    [dims],
    [(dims[channel],)],
    [shape],
    [ctx.out_shape(node)],
    kinds={f: REDUCTION for d, f in enumerate(dims) if d != channel},
  )


def l2_loss(node, ctx):
  shape = ctx.shape(node.inputs[0])
  dims = tuple(Namer().take(len(shape)))
  return make_rule([dims], [()], [shape], [()], kinds={f: REDUCTION for f in dims})


def scan_rule(node, ctx):
  """Cumsum/Cumprod/CumulativeLogsumexp(x, axis): the scanned dim must be whole."""
  shape = ctx.shape(node.inputs[0])
  axis = ctx.const_ints(node.inputs[1])
  if axis is None:
    raise RuleError(f'{node.op} {node.name}: axis {node.inputs[1]} is not a constant.')
  axis = normalize_axis(axis[0], len(shape), f'{node.op} {node.name}')
  dims = tuple(Namer().take(len(shape)))
  return make_rule(
    [dims, None], [dims], [shape, None], [ctx.out_shape(node)], kinds={dims[axis]: NEED_REPLICATION}
  )


def top_k(node, ctx):
  """TopKV2(x, k) -> values, indices: the last dim must be whole."""
  shape = ctx.shape(node.inputs[0])
  namer = Namer()
  dims = tuple(namer.take(len(shape)))
  k = namer.fresh()
  out = dims[:-1] + (k,)
  return make_rule(
    [dims, None],
    [out, out],
    [shape, None],
    [ctx.out_shape(node, 0), ctx.out_shape(node, 1)],
    kinds={dims[-1]: NEED_REPLICATION, k: NEED_REPLICATION},
  )


def _reduce_example(op):
  def build(b):
    x = b.placeholder('x', (4, 8, 16))
    axes = b.const([1], name='axes')
    b.op(op, [x, axes], [(4, 16)], name='y', attrs={'keep_dims': False})
    return 'y'

  return build


def _arg_example(op):
  def build(b):
    x = b.placeholder('x', (4, 8))
    axis = b.const(1, name='axis')
    b.op(op, [x, axis], [(4,)], name='y', dtypes=[__import__('tensorflow').int64])
    return 'y'

  return build


def _softmax_example(op):
  def build(b):
    x = b.placeholder('x', (4, 8))
    b.op(op, [x], [(4, 8)], name='y')
    return 'y'

  return build


def _xent_example(op, dense):
  def build(b):
    import tensorflow as tf

    x = b.placeholder('x', (4, 8))
    lbl = b.placeholder(
      'labels', (4, 8) if dense else (4,), dtype=tf.float32 if dense else tf.int32
    )
    b.op(op, [x, lbl], [(4,), (4, 8)], name='y')
    return 'y'

  return build


def _bias_add_grad_example(b):
  x = b.placeholder('x', (2, 6, 6, 8))
  b.op('BiasAddGrad', [x], [(8,)], name='y', attrs={'data_format': 'NHWC'})
  return 'y'


def _l2_example(b):
  x = b.placeholder('x', (4, 8))
  b.op('L2Loss', [x], [()], name='y')
  return 'y'


def _scan_example(op):
  def build(b):
    x = b.placeholder('x', (4, 8))
    axis = b.const(1, name='axis')
    b.op(op, [x, axis], [(4, 8)], name='y')
    return 'y'

  return build


def _top_k_example(b):
  import tensorflow as tf

  x = b.placeholder('x', (4, 8))
  k = b.const(3, name='k')
  b.op('TopKV2', [x, k], [(4, 3), (4, 3)], name='y', dtypes=[tf.float32, tf.int32])
  return 'y'


for _op in SUM_LIKE:
  register(_op, 'reduction', reduce_rule, _reduce_example(_op))
register(['ArgMax', 'ArgMin'], 'reduction', arg_reduce, _arg_example('ArgMax'))
register(['Softmax', 'LogSoftmax'], 'reduction', last_dim_whole, _softmax_example('Softmax'))
register(
  'SparseSoftmaxCrossEntropyWithLogits',
  'reduction',
  sparse_xent,
  _xent_example('SparseSoftmaxCrossEntropyWithLogits', False),
)
register(
  'SoftmaxCrossEntropyWithLogits',
  'reduction',
  dense_xent,
  _xent_example('SoftmaxCrossEntropyWithLogits', True),
)
register('BiasAddGrad', 'reduction', bias_add_grad, _bias_add_grad_example)
register('L2Loss', 'reduction', l2_loss, _l2_example)
register(
  ['Cumsum', 'Cumprod', 'CumulativeLogsumexp'], 'reduction', scan_rule, _scan_example('Cumsum')
)
register('TopKV2', 'reduction', top_k, _top_k_example)


# --- properties ---------------------------------------------------------------------
declare('Max', reduction='max')
declare('Min', reduction='min')
declare('Prod', reduction='prod')
declare('Mean', reduction='mean')
declare('Sum', linear='sum')
# Partial results no collective can combine: reduced dims stay whole.
declare(['All', 'Any', 'ArgMax', 'ArgMin', 'EuclideanNorm'], combinable=False)
declare('BiasAddGrad', local='bias_add_grad')

# --- sweep programs (testing/programs/reductions.py) -----------------------------------
# `form`: the program's loop sweeping the op; `order`: the order its values are drawn in
# (one seeded stream); `near_one`: values near 1, so products stay finite.
declare(op_types_of('reduction'), sweep='reductions')
for _form, _ops in (
  ('reduce', ['Sum', 'Max', 'Min', 'Mean', 'EuclideanNorm', 'Prod']),
  ('reduce_bool', ['All', 'Any']),
  ('arg_reduce', ['ArgMax', 'ArgMin']),
  ('scan', ['Cumsum', 'Cumprod', 'CumulativeLogsumexp']),
):
  for _op in _ops:
    _params = {'form': _form, 'near_one': _op in ('Prod', 'Cumprod')}
    declare(_op, sweep_params=_params)
