"""Sweep programs of matrix products (`matmul`) and neural-network ops (`nn`)."""

from __future__ import annotations

from typing import List

import tensorflow as tf

from tf_gspmd.testing.op_builders import OpSpec, Values, arg, program, raw, spec


@program('matmul')
def matmul(entries) -> List[OpSpec]:
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


@program('nn')
def nn(entries) -> List[OpSpec]:
  """Convolutions, pooling, their gradients, fused batch norm and its gradient."""
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

  def batch_norm_grad(forward, op, reserve_space=False):
    def fn(dy, a, scale, offset):
      empty = tf.zeros([0], tf.float32)
      fwd = raw(forward, a, scale, offset, empty, empty, epsilon=1e-3, is_training=True)
      extra = [fwd[5]] if reserve_space else []  # V3 reads the forward's reserve space 3
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
  out += [
    spec('FusedBatchNorm', batch_norm('FusedBatchNorm'), *bn),
    spec('FusedBatchNormV2', batch_norm('FusedBatchNormV2'), *bn),
    spec('FusedBatchNormV3', batch_norm('FusedBatchNormV3'), *bn),
  ]

  def inference(a, scale, offset, mean, variance):
    return raw(
      'FusedBatchNormV3', a, scale, offset, mean, variance, epsilon=1e-3, is_training=False
    )[0]

  out.append(spec('FusedBatchNormV3/inference', inference, *bn))
  out += [
    spec('FusedBatchNormGrad', batch_norm_grad('FusedBatchNorm', 'FusedBatchNormGrad'), *bn_grad),
    spec(
      'FusedBatchNormGradV2',
      batch_norm_grad('FusedBatchNormV2', 'FusedBatchNormGradV2'),
      *bn_grad,
    ),
    spec(
      'FusedBatchNormGradV3',
      batch_norm_grad('FusedBatchNormV3', 'FusedBatchNormGradV3', reserve_space=True),
      *bn_grad,
    ),
  ]
  return out
