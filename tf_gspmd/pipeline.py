"""Pipeline parallelism the GSPMD way: vectorized stages over a mesh axis.

`pipeline(stage_fn, stage_params, x, mesh, ...)`, called inside a tf.function
that tf_gspmd partitions, runs S stages (S = the size of `stage_axis`) on M
microbatches with GPipe's schedule, written as ordinary annotated TF ops:

- the S stages' weights are stacked along a leading dim sharded over
  `stage_axis`, so device s holds stage s's weights (and their optimizer
  state: 1/S of the total);
- a state buffer [S, microbatch, ...] holds the activation each stage works
  on; one vectorized call of `stage_fn` (`tf.vectorized_map`) runs every stage
  at once, each partition computing only its own stage;
- after each iteration the activations move one stage on: a `tf.roll` of the
  stage dim by one, which tf_gspmd partitions as one collective-permute (and
  its gradient as one permute back); stage 0 takes the next microbatch;
- the last stage's outputs are collected into an [S, microbatch, M, ...]
  buffer masked to stage S-1 and summed over stages once at the end, so each
  device holds at most M microbatches of one stage's output.

M + S - 1 iterations run (unrolled in Python: shapes are static and the
gradient needs no loop accumulators); the bubble, the fraction of stage-steps
idle, is (S - 1) / (M + S - 1) (`bubble_fraction`). Every other mesh axis
stays free for data or model parallelism: the microbatch dim and the weights'
other dims take whatever propagation gives them.
"""

from __future__ import annotations

from typing import Callable

import tensorflow as tf

from tf_gspmd.annotations import shard
from tf_gspmd.mesh import Mesh
from tf_gspmd.sharding import P


def bubble_fraction(num_stages: int, num_microbatches: int) -> float:
  """The fraction of stage-steps a GPipe schedule leaves idle: (S - 1) / (M + S - 1)."""
  return (num_stages - 1) / (num_microbatches + num_stages - 1)


def _check(stage_params, x, mesh: Mesh, stage_axis: str, num_microbatches: int) -> int:
  if stage_axis not in mesh.axis_names:
    raise ValueError(f'pipeline: stage_axis {stage_axis!r} is not an axis of {mesh}.')
  stages = mesh.axis_size(stage_axis)
  for p in tf.nest.flatten(stage_params):
    if p.shape.rank is None or p.shape.rank == 0 or p.shape[0] != stages:
      raise ValueError(
        f'pipeline: stage parameter {getattr(p, "name", p)} has shape {p.shape}; every stage '
        f'parameter needs a leading dim of {stages} (one slice per stage of {stage_axis!r}).'
      )
  batch = x.shape[0]
  if batch is None or batch % num_microbatches:
    raise ValueError(
      f'pipeline: batch {batch} of x (shape {x.shape}) is not divisible into '
      f'{num_microbatches} microbatches.'
    )
  return stages


def _stage_spec(stage_axis: str, rank: int) -> P:
  return P(stage_axis, *([None] * (rank - 1)))


def pipeline(
  stage_fn: Callable,
  stage_params,
  x,
  mesh: Mesh,
  stage_axis: str = 'stage',
  num_microbatches: int = 1,
):
  """Run `stage_fn` S times in sequence on `x`, as S pipelined stages over `stage_axis`.

  `stage_fn(params, h) -> h'` is one stage: `params` has the structure of
  `stage_params` with the leading stage dim removed, and h' has h's shape and
  dtype (every stage maps [microbatch, ...] to the same shape). `stage_params`
  holds tensors or variables with leading dim S; `x` is [batch, ...] with batch
  divisible by `num_microbatches`. Returns what applying stage 0, then 1, ...,
  then S-1 to `x` returns. Use inside a tf.function partitioned by
  `tf_gspmd.partition` over `mesh`.

  >>> w = tf.Variable(tf.random.normal([4, 16, 16]))             # doctest: +SKIP
  >>> tg.shard_variable(w, mesh, tg.P('stage', None, None))       # doctest: +SKIP
  >>> y = tg.pipeline(lambda w, h: tf.tanh(h @ w), w, x, mesh,    # doctest: +SKIP
  ...                 num_microbatches=8)
  """
  x = tf.convert_to_tensor(x)
  stages = _check(stage_params, x, mesh, stage_axis, num_microbatches)
  micro = x.shape[0] // num_microbatches
  rest = x.shape[1:].as_list()
  rank = 2 + len(rest)
  # Microbatch m is samples m, M + m, 2M + m, ...: the batch dim's split (data parallelism)
  # stays on the microbatch rows, and picking microbatch m slices an unsplit dim.
  chunks = tf.reshape(x, [micro, num_microbatches] + rest)
  params = tf.nest.map_structure(
    lambda p: shard(
      tf.convert_to_tensor(p),
      mesh,
      _stage_spec(stage_axis, p.shape.rank),
      unspecified_dims=list(range(1, p.shape.rank)),
    ),
    stage_params,
  )
  stage_ids = tf.reshape(tf.range(stages), [stages] + [1] * (rank - 1))
  first, last = tf.equal(stage_ids, 0), tf.equal(stage_ids, stages - 1)
  open_dims = list(range(1, rank))
  state = tf.zeros([stages, micro] + rest, x.dtype)
  collected = tf.zeros([stages, micro, num_microbatches] + rest, x.dtype)
  for step in range(num_microbatches + stages - 1):
    if step:
      # A chain of identities: the gradient reaching the weights is summed iteration by
      # iteration on the way back (one running sum), not kept for all M+S-1 iterations and
      # added at the end, which would hold M+S-1 weight-sized gradients at once.
      params = tf.nest.map_structure(tf.identity, params)
    entering = chunks[:, step] if step < num_microbatches else tf.zeros([micro] + rest, x.dtype)
    state = tf.where(first, entering[tf.newaxis], state)
    state = shard(state, mesh, _stage_spec(stage_axis, rank), unspecified_dims=open_dims)
    out = tf.vectorized_map(
      lambda a: stage_fn(a[0], a[1]), (params, state), fallback_to_while_loop=False
    )
    out = shard(out, mesh, _stage_spec(stage_axis, rank), unspecified_dims=open_dims)
    done = step - (stages - 1)  # the microbatch leaving the last stage
    if done >= 0:
      slot = tf.reshape(
        tf.one_hot(done, num_microbatches, dtype=x.dtype),
        [1, 1, num_microbatches] + [1] * len(rest),
      )
      collected += tf.where(last, out, tf.zeros_like(out))[:, :, tf.newaxis] * slot
    state = tf.roll(out, 1, axis=0)  # every stage hands its activation to the next
  outputs = tf.reduce_sum(collected, axis=0)
  return tf.reshape(outputs, [micro * num_microbatches] + rest)
