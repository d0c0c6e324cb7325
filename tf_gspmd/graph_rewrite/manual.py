"""Manual regions inside the per-partition program.

A value inside a region (`propagation/manual.py`) is this partition's own: a
`Local` whose global shape is the region's shard shape and whose sharding names
only the region's automatic axes, so every op of the region computes on it as
written (the partitioner keeps manual axes out of its operands,
`Partitioner._into_region`). The entry (`XlaSpmdFullToShardShape`) reshards
the full-shaped operand to the entry's layout and keeps this partition's
shard (padding zeroed); the exit (`XlaSpmdShardToFullShape`) declares the
shards to be that layout of the full shape. Collectives written inside go
through the `Collectives` interface over the mesh axes their group assignment
names (XLA's replica groups are partition ids here), so they lower to the TF
backend's collectives or XLA's native ones like every other.
"""

from __future__ import annotations

from typing import List, Sequence, Tuple

import numpy as np
import tensorflow as tf

from tf_gspmd.graph_rewrite import uneven
from tf_gspmd.graph_rewrite.handlers import check_local_shape, computes, global_shape, local_params
from tf_gspmd.graph_rewrite.partitioner import Local, Partitioner
from tf_gspmd.propagation import manual
from tf_gspmd.sharding import NamedSharding, P


def spec(dims: Sequence[Tuple[str, ...]]) -> P:
  return P(*[None if not d else (d[0] if len(d) == 1 else tuple(d)) for d in dims])


def _axes(s: NamedSharding, rank: int) -> List[Tuple[str, ...]]:
  return [tuple(s.spec.axes_of(d)) for d in range(rank)]


def _keeps(b: manual.Boundary, d: int, auto: Tuple[str, ...], mesh) -> bool:
  """Whether dim `d` can keep automatic axes `auto` across the boundary: nested splits of
  a dim are the flat split only when both divide it evenly."""
  on = b.manual_on(d)
  if not on or not auto:
    return True
  return b.full_shape[d] % (mesh.axes_size(on) * mesh.axes_size(auto)) == 0


@computes('manual_enter')
def enter_handler(p: Partitioner, graph, node, operands):
  """Full-shaped value -> this partition's shard of the entry's layout."""
  b = manual.boundary(node, graph, p.mesh)
  out = node.outputs[0].name
  rank = len(b.full_shape)
  value = operands[0]
  if tuple(value.shape) != b.full_shape:
    raise ValueError(f'{b.describe()}: operand of shape {list(value.shape)}.')
  target = p.target(graph, out)
  keep = [
    tuple(a for a in target.spec.axes_of(d) if a not in b.manual)
    if _keeps(b, d, tuple(target.spec.axes_of(d)), p.mesh)
    else ()
    for d in range(rank)
  ]
  need = NamedSharding(p.mesh, spec([b.manual_on(d) + keep[d] for d in range(rank)]))
  local = p.reshard(value, need, f'entering the manual region at {node.name}')
  split = [d for d in range(rank) if b.manual_on(d)]
  tensor = uneven.mask_padding(local.tensor, need, b.full_shape, split, 0, p.backend.partition_id)
  tensor = tf.identity(tensor, name=node.name)
  region = Local(tensor, NamedSharding(p.mesh, spec(keep)), b.region_shape)
  check_local_shape(node, region)
  return [p.finish(graph, region, out)]


@computes('manual_exit')
def exit_handler(p: Partitioner, graph, node, operands):
  """Shards -> the full-shaped value they are the exit's layout of."""
  b = manual.boundary(node, graph, p.mesh)
  value = operands[0]
  rank = len(b.full_shape)
  if tuple(value.shape) != b.region_shape:
    raise ValueError(
      f'{b.describe()}: its operand has shape {list(value.shape)}, but the full shape '
      f'{list(b.full_shape)} split by {b.sharding} over the manual axes gives shards of '
      f'{list(b.region_shape)}; the full shape must be what the shard shape divides into.'
    )
  have = value.sharding
  keep = [
    tuple(a for a in have.spec.axes_of(d) if a not in b.manual)
    if _keeps(b, d, tuple(have.spec.axes_of(d)), p.mesh)
    else ()
    for d in range(rank)
  ]
  local = p.reshard(
    value, NamedSharding(p.mesh, spec(keep)), f'leaving the manual region at {node.name}'
  )
  full = NamedSharding(p.mesh, spec([b.manual_on(d) + keep[d] for d in range(rank)]))
  tensor = tf.identity(local.tensor, name=node.name)
  result = Local(tensor, full, b.full_shape)
  check_local_shape(node, result)
  return [p.finish(graph, result, node.outputs[0].name)]


