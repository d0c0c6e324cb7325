"""tg.plan: per-device bytes and collectives of a step on a mesh of any size, without devices.

At N=8 the plan must equal what tg.partition builds and runs for the same step
(variable bytes, every collective, the activation liveness of the program);
at N=2048 the per-device bytes must equal the closed form from the model's
dims, with no memory proportional to the global model allocated.
"""

import os
import resource
import sys
from unittest import mock

import numpy as np
import pytest
import tensorflow as tf

import tf_gspmd as tg
from tf_gspmd import Mesh, NamedSharding, P
from tf_gspmd.graph_rewrite import partitioner as partitioner_lib
from tf_gspmd.planning import activation_peak

from helpers import run_python

sys.path.insert(0, os.path.join(os.path.dirname(__file__), '..', 'examples'))
import moe  # noqa: E402
import plan_2048 as models  # noqa: E402

SMALL_DENSE = models.Dense(layers=1, batch=4, seq=4, d_model=8, heads=4, d_head=2, hidden=16)
SMALL_MOE = moe.Config(groups=8, tokens=8, d_model=8, experts=8, hidden=16, capacity=2)


def _rss_bytes() -> int:
  with open('/proc/self/status') as status:
    line = next(t for t in status if t.startswith('VmRSS:'))
  return int(line.split()[1]) * 1024


def _collectives(records):
  return [(r['kind'], tuple(r['axes']), tuple(r['shape']), r['bytes'], r['op']) for r in records]


def _run_both(build, mesh, cfg, data):
  """(partitioned function, its loss, the unpartitioned loss) of one Adam step on `data`."""
  partitioned = build(mesh, cfg, models.real_variables(0))
  reference = build(mesh, cfg, models.real_variables(0))
  pf = tg.partition(partitioned.step, mesh, in_shardings=partitioned.in_shardings)
  loss = float(pf(*data))
  want = float(reference.step(*data))
  return pf, loss, want


@pytest.mark.parametrize('which', ['dense', 'moe'])
def test_plan_at_8_is_what_partition_builds_and_runs(which):
  if which == 'dense':
    mesh, cfg, build = Mesh.create((2, 4), ('X', 'Y')), SMALL_DENSE, models.dense_transformer
  else:
    mesh, cfg, build = Mesh.create((8,), ('model',)), SMALL_MOE, models.gshard_moe
  planned = build(mesh, cfg, models.abstract_variables)
  report = tg.plan(planned.step, *planned.arg_specs, mesh=mesh, in_shardings=planned.in_shardings)

  rng = np.random.RandomState(1)
  data = [rng.randn(*s.shape).astype(np.float32) for s in planned.arg_specs]
  pf, loss, want = _run_both(build, mesh, cfg, data)
  assert abs(loss - want) <= 1e-5 * abs(want), (loss, want)  # the partition runs correctly

  assert report.variable_bytes() == pf.variable_bytes()
  assert _collectives(report.collectives()) == _collectives(pf.collectives())
  assert report.collectives(), 'a 2-D or expert-sharded step without collectives: wrong layouts'
  real_graph = pf.get_program(*data).prepared.per_partition.function.graph
  assert (report.activation_peak, report.activation_tensors) == activation_peak(real_graph)
  assert report.parameter_bytes == sum(v.per_device for v in report.variables if v.trainable)
  assert report.optimizer_bytes == 2 * report.parameter_bytes  # Adam: two slots per weight
  assert 'activation peak' in str(report) and 'collectives per step' in str(report)


