"""Small, concrete TF programs that produce each registered op type, for the op sweep.

`op_specs()` returns one or more `OpSpec`s per op type of
`tf_gspmd.propagation.registry`: a Python function that emits the op (almost
always through `tf.raw_ops`, so the op type is exactly the one named) and
concrete operand values. The sweep (`op_sweep.py`) annotates the operands
with every sharding of a mesh, partitions the function and compares it with
the unpartitioned run.

Operand values are chosen inside each op's domain (logs of positives,
inverse trig functions of values in (-1, 1), nonzero divisors) so results
are finite and comparable. Shapes hold dims that do not divide the meshes'
shard counts (10 over 4, 3 over 4, 7 over 8, 10 over 8) so uneven shards and
empty shards are exercised.

`UNSWEPT` names registered op types no tf.function can produce, with why.
"""

from __future__ import annotations

import dataclasses
import inspect
import zlib
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np
import tensorflow as tf
from tensorflow.python.framework import op_def_registry


@dataclasses.dataclass(frozen=True)
class Operand:
  """One input of a swept op.

  `shard`: whether the sweep enumerates shardings for it (scalars and
  auxiliary values are left unannotated). `variable`: passed as a
  `tf.Variable` holding `value` (sharded with `shard_variable`).
  """

  value: np.ndarray
  shard: bool = True
  variable: bool = False

  @property
  def rank(self) -> int:
    return int(np.ndim(self.value))


@dataclasses.dataclass(frozen=True)
class OpSpec:
  """A program producing `op_type`: `fn(*operands)` returns a tensor, a tuple, or None.

  `name` is the op type, or `op_type/variant` when one op type has several
  programs (axes, masks, modes). `shard_outputs`: whether the sweep also asks
  for sharded outputs (`out_shardings`).
  """

  name: str
  op_type: str
  fn: Callable
  operands: Tuple[Operand, ...]
  shard_outputs: bool = True
  note: str = ''

  @property
  def variables(self) -> Tuple[int, ...]:
    return tuple(i for i, o in enumerate(self.operands) if o.variable)


# Registered op types that no tf.function produces, so no program can sweep them.
UNSWEPT = {
  '_Arg': 'function arguments are captured as Placeholders (swept as Placeholder)',
  '_Retval': 'function results are captured as graph outputs, not _Retval nodes',
  'VarHandleOp': 'variables used by a tf.function are captured resource handles, '
  'not VarHandleOp nodes',
}
# cuDNN's fused RNN ops: TF registers no CPU kernel for them, so no program runs here
# (tests/test_one_definition.py checks TF's kernel registry still says so).
UNSWEPT.update(
  {
    op: 'no CPU kernel (GPU only)'
    for op in (
      'CudnnRNN',
      'CudnnRNNV2',
      'CudnnRNNV3',
      'CudnnRNNBackprop',
      'CudnnRNNBackpropV2',
      'CudnnRNNBackpropV3',
    )
  }
)


# --- building blocks ---------------------------------------------------------------
def raw(op_type: str, *inputs, **attrs):
  """`tf.raw_ops.<op_type>` with positional inputs (in the op def's order) and keyword attrs."""
  fn = getattr(tf.raw_ops, op_type)
  n_inputs = len(op_def_registry.get(op_type).input_arg)
  # The Python names of inputs may differ from the op def's (`axis` for `dim`); order does not.
  names = list(inspect.signature(fn).parameters)[:n_inputs]
  if len(inputs) > n_inputs:
    raise TypeError(f'{op_type} takes {n_inputs} inputs ({names}), got {len(inputs)}.')
  kwargs = dict(zip(names, inputs))
  kwargs.update(attrs)
  return fn(**kwargs)


class Values:
  """Deterministic operand values for one spec (seeded by its name)."""

  def __init__(self, name: str):
    self.rng = np.random.RandomState(zlib.crc32(name.encode()))

  def uniform(self, shape, lo=-2.0, hi=2.0, dtype=np.float32) -> np.ndarray:
    return self.rng.uniform(lo, hi, size=shape).astype(dtype)

  def ints(self, shape, lo, hi, dtype=np.int32) -> np.ndarray:
    return self.rng.randint(lo, hi, size=shape).astype(dtype)

  def bools(self, shape) -> np.ndarray:
    return self.rng.rand(*shape) < 0.5

  def nonzero(self, shape, lo=0.5, hi=2.0) -> np.ndarray:
    """Floats of either sign, away from zero."""
    sign = np.where(self.rng.rand(*shape) < 0.5, -1.0, 1.0)
    return (sign * self.rng.uniform(lo, hi, size=shape)).astype(np.float32)

  def nonzero_ints(self, shape, hi=5) -> np.ndarray:
    sign = np.where(self.rng.rand(*shape) < 0.5, -1, 1)
    return (sign * self.rng.randint(1, hi, size=shape)).astype(np.int32)

  def complex(self, shape) -> np.ndarray:
    return (self.uniform(shape) + 1j * self.uniform(shape)).astype(np.complex64)

  def specials(self, shape) -> np.ndarray:
    """Floats with some inf, -inf and nan among them."""
    x = self.uniform(shape).reshape(-1)
    x[::5] = np.inf
    x[1::7] = -np.inf
    x[2::6] = np.nan
    return x.reshape(shape)


