"""GSPMD pipelining on 8 logical CPU devices: 4 stages x 2-way data parallelism, 8 microbatches.

Trains a 4-stage residual MLP with `tg.pipeline` partitioned over (stage=4, data=2), beside the
same stages run in sequence unpartitioned, and prints the bubble fraction, the collectives of
one step, the per-device bytes of weights and optimizer state, the step times side by side, and
the largest error of the losses and trained weights by the oracle (tf_gspmd.testing: normwise
relative error per tensor, bound 1e-5 for float32).
"""

import os
import sys
import time

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
import collections

import numpy as np
import tensorflow as tf

tf.config.set_logical_device_configuration(
  tf.config.list_physical_devices('CPU')[0], [tf.config.LogicalDeviceConfiguration()] * 8
)
import tf_gspmd as tg
from tf_gspmd.testing.oracle import check, report

STAGES, MICROBATCHES, BATCH, WIDTH, HIDDEN = 4, 8, 64, 64, 256
mesh = tg.Mesh.create((STAGES, 2), ('stage', 'data'))


def stage(p, h):
  """One stage: a residual MLP block (the same shape in and out, as pipelining needs)."""
  return h + tf.matmul(tf.nn.gelu(tf.matmul(h, p['w_in']) + p['b_in']), p['w_out'])


def make_step(piped: bool):
  rng = np.random.RandomState(0)
  params = {
    'w_in': tf.Variable(rng.randn(STAGES, WIDTH, HIDDEN).astype(np.float32) * 0.05, name='w_in'),
    'b_in': tf.Variable(np.zeros([STAGES, HIDDEN], np.float32), name='b_in'),
    'w_out': tf.Variable(rng.randn(STAGES, HIDDEN, WIDTH).astype(np.float32) * 0.05, name='w_out'),
  }
  if piped:  # stage s's weights on the devices of stage s
    for v in params.values():
      tg.shard_variable(v, mesh, tg.P('stage', *([None] * (v.shape.rank - 1))))
  optimizer_state = {
    n: tf.Variable(tf.zeros_like(v), name=f'{n}_momentum') for n, v in params.items()
  }

  @tf.function
  def step(x, y):
    x = tg.shard(x, mesh, tg.P('data', None))
    with tf.GradientTape() as tape:
      if piped:
        h = tg.pipeline(stage, params, x, mesh, num_microbatches=MICROBATCHES)
      else:
        h = x
        for s in range(STAGES):
          h = stage({n: v[s] for n, v in params.items()}, h)
      loss = tf.reduce_mean(tf.square(h - y))
    grads = tape.gradient(loss, params)
    for n, v in params.items():  # momentum SGD: one optimizer slot per weight
      optimizer_state[n].assign(0.9 * optimizer_state[n] + grads[n])
      v.assign_sub(0.05 * optimizer_state[n])
    return loss

  return step, params, optimizer_state


def timed(fn, *args, repeats=5):
  fn(*args)
  start = time.perf_counter()
  for _ in range(repeats):
    fn(*args)
  return (time.perf_counter() - start) / repeats


def main():
  rng = np.random.RandomState(1)
  x = rng.randn(BATCH, WIDTH).astype(np.float32)
  y = rng.randn(BATCH, WIDTH).astype(np.float32)
  piped_step, params, slots = make_step(piped=True)
  sequential_step, ref_params, ref_slots = make_step(piped=False)
  pf = tg.partition(piped_step, mesh)
  verdicts = []
  for i in range(3):
    loss, ref_loss = pf(x, y), sequential_step(x, y)
    verdicts.append(check(loss, ref_loss, f'step {i + 1} loss'))
  print(f'bubble fraction (S-1)/(M+S-1): {tg.pipeline_bubble_fraction(STAGES, MICROBATCHES):.3f}')
  kinds = collections.Counter(f'{c["kind"]} over {",".join(c["axes"])}' for c in pf.collectives())
  print('collectives per step:', dict(sorted(kinds.items())))
  sizes = pf.variable_bytes()
  for v in list(params.values()) + list(slots.values()):
    print(f'  {v.name:<14} per device {sizes[v.name]["per_device"]:>7} of {sizes[v.name]["total"]}')
  piped_time, sequential_time = timed(pf, x, y), timed(sequential_step, x, y)
  print(
    f'step time: pipelined on 8 devices {piped_time * 1e3:.1f} ms, sequential on one '
    f'{sequential_time * 1e3:.1f} ms (ratio {piped_time / sequential_time:.2f})'
  )
  verdicts += [check(params[n], ref_params[n], n) for n in params]
  verdicts += [check(slots[n], ref_slots[n], f'{n}_momentum') for n in slots]
  print(f'loss {float(loss):.6f} vs sequential {float(ref_loss):.6f}')
  lines, ok = report(verdicts, 'max relative error vs unpartitioned:')
  print('\n'.join(lines))
  return 0 if ok else 1


if __name__ == '__main__':
  sys.exit(main())
