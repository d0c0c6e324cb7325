"""Propagation on hand-built IR programs: passes, priorities, conflicts, control flow,
provenance."""

import warnings

import pytest
import tensorflow as tf

import tf_gspmd
from tf_gspmd import Mesh, NamedSharding, P, Sharding
from tf_gspmd.propagation.builder import Func, GraphBuilder, program
from tf_gspmd.propagation.propagate import (
  ANNOTATION,
  AUXILIARY,
  BACKWARD,
  FORWARD,
  NO_RULE,
  SCALAR,
  UNKNOWN_RANK,
  VARIABLE,
  PropagationWarning,
  propagate_program,
)

MESH = Mesh.create((2, 4), ('data', 'model'))


def ns(*spec):
  return NamedSharding(MESH, P(*spec))


def spec(result, name, graph=None):
  return result.sharding(name, graph).spec


def mlp_program():
  b = GraphBuilder()
  x = b.placeholder('x', (8, 16), annotation=ns('data', None))
  w1 = b.placeholder('w1', (16, 32), annotation=ns(None, 'model'))
  w2 = b.placeholder('w2', (32, 16), annotation=ns('model', None))
  h = b.op('MatMul', [x, w1], [(8, 32)], name='hidden')
  r = b.op('Relu', [h], [(8, 32)], name='relu')
  y = b.op('MatMul', [r, w2], [(8, 16)], name='out')
  return program(b.graph([y]))


def test_megatron_mlp_on_hand_built_graph():
  res = propagate_program(mlp_program(), MESH)
  assert spec(res, 'hidden:0') == P('data', 'model')
  assert spec(res, 'relu') == P('data', 'model')
  # The second matmul contracts over 'model': partial sums resolve to P('data', None).
  assert spec(res, 'out:0') == P('data', None)
  prov = res.provenance_of('out:0')
  assert prov.kind == FORWARD and prov.path == ('hidden', 'relu', 'out')
  assert prov.origin == 'x:0' and prov.source == 'relu:0'
  assert res.provenance_of('x:0').kind == ANNOTATION
  table = res.explain().splitlines()
  assert table[0].startswith('Sharding propagation on Mesh(data=2, model=4): 6 tensors')
  row = [line.split() for line in table if line.startswith('out ')][0]
  assert row[:3] == ['out', 'MatMul', '0'] and "P('data', None)" in ' '.join(row)
  assert 'forward' in row and 'x:0' in row
  assert {r['tensor'] for r in res.records()} == {
    'x:0',
    'w1:0',
    'w2:0',
    'hidden:0',
    'relu:0',
    'out:0',
  }


def test_backward_propagation_and_annotations_never_overridden():
  b = GraphBuilder()
  x = b.placeholder('x', (8, 16))
  w = b.placeholder('w', (16, 32))
  y = b.op('MatMul', [x, w], [(8, 32)], name='y')
  # Fully annotated result, and a conflicting closed annotation on x's consumer.
  z = b.op('Identity', [y], [(8, 32)], name='z', annotation=ns('data', 'model'))
  q = b.op('Neg', [x], [(8, 16)], name='q', annotation=ns(None, 'data'))
  res = propagate_program(program(b.graph([z, q])), MESH)
  assert spec(res, 'z') == P('data', 'model') and spec(res, 'q') == P(None, 'data')
  assert spec(res, 'y') == P('data', 'model')
  assert res.provenance_of('y').kind == BACKWARD
  # x is reached two ways: through the pass-through Neg (level 0) it takes q's P(None, 'data')
  # first; through the MatMul (level 1) 'data' on dim 0 would use the axis twice, so it stays.
  assert spec(res, 'x') == P(None, 'data')
  assert res.provenance_of('x').op == 'q' and res.provenance_of('x').level == 0
  assert spec(res, 'w') == P(None, 'model')


def test_unspecified_dims_stay_open():
  b = GraphBuilder()
  x = b.placeholder('x', (8, 16))
  a = b.op(
    'XlaSharding',
    [x],
    [(8, 16)],
    name='ann',
    annotation=ns('data', None),
    attrs={'unspecified_dims': [1]},
  )
  closed = b.op('XlaSharding', [x], [(8, 16)], name='closed', annotation=ns('data', None))
  w = b.placeholder('w', (16, 16), annotation=ns(None, 'model'))
  y = b.op('AddV2', [a, b.op('Identity', [w], [(16, 16)], name='wid')], [(8, 16)], name='y')
  y2 = b.op('AddV2', [closed, b.op('Identity', [w], [(16, 16)], name='wid2')], [(8, 16)], name='y2')
  res = propagate_program(program(b.graph([y, y2])), MESH)
  assert spec(res, 'ann') == P('data', 'model')  # dim 1 was left to propagation
  assert spec(res, 'closed') == P('data', None)  # dim 1 explicitly replicated
  assert spec(res, 'y2') == P('data', 'model')