def arg(value, shard=True) -> Operand:
  value = np.asarray(value)
  return Operand(value, shard=shard and value.ndim > 0)


def var(value, shard=True) -> Operand:
  return Operand(np.asarray(value), shard=shard, variable=True)


def spec(name, fn, *operands, op_type=None, shard_outputs=True, note='') -> OpSpec:
  return OpSpec(name, op_type or name.split('/')[0], fn, tuple(operands), shard_outputs, note)


# Shapes: 7, 10 and 3 over 2, 4 and 8 shards give even, uneven and empty shards.
UNARY_SHAPE = (7, 10, 3)
BINARY_SHAPE = (10, 3)


# --- elementwise ---------------------------------------------------------------------
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
# Integer binary ops: range of y (x is drawn from [-20, 20)).
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


def _float_values(v: Values, shape, kind):
  if kind is None:
    return v.uniform(shape)
  if kind == 'nonzero':
    return v.nonzero(shape)
  if kind == 'with_zeros':
    x = v.uniform(shape).reshape(-1)
    x[::4] = 0.0
    return x.reshape(shape)
  if kind == 'orders':
    return v.ints(shape, 0, 3).astype(np.float32)
  return v.uniform(shape, *kind)


def _replicated_annotation(x):
  from tf_gspmd.annotations import replicate

  return tf.identity(replicate(x))


