"""Gathers and scatters whose operands disagree move the fewer bytes (issue #41, point 1).

An embedding table split FSDP-style (hidden dim over the batch axis) gathered by ids split
over the batch axis: one of the two splits must go. The table is small next to the ids and
the looked-up rows, so the table is all-gathered (the weight, as FSDP does) and the ids and
rows stay batch-split; its gradient is reduce-scattered back onto the table's layout. Each
case checks values against the unpartitioned function (the oracle) and the bytes
`step.collectives()` reports, against a bound the old choice (ids gathered) broke.
"""

from unittest import mock

import numpy as np
import tensorflow as tf

import tf_gspmd as tg
from tf_gspmd.graph_rewrite import partitioner as partitioner_lib
from tf_gspmd.propagation import pricing
from tf_gspmd.propagation.rule import REDUCTION, OpRule
from tf_gspmd.testing import assert_close

from helpers import randn

MESH = tg.Mesh.create((2, 4), ('batch', 'model'))
VOCAB, HIDDEN = 256, 64
TABLE_BYTES = VOCAB * HIDDEN * 4  # 65,536


def ids(seed, *shape):
  return np.random.RandomState(seed).randint(0, VOCAB, shape).astype(np.int32)


def moved(step):
  """Bytes of every collective one call runs (each record's buffer)."""
  return sum(rec['bytes'] for rec in step.collectives())


def fsdp_table(seed=0):
  table = tf.Variable(randn(seed, VOCAB, HIDDEN))
  tg.shard_variable(table, MESH, tg.P(None, 'batch'))
  return table


# --- the decision, priced ----------------------------------------------------------------------
def gather_rule():
  """GatherV2's rule: table [rows, hidden], ids [b, s] -> [b, s, hidden], rows a reduction."""
  return OpRule(
    operands=(('r', 'h'), ('b', 's')),
    results=(('b', 's', 'h'),),
    kinds={'r': REDUCTION},
  )


def test_a_conflict_keeps_the_split_whose_loss_moves_more_bytes():
  rule = gather_rule()
  chosen = {'h': ('batch',), 'b': ('batch',)}
  specs = [((), ('batch',)), (('batch',), ()), None]
  sizes = [4, 4, 4]
  big_ids = [(VOCAB, HIDDEN), (512, 128), (512, 128, HIDDEN)]
  settled = pricing.settle(rule, chosen, specs, big_ids, sizes, MESH)
  assert settled['b'] == ('batch',) and settled['h'] == ()  # the table is gathered
  few_ids = [(VOCAB, HIDDEN), (8, 4), (8, 4, HIDDEN)]
  settled = pricing.settle(rule, chosen, specs, few_ids, sizes, MESH)
  assert settled['h'] == ('batch',) and settled['b'] == ()  # the ids are gathered


def test_an_unknown_dim_leaves_the_rule_order():
  rule = gather_rule()
  chosen = {'h': ('batch',), 'b': ('batch',)}
  specs = [((), ('batch',)), (('batch',), ()), None]
  shapes = [(VOCAB, HIDDEN), (None, 128), (None, 128, HIDDEN)]
  assert pricing.settle(rule, chosen, specs, shapes, [4, 4, 4], MESH) == rule.resolve_axes(chosen)


# --- end to end ----------------------------------------------------------------------------------
def lookup(table):
  @tf.function
  def f(x):
    x = tg.shard(x, MESH, tg.P('batch', None))
    return tf.reduce_sum(tf.square(tf.gather(table, x)), -1)

  return f


def test_fsdp_table_lookup_gathers_the_table_not_the_ids():
  """Before: the ids all-gathered (131,072 bytes) and the result all-reduced (262,144)."""
  f = lookup(fsdp_table())
  step = tg.partition(f, MESH)
  x = ids(1, 512, 128)
  assert_close(step(x), f(x), 'sum of squared rows')
  kinds = [(r['kind'], r['dtype']) for r in step.collectives()]
  assert kinds == [('all_gather', 'float32')], step.collectives()
  assert moved(step) <= TABLE_BYTES, step.collectives()


def fsdp_train_step(table, w, update):
  @tf.function
  def step(x, y):
    x = tg.shard(x, MESH, tg.P('batch', None))
    with tf.GradientTape() as tape:
      h = tf.reduce_mean(tf.gather(table, x), 1)
      loss = tf.reduce_mean(tf.square(tf.matmul(h, w) - y))
    g_table, g_w = tape.gradient(loss, [table, w])
    update(table, g_table)
    w.assign_sub(0.5 * g_w)
    return loss

  return step


def dense_update(table, grad):
  table.assign_sub(0.5 * tf.convert_to_tensor(grad))  # an UnsortedSegmentSum of the rows


def train_and_compare(update):
  table, w = fsdp_table(), tf.Variable(randn(2, HIDDEN, 8))
  ref_table, ref_w = tf.Variable(randn(0, VOCAB, HIDDEN)), tf.Variable(randn(2, HIDDEN, 8))
  step = tg.partition(fsdp_train_step(table, w, update), MESH)
  ref = fsdp_train_step(ref_table, ref_w, update)
  x, y = ids(1, 512, 128), randn(3, 512, 8)
  for k in range(2):
    assert_close(step(x, y), ref(x, y), f'loss of step {k}')
  assert_close(table.numpy(), ref_table.numpy(), 'table after 2 steps')
  assert_close(w.numpy(), ref_w.numpy(), 'w after 2 steps')
  return step