def test_conflicting_operands_take_the_sharding_over_more_devices():
  b = GraphBuilder()
  a = b.placeholder('a', (8, 16), annotation=ns('data', None))
  c = b.placeholder('c', (8, 16), annotation=ns('model', None))
  y = b.op('AddV2', [a, c], [(8, 16)], name='y')
  res = propagate_program(program(b.graph([y])), MESH)
  assert spec(res, 'y') == P('model', None)
  assert res.provenance_of('y').source == 'c:0'


def test_broadcast_operand_shards_the_result_only_last():
  """A bias split 8 ways loses to the activation's 4-way split that reaches it first."""

  def build(with_activation_path):
    b = GraphBuilder()
    a = b.placeholder('a', (8, 16), annotation=ns(None, 'model') if with_activation_path else None)
    x = b.op('Relu', [a], [(8, 16)], name='x')
    bias = b.placeholder('bias', (16,), annotation=ns(('data', 'model')))
    y = b.op('BiasAdd', [x, bias], [(8, 16)], name='y')
    return program(b.graph([y]))

  res = propagate_program(build(True), MESH)
  assert spec(res, 'y') == P(None, 'model')
  assert res.provenance_of('y').level == 1
  # With nothing else reaching it, the bias shards the result (at the last level).
  # With nothing else reaching it, the bias shards the activation backward (level 1), and the
  # activation shards the result.
  res = propagate_program(build(False), MESH)
  assert spec(res, 'y') == P(None, ('data', 'model'))
  assert spec(res, 'x') == P(None, ('data', 'model'))
  assert res.provenance_of('x').kind == BACKWARD and res.provenance_of('y').origin == 'bias:0'
  assert spec(res, 'a') == P(None, ('data', 'model'))


def test_reshape_keeps_a_sharded_dim_across_merge_and_split():
  b = GraphBuilder()
  x = b.placeholder('x', (8, 4, 16), annotation=ns('data', None, 'model'))
  flat = b.op('Reshape', [x, b.const([32, 16], name='s1')], [(32, 16)], name='flat')
  back = b.op('Reshape', [flat, b.const([8, 4, 16], name='s2')], [(8, 4, 16)], name='back')
  res = propagate_program(program(b.graph([back])), MESH)
  assert spec(res, 'flat') == P('data', 'model')
  assert spec(res, 'back') == P('data', None, 'model')
  assert res.provenance_of('s1').kind == AUXILIARY


def test_op_without_rule_warns_once_and_is_replicated():
  b = GraphBuilder()
  x = b.placeholder('x', (8, 16), annotation=ns('data', None))
  u1 = b.op('MysteryOp', [x], [(8, 16)], name='u1')
  u2 = b.op('MysteryOp', [u1], [(8, 16)], name='u2')
  y = b.op('Relu', [u2], [(8, 16)], name='y')
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter('always')
    res = propagate_program(program(b.graph([y])), MESH)
  ours = [w for w in caught if issubclass(w.category, PropagationWarning)]
  assert len(ours) == 1 and 'MysteryOp' in str(ours[0].message)
  assert res.warnings == [str(ours[0].message)]
  assert spec(res, 'u1') == P(None, None) and res.provenance_of('u2').kind == NO_RULE
  assert spec(res, 'y') == P(None, None)


def test_scalars_and_unknown_ranks_are_replicated():
  b = GraphBuilder()
  s = b.placeholder('s', ())
  u = b.placeholder('u', None)
  y = b.op('Neg', [u], [None], name='y')
  with pytest.warns(PropagationWarning, match='result rank is unknown'):
    res = propagate_program(program(b.graph([s, y])), MESH)
  assert spec(res, 's') == P() and res.provenance_of('s').kind == SCALAR
  assert spec(res, 'u') == P() and res.provenance_of('u').kind == UNKNOWN_RANK


def test_annotation_not_expressible_on_mesh_raises():
  b = GraphBuilder()
  b.placeholder('x', (8, 16), annotation=Sharding.tiled([[0], [3]]))
  with pytest.raises(ValueError, match=r'x:0.*cannot be written'):
    propagate_program(program(b.graph()), MESH)


