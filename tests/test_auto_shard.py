"""tg.auto_shard: layouts chosen by pricing candidates under a memory budget.

It must find what experts write (Megatron's column/row split when data parallelism does
not fit, data parallelism when it does, experts split for GShard's MoE), agree with an
exhaustive search of the same candidates on small cases (and no layout of a fixed sample
of them, planned with tg.plan, may beat it), give layouts that partition and train like
the unpartitioned step (by the oracle), and search a 2048-device mesh to a layout as cheap
as the paper's (its time is printed: a benchmark, not asserted).
"""

import importlib
import itertools
import os
import random
import re
import subprocess
import sys
import time

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_gspmd as tg
from tf_gspmd import Mesh, P
from tf_gspmd.annotations import _tf_variable
from tf_gspmd.auto_shard import groups as auto_groups
from tf_gspmd.auto_shard import search as auto_search
from tf_gspmd.testing import assert_close

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, 'examples'), os.path.join(ROOT, 'examples', 'keras')]
import moe  # noqa: E402
import plan_2048  # noqa: E402
import transformer  # noqa: E402

auto = importlib.import_module('tf_gspmd.auto_shard')  # tg.auto_shard is the function
MESH = Mesh.create((2, 4), ('data', 'model'))

# One step model for every machine: the search's choices between near-equal layouts follow
# the fit's prices, and the fit differs by CPU (and by TF's thread pools: this Intel CPU's
# shipped fit, measured with one thread per pool, prices the Megatron MLP's ZeRO variant
# 1.5% under Megatron itself). The suite gives the same answer on every machine: it prices
# with the shipped fit of the CPU these expectations were first measured on.
PINNED_FIT_CPU = 'AMD EPYC x2'


@pytest.fixture(autouse=True)
def _pinned_step_fit(monkeypatch):
  from tf_gspmd.auto_shard import constants as auto_constants

  entry = auto_constants._read(auto_constants.DEFAULT_FIT_FILE)[PINNED_FIT_CPU]  # noqa: SLF001
  monkeypatch.setattr(auto_constants, 'load_step_fit', lambda *a, **k: dict(entry['fit']))


def _mlp(batch, d_model, hidden, seed=0):
  """A Megatron-shaped MLP training step (two matmuls, Keras Adam) and its variables."""
  rng = np.random.RandomState(seed)
  w1 = tf.Variable(rng.randn(d_model, hidden).astype(np.float32) * 0.1, name='w1')
  w2 = tf.Variable(rng.randn(hidden, d_model).astype(np.float32) * 0.1, name='w2')
  optimizer = keras.optimizers.Adam(0.01)
  optimizer.build([w1, w2])

  @tf.function
  def step(x, y):
    with tf.GradientTape() as tape:
      out = tf.matmul(tf.nn.relu(tf.matmul(x, w1)), w2)
      loss = tf.reduce_mean(tf.square(out - y))
    grads = tape.gradient(loss, [w1, w2])
    optimizer.apply_gradients(zip(grads, [w1, w2]))
    return loss

  specs = [tf.TensorSpec((batch, d_model))] * 2
  return step, [w1, w2] + list(optimizer.variables), specs


def _data(specs, seed):
  rng = np.random.RandomState(seed)
  return [
    rng.randn(*s.shape).astype(np.float32)
    if s.dtype == tf.float32
    else rng.randint(0, 64, s.shape).astype(s.dtype.as_numpy_dtype)
    for s in specs
  ]


def _planned(step, specs, variables, layouts, input_axes):
  """The cost model's Evaluation of `step` with `layouts` [(variable, P)], then unannotated."""
  for var, spec in layouts:
    tg.shard_variable(var, MESH, spec)
  shardings = auto_search.Search(step, specs, MESH, 0, [], [], None).input_shardings(input_axes)
  try:
    return auto.estimate(tg.plan(step, *specs, mesh=MESH, in_shardings=shardings))
  finally:
    for var in variables:
      auto_search.clear_layout(_tf_variable(var))


