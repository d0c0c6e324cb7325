"""Float64 twins of Keras models: the exact run the oracle's float64 rule measures against.

`assert_close_to_float64(got, want, exact)` needs `exact`, the same step run in
float64 from the same starting values. For a Keras model that is a second build
under a float64 policy, its variables set to the float32 build's values
(float64 initializers would draw other numbers), and a training step made under
the same policy: a Keras loss takes the policy it is made under, and one made
outside computes in float32, so the "exact" run would not be.
"""

import contextlib
import re

import numpy as np


@contextlib.contextmanager
def float64_policy():
  """Keras' float type and dtype policy are float64 inside (both put back on leaving)."""
  import keras  # (the oracle itself needs no Keras)

  previous = keras.config.floatx(), keras.config.dtype_policy()
  keras.config.set_floatx('float64')
  keras.config.set_dtype_policy('float64')
  try:
    yield
  finally:
    keras.config.set_floatx(previous[0])
    keras.config.set_dtype_policy(previous[1])


def float64_twin(build, **kwargs):
  """`build(**kwargs)` -> (model, optimizer), built in float64 holding the values a float32
  `build(**kwargs)` starts from. Build the twin's training step under `float64_policy()`."""
  with float64_policy():
    model, optimizer = build(**kwargs)
  donor, donor_optimizer = build(**kwargs)
  mine = model.variables + optimizer.variables
  theirs = donor.variables + donor_optimizer.variables
  if len(mine) != len(theirs):
    raise ValueError(
      f'float64_twin: the float64 build holds {len(mine)} variables, the float32 '
      f'one {len(theirs)}; build() must make the same model each time.'
    )
  for v, w in zip(mine, theirs):
    if str(v.dtype) not in ('float64', 'int64', 'int32') and v.dtype != np.float64:
      raise ValueError(f'float64_twin: {v.path} is {v.dtype} under the float64 policy.')
    if _role(v) != _role(w) or tuple(v.shape) != tuple(w.shape):
      raise ValueError(
        f'float64_twin: variables out of step: {v.path} {tuple(v.shape)} vs '
        f'{w.path} {tuple(w.shape)}'
      )
    v.assign(np.asarray(w.numpy(), v.dtype))
  return model, optimizer


def _role(variable) -> str:
  """A variable's name without its model's numbered name (an optimizer slot's name holds it:
  'sequential_3_conv_0_kernel_momentum' is 'conv_0_kernel_momentum')."""
  return re.sub(r'^[a-z]+_\d+_', '', variable.path.split('/')[-1])
