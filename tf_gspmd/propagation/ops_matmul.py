"""Matrix products: MatMul, BatchMatMul (with broadcast batch dims) and Einsum.

Batch and free dims pass through; contracted dims are reduction factors, so a
sharded contracting dim gives partial results that the partitioner sums (the
propagated result sharding is that of the output dims alone).
"""

from __future__ import annotations

from tf_gspmd.propagation.registry import attr, declare, op_types_of, register
from tf_gspmd.propagation.rule import NEED_REPLICATION, REDUCTION
from tf_gspmd.propagation.rule_builders import Namer, make_rule


def matmul(node, ctx):
  a_shape, b_shape = ctx.shape(node.inputs[0]), ctx.shape(node.inputs[1])
  a = ('k', 'i') if attr(node, 'transpose_a', False) else ('i', 'k')
  b = ('j', 'k') if attr(node, 'transpose_b', False) else ('k', 'j')
  return make_rule(
    [a, b], [('i', 'j')], [a_shape, b_shape], [ctx.out_shape(node)], kinds={'k': REDUCTION}
  )


def batch_matmul(node, ctx):
  """x[..., m, k] @ y[..., k, n]; batch dims broadcast like numpy (right-aligned)."""
  x_shape, y_shape = ctx.shape(node.inputs[0]), ctx.shape(node.inputs[1])
  out_shape = ctx.out_shape(node)
  nb = len(out_shape) - 2
  namer = Namer(['i', 'j', 'k'])
  batch = tuple(namer.take(nb))
  adj_x = attr(node, 'adj_x', False)
  adj_y = attr(node, 'adj_y', False)
  operands, bcast = [], []
  for idx, (shape, mat) in enumerate(
    ((x_shape, ('k', 'i') if adj_x else ('i', 'k')), (y_shape, ('j', 'k') if adj_y else ('k', 'j')))
  ):
    own = len(shape) - 2
    dims = []
    for d in range(own):
      out_d = nb - own + d
      dims.append(None if shape[d] == 1 and out_shape[out_d] != 1 else batch[out_d])
    if own < nb or None in dims:
      bcast.append(idx)
    operands.append(tuple(dims) + mat)
  return make_rule(
    operands,
    [batch + ('i', 'j')],
    [x_shape, y_shape],
    [out_shape],
    kinds={'k': REDUCTION},
    broadcast_operands=bcast,
  )


def einsum(node, ctx):
  """Einsum: each letter is a factor; letters missing from the output are reductions."""
  equation = attr(node, 'equation')
  lhs, _, out = equation.replace(' ', '').partition('->')
  specs = lhs.split(',')
  shapes = [ctx.shape(t) for t in node.inputs]
  out_shape = ctx.out_shape(node)
  if len(specs) != len(shapes):
    raise ValueError(
      f'Einsum {node.name}: equation {equation!r} has {len(specs)} operands, '
      f'the node has {len(shapes)}.'
    )
  letters = {c for c in equation if c.isalpha()}
  namer = Namer(letters)
  out_ell = len(out_shape) - len(out.replace('...', '')) if '...' in out else 0
  ellipsis = tuple(namer.take(out_ell))
  kinds, operands, bcast = {}, [], []
  for idx, (spec, shape) in enumerate(zip(specs, shapes)):
    dims = []
    if '...' in spec:
      head, tail = spec.split('...')
      n = len(shape) - len(head) - len(tail)
      dims += list(head)
      for d in range(n):
        out_d = out_ell - n + d
        size = shape[len(head) + d]
        dims.append(None if size == 1 or out_d < 0 else ellipsis[out_d])
        if dims[-1] is None:
          bcast.append(idx)
      dims += list(tail)
    else:
      dims = list(spec)
    for f in dims:
      if f is not None and dims.count(f) > 1:
        kinds[f] = NEED_REPLICATION  # a diagonal: its entries are not independent
    operands.append(tuple(dims))
  out_dims = []
  if '...' in out:
    head, tail = out.split('...')
    out_dims = list(head) + list(ellipsis) + list(tail)
  else:
    out_dims = list(out)
  for dims in operands:
    for f in dims:
      if f is not None and f not in out_dims and kinds.get(f) != NEED_REPLICATION:
        kinds[f] = REDUCTION
  return make_rule(
    operands,
    [tuple(out_dims)],
    shapes,
    [out_shape],
    kinds=kinds,
    broadcast_operands=sorted(set(bcast)),
  )


def _matmul_example(b):
  x = b.placeholder('x', (8, 16))
  w = b.placeholder('w', (16, 32))
  b.op('MatMul', [x, w], [(8, 32)], name='y', attrs={'transpose_a': False, 'transpose_b': False})
  return 'y'


def _batch_matmul_example(op):
  def build(b):
    x = b.placeholder('x', (2, 4, 8, 16))
    w = b.placeholder('w', (4, 16, 32))
    b.op(op, [x, w], [(2, 4, 8, 32)], name='y', attrs={'adj_x': False, 'adj_y': False})
    return 'y'

  return build


def _einsum_example(b):
  x = b.placeholder('x', (2, 10, 16))
  w = b.placeholder('w', (16, 4, 8))
  b.op('Einsum', [x, w], [(2, 10, 4, 8)], name='y', attrs={'equation': 'abc,cde->abde', 'N': 2})
  return 'y'


register('MatMul', 'matmul', matmul, _matmul_example)
register(
  ['BatchMatMul', 'BatchMatMulV2', 'BatchMatMulV3'],
  'matmul',
  batch_matmul,
  _batch_matmul_example('BatchMatMulV2'),
)
register('Einsum', 'matmul', einsum, _einsum_example)
# A contraction dim and a free dim proposed one axis (the activation's features and the
# weight's columns, both over 'model'): keeping the cheaper one is decided by bytes.
declare(op_types_of('matmul'), settles_by_bytes=True)

# --- sweep programs (testing/programs/nn.py) -----------------------------------
declare(op_types_of('matmul'), sweep='matmul')
