"""The one numerical oracle: is a partitioned result the unpartitioned one?

Every test, example and bench that compares a partitioned run with the same
function run unpartitioned asks this module, so "equal" means one thing.

The rule, per tensor (each leaf of a nested structure separately):

- Floating tensors: the normwise relative error ``‖got − want‖₂ / ‖want‖₂``
  over the whole tensor must not exceed a bound for its dtype (`bound`). A
  partitioned program sums in another order than the unpartitioned one, and
  TF picks other kernels per CPU (oneDNN, native bf16 dot products), so single
  elements near zero may differ by much more than their own size while the
  tensor as a whole agrees to rounding: an element-wise tolerance fails there
  on correct programs and a normwise one does not. A wrong program (a missing
  all-reduce, a halo off by one row, two shards swapped) moves a whole block
  and lands orders of magnitude above the bound (`tests/test_oracle_catches.py`
  breaks programs on purpose to show it).
  Where ``‖want‖₂`` is 0 the error is ``‖got‖₂`` itself (absolute). NaNs must sit
  at the same places and infinities be equal; the norms run over the rest.
- Integers and booleans: exactly equal.
- Shapes and dtypes: equal.

Where float32 itself is ill-conditioned (BatchNorm training steps, Adam's
first sign-like steps, several training steps, bf16 policies) the two float32
runs may differ by far more than rounding, both being far from the exact
answer. There `assert_close_to_float64` compares against a float64 run of the
same step: the partitioned result may be no further from it than twice the
unpartitioned result's distance, plus a floor (the dtype's bound). A tensor whose
exact value is a cancellation (a gradient a softmax or a BatchNorm makes 0: the
unpartitioned float32 result further from float64 than float64's own size, so
it keeps no digit of it) is the rounding of the terms that cancel, whose size
varies from one summation order to the next by more than 2x: it may be up to
`CANCELLED_FACTOR` times the unpartitioned result's distance. A wrong program
is off by the size of the terms, about 1/eps (10^7 in float32) times that.

>>> import numpy as np
>>> want = np.array([1.0, -2.0, 1e-7], np.float32)
>>> near_zero_off = want + np.float32([0, 0, 1e-6])  # the last element 11x its own size
>>> relative_error(near_zero_off, want) <= bound(np.float32)
True
>>> relative_error(want[::-1], want) <= bound(np.float32)  # two values swapped
False
>>> assert_close({'w': want}, {'w': want})
>>> check(np.int32([1, 2]), np.int32([1, 3]), 'ids').ok
False
"""

import dataclasses
import math
from typing import Iterator, List, Optional, Sequence, Tuple

import ml_dtypes
import numpy as np

# Normwise relative error allowed per dtype. float32: 1e-5 (~84 of its eps, 2^-23), room
# for long sums taken in another order. Each 16-bit dtype: 4 x its eps (bfloat16 eps 2^-7
# gives 2^-5 = 0.03125; float16 eps 2^-10 gives 2^-8 = 0.0039): a 16-bit result is the
# rounding of an f32 accumulation, so two orders differ by up to one rounding (eps/2) per
# element, and the inputs of the last op are themselves 16-bit results of earlier ops, each
# carrying its own rounding; 4 eps leaves room for a short chain of them. float64: 1e-12,
# far above a reordered float64 sum (~1e-16 sqrt(n)) and far below any float32 leak (1e-8).
_EPS_MULTIPLE_16_BIT = 4
_BOUND_FLOAT32 = 1e-5
_BOUND_FLOAT64 = 1e-12
# The float64 rule's allowance for a cancelled tensor, in units of the unpartitioned result's
# distance from float64 (its rounding noise). Two summation orders give noise of one size
# but not one value: on a (1, 3) attention key-bias gradient (0 in exact arithmetic) three
# float32 runs landed 0.7 to 5.8e-13 from float64 (2.4x apart); for a tensor of a few
# elements the norm of such noise is a draw of a chi distribution of few degrees, whose
# draws a factor 16 separates rarely (under 0.3% for one element and one witness further
# off). A real error is the size of the terms: ~10^7 times the noise in float32.
CANCELLED_FACTOR = 16


