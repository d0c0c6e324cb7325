"""Sweep programs of generated values: Fill, Range, LinSpace, random ops and samplers.

Stateful random ops are seeded, so the unpartitioned run draws the same values.
"""

from __future__ import annotations

from typing import List

import numpy as np
import tensorflow as tf

from tf_gspmd.testing.op_builders import OpSpec, Values, arg, program, raw, spec


@program('generators')
def generators(entries) -> List[OpSpec]:
  """Fill, Range, LinSpace, random ops of a shape input, and the key-counter ops."""
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

  def sampler(op, **extra):
    return spec(op, lambda c: tuple(raw(op, c, range_max=12, **sampled, **extra)), classes)

  out += [
    sampler('FixedUnigramCandidateSampler', unigrams=[1.0 + k for k in range(12)]),
    sampler('LearnedUnigramCandidateSampler'),
    sampler('LogUniformCandidateSampler'),
    sampler('ThreadUnsafeUnigramCandidateSampler'),
    sampler('UniformCandidateSampler'),
  ]
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
