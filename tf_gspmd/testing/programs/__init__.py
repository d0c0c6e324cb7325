"""The op sweep's programs, one module per op family; each registers its kinds
(`op_builders.program`)."""

from typing import Sequence


def in_draw_order(entries, form: str, draw_order: Sequence[str]) -> list:
  """The entries of `form` (their `sweep_params['form']`) in the order their values are drawn.

  A program drawing the values of several ops from one seeded stream lists them here, beside
  the program (test data, not a property of the op): `draw_order` is the order they were
  always drawn in, so every case keeps its values; an op not listed comes after, by name.
  """
  named = [e for e in entries if e.sweep_params.get('form') == form]
  rank = {op: i for i, op in enumerate(draw_order)}
  return sorted(named, key=lambda e: (rank.get(e.op_type, len(rank)), e.op_type))