@pytest.mark.slow  # a 2048-device plan (make test runs it)
def test_dense_transformer_at_2048_matches_its_formula_without_allocating():
  mesh = Mesh.create((64, 32), ('X', 'Y'))
  cfg = models.Dense(layers=2)
  before = _rss_bytes()
  built = models.dense_transformer(mesh, cfg, models.abstract_variables)
  report = tg.plan(built.step, *built.arg_specs, mesh=mesh, in_shardings=built.in_shardings)
  grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before  # an upper bound
  print(report)

  params = cfg.parameter_count() * 4
  assert report.global_parameter_bytes == params
  assert report.parameter_bytes == params // 2048  # every weight split over X and Y
  assert report.optimizer_bytes == 2 * params // 2048
  # Nothing proportional to the global model (6.4 GB of weights + 12.9 GB of slots) was made.
  assert grown < 1.5e9, f'planning grew the process by {grown / 1e9:.1f} GB'
  assert report.activation_peak > 0

  # The 2-D pattern: each weight's gradient reduce-scattered over the batch axis X once; one
  # all-reduce of the loss; no all-to-all. The same collectives as the same step at N=8.
  summary = report.collective_summary()
  weights = 6 * cfg.layers
  assert summary[('reduce_scatter', ('X',))]['count'] == weights
  assert summary[('all_reduce', ('X', 'Y'))]['count'] == 1
  assert not any(kind == 'all_to_all' for kind, _ in summary)
  assert report.collective_bytes == 1_515_847_684
  small_mesh = Mesh.create((2, 4), ('X', 'Y'))
  small_cfg = models.Dense(layers=2, batch=4, seq=4, d_model=8, heads=4, d_head=2, hidden=16)
  small = models.dense_transformer(small_mesh, small_cfg, models.abstract_variables)
  # At 2048 every reshard result is over the reuse bound (a weight gathered for the forward is
  # gathered again for the backward); the small step reuses nothing either when the bound is 0.
  with mock.patch.object(partitioner_lib, 'REUSED_RESHARD_BYTES', 0):
    small_report = tg.plan(
      small.step, *small.arg_specs, mesh=small_mesh, in_shardings=small.in_shardings
    )
  counts = {k: v['count'] for k, v in summary.items()}
  assert counts == {k: v['count'] for k, v in small_report.collective_summary().items()}


def test_gshard_moe_at_2048_matches_its_formula():
  mesh = Mesh.create((2048,), ('model',))
  cfg = models.moe_config(2048)
  built = models.gshard_moe(mesh, cfg, models.abstract_variables)
  report = tg.plan(built.step, *built.arg_specs, mesh=mesh, in_shardings=built.in_shardings)
  print(report)
  gate, experts = models.moe_parameter_count(cfg)
  assert report.global_parameter_bytes == 4 * (gate + experts)
  assert report.parameter_bytes == 4 * (gate + experts // 2048)  # gate whole, one expert here
  assert report.optimizer_bytes == 2 * report.parameter_bytes
  summary = report.collective_summary()
  # Dispatch and combine move tokens between group and expert layouts: all-to-alls, forward
  # and backward (at this size the backward's re-read of combine's operand is resharded
  # again, over the reuse bound); nothing gathers the expert weights.
  assert summary[('all_to_all', ('model',))]['count'] == 4
  assert not any(
    r['kind'] == 'all_gather' and r['op'].startswith(('w_in', 'w_out'))
    for r in report.collectives()
  )


def test_plan_refuses_a_mesh_that_is_not_a_mesh():
  with pytest.raises(TypeError, match='plan: mesh must be a tf_gspmd.Mesh'):
    tg.plan(lambda x: x, tf.TensorSpec([4]), mesh=(2048,))


def test_abstract_variable_has_no_value_and_keeps_its_sharding():
  mesh = Mesh.create((2048,), ('x',))
  sharding = NamedSharding(mesh, P('x', None))
  v = tg.abstract_variable([2048 * 1024, 1024], tf.float32, sharding, name='big')
  assert v.shape == (2048 * 1024, 1024) and tg.get_sharding(v) == sharding
  assert not bool(v.is_initialized())
  assert v.numpy().size == 0  # 8 GB that were never allocated: a read finds no buffer


@pytest.mark.slow  # a page or a fresh interpreter: `make test` runs it, the edit loop not
def test_readme_planning_at_scale_example_runs_verbatim(tmp_path):
  """docs/scaling_out.md, 'Planning at scale': its block runs and prints what the text says."""
  import pathlib
  import re

  root = pathlib.Path(__file__).resolve().parent.parent
  page = (root / 'docs' / 'scaling_out.md').read_text()
  section = page[page.index('## Planning at scale') : page.index('## Several processes')]
  block = re.search(r'```python\n(.*?)```', section, re.S).group(1)
  script = tmp_path / 'readme_planning.py'
  script.write_text(block)
  result = run_python(script)
  assert result.returncode == 0, result.stderr[-3000:]
  lines = result.stdout.splitlines()
  assert lines[0] == '4294967296 2097152 2097152' and lines[0] in section
  assert lines[1] == (
    "[('all_gather', ('X',)), ('all_reduce', ('X', 'Y')), ('all_to_all', ('X',)), "
    "('reduce_scatter', ('X',))]"
  )
  # Chosen by bytes: moving x (42 MB a device) instead of all-gathering the weight (136 MB).
  assert lines[2] == '42467332' and '42 MB' in section
