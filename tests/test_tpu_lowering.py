"""The TPU path: the partitioned step traced with XLA collective ops and lowered to HLO.

No TPU here: the program is built and lowered, and its collectives and replica
groups are read from the HLO (XLA on CPU lowers the all-reduce family).
"""

import numpy as np
import tensorflow as tf

import tf_gspmd as tg
from tf_gspmd.xla_bridge.hlo import hlo_collectives

MODEL_GROUPS = ((0, 1, 2, 3), (4, 5, 6, 7))
DATA_GROUPS = ((0, 4), (1, 5), (2, 6), (3, 7))


def test_megatron_training_step_lowers_to_hlo_all_reduces_with_mesh_groups():
  mesh = tg.Mesh.create((2, 4), ('data', 'model'))
  w1 = tf.Variable(np.ones((16, 32), np.float32))
  w2 = tf.Variable(np.ones((32, 8), np.float32))
  tg.shard_variable(w1, mesh, tg.P(None, 'model'))
  tg.shard_variable(w2, mesh, tg.P('model', None))

  @tf.function
  def step(x):
    x = tg.shard(x, mesh, tg.P('data', None))
    with tf.GradientTape() as tape:
      loss = tf.reduce_sum(tf.matmul(tf.nn.relu(tf.matmul(x, w1)), w2) ** 2)
    g1, g2 = tape.gradient(loss, [w1, w2])
    w1.assign_sub(0.01 * g1)
    w2.assign_sub(0.01 * g2)
    return loss

  pf = tg.partition(step, mesh)
  program, hlo = pf.lower_xla(np.ones((8, 16), np.float32))
  found = [(c.kind, c.shape, c.replica_groups) for c in hlo_collectives(hlo)]
  assert found == [
    ('all-reduce', 'f32[4,8]', MODEL_GROUPS),  # row-parallel matmul resolved over 'model'
    # The loss over the batch and the gradients of w1's and w2's shards, resolved together
    # (graph_rewrite/coalesce.py) as one all-reduce each, side by side: XLA's all-reduce
    # combiner fuses them on TPU without the copies a concatenation makes.
    ('all-reduce', 'f32[]', DATA_GROUPS),
    ('all-reduce', 'f32[16,8]', DATA_GROUPS),
    ('all-reduce', 'f32[8,8]', DATA_GROUPS),
  ]
  assert program.backend == 'xla'
  # The program is the same for every replica: only the partition id input differs.
  graph_ops = {op.type for op in program.function.graph.get_operations()}
  assert 'XlaAllReduce' in graph_ops and not graph_ops & {
    'CollectiveReduceV2',
    'CollectiveGatherV2',
  }
