"""Op rules: golden texts, the support table, coverage of Keras steps, and rule semantics."""

import os

import numpy as np
import pytest

from tf_gspmd import Mesh, NamedSharding, P
from tf_gspmd.propagation import registry, support_table
from tf_gspmd.propagation.builder import GraphBuilder
from tf_gspmd.propagation.ops_shape import reshape_factors
from tf_gspmd.propagation.rule import NEED_REPLICATION, REDUCTION, OpRule
from tf_gspmd.propagation.rule_builders import Namer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GOLDEN = os.path.join(ROOT, 'tests', 'golden', 'op_rules.txt')
SUPPORT_TABLE = os.path.join(ROOT, 'docs', 'support_table.md')
MESH = Mesh.create((2, 4), ('data', 'model'))

# Every op type measured in Keras 3 training steps (forward, gradients, Adam, metrics) of an
# MLP, a transformer encoder block (MultiHeadAttention, LayerNormalization, Dropout,
# Embedding) and a CNN (Conv2D, BatchNormalization, MaxPooling2D, GlobalAveragePooling2D).
KERAS_STEP_OPS = [
  'AddN',
  'AddV2',
  'ArgMax',
  'AssignAddVariableOp',
  'AssignSubVariableOp',
  'AssignVariableOp',
  'BatchMatMulV2',
  'BiasAdd',
  'BiasAddGrad',
  'Bitcast',
  'BitwiseAnd',
  'BroadcastGradientArgs',
  'Cast',
  'ConcatV2',
  'Const',
  'Conv2D',
  'Conv2DBackpropFilter',
  'Conv2DBackpropInput',
  'DivNoNan',
  'Einsum',
  'Equal',
  'Erfc',
  'Exp',
  'ExpandDims',
  'FloorDiv',
  'FloorMod',
  'GatherV2',
  'GreaterEqual',
  'Identity',
  'IdentityN',
  'Less',
  'LogicalAnd',
  'MatMul',
  'MaxPool',
  'MaxPoolGrad',
  'Maximum',
  'Mean',
  'Mul',
  'Neg',
  'NoOp',
  'Placeholder',
  'Pow',
  'Prod',
  'ReadVariableOp',
  'RealDiv',
  'Relu',
  'ReluGrad',
  'Reshape',
  'Rsqrt',
  'RsqrtGrad',
  'SelectV2',
  'ShapeN',
  'Softmax',
  'SparseSoftmaxCrossEntropyWithLogits',
  'Sqrt',
  'Square',
  'SquaredDifference',
  'Squeeze',
  'StatelessRandomGetKeyCounter',
  'StatelessRandomUniformV2',
  'StopGradient',
  'StridedSlice',
  'Sub',
  'Sum',
  'Tile',
  'UnsortedSegmentSum',
]


def _rule(build):
  b = GraphBuilder()
  name = build(b)
  graph = b.graph()
  return registry.rule_for(graph.node(name), registry.RuleContext(graph, b.resource_shapes))


def test_golden_rule_texts_are_up_to_date():
  with open(GOLDEN) as f:
    committed = f.read()
  assert committed == support_table.golden_text(), (
    'rule texts changed; if intended, regenerate tests/golden/op_rules.txt with '
    'python -m tf_gspmd.propagation.support_table'
  )
  lines = committed.splitlines()
  assert [n.split(':')[0] for n in lines] == sorted(n.split(':')[0] for n in lines)
  assert 'MatMul: ([i,k],[k,j])->([i,j]) reduction={k}' in lines


def test_support_table_is_up_to_date():
  with open(SUPPORT_TABLE) as f:
    assert f.read() == support_table.support_table(), (
      'docs/support_table.md is stale: run python -m tf_gspmd.propagation.support_table'
    )