# --- collectives written inside a region -------------------------------------------------
def _where(node) -> str:
  return f'{node.op} {node.name}'


def _note(p: Partitioner, kind: str, axes, tensor: tf.Tensor, node, graph, **params) -> None:
  """Report a collective written by hand, as the partitioner reports its own, naming the
  region it is written in."""
  region = p.manual_region(graph, node.outputs[0].name)
  where = region.describe() if region is not None else 'a manual region'
  record = {
    'kind': kind,
    'axes': tuple(axes),
    'shape': tuple(tensor.shape),
    'dtype': tensor.dtype.name,
    'bytes': int(tensor.shape.num_elements() or 0) * tensor.dtype.size,
    'why': f'written by hand: {node.op} {node.name} in {where}',
  }
  record.update(params)
  p.note_collective(record)


def _group_axes(p: Partitioner, graph, node, index: int, region) -> Tuple[str, ...]:
  groups = p.static_value(graph, node.inputs[index])
  if groups is None:
    raise ValueError(
      f'{_where(node)}: its group assignment {node.inputs[index]} is not known before the '
      'program runs; write it as a constant.'
    )
  axes = manual.axes_of_groups(p.mesh, groups, _where(node))
  _check_manual(node, axes, region, p.mesh)
  return axes


def _check_manual(node, axes, region, mesh) -> None:
  outside = [a for a in axes if a not in region]
  if outside:
    raise ValueError(
      f'{_where(node)}: a collective over mesh axes {tuple(axes)}, but {outside} '
      + (
        f'are not manual in this region (manual over {region})'
        if region
        else 'is in no manual region'
      )
      + f" of mesh {mesh}; collectives written by hand run over a manual region's axes only."
    )


def _region(p: Partitioner, graph, node) -> Tuple[str, ...]:
  return p.manual_axes(graph, node.outputs[0].name)


def _whole(p: Partitioner, value: Local, dims, why: str) -> Local:
  """`value` with `dims` unsplit (its other dims keep their automatic axes)."""
  s = value.sharding
  axes = _axes(s, len(value.shape))
  for d in dims:
    axes[d] = ()
  return p.reshard(value, NamedSharding(p.mesh, spec(axes)), why)


@computes('manual_collective')
def collective_handler(p: Partitioner, graph, node, operands):
  params = local_params(node)
  kind = params['kind']
  region = _region(p, graph, node)
  out_name = node.outputs[0].name
  if kind == 'custom_call':
    return _custom_call(p, graph, node, operands, region)
  x = operands[0]
  why = f'operand of {node.op} {node.name}'
  out_shape = global_shape(graph, out_name)
  if kind == 'permute':
    pairs = p.static_value(graph, node.inputs[1])
    if pairs is None:
      raise ValueError(f'{_where(node)}: its source_target_pairs are not constant.')
    pairs = _check_pairs(p, node, np.asarray(pairs).reshape(-1, 2), region)
    x = p.reshard(x, x.sharding.without_partial(), why)
    moved = sorted(
      {
        a
        for s, d in pairs.tolist()
        for a in p.mesh.axis_names
        if p.mesh.coords(s)[a] != p.mesh.coords(d)[a]
      },
      key=p.mesh.axis_names.index,
    )
    _note(p, 'permute', moved, x.tensor, node, graph)
    y = p.backend.permute(x.tensor, pairs)
    return [p.finish(graph, Local(y, x.sharding, out_shape), out_name)]
  axes = _group_axes(p, graph, node, 1, region)
  k = p.mesh.axes_size(axes)
  op = _reduction(node, params)
  if kind == 'all_reduce':
    x = p.reshard(x, x.sharding.without_partial(), why)
    _note(p, 'all_reduce', axes, x.tensor, node, graph, reduction=op)
    y = p.backend.all_reduce(x.tensor, axes, 'sum' if op == 'mean' else op)
    if op == 'mean':
      y = y / tf.cast(k, y.dtype)
    return [p.finish(graph, Local(y, x.sharding, out_shape), out_name)]
  if kind == 'all_to_all':
    split = int(node.attrs['split_dimension'].i)
    concat = int(node.attrs['concat_dimension'].i)
    count = int(node.attrs['split_count'].i)
    if count != k or x.shape[split] % k:
      raise ValueError(
        f'{_where(node)}: split_count {count} over mesh axes {axes} (group size {k}); '
        f'split_dimension {split} of shape {list(x.shape)} must divide into the group size.'
      )
    x = _whole(p, x, {split, concat}, why)
    _note(p, 'all_to_all', axes, x.tensor, node, graph)
    y = p.backend.all_to_all(x.tensor, axes, split, concat)
    return [p.finish(graph, Local(y, x.sharding, out_shape), out_name)]
  if kind == 'reduce_scatter':
    dim = int(np.asarray(p.static_value(graph, node.inputs[2])).reshape(-1)[0])
    if x.shape[dim] % k:
      raise ValueError(
        f'{_where(node)}: scatter_dimension {dim} of shape {list(x.shape)} does not divide '
        f'into the {k} members of mesh axes {axes}.'
      )
    x = _whole(p, x, {dim}, why)
    _note(p, 'reduce_scatter', axes, x.tensor, node, graph, reduction=op)
    y = p.backend.reduce_scatter(x.tensor, axes, dim, 'sum' if op == 'mean' else op)
    if op == 'mean':
      y = y / tf.cast(k, y.dtype)
    return [p.finish(graph, Local(y, x.sharding, out_shape), out_name)]
  raise ValueError(f'{_where(node)}: no manual collective of kind {kind!r}. This is a bug.')


