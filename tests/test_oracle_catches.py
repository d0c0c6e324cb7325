"""The oracle still catches real bugs: programs broken on purpose fail it, in float32 and bf16.

Each case partitions a small program three ways: as built (the oracle passes),
and with one fault put into the partitioner or runtime while it builds the
program: one all-reduce dropped, a convolution's halo cut one row off, two
partitions' shards of an input swapped. The normwise rule that tolerates
another summation order must reject each of these (a test that cannot fail
is a defect; this one checks both directions).
"""

import dataclasses

import numpy as np
import pytest
import tensorflow as tf

import tf_gspmd as tg
from tf_gspmd.collectives.interface import Collectives
from tf_gspmd.graph_rewrite import halo_exchange
from tf_gspmd.runtime import sharded
from tf_gspmd.testing import assert_close, check

DTYPES = [tf.float32, tf.bfloat16]


def _randn(seed, *shape, dtype=tf.float32):
  return tf.constant(np.random.RandomState(seed).randn(*shape).astype(np.float32), dtype)


def _megatron_mlp(dtype):
  """Column- then row-parallel matmul on 2x4: the row-parallel one ends in an all-reduce."""
  mesh = tg.Mesh.create((2, 4), ('data', 'model'))
  w1 = tf.Variable(_randn(0, 16, 32, dtype=dtype))
  w2 = tf.Variable(_randn(1, 32, 8, dtype=dtype))
  tg.shard_variable(w1, mesh, tg.P(None, 'model'))
  tg.shard_variable(w2, mesh, tg.P('model', None))

  @tf.function
  def f(x):
    x = tg.shard(x, mesh, tg.P('data', None))
    return tf.matmul(tf.nn.relu(tf.matmul(x, w1)), w2)

  return mesh, f, (_randn(2, 8, 16, dtype=dtype),)


def _conv_split_on_height(dtype):
  """A 3x3 SAME convolution with the image's height split 4 ways: one halo row each side."""
  mesh = tg.Mesh.create((4, 2), ('h', 'x'))
  kernel = tf.Variable(_randn(3, 3, 3, 2, 4, dtype=dtype))

  @tf.function
  def f(image):
    image = tg.shard(image, mesh, tg.P(None, 'h', None, None))
    return tf.nn.conv2d(image, kernel, strides=1, padding='SAME')

  return mesh, f, (_randn(4, 2, 16, 8, 2, dtype=dtype),)


def _drop_first_all_reduce(monkeypatch):
  original = Collectives.all_reduce
  dropped = []

  def all_reduce(self, x, axes, op='sum'):
    if not dropped and self.mesh.axes_size(axes) > 1:
      dropped.append(axes)
      return tf.convert_to_tensor(x)  # each partition keeps its partial sum
    return original(self, x, axes, op)

  monkeypatch.setattr(Collectives, 'all_reduce', all_reduce)
  return dropped


def _halo_one_row_off(monkeypatch):
  original = halo_exchange._borrow  # noqa: SLF001 (the function a bug is planted in)
  shifted = []

  def borrow(p, x, sd, piece, side, of=''):
    start = piece.start - 1 if piece.start > 0 else piece.start + 1  # the next row inward
    shifted.append((side, piece.start, start))
    return original(p, x, sd, dataclasses.replace(piece, start=start), side, of)

  monkeypatch.setattr(halo_exchange, '_borrow', borrow)
  return shifted


def _swap_two_shards(monkeypatch):
  original = sharded.split
  swapped = []

  def split(value, sharding, devices, what='value'):
    shards = original(value, sharding, devices, what)
    # Every split of the first split value (its shards are made, and a plain variable's value
    # copied into them at each call): the fault stays for the whole call. Only that one: the
    # same blocks of the next (a Megatron pair's) would permute the hidden units, a no-op.
    key = (what, str(sharding))
    if sharding.kind == 'tiled' and (not swapped or swapped[0][2] == key):
      other = next(
        (j for j in range(1, len(shards)) if sharding.tile_index(j) != sharding.tile_index(0)), None
      )
      if other is not None:
        swapped.append((0, other, key))
        shards = list(shards)
        shards[0], shards[other] = shards[other], shards[0]
    return shards

  monkeypatch.setattr(sharded, 'split', split)
  return swapped


FAULTS = {
  'drop_all_reduce': (_megatron_mlp, _drop_first_all_reduce),
  'halo_one_row_off': (_conv_split_on_height, _halo_one_row_off),
  'swap_two_shards': (_megatron_mlp, _swap_two_shards),
}


@pytest.mark.parametrize('dtype', DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize('fault', sorted(FAULTS))
def test_oracle_passes_the_program_and_fails_it_broken(fault, dtype, monkeypatch):
  build, inject = FAULTS[fault]
  mesh, f, args = build(dtype)
  want = f(*args)
  assert_close(tg.partition(f, mesh)(*args), want, f'{fault} as built')

  mesh, f, args = build(dtype)  # fresh variables: the fault applies while this one builds
  done = inject(monkeypatch)
  got = tg.partition(f, mesh)(*args)
  assert done, f'the fault {fault} was never injected: the test would prove nothing'
  verdict = check(got, want, fault)
  assert not verdict.ok, f'the oracle passed a broken program ({fault}, {dtype.name}): {verdict}'
  # Not a near miss: far above the bound that tolerates another summation order.
  assert verdict.error > 10 * verdict.bound, verdict
