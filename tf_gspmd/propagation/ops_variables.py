"""Variables: reads, assigns, optimizer updates, gathers and scatters on resources.

A resource handle is a scalar, but its sharding here is the sharding of the
variable value it refers to (the rule context knows that value's shape). So a
variable's annotation flows to its reads, and from the assigned values and
optimizer updates back to the variable: gradients and slot variables end up
with their variable's sharding.
"""

from __future__ import annotations

from tf_gspmd.propagation.ops_indexing import gather_rule
from tf_gspmd.propagation.registry import RuleError, attr, declare, register
from tf_gspmd.propagation.rule import NEED_REPLICATION, REDUCTION
from tf_gspmd.propagation.rule_builders import Namer, make_rule, replicated_results

# Dense optimizer updates: op type -> positions of the inputs shaped like the variable.
APPLY_OPS = {
  'ResourceApplyGradientDescent': (3, (0, 2)),
  'ResourceApplyMomentum': (5, (0, 1, 3)),
  'ResourceApplyKerasMomentum': (5, (0, 1, 3)),
  'ResourceApplyAdagrad': (4, (0, 1, 3)),
  'ResourceApplyAdagradV2': (5, (0, 1, 4)),
  'ResourceApplyAdam': (10, (0, 1, 2, 9)),
  'ResourceApplyAdamWithAmsgrad': (11, (0, 1, 2, 3, 10)),
  'ResourceApplyAdaMax': (9, (0, 1, 2, 8)),
  'ResourceApplyAdadelta': (7, (0, 1, 2, 6)),
  'ResourceApplyRMSProp': (8, (0, 1, 2, 7)),
  'ResourceApplyCenteredRMSProp': (9, (0, 1, 2, 3, 8)),
}


def _value_shape(node, ctx):
  """The variable's shape: from the handle's known value shape or from a value operand/result."""
  shape = ctx.shape(node.inputs[0])
  if shape is None and node.outputs:
    shape = ctx.out_shape(node)
  if shape is None and len(node.inputs) > 1:
    shape = ctx.shape(node.inputs[1])
  if shape is None:
    raise RuleError(f'{node.op} {node.name}: the shape of variable {node.inputs[0]} is unknown.')
  return shape


def read_variable(node, ctx):
  shape = _value_shape(node, ctx)
  dims = tuple(Namer().take(len(shape)))
  return make_rule([dims], [dims], [shape], [shape])


def assign_variable(node, ctx):
  """Assign{,Add,Sub}VariableOp(resource, value): the value has the variable's layout."""
  shape = _value_shape(node, ctx)
  dims = tuple(Namer().take(len(shape)))
  return make_rule(
    [dims, dims], [None] * len(node.outputs), [shape, shape], [None] * len(node.outputs)
  )


def apply_update(node, ctx):
  _, shaped = APPLY_OPS[node.op]
  shape = _value_shape(node, ctx)
  dims = tuple(Namer().take(len(shape)))
  operands, shapes = [], []
  for i, t in enumerate(node.inputs):
    if i in shaped:
      operands.append(dims)
      shapes.append(shape)
    else:
      s = ctx.shape(t)
      operands.append(None if s is None or len(s) != 0 else ())
      shapes.append(s)
  return make_rule(operands, [None] * len(node.outputs), shapes, [None] * len(node.outputs))


def resource_gather(node, ctx):
  """ResourceGather(resource, indices): a gather along dim 0 (or batch_dims) of the variable."""
  shape = ctx.shape(node.inputs[0])
  if shape is None:
    raise RuleError(
      f'ResourceGather {node.name}: the shape of variable {node.inputs[0]} is unknown.'
    )
  batch_dims = attr(node, 'batch_dims', 0)
  return gather_rule(node, ctx, shape, batch_dims, batch_dims, 0, 1)


