"""Generated values: Fill, Range, LinSpace and random-number ops.

Their results depend on no data operand, so their factors are tied to
nothing: they take the sharding of their users (a dropout mask takes the
activation's sharding). A partitioner that shards a random result must make
each partition produce its slice of the global random tensor.

Random ops with distribution parameters or a data operand (gamma, Poisson,
multinomial, truncated normal with bounds, shuffle), candidate samplers and
bounding-box samplers are the same kind of rule: `random_handler` reads
every operand whole, draws the global result from seeds shared by all
partitions and keeps this partition's shard, so their operands are
auxiliary (whole) and every result dim is a result-only factor (any layout).
"""

from __future__ import annotations

from tf_gspmd.propagation.registry import declare, op_types_of, register
from tf_gspmd.propagation.rule_builders import free_results, replicated_results

RANDOM = [
  'StatelessRandomUniformV2',
  'StatelessRandomNormalV2',
  'StatelessTruncatedNormalV2',
  'StatelessRandomUniformIntV2',
  'StatelessRandomUniformFullIntV2',
  'StatelessRandomUniform',
  'StatelessRandomNormal',
  'StatelessTruncatedNormal',
  'StatelessRandomUniformInt',
  'StatelessRandomUniformFullInt',
  'RandomUniform',
  'RandomStandardNormal',
  'TruncatedNormal',
  'RandomUniformInt',
  'StatelessRandomBinomial',
]

# Drawn whole from a seed by `random_handler`; operands (shapes, parameters, a value to
# shuffle, true classes, boxes) are read whole: (input shapes and dtypes, result
# shapes and dtypes) of an example node each.
_F32, _I32, _I64 = 'float32', 'int32', 'int64'
_SAMPLER = ([((3, 2), _I64)], [((4,), _I64), ((3, 2), _F32), ((4,), _F32)])
_BOX = ([((3,), _I32), ((1, 1, 4), _F32)], [((3,), _I32), ((3,), _I32), ((1, 1, 4), _F32)])
DRAWN_WHOLE = {
  'AllCandidateSampler': _SAMPLER,
  'FixedUnigramCandidateSampler': _SAMPLER,
  'LearnedUnigramCandidateSampler': _SAMPLER,
  'LogUniformCandidateSampler': _SAMPLER,
  'ThreadUnsafeUnigramCandidateSampler': _SAMPLER,
  'UniformCandidateSampler': _SAMPLER,
  'Multinomial': ([((10, 3), _F32), ((), _I32)], [((10, 7), _I64)]),
  'StatelessMultinomial': ([((10, 3), _F32), ((), _I32), ((2,), _I64)], [((10, 7), _I64)]),
  'ParameterizedTruncatedNormal': ([((2,), _I32)] + [((), _F32)] * 4, [((10, 3), _F32)]),
  'StatelessParameterizedTruncatedNormal': (
    [((2,), _I32), ((2,), _I64)] + [((), _F32)] * 4,
    [((10, 3), _F32)],
  ),
  'RandomGamma': ([((1,), _I32), ((3,), _F32)], [((10, 3), _F32)]),
  'RandomPoissonV2': ([((1,), _I32), ((3,), _F32)], [((10, 3), _I64)]),
  'RandomShuffle': ([((10, 3), _F32)], [((10, 3), _F32)]),
  'SampleDistortedBoundingBox': _BOX,
  'SampleDistortedBoundingBoxV2': (_BOX[0] + [((), _F32)], _BOX[1]),
  'StatelessRandomGammaV2': ([((2,), _I32), ((2,), _I64), ((10, 3), _F32)], [((10, 3), _F32)]),
  'StatelessRandomPoisson': ([((2,), _I32), ((2,), _I64), ((10, 3), _F32)], [((10, 3), _F32)]),
  'StatelessRandomGetAlg': ([], [((), _I32)]),
}


def _random_example(op):
  def build(b):
    import tensorflow as tf

    shape = b.const([4, 8], name='shape')
    key = b.placeholder('key', (1,), dtype=tf.uint64)
    counter = b.placeholder('counter', (2,), dtype=tf.uint64)
    alg = b.const(1, name='alg')
    b.op(op, [shape, key, counter, alg], [(4, 8)], name='y')
    return 'y'

  return build


def _drawn_whole_example(op):
  def build(b):
    import tensorflow as tf

    ins, outs = DRAWN_WHOLE[op]
    inputs = [
      b.placeholder(f'in{k}', shape, dtype=tf.as_dtype(dtype))
      for k, (shape, dtype) in enumerate(ins)
    ]
    b.op(
      op,
      inputs,
      [shape for shape, _ in outs],
      name='y',
      dtypes=[tf.as_dtype(dtype) for _, dtype in outs],
    )
    return 'y'

  return build


def _fill_example(b):
  dims = b.const([4, 8], name='dims')
  value = b.const(0.0, name='value')
  b.op('Fill', [dims, value], [(4, 8)], name='y')
  return 'y'


def _range_example(b):
  import tensorflow as tf

  start, limit, delta = b.const(0, name='start'), b.const(8, name='limit'), b.const(1, name='delta')
  b.op('Range', [start, limit, delta], [(8,)], name='y', dtypes=[tf.int32])
  return 'y'


def _key_counter_example(b):
  import tensorflow as tf

  seed = b.placeholder('seed', (2,), dtype=tf.int64)
  b.op(
    'StatelessRandomGetKeyCounter', [seed], [(1,), (2,)], name='y', dtypes=[tf.uint64, tf.uint64]
  )
  return 'y'


def _key_counter(node, ctx):
  """Key/counter derivation from a seed: tiny vectors, replicated."""
  return replicated_results(node, ctx)


for _op in RANDOM:
  register(_op, 'random', free_results, _random_example(_op))
for _op in DRAWN_WHOLE:
  register(_op, 'random', free_results, _drawn_whole_example(_op))
register('Fill', 'random', free_results, _fill_example)
register(['Range', 'LinSpace'], 'random', free_results, _range_example)
register(
  ['StatelessRandomGetKeyCounter', 'StatelessRandomGetKeyCounterAlg'],
  'random',
  _key_counter,
  _key_counter_example,
)


# --- properties ---------------------------------------------------------------------
declare('Fill', local='fill')
declare('Range', local='range')
declare('LinSpace', local='lin_space')
# Drawn whole from seeds shared by every partition, then this partition's shard kept.
declare(
  RANDOM + list(DRAWN_WHOLE) + ['StatelessRandomGetKeyCounter', 'StatelessRandomGetKeyCounterAlg'],
  local='random',
)

# --- sweep programs (testing/programs/generators.py) -----------------------------------
declare(op_types_of('random'), sweep='generators')
