"""Testing tools: the numerical oracle every comparison goes through (`oracle`), the brute-force
op sweep (`op_sweep`) and its op programs (`op_builders`)."""

from tf_gspmd.testing.op_builders import UNSWEPT, Operand, OpSpec, op_specs, specs_by_op_type
from tf_gspmd.testing.op_sweep import (
  MESHES,
  Case,
  CaseResult,
  Poisoned,
  Sweep,
  all_specs,
  configure_devices,
  enumerate_cases,
  format_table,
  mesh_named,
  sample_cases,
  summary,
)
from tf_gspmd.testing.oracle import (
  Verdict,
  as_float32,
  assert_close,
  assert_close_to_float64,
  bound,
  check,
  compare,
  relative_error,
)

__all__ = [
  'Verdict',
  'as_float32',
  'assert_close',
  'assert_close_to_float64',
  'bound',
  'check',
  'compare',
  'relative_error',
  'UNSWEPT',
  'OpSpec',
  'Operand',
  'op_specs',
  'specs_by_op_type',
  'MESHES',
  'Case',
  'CaseResult',
  'Poisoned',
  'Sweep',
  'all_specs',
  'configure_devices',
  'enumerate_cases',
  'format_table',
  'mesh_named',
  'sample_cases',
  'summary',
]
