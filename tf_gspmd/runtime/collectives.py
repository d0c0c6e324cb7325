"""The TF-collective backend: `TFCollectives` (collective V2 ops between the logical devices
of one process; runs on CPU and GPU). The interface it implements, and the helpers shared by
every backend, live in `tf_gspmd.collectives`; they are re-exported here for old callers."""

from __future__ import annotations

import functools
from typing import Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf
from tensorflow.core.framework import attr_value_pb2

from tf_gspmd.collectives import tables
from tf_gspmd.collectives.interface import (  # noqa: F401  re-exported
  DEFAULT_TIMEOUT,
  KINDS,
  CollectiveRecord,
  Collectives,
  _no_dependencies,
  merge_leading_into,
  pad_dim,
  slice_dim,
  split_leading_from,
)
from tf_gspmd.mesh import Mesh
from tf_gspmd.tf_private import collective_ops, set_op_attr

# --- TF collective V2 backend ------------------------------------------------------------------
_TF_MERGE_OPS = {'sum': 'Add', 'prod': 'Mul', 'max': 'Max', 'min': 'Min'}


@functools.lru_cache(maxsize=64)
def _tf_rank_keys(devices: Tuple[str, ...]) -> np.ndarray:
  """Each partition's place in the order TF sorts collective members (device name order)."""

  def sort_key(name):
    spec = tf.DeviceSpec.from_string(name)
    return (
      spec.job or '',
      spec.replica or 0,
      spec.task or 0,
      spec.device_type or '',
      spec.device_index or 0,
    )

  order = sorted(range(len(devices)), key=lambda p: sort_key(devices[p]))
  keys = np.empty(len(devices), dtype=np.int64)
  keys[order] = np.arange(len(devices))
  return keys


def default_devices(num_partitions: int) -> Tuple[str, ...]:
  return tuple(f'/device:CPU:{p}' for p in range(num_partitions))