def bound(dtype) -> float:
  """The normwise relative error allowed for a floating tensor of `dtype` (0 for exact ones).

  >>> bound(np.float32), bound(ml_dtypes.bfloat16), bound(np.float16)
  (1e-05, 0.03125, 0.00390625)
  """
  dtype = np.dtype(dtype)
  if not is_floating(dtype):
    return 0.0
  if dtype in (np.float64, np.complex128):
    return _BOUND_FLOAT64
  if dtype in (np.float32, np.complex64):
    return _BOUND_FLOAT32
  return _EPS_MULTIPLE_16_BIT * float(ml_dtypes.finfo(dtype).eps)


def is_floating(dtype) -> bool:
  """True for numpy floats and complex, and ml_dtypes' floats (bfloat16, float8_*)."""
  dtype = np.dtype(dtype)
  if dtype.kind in 'fc':
    return True
  try:
    ml_dtypes.finfo(dtype)
  except ValueError:
    return False
  return True


def relative_error(got, want) -> float:
  """``‖got − want‖₂ / ‖want‖₂`` over the finite entries of `want`, in float64.

  ``‖got − want‖₂`` where ``‖want‖₂`` is 0; inf where shapes differ or `got` is not
  finite where `want` is, or NaNs and infinities do not match.
  """
  got, want = _array(got), _array(want)
  if got.shape != want.shape:
    return math.inf
  g, w = _as_wide(got), _as_wide(want)
  if not _same_specials(g, w):
    return math.inf
  finite = np.isfinite(w)
  if not np.all(np.isfinite(g[finite])):
    return math.inf
  diff = float(np.linalg.norm(g[finite] - w[finite]))
  norm = float(np.linalg.norm(w[finite]))
  return diff / norm if norm > 0 else diff


@dataclasses.dataclass(frozen=True)
class Verdict:
  """One tensor's comparison: its name, the error measured, the bound, and why it failed."""

  name: str
  ok: bool
  error: float
  bound: float
  why: str = ''

  def __str__(self):
    return (
      f'{self.name}: {self.why}'
      if not self.ok
      else (f'{self.name}: error {self.error:.3g} <= bound {self.bound:.3g}')
    )


def check(got, want, name: str = 'result', max_error: Optional[float] = None) -> Verdict:
  """Compare one tensor with the oracle's rule; `max_error` overrides `bound(dtype)`."""
  python_floats = _is_python_float(want)
  got, want = _array(got), _array(want)
  limit = bound(want.dtype) if max_error is None else max_error
  if got.shape != want.shape:
    return Verdict(name, False, math.inf, limit, f'shape {got.shape} != expected {want.shape}')
  if got.dtype != want.dtype:
    return Verdict(name, False, math.inf, limit, f'dtype {got.dtype} != expected {want.dtype}')
  if not is_floating(want.dtype):
    bad = int(np.sum(got != want))
    why = (
      ''
      if bad == 0
      else (
        f'{bad} of {want.size} elements differ (exact dtype '
        f'{want.dtype}), first {_worst(got, want)}'
      )
    )
    return Verdict(name, bad == 0, float(bad), 0.0, why)
  error = relative_error(got, want)
  ok = error <= limit
  why = (
    ''
    if ok
    else (
      f'normwise relative error {error:.3g} > bound {limit:.3g} ({want.dtype}, '
      f'shape {want.shape}); largest difference {_worst(got, want)}'
    )
  )
  if not ok and python_floats and error <= _BOUND_FLOAT32:
    why += (
      '; Python floats are read as float64: pass float32 results (a Keras loss or '
      'metric) through as_float32(...)'
    )
  return Verdict(name, ok, error, limit, why)


def assert_close(got, want, name: str = 'result', max_error: Optional[float] = None) -> None:
  """Assert every tensor of `got` equals its counterpart in `want` by the oracle's rule.

  `got` and `want` are tensors, arrays, variables, scalars, or nested lists,
  tuples and dicts of them (the same structure). Each leaf is named in the
  message by its Keras variable path or TF variable name, else by its place
  under `name` (``result[1]['kernel']``). `max_error` replaces the dtype's
  bound for every leaf: pass one only with a measurement that says why.
  """
  failures = [str(v) for v in _verdicts(got, want, name, max_error) if not v.ok]
  if failures:
    raise AssertionError(
      'partitioned result differs from unpartitioned:\n  ' + '\n  '.join(failures)
    )