def elementwise_specs() -> List[OpSpec]:
  out = []
  for op, domain in _UNARY_FLOAT.items():
    v = Values(op)
    x = v.uniform(UNARY_SHAPE, *(domain or (-2.0, 2.0)))
    out.append(spec(op, lambda a, op=op: raw(op, a), arg(x)))
  for op in _UNARY_SPECIAL:
    out.append(spec(op, lambda a, op=op: raw(op, a), arg(Values(op).specials(UNARY_SHAPE))))
  for op in _UNARY_COMPLEX:
    out.append(spec(op, lambda a, op=op: raw(op, a), arg(Values(op).complex(BINARY_SHAPE))))
  v = Values('unary_int')
  out.append(spec('Invert', lambda a: raw('Invert', a), arg(v.ints(UNARY_SHAPE, -50, 50))))
  out.append(
    spec('PopulationCount', lambda a: raw('PopulationCount', a), arg(v.ints(UNARY_SHAPE, -50, 50)))
  )
  out.append(spec('LogicalNot', lambda a: raw('LogicalNot', a), arg(v.bools(UNARY_SHAPE))))
  out.append(
    spec(
      'CheckNumerics',
      lambda a: raw('CheckNumerics', a, message='sweep'),
      arg(v.uniform(UNARY_SHAPE)),
    )
  )
  out.append(
    spec(
      'EnsureShape',
      lambda a: raw('EnsureShape', a, shape=list(UNARY_SHAPE)),
      arg(v.uniform(UNARY_SHAPE)),
    )
  )
  out.append(
    spec('Cast', lambda a: raw('Cast', a, DstT=tf.int32), arg(v.uniform(UNARY_SHAPE, -5, 5)))
  )
  out.append(
    spec(
      'Cast/int_to_float',
      lambda a: raw('Cast', a, DstT=tf.float32),
      arg(v.ints(UNARY_SHAPE, -5, 5)),
    )
  )
  out.append(
    spec('Bitcast', lambda a: raw('Bitcast', a, type=tf.int32), arg(v.uniform(BINARY_SHAPE)))
  )
  out.append(
    spec('Bitcast/widen', lambda a: raw('Bitcast', a, type=tf.int64), arg(v.ints((10, 2), -50, 50)))
  )
  out.append(
    spec(
      'XlaSharding',
      _replicated_annotation,
      arg(v.uniform(UNARY_SHAPE)),
      note='annotations themselves: input annotation, a replicated one, out_shardings',
    )
  )

  for op, (kx, ky) in _BINARY_FLOAT.items():
    v = Values(op)
    x, y = _float_values(v, BINARY_SHAPE, kx), _float_values(v, BINARY_SHAPE, ky)
    out.append(spec(op, lambda a, b, op=op: raw(op, a, b), arg(x), arg(y)))
  for op in ('Add', 'AddV2', 'Mul'):
    v = Values(op)
    out.append(
      spec(
        op,
        lambda a, b, op=op: raw(op, a, b),
        arg(v.uniform(BINARY_SHAPE)),
        arg(v.uniform(BINARY_SHAPE)),
      )
    )
  v = Values('broadcast')
  out.append(
    spec(
      'AddV2/broadcast_row',
      lambda a, b: raw('AddV2', a, b),
      arg(v.uniform(UNARY_SHAPE)),
      arg(v.uniform((3,))),
    )
  )
  out.append(
    spec(
      'Mul/broadcast_column',
      lambda a, b: raw('Mul', a, b),
      arg(v.uniform((10, 1))),
      arg(v.uniform(BINARY_SHAPE)),
    )
  )
  out.append(
    spec(
      'Sub/broadcast_both',
      lambda a, b: raw('Sub', a, b),
      arg(v.uniform((7, 1, 3))),
      arg(v.uniform((10, 1))),
    )
  )
  out.append(
    spec(
      'ApproximateEqual',
      lambda a, b: raw('ApproximateEqual', a, b, tolerance=0.5),
      arg(v.uniform(BINARY_SHAPE)),
      arg(v.uniform(BINARY_SHAPE)),
    )
  )
  out.append(
    spec(
      'Complex',
      lambda a, b: raw('Complex', a, b, Tout=tf.complex64),
      arg(v.uniform(BINARY_SHAPE)),
      arg(v.uniform(BINARY_SHAPE)),
    )
  )
  for op in _COMPARE:
    v = Values(op)
    out.append(
      spec(
        op,
        lambda a, b, op=op: raw(op, a, b),
        arg(v.ints(BINARY_SHAPE, 0, 3)),
        arg(v.ints(BINARY_SHAPE, 0, 3)),
      )
    )
  for op, ky in _BINARY_INT.items():
    v = Values(op)
    y = v.nonzero_ints(BINARY_SHAPE) if ky == 'nonzero' else v.ints(BINARY_SHAPE, *ky)
    x = v.ints(BINARY_SHAPE, 0 if op == 'Mod' else -20, 20)
    out.append(spec(op, lambda a, b, op=op: raw(op, a, b), arg(x), arg(y)))
  for op in ('LogicalAnd', 'LogicalOr'):
    v = Values(op)
    out.append(
      spec(
        op,
        lambda a, b, op=op: raw(op, a, b),
        arg(v.bools(BINARY_SHAPE)),
        arg(v.bools(BINARY_SHAPE)),
      )
    )

  v = Values('ternary')
  out.append(
    spec(
      'Betainc',
      lambda a, b, x: raw('Betainc', a, b, x),
      arg(v.uniform(BINARY_SHAPE, 0.5, 3.0)),
      arg(v.uniform(BINARY_SHAPE, 0.5, 3.0)),
      arg(v.uniform(BINARY_SHAPE, 0.05, 0.95)),
    )
  )
  out.append(
    spec(
      'Select',
      lambda c, a, b: raw('Select', c, a, b),
      arg(v.bools(BINARY_SHAPE)),
      arg(v.uniform(BINARY_SHAPE)),
      arg(v.uniform(BINARY_SHAPE)),
    )
  )
  out.append(
    spec(
      'SelectV2',
      lambda c, a, b: raw('SelectV2', c, a, b),
      arg(v.bools((10, 1))),
      arg(v.uniform(BINARY_SHAPE)),
      arg(v.uniform((3,))),
    )
  )
  out.append(
    spec(
      'ClipByValue',
      lambda x, lo, hi: raw('ClipByValue', x, lo, hi),
      arg(v.uniform(BINARY_SHAPE)),
      arg(v.uniform(BINARY_SHAPE, -1.0, 0.0)),
      arg(v.uniform(BINARY_SHAPE, 0.0, 1.0)),
    )
  )
  out.append(
    spec(
      'ClipByValue/scalar_bounds',
      lambda x, lo, hi: raw('ClipByValue', x, lo, hi),
      arg(v.uniform(UNARY_SHAPE)),
      arg(np.float32(-0.5)),
      arg(np.float32(0.7)),
    )
  )
  out.append(
    spec(
      'AddN',
      lambda a, b, c: raw('AddN', [a, b, c]),
      arg(v.uniform(BINARY_SHAPE)),
      arg(v.uniform(BINARY_SHAPE)),
      arg(v.uniform(BINARY_SHAPE)),
    )
  )
  out.append(
    spec(
      'IdentityN',
      lambda a, b: tuple(raw('IdentityN', [a, b])),
      arg(v.uniform(BINARY_SHAPE)),
      arg(v.uniform((7,))),
    )
  )
  for op in ('BiasAdd', 'BiasAddV1'):
    out.append(
      spec(op, lambda x, b, op=op: raw(op, x, b), arg(v.uniform((4, 10, 3))), arg(v.uniform((3,))))
    )
  return out


