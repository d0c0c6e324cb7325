"""`tg.shard_map`: a manual region over named mesh axes, with collectives by axis name.

`shard_map(fn, mesh, in_specs, out_specs, axes=...)` has JAX's semantics: `fn`
sees each argument's local shard (split by its `in_spec` over the manual axes)
and returns local values, which `out_specs` put back together; a manual axis an
out spec leaves out asserts the value is the same on every member of that axis.
Inside `fn`, `psum`, `all_gather`, `psum_scatter`, `all_to_all`, `ppermute` and
`axis_index` talk over manual axes by name. With `axes` naming only some mesh
axes, the region is manual over those and automatic over the rest: propagated
and partitioned as usual.

It writes the ops TF writes for TPU code, read back by the partitioner
(`propagation/manual.py`, `graph_rewrite/manual.py`): `XlaSpmdFullToShardShape`
and `XlaSpmdShardToFullShape` with the manual axes in the attr
`_tf_gspmd_manual_axes`; `CrossReplicaSum`, `AllToAll`, `CollectivePermute` and
`XlaReduceScatter` with group assignments along the named axes; an
`XlaCustomCall` for the all-gather and the axis index TF has no op for.
Gradients are the transposes: psum <-> broadcast (a replicated out spec's
cotangent is divided over the axis, a replicated in spec's summed over it),
all_gather <-> psum_scatter, all_to_all <-> the inverse all_to_all, ppermute <->
the reverse permutation. Variables passed as arguments are read as their shards.

Only inside a `tf.function` that `tg.partition` (or a Keras model on top of it)
partitions; the ops have no kernel of their own.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import threading
from typing import List, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf
from tensorflow.core.framework import attr_value_pb2

from tf_gspmd import op_sharding
from tf_gspmd.mesh import Mesh
from tf_gspmd.sharding import NamedSharding, P
from tf_gspmd.tf_private import gen_xla_ops, set_op_attr, xla_sharding

MANUAL_AXES_ATTR = '_tf_gspmd_manual_axes'
# On an exit whose out spec leaves manual axes out: check the value is replicated over them.
CHECK_ATTR = '_tf_gspmd_check_replicated'
AXIS_INDEX_TARGET = 'tf_gspmd.axis_index'
ALL_GATHER_TARGET = 'tf_gspmd.all_gather'

_plain_python = tf.autograph.experimental.do_not_convert
_state = threading.local()


class _Region:
  def __init__(self, mesh: Mesh, manual: Tuple[str, ...]):
    self.mesh = mesh
    self.manual = manual


def _current(what: str) -> _Region:
  stack = getattr(_state, 'stack', [])
  if not stack:
    raise ValueError(
      f'tg.{what}: called outside tg.shard_map; collectives by mesh axis name run inside the '
      'function a shard_map calls.'
    )
  return stack[-1]


@contextlib.contextmanager
def _inside(region: _Region):
  stack = getattr(_state, 'stack', None)
  if stack is None:
    stack = _state.stack = []
  stack.append(region)
  try:
    yield
  finally:
    stack.pop()


def _axes_tuple(axis_name) -> Tuple[str, ...]:
  return (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)


def _region_axes(what: str, axis_name, x=None) -> Tuple[_Region, Tuple[str, ...]]:
  region = _current(what)
  axes = _axes_tuple(axis_name)
  for a in axes:
    if a not in region.manual:
      raise ValueError(
        f'tg.{what}: mesh axis {a!r} is not manual in this region (manual axes '
        f'{region.manual} of mesh {region.mesh})'
        + (f', operand {getattr(x, "name", "")} of shape {list(x.shape)}' if x is not None else '')
        + '; name a manual axis, or add it to shard_map(axes=...).'
      )
  if len(set(axes)) != len(axes):
    raise ValueError(f'tg.{what}: mesh axis named twice in {axes}.')
  return region, axes


def _groups(mesh: Mesh, axes) -> tf.Tensor:
  return tf.constant(np.asarray(mesh.groups(axes), np.int32))


# --- the region boundary ------------------------------------------------------------
@_plain_python
def shard_map(fn, mesh: Mesh, in_specs, out_specs, axes=None, check: bool = True):
  """`fn` run on local shards over the manual mesh `axes` (default: all of them).

  `in_specs` / `out_specs`: one `P` per argument / result (or one `P` for all);
  they may name manual axes only. An out spec that leaves a manual axis out
  asserts replication over it; with `check`, a value the region cannot be seen
  to replicate (no psum or all_gather over that axis, no replicated input behind
  it) is refused when the function is partitioned.
  """
  manual = _manual_axes(mesh, axes)

  @functools.wraps(fn)
  @_plain_python
  def wrapped(*args):
    if tf.executing_eagerly():
      raise ValueError(
        'tg.shard_map: call it inside a tf.function partitioned by tg.partition; eagerly '
        'there are no partitions to run it on.'
      )
    specs = _spec_list(in_specs, len(args), 'in_specs', mesh, manual)
    values = [_read(a) for a in args]
    locals_ = [
      _enter(v, s, mesh, manual, f'argument {i}') for i, (v, s) in enumerate(zip(values, specs))
    ]
    with _inside(_Region(mesh, manual)):
      outs = fn(*locals_)
    single = not isinstance(outs, (list, tuple))
    flat = [outs] if single else list(outs)
    ospecs = _spec_list(out_specs, len(flat), 'out_specs', mesh, manual)
    results = []
    for i, (y, s) in enumerate(zip(flat, ospecs)):
      y = tf.convert_to_tensor(y)
      results.append(_exit(y, s, mesh, manual, f'result {i}', check))
    return results[0] if single else type(outs)(results)

  return wrapped


def _manual_axes(mesh: Mesh, axes) -> Tuple[str, ...]:
  if axes is None:
    return tuple(mesh.axis_names)
  axes = _axes_tuple(axes)
  for a in axes:
    if a not in mesh.axis_names:
      raise ValueError(
        f'tg.shard_map: axes={axes} names {a!r}, not an axis of mesh {mesh} '
        f'(axes {mesh.axis_names}).'
      )
  return tuple(a for a in mesh.axis_names if a in axes)


def _spec_list(specs, n: int, what: str, mesh: Mesh, manual) -> List[P]:
  if isinstance(specs, P) or specs is None:
    specs = [specs or P()] * n
  specs = [s if isinstance(s, P) else P(*s) for s in specs]
  if len(specs) != n:
    raise ValueError(f'tg.shard_map: {len(specs)} {what} for {n} values.')
  for i, s in enumerate(specs):
    for a in s.used_axes():
      if a not in manual:
        raise ValueError(
          f'tg.shard_map: {what}[{i}] = {s} names mesh axis {a!r}, which is not manual '
          f'in this region (manual axes {manual} of mesh {mesh}); specs name manual axes only.'
        )
  return specs


def _read(a):
  """A variable argument is read: its shards enter the region, not a gathered copy."""
  return tf.convert_to_tensor(a)


def _proto(mesh: Mesh, spec: P) -> bytes:
  return op_sharding.to_proto(NamedSharding(mesh, spec)).SerializeToString()


def _mark(t: tf.Tensor, manual) -> tf.Tensor:
  value = attr_value_pb2.AttrValue()
  value.list.s.extend(a.encode() for a in manual)
  set_op_attr(t.op, MANUAL_AXES_ATTR, value)
  return t


def _open_dims(mesh: Mesh, manual, rank: int) -> List[int]:
  """Partially manual: every dim of the region's value stays open to the automatic axes."""
  return list(range(rank)) if len(manual) < len(mesh.axis_names) else []


