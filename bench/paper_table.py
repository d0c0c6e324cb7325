"""The GSPMD paper's dense Transformer on 2048 TPU v3 cores, PREDICTED by tg.plan's cost model.

No TPU runs here: each configuration's Adam training step is planned with `tg.plan` on a
(X, Y) mesh of 2048 devices (none needed) with 2-D weight sharding (examples/plan_2048.py's
`dense_transformer`: activations [batch over X, model dim over Y], every weight over X and
Y; f32 weights and Adam slots, the layer computed in bfloat16 as the paper did), and its
features are priced on `tg.TPU_V3` (one TensorCore: 61.5 TFLOPS bf16, 16 GiB HBM at
450 GB/s, 2-D torus links; see tf_gspmd/step_cost.py for the sources and
docs/scaling_out.md for what the model leaves out).

One layer is representative: every layer is the same program, so each configuration is
planned with 1 and 2 layers and the step extrapolated linearly to its depth (time, flops
and per-device bytes alike), which keeps planning in seconds.

Configurations: the GSPMD authors' own 2048-core dense LM configurations in Lingvo
(github.com/tensorflow/lingvo, lingvo/tasks/lm/params/synthetic_packed_input.py:
DenseLm128B32x32 and DenseLm175B32x32), with the throughput those files say to expect;
the paper (Xu et al. 2021, arXiv:2105.04663) reports 50% to 62% of peak FLOPS on up to
2048 TPU v3 cores for its dense Transformers (abstract). Lingvo's runs use gated GELU,
relative attention, a 32k vocabulary and Adafactor, which the planned step leaves out (the
128B configuration's gated feed-forward, three [8192, 65536] matrices, is planned as two
[8192, 98304]: the same parameters and flops).

  .venv/bin/python bench/paper_table.py
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [ROOT, os.path.join(ROOT, 'examples')]

import plan_2048  # noqa: E402

import tf_gspmd as tg  # noqa: E402


@dataclasses.dataclass(frozen=True)
class PaperConfig:
  """One configuration: the model, its mesh, and the throughput its source reports."""

  name: str
  model: plan_2048.Dense  # all of its layers
  mesh: tuple  # (X, Y)
  tokens_per_second: float  # what its Lingvo config's comment says to expect
  source: str

  @property
  def tokens(self) -> int:
    return self.model.batch * self.model.seq

  @property
  def reported_step(self) -> float:
    return self.tokens / self.tokens_per_second


LINGVO = 'lingvo synthetic_packed_input.py'
CONFIGS = (
  PaperConfig(  # gated GELU's 3 matrices [8192, 65536] planned as 2 of [8192, 98304]: same size
    '128B (64 layers)',
    plan_2048.Dense(64, 512, 1024, 8192, 128, 128, 98304, 'bfloat16'),
    (32, 64),
    62e3,
    f'{LINGVO} DenseLm128B32x32: "Expect ~ 62k tokens/sec"',
  ),
  PaperConfig(
    '175B (96 layers)',
    plan_2048.Dense(96, 1024, 2048, 12288, 96, 128, 49152, 'bfloat16'),
    (64, 32),
    51.53e3,
    f'{LINGVO} DenseLm175B32x32: "Expect ~51.53k tokens / sec"',
  ),
)
PAPER_RANGE = '50%-62% of peak (paper abstract, 2048 TPU v3 cores, dense up to 1T parameters)'


@dataclasses.dataclass
class Predicted:
  """A configuration's step extrapolated from its planned 1- and 2-layer steps."""

  seconds: float
  terms: dict  # compute, memory, launch, collectives (seconds)
  flops: float  # per device
  memory: int  # per-device bytes: parameters + optimizer state + activation peak
  plan_seconds: float

  @property
  def utilization(self) -> float:
    return self.flops / self.seconds / tg.TPU_V3.flops('bfloat16')


def plan_layers(cfg: PaperConfig, layers: int):
  mesh = tg.Mesh.create(cfg.mesh, ('X', 'Y'))
  model = dataclasses.replace(cfg.model, layers=layers)
  built = plan_2048.dense_transformer(mesh, model, plan_2048.abstract_variables)
  return plan_2048.plan(built, mesh)


def predict(cfg: PaperConfig) -> Predicted:
  """Plan 1 and 2 layers, price both on TPU_V3, extrapolate to the configuration's depth."""
  start = time.perf_counter()
  one, two = (plan_layers(cfg, n) for n in (1, 2))
  t1, t2 = one.step_time(tg.TPU_V3), two.step_time(tg.TPU_V3)
  depth = cfg.model.layers - 1

  def scaled(a: float, b: float) -> float:
    return a + depth * (b - a)

  terms = {
    k: scaled(getattr(t1, k), getattr(t2, k))
    for k in ('compute', 'memory', 'launch', 'collectives')
  }
  m1, m2 = (r.parameter_bytes + r.optimizer_bytes + r.activation_peak for r in (one, two))
  return Predicted(
    sum(terms.values()),
    terms,
    scaled(t1.flops, t2.flops),
    int(scaled(m1, m2)),
    time.perf_counter() - start,
  )


def main(argv=None) -> int:
  argparse.ArgumentParser(description=__doc__.split('\n')[0]).parse_args(argv)
  print('PREDICTED by tg.plan + tg.TPU_V3 (no TPU ran); reference figures from their sources.')
  print(f'paper: {PAPER_RANGE}')
  profile = tg.TPU_V3
  print(
    f'profile: {profile.name}: {profile.flops("bfloat16") / 1e12:.1f} TFLOPS bf16, '
    f'{profile.memory_bytes / 2**30:.0f} GiB at {profile.memory_bandwidth / 1e9:.0f} GB/s, '
    f'links {profile.link_bandwidth / 1e9:.1f} GB/s per direction, {profile.topology}'
  )
  for cfg in CONFIGS:
    p = predict(cfg)
    reported_util = p.flops * cfg.tokens_per_second / cfg.tokens / profile.flops('bfloat16')
    m = cfg.model
    print(
      f'\n{cfg.name}: {m.layers} layers, d_model {m.d_model}, {m.heads} heads x {m.d_head}, '
      f'ff {m.hidden}, batch {m.batch} x seq {m.seq}, mesh {cfg.mesh[0]} x {cfg.mesh[1]}, '
      f'{m.parameter_count() / 1e9:.1f}B parameters'
    )
    terms = ', '.join(f'{k} {v:.3f} s' for k, v in p.terms.items())
    print(
      f'  predicted step {p.seconds:.2f} s ({terms}); {p.utilization:.1%} of peak; '
      f'{p.memory / 2**30:.2f} GiB per device (of {profile.memory_bytes / 2**30:.0f}; no '
      f'rematerialization); planned in {p.plan_seconds:.1f} s'
    )
    print(
      f'  reported  step {cfg.reported_step:.2f} s ({cfg.tokens_per_second / 1e3:.2f}k tokens/s: '
      f'{cfg.source}); at the planned flops that is {reported_util:.1%} of peak'
    )
  return 0


if __name__ == '__main__':
  sys.exit(main())