# --- generators ------------------------------------------------------------------------
def generator_specs() -> List[OpSpec]:
  v = Values('generators')
  shape = [10, 3]
  f32 = tf.float32
  out = [
    spec('Fill', lambda x: raw('Fill', shape, x), arg(np.float32(1.5))),
    spec(
      'LinSpace', lambda a, b: raw('LinSpace', a, b, 13), arg(np.float32(1.0)), arg(np.float32(5.0))
    ),
    spec('Range', lambda: raw('Range', 3, 42, 3), note='folded: a statically known value'),
    spec('Range/float', lambda a: raw('Range', a, 9.5, 0.5), arg(np.float32(-1.0))),
    spec(
      'Range/large_int',
      lambda: raw('Range', -3, 2997, 2),
      note='1500 elements: too many to fold, so computed',
    ),
    spec('Range/negative_delta', lambda a: raw('Range', a, -6.0, -1.5), arg(np.float32(7.0))),
    spec('RandomUniform', lambda: raw('RandomUniform', shape, dtype=f32, seed=1, seed2=2)),
    spec(
      'RandomStandardNormal', lambda: raw('RandomStandardNormal', shape, dtype=f32, seed=1, seed2=2)
    ),
    spec('TruncatedNormal', lambda: raw('TruncatedNormal', shape, dtype=f32, seed=1, seed2=2)),
    spec('RandomUniformInt', lambda: raw('RandomUniformInt', shape, 0, 100, seed=1, seed2=2)),
    spec('StatelessRandomUniform', lambda: raw('StatelessRandomUniform', shape, [1, 2], dtype=f32)),
    spec('StatelessRandomNormal', lambda: raw('StatelessRandomNormal', shape, [1, 2], dtype=f32)),
    spec(
      'StatelessTruncatedNormal', lambda: raw('StatelessTruncatedNormal', shape, [1, 2], dtype=f32)
    ),
    spec(
      'StatelessRandomUniformInt',
      lambda: raw('StatelessRandomUniformInt', [40, 30], [1, 2], 0, 100),
    ),
    spec(
      'StatelessRandomUniformFullInt',
      lambda: raw('StatelessRandomUniformFullInt', [40, 30], [1, 2], dtype=tf.int32),
    ),
    spec(
      'StatelessRandomBinomial',
      lambda c, p: raw('StatelessRandomBinomial', shape, [1, 2], c, p, dtype=tf.float32),
      arg(v.uniform((10, 3), 1.0, 10.0)),
      arg(v.uniform((10, 3), 0.1, 0.9)),
    ),
  ]

  def keyed(op, **attrs):
    def fn():
      key, counter = raw('StatelessRandomGetKeyCounter', [1, 2])
      return raw(op, shape, key, counter, 1, **attrs)

    return fn

  def keyed_int(op, *bounds, **attrs):
    def fn():
      key, counter, alg = raw('StatelessRandomGetKeyCounterAlg', [1, 2])
      return raw(op, [40, 30], key, counter, alg, *bounds, **attrs)

    return fn

  out += [
    spec('StatelessRandomUniformV2', keyed('StatelessRandomUniformV2', dtype=f32)),
    spec('StatelessRandomNormalV2', keyed('StatelessRandomNormalV2', dtype=f32)),
    spec('StatelessTruncatedNormalV2', keyed('StatelessTruncatedNormalV2', dtype=f32)),
    spec('StatelessRandomUniformIntV2', keyed_int('StatelessRandomUniformIntV2', 0, 100)),
    spec(
      'StatelessRandomUniformFullIntV2',
      keyed_int('StatelessRandomUniformFullIntV2', dtype=tf.int32),
    ),
    spec('StatelessRandomGetKeyCounter', lambda: raw('StatelessRandomGetKeyCounter', [1, 2])),
    spec('StatelessRandomGetKeyCounterAlg', lambda: raw('StatelessRandomGetKeyCounterAlg', [1, 2])),
  ]
  return out + drawn_whole_specs(v)


def drawn_whole_specs(v: Values) -> List[OpSpec]:
  """Random ops with parameters or data operands, candidate and bounding-box samplers: drawn
  whole from seeds (stateful ones seeded, so the unpartitioned run draws the same values)."""
  f32, seeds = tf.float32, dict(seed=1, seed2=2)
  classes = arg(v.ints((10, 2), 0, 4).astype(np.int64))  # < num_sampled (AllCandidateSampler)
  sampled = dict(num_true=2, num_sampled=4, unique=True, **seeds)
  out = [
    spec('AllCandidateSampler', lambda c: tuple(raw('AllCandidateSampler', c, **sampled)), classes)
  ]
  for op, extra in (
    ('FixedUnigramCandidateSampler', dict(unigrams=[1.0 + k for k in range(12)])),
    ('LearnedUnigramCandidateSampler', {}),
    ('LogUniformCandidateSampler', {}),
    ('ThreadUnsafeUnigramCandidateSampler', {}),
    ('UniformCandidateSampler', {}),
  ):
    out.append(
      spec(
        op,
        lambda c, op=op, extra=extra: tuple(raw(op, c, range_max=12, **sampled, **extra)),
        classes,
      )
    )
  logits = arg(v.uniform((10, 3)))
  bounds = [arg(np.float32(x)) for x in (0.5, 1.5, -1.0, 2.0)]  # mean, stddev, min, max
  positive = arg(v.uniform((10, 3), 0.5, 3.0))
  box = arg(np.array([[[0.1, 0.2, 0.7, 0.9]]], np.float32))
  out += [
    spec('Multinomial', lambda x: raw('Multinomial', x, 7, **seeds), logits),
    spec('StatelessMultinomial', lambda x: raw('StatelessMultinomial', x, 7, [1, 2]), logits),
    spec(
      'ParameterizedTruncatedNormal',
      lambda *b: raw('ParameterizedTruncatedNormal', [10, 3], *b, **seeds),
      *bounds,
    ),
    spec(
      'StatelessParameterizedTruncatedNormal',
      lambda *b: raw('StatelessParameterizedTruncatedNormal', [10, 3], [1, 2], *b),
      *bounds,
    ),
    spec(
      'RandomGamma', lambda a: raw('RandomGamma', [10], a, **seeds), arg(v.uniform((3,), 0.5, 3.0))
    ),
    spec(
      'RandomPoissonV2',
      lambda r: raw('RandomPoissonV2', [10], r, **seeds),
      arg(v.uniform((3,), 0.5, 3.0)),
    ),
    spec('RandomShuffle', lambda x: raw('RandomShuffle', x, **seeds), arg(v.uniform((10, 3)))),
    spec(
      'SampleDistortedBoundingBox',
      lambda b: tuple(raw('SampleDistortedBoundingBox', [40, 30, 3], b, **seeds)),
      box,
    ),
    spec(
      'SampleDistortedBoundingBoxV2',
      lambda b: tuple(raw('SampleDistortedBoundingBoxV2', [40, 30, 3], b, 0.1, **seeds)),
      box,
    ),
    spec(
      'StatelessRandomGammaV2',
      lambda a: raw('StatelessRandomGammaV2', [10, 3], [1, 2], a),
      positive,
    ),
    spec(
      'StatelessRandomPoisson',
      lambda r: raw('StatelessRandomPoisson', [10, 3], [1, 2], r, dtype=f32),
      positive,
    ),
    spec('StatelessRandomGetAlg', lambda: raw('StatelessRandomGetAlg')),
  ]
  return out