def _full_to_shard(x, proto, mesh, manual):
  m = xla_sharding.auto_to_manual_spmd_partition(
    x, proto, unspecified_dims=_open_dims(mesh, manual, x.shape.rank)
  )
  return _mark(m, manual)


def _shard_to_full(y, proto, full_shape, mesh, manual):
  t = xla_sharding.manual_to_auto_spmd_partition(
    y, proto, full_shape=list(full_shape), unspecified_dims=_open_dims(mesh, manual, y.shape.rank)
  )
  return _mark(t, manual)


def _unmentioned(spec: P, manual) -> Tuple[str, ...]:
  used = spec.used_axes()
  return tuple(a for a in manual if a not in used)


def _static_shape_and_spec(x: tf.Tensor, spec: P, which: str, what: str):
  """`x`'s static shape and `spec` padded with None to its rank (`which`: 'in' or 'out')."""
  if not x.shape.is_fully_defined():
    raise ValueError(f'tg.shard_map: {what} has shape {x.shape}; a static shape is needed.')
  shape = x.shape.as_list()
  if len(spec) > len(shape):
    raise ValueError(
      f'tg.shard_map: {which} spec {spec} of {what} has more dims than its shape {shape}.'
    )
  return shape, P(*(list(spec) + [None] * (len(shape) - len(spec))))