def _unnumbered(name):
  """A Keras optimizer's variable name without the number a second optimizer gets."""
  return re.sub(r'^adam(_\d+)?/', 'adam/', name)


def _train_both(build, result, steps=3, seed=0):
  """Train the step partitioned with `result`'s layouts and unpartitioned; compare by the oracle."""
  step, variables, specs = build(seed)
  ref_step, ref_variables, _ = build(seed)
  by_name = {_unnumbered(_tf_variable(v).name.split(':')[0]): v for v in variables}
  for name, sharding in result.shardings.items():
    tg.shard_variable(by_name[_unnumbered(name)], sharding)
  partitioned = tg.partition(step, result.mesh, in_shardings=result.input_shardings)
  for i in range(steps):
    data = _data(specs, i)
    assert_close(partitioned(*data), ref_step(*data), f'loss of step {i + 1}')
  # The float64 rule (tests/test_models.py): attention key biases have a zero gradient in exact
  # arithmetic (softmax cancels a bias added to every key), so they and their Adam slots hold
  # round-off alone, different in any two correct float32 runs; every other variable must agree.
  kept = [
    i
    for i, v in enumerate(variables)
    if not re.search(r'key.bias', v.path if hasattr(v, 'path') else v.name)
  ]
  assert_close(
    [variables[i].numpy() for i in kept], [ref_variables[i].numpy() for i in kept], 'variables'
  )
  return partitioned


# --- grouping and candidates -------------------------------------------------------------------
def test_layers_share_a_decision_slots_and_biases_follow():
  model, optimizer = transformer.build(seed=0, layers=2)
  step = transformer.train_step(model, optimizer)
  variables = auto_groups.variables_of(
    step,
    [
      tf.TensorSpec((8, 8), tf.int32),
      tf.TensorSpec((8,), tf.int32),
    ],
  )
  groups = {g.key: g for g in auto.group_variables(variables)}
  ffn_in = groups['ffn_in_#/kernel [32, 64] float32']
  assert [v.name for v in ffn_in.members] == ['ffn_in_0/kernel', 'ffn_in_1/kernel']
  # The optimizer's name prefix ('adam', 'adam_1', ...) depends on what the process built before.
  followers = {re.sub(r'^adam(_\d+)?/', '', v.name): rank for v, rank in ffn_in.followers}
  assert followers['ffn_in_1/bias'] == 1  # a bias takes its kernel's output dim
  assert followers['ffn_in_0_kernel_momentum'] is None  # a slot takes the whole layout
  assert 'ffn_in_0_bias_velocity' in followers
  # Query, key and value projections of every layer: one decision.
  assert len(groups['attn_#/*/kernel [32, 4, 8] float32'].members) == 6
  # 2 layers or 20: the same groups (the search grows with distinct layers, not their count).
  assert len(groups) == 10


def test_candidates_split_dims_over_axis_groups_that_divide_them():
  specs = auto.spec_candidates((32, 4, 8), MESH)
  assert P(None, 'model', None) in specs and P('data', 'model', None) in specs
  assert P(None, ('data', 'model'), None) not in specs  # 4 heads over 8 devices: no
  assert len(specs) == len(set(specs)) == 15
  assert auto.spec_candidates((3,), MESH) == [P(None)]


# --- what experts write ------------------------------------------------------------------------
def test_ample_budget_gives_data_parallelism():
  for mesh in (MESH, Mesh.create((8,), ('data',))):
    step, variables, specs = _mlp(batch=8192, d_model=32, hidden=64)
    result = tg.auto_shard(step, *specs, mesh=mesh, memory_budget=10**9)
    print(result.report())
    everything = tuple(mesh.axis_names) if len(mesh.axis_names) > 1 else mesh.axis_names[0]
    assert [s.spec for s in result.input_shardings] == [P(everything, None)] * 2
    assert all(s.is_replicated for s in result.shardings.values()), result.shardings
    assert all(tg.get_sharding(v) is None for v in variables)  # annotations restored


