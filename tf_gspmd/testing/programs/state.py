"""Sweep programs of sources (constants, placeholders, sinks), variables and control flow.

The program `variables` reads `sweep_params['form']` ('assign', 'apply', 'scatter')
of the entries naming it, in `DRAW_ORDER` (the order values are drawn in: one
seeded stream); optimizer updates (`apply`) read `slots` (slot variables), `scalars`
(inputs before the gradient) and `momentum_last`; row updates read `nonzero`.
"""

from __future__ import annotations

from typing import List

import numpy as np
import tensorflow as tf

from tf_gspmd.testing.op_builders import BINARY_SHAPE, OpSpec, Values, arg, program, raw, spec, var
from tf_gspmd.testing.programs import in_draw_order


def _with_control(op, value):
  with tf.control_dependencies([op]):
    return tf.identity(value)


@program('sources')
def sources(entries) -> List[OpSpec]:
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


def _apply(op, n_slots, scalars, momentum_last):
  """ResourceApply<op>(var, *slots, *scalars, grad): returns nothing; the sweep compares
  variables. `momentum_last`: the op takes (lr, grad, momentum), not (*scalars, grad)."""

  def fn(*operands):
    handles = [handle(o) for o in operands[: 1 + n_slots]]
    grad = operands[1 + n_slots]
    if momentum_last:
      raw(op, *handles, scalars[0], grad, scalars[1])
    else:
      raw(op, *handles, *scalars, grad)

  return fn


# Per form, the order values were always drawn in (see `in_draw_order`).
DRAW_ORDER = {
  'assign': ('AssignVariableOp', 'AssignAddVariableOp', 'AssignSubVariableOp'),
  'apply': (
    'ResourceApplyGradientDescent',
    'ResourceApplyMomentum',
    'ResourceApplyKerasMomentum',
    'ResourceApplyAdagrad',
    'ResourceApplyAdagradV2',
    'ResourceApplyAdadelta',
    'ResourceApplyRMSProp',
    'ResourceApplyCenteredRMSProp',
    'ResourceApplyAdam',
    'ResourceApplyAdaMax',
    'ResourceApplyAdamWithAmsgrad',
  ),
  'scatter': (
    'ResourceScatterAdd',
    'ResourceScatterSub',
    'ResourceScatterMul',
    'ResourceScatterDiv',
    'ResourceScatterMax',
    'ResourceScatterMin',
    'ResourceScatterUpdate',
  ),
}


def _in_order(entries, form: str):
  return in_draw_order(entries, form, DRAW_ORDER[form])


@program('variables')
def variables(entries) -> List[OpSpec]:
  """Reads, assignments, optimizer updates and row updates of variables."""
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
  for e in _in_order(entries, 'assign'):
    op = e.op_type
    out.append(spec(op, _assign(op), var(v.uniform(BINARY_SHAPE)), arg(v.uniform(BINARY_SHAPE))))
  for e in _in_order(entries, 'apply'):
    op, params = e.op_type, e.sweep_params
    slots = params['slots']
    slot_values = [var(v.uniform(BINARY_SHAPE, 0.1, 1.0)) for _ in range(slots)]
    out.append(
      spec(
        op,
        _apply(op, slots, params['scalars'], params.get('momentum_last', False)),
        var(v.uniform(BINARY_SHAPE)),
        *slot_values,
        arg(v.uniform(BINARY_SHAPE)),
        shard_outputs=False,
      )
    )
  for e in _in_order(entries, 'scatter'):

    def fn(w, i, u, op=e.op_type):
      raw(op, handle(w), i, u)
      return w.read_value()

    op = e.op_type
    # A division's updates stay away from zero.
    updates = v.nonzero((4, 3)) if e.sweep_params.get('nonzero') else v.uniform((4, 3))
    out.append(
      spec(op, fn, var(v.uniform((10, 3))), arg(np.array([7, 0, 3, 9], np.int32)), arg(updates))
    )
  return out


@program('control_flow')
def control_flow(entries) -> List[OpSpec]:
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
