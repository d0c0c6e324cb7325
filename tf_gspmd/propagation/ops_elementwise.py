"""Elementwise ops, with numpy broadcasting; identities; BiasAdd and AddN.

Result dims get one factor each; an operand dim shares the factor of the
result dim it lines up with (right-aligned), or `-` when it is broadcast
(size 1 against a larger result dim, or missing). Such an operand is marked
broadcast: it may take the result's sharding early, but shards the result only
at the last propagation level.
"""

from __future__ import annotations

from tf_gspmd.propagation.registry import RuleError, attr, declare, register
from tf_gspmd.propagation.rule_builders import Namer, make_rule

UNARY = [
  'Abs',
  'Acos',
  'Acosh',
  'Angle',
  'Asin',
  'Asinh',
  'Atan',
  'Atanh',
  'Ceil',
  'CheckNumerics',
  'ComplexAbs',
  'Conj',
  'Cos',
  'Cosh',
  'Digamma',
  'Elu',
  'EnsureShape',
  'Erf',
  'Erfc',
  'Erfinv',
  'Exp',
  'Expm1',
  'Floor',
  'Identity',
  'Imag',
  'Inv',
  'Invert',
  'IsFinite',
  'IsInf',
  'IsNan',
  'LeakyRelu',
  'Lgamma',
  'Log',
  'Log1p',
  'LogicalNot',
  'Ndtri',
  'Neg',
  'OnesLike',
  'PreventGradient',
  'Real',
  'Reciprocal',
  'Relu',
  'Relu6',
  'Rint',
  'Round',
  'Rsqrt',
  'Selu',
  'Sigmoid',
  'Sign',
  'Sin',
  'Sinh',
  'Snapshot',
  'Softplus',
  'Softsign',
  'Sqrt',
  'Square',
  'StopGradient',
  'Tan',
  'Tanh',
  'XlaSharding',
  'ZerosLike',
  'Cast',
  'PopulationCount',
]

BINARY = [
  'Add',
  'AddV2',
  'ApproximateEqual',
  'Atan2',
  'BitwiseAnd',
  'BitwiseOr',
  'BitwiseXor',
  'Complex',
  'Div',
  'DivNoNan',
  'EluGrad',
  'Equal',
  'FloorDiv',
  'FloorMod',
  'Greater',
  'GreaterEqual',
  'Igamma',
  'Igammac',
  'InvGrad',
  'LeakyReluGrad',
  'LeftShift',
  'Less',
  'LessEqual',
  'LogicalAnd',
  'LogicalOr',
  'Maximum',
  'Minimum',
  'Mod',
  'Mul',
  'MulNoNan',
  'NextAfter',
  'NotEqual',
  'Polygamma',
  'Pow',
  'RealDiv',
  'ReciprocalGrad',
  'Relu6Grad',
  'ReluGrad',
  'RightShift',
  'RsqrtGrad',
  'SeluGrad',
  'SigmoidGrad',
  'SoftplusGrad',
  'SoftsignGrad',
  'SqrtGrad',
  'SquaredDifference',
  'Sub',
  'TanhGrad',
  'TruncateDiv',
  'TruncateMod',
  'Xdivy',
  'Xlog1py',
  'Xlogy',
  'Zeta',
]

TERNARY = ['Select', 'SelectV2', 'ClipByValue', 'Betainc']


