"""cuDNN's fused RNN ops (`CudnnRNN*`, what Keras' LSTM/GRU run on a GPU).

Every partition computes them whole: operands read whole, results free (each
takes its users' layout, a local slice of the whole result). This is what
`handlers.random_handler` does with them (they carry dropout seeds, so every
partition gets the same seeds, and the same values). A batch-split rule (the
batch dim of input, input_h, input_c and of every result passing through,
the params buffer and the opaque reserve space whole) would be the fast one,
but TF has no CPU kernel for these ops: such a rule could not be measured
against the unpartitioned op on the logical CPU devices, so it is not claimed.
"""

from __future__ import annotations

from tf_gspmd.propagation.registry import declare, register
from tf_gspmd.propagation.rule_builders import free_results

_T, _B, _IN, _UNITS, _PARAMS = 5, 4, 3, 6, 200
_SEQ_IN, _STATE, _SEQ_OUT = (_T, _B, _IN), (1, _B, _UNITS), (_T, _B, _UNITS)
_FORWARD_INS = [
  ('input', _SEQ_IN),
  ('input_h', _STATE),
  ('input_c', _STATE),
  ('params', (_PARAMS,)),
]
_BACKPROP_INS = _FORWARD_INS + [
  ('output', _SEQ_OUT),
  ('output_h', _STATE),
  ('output_c', _STATE),
  ('output_backprop', _SEQ_OUT),
  ('output_h_backprop', _STATE),
  ('output_c_backprop', _STATE),
  ('reserve_space', None),
]

# op type -> (operands, result shapes); None: an opaque buffer of unknown size.
SIGNATURES = {
  'CudnnRNN': (_FORWARD_INS, [_SEQ_OUT, _STATE, _STATE, None]),
  'CudnnRNNV2': (_FORWARD_INS, [_SEQ_OUT, _STATE, _STATE, None, None]),
  'CudnnRNNV3': (
    _FORWARD_INS + [('sequence_lengths', (_B,))],
    [_SEQ_OUT, _STATE, _STATE, None, None],
  ),
  'CudnnRNNBackprop': (_BACKPROP_INS, [_SEQ_IN, _STATE, _STATE, (_PARAMS,)]),
  'CudnnRNNBackpropV2': (
    _BACKPROP_INS + [('host_reserved', None)],
    [_SEQ_IN, _STATE, _STATE, (_PARAMS,)],
  ),
  'CudnnRNNBackpropV3': (
    _FORWARD_INS + [('sequence_lengths', (_B,))] + _BACKPROP_INS[4:] + [('host_reserved', None)],
    [_SEQ_IN, _STATE, _STATE, (_PARAMS,)],
  ),
}


def _example(op):
  def build(b):
    import tensorflow as tf

    operands, results = SIGNATURES[op]
    dtypes = {'sequence_lengths': tf.int32, 'host_reserved': tf.int8}
    inputs = [b.placeholder(name, shape, dtype=dtypes.get(name)) for name, shape in operands]
    b.op(op, inputs, results, name='y')
    return 'y'

  return build


for _op in SIGNATURES:
  register(_op, 'rnn', free_results, _example(_op))


# No CPU kernel to run them locally: drawn whole like the random ops' results.
declare(list(SIGNATURES), local='random')
# TF registers no CPU kernel for cuDNN's fused RNN ops, so no program runs them here
# (tests/test_one_definition.py checks TF's kernel registry still says so).
declare(list(SIGNATURES), unswept='no CPU kernel (GPU only)')