def _megatron_mlp(seed=0):
  # Dims a model axis of 4 divides but no split over all 8 devices does (like 4 heads):
  # the 2x4 mesh is then batch x model, as Megatron writes it.
  return _mlp(batch=256, d_model=132, hidden=1020, seed=seed)


def test_megatron_mlp_when_data_parallelism_does_not_fit():
  step, variables, specs = _megatron_mlp()
  w1, w2 = variables[:2]
  megatron = _planned(
    step, specs, variables, [(w1, P(None, 'model')), (w2, P('model', None))], ('data',)
  )
  data_parallel = _planned(step, specs, variables, [], ('data', 'model'))
  budget = int(megatron.memory * 1.05)
  assert data_parallel.memory > budget, (data_parallel.memory, budget)

  result = tg.auto_shard(step, *specs, mesh=MESH, memory_budget=budget)
  print(result.report())
  got = result.best.report.collective_bytes
  want = megatron.report.collective_bytes
  assert abs(got - want) <= 0.05 * want, (got, want)
  assert result.best.memory <= budget
  assert result.layout_of('w1') == P(None, 'model') and result.layout_of('w2') == P('model', None)
  momentum = next(n for n in result.shardings if n.endswith('w1_0_momentum'))
  assert result.layout_of(momentum) == P(None, 'model')  # the slot follows its variable
  text = result.report()
  for line in ('chosen: predicted', 'runner-up:', 'collectives', 'repeated work'):
    assert line in text, text
  _train_both(_megatron_mlp, result)


SAMPLE = 24  # layouts of the exhaustive space planned with tg.plan, a fixed draw (seed 0)


@pytest.mark.slow
def test_exhaustive_search_confirms_the_descent_on_the_mlp():
  step, _, specs = _mlp(batch=64, d_model=32, hidden=128)
  for budget in (10**9, 60_000):
    descent = tg.auto_shard(step, *specs, mesh=MESH, memory_budget=budget)
    exhaustive = tg.auto_shard(step, *specs, mesh=MESH, memory_budget=budget, search='exhaustive')
    print(descent.report(), exhaustive.report(), sep='\n')
    assert exhaustive.evaluations == 9 * 9 * 4  # every combination was priced
    # The descent's layout is the optimum, or within the cost it does not move for.
    assert descent.best.cost <= exhaustive.best.cost * (1 + 2 * auto.TIE)
    assert descent.best.memory <= budget
    # Both priced by the fast model, ended on a plan: no layout of a fixed sample of the
    # space, planned with tg.plan, beats the descent's by more than it does not move for.
    searcher = descent._searcher  # noqa: SLF001 (the search's own space and planner)
    space = list(itertools.product(*searcher.spaces))
    sample = random.Random(0).sample(space, SAMPLE)
    planned = [searcher.verify(choice) for choice in sample]
    for e in sorted(planned, key=lambda e: e.key(budget)):
      print(f'sampled {e.choice}: planned {e.cost * 1e3:.3f} ms, {e.memory:,} bytes')
    fitting = [e.cost for e in planned if e.memory <= budget]
    assert descent.best.cost <= min(fitting) * (1 + 2 * auto.TIE), (descent.best.cost, fitting)


def test_nothing_fits_names_the_smallest_bytes():
  step, _, specs = _mlp(batch=64, d_model=32, hidden=128)
  with pytest.raises(
    ValueError,
    match=r'fits 1,000 bytes per device; the smallest found '
    r'needs [\d,]+ bytes',
  ):
    tg.auto_shard(step, *specs, mesh=MESH, memory_budget=1000)


def test_fixed_layouts_and_annotations_are_kept():
  step, variables, specs = _mlp(batch=64, d_model=32, hidden=128)
  tg.shard_variable(variables[1], MESH, P(None, 'data'))  # the user's own annotation on w2
  try:
    result = tg.auto_shard(
      step, *specs, mesh=MESH, memory_budget=10**9, fixed={'w1': P('model', None)}
    )
  finally:
    auto_search.clear_layout(variables[1])
  assert result.layout_of('w1') == P('model', None)
  assert result.layout_of('w2') == P(None, 'data')
  assert result.layout_map['w1'] == P('model', None)
  keras_map = result.keras_layout_map()
  assert tuple(keras_map['w1'].axes) == ('model', None)


