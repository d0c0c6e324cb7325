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

import re
from typing import Dict, List, Tuple

from tf_gspmd import dtensor_compat
from tf_gspmd.annotations import shard_variable
from tf_gspmd.mesh import Mesh
from tf_gspmd.sharding import NamedSharding, P


class LayoutMap:
  """Ordered regex -> `P` rules; the first rule whose regex matches a variable's path wins."""

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
          f'this map\'s mesh {self.mesh!r}; a LayoutMap holds specs on its own mesh (use '
          'tg.shard_variable(v, layout) for a variable laid out elsewhere).')
    return sharding.spec

  def __getitem__(self, path: str):
    for pattern, spec in self._rules.items():
      if re.fullmatch(pattern, path):
        return spec
    return None

  def apply(self, model) -> List[Tuple[str, P]]:
    """Annotate every variable of `model` that a rule matches; returns (path, spec) pairs."""
    applied = []
    for variable in model.variables:
      path = getattr(variable, 'path', variable.name)
      spec = self[path]
      if spec is None:
        continue
      if len(spec) != len(variable.shape):
        raise ValueError(
            f'LayoutMap: rule {spec} matches {path} of shape {tuple(variable.shape)} '
            f'(rank {len(variable.shape)}); give one spec entry per dim.')
      shard_variable(variable, self.mesh, spec)
      applied.append((path, spec))
    return applied
