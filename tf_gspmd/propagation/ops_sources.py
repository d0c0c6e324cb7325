"""Sources and sinks: constants, placeholders, no-ops, asserts.

A source's results are tied to nothing: they take their sharding from their
users (a constant added to a sharded activation gets the activation's
sharding) or from an annotation (placeholders of annotated arguments).
"""

from __future__ import annotations

import numpy as np

from tf_gspmd.propagation.registry import declare, register
from tf_gspmd.propagation.rule_builders import free_results, make_rule


def _sink(node, ctx):
  """Ops with no data results (NoOp, Assert, _Retval): their operands are unconstrained."""
  return make_rule(
    [None] * len(node.inputs),
    [None] * len(node.outputs),
    [None] * len(node.inputs),
    [None] * len(node.outputs),
  )


def _const_example(b):
  b.const(np.zeros((4, 8), np.float32), name='c')
  return 'c'


def _placeholder_example(b):
  b.placeholder('x', (4, 8))
  return 'x'


def _noop_example(b):
  b.op('NoOp', [], [], name='n')
  return 'n'


def _assert_example(b):
  c = b.placeholder('c', ())
  b.op('Assert', [c], [], name='a')
  return 'a'


register('Const', 'sources', free_results, _const_example)
register(['Placeholder', '_Arg'], 'sources', free_results, _placeholder_example)
register('NoOp', 'sources', _sink, _noop_example)
register(['Assert', '_Retval', 'PrintV2'], 'sources', _sink, _assert_example)


# --- properties ---------------------------------------------------------------------
declare('Const', local='static')
declare('Placeholder', aliasing=True)  # the caller's buffer
declare('NoOp', local='no_op')

# --- sweep programs (testing/programs/state.py) -----------------------------------
declare(['Const', 'Placeholder', 'NoOp', 'Assert', 'PrintV2'], sweep='sources')
declare('_Arg', unswept='function arguments are captured as Placeholders (swept as Placeholder)')
declare('_Retval', unswept='function results are captured as graph outputs, not _Retval nodes')