@pytest.mark.slow  # plans and builds a step (make test runs it)
def test_a_step_the_fast_model_cannot_walk_is_planned_instead(monkeypatch):
  step, _, specs = _mlp(batch=64, d_model=32, hidden=128)

  def cannot(*args, **kwargs):
    raise NotImplementedError('no walk')

  monkeypatch.setattr(auto.Simulator, 'evaluate', cannot)
  result = tg.auto_shard(step, *specs, mesh=MESH, memory_budget=10**9, fixed={'w1': P(None, None)})
  assert result.planned == result.evaluations  # every layout it priced was planned
  assert result.layout_of('w1') == P(None, None)
  assert result.best.report is not None and result.best.memory <= 10**9


def _small_transformer(seed=0):
  model, optimizer = transformer.build(seed=seed, layers=1)
  step = transformer.train_step(model, optimizer)
  specs = [tf.TensorSpec((8, 8), tf.int32), tf.TensorSpec((8,), tf.int32)]
  return step, model.variables + optimizer.variables, specs


@pytest.mark.slow
def test_transformer_finds_megatron_when_data_parallelism_does_not_fit():
  step, variables, specs = _small_transformer()
  model_vars = [v for v in variables if not v.path.startswith('adam/')]
  layout = transformer.layout(MESH)
  megatron = _planned(
    step,
    specs,
    variables,
    [(v, layout[v.path]) for v in model_vars if layout[v.path] is not None],
    ('data',),
  )
  data_parallel = _planned(step, specs, variables, [], ('data', 'model'))
  budget = int(megatron.memory * 1.05)
  assert data_parallel.memory > budget, (data_parallel.memory, budget)
  start = time.perf_counter()
  result = tg.auto_shard(step, *specs, mesh=MESH, memory_budget=budget)
  print(f'searched in {time.perf_counter() - start:.0f} s\n{result.report()}')
  got, want = result.best.report.collective_bytes, megatron.report.collective_bytes
  print(f'collective bytes: auto_shard {got:,}, hand-written Megatron {want:,}')
  assert abs(got - want) <= 0.05 * want, (got, want)
  assert result.best.memory <= budget
  _train_both(_small_transformer, result, steps=2)


def _moe(seed=0):
  cfg = moe.Config(groups=8, tokens=8, d_model=16, experts=8, hidden=64, capacity=2)
  w = moe.weights(seed, cfg)
  step = moe.train_step(w, MESH, cfg=cfg)
  spec = tf.TensorSpec((cfg.groups, cfg.tokens, cfg.d_model))
  return step, list(w.values()), [spec, spec]


@pytest.mark.slow
def test_gshard_moe_shards_the_experts():
  step, variables, specs = _moe()
  replicated = _planned(step, specs, variables, [], ('data',))
  budget = int(replicated.memory * 0.8)
  result = tg.auto_shard(step, *specs, mesh=MESH, memory_budget=budget)
  print(result.report())
  for name in ('w_in', 'w_out'):
    assert 'model' in result.layout_of(name)[0], result.layout_of(name)  # experts split
  _train_both(_moe, result, steps=2)


class _Priced:
  """An evaluation's price alone (what the search's stopping rule reads)."""

  def __init__(self, choice, cost, memory=0):
    self.choice, self.cost, self.memory = choice, cost, memory

  def overflow(self, budget):
    return max(0, self.memory - budget)

  def key(self, budget):
    return (self.overflow(budget), self.cost)


