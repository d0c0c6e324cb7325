"""How the examples check partitioned weights: the oracle (tf_gspmd.testing), per weight.

A weight passes when its normwise relative error ||got - want|| / ||want|| against the
unpartitioned run is within the float32 bound (1e-5). Where float32 itself is ill-conditioned
that says nothing: the transformer's attention key biases have a zero gradient in exact
arithmetic (a bias added to every key shifts all of a query's scores alike, and softmax
cancels it), so in float32 they hold round-off alone, which Adam scales to steps of lr
(m / sqrt(v) of a ~1e-9 gradient is +-1): two correct float32 runs land ~1 apart. Those weights
are judged by the oracle's float64 rule instead, against the same steps run in float64:
the partitioned run no further from float64 than twice the unpartitioned run, plus the bound.
A weight counts as ill-conditioned when the unpartitioned float32 run is itself further than
the bound from float64.
"""

from typing import List, NamedTuple

import numpy as np

from tf_gspmd.testing import assert_close_to_float64, bound, relative_error


class WeightReport(NamedTuple):
  error: float  # the largest normwise error of the well-conditioned weights
  worst: str  # which weight that is
  compared: int  # how many well-conditioned weights
  lines: List[str]  # one per ill-conditioned weight (float64 rule) and per failure
  ok: bool


def compare_weights(got, want, exact) -> WeightReport:
  """`got` (partitioned), `want` (unpartitioned), `exact` (float64): lists of variables."""
  limit = bound(np.float32)
  error, worst, compared, lines, ok = 0.0, '-', 0, [], True
  for g, w, e in zip(got, want, exact):
    g, w, e, name = g.numpy(), w.numpy(), np.asarray(e.numpy(), np.float64), w.path
    floor = relative_error(w.astype(np.float64), e)
    if floor <= limit:  # float32 well conditioned here: the default rule
      err = relative_error(g, w)
      compared += 1
      if err > error:
        error, worst = err, name
      if not err <= limit:
        ok = False
        lines.append(f'MISMATCH {name}: normwise relative error {err:.3g} > bound {limit:g}')
      continue
    distance = relative_error(g.astype(np.float64), e)
    try:
      assert_close_to_float64(g, w, e, name)
      verdict = 'within'
    except AssertionError:
      ok, verdict = False, 'MISMATCH: not within'
    lines.append(
      f'{name}: round-off alone in float32 (unpartitioned {floor:.2g} from float64, '
      f'partitioned {distance:.2g}); float64 rule: {verdict} 2 x {floor:.2g} + {limit:g}'
    )
  return WeightReport(error, worst, compared, lines, ok)