class TFCollectives(Collectives):
  """Collectives from TF collective V2 ops between the devices of one process.

  `token` is this partition's ordering token: the resource handle of a small
  per-device variable (float64[2], see `new_token_variable`). Every group
  collective takes it as `ordering_token`, which is what makes collective V2
  ops run across logical devices of one multi-device function, in program
  order. With `progress_markers` the token variable also records progress:
  `[2i+1, start time]` when collective i starts, `[2i+2, ...]` when it is done.
  The launcher's watchdog reads the markers to time collectives out, and after
  a failure to name the collective and the partitions that never joined.

  `timeout` (seconds, 0 = none) is TF's own per-op timeout. TF implements it
  with one detached thread per op execution and device that sleeps for the
  whole timeout: a program of 21 collectives on 8 devices left ~350 threads
  per call, and a training loop ran out of threads. So the launcher leaves it
  at 0 and enforces its timeout with the markers instead.

  Permutes and broadcasts use `broadcast_send_v2` / `broadcast_recv_v2`: a
  permute gives every (source, target) pair its own group of two. Where the pairs form
  cycles, or the shard is small (`CLOSED_CYCLE_MAX_BYTES`), the permutation is closed into
  cycles and every partition runs one send and one receive (`_permute_on_cycle`); else each
  partition runs at most one send and one receive, chosen by an `If` on a table (its
  branch functions made once per dtype, `_pair_branches`), so that no whole shard moves for
  nothing. On 8 logical CPUs a shift of 1M float32 took 12 ms with the `If`s, against 20 ms
  with the permutation completed to a full one and 62 ms with all-gathers over pair groups
  (an earlier measurement; see `CLOSED_CYCLE_MAX_BYTES` for this one).
  """

  backend = 'tf'

  def __init__(
    self,
    mesh: Mesh,
    partition_id,
    token,
    *,
    devices: Optional[Sequence[str]] = None,
    timeout: float = 0.0,
    name: str = 'gspmd',
    progress_markers: bool = True,
  ):
    super().__init__(mesh, partition_id, name=name)
    devices = default_devices(mesh.size) if devices is None else tuple(devices)
    if len(devices) != mesh.size:
      raise ValueError(f'TFCollectives: {len(devices)} devices for a mesh of {mesh.size}.')
    self.token = token
    self.timeout = float(timeout)
    self.devices = devices
    self.progress_markers = progress_markers
    self._assignment = tables.KEYS.assignment_id(devices)
    if devices == default_devices(mesh.size):
      self._rank_keys = np.arange(mesh.size)
    else:
      self._rank_keys = _tf_rank_keys(devices)

  def with_mesh(self, mesh: Mesh) -> 'TFCollectives':
    return TFCollectives(
      mesh,
      self.partition_id,
      self.token,
      devices=self.devices,
      timeout=self.timeout,
      name=self.name,
      progress_markers=self.progress_markers,
    )

  # --- tables ----------------------------------------------------------------------------
  def _group_key(self, axes) -> tf.Tensor:
    ids = tables.group_ids(self.mesh, axes)
    base = tables.KEYS.group_key_base(
      (self._assignment, self.mesh, 'axes', axes), len(tables.groups(self.mesh, axes))
    )
    return self.table((ids + base).astype(np.int32), name='group_key')

  def _rank_table(self, axes, inverse: bool):
    """Per position, the TF rank (or, `inverse`, per TF rank the position); None if equal."""
    ranks = tables.rank_orders(tables.groups(self.mesh, axes), self._rank_keys)
    if ranks is None:
      return None
    if inverse:
      ranks = np.argsort(ranks, axis=1).astype(np.int32)
    group = self.table(tables.group_ids(self.mesh, axes).astype(np.int32), name='group_id')
    return tf.gather(tf.constant(ranks), group, name='rank_order')

  def _kwargs(self, axes):
    return dict(
      group_size=self.mesh.axes_size(axes),
      group_key=self._group_key(axes),
      instance_key=tables.KEYS.instance_key(),
      timeout=self.timeout,
      # One tensor, not a list: TF's wrappers list it themselves, and a list of it became a
      # Pack per collective, a new resource tensor that automatic control dependencies do
      # not tie to the token (collectives were ordered by the progress markers alone).
      ordering_token=self.token,
    )

  # --- collectives -------------------------------------------------------------------------
  def _all_reduce(self, x, axes, op):
    return collective_ops.all_reduce_v2(
      x, merge_op=_TF_MERGE_OPS[op], final_op='Id', **self._kwargs(axes)
    )

  def _all_gather(self, x, axes, dim):
    k = self.mesh.axes_size(axes)
    by_rank = self._rank_table(axes, inverse=False)
    rows = x if x.shape.rank else x[tf.newaxis]
    gathered = collective_ops.all_gather_v2(rows, **self._kwargs(axes))  # pieces by rank, dim 0
    if dim == 0 and by_rank is None and x.shape.rank:
      return gathered  # already the pieces in position order along dim 0
    stacked = tf.reshape(gathered, [k] + x.shape.as_list())
    if by_rank is not None:
      stacked = tf.gather(stacked, by_rank)
    return merge_leading_into(stacked, dim)

  def _reduce_scatter(self, x, axes, dim, op):
    # CollectiveReduceScatterV2 has no CPU implementation: all-reduce, then keep our chunk.
    reduced = self._all_reduce(x, axes, op)
    chunk = int(x.shape[dim]) // self.mesh.axes_size(axes)
    return slice_dim(reduced, dim, self.axis_index(axes) * chunk, chunk)

  def _all_to_all(self, x, axes, split_dim, concat_dim):
    k = self.mesh.axes_size(axes)
    by_position = self._rank_table(axes, inverse=True)
    by_rank = self._rank_table(axes, inverse=False)
    if split_dim == 0 and by_position is None:  # chunk j is rows j*c.. already: one reshape
      piece = [int(x.shape[0]) // k] + x.shape.as_list()[1:]
      sending = tf.reshape(x, [k, -1])
    else:
      chunks = split_leading_from(x, split_dim, k)  # [k, ...piece]: chunk j goes to position j
      piece = chunks.shape[1:].as_list()
      if by_position is not None:
        chunks = tf.gather(chunks, by_position)  # slot r holds the chunk for TF rank r
      sending = tf.reshape(chunks, [k, -1])
    received = collective_ops.all_to_all_v2(sending, **self._kwargs(axes))  # slot r: TF rank r
    if concat_dim == 0 and by_rank is None:  # the slots in position order along dim 0
      return tf.reshape(received, [k * piece[0]] + piece[1:])
    received = tf.reshape(received, [k] + piece)
    if by_rank is not None:
      received = tf.gather(received, by_rank)
    return merge_leading_into(received, concat_dim)

  def _permute(self, x, pairs, family):
    cycle = tables.closed_cycle(pairs, self.num_partitions)
    if cycle is not None and (all(cycle[1]) or _nbytes(x) <= CLOSED_CYCLE_MAX_BYTES):
      return self._permute_on_cycle(x, pairs, family, *cycle)
    return self._permute_by_branches(x, pairs, family)

  def _permute_on_cycle(self, x, pairs, family, edges, real):
    """Every partition sends once and receives once, on a permutation closed into cycles
    (`tables.closed_cycle`): no `If`, one send and one receive op, side by side (a cycle
    waits on itself when each partition receives only after it sent). An added pair carries
    a value nobody uses: its receiver takes zeros, or keeps its own value where `pairs` say."""
    n = self.num_partitions
    base = tables.KEYS.group_key_base(
      (self._assignment, self.mesh) + family + ('closed',), len(edges)
    )
    send_key = np.zeros(n, np.int32)
    recv_key = np.zeros(n, np.int32)
    receives = np.zeros(n, bool)
    for i, (source, target) in enumerate(edges):
      send_key[source] = recv_key[target] = base + i
      receives[target] = real[i]
    instance = tables.KEYS.instance_key()
    pair = dict(group_size=2, instance_key=instance, timeout=self.timeout)
    sent = collective_ops.broadcast_send_v2(x, group_key=self.table(send_key, 'send_key'), **pair)
    got = collective_ops.broadcast_recv_v2(
      x.shape.as_list(), x.dtype, group_key=self.table(recv_key, 'recv_key'), **pair
    )
    if not receives.all():
      got = tf.where(self.table(receives, 'receives'), got, tf.zeros_like(x))
    return self._permuted(x, pairs, got, sent)

  def _permute_by_branches(self, x, pairs, family):
    n = self.num_partitions
    moving = pairs[pairs[:, 0] != pairs[:, 1]]
    base = tables.KEYS.group_key_base((self._assignment, self.mesh) + family, max(len(moving), 1))
    send_key = np.zeros(n, np.int32)
    recv_key = np.zeros(n, np.int32)
    keys = base + np.arange(len(moving), dtype=np.int64)
    send_key[moving[:, 0]] = keys
    recv_key[moving[:, 1]] = keys
    instance = tf.constant(tables.KEYS.instance_key(), tf.int32)
    send, receive, keep, nothing = _pair_branches(x.dtype, self.timeout)
    send_group = self.table(send_key, 'send_key')
    sent = _inlined_if(
      self.table(send_key != 0, 'sends'), [x, send_group, instance], send, keep, x, 'send'
    )
    shape = tf.constant(x.shape.as_list(), tf.int32)
    receiving = [shape, self.table(recv_key, 'recv_key'), instance]
    got = _inlined_if(
      self.table(recv_key != 0, 'receives'), receiving, receive, nothing, x, 'receive'
    )
    return self._permuted(x, pairs, got, sent)

  def _permuted(self, x, pairs, got, sent):
    """A permute's result: `got`, but `x` where a pair keeps a partition's own value, once
    this partition's send is done."""
    stays = np.zeros(self.num_partitions, bool)
    stays[pairs[pairs[:, 0] == pairs[:, 1], 0]] = True
    if stays.any():
      got = tf.where(self.table(stays, 'keeps'), x, got)
    with tf.control_dependencies([sent]):
      return tf.identity(got)

  def _broadcast(self, x, axes, root):
    k = self.mesh.axes_size(axes)
    group_key = self._group_key(axes)
    instance = tables.KEYS.instance_key()
    shape, dtype = x.shape.as_list(), x.dtype

    def send():
      return collective_ops.broadcast_send_v2(
        x, group_size=k, group_key=group_key, instance_key=instance, timeout=self.timeout
      )

    def receive():
      return collective_ops.broadcast_recv_v2(
        shape, dtype, group_size=k, group_key=group_key, instance_key=instance, timeout=self.timeout
      )

    return tf.cond(tf.equal(self.axis_index(axes), root), send, receive, name='root')

  # --- progress markers ----------------------------------------------------------------------
  def _around(self, record, build):
    if not self.progress_markers:
      return build()
    started = set_marker(self.token, 2 * record.index + 1, name='started')
    with tf.control_dependencies([started]):
      result = build()
    with tf.control_dependencies([result]):
      finish_marker(self.token)
    # No identity waits for `done`: the token's writes and collectives run in program order
    # (automatic control dependencies order the ops that use one resource), so the next
    # collective's `started` follows it, and the function's stateful ops all run.
    return result


# Above this size a permute whose pairs leave partitions without a source or a target runs its
# sends and receives under `If`s (`_permute_by_branches`): the added pairs of a closed cycle
# would move whole shards for nothing. Measured on 8 logical CPUs, a shift without wrap of
# float32[n] per partition, closed cycle / branches per call: n = 256 1.82 / 1.82 ms, 4096
# 1.66 / 1.59, 65536 2.44 / 2.29, 1M 23.3 / 18.4 ms; a cyclic shift (nothing added) 1M
# 16.6 / 16.2 ms. Lowered, the two Ifs of a permute were some 60 nodes on every device, a
# third of a fuzz program's nodes (the fuzzer's CPU 0.92 of the branches' with closed
# cycles, `bench/fuzz_ab.py --switch closed-cycles`).
CLOSED_CYCLE_MAX_BYTES = 64 * 1024


def _nbytes(x) -> int:
  return int(np.prod(x.shape.as_list(), dtype=np.int64)) * x.dtype.size


def _inlined_if(cond, inputs, then_branch, else_branch, like: tf.Tensor, name: str) -> tf.Tensor:
  """`then_branch(*inputs)` where `cond`, else `else_branch(*inputs)` (each giving a tensor
  like `like`): an `If` op TF lowers to Switch/Merge in the caller's graph, as `tf.cond`
  makes it, so the branch's collective runs in the partition's own graph. (Run as a function
  call instead, each device's branch blocks a thread while it waits for its peer, and the
  program hangs.)"""
  (out,) = tf.raw_ops.If(
    cond=cond,
    input=inputs,
    Tout=[like.dtype],
    then_branch=then_branch,
    else_branch=else_branch,
    output_shapes=[like.shape],
    name=name,
  )
  set_op_attr(out.op, '_lower_using_switch_merge', attr_value_pb2.AttrValue(b=True))
  return out


@functools.lru_cache(maxsize=64)
def _pair_branches(dtype: tf.DType, timeout: float):
  """The branch functions of a permute's `If` ops, made once per dtype and timeout, for
  every shape (the `If` op states its output's shape; a received value's shape is an
  argument): (send x to the pair `group_key` names, receive from it, pass x on, zeros). A
  `tf.cond` per send and receive traced two new branch graphs each time (22 ms a cond, most
  of the emission time of a program of halo exchanges), and branches made per shape still
  traced four functions for every new shape (a fuzz program's permutes, 28 ms each)."""
  x_spec = tf.TensorSpec(None, dtype)
  key_spec = tf.TensorSpec([], tf.int32)
  shape_spec = tf.TensorSpec([None], tf.int32)

  def send(x, group_key, instance_key):
    return collective_ops.broadcast_send_v2(
      x, group_size=2, group_key=group_key, instance_key=instance_key, timeout=timeout
    )

  def receive(shape, group_key, instance_key):
    return collective_ops.broadcast_recv_v2(
      shape, dtype, group_size=2, group_key=group_key, instance_key=instance_key, timeout=timeout
    )

  def keep(x, group_key, instance_key):
    del group_key, instance_key
    return tf.identity(x)

  def nothing(shape, group_key, instance_key):
    del group_key, instance_key
    return tf.zeros(shape, dtype)

  def concrete(fn, *specs):
    return tf.function(fn, autograph=False).get_concrete_function(*specs)

  return (
    concrete(send, x_spec, key_spec, key_spec),
    concrete(receive, shape_spec, key_spec, key_spec),
    concrete(keep, x_spec, key_spec, key_spec),
    concrete(nothing, shape_spec, key_spec, key_spec),
  )


def new_token_variable(device: str, name: str = 'gspmd_token') -> tf.Variable:
  """A per-device ordering token that can also carry progress markers: float64 [state, time]."""
  with tf.device(device):
    return tf.Variable(tf.zeros([2], tf.float64), trainable=False, name=name)


def set_marker(token, state: int, name: str = 'marker'):
  """token[0] = state; when a collective starts (odd state) also token[1] = now (host seconds)."""
  if state % 2:
    return tf.raw_ops.ResourceScatterUpdate(
      resource=token,
      indices=[0, 1],
      updates=tf.stack([tf.constant(float(state), tf.float64), tf.timestamp()]),
      name=name,
    )
  return tf.raw_ops.ResourceScatterUpdate(
    resource=token, indices=[0], updates=tf.constant([float(state)], tf.float64), name=name
  )


def finish_marker(token, name: str = 'done'):
  """token[0] += 1: the collective whose start set 2k+1 is done (2k+2). One node per
  collective (its constants are every collective's), where setting the state made two."""
  return tf.raw_ops.ResourceScatterAdd(
    resource=token, indices=[0], updates=tf.constant([1.0], tf.float64), name=name
  )