def _reduction(node, params) -> str:
  """The reduction a collective computes: its entry's, or the one its attr names."""
  if 'reduction' in params or 'reduce_attr' not in params:
    return params.get('reduction', 'sum')
  name = node.attrs[params['reduce_attr']].s.decode()
  known = list(params['reductions'])
  if name not in known:
    raise ValueError(f'{_where(node)}: {params["reduce_attr"]} {name!r} is not one of {known}.')
  return params['reductions'][name]


def _check_pairs(p: Partitioner, node, pairs: np.ndarray, region) -> np.ndarray:
  n = p.mesh.size
  srcs, dsts = pairs[:, 0].tolist(), pairs[:, 1].tolist()
  if (
    (pairs < 0).any()
    or (pairs >= n).any()
    or len(set(srcs)) != len(srcs)
    or len(set(dsts)) != len(dsts)
  ):
    raise ValueError(
      f'{_where(node)}: source_target_pairs {pairs.tolist()} are not a permutation of '
      f'partitions 0..{n - 1}: each partition is a source at most once and a target at most once.'
    )
  auto = [a for a in p.mesh.axis_names if a not in region]
  for s, d in pairs.tolist():
    cs, cd = p.mesh.coords(s), p.mesh.coords(d)
    moved = [a for a in p.mesh.axis_names if cs[a] != cd[a]]
    bad = [a for a in moved if a in auto]
    if bad:
      raise ValueError(
        f'{_where(node)}: pair ({s}, {d}) moves data along mesh axes {bad}, which are not '
        f'manual in this region (manual over {region}); a permute written by hand stays '
        'inside the manual axes.'
      )
  return pairs


def _custom_call(p: Partitioner, graph, node, operands, region):
  target = manual.custom_target(node)
  config = manual.custom_config(node)
  out_name = node.outputs[0].name
  if target == manual.AXIS_INDEX_TARGET:
    axes = tuple(config['axes'])
    _check_manual(node, axes, region or tuple(config.get('region', ())), p.mesh)
    index = p.backend.axis_index(axes)
    return [Local(tf.identity(index, name=node.name), NamedSharding(p.mesh, P()), ())]
  if target == manual.ALL_GATHER_TARGET:
    axes, dim = tuple(config['axes']), int(config['dim'])
    _check_manual(node, axes, region, p.mesh)
    x = _whole(p, operands[0], {dim}, f'operand of all_gather {node.name}')
    _note(p, 'all_gather', axes, x.tensor, node, graph)
    y = p.backend.all_gather(x.tensor, axes, dim)
    value = Local(y, x.sharding, global_shape(graph, out_name))
    return [p.finish(graph, value, out_name)]
  raise ValueError(
    f'{_where(node)}: custom call target {target!r} cannot run outside XLA on TPU; '
    "tf_gspmd runs tg.shard_map's own targets only."
  )
