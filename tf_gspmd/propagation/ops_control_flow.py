"""Control flow and function calls: While, If, Case, PartitionedCall.

These ops have no factor rule; they tie tensors of the caller and of the
called library functions into groups that share one sharding:

- While: loop input k, the condition's and the body's argument k, the body's
  result k and the loop's output k.
- If/Case: input k+1 and argument k of every branch; result k of every branch
  and output k.
- PartitionedCall: input k and argument k; result k and output k.

Propagation merges each group like an identity op (both ways), and sweeps the
called functions in between, so shardings flow into and out of nested
functions. The partitioner gives every member of a group the same sharding.
"""

from __future__ import annotations

from typing import List, Tuple

from tf_gspmd.propagation.registry import declare, op_types_of, register

Key = Tuple[str, str]  # (graph name, tensor name)


class CallTies:
  """How one control-flow op type ties tensors across graphs (its operands to the called
  functions' arguments, their results to its own): each group shares one sharding. Not a
  handler: that word is the partitioner's, for an op type's local computation."""

  def __init__(self, kind: str):
    self.kind = kind  # 'while', 'if', 'case', 'call'

  def functions(self, node) -> List[str]:
    """Library functions the node calls, in attr order."""
    out = []
    for names in node.called_functions().values():
      out.extend(names)
    return out

  def ties(self, node, graph, program) -> List[List[Key]]:
    """Groups of (graph, tensor) that share one sharding, each ordered from upstream to
    downstream."""
    g = graph.name
    outs = [(g, o.name) for o in node.outputs]
    ins = [(g, t) for t in node.inputs]
    called = node.called_functions()

    def fn(name):
      if name not in program.functions:
        raise ValueError(
          f'{node.op} {node.name} calls function {name!r}, which the program does not hold.'
        )
      return program.functions[name]

    groups = []
    if self.kind == 'while':
      cond, body = fn(called['cond'][0]), fn(called['body'][0])
      for k in range(len(node.inputs)):
        groups.append(
          [
            ins[k],
            (cond.name, cond.inputs[k]),
            (body.name, body.inputs[k]),
            (body.name, body.outputs[k]),
            outs[k],
          ]
        )
    elif self.kind in ('if', 'case'):
      if self.kind == 'if':
        branches = [fn(called['then_branch'][0]), fn(called['else_branch'][0])]
      else:
        branches = [fn(n) for n in called['branches']]
      for k in range(len(node.inputs) - 1):
        groups.append([ins[k + 1]] + [(b.name, b.inputs[k]) for b in branches])
      for k in range(len(node.outputs)):
        groups.append([(b.name, b.outputs[k]) for b in branches] + [outs[k]])
    else:
      f = fn(called['f'][0])
      for k in range(len(node.inputs)):
        groups.append([ins[k], (f.name, f.inputs[k])])
      for k in range(len(node.outputs)):
        groups.append([(f.name, f.outputs[k]), outs[k]])
    return groups

  def text(self, op_type: str) -> str:
    return {
      'while': 'tie: input[k] = cond.arg[k] = body.arg[k] = body.result[k] = output[k]',
      'if': (
        'tie: input[k+1] = then.arg[k] = else.arg[k]; then.result[k] = else.result[k] = output[k]'
      ),
      'case': 'tie: input[k+1] = branch.arg[k] (every branch); branch.result[k] = output[k]',
      'call': 'tie: input[k] = f.arg[k]; f.result[k] = output[k]',
    }[self.kind]


register(['While', 'StatelessWhile'], 'control_flow', call_ties=CallTies('while'))
register(['If', 'StatelessIf'], 'control_flow', call_ties=CallTies('if'))
register(['Case', 'StatelessCase'], 'control_flow', call_ties=CallTies('case'))
register(['PartitionedCall', 'StatefulPartitionedCall'], 'control_flow', call_ties=CallTies('call'))


# --- properties ---------------------------------------------------------------------
declare(['While', 'StatelessWhile'], local='while')
declare(['If', 'StatelessIf'], local='if')
declare(['Case', 'StatelessCase'], local='case')
declare(['PartitionedCall', 'StatefulPartitionedCall'], local='call')

# --- sweep programs (testing/programs/state.py) -----------------------------------
declare(op_types_of('control_flow'), sweep='control_flow')
