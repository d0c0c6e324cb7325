"""`make demo`: train a Keras 3 transformer encoder partitioned over 8 logical CPU devices.

The model is plain Keras; a LayoutMap shards attention heads and the MLP
hidden dim over 'model' (Megatron style) and the batch over 'data' on a
(data=2, model=4) mesh. tf_gspmd captures the whole training step (forward,
GradientTape, Adam), propagates the shardings, partitions it into one
per-device program with collectives, and runs it. Each step prints the
partitioned loss beside the unpartitioned run of the same step; at the end,
the collectives one step runs, the per-device memory of variables and
optimizer state, and how far the weights are from the unpartitioned run's by
the oracle (tf_gspmd.testing; float64_check.py: the normwise relative error
per weight, bound 1e-5, and the float64 rule for the weights float32 cannot
resolve, judged against the same steps run in float64).
"""

import collections
import os
import sys
import time

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
os.environ.setdefault('KERAS_BACKEND', 'tensorflow')

import tensorflow as tf  # noqa: E402

NUM_DEVICES = 8
# Before anything initializes TF's devices: split the one CPU into 8 logical devices.
tf.config.set_logical_device_configuration(
  tf.config.list_physical_devices('CPU')[0], [tf.config.LogicalDeviceConfiguration()] * NUM_DEVICES
)

import keras  # noqa: E402
import numpy as np  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, '..', '..'))
sys.path.insert(0, HERE)
import float64_check  # noqa: E402
import transformer  # noqa: E402

import tf_gspmd as tg  # noqa: E402
from tf_gspmd.testing import check  # noqa: E402
from tf_gspmd.testing.float64 import float64_policy, float64_twin  # noqa: E402

STEPS = 8


def memory_table(step, optimizer):
  """Per-device bytes of variables and optimizer state, against total / shard count."""
  rows = collections.defaultdict(lambda: [0, 0, 0])  # total, per device, expected per device
  for original, sharded in step.variable_pairs():
    kind = 'optimizer state' if original.name.startswith(optimizer.name + '/') else 'variables'
    total = int(np.prod(sharded.shape, dtype=np.int64)) * sharded.dtype.size
    shards = int(np.prod(sharded.sharding.tile_shape)) if sharded.sharding.tile_shape else 1
    rows[kind][0] += total
    rows[kind][1] += int(np.prod(sharded.local_shape, dtype=np.int64)) * sharded.dtype.size
    rows[kind][2] += total // shards
  print(f'\n{"per-device memory":<18}{"total bytes":>14}{"per device":>14}{"total/shards":>14}')
  for kind, (total, per_device, expected) in sorted(rows.items()):
    print(f'{kind:<18}{total:>14,}{per_device:>14,}{expected:>14,}')


def main():
  mesh = tg.Mesh.create((2, 4), ('data', 'model'))
  model, optimizer = transformer.build(seed=0)
  ref_model, ref_optimizer = transformer.build(seed=0)
  applied = transformer.layout(mesh).apply(model)
  print(
    f'mesh {mesh}; {len(applied)} variables annotated, e.g. '
    + ', '.join(f'{p} {s}' for p, s in applied[:3])
  )
  step = tg.partition(transformer.train_step(model, optimizer, mesh), mesh)
  reference = transformer.train_step(ref_model, ref_optimizer)
  exact_model, exact_optimizer = float64_twin(transformer.build, seed=0)
  with float64_policy():  # its loss in float64 too
    exact = transformer.train_step(exact_model, exact_optimizer)

  bar = keras.utils.Progbar(STEPS, stateful_metrics=['loss', 'unpartitioned', 'rel_err'])
  start = time.time()
  losses_ok = True
  for i in range(STEPS):
    tokens, labels = transformer.batch(seed=i)
    loss, want = step(tokens, labels), reference(tokens, labels)
    exact(tokens, labels)
    verdict = check(loss, want, f'step {i + 1} loss')
    losses_ok = losses_ok and verdict.ok
    bar.update(
      i + 1, [('loss', float(loss)), ('unpartitioned', float(want)), ('rel_err', verdict.error)]
    )
  print(
    f'{STEPS} steps in {time.time() - start:.1f} s (the first includes capture, '
    'propagation, partitioning and tracing)'
  )

  counts = collections.Counter()
  volume = collections.Counter()
  for rec in step.collectives():
    key = (rec['kind'], ','.join(rec['axes']))
    counts[key] += 1
    volume[key] += rec['bytes']
  print(f'\ncollectives per step: {sum(counts.values())}')
  print(f'{"kind":<12}{"axes":<8}{"count":>6}{"bytes":>10}')
  for (kind, axes), n in counts.most_common(6):
    print(f'{kind:<12}{axes:<8}{n:>6}{volume[(kind, axes)]:>10,}')
  memory_table(step, optimizer)

  report = float64_check.compare_weights(
    model.trainable_variables, ref_model.trainable_variables, exact_model.trainable_variables
  )
  print(
    f'\nafter {STEPS} steps, weights vs unpartitioned: relative error {report.error:.2e} '
    f'(normwise, the worst of {report.compared} weights: {report.worst}; bound 1e-05)'
  )
  print('\n'.join(report.lines))
  if not losses_ok:
    print('MISMATCH: a loss differs from the unpartitioned one by more than the bound')
  return 0 if report.ok and losses_ok else 1


if __name__ == '__main__':
  sys.exit(main())
