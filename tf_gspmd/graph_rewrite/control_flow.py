"""Partitioning control flow: While and If bodies are partitioned recursively.

Loop-carried values keep one sharding (the one propagation gave the loop's
results), so the partitioned body takes and returns shards of the same
shape. Predicates are replicated so every partition takes the same branch.
Function calls are partitioned inline: their body is emitted at the call site.
"""

from __future__ import annotations

from typing import List

import tensorflow as tf

from tf_gspmd.graph_rewrite.handlers import computes
from tf_gspmd.graph_rewrite.partitioner import Local, Partitioner
from tf_gspmd.tf_private import handle_data_util


def _run_body(p: Partitioner, graph_name: str, tensors, params: List[Local], result_layouts):
  """Partition library function `graph_name` on `tensors` laid out like `params`.

  Runs inside a branch or loop body being traced by TF's control-flow
  builders, which thread any outer tensor the body uses (this partition's
  id, its collective token) through as inputs.
  """
  body = p.program.function(graph_name)
  for inner, outer in zip(tensors, params):
    if outer.tensor is not None and outer.tensor.dtype == tf.resource and inner is not outer.tensor:
      handle_data_util.copy_handle_data(outer.tensor, inner)  # keep the variable's dtype/shape
  args = [Local(t, v.sharding, v.shape) for t, v in zip(tensors, params)]
  outs = p.run_graph(body, args)
  if result_layouts is None:
    return [o.tensor for o in outs]
  return [
    o.tensor
    if layout.tensor is not None and layout.dtype == tf.resource
    else p.reshard(
      _with_static_shape(o, layout), layout.sharding, 'loop-carried or branch result'
    ).tensor
    for o, layout in zip(outs, result_layouts)
  ]


def _with_static_shape(value: Local, layout: Local) -> Local:
  """A body result of run-time shape (replicated) given the static shape the call's result
  has (a cond's gradient branch sizes its dense gradient by a shape passed in as an argument,
  which the branch cannot fold): every branch then returns one static shape."""
  known = all(d is not None for d in layout.shape)
  if not known or all(d is not None for d in value.shape) or not value.sharding.is_replicated:
    return value
  tensor = tf.ensure_shape(value.tensor, layout.shape)
  return Local(tensor, value.sharding, tuple(layout.shape))


def _loop_layouts(p, graph, node, operands) -> List[Local]:
  """Operands moved to the sharding the loop carries them in."""
  moved = []
  for value, out in zip(operands, node.outputs):
    if value.dtype == tf.resource:  # a variable's shard handle keeps its variable's layout
      moved.append(value)
    else:
      moved.append(p.reshard(value, p.target(graph, out.name), 'loop-carried'))
  return moved


def _attr(node, name, default):
  value = node.attrs.get(name)
  return default if value is None else value.i


@computes('while')
def while_handler(p, graph, node, operands):
  carried = _loop_layouts(p, graph, node, operands)
  names = node.called_functions()
  cond_name, body_name = names['cond'][0], names['body'][0]

  def cond(*tensors):
    (pred,) = _run_body(p, cond_name, tensors, carried, None)
    return pred

  def body(*tensors):
    return _run_body(p, body_name, tensors, carried, carried)

  outs = tf.while_loop(
    cond,
    body,
    [v.tensor for v in carried],
    parallel_iterations=_attr(node, 'parallel_iterations', 10),
    name=node.name,
  )
  return [Local(t, v.sharding, v.shape) for t, v in zip(outs, carried)]


def _run_branches(p, graph, node, args: List[Local], choose, branch_names) -> List[Local]:
  """Partition each branch on `args` and let `choose(branch_fns)` pick one at run time.

  Every branch returns its results in the layouts propagation gave the node's
  outputs, so whichever branch runs, consumers see one layout.
  """
  layouts = [Local(None, p.target(graph, t.name), tuple(t.shape or ())) for t in node.outputs]

  def branch(name):
    return lambda: _run_body(p, name, [a.tensor for a in args], args, layouts)

  outs = choose([branch(n) for n in branch_names])
  outs = outs if isinstance(outs, (list, tuple)) else [outs]
  return [Local(t, lay.sharding, lay.shape) for t, lay in zip(outs, layouts)]


@computes('if')
def if_handler(p, graph, node, operands):
  pred = tf.reshape(tf.cast(p.replicate(operands[0], 'branch predicate').tensor, tf.bool), [])
  names = node.called_functions()
  return _run_branches(
    p,
    graph,
    node,
    operands[1:],
    lambda fns: tf.cond(pred, fns[0], fns[1], name=node.name),
    [names['then_branch'][0], names['else_branch'][0]],
  )


@computes('case')
def case_handler(p, graph, node, operands):
  index = tf.reshape(p.replicate(operands[0], 'branch index').tensor, [])
  return _run_branches(
    p,
    graph,
    node,
    operands[1:],
    lambda fns: tf.switch_case(index, fns, name=node.name),
    node.called_functions()['branches'],
  )


@computes('call')
def call_handler(p, graph, node, operands):
  """A call is partitioned inline: its body's ops are emitted here."""
  callee = p.program.function(node.called_functions()['f'][0])
  outs = p.run_graph(callee, operands)
  return [p.finish(graph, o, t.name) for o, t in zip(outs, node.outputs)]