def broadcasting_rule(node, ctx, data_operands=None):
  """Numpy-broadcasting elementwise rule over `data_operands` (default: all inputs)."""
  data = range(len(node.inputs)) if data_operands is None else data_operands
  out_shape = ctx.out_shape(node)
  if out_shape is None:
    raise RuleError(f'{node.op} {node.name}: result rank is unknown.')
  namer = Namer()
  res_dims = tuple(namer.take(len(out_shape)))
  operands, shapes, bcast = [], [], []
  for i, t in enumerate(node.inputs):
    shape = ctx.shape(t)
    shapes.append(shape)
    if i not in data or shape is None:
      operands.append(None)
      continue
    offset = len(out_shape) - len(shape)
    if offset < 0:
      raise ValueError(
        f'{node.op} {node.name}: operand {t} of shape {shape} has a higher rank than the '
        f'result {out_shape}.'
      )
    dims = []
    for d, size in enumerate(shape):
      rsize = out_shape[offset + d]
      dims.append(None if size == 1 and rsize != 1 else res_dims[offset + d])
    if shape and (offset or None in dims):
      bcast.append(i)
    operands.append(tuple(dims))
  results = [res_dims if ctx.shape(o.name) == out_shape else None for o in node.outputs]
  return make_rule(
    operands, results, shapes, [ctx.shape(o.name) for o in node.outputs], broadcast_operands=bcast
  )


def identity_n(node, ctx):
  """IdentityN: output k is input k."""
  namer = Namer()
  dims = []
  for t in node.inputs:
    shape = ctx.shape(t)
    dims.append(None if shape is None else tuple(namer.take(len(shape))))
  return make_rule(
    dims, dims, [ctx.shape(t) for t in node.inputs], [ctx.shape(o.name) for o in node.outputs]
  )


def bias_add(node, ctx):
  """BiasAdd: the bias lines up with the channel dim (last, or 1 for NCHW)."""
  shape = ctx.shape(node.inputs[0])
  namer = Namer()
  dims = tuple(namer.take(len(shape)))
  channel = 1 if attr(node, 'data_format', 'NHWC').startswith('NC') else len(shape) - 1
  return make_rule(
    [dims, (dims[channel],)],
    [dims],
    [shape, ctx.shape(node.inputs[1])],
    [ctx.out_shape(node)],
    broadcast_operands=[1] if len(shape) > 1 else [],
  )


def _unary_example(op):
  def build(b):
    x = b.placeholder('x', (4, 8))
    b.op(op, [x], [(4, 8)], name='y')
    return 'y'

  return build


def _binary_example(op):
  def build(b):
    x = b.placeholder('x', (4, 8))
    z = b.placeholder('z', (8,))
    b.op(op, [x, z], [(4, 8)], name='y')
    return 'y'

  return build


def _ternary_example(op):
  def build(b):
    c = b.placeholder('c', (4, 1))
    x = b.placeholder('x', (4, 8))
    z = b.placeholder('z', ())
    b.op(op, [c, x, z], [(4, 8)], name='y')
    return 'y'

  return build


def _addn_example(b):
  xs = [b.placeholder(f'x{i}', (4, 8)) for i in range(3)]
  b.op('AddN', xs, [(4, 8)], name='y')
  return 'y'


def _identity_n_example(b):
  x = b.placeholder('x', (4, 8))
  z = b.placeholder('z', (3,))
  b.op('IdentityN', [x, z], [(4, 8), (3,)], name='y')
  return 'y'


def _bias_add_example(op):
  def build(b):
    x = b.placeholder('x', (2, 6, 6, 8))
    z = b.placeholder('z', (8,))
    b.op(op, [x, z], [(2, 6, 6, 8)], name='y', attrs={'data_format': 'NHWC'})
    return 'y'

  return build


def _bitcast(node, ctx):
  """Bitcast: same shape when the element sizes match; else the last dim is added or dropped."""
  in_shape, out_shape = ctx.shape(node.inputs[0]), ctx.out_shape(node)
  namer = Namer()
  common = min(len(in_shape), len(out_shape))
  shared = namer.take(common)
  if len(in_shape) == len(out_shape):
    return make_rule([tuple(shared)], [tuple(shared)], [in_shape], [out_shape])
  extra = namer.fresh()
  ins = tuple(shared) + ((extra,) if len(in_shape) > common else ())
  outs = tuple(shared) + ((extra,) if len(out_shape) > common else ())
  return make_rule([ins], [outs], [in_shape], [out_shape], kinds={extra: 'need_replication'})