def test_a_candidate_ahead_only_by_the_fast_models_bias_is_not_planned():
  """The plan priced layout a 0.2% above the fast model: a candidate the fast model puts
  0.1% under a is not planned (scaled by that bias it is behind a's plan); one 1% under is.
  Seen on the 2048-device search: four layouts planned alike, three for nothing."""
  searcher = auto_search.Search.__new__(auto_search.Search)
  searcher.budget = 100
  searcher.simulated = {('a',): _Priced(('a',), 5114.5)}
  searcher.planned = {('a',): _Priced(('a',), 5122.7)}
  assert not searcher.worth_planning(_Priced(('b',), 5115.7))
  assert searcher.worth_planning(_Priced(('c',), 5063.0))
  assert not searcher.worth_planning(_Priced(('d',), 5063.0, memory=101))  # over the budget
  searcher.planned, searcher.simulated = {}, {}
  assert searcher.worth_planning(_Priced(('b',), 5115.7))  # nothing planned yet


# --- at scale, without devices -------------------------------------------------------------------
@pytest.mark.slow
def test_dense_transformer_at_2048_chooses_a_layout_as_cheap_as_the_papers():
  mesh = Mesh.create((64, 32), ('X', 'Y'))
  cfg = plan_2048.Dense(layers=1)
  paper = plan_2048.dense_transformer(mesh, cfg, plan_2048.abstract_variables)  # its 2-D layout
  paper = auto.estimate(
    tg.plan(paper.step, *paper.arg_specs, mesh=mesh, in_shardings=paper.in_shardings)
  )

  def unannotated(name, shape, sharding, trainable=True):
    del sharding  # auto_shard chooses
    return tg.abstract_variable(shape, tf.float32, name=name, trainable=trainable)

  built = plan_2048.dense_transformer(mesh, cfg, unannotated)
  params = cfg.parameter_count() * 4
  budget = int(paper.memory * 1.25)  # data parallelism needs 40x more
  start = time.perf_counter()
  result = tg.auto_shard(built.step, *built.arg_specs, mesh=mesh, memory_budget=budget)
  seconds = time.perf_counter() - start
  print(
    f'2048-device search: {seconds:.1f} s, {result.evaluations} layouts planned\n{result.report()}'
  )
  print(f"the paper's 2-D layout: predicted {paper.cost:.1f} s, {paper.memory:,} bytes")
  # The search time is printed, not asserted: speed is a benchmark (examples/plan_2048.py), and
  # a timed assertion fails on a loaded machine for no fault of the code.
  assert result.best.memory <= budget
  assert result.best.report.parameter_bytes < params // 64  # every weight split over Y or more
  assert result.best.cost <= paper.cost * 1.01  # as cheap as the paper's own layout


# --- the bench -----------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.sweep  # the bench's smoke run (about a minute): runs with the full sweep
def test_rank_bench_quick_prints_every_line():
  proc = subprocess.run(
    [sys.executable, os.path.join(ROOT, 'bench', 'auto_shard_rank.py'), '--quick'],
    capture_output=True,
    text=True,
    timeout=900,
    cwd=ROOT,
  )
  assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
  out = proc.stdout
  for model, layouts in (('transformer', ('dp8', 'megatron+data')), ('cnn', ('dp8', 'replicated'))):
    for layout in layouts:
      assert re.search(
        rf'{model} +{re.escape(layout)} +predicted +[\d.]+ ms +measured +[\d.]+ ms', out
      ), out
  for scope in ('transformer', 'cnn', 'all'):
    assert re.search(rf'{scope}: predicted order: .+ < ', out), out
    assert re.search(rf'{scope}: measured order: .+ < ', out), out
    assert re.search(rf'{scope}: Spearman rank correlation -?[\d.]+ over \d+ layouts', out), out


def test_spearman_is_numpy_rank_correlation():
  sys.path.insert(0, os.path.join(ROOT, 'bench'))
  import auto_shard_rank

  assert auto_shard_rank.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
  assert auto_shard_rank.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
  assert auto_shard_rank.spearman([1, 2, 2, 3], [1, 2, 3, 4]) == pytest.approx(0.9486833)