def test_variables_reads_updates_and_slots():
  w = tf.Variable(tf.zeros((16, 32)), name='w')
  slot = tf.Variable(tf.zeros((16, 32)), name='slot')
  tf_gspmd.shard_variable(w, MESH, P(None, 'model'))
  b = GraphBuilder()
  x = b.placeholder('x', (8, 16), annotation=ns('data', None))
  wr = b.resource('w_handle', (16, 32))
  sr = b.resource('slot_handle', (16, 32))
  wv = b.op('ReadVariableOp', [wr], [(16, 32)], name='read_w')
  y = b.op('MatMul', [x, wv], [(8, 32)], name='y')
  dy = b.op('OnesLike', [y], [(8, 32)], name='dy')
  dw = b.op('MatMul', [x, dy], [(16, 32)], name='dw', attrs={'transpose_a': True})
  sv = b.op('ReadVariableOp', [sr], [(16, 32)], name='read_slot')
  new_slot = b.op('AddV2', [sv, dw], [(16, 32)], name='new_slot')
  b.op('AssignVariableOp', [sr, new_slot], [], name='assign_slot')
  b.op('AssignSubVariableOp', [wr, new_slot], [], name='update_w')
  prog = program(b.graph([y]), variables={'w_handle:0': w, 'slot_handle:0': slot})
  res = propagate_program(prog, MESH)
  assert res.provenance_of('w_handle:0').kind == VARIABLE
  assert spec(res, 'w_handle') == P(None, 'model')
  assert spec(res, 'y') == P('data', 'model')
  assert spec(res, 'dw') == P(None, 'model')  # the gradient has the variable's sharding
  assert spec(res, 'slot_handle') == P(None, 'model')  # ... and so does the slot
  assert spec(res, 'read_slot') == P(None, 'model')


def _while_program(annotate_body=False):
  """i, x = while i < 3: (i + 1, tanh(x) [annotated in the body?])."""
  cb = GraphBuilder('cond')
  ci = cb.placeholder('i', (), dtype=tf.int32)
  cx = cb.placeholder('x', (8, 16))
  lt = cb.op('Less', [ci, cb.const(3, name='three')], [()], name='lt', dtypes=[tf.bool])
  cond = cb.graph([lt], [ci, cx])
  bb = GraphBuilder('body')
  bi = bb.placeholder('i', (), dtype=tf.int32)
  bx = bb.placeholder('x', (8, 16))
  inc = bb.op('AddV2', [bi, bb.const(1, name='one')], [()], name='inc', dtypes=[tf.int32])
  t = bb.op(
    'Tanh', [bx], [(8, 16)], name='t', annotation=ns(None, 'model') if annotate_body else None
  )
  body = bb.graph([inc, t], [bi, bx])
  b = GraphBuilder()
  i0 = b.const(0, name='i0')
  x = b.placeholder('x', (8, 16), annotation=ns('data', None))
  outs = b.op(
    'While',
    [i0, x],
    [(), (8, 16)],
    name='loop',
    dtypes=[tf.int32, tf.float32],
    attrs={'cond': Func('cond'), 'body': Func('body')},
  )
  y = b.op('Relu', [outs[1]], [(8, 16)], name='y')
  return program(b.graph([y]), [cond, body])


def test_while_body_condition_and_results_share_the_loop_sharding():
  res = propagate_program(_while_program(), MESH)
  for name, graph in (
    ('x:0', 'body'),
    ('t:0', 'body'),
    ('x:0', 'cond'),
    ('loop:1', None),
    ('y:0', None),
  ):
    assert spec(res, name, graph) == P('data', None), (name, graph)
  assert spec(res, 'body::t:0') == P('data', None)
  assert res.provenance_of('body::x:0').kind == FORWARD
  assert spec(res, 'loop:0') == P()


def test_annotation_inside_a_while_body_flows_out_and_into_the_condition():
  res = propagate_program(_while_program(annotate_body=True), MESH)
  assert spec(res, 'body::t:0') == P(None, 'model')  # annotated, unchanged
  assert spec(res, 'body::x:0') == P('data', 'model')  # merged: loop input + body result
  assert spec(res, 'cond::x:0') == P('data', 'model')
  assert spec(res, 'loop:1') == P('data', 'model')
  assert spec(res, 'y') == P('data', 'model')
  assert spec(res, 'x') == P('data', None)  # the user's annotation stays


def test_if_branches_agree():
  branches = []
  for name, op in (('then', 'Relu'), ('else', 'Neg')):
    gb = GraphBuilder(name)
    a = gb.placeholder('a', (8, 16))
    r = gb.op(op, [a], [(8, 16)], name='r')
    branches.append(gb.graph([r], [a]))
  b = GraphBuilder()
  c = b.placeholder('c', (), dtype=tf.bool)
  x = b.placeholder('x', (8, 16))
  out = b.op(
    'StatelessIf',
    [c, x],
    [(8, 16)],
    name='if',
    attrs={'then_branch': Func('then'), 'else_branch': Func('else')},
  )
  b.op('Identity', [out], [(8, 16)], name='z', annotation=ns(None, 'model'))
  res = propagate_program(program(b.graph(['z:0']), branches), MESH)
  for name in ('then::a:0', 'then::r:0', 'else::a:0', 'else::r:0', 'if:0', 'x:0'):
    assert spec(res, name) == P(None, 'model'), name
  assert res.provenance_of('x:0').kind == BACKWARD


def test_propagation_is_deterministic():
  first = propagate_program(_while_program(True), MESH).records()
  second = propagate_program(_while_program(True), MESH).records()
  assert first == second