def _bitcast_example(b):
  x = b.placeholder('x', (4, 2))
  b.op('Bitcast', [x], [(4,)], name='y')
  return 'y'


for _op in UNARY:
  register(_op, 'elementwise', broadcasting_rule, _unary_example(_op))
for _op in BINARY:
  register(_op, 'elementwise', broadcasting_rule, _binary_example(_op))
for _op in TERNARY:
  register(_op, 'elementwise', broadcasting_rule, _ternary_example(_op))
register('AddN', 'elementwise', broadcasting_rule, _addn_example)
register('IdentityN', 'elementwise', identity_n, _identity_n_example)
register(['BiasAdd', 'BiasAddV1'], 'elementwise', bias_add, _bias_add_example('BiasAdd'))
register('Bitcast', 'elementwise', _bitcast, _bitcast_example)


# --- properties ---------------------------------------------------------------------
# Pass-through ops: the result is the operand (on the local block too).
declare(
  ['Identity', 'Snapshot', 'StopGradient', 'PreventGradient', 'EnsureShape', 'CheckNumerics'],
  local='identity',
)
declare(['Identity', 'Snapshot', 'StopGradient'], aliasing=True)
declare(['Identity', 'Snapshot'], linear='layout')
declare('Identity', resource='forwards')
declare('IdentityN', local='identity_n', aliasing=True, resource='forwards')
declare('XlaSharding', local='sharding_annotation', linear='annotate')
declare(['AddV2', 'Add'], linear='add')
declare('AddN', linear='add_n')
declare('Sub', linear='subtract')
declare('Neg', linear='negate')
declare('Mul', linear='scale')
declare('RealDiv', linear='divide')
# Ops dividing by operand 1: its padding must not be zero.
declare(
  ['FloorDiv', 'FloorMod', 'Mod', 'TruncateDiv', 'TruncateMod', 'Div', 'RealDiv', 'DivNoNan'],
  divisor=1,
)

# --- sweep programs (testing/programs/elementwise.py) -----------------------------------
# Unary float ops and the range their input is drawn from.
_UNARY_FLOAT = {
  'Abs': None,
  'Acos': (-0.9, 0.9),
  'Acosh': (1.1, 3.0),
  'Asin': (-0.9, 0.9),
  'Asinh': None,
  'Atan': None,
  'Atanh': (-0.9, 0.9),
  'Ceil': None,
  'Cos': None,
  'Cosh': None,
  'Digamma': (0.5, 3.0),
  'Elu': None,
  'Erf': None,
  'Erfc': None,
  'Erfinv': (-0.9, 0.9),
  'Exp': None,
  'Expm1': None,
  'Floor': None,
  'Inv': (0.5, 2.0),
  'LeakyRelu': None,
  'Lgamma': (0.5, 3.0),
  'Log': (0.5, 3.0),
  'Log1p': (0.0, 3.0),
  'Ndtri': (0.05, 0.95),
  'Neg': None,
  'OnesLike': None,
  'Reciprocal': (0.5, 2.0),
  'Relu': None,
  'Relu6': (-2.0, 8.0),
  'Rint': (-4.0, 4.0),
  'Round': (-4.0, 4.0),
  'Rsqrt': (0.5, 3.0),
  'Selu': None,
  'Sigmoid': None,
  'Sign': None,
  'Sin': None,
  'Sinh': None,
  'Softplus': None,
  'Softsign': None,
  'Sqrt': (0.1, 3.0),
  'Square': None,
  'Tan': (-1.0, 1.0),
  'Tanh': None,
  'ZerosLike': None,
  'Identity': None,
  'Snapshot': None,
  'StopGradient': None,
  'PreventGradient': None,
}
_UNARY_SPECIAL = ('IsFinite', 'IsInf', 'IsNan')
_UNARY_COMPLEX = ('Angle', 'ComplexAbs', 'Conj', 'Imag', 'Real')

