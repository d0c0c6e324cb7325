"""Keras 3 training steps partitioned on 8 logical CPUs, trained 5 steps against the
unpartitioned run."""

import collections
import os
import sys

import numpy as np
import pytest

import tf_gspmd as tg
from tf_gspmd.testing import assert_close, assert_close_to_float64, relative_error
from tf_gspmd.testing.float64 import float64_policy, float64_twin

from helpers import STEPS, image_batches, keras_cnn, keras_mlp, keras_train_step, mlp_batches

sys.path.insert(0, os.path.join(os.path.dirname(__file__), '..', 'examples', 'keras'))
import transformer  # noqa: E402


def train_both(step, reference, batches):
  """Train both steps on `batches`; each step's loss by the oracle."""
  for i, (tokens, labels) in enumerate(batches):
    assert_close(step(tokens, labels), reference(tokens, labels), f'loss of step {i + 1}')


def collective_kinds(step):
  return collections.Counter((r['kind'], r['axes']) for r in step.collectives())


@pytest.mark.parametrize('devices,batch', [(8, 16), (4, 10)])
def test_mlp_data_parallel(devices, batch):
  """(a) and the uneven variant: batch split only; gradient all-reduces appear unwritten."""
  mesh = tg.Mesh.create((devices,), ('data',))
  model, optimizer = keras_mlp(0)
  ref_model, ref_optimizer = keras_mlp(0)
  step = tg.partition(
    keras_train_step(model, optimizer, lambda x: tg.shard(x, mesh, tg.P('data', None))), mesh
  )
  train_both(step, keras_train_step(ref_model, ref_optimizer), mlp_batches(batch))
  assert_close(
    model.variables + optimizer.variables,
    ref_model.variables + ref_optimizer.variables,
    'variables',
  )
  kinds = collective_kinds(step)
  # One pending sum per gradient (6 weights) and one for the loss, fused into buckets
  # (graph_rewrite/coalesce.py): 2 all-reduces of 7 sums; nothing gathered.
  assert kinds == {('all_reduce', ('data',)): 2}
  assert sum(c.get('fused', 1) for c in step.collectives()) == 7


def test_mlp_hidden_not_divisible_by_model_axis():
  """Uneven variant: hidden size 30 over a model axis of 4 (shards of 8, 8, 8, 6)."""
  mesh = tg.Mesh.create((2, 4), ('data', 'model'))
  model, optimizer = keras_mlp(0, hidden=30)
  ref_model, ref_optimizer = keras_mlp(0, hidden=30)
  layout = tg.LayoutMap(mesh)
  layout[r'.*hidden_0/kernel'] = tg.P(None, 'model')
  layout[r'.*hidden_0/bias'] = tg.P('model')
  layout[r'.*hidden_1/kernel'] = tg.P('model', None)
  assert len(layout.apply(model)) == 3
  step = tg.partition(
    keras_train_step(model, optimizer, lambda x: tg.shard(x, mesh, tg.P('data', None))), mesh
  )
  train_both(step, keras_train_step(ref_model, ref_optimizer), mlp_batches(10))
  assert_close(
    model.variables + optimizer.variables,
    ref_model.variables + ref_optimizer.variables,
    'variables',
  )
  assert ('all_reduce', ('model',)) in collective_kinds(step)


@pytest.mark.slow
def test_transformer_megatron_on_data_model_mesh():
  """(b) Two encoder layers; heads and MLP hidden on 'model', batch on 'data', Adam slots alike."""
  mesh = tg.Mesh.create((2, 4), ('data', 'model'))
  model, optimizer = transformer.build(seed=0)
  ref_model, ref_optimizer = transformer.build(seed=0)
  exact_model, exact_optimizer = float64_twin(transformer.build, seed=0)
  transformer.layout(mesh).apply(model)
  step = tg.partition(transformer.train_step(model, optimizer, mesh), mesh)
  batches = [transformer.batch(seed=i) for i in range(STEPS)]
  train_both(step, transformer.train_step(ref_model, ref_optimizer), batches)
  with float64_policy():  # the step's Keras loss computes in the policy it is made under
    exact_step = transformer.train_step(exact_model, exact_optimizer)
  for tokens, labels in batches:
    exact_step(tokens, labels)
  # The float64 rule: the attention key biases have a zero gradient in exact arithmetic (a
  # bias added to every key shifts each query's scores alike; softmax cancels it), so in
  # float32 they and their Adam slots hold round-off alone, different in any two correct
  # runs (measured: normwise 0.63 to 1.55 apart; to float64, partitioned 0.53 to 0.88 x the
  # unpartitioned distance; every other variable 5e-8 to 1.3e-6 from float64, both runs).
  got, want = model.variables + optimizer.variables, ref_model.variables + ref_optimizer.variables
  exact = exact_model.variables + exact_optimizer.variables
  for g, w, e in zip(got, want, exact):
    if 'key_bias' in g.path or 'key/bias' in g.path:
      print(
        f'{g.path}: to float64 partitioned {relative_error(g, e):.3g}, unpartitioned '
        f'{relative_error(w, e):.3g}; partitioned vs unpartitioned {relative_error(g, w):.3g}'
      )
  assert_close_to_float64(got, want, exact, 'variables')

  # Memory: per-device bytes of variables + optimizer state equal total / shard count.
  total = per_device = expected = 0
  for sharded in step.sharded_variables():
    nbytes = int(np.prod(sharded.shape)) * sharded.dtype.size
    shards = int(np.prod(sharded.sharding.tile_shape)) if sharded.sharding.tile_shape else 1
    total += nbytes
    per_device += int(np.prod(sharded.local_shape)) * sharded.dtype.size
    expected += nbytes // shards
  assert per_device == expected < total
  # Slots follow their variables: the query kernel's Adam momentum is split over 'model'.
  momentum = next(
    sharded
    for original, sharded in step.variable_pairs()
    if 'attn_0_query_kernel_momentum' in original.name
  )
  assert momentum.sharding.spec == tg.P(None, 'model', None)
  kinds = collective_kinds(step)
  assert kinds[('all_reduce', ('model',))] >= 4  # attention out + MLP out, forward and backward