def _enter(x: tf.Tensor, spec: P, mesh: Mesh, manual, what: str) -> tf.Tensor:
  shape, spec = _static_shape_and_spec(x, spec, 'in', what)
  for d, size in enumerate(shape):
    k = mesh.axes_size(spec.axes_of(d))
    if size % k:
      raise ValueError(
        f'tg.shard_map: {what} of shape {shape}: dim {d} ({size}) does not divide into the '
        f'{k} shards of in spec {spec} over mesh axes {spec.axes_of(d)}.'
      )
  proto = _proto(mesh, spec)
  summed = _unmentioned(spec, manual)

  @tf.custom_gradient
  def enter(v):
    def grad(g):
      if summed:  # every member saw the whole value: its cotangent is the members' sum
        g = tf.raw_ops.CrossReplicaSum(input=g, group_assignment=_groups(mesh, summed))
      return _shard_to_full(g, proto, shape, mesh, manual)

    return _full_to_shard(v, proto, mesh, manual), grad

  return enter(x)


def _exit(y: tf.Tensor, spec: P, mesh: Mesh, manual, what: str, check: bool) -> tf.Tensor:
  local, spec = _static_shape_and_spec(y, spec, 'out', what)
  full = [size * mesh.axes_size(spec.axes_of(d)) for d, size in enumerate(local)]
  proto = _proto(mesh, spec)
  replicated = _unmentioned(spec, manual)
  k = math.prod(mesh.axis_size(a) for a in replicated)

  @tf.custom_gradient
  def leave(v):
    def grad(g):
      g = _full_to_shard(g, proto, mesh, manual)
      # One value stands for its k equal copies: each copy's cotangent is 1/k of it.
      return g / tf.cast(k, g.dtype) if k > 1 and g.dtype.is_floating else g

    full_value = _shard_to_full(v, proto, full, mesh, manual)
    if check and replicated:
      flag = attr_value_pb2.AttrValue(b=True)
      set_op_attr(full_value.op, CHECK_ATTR, flag)
    return full_value, grad

  return leave(y)


# --- collectives by mesh axis name ------------------------------------------------------
@_plain_python
def psum(x, axis_name):
  """The sum of `x` over the members of each group along the manual `axis_name`(s)."""
  x = tf.convert_to_tensor(x)
  region, axes = _region_axes('psum', axis_name, x)
  return tf.raw_ops.CrossReplicaSum(input=x, group_assignment=_groups(region.mesh, axes))


@_plain_python
def all_gather(x, axis_name, axis: int = 0, tiled: bool = False):
  """The members' `x` along `axis_name` stacked on a new dim `axis` (concatenated if `tiled`)."""
  x = tf.convert_to_tensor(x)
  region, axes = _region_axes('all_gather', axis_name, x)
  if not tiled:
    x = tf.expand_dims(x, axis)
  dim = axis % x.shape.rank
  return _all_gather(x, region.mesh, region.manual, axes, dim)


def _all_gather(x, mesh, manual, axes, dim):
  k = mesh.axes_size(axes)
  shape = x.shape.as_list()
  shape[dim] *= k

  @tf.custom_gradient
  def gather(v):
    def grad(g):
      return _reduce_scatter(g, mesh, manual, axes, dim)

    config = json.dumps({'axes': list(axes), 'dim': dim, 'region': list(manual)})
    y = gen_xla_ops.xla_custom_call(
      [v], target_name=ALL_GATHER_TARGET, backend_config=config, dtype=v.dtype, shape=shape
    )
    return y, grad

  return gather(x)