# Binary float ops: (range of x, range of y); None: the default range.
_BINARY_FLOAT = {
  'Atan2': (None, None),
  'Div': (None, 'nonzero'),
  'DivNoNan': (None, 'with_zeros'),
  'Igamma': ((0.5, 3.0), (0.5, 3.0)),
  'Igammac': ((0.5, 3.0), (0.5, 3.0)),
  'Maximum': (None, None),
  'Minimum': (None, None),
  'MulNoNan': (None, 'with_zeros'),
  'NextAfter': (None, None),
  'Polygamma': ('orders', (0.5, 3.0)),
  'Pow': ((0.5, 2.0), (-2.0, 2.0)),
  'RealDiv': (None, 'nonzero'),
  'SquaredDifference': (None, None),
  'Sub': (None, None),
  'Xdivy': (None, 'nonzero'),
  'Xlog1py': (None, (0.0, 3.0)),
  'Xlogy': (None, (0.5, 3.0)),
  'Zeta': ((1.5, 4.0), (0.5, 3.0)),
  # Gradients of unary ops: (y or features, dy).
  'EluGrad': (None, None),
  'InvGrad': (None, None),
  'LeakyReluGrad': (None, None),
  'ReciprocalGrad': (None, None),
  'Relu6Grad': (None, (-2.0, 8.0)),
  'ReluGrad': (None, None),
  'RsqrtGrad': (None, None),
  'SeluGrad': (None, None),
  'SigmoidGrad': (None, None),
  'SoftplusGrad': (None, None),
  'SoftsignGrad': (None, None),
  'SqrtGrad': (None, None),
  'TanhGrad': (None, None),
}
_COMPARE = ('Equal', 'NotEqual', 'Greater', 'GreaterEqual', 'Less', 'LessEqual')
# Integer binary ops: range of y, or 'nonzero' (x is drawn from [-20, 20), Mod's from [0, 20)).
_BINARY_INT = {
  'BitwiseAnd': (-20, 20),
  'BitwiseOr': (-20, 20),
  'BitwiseXor': (-20, 20),
  'FloorDiv': 'nonzero',
  'FloorMod': 'nonzero',
  'TruncateDiv': 'nonzero',
  'TruncateMod': 'nonzero',
  'Mod': (1, 7),
  'LeftShift': (0, 8),
  'RightShift': (0, 8),
}


for _op, _domain in _UNARY_FLOAT.items():
  declare(_op, sweep='unary', sweep_params={} if _domain is None else {'domain': _domain})
declare(_UNARY_SPECIAL, sweep='unary_special')
declare(_UNARY_COMPLEX, sweep='unary_complex')
for _op, (_x, _y) in _BINARY_FLOAT.items():
  declare(_op, sweep='binary', sweep_params={'x': _x, 'y': _y})
declare(['Add', 'AddV2', 'Mul'], sweep='binary')
declare(_COMPARE, sweep='compare')
for _op, _int_y in _BINARY_INT.items():
  declare(
    _op, sweep='binary_int', sweep_params={'y': _int_y, 'x': (0, 20) if _op == 'Mod' else (-20, 20)}
  )
declare(['LogicalAnd', 'LogicalOr'], sweep='logical')
# Programs of their own: casts, annotations, broadcasting, ternary and n-ary ops.
declare(
  [
    'Invert',
    'PopulationCount',
    'LogicalNot',
    'CheckNumerics',
    'EnsureShape',
    'Cast',
    'Bitcast',
    'XlaSharding',
    'ApproximateEqual',
    'Complex',
    'Betainc',
    'Select',
    'SelectV2',
    'ClipByValue',
    'AddN',
    'IdentityN',
    'BiasAdd',
    'BiasAddV1',
  ],
  sweep='elementwise',
)