def test_fsdp_embedding_training_gathers_the_table_and_reduce_scatters_its_gradient():
  """Before: 331,780 bytes (the ids gathered, the rows and their gradient exchanged twice by
  all-to-alls). Now: the table gathered (32,768), its dense gradient reduce-scattered (65,536),
  the loss and w's gradient in one fused all-reduce."""
  step = train_and_compare(dense_update)
  by_kind = {(r['kind'], r['op_type']) for r in step.collectives()}
  assert ('all_gather', 'ResourceGather') in by_kind
  assert ('reduce_scatter', 'UnsortedSegmentSum') in by_kind
  assert not [r for r in step.collectives() if r['dtype'] == 'int32'], 'ids moved'
  assert moved(step) <= 100_356, step.collectives()


def test_fsdp_table_lookup_on_xla():
  f = lookup(fsdp_table())
  step = tg.partition(f, MESH, backend='xla')
  x = ids(1, 512, 128)
  assert_close(step(x), f(x), 'sum of squared rows')
  assert moved(step) <= TABLE_BYTES, step.collectives()


def sparse_update(table, grad):
  table.scatter_sub(tf.IndexedSlices(0.5 * grad.values, grad.indices))  # ResourceScatterSub


def test_fsdp_embedding_training_with_row_updates_sums_them_where_they_are():
  """A sparse update (Keras' optimizers update an embedding so) into the FSDP-split table.
  Before: 278,528 bytes (the ids gathered for the lookup, and all 65,536 ids again for the
  update). Now: each partition sums its rows' updates, reduce-scattered onto the table."""
  step = train_and_compare(sparse_update)
  by_kind = {(r['kind'], r['op_type']) for r in step.collectives()}
  assert ('reduce_scatter', 'ResourceScatterSub') in by_kind
  assert not [r for r in step.collectives() if r['dtype'] == 'int32'], 'ids moved'
  assert moved(step) <= 100_356, step.collectives()


def test_few_ids_whose_rows_feed_a_dense_layer_keep_their_batch_split():
  """FSDP: the ids (8 KB) are fewer bytes than the table, but gathering them would leave the
  looked-up rows (512 KB) split by hidden over 'batch', and the dense layer after them would
  sum partial products of that size. The settlement that takes the batch split from the
  activations is charged that sum: the table and the kernel are gathered instead.
  Before: the ids all-gathered and the product all-reduced (69,636 bytes); now 33,796."""
  table = fsdp_table()
  w = tf.Variable(randn(4, HIDDEN, 32))
  tg.shard_variable(w, MESH, tg.P('batch', 'model'))

  @tf.function
  def f(x):
    x = tg.shard(x, MESH, tg.P('batch', None))
    return tf.reduce_sum(tf.square(tf.einsum('bsh,hk->bsk', tf.gather(table, x), w)))

  step = tg.partition(f, MESH)
  x = ids(5, 64, 32)
  assert_close(step(x), f(x), 'sum of squared outputs')
  assert not [r for r in step.collectives() if r['dtype'] == 'int32'], step.collectives()
  assert moved(step) <= TABLE_BYTES, step.collectives()


def test_a_weight_gathered_for_the_forward_is_the_one_its_gradient_reads():
  """FSDP: a kernel split over the batch axis is all-gathered once per step, not once for the
  forward matmul and again for the backward matmul reading the same tensor (the gradient of
  the first layer's output reads the second kernel), as XLA's partitioner caches its
  reshards; values as the unpartitioned step."""
  rng = np.random.RandomState(5)
  starts = [rng.randn(64, 32).astype(np.float32), rng.randn(32, 8).astype(np.float32)]
  x = rng.randn(16, 64).astype(np.float32)

  def make(kernels, mesh=None):
    @tf.function
    def step(x):
      if mesh is not None:
        x = tg.shard(x, mesh, tg.P('batch', None))
      with tf.GradientTape() as tape:
        loss = tf.reduce_sum(tf.tanh(tf.tanh(x @ kernels[0]) @ kernels[1]) ** 2)
      for kernel, grad in zip(kernels, tape.gradient(loss, kernels)):
        kernel.assign_sub(0.1 * grad)
      return loss

    return step

  mine = [tf.Variable(s) for s in starts]
  theirs = [tf.Variable(s) for s in starts]
  for kernel in mine:
    tg.shard_variable(kernel, MESH, tg.P('batch', 'model'))
  partitioned = tg.partition(make(mine, MESH), MESH)
  plain = make(theirs)
  for i in range(2):
    assert_close(partitioned(x), plain(x), f'loss {i}')
  for j, (a, b) in enumerate(zip(mine, theirs)):
    assert_close(a.read_value(), b.read_value(), f'kernel {j} after two steps')
  gathered = [
    r['op'] for r in partitioned.collectives() if r['kind'] == 'all_gather' and 'batch' in r['axes']
  ]
  assert len(gathered) == 2, gathered  # each kernel once (the old code gathered the second twice)

  # Over the reuse bound (a large gathered weight) the backward gathers again, as FSDP does, so
  # that no gathered weight is held from the forward to the backward.
  with mock.patch.object(partitioner_lib, 'REUSED_RESHARD_BYTES', 0):
    again = tg.partition(make(mine, MESH), MESH)
    assert_close(again(x), plain(x), 'loss, nothing reused')
  gathered = [r for r in again.collectives() if r['kind'] == 'all_gather' and 'batch' in r['axes']]
  assert len(gathered) == 3, gathered