def test_every_keras_step_op_type_has_a_rule():
  missing = [op for op in KERAS_STEP_OPS if registry.lookup(op) is None]
  assert not missing
  families = registry.families()
  assert set(families) >= {
    'elementwise',
    'matmul',
    'reduction',
    'shape',
    'nn',
    'variables',
    'control_flow',
  }
  assert 'Conv2D' in families['nn'] and 'While' in families['control_flow']


def test_rule_kinds_and_validation():
  r = OpRule(operands=(('i', 'k'), ('k', 'j')), results=(('i', 'j'),), kinds={'k': REDUCTION})
  assert r.factors() == ('i', 'k', 'j')
  assert r.kind('i') == 'pass_through' and not r.is_pass_through
  with pytest.raises(ValueError, match='reduction factor'):
    OpRule(operands=(('i',),), results=(('i',),), kinds={'i': REDUCTION})
  with pytest.raises(ValueError, match='unknown kind'):
    OpRule(operands=(('i',),), results=(('i',),), kinds={'i': 'sideways'})


def test_matmul_infer_and_require():
  r = _rule(
    lambda b: b.op(
      'MatMul',
      [b.placeholder('x', (8, 16)), b.placeholder('w', (16, 32))],
      [(8, 32)],
      name='y',
      attrs={'transpose_b': False},
    ).split(':')[0]
  )
  x = NamedSharding(MESH, P('data', 'model'))
  w = NamedSharding(MESH, P('model', None))
  # The contracting dim is sharded: the result is the non-partial sharding of i, j.
  assert r.infer_results([x, w], MESH, [(8, 32)]) == [NamedSharding(MESH, P('data', None))]
  req = r.required_operands([NamedSharding(MESH, P('data', 'model'))], MESH, [(8, 16), (16, 32)])
  assert req == [NamedSharding(MESH, P('data', None)), NamedSharding(MESH, P(None, 'model'))]


def test_transposed_matmul_and_batch_matmul_broadcast():
  r = _rule(
    lambda b: b.op(
      'MatMul',
      [b.placeholder('x', (16, 8)), b.placeholder('w', (32, 16))],
      [(8, 32)],
      name='y',
      attrs={'transpose_a': True, 'transpose_b': True},
    ).split(':')[0]
  )
  assert r.text() == '([k,i],[j,k])->([i,j]) reduction={k}'
  r = _rule(
    lambda b: b.op(
      'BatchMatMulV2',
      [b.placeholder('x', (2, 1, 8, 16)), b.placeholder('w', (3, 16, 4))],
      [(2, 3, 8, 4)],
      name='y',
    ).split(':')[0]
  )
  assert r.text() == '([l,-,i,k],[m,k,j])->([l,m,i,j]) reduction={k}'
  assert r.broadcast_operands == (0, 1)


def test_einsum_with_ellipsis():
  r = _rule(
    lambda b: b.op(
      'Einsum',
      [b.placeholder('x', (2, 3, 10, 16)), b.placeholder('w', (16, 8))],
      [(2, 3, 10, 8)],
      name='y',
      attrs={'equation': '...c,cd->...d'},
    ).split(':')[0]
  )
  assert r.text() == '([i,j,k,c],[c,d])->([i,j,k,d]) reduction={c}'


@pytest.mark.parametrize(
  'src,dst,expect_in,expect_out',
  [
    ((8, 4), (32,), ('i', 'j'), (('i', 'j'),)),
    ((32,), (8, 4), (('i', 'j'),), ('i', 'j')),
    ((4, 1, 6), (4, 6), ('i', None, 'j'), ('i', 'j')),
    # 6x4 -> 4x6: only a common major factor of 2; the coprime rest must stay whole.
    ((6, 4), (4, 6), (('i', 'j'), 'k'), (('i', 'l'), 'm')),
  ],
)
def test_reshape_factorization(src, dst, expect_in, expect_out):
  in_dims, out_dims, sizes, kinds = reshape_factors(src, dst, Namer())
  assert in_dims == expect_in and out_dims == expect_out
  shared = {
    f
    for e in in_dims + out_dims
    if e
    for f in ((e,) if isinstance(e, str) else e)
    if kinds.get(f) != NEED_REPLICATION
  }
  assert shared == ({'i'} if src == (6, 4) else shared)
  # Every factor of both sides multiplies back to the dim sizes.
  for shape, dims in ((src, in_dims), (dst, out_dims)):
    for s, e in zip(shape, dims):
      fs = () if e is None else ((e,) if isinstance(e, str) else e)
      assert int(np.prod([sizes[f] for f in fs])) == s