# --- matmul -------------------------------------------------------------------------
def matmul_specs() -> List[OpSpec]:
  v = Values('matmul')
  x, y = v.uniform((10, 3)), v.uniform((3, 7))
  return [
    spec('MatMul', lambda a, b: raw('MatMul', a, b), arg(x), arg(y)),
    spec(
      'MatMul/transposed',
      lambda a, b: raw('MatMul', a, b, transpose_a=True, transpose_b=True),
      arg(v.uniform((3, 10))),
      arg(v.uniform((7, 3))),
    ),
    spec(
      'BatchMatMul',
      lambda a, b: raw('BatchMatMul', a, b),
      arg(v.uniform((2, 10, 3))),
      arg(v.uniform((2, 3, 7))),
    ),
    spec(
      'BatchMatMulV2',
      lambda a, b: raw('BatchMatMulV2', a, b, adj_y=True),
      arg(v.uniform((2, 10, 3))),
      arg(v.uniform((2, 7, 3))),
    ),
    spec(
      'BatchMatMulV2/broadcast',
      lambda a, b: raw('BatchMatMulV2', a, b),
      arg(v.uniform((2, 10, 3))),
      arg(v.uniform((3, 7))),
    ),
    spec(
      'BatchMatMulV3',
      lambda a, b: raw('BatchMatMulV3', a, b, Tout=tf.float32),
      arg(v.uniform((2, 10, 3))),
      arg(v.uniform((2, 3, 7))),
    ),
    spec(
      'Einsum',
      lambda a, b: raw('Einsum', [a, b], equation='bij,jk->bik'),
      arg(v.uniform((2, 10, 3))),
      arg(v.uniform((3, 7))),
    ),
    spec(
      'Einsum/contract_two',
      lambda a, b: raw('Einsum', [a, b], equation='ijk,jkl->il'),
      arg(v.uniform((10, 3, 2))),
      arg(v.uniform((3, 2, 7))),
    ),
  ]