sys.path.insert(0, os.path.join(os.path.dirname(__file__), '..', 'examples'))
import moe  # noqa: E402


def test_mixture_of_experts_dispatches_with_all_to_all():
  """(d) GShard-style MoE: groups and experts both on 'model'; tokens move by all-to-all."""
  mesh = tg.Mesh.create((2, 4), ('data', 'model'))
  w, w_ref = moe.weights(0), moe.weights(0)
  moe.annotate(w, mesh)
  step = tg.partition(moe.train_step(w, mesh), mesh)
  reference = moe.train_step(w_ref)
  train_both(step, reference, [moe.batch(seed=i) for i in range(STEPS)])
  assert_close(w, w_ref, 'weights')
  kinds = collective_kinds(step)
  # Groups <-> experts is an all-to-all each way: dispatch and combine forward, and combine's
  # gradient; the backward's second read of combine's operand is the forward's reshard.
  assert kinds[('all_to_all', ('model',))] == 3
  # Nothing as large as one partition's tokens [G/4, S, M] moves by all-gather.
  token_shard_bytes = moe.GROUPS // 4 * moe.TOKENS * moe.D_MODEL * 4
  for rec in step.collectives():
    if rec['kind'] == 'all_gather':
      assert rec['bytes'] < token_shard_bytes, rec


@pytest.mark.slow
@pytest.mark.parametrize(
  'spec',
  [('data', 'h', None, None), ('data', None, None, None)],
  ids=['height_split', 'batch_only'],
)
def test_cnn_with_batchnorm(spec):
  """(c) Image height split over 4 (halo exchange), batch over 2, BatchNorm statistics reduced."""
  mesh = tg.Mesh.create((2, 4), ('data', 'h'))
  model, optimizer = keras_cnn(0)
  ref_model, ref_optimizer = keras_cnn(0)
  exact_model, exact_optimizer = float64_twin(keras_cnn, seed=0)
  step = tg.partition(
    keras_train_step(model, optimizer, lambda x: tg.shard(x, mesh, tg.P(*spec))), mesh
  )
  reference = keras_train_step(ref_model, ref_optimizer)
  with float64_policy():  # the step's Keras loss computes in the policy it is made under
    exact_step = keras_train_step(exact_model, exact_optimizer)
  losses = {'partitioned': [], 'unpartitioned': [], 'float64': []}
  for x, y in image_batches(4):
    losses['partitioned'].append(step(x, y).numpy())
    losses['unpartitioned'].append(reference(x, y).numpy())
    losses['float64'].append(exact_step(x.astype(np.float64), y).numpy())
  assert losses['float64'][0].dtype == np.float64
  # The float64 rule: several Adam steps of a BatchNorm net are ill-conditioned in float32
  # (measured on an AVX-512 CPU, both oneDNN settings: bn_0 and conv_0 bias slots 2.9e-6
  # apart between the two float32 runs, a third of float32's bound after 5 steps; on other
  # CPUs the kernels differ), so both float32 runs are measured against float64.
  assert_close_to_float64(
    np.float32(losses['partitioned']),
    np.float32(losses['unpartitioned']),
    np.float64(losses['float64']),
    'losses',
  )
  assert_close_to_float64(
    model.variables + optimizer.variables,
    ref_model.variables + ref_optimizer.variables,
    exact_model.variables + exact_optimizer.variables,
    'variables',
  )
  kinds = collective_kinds(step)
  assert not any(kind == 'all_gather' for kind, _ in kinds), kinds
  if 'h' in spec:
    assert kinds[('permute', ('h',))] >= 8  # halos of both convs and the pool, both directions
  else:
    assert set(kinds) == {('all_reduce', ('data',))}
