"""A numpy simulator of reshard routes on per-device arrays (tests and benchmarks; no TF).

Each step is executed exactly as its class's docstring in `reshard.moves` tells a
lowering to execute it, with the collectives' mesh-axis semantics:
all_gather concatenates the group's buffers in group order, all_to_all sends
piece j of the split dim to group member j and concatenates what arrives along
the concat dim in member order, reduce_scatter reduces then hands member j
piece j, permute moves whole buffers along (src, dst) pairs. Groups are
`Mesh.groups(axes)`, ordered row-major over the axes, major first.

Shards are padded to the sharding's ceil shard shape. `make_shards` fills
padding with NaN so that a route that lets padding leak into valid data fails
`check_shards`, which compares only the valid region of each shard.
"""

from __future__ import annotations

from typing import Callable, Dict, Optional

import numpy as np

from tf_gspmd.graph_rewrite.reshard.exchange import Permute, Repad
from tf_gspmd.graph_rewrite.reshard.geometry import pad_dim, regroup_blocks, slice_window
from tf_gspmd.graph_rewrite.reshard.moves import (
  AllGather,
  AllReduce,
  AllToAll,
  ReduceScatter,
  Slice,
)
from tf_gspmd.graph_rewrite.reshard.route import ReshardRoute
from tf_gspmd.sharding import NamedSharding

_REDUCERS = {'sum': np.add, 'max': np.maximum, 'min': np.minimum, 'prod': np.multiply}


def _reduce(op: str, arrays):
  fn = _REDUCERS[op]
  out = arrays[0]
  for a in arrays[1:]:
    out = fn(out, a)
  return out


def _valid_slices(sharding: NamedSharding, shape, device):
  """(global slices, local slices) of the valid region of `device`'s shard."""
  bounds = sharding.shard_bounds(shape, device)
  assert bounds is not None, (sharding, device)  # every mesh device holds a shard
  return (tuple(slice(lo, hi) for lo, hi in bounds), tuple(slice(0, hi - lo) for lo, hi in bounds))


def partial_summands(x: np.ndarray, count: int, op: str, rng: np.random.Generator):
  """`count` arrays whose reduction by `op` is exactly `x` (x holds small integers)."""
  if count == 1:
    return [x]
  if op == 'sum':
    parts = [rng.integers(-50, 50, size=x.shape).astype(x.dtype) for _ in range(count - 1)]
    return parts + [x - sum(parts)]
  if op == 'max':
    return [x] + [x - rng.integers(0, 20, size=x.shape) for _ in range(count - 1)]
  if op == 'min':
    return [x] + [x + rng.integers(0, 20, size=x.shape) for _ in range(count - 1)]
  if op == 'prod':
    return [x] + [np.ones_like(x) for _ in range(count - 1)]
  raise ValueError(f'partial_summands: unknown reduction {op!r}.')


def make_shards(
  x: np.ndarray,
  sharding: NamedSharding,
  rng: Optional[np.random.Generator] = None,
  pad_value=np.nan,
) -> Dict[int, np.ndarray]:
  """Per-device padded shards of `x`; with partial axes, summands that reduce to `x`.

  Devices that share a tile and a coordinate along the partial axes hold the
  same summand, as a real partial result would.
  """
  rng = rng or np.random.default_rng(0)
  mesh = sharding.mesh
  partial_axes = tuple(sharding.partial_axes)
  summands = partial_summands(x, mesh.axes_size(partial_axes), sharding.partial or 'sum', rng)
  shard_shape = sharding.shard_shape(x.shape)
  out = {}
  for device in mesh.devices:
    g, loc = _valid_slices(sharding, x.shape, device)
    buf = np.full(shard_shape, pad_value, dtype=np.float64)
    buf[loc] = summands[mesh.linear_index(device, partial_axes)][g]
    out[device] = buf
  return out


def check_shards(x: np.ndarray, sharding: NamedSharding, shards: Dict[int, np.ndarray]) -> None:
  """Assert every device's shard has the right shape and exactly `x`'s values in its valid region.

  For a partial `sharding`, the shards reduced over the partial axes must match.
  """
  mesh = sharding.mesh
  expected_shape = sharding.shard_shape(x.shape)
  partial_axes = tuple(sharding.partial_axes)
  for group in mesh.groups(partial_axes):
    for device in group:
      if shards[device].shape != expected_shape:
        raise AssertionError(
          f'device {device}: shard shape {shards[device].shape}, expected '
          f'{expected_shape} for {sharding} of {x.shape}'
        )
    total = _reduce(sharding.partial or 'sum', [shards[d] for d in group])
    g, loc = _valid_slices(sharding, x.shape, group[0])
    if not np.array_equal(total[loc], x[g]):
      raise AssertionError(
        f'devices {group}: valid region of the shard differs from the '
        f'target {sharding} of {x.shape}:\n got {total[loc]}\n want {x[g]}'
      )