# --- nn ------------------------------------------------------------------------------
def nn_specs() -> List[OpSpec]:
  v = Values('nn')
  x, w = v.uniform((2, 7, 6, 3)), v.uniform((3, 3, 3, 4))
  same = dict(strides=[1, 1, 1, 1], padding='SAME')
  pool = dict(ksize=[1, 2, 2, 1], strides=[1, 2, 2, 1], padding='VALID')
  images = v.uniform((2, 8, 6, 3))

  def max_pool_grad(a, g):
    return raw('MaxPoolGrad', a, raw('MaxPool', a, **pool), g, **pool)

  def max_pool_grad_grad(a, g):
    return raw('MaxPoolGradGrad', a, raw('MaxPool', a, **pool), g, **pool)

  def batch_norm(op):
    def fn(a, scale, offset, mean, variance):
      outs = raw(op, a, scale, offset, mean, variance, epsilon=1e-3, is_training=True)
      return outs[0], outs[1], outs[2]

    return fn

  def batch_norm_grad(forward, op):
    def fn(dy, a, scale, offset):
      empty = tf.zeros([0], tf.float32)
      fwd = raw(forward, a, scale, offset, empty, empty, epsilon=1e-3, is_training=True)
      extra = [fwd[5]] if op == 'FusedBatchNormGradV3' else []
      outs = raw(op, dy, a, scale, fwd[3], fwd[4], *extra, epsilon=1e-3, is_training=True)
      return outs[0], outs[1], outs[2]

    return fn

  bn = (
    arg(v.uniform((4, 5, 6, 3))),
    arg(v.uniform((3,), 0.5, 1.5)),
    arg(v.uniform((3,))),
    arg(v.uniform((3,))),
    arg(v.uniform((3,), 0.5, 1.5)),
  )
  bn_grad = (
    arg(v.uniform((4, 5, 6, 3))),
    arg(v.uniform((4, 5, 6, 3))),
    arg(v.uniform((3,), 0.5, 1.5)),
    arg(v.uniform((3,))),
  )
  out = [
    spec('Conv2D', lambda a, b: raw('Conv2D', a, b, **same), arg(x), arg(w)),
    spec(
      'Conv2D/valid_stride2',
      lambda a, b: raw('Conv2D', a, b, strides=[1, 2, 2, 1], padding='VALID'),
      arg(x),
      arg(w),
    ),
    spec(
      'DepthwiseConv2dNative',
      lambda a, b: raw('DepthwiseConv2dNative', a, b, **same),
      arg(x),
      arg(v.uniform((3, 3, 3, 2))),
    ),
    spec(
      'DepthwiseConv2dNativeBackpropInput',
      lambda b, g: raw('DepthwiseConv2dNativeBackpropInput', [2, 7, 6, 3], b, g, **same),
      arg(v.uniform((3, 3, 3, 2))),
      arg(v.uniform((2, 7, 6, 6))),
    ),
    spec(
      'DepthwiseConv2dNativeBackpropFilter',
      lambda a, g: raw('DepthwiseConv2dNativeBackpropFilter', a, [3, 3, 3, 2], g, **same),
      arg(x),
      arg(v.uniform((2, 7, 6, 6))),
    ),
    spec(
      'Conv2DBackpropInput',
      lambda b, g: raw('Conv2DBackpropInput', [2, 7, 6, 3], b, g, **same),
      arg(w),
      arg(v.uniform((2, 7, 6, 4))),
    ),
    spec(
      'Conv2DBackpropFilter',
      lambda a, g: raw('Conv2DBackpropFilter', a, [3, 3, 3, 4], g, **same),
      arg(x),
      arg(v.uniform((2, 7, 6, 4))),
    ),
    spec('MaxPool', lambda a: raw('MaxPool', a, **pool), arg(images)),
    spec('AvgPool', lambda a: raw('AvgPool', a, **pool), arg(images)),
    spec(
      'AvgPoolGrad',
      lambda g: raw('AvgPoolGrad', [2, 8, 6, 3], g, **pool),
      arg(v.uniform((2, 4, 3, 3))),
    ),
    spec('MaxPoolGrad', max_pool_grad, arg(images), arg(v.uniform((2, 4, 3, 3)))),
    spec('MaxPoolGradGrad', max_pool_grad_grad, arg(images), arg(v.uniform((2, 8, 6, 3)))),
  ]
  for op in ('FusedBatchNorm', 'FusedBatchNormV2', 'FusedBatchNormV3'):
    out.append(spec(op, batch_norm(op), *bn))

  def inference(a, scale, offset, mean, variance):
    return raw(
      'FusedBatchNormV3', a, scale, offset, mean, variance, epsilon=1e-3, is_training=False
    )[0]

  out.append(spec('FusedBatchNormV3/inference', inference, *bn))
  for forward, op in (
    ('FusedBatchNorm', 'FusedBatchNormGrad'),
    ('FusedBatchNormV2', 'FusedBatchNormGradV2'),
    ('FusedBatchNormV3', 'FusedBatchNormGradV3'),
  ):
    out.append(spec(op, batch_norm_grad(forward, op), *bn_grad))
  return out


# --- reductions ---------------------------------------------------------------------
def reduction_specs() -> List[OpSpec]:
  v = Values('reductions')
  x3 = v.uniform(UNARY_SHAPE)
  out = []
  for op in ('Sum', 'Max', 'Min', 'Mean', 'EuclideanNorm', 'Prod'):
    values = v.uniform(UNARY_SHAPE, 0.7, 1.3) if op == 'Prod' else x3
    out.append(spec(op, lambda a, op=op: raw(op, a, [1]), arg(values)))
    out.append(
      spec(
        f'{op}/two_axes_keepdims', lambda a, op=op: raw(op, a, [0, 2], keep_dims=True), arg(values)
      )
    )
  for op in ('All', 'Any'):
    out.append(spec(op, lambda a, op=op: raw(op, a, [1]), arg(v.rng.rand(*UNARY_SHAPE) < 0.9)))
    out.append(
      spec(
        f'{op}/all_axes',
        lambda a, op=op: raw(op, a, [0, 1, 2]),
        arg(v.rng.rand(*UNARY_SHAPE) < 0.97),
      )
    )
  for op in ('ArgMax', 'ArgMin'):
    out.append(spec(op, lambda a, op=op: raw(op, a, 1), arg(v.uniform((10, 7)))))
    out.append(spec(f'{op}/axis0', lambda a, op=op: raw(op, a, 0), arg(v.uniform((10, 7)))))
  out.append(spec('BiasAddGrad', lambda a: raw('BiasAddGrad', a), arg(v.uniform((4, 10, 3)))))
  for op in ('Cumsum', 'Cumprod', 'CumulativeLogsumexp'):
    values = v.uniform((10, 7), 0.7, 1.3) if op == 'Cumprod' else v.uniform((10, 7))
    out.append(spec(op, lambda a, op=op: raw(op, a, 1), arg(values)))
    out.append(
      spec(
        f'{op}/axis0_exclusive_reverse',
        lambda a, op=op: raw(op, a, 0, exclusive=True, reverse=True),
        arg(values),
      )
    )
  out.append(spec('L2Loss', lambda a: raw('L2Loss', a), arg(v.uniform(BINARY_SHAPE))))
  out.append(spec('Softmax', lambda a: raw('Softmax', a), arg(v.uniform((10, 7)))))
  out.append(spec('LogSoftmax', lambda a: raw('LogSoftmax', a), arg(v.uniform((10, 7)))))
  labels = v.uniform((10, 7), 0.0, 1.0)
  labels = labels / labels.sum(axis=1, keepdims=True)
  out.append(
    spec(
      'SoftmaxCrossEntropyWithLogits',
      lambda a, b: tuple(raw('SoftmaxCrossEntropyWithLogits', a, b)),
      arg(v.uniform((10, 7))),
      arg(labels),
    )
  )
  out.append(
    spec(
      'SparseSoftmaxCrossEntropyWithLogits',
      lambda a, b: tuple(raw('SparseSoftmaxCrossEntropyWithLogits', a, b)),
      arg(v.uniform((10, 7))),
      arg(v.ints((10,), 0, 7)),
    )
  )
  out.append(spec('TopKV2', lambda a: tuple(raw('TopKV2', a, 3)), arg(v.uniform((10, 7)))))
  return out