@_plain_python
def psum_scatter(x, axis_name, scatter_dimension: int = 0, tiled: bool = False):
  """psum over `axis_name`, each member keeping its chunk of `scatter_dimension`.

  Not `tiled`: that dim's size is the group size and is removed; `tiled`: it is
  divided by the group size.
  """
  x = tf.convert_to_tensor(x)
  region, axes = _region_axes('psum_scatter', axis_name, x)
  dim = scatter_dimension % x.shape.rank
  k = region.mesh.axes_size(axes)
  size = x.shape[dim]
  if (not tiled and size != k) or size % k:
    raise ValueError(
      f'tg.psum_scatter over {axes}: dim {dim} of shape {x.shape.as_list()} must '
      + ('equal' if not tiled else 'divide by')
      + f' the group size {k}.'
    )
  y = _reduce_scatter(x, region.mesh, region.manual, axes, dim)
  return y if tiled else tf.squeeze(y, dim)


def _reduce_scatter(x, mesh, manual, axes, dim):
  @tf.custom_gradient
  def scatter(v):
    def grad(g):
      return _all_gather(g, mesh, manual, axes, dim)

    y = gen_xla_ops.xla_reduce_scatter(
      v, _groups(mesh, axes), tf.constant(dim, tf.int32), reduce_op='Add'
    )
    return y, grad

  return scatter(x)


@_plain_python
def all_to_all(x, axis_name, split_axis: int, concat_axis: int):
  """Cut `split_axis` into one chunk per member along `axis_name`; chunk j goes to member j;
  arrivals are concatenated along `concat_axis` in member order (TF's AllToAll)."""
  x = tf.convert_to_tensor(x)
  region, axes = _region_axes('all_to_all', axis_name, x)
  k = region.mesh.axes_size(axes)
  rank = x.shape.rank
  split_axis, concat_axis = split_axis % rank, concat_axis % rank
  if x.shape[split_axis] % k:
    raise ValueError(
      f'tg.all_to_all over {axes}: split_axis {split_axis} of shape {x.shape.as_list()} '
      f'does not divide into {k} chunks.'
    )
  return tf.raw_ops.AllToAll(
    input=x,
    group_assignment=_groups(region.mesh, axes),
    concat_dimension=concat_axis,
    split_dimension=split_axis,
    split_count=k,
  )


@_plain_python
def ppermute(x, axis_name, perm: Sequence[Tuple[int, int]]):
  """Member `dst` of each group along `axis_name` gets `x` of member `src`, for each (src, dst)
  of `perm` (positions along the axis); members that are no target get zeros."""
  x = tf.convert_to_tensor(x)
  region, axes = _region_axes('ppermute', axis_name, x)
  k = region.mesh.axes_size(axes)
  perm = [(int(s), int(d)) for s, d in perm]
  srcs, dsts = [s for s, _ in perm], [d for _, d in perm]
  bad = [p for p in perm if not (0 <= p[0] < k and 0 <= p[1] < k)]
  if bad or len(set(srcs)) != len(srcs) or len(set(dsts)) != len(dsts):
    raise ValueError(
      f'tg.ppermute over mesh axes {axes} (size {k}): perm {perm} is not a permutation: '
      + (
        f'{bad} are not positions 0..{k - 1}' if bad else 'a position is a source or a target twice'
      )
      + '.'
    )
  pairs = [(g[s], g[d]) for g in region.mesh.groups(axes) for s, d in perm]
  return tf.raw_ops.CollectivePermute(
    input=x, source_target_pairs=tf.constant(np.asarray(pairs, np.int32).reshape(-1, 2))
  )


@_plain_python
def axis_index(axis_name) -> tf.Tensor:
  """This member's position along the manual `axis_name`(s) (int32 scalar)."""
  region, axes = _region_axes('axis_index', axis_name)
  config = json.dumps({'axes': list(axes), 'region': list(region.manual)})
  return gen_xla_ops.xla_custom_call(
    [], target_name=AXIS_INDEX_TARGET, backend_config=config, dtype=tf.int32, shape=[]
  )


def region_mesh() -> Optional[Mesh]:
  """The mesh of the shard_map being traced, or None outside one."""
  stack = getattr(_state, 'stack', None)
  return stack[-1].mesh if stack else None