def resource_scatter(node, ctx, idx_kind=NEED_REPLICATION):
  """ResourceScatter{Update,Mul,Div,Max,Min}(resource, indices, updates): masked local
  updates, every index seen by every partition."""
  shape = ctx.shape(node.inputs[0])
  i_shape, u_shape = ctx.shape(node.inputs[1]), ctx.shape(node.inputs[2])
  if shape is None:
    raise RuleError(f'{node.op} {node.name}: the shape of variable {node.inputs[0]} is unknown.')
  namer = Namer()
  v_dims = namer.take(len(shape))
  idx = namer.take(len(i_shape))
  u_dims = tuple(idx) + tuple(v_dims[1:]) if u_shape is not None and len(u_shape) else ()
  return make_rule(
    [tuple(v_dims), tuple(idx), u_dims],
    [None] * len(node.outputs),
    [shape, i_shape, u_shape],
    [None] * len(node.outputs),
    kinds={f: idx_kind for f in idx},
  )


def resource_scatter_add(node, ctx):
  """ResourceScatter{Add,Sub}: the index dims may be split, a reduction (each partition sums
  its updates into rows, the sums reduce-scattered onto the variable's layout)."""
  return resource_scatter(node, ctx, idx_kind=REDUCTION)


def var_handle(node, ctx):
  """VarHandleOp: a handle tied to nothing; its variable's layout comes from its users."""
  shape = attr(node, 'shape')
  if shape is None or None in shape or any(s < 0 for s in shape):
    raise RuleError(f'VarHandleOp {node.name}: the variable shape {shape} is not static.')
  return make_rule([], [tuple(Namer().take(len(shape)))], [], [shape])


def variable_shape(node, ctx):
  return replicated_results(node, ctx, data_operands=[0])


def var_is_initialized(node, ctx):
  """VarIsInitializedOp: a scalar; the variable is only asked about, in whatever layout it has."""
  return replicated_results(node, ctx, data_operands=[0])


# --- examples ---------------------------------------------------------------------------
def _read_example(b):
  v = b.resource('v', (16, 32))
  b.op('ReadVariableOp', [v], [(16, 32)], name='y')
  return 'y'


def _assign_example(op):
  def build(b):
    v = b.resource('v', (16, 32))
    x = b.placeholder('x', (16, 32))
    b.op(op, [v, x], [], name='y')
    return 'y'

  return build


def _apply_example(op):
  def build(b):
    n, shaped = APPLY_OPS[op]
    inputs = []
    for i in range(n):
      if i in shaped:
        inputs.append(
          b.resource(f'v{i}', (16, 32)) if i != shaped[-1] else b.placeholder('grad', (16, 32))
        )
      else:
        inputs.append(b.placeholder(f's{i}', ()))
    b.op(op, inputs, [], name='y')
    return 'y'

  return build


def _resource_gather_example(b):
  import tensorflow as tf

  v = b.resource('v', (50, 16))
  i = b.placeholder('indices', (4, 10), dtype=tf.int32)
  b.op('ResourceGather', [v, i], [(4, 10, 16)], name='y', attrs={'batch_dims': 0})
  return 'y'


def _scatter_example(op):
  def build(b):
    import tensorflow as tf

    v = b.resource('v', (50, 16))
    i = b.placeholder('indices', (6,), dtype=tf.int32)
    u = b.placeholder('updates', (6, 16))
    b.op(op, [v, i, u], [], name='y')
    return 'y'

  return build


def _var_handle_example(b):
  import tensorflow as tf

  b.op('VarHandleOp', [], [()], name='y', dtypes=[tf.resource], attrs={'shape': [16, 32]})
  return 'y'


def _variable_shape_example(b):
  import tensorflow as tf

  v = b.resource('v', (16, 32))
  b.op('VariableShape', [v], [(2,)], name='y', dtypes=[tf.int32])
  return 'y'


def _var_is_initialized_example(b):
  import tensorflow as tf

  v = b.resource('v', (16, 32))
  b.op('VarIsInitializedOp', [v], [()], name='y', dtypes=[tf.bool])
  return 'y'


register('ReadVariableOp', 'variables', read_variable, _read_example)
register(
  ['AssignVariableOp', 'AssignAddVariableOp', 'AssignSubVariableOp'],
  'variables',
  assign_variable,
  _assign_example('AssignVariableOp'),
)
for _op in APPLY_OPS:
  register(_op, 'variables', apply_update, _apply_example(_op))