# --- shape ops ------------------------------------------------------------------------
def _strided(begin, end, strides, **masks):
  return lambda a: raw('StridedSlice', a, begin, end, strides, **masks)


def _broadcast_gradient(grad):
  _, reduce_b = raw('BroadcastGradientArgs', list(BINARY_SHAPE), [3])
  return tf.reshape(tf.reduce_sum(grad, reduce_b), [3])


def shape_specs() -> List[OpSpec]:
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
  for op in (
    'UnsortedSegmentSum',
    'UnsortedSegmentMax',
    'UnsortedSegmentMin',
    'UnsortedSegmentProd',
  ):
    data = (
      v.uniform(BINARY_SHAPE, 0.7, 1.3) if op == 'UnsortedSegmentProd' else v.uniform(BINARY_SHAPE)
    )
    out.append(spec(op, lambda d, i, op=op: raw(op, d, i, 6), arg(data), arg(ids)))
  out.append(
    spec(
      'UnsortedSegmentSum/ids_2d',
      lambda d, i: raw('UnsortedSegmentSum', d, i, 4),
      arg(v.uniform((10, 3, 2))),
      arg(v.ints((10, 3), -1, 4)),
    )
  )
  return out


# --- sources, variables, control flow --------------------------------------------------
def _with_control(op, value):
  with tf.control_dependencies([op]):
    return tf.identity(value)


def source_specs() -> List[OpSpec]:
  v = Values('sources')
  c = v.uniform(BINARY_SHAPE)
  return [
    spec('Const', lambda a: a + tf.constant(c), arg(v.uniform(BINARY_SHAPE))),
    spec('Placeholder', lambda a: a * 3, arg(v.ints(BINARY_SHAPE, -9, 9))),
    spec('NoOp', lambda a: _with_control(tf.no_op(), a * 2.0), arg(v.uniform(BINARY_SHAPE))),
    spec(
      'Assert',
      lambda a: _with_control(raw('Assert', True, [a]), a * 2.0),
      arg(v.uniform(BINARY_SHAPE)),
    ),
    spec(
      'PrintV2',
      lambda a: _with_control(tf.print(a, output_stream='file:///dev/null'), a * 2.0),
      arg(v.uniform(BINARY_SHAPE)),
    ),
  ]


def handle(variable):
  """`variable.handle`, with the variable recorded as used by the function being traced.

  A raw op on a bare handle leaves the variable out of the traced function's
  `variables`, and capture would see an anonymous resource capture.
  """
  tf.compat.v1.get_default_graph().watch_variable(variable)
  return variable.handle


def _assign(op):
  def fn(variable, value):
    raw(op, handle(variable), value)
    return variable.read_value()

  return fn


def _apply(op, n_slots, *scalars):
  """ResourceApply<op>(var, *slots, *scalars, grad): returns nothing; the sweep compares
  variables."""

  def fn(*operands):
    handles = [handle(o) for o in operands[: 1 + n_slots]]
    grad = operands[1 + n_slots]
    if op in ('ResourceApplyMomentum', 'ResourceApplyKerasMomentum'):
      raw(op, *handles, scalars[0], grad, scalars[1])
    else:
      raw(op, *handles, *scalars, grad)

  return fn


_APPLY = {  # op: (slot variables, scalar inputs before grad)
  'ResourceApplyGradientDescent': (0, (0.1,)),
  'ResourceApplyMomentum': (1, (0.1, 0.9)),
  'ResourceApplyKerasMomentum': (1, (0.1, 0.9)),
  'ResourceApplyAdagrad': (1, (0.1,)),
  'ResourceApplyAdagradV2': (1, (0.1, 1e-7)),
  'ResourceApplyAdadelta': (2, (0.1, 0.95, 1e-7)),
  'ResourceApplyRMSProp': (2, (0.1, 0.9, 0.5, 1e-7)),
  'ResourceApplyCenteredRMSProp': (3, (0.1, 0.9, 0.5, 1e-7)),
  'ResourceApplyAdam': (2, (0.9, 0.999, 0.01, 0.9, 0.999, 1e-7)),
  'ResourceApplyAdaMax': (2, (0.9, 0.01, 0.9, 0.999, 1e-7)),
  'ResourceApplyAdamWithAmsgrad': (3, (0.9, 0.999, 0.01, 0.9, 0.999, 1e-7)),
}


