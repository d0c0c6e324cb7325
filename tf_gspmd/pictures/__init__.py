"""Pictures of a sharding: where a tensor's blocks live, as a terminal grid or an HTML page.

`visualize(x)` prints which devices hold which block of a tensor (`text`);
`PartitionedFunction.visualize` / `.report` and `PlanReport.report` draw the
tilings propagation chose, and the page (`html`) adds the collectives and
per-device memory of a step. Everything here reads plain data (shardings,
shapes, byte counts, collective records), computed once in `geometry`.
"""

from __future__ import annotations

from typing import Optional, Sequence

from tf_gspmd.mesh import Mesh
from tf_gspmd.pictures import text
from tf_gspmd.pictures.geometry import Tiling, tiling_of
from tf_gspmd.sharding import Sharding


def visualize(x, shape: Optional[Sequence[int]] = None, mesh: Optional[Mesh] = None) -> str:
  """Print (and return) a grid of which devices hold which block of a tensor.

  `x`: a `Sharding`/`NamedSharding` (then `shape` is required), a tf.Tensor or
  tf.Variable annotated with tf_gspmd (`shard`, `shard_variable`), or a
  `ShardedVariable`/`ShardedValue`. `mesh` names the axes of a sharding written
  as a tile assignment. Cells list devices: ',' between replicas, '+' between
  the parts of a pending sum.

  >>> mesh = tg.Mesh.create((2, 4), ('data', 'model'))                 # doctest: +SKIP
  >>> tg.visualize(tg.NamedSharding(mesh, tg.P('data', 'model')), (8, 8))  # doctest: +SKIP
  (8, 8) P('data', 'model') on mesh data=2 x model=4; each device holds (4, 2)
  ...
  """
  sharding, shape, name = _sharding_and_shape(x, shape, mesh)
  picture = text.render(tiling_of(sharding, shape, mesh), name)
  print(picture)
  return picture


def _sharding_and_shape(x, shape, mesh) -> tuple:
  """(sharding, shape, name or None) of whatever `visualize` was given."""
  if isinstance(x, Sharding):
    if shape is None:
      raise ValueError(
        f'visualize: a sharding alone has no shape; pass shape=, e.g. visualize({x}, shape=(8, 8)).'
      )
    return x, tuple(shape), None
  held = getattr(x, 'sharding', None)
  if isinstance(held, Sharding):  # ShardedVariable, ShardedValue
    return held, tuple(shape or x.shape), getattr(x, 'label', None)
  return _annotated(x, shape, mesh)


def _annotated(x, shape, mesh) -> tuple:
  from tf_gspmd.annotations import get_sharding

  try:
    sharding = get_sharding(x, mesh)
  except (AttributeError, TypeError, ValueError):
    sharding = None
  name = getattr(x, 'name', None)
  if sharding is None:
    raise ValueError(
      f'visualize: {name or type(x).__name__} carries no tf_gspmd sharding (eager tensors '
      'never do); annotate it with tg.shard or tg.shard_variable, or pass a Sharding and '
      'its shape.'
    )
  if shape is None:
    shape = getattr(x, 'shape', None)
    if shape is None or None in tuple(shape):
      raise ValueError(f'visualize: {name} has shape {shape}, not fully known; pass shape=.')
  return sharding, tuple(int(s) for s in shape), name


__all__ = ['Tiling', 'tiling_of', 'visualize']