def assert_close_to_float64(
  got, want, exact, name: str = 'result', floor: Optional[float] = None
) -> None:
  """The float64 rule, where float32 (or bf16) itself is ill-conditioned.

  `got` (partitioned) and `want` (unpartitioned) ran in the same low precision;
  `exact` is the same step run in float64. Passes when, per tensor,
  ``err(got, exact) <= 2 * err(want, exact) + floor``, errors normwise relative
  as in `relative_error`; `floor` defaults to the bound of `want`'s dtype. Where
  `want` keeps no digit of `exact` (``‖want − exact‖ >= ‖exact‖``: a cancellation),
  ``err(got, exact) <= CANCELLED_FACTOR * err(want, exact)`` passes too.
  """
  failures = []
  for path, g, w, e in _zip_leaves(name, got, want, exact):
    g, w = _array(g), _array(w)
    if g.shape != w.shape or g.dtype != w.dtype or not is_floating(w.dtype):
      verdict = check(g, w, path)  # a mismatch of shape or dtype, or an exact dtype
      if not verdict.ok:
        failures.append(str(verdict))
      continue
    limit_floor = bound(w.dtype) if floor is None else floor
    err_got, err_want = relative_error(g, e), relative_error(w, e)  # both in float64
    limit = _float64_limit(w, e, err_want, limit_floor)
    if not err_got <= limit:
      failures.append(
        f'{path}: partitioned is {err_got:.3g} from float64, unpartitioned {err_want:.3g}; '
        f'bound {_limit_text(err_want, limit_floor, limit)} ({w.dtype}, shape {w.shape})'
      )
  if failures:
    raise AssertionError(
      'partitioned result is further from float64 than unpartitioned:\n  ' + '\n  '.join(failures)
    )


def is_cancelled(want, exact) -> bool:
  """True when `want` (a low-precision run) is no closer to `exact` (float64) than `exact`'s
  own size: it keeps no digit of it, it is the rounding of terms that cancel."""
  w, e = _as_wide(_array(want)), _as_wide(_array(exact))
  finite = np.isfinite(e) & np.isfinite(w)
  return bool(np.linalg.norm(w[finite] - e[finite]) >= np.linalg.norm(e[finite]))


def _float64_limit(want, exact, err_want: float, floor: float) -> float:
  limit = 2 * err_want + floor
  if is_cancelled(want, exact):
    limit = max(limit, CANCELLED_FACTOR * err_want)
  return limit


def _limit_text(err_want: float, floor: float, limit: float) -> str:
  if limit > 2 * err_want + floor:
    return f'{CANCELLED_FACTOR} x {err_want:.3g} (cancelled: float32 keeps no digit) = {limit:.3g}'
  return f'2 x {err_want:.3g} + {floor:.3g} = {limit:.3g}'


def report(verdicts: Sequence[Verdict], headline: str) -> Tuple[List[str], bool]:
  """A script's summary of its checks: a 'MISMATCH <verdict>' line per failure, then
  '<headline> <worst error> (<its tensor>; normwise per tensor, bound <b>)'; and whether
  every check passed."""
  lines = [f'MISMATCH {v}' for v in verdicts if not v.ok]
  worst = max(verdicts, key=lambda v: v.error)
  lines.append(
    f'{headline} {worst.error:.2e} ({worst.name}; normwise per tensor, bound {worst.bound:g})'
  )
  return lines, all(v.ok for v in verdicts)


def as_float32(values):
  """Keras reports its float32 losses and metrics as Python floats (which read as float64):
  back to float32, for float32's bound. Dicts (a history) keep their keys."""
  if isinstance(values, dict):
    return {k: as_float32(v) for k, v in values.items()}
  return np.asarray(values, np.float32)


def compare(got, want, max_error: Optional[float] = None) -> Tuple[bool, float, str]:
  """(equal enough, error, why not) for one tensor: the op sweep's form of `check`."""
  verdict = check(got, want, 'result', max_error)
  return verdict.ok, verdict.error, verdict.why