register('ResourceGather', 'variables', resource_gather, _resource_gather_example)
register(
  ['ResourceScatterAdd', 'ResourceScatterSub'],
  'variables',
  resource_scatter_add,
  _scatter_example('ResourceScatterAdd'),
)
register(
  [
    'ResourceScatterUpdate',
    'ResourceScatterMax',
    'ResourceScatterMin',
    'ResourceScatterMul',
    'ResourceScatterDiv',
  ],
  'variables',
  resource_scatter,
  _scatter_example('ResourceScatterUpdate'),
)
register('VarHandleOp', 'variables', var_handle, _var_handle_example)
register('VariableShape', 'variables', variable_shape, _variable_shape_example)
register('VarIsInitializedOp', 'variables', var_is_initialized, _var_is_initialized_example)


# --- properties ---------------------------------------------------------------------
declare('VarHandleOp', resource='declares')
declare('ReadVariableOp', local='read_variable', resource='reads', aliasing=True)
declare(
  ['AssignVariableOp', 'AssignAddVariableOp', 'AssignSubVariableOp'],
  local='assign_variable',
  resource='assigns',
)
declare(list(APPLY_OPS), local='apply_update')
declare('ResourceGather', local='resource_gather', settles_by_bytes=True)
for _op, _update in (
  ('ResourceScatterAdd', 'add'),
  ('ResourceScatterSub', 'sub'),
  ('ResourceScatterUpdate', 'update'),
  ('ResourceScatterMax', 'max'),
  ('ResourceScatterMin', 'min'),
  ('ResourceScatterMul', 'mul'),
  ('ResourceScatterDiv', 'div'),
):
  declare(_op, local='resource_scatter', local_params={'update': _update}, settles_by_bytes=True)
declare('VariableShape', local='variable_shape')
declare(['ReadVariableOp', 'VarIsInitializedOp', 'VariableShape'], reads_variable_only=True)
declare('VarIsInitializedOp', local='var_is_initialized')

# --- sweep programs (testing/programs/state.py) -----------------------------------
declare(
  ['ReadVariableOp', 'VariableShape', 'VarIsInitializedOp', 'ResourceGather'], sweep='variables'
)
declare(
  'VarHandleOp',
  unswept='variables used by a tf.function are captured resource handles, not VarHandleOp nodes',
)
# `form`: the program's loop sweeping the op.
for _op in ['AssignVariableOp', 'AssignAddVariableOp', 'AssignSubVariableOp']:
  declare(_op, sweep='variables', sweep_params={'form': 'assign'})
# Optimizer updates: slot variables, scalar inputs before the gradient (Momentum's take
# (lr, grad, momentum)).
for _op, _slots, _scalars in [
  ('ResourceApplyGradientDescent', 0, (0.1,)),
  ('ResourceApplyMomentum', 1, (0.1, 0.9)),
  ('ResourceApplyKerasMomentum', 1, (0.1, 0.9)),
  ('ResourceApplyAdagrad', 1, (0.1,)),
  ('ResourceApplyAdagradV2', 1, (0.1, 1e-7)),
  ('ResourceApplyAdadelta', 2, (0.1, 0.95, 1e-7)),
  ('ResourceApplyRMSProp', 2, (0.1, 0.9, 0.5, 1e-7)),
  ('ResourceApplyCenteredRMSProp', 3, (0.1, 0.9, 0.5, 1e-7)),
  ('ResourceApplyAdam', 2, (0.9, 0.999, 0.01, 0.9, 0.999, 1e-7)),
  ('ResourceApplyAdaMax', 2, (0.9, 0.01, 0.9, 0.999, 1e-7)),
  ('ResourceApplyAdamWithAmsgrad', 3, (0.9, 0.999, 0.01, 0.9, 0.999, 1e-7)),
]:
  _params = {'form': 'apply', 'slots': _slots, 'scalars': _scalars}
  _params['momentum_last'] = _op in ('ResourceApplyMomentum', 'ResourceApplyKerasMomentum')
  declare(_op, sweep='variables', sweep_params=_params)
for _op in [
  'ResourceScatterAdd',
  'ResourceScatterSub',
  'ResourceScatterMul',
  'ResourceScatterDiv',
  'ResourceScatterMax',
  'ResourceScatterMin',
  'ResourceScatterUpdate',
]:
  _params = {'form': 'scatter', 'nonzero': _op == 'ResourceScatterDiv'}
  declare(_op, sweep='variables', sweep_params=_params)