def simulate(route: ReshardRoute, shards: Dict[int, np.ndarray]) -> Dict[int, np.ndarray]:
  """Run every step of `route` on per-device arrays; returns the new per-device arrays."""
  mesh = route.mesh
  cur = {d: np.asarray(a) for d, a in shards.items()}
  for step in route.steps:
    for d, a in cur.items():
      if a.shape != tuple(step.shape_in):
        raise AssertionError(
          f'{step.describe()}: device {d} holds shape {a.shape}, the route says {step.shape_in}'
        )
    cur = _RUNNERS[type(step)](step, cur, mesh)
    for d, a in cur.items():
      if a.shape != tuple(step.shape_out):
        raise AssertionError(
          f'{step.describe()}: device {d} produced shape {a.shape}, the route says {step.shape_out}'
        )
  return cur


def _run_slice(step: Slice, cur, mesh):
  out = {}
  for d, a in cur.items():
    start, shift = slice_window(mesh.linear_index(d, step.axes), step.chunk, a.shape[step.dim])
    window = _window(a, step.dim, start, step.chunk)
    out[d] = np.roll(window, -shift, axis=step.dim)
  return out


def _run_all_gather(step: AllGather, cur, mesh):
  out = {}
  for group in mesh.groups(step.axes):
    y = np.concatenate([cur[d] for d in group], axis=step.dim)
    y = regroup_blocks(y, step.dim, step.blocks, step.out_chunk)
    for d in group:
      out[d] = y.copy()
  return out


def _run_all_to_all(step: AllToAll, cur, mesh):
  out = {}
  for group in mesh.groups(step.axes):
    pieces = [
      np.split(pad_dim(cur[d], step.split_dim, step.split_padded), len(group), axis=step.split_dim)
      for d in group
    ]
    for j, d in enumerate(group):
      y = np.concatenate([pieces[i][j] for i in range(len(group))], axis=step.concat_dim)
      out[d] = regroup_blocks(y, step.concat_dim, step.blocks, step.out_chunk)
  return out


def _run_reduce_scatter(step: ReduceScatter, cur, mesh):
  out = {}
  for group in mesh.groups(step.axes):
    total = _reduce(step.op, [pad_dim(cur[d], step.dim, step.padded) for d in group])
    for j, piece in enumerate(np.split(total, len(group), axis=step.dim)):
      out[group[j]] = piece
  return out


def _run_all_reduce(step: AllReduce, cur, mesh):
  out = {}
  for group in mesh.groups(step.axes):
    total = _reduce(step.op, [cur[d] for d in group])
    for d in group:
      out[d] = total.copy()
  return out


def _run_permute(step: Permute, cur, mesh):
  srcs = [s for s, _ in step.pairs]
  dsts = [t for _, t in step.pairs]
  if len(set(srcs)) != len(srcs) or len(set(dsts)) != len(dsts):
    raise AssertionError(f'permute pairs are not a partial permutation: {step.pairs}')
  out = dict(cur)
  for s, t in step.pairs:
    out[t] = cur[s]
  return out


def _window(a, dim, start, length):
  """Rows [start, start+length) of `a` along `dim`; raises if the window leaves the buffer."""
  if start < 0 or start + length > a.shape[dim]:
    raise AssertionError(f'window [{start}, {start + length}) outside {a.shape[dim]} rows')
  return np.take(a, range(start, start + length), axis=dim)


def _put(out, dim, start, rows):
  index = [slice(None)] * out.ndim
  index[dim] = slice(start, start + rows.shape[dim])
  out[tuple(index)] = rows


def _run_repad(step: Repad, cur, mesh):
  dim = step.dim
  out = {d: np.zeros(step.shape_out, dtype=a.dtype) for d, a in cur.items()}
  for d, src, dst, length in step.local:
    _put(out[d], dim, dst, _window(cur[d], dim, src, length))
  for rnd in step.rounds:
    sent = {d: _window(cur[d], dim, start, rnd.size) for d, start in rnd.sends}
    received = {t: sent[s] for s, t in rnd.pairs}
    for d, msg_off, dst, length in rnd.recvs:
      _put(out[d], dim, dst, _window(received[d], dim, msg_off, length))
  return out


_RUNNERS: Dict[type, Callable[..., Dict[int, np.ndarray]]] = {
  Slice: _run_slice,
  AllGather: _run_all_gather,
  AllToAll: _run_all_to_all,
  ReduceScatter: _run_reduce_scatter,
  AllReduce: _run_all_reduce,
  Permute: _run_permute,
  Repad: _run_repad,
}