def variable_specs() -> List[OpSpec]:
  v = Values('variables')
  out = [
    spec('ReadVariableOp', lambda w: w.read_value(), var(v.uniform(BINARY_SHAPE))),
    spec('VariableShape', lambda w: raw('VariableShape', handle(w)), var(v.uniform(BINARY_SHAPE))),
    spec(
      'VarIsInitializedOp',
      lambda w: raw('VarIsInitializedOp', handle(w)),
      var(v.uniform(BINARY_SHAPE)),
    ),
    spec(
      'ResourceGather',
      lambda w, i: raw('ResourceGather', handle(w), i, dtype=tf.float32),
      var(v.uniform((10, 3))),
      arg(v.ints((4, 5), 0, 10)),
    ),
  ]
  for op in ('AssignVariableOp', 'AssignAddVariableOp', 'AssignSubVariableOp'):
    out.append(spec(op, _assign(op), var(v.uniform(BINARY_SHAPE)), arg(v.uniform(BINARY_SHAPE))))
  for op, (slots, scalars) in _APPLY.items():
    slot_values = [var(v.uniform(BINARY_SHAPE, 0.1, 1.0)) for _ in range(slots)]
    out.append(
      spec(
        op,
        _apply(op, slots, *scalars),
        var(v.uniform(BINARY_SHAPE)),
        *slot_values,
        arg(v.uniform(BINARY_SHAPE)),
        shard_outputs=False,
      )
    )
  for op in (
    'ResourceScatterAdd',
    'ResourceScatterSub',
    'ResourceScatterMul',
    'ResourceScatterDiv',
    'ResourceScatterMax',
    'ResourceScatterMin',
    'ResourceScatterUpdate',
  ):

    def fn(w, i, u, op=op):
      raw(op, handle(w), i, u)
      return w.read_value()

    updates = v.nonzero((4, 3)) if op == 'ResourceScatterDiv' else v.uniform((4, 3))
    out.append(
      spec(op, fn, var(v.uniform((10, 3))), arg(np.array([7, 0, 3, 9], np.int32)), arg(updates))
    )
  return out


def control_flow_specs() -> List[OpSpec]:
  v = Values('control_flow')
  x = v.uniform(BINARY_SHAPE)
  w = v.uniform(BINARY_SHAPE)

  def stateless_if(pred, a):
    return tf.cond(pred > 0, lambda: a * 2.0, lambda: tf.tanh(a))

  def stateful_if(pred, a, variable):
    return tf.cond(pred > 0, lambda: a * variable, lambda: a - 1.0)

  def stateless_while(a):
    return tf.while_loop(lambda i, y: i < 3, lambda i, y: (i + 1, y * 0.5 + 1.0), [0, a])[1]

  def stateful_while(a, variable):
    return tf.while_loop(lambda i, y: i < 3, lambda i, y: (i + 1, y * variable), [0, a])[1]

  def stateless_case(index, a):
    return tf.switch_case(index, [lambda: a + 1.0, lambda: a * 3.0, lambda: -a])

  def stateful_case(index, a, variable):
    return tf.switch_case(index, [lambda: a + 1.0, lambda: a * variable])

  @tf.function(autograph=False)
  def inner(a):
    return tf.tanh(a) * 2.0

  def call(a):
    return inner(a)

  def stateful_call(a, variable):
    @tf.function(autograph=False)
    def reads(b):
      return b * variable

    return reads(a)

  scalar = arg(np.float32(1.0))
  index = arg(np.int32(1))
  return [
    spec('StatelessIf', stateless_if, scalar, arg(x)),
    spec('If', stateful_if, scalar, arg(x), var(w)),
    spec('StatelessWhile', stateless_while, arg(x)),
    spec('While', stateful_while, arg(x), var(w)),
    spec('StatelessCase', stateless_case, index, arg(x)),
    spec('Case', stateful_case, index, arg(x), var(w)),
    spec('PartitionedCall', call, arg(x)),
    spec('StatefulPartitionedCall', stateful_call, arg(x), var(w)),
  ]


_FAMILY_BUILDERS = (
  elementwise_specs,
  generator_specs,
  matmul_specs,
  nn_specs,
  reduction_specs,
  shape_specs,
  source_specs,
  variable_specs,
  control_flow_specs,
)
_CACHE: Optional[List[OpSpec]] = None


def op_specs() -> List[OpSpec]:
  """Every swept program, sorted by name."""
  global _CACHE
  if _CACHE is None:
    specs = [s for build in _FAMILY_BUILDERS for s in build()]
    names = [s.name for s in specs]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
      raise ValueError(f'op_builders: duplicate spec names {duplicates}.')
    _CACHE = sorted(specs, key=lambda s: s.name)
  return list(_CACHE)


def specs_by_op_type() -> Dict[str, List[OpSpec]]:
  out: Dict[str, List[OpSpec]] = {}
  for s in op_specs():
    out.setdefault(s.op_type, []).append(s)
  return out