# --- internals -----------------------------------------------------------------------------
def _verdicts(got, want, name, max_error) -> Iterator[Verdict]:
  for path, g, w in _zip_leaves(name, got, want):
    yield check(g, w, path, max_error)


def _zip_leaves(name: str, *trees) -> List[tuple]:
  """(name, leaf of each tree) for every leaf, checking the trees have one structure."""
  out: List[tuple] = []
  _walk(name, trees, out)
  return out


def _walk(path: str, nodes: tuple, out: List[tuple]) -> None:
  first = nodes[0]
  if isinstance(first, dict):
    keys = list(first)
    for other in nodes[1:]:
      if not isinstance(other, dict) or set(other) != set(keys):
        raise AssertionError(
          f'{path}: keys {sorted(map(str, keys))} != '
          f'{sorted(map(str, other)) if isinstance(other, dict) else other}'
        )
    for key in keys:
      _walk(f'{path}[{key!r}]', tuple(n[key] for n in nodes), out)
  elif isinstance(first, (list, tuple)) and not _is_leaf(first):
    sizes = [len(n) if isinstance(n, (list, tuple)) else type(n).__name__ for n in nodes]
    if any(size != sizes[0] for size in sizes):
      raise AssertionError(f'{path}: the sides hold {" vs ".join(map(str, sizes))} results')
    for i, children in enumerate(zip(*nodes)):
      _walk(_leaf_name(children, f'{path}[{i}]'), children, out)
  else:
    out.append((path,) + nodes)


def _is_leaf(seq) -> bool:
  """A list of plain numbers is one tensor (a Keras history entry, evaluate's list)."""
  return len(seq) > 0 and all(isinstance(x, (int, float, np.number, bool)) for x in seq)


def _leaf_name(leaves: tuple, fallback: str) -> str:
  """A Keras variable's path or a TF variable's name, from whichever side has one."""
  for leaf in leaves:
    if any('Variable' in cls.__name__ for cls in type(leaf).__mro__):
      for attr in ('path', 'name'):
        value = getattr(leaf, attr, None)
        if isinstance(value, str):
          return value
  return fallback


def _is_python_float(x) -> bool:
  """A Python float or a list/tuple of them: numbers that carry no dtype of their own."""
  if isinstance(x, (list, tuple)):
    return len(x) > 0 and all(isinstance(v, float) and not isinstance(v, np.floating) for v in x)
  return isinstance(x, float) and not isinstance(x, np.floating)


def _array(x) -> np.ndarray:
  if isinstance(x, np.ndarray):
    return x
  if hasattr(x, 'numpy') and callable(x.numpy):
    return np.asarray(x.numpy())
  return np.asarray(x)


def _as_wide(a: np.ndarray) -> np.ndarray:
  """float64 (complex128 for complex) copy of a floating array, for exact norms."""
  return a.astype(np.complex128 if a.dtype.kind == 'c' else np.float64)


def _same_specials(g: np.ndarray, w: np.ndarray) -> bool:
  if not np.array_equal(np.isnan(g), np.isnan(w)):
    return False
  inf = np.isinf(w)
  return bool(np.array_equal(g[inf], w[inf]))


def _worst(got: np.ndarray, want: np.ndarray) -> str:
  """Where got and want differ most: index, both values."""
  if want.size == 0:
    return 'nowhere (empty)'
  if is_floating(want.dtype):
    g, w = _as_wide(got), _as_wide(want)
    with np.errstate(invalid='ignore'):
      diff = np.where(np.isnan(g) & np.isnan(w), 0, np.abs(g - w))
    diff = np.where(np.isnan(diff), np.inf, diff)
  else:
    diff = (got != want).astype(np.int8)
  index = np.unravel_index(int(np.argmax(diff)), want.shape)
  index = tuple(int(i) for i in index)
  return f'at {index}: got {_scalar(got[index])}, expected {_scalar(want[index])}'


def _scalar(value) -> str:
  value = np.asarray(value)
  if is_floating(value.dtype) and value.dtype.kind != 'c':
    return f'{float(value):.7g}'
  return str(value.item())