def test_reshape_keeps_sharding_of_merged_and_split_dims():
  def merge(b):
    x = b.placeholder('x', (8, 4, 16))
    return b.op('Reshape', [x, b.const([32, 16])], [(32, 16)], name='y').split(':')[0]

  r = _rule(merge)
  # A sharded major dim stays sharded after merging with the minor one.
  out = r.infer_results([NamedSharding(MESH, P('data', 'model', None)), None], MESH, [(32, 16)])
  assert out == [NamedSharding(MESH, P('data', None))]
  # Sharding the merged dim 8 ways lands on the major factor (8 rows of 4).
  back = r.required_operands(
    [NamedSharding(MESH, P(('data', 'model'), None))], MESH, [(8, 4, 16), None]
  )
  assert back[0] == NamedSharding(MESH, P(('data', 'model'), None, None))


def test_strided_slice_masks_and_windows():
  def build(b):
    x = b.placeholder('x', (4, 8, 6))
    ins = [x, b.const([0, 2, 0]), b.const([0, 8, 1]), b.const([1, 2, 1])]
    return b.op(
      'StridedSlice',
      ins,
      [(4, 3)],
      name='y',
      attrs={'begin_mask': 1, 'end_mask': 1, 'new_axis_mask': 0, 'shrink_axis_mask': 4},
    ).split(':')[0]

  r = _rule(build)
  # dim 0 whole, dim 1 rows 2,4,6 (a stride-2 window at offset 2), dim 2 shrunk away: one
  # row picked from its shards (a reduction: the pick, then a sum over the shards).
  assert r.text().startswith('([i,j,k],_,_,_)->([i,j]) reduction={k}')
  w = r.windows['j']
  assert (w.stride, w.pad_lo, w.input_size, w.output_size) == (2, -2, 8, 3)


def test_conv_windows_match_same_padding():
  def build(b):
    x = b.placeholder('x', (2, 15, 16, 3))
    f = b.placeholder('f', (3, 3, 3, 8))
    return b.op(
      'Conv2D',
      [x, f],
      [(2, 8, 8, 8)],
      name='y',
      attrs={'strides': [1, 2, 2, 1], 'padding': 'SAME', 'dilations': [1, 1, 1, 1]},
    ).split(':')[0]

  r = _rule(build)
  assert r.kind('c') == REDUCTION and r.kind('kh') == NEED_REPLICATION
  assert r.windows['h'].output_size == 8 and r.windows['w'].output_size == 8
  assert (r.windows['h'].pad_lo, r.windows['h'].pad_hi) == (1, 1)


def test_variable_rules_use_the_value_shape():
  def build(b):
    v = b.resource('v', (16, 32))
    return b.op(
      'ResourceApplyAdam',
      [v, b.resource('m', (16, 32)), b.resource('u', (16, 32))]
      + [b.placeholder(f's{i}', ()) for i in range(6)]
      + [b.placeholder('g', (16, 32))],
      [],
      name='apply',
    )

  r = _rule(lambda b: (build(b), 'apply')[1])
  assert r.text() == '([i,j],[i,j],[i,j],[],[],[],[],[],[],[i,j])->()'


def test_unregistered_op_has_no_rule():
  assert registry.lookup('NoSuchOpType') is None
  assert 'NoSuchOpType' not in registry.op_types()
