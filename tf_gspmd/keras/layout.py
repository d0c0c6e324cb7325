"""Annotating Keras 3 models: a layout map from variable paths to partition specs.

Like Keras 3's own `keras.distribution.LayoutMap` (which only runs on JAX),
but it writes tf_gspmd variable annotations, so the TF backend can partition
the model's training step.

>>> layout = LayoutMap(mesh)                                   # doctest: +SKIP
>>> layout[r'.*ffn_in.*/kernel'] = P(None, 'model')            # doctest: +SKIP
>>> layout.apply(model)                                        # doctest: +SKIP

A TF DTensor user's Mesh and Layouts serve as they are:
`LayoutMap(dtensor_mesh)[r'.*kernel'] = dtensor.Layout([UNSHARDED, 'model'], dtensor_mesh)`.
"""

from __future__ import annotations

import difflib
import re
import warnings
from typing import Dict, List, Tuple

from tf_gspmd import dtensor_compat
from tf_gspmd.annotations import shard_variable
from tf_gspmd.mesh import Mesh
from tf_gspmd.sharding import NamedSharding, P


class LayoutMap:
  """Regex -> `P` rules over variable paths (a whole-path match); the rules matching one
  variable must agree on its spec."""

  def __init__(self, mesh: Mesh):
    self.mesh = dtensor_compat.converted(mesh)  # a DTensor Mesh too
    self._rules: Dict[str, P] = {}

  def __setitem__(self, pattern: str, spec) -> None:
    re.compile(pattern)  # fail early on a bad pattern
    if dtensor_compat.is_dtensor_layout(spec):
      spec = self._spec_of_layout(pattern, spec)
    self._rules[pattern] = spec if isinstance(spec, P) else P(*spec)

  def _spec_of_layout(self, pattern: str, layout) -> P:
    """A DTensor Layout's spec, when it lays out on this map's mesh (every rule's mesh)."""
    sharding = dtensor_compat.from_dtensor_layout(layout)
    if not isinstance(sharding, NamedSharding) or sharding.mesh != self.mesh:
      raise ValueError(
        f'LayoutMap: the DTensor layout for {pattern!r} gives {sharding!r}, not a spec on '
        f"this map's mesh {self.mesh!r}; a LayoutMap holds specs on its own mesh (use "
        'tg.shard_variable(v, layout) for a variable laid out elsewhere).'
      )
    return sharding.spec

  def __getitem__(self, path: str):
    matched = self._matching(path)
    return matched[0][1] if matched else None

  def _matching(self, path: str) -> List[Tuple[str, P]]:
    return [(pattern, spec) for pattern, spec in self._rules.items() if re.fullmatch(pattern, path)]

  def apply(self, model) -> List[Tuple[str, P]]:
    """Annotate every variable of `model` that a rule matches; returns (path, spec) pairs.

    Two rules matching one variable must agree on its spec; a rule matching no variable
    warns, listing the paths it nearly matches (a typo would leave the layout unused).
    """
    applied, used = [], set()
    for variable in model.variables:
      path = getattr(variable, 'path', variable.name)
      matched = self._matching(path)
      if not matched:
        continue
      used.update(pattern for pattern, _ in matched)
      spec = self._one_spec(path, matched)
      if len(spec) != len(variable.shape):
        raise ValueError(
          f'LayoutMap: rule {spec} matches {path} of shape {tuple(variable.shape)} '
          f'(rank {len(variable.shape)}); give one spec entry per dim.'
        )
      try:
        shard_variable(variable, self.mesh, spec)
      except ValueError as error:
        raise ValueError(
          f'LayoutMap: rule {matched[0][0]!r} -> {spec} for variable {path}: {error}'
        ) from None
      applied.append((path, spec))
    warn_unused(
      [p for p in self._rules if p not in used],
      [getattr(v, 'path', v.name) for v in model.variables],
      'LayoutMap',
    )
    return applied

  @staticmethod
  def _one_spec(path: str, matched: List[Tuple[str, P]]) -> P:
    specs = {spec for _, spec in matched}
    if len(specs) > 1:
      rules = ', '.join(f'{pattern!r} -> {spec}' for pattern, spec in matched)
      raise ValueError(
        f'LayoutMap: variable {path} is matched by several rules that disagree: {rules}. '
        'Make the patterns exclusive so that one key matches each variable.'
      )
    return matched[0][1]


def warn_unused(patterns, paths, what: str) -> None:
  """One warning per layout key that matched no path, with the paths it nearly matches."""
  for pattern in patterns:
    plain = re.sub(r'[.*+?^$()\[\]|\\]', '', pattern)  # the key's literal text, to compare
    near = difflib.get_close_matches(plain, paths, n=3, cutoff=0.6)
    hint = (
      f'; did you mean {", ".join(repr(p) for p in near)}?'
      if near
      else (f'; the model has {len(paths)} variables, e.g. {paths[:3]}.')
    )
    warnings.warn(
      f'{what}: key {pattern!r} matches no variable of the model, so its layout is not used{hint}',
      UserWarning,
      stacklevel=3,
    )
