"""tf_gspmd's partitioned program beside XLA's own SPMD partitioner, on the identical TF step.

For each model the same annotated, unpartitioned Keras/TF training step is
partitioned twice on 8 PJRT CPU devices and both programs are compiled by XLA
and run through the same PJRT runtime:

  ours  `tg.partition(step, mesh, backend='xla')`: tf_gspmd's per-replica
        program (replica id = partition id, native collectives), exported to
        StableHLO and compiled with num_replicas=8.
  xla   `tf_gspmd.xla_bridge.reference_partitioner.XlaPartitionedStep`: the step
        lowered through tf2xla with its XlaSharding annotations, every
        parameter given the layout tf_gspmd chose for it (the same inputs and
        variable layouts on both sides), compiled with num_partitions=8 and
        use_spmd_partitioning (GSPMD): XLA partitions it itself.

Models (bench/step_time.py's sizes; --quick for the small ones):
  mlp          Keras MLP + Adam, data parallel (data=8).
  transformer  examples/keras/transformer.py + Adam, Megatron layout on (data=2, model=4).
  cnn          Conv/BatchNorm/MaxPool + Adam, image height split over h=4 (halos), batch
               over data=2.
  moe          examples/moe.py, GShard top-1 MoE, groups and experts on 'model' (2x4).
  transformer_fsdp  the transformer with FSDP-style layouts: every kernel's and the
               embedding's hidden dim over the batch axis 'data' (`fsdp_layout`).
  transformer_hub   the transformer under Keras Hub's kind of layout map (`hub_layout`).

Printed per model, for ours and XLA's:
  collectives   collective instructions of the compiled (optimized) HLO, per step; XLA's
                combiner merges small all-reduces into one tuple all-reduce on both sides
  bytes         bytes one device receives per step, summed over those collectives (rules in
                tf_gspmd/xla_bridge/reference_partitioner.py: ring all-reduce 2(g-1)/g, ...)
  peak KiB      per-device peak from the compiled executable's buffer assignment
                (arguments + outputs + temporaries; neither side donates its input buffers)
  step ms       median time of one execute of the compiled program (inputs already on the
                devices, outputs waited for), the two programs called in turn; 'ratio' is
                ours/XLA of the medians, 'min ratio' of the fastest calls (less load noise)
  check         both trained --check-steps steps against the unpartitioned step (compiled
                by XLA as well), compared by the oracle (tf_gspmd.testing.oracle): 'rel err'
                is the largest normwise relative error ||got - want|| / ||want|| over the
                loss history and every variable, one tensor at a time (bound 1e-5 for
                float32; integers exactly). The Keras models' variables are judged by the
                oracle's float64 rule against the same steps run unpartitioned in float64:
                each partitioned run no further from float64 than twice the unpartitioned
                run, plus 1e-5, tensor by tensor ('oracle': ok, or MISMATCH naming the
                tensors). The MoE (SGD, well conditioned, float32 constants in its step) has
                no float64 run: the default bound applies to every variable
  floor         the largest normwise error of the unpartitioned float32 run against the
                float64 one, over the variables float32 resolves (within the bound of
                float64): how far round-off alone moves them in --check-steps steps
  round-off     how many variables float32 does not resolve: their gradient is zero in
                exact arithmetic (a convolution bias before BatchNorm, the attention key
                biases, their Adam slots, BatchNorm's moving mean that carries such a bias),
                so they hold round-off alone, which Adam (m / sqrt(v) of a ~1e-9 gradient is
                +-1) turns into steps of lr: two correct float32 runs land ~1 apart there.
                Only the float64 rule judges them; 'rel err', 'floor' and 'ours vs XLA' are
                over the other variables
  ours vs XLA   the variables of the two partitioned runs against each other (normwise,
                largest over the tensors)

Why the bytes can differ (the table is followed by a per-kind breakdown for every model
where XLA moves fewer bytes):
  * XLA's partitioner sees the whole step at once and may pick another layout for
    intermediate values (e.g. keep an activation gradient sharded and gather a weight
    instead); tf_gspmd follows its propagated shardings op by op.
  * Both sides count what their compiled HLO moves, after XLA's own passes (its all-reduce
    combiner merges small all-reduces into one tuple all-reduce on either side).
Measured at full sizes (docs/xla_and_tpu.md, "Side by side with XLA's own partitioner"):
XLA never moved fewer bytes. MLP and transformer: the same collectives on both sides, byte for byte.
CNN: XLA exchanges halos again in the backward pass (10 collective-permutes against 6) and reduces
BatchNorm statistics over h and data in two steps (1.36 MB against 0.99 MB; tf_gspmd's
halos of the image gradients carry output-gradient rows, 64 channels, since it computes
the own rows directly, as XLA does). MoE: XLA
all-gathers the [G, S, M] tokens twice where tf_gspmd keeps them split and moves them by
all-to-all only (7,320 B against 3,864 B).
Step time: the CNN is the one model where ours can be slower (ours/XLA 1.03-1.06 by median,
0.99-1.06 by fastest call, over 3 full-size 20-step runs on a loaded 2-core machine; it was
0.98-1.17 while tf_gspmd computed the input gradient of the second convolution on a
halo-padded window, f32[32,10,34,32] per device, then sliced). Both now compute that
gradient as the f32[32,8,32,32] shard directly, after a halo exchange of the output
gradient: the compiled convolutions are the same shapes on both sides.

  .venv/bin/python bench/vs_xla.py [--models mlp,transformer,cnn,moe] [--quick]
                                   [--steps 20] [--check-steps 3] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
os.environ.setdefault('KERAS_BACKEND', 'tensorflow')

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [ROOT, HERE, os.path.join(ROOT, 'examples'), os.path.join(ROOT, 'examples', 'keras')]

import numpy as np  # noqa: E402
import step_time  # noqa: E402  (sibling: model sizes and builders)
import tensorflow as tf  # noqa: E402

NUM_DEVICES = 8
MODELS = ('mlp', 'transformer', 'cnn', 'moe', 'transformer_fsdp', 'transformer_hub')


def fsdp_layout(mesh):
  """FSDP-style: every weight's hidden (d_model) dim split over the batch axis 'data', the
  Megatron dims over 'model' (the embedding and the head split by hidden too)."""
  from tf_gspmd import P
  from tf_gspmd.keras.layout import LayoutMap

  rules = LayoutMap(mesh)
  rules[r'.*embed/embeddings'] = P(None, 'data')
  rules[r'.*attn_\d+/(query|key|value)/kernel'] = P('data', 'model', None)
  rules[r'.*attn_\d+/attention_output/kernel'] = P('model', None, 'data')
  rules[r'.*ffn_in_\d+/kernel'] = P('data', 'model')
  rules[r'.*ffn_out_\d+/kernel'] = P('model', 'data')
  rules[r'.*head/kernel'] = P('data', None)
  return rules


def hub_layout(mesh):
  """Keras Hub's kind of map (LlamaBackbone.get_layout_map, its 'batch' axis named 'data'):
  embedding (vocab, hidden) on ('model', 'data'), query/key/value kernels on ('model', 'data',
  None) (hidden over 'model', heads over the batch axis), the attention output on ('model',
  None, 'data'), the MLP's in and out kernels on ('data', 'model') and ('model', 'data')."""
  from tf_gspmd import P
  from tf_gspmd.keras.layout import LayoutMap

  rules = LayoutMap(mesh)
  rules[r'.*embed/embeddings'] = P('model', 'data')
  rules[r'.*attn_\d+/(query|key|value)/kernel'] = P('model', 'data', None)
  rules[r'.*attn_\d+/attention_output/kernel'] = P('model', None, 'data')
  rules[r'.*ffn_in_\d+/kernel'] = P('data', 'model')
  rules[r'.*ffn_out_\d+/kernel'] = P('model', 'data')
  return rules


# The transformer under other layouts than its Megatron one (same model, step and mesh).
LAYOUT_VARIANTS = {'transformer_fsdp': fsdp_layout, 'transformer_hub': hub_layout}
MOE_MESH = ((2, 4), ('data', 'model'))


class Case:
  """One model: the annotated step (shared by both sides), a reference step, a batch."""

  def __init__(self, name: str, quick: bool):
    import tf_gspmd as tg

    self.name = name
    if name == 'moe':
      import moe

      self.mesh = tg.Mesh.create(*MOE_MESH)
      self.weights, ref_weights = moe.weights(0), moe.weights(0)
      moe.annotate(self.weights, self.mesh)
      self.step = moe.train_step(self.weights, self.mesh)
      self.reference = _jit(moe.train_step(ref_weights))
      self.variables = list(self.weights.values())
      self.ref_variables = list(ref_weights.values())
      self.batch = moe.batch(1)
      self.exact = None  # float32 constants in its step; SGD: float32 is well conditioned
      return
    base = 'transformer' if name in LAYOUT_VARIANTS else name
    spec = step_time.ModelSpec(base, step_time.CONFIGS['quick' if quick else 'full'][base])
    if name in LAYOUT_VARIANTS:
      spec.layout = LAYOUT_VARIANTS[name]
    self.mesh = spec.tg_mesh()
    model, optimizer = spec.keras()
    ref_model, ref_optimizer = spec.keras()
    if spec.layout is not None:
      spec.layout(self.mesh).apply(model)
    self.step = spec.train_step(model, optimizer, self.mesh)
    self.reference = _jit(spec.train_step(ref_model, ref_optimizer))
    self.variables = list(model.variables) + list(optimizer.variables)
    self.ref_variables = list(ref_model.variables) + list(ref_optimizer.variables)
    self.batch = (spec.x, spec.y)
    self.exact = _float64_step(spec)


def _float64_step(spec):
  """(step, variables, batch): the unpartitioned step in float64, from the float32 models'
  initial weights: the exact answer the oracle's float64 rule measures both runs against."""
  from tf_gspmd.testing.float64 import float64_policy, float64_twin

  model, optimizer = float64_twin(spec.keras)
  with float64_policy():
    step = spec.train_step(model, optimizer)  # its Keras loss takes the policy: float64
  variables = list(model.variables) + list(optimizer.variables)
  batch = tuple(b.astype(np.float64) if b.dtype == np.float32 else b for b in (spec.x, spec.y))
  return step, variables, batch


def _jit(step):
  """The unpartitioned step compiled by XLA too, so that all three runs share one compiler
  (TF's own CPU kernels differ from XLA's in rounding; Adam turns a 1e-7 difference in a
  near-zero gradient into a visible one)."""
  return tf.function(step.python_function, jit_compile=True)


def _tf_variable(v):
  """The tf.Variable behind a Keras variable (or the variable itself)."""
  return v.value if hasattr(v, 'path') else v


def build_both(case: Case):
  """(ours, xla, build seconds of each): both start from the variables' current values."""
  import tf_gspmd as tg
  from tf_gspmd.xla_bridge import reference_partitioner

  start = time.perf_counter()
  ours = tg.partition(case.step, case.mesh, backend='xla')
  program = ours.get_program(*case.batch)
  ours.xla_executable(*case.batch)
  ours_seconds = time.perf_counter() - start
  layouts = {id(v): ours.store.sharded[id(v)].sharding for v in program.variables}
  start = time.perf_counter()
  xla = reference_partitioner.XlaPartitionedStep(
    case.step,
    case.batch,
    NUM_DEVICES,
    arg_shardings=program.arg_shardings,
    variable_sharding=lambda v: layouts.get(id(v)),
  )
  return ours, xla, ours_seconds, time.perf_counter() - start


def check(case: Case, ours, xla, steps: int) -> dict:
  """Train `steps` steps three ways (and in float64 where the case has it); the oracle's
  normwise errors of ours and XLA's against the reference, and its verdicts."""
  from tf_gspmd.testing import oracle

  ours_losses, xla_losses, ref_losses = [], [], []
  for _ in range(steps):
    if case.exact is not None:
      case.exact[0](*case.exact[2])
    ref_losses.append(np.asarray(case.reference(*case.batch)))
    ours_losses.append(np.asarray(ours(*case.batch)))
    xla_losses.append(np.asarray(xla(*case.batch)))
  xla_values = xla.read_variables()
  names = [_tf_variable(v).name for v in case.variables]
  want = {n: np.asarray(r.numpy()) for n, r in zip(names, case.ref_variables)}
  # Every variable of the step is held by both sides (a KeyError here is a bench bug).
  got = {
    'ours': {
      n: ours.store.sharded[id(_tf_variable(v))].numpy() for n, v in zip(names, case.variables)
    },
    'xla': {n: np.asarray(xla_values[n]) for n in names},
  }
  exact = (
    None if case.exact is None else {n: np.asarray(e.numpy()) for n, e in zip(names, case.exact[1])}
  )
  losses = {'ours': np.stack(ours_losses), 'xla': np.stack(xla_losses)}
  want_losses = np.stack(ref_losses)

  def largest(pairs):
    return max((oracle.relative_error(a, b) for a, b in pairs), default=0.0)

  failures = []
  for side in ('ours', 'xla'):
    verdict = oracle.check(losses[side], want_losses, f'{side} losses')
    if not verdict.ok:
      failures.append(str(verdict))
    try:
      if exact is None:
        oracle.assert_close(got[side], want, side)
      else:
        oracle.assert_close_to_float64(got[side], want, exact, side)
    except AssertionError as error:
      failures.append(str(error))
  floating = [n for n in names if oracle.is_floating(want[n].dtype)]
  bound = oracle.bound(np.float32)
  # The variables float32 resolves: the unpartitioned run within the bound of float64. The
  # others hold round-off alone (a zero gradient in exact arithmetic: a convolution bias
  # before BatchNorm, an attention key bias, their Adam slots, BatchNorm's moving mean
  # carrying that bias); the float64 rule above judged them.
  resolved = [
    n for n in floating if exact is None or oracle.relative_error(want[n], exact[n]) <= bound
  ]
  if os.environ.get('VS_XLA_DEBUG'):
    for n in floating:
      print(
        n,
        *(oracle.relative_error(got[side][n], want[n]) for side in ('ours', 'xla')),
        '' if exact is None else oracle.relative_error(want[n], exact[n]),
        file=sys.stderr,
      )
  return dict(
    ours_loss=oracle.relative_error(losses['ours'], want_losses),
    xla_loss=oracle.relative_error(losses['xla'], want_losses),
    ours_vars=largest((got['ours'][n], want[n]) for n in resolved),
    xla_vars=largest((got['xla'][n], want[n]) for n in resolved),
    floor=None if exact is None else largest((want[n], exact[n]) for n in resolved),
    round_off_only=len(floating) - len(resolved),
    ours_vs_xla=largest((got['ours'][n], got['xla'][n]) for n in resolved),
    bound=bound,
    failures=failures,
  )


def _ours_arrays(ours, batch):
  """ours' executable inputs as jax arrays (placed once): what one timed execute consumes."""
  from tf_gspmd.xla_bridge import pjrt

  compiled = ours.get_program(*batch)
  run = ours._prepared(compiled)  # noqa: SLF001
  devices = run.executable.devices
  inputs = [pjrt.put_global(v, layout, devices) for v, layout in zip(batch, run.export.args)]
  inputs += run.captures
  inputs += [ours.store.sharded[id(v)].shards for v in compiled.variables]
  executable = run.executable
  arrays = [executable.array_of(layout, given) for layout, given in zip(run.export.args, inputs)]
  return executable.executable, arrays


def _xla_arrays(xla, batch):
  inputs = [
    xla._put(p, batch[p.number]) if p.kind == 'argument' else xla._state[p.number]  # noqa: SLF001
    for p in xla.parameters
  ]
  return xla.executable, inputs


def time_both(ours, xla, batch, steps: int) -> dict:
  """Median ms of one execute each, the two taken in turn (load hits both alike)."""
  runs = {'ours': _ours_arrays(ours, batch), 'xla': _xla_arrays(xla, batch)}
  times = {k: [] for k in runs}
  for i in range(steps + 2):
    for name, (executable, arrays) in runs.items():
      if name == 'ours':
        # Ours donates its variables' buffers to the step (no second copy of the state):
        # each timed execute gets copies, made before the clock starts.
        arrays = [a.copy() for a in arrays]
        for a in arrays:
          a.block_until_ready()
      start = time.perf_counter()
      results = executable.execute_sharded(arrays)
      for per_device in results.disassemble_into_single_device_arrays():
        for buffer in per_device:
          buffer.block_until_ready()
      if i >= 2:  # two warm-up rounds
        times[name].append(time.perf_counter() - start)
  out = {k: 1e3 * statistics.median(v) for k, v in times.items()}
  # Also the fastest call of each: on a shared machine other processes' load inflates
  # medians; the minimum is the program's own cost most nearly.
  out.update({f'{k}_min': 1e3 * min(v) for k, v in times.items()})
  return out


def collective_summary(collectives) -> dict:
  kinds = {}
  for c in collectives:
    kinds[c['kind']] = kinds.get(c['kind'], 0) + 1
  return dict(count=len(collectives), bytes=sum(c['bytes'] for c in collectives), kinds=kinds)


def measure(name: str, quick: bool, steps: int, check_steps: int) -> dict:
  from tf_gspmd.xla_bridge import reference_partitioner

  case = Case(name, quick)
  ours, xla, ours_build, xla_build = build_both(case)
  executable = ours.xla_executable(*case.batch)
  ours_collectives = reference_partitioner.partitioned_collectives(
    executable.compiled_hlo(), NUM_DEVICES
  )
  result = dict(
    model=name,
    mesh=f'{case.mesh.shape}',
    build_s=dict(ours=ours_build, xla=xla_build),
    collectives=dict(
      ours=collective_summary(ours_collectives), xla=collective_summary(xla.collectives())
    ),
    peak_bytes=dict(
      ours=reference_partitioner.compiled_memory(executable.executable)['peak'],
      xla=xla.memory()['peak'],
    ),
    step_ms=time_both(ours, xla, case.batch, steps),
    errors=check(case, ours, xla, check_steps),
  )
  result['ours_detail'] = ours_collectives
  result['xla_detail'] = xla.collectives()
  return result


def _kinds(summary: dict) -> str:
  return ' '.join(f'{k}x{n}' for k, n in sorted(summary['kinds'].items()))


def explain_bytes(r: dict) -> str:
  """Where XLA moves fewer bytes: which collectives differ, by kind."""

  def by_kind(detail):
    out = {}
    for c in detail:
      out[c['kind']] = out.get(c['kind'], 0) + c['bytes']
    return out

  ours, xla = by_kind(r['ours_detail']), by_kind(r['xla_detail'])
  parts = [
    f'{k}: ours {ours.get(k, 0)} B, XLA {xla.get(k, 0)} B'
    for k in sorted(set(ours) | set(xla))
    if ours.get(k, 0) != xla.get(k, 0)
  ]
  return f'  {r["model"]}: XLA moves fewer bytes -- ' + '; '.join(parts)


def print_table(results) -> None:
  header = [
    'model',
    'mesh',
    'collectives ours',
    'collectives XLA',
    'bytes ours',
    'bytes XLA',
    'peak KiB ours',
    'peak KiB XLA',
    'step ms ours',
    'step ms XLA',
    'ratio',
    'min ratio',
    'rel err ours/XLA',
    'floor',
    'round-off',
    'ours vs XLA',
    'oracle',
  ]
  rows = []
  for r in results:
    c, e = r['collectives'], r['errors']
    rows.append(
      [
        r['model'],
        r['mesh'],
        f'{c["ours"]["count"]} ({_kinds(c["ours"])})',
        f'{c["xla"]["count"]} ({_kinds(c["xla"])})',
        str(c['ours']['bytes']),
        str(c['xla']['bytes']),
        f'{r["peak_bytes"]["ours"] / 2**10:.1f}',
        f'{r["peak_bytes"]["xla"] / 2**10:.1f}',
        f'{r["step_ms"]["ours"]:.2f}',
        f'{r["step_ms"]["xla"]:.2f}',
        f'{r["step_ms"]["ours"] / r["step_ms"]["xla"]:.2f}',
        f'{r["step_ms"]["ours_min"] / r["step_ms"]["xla_min"]:.2f}',
        f'{max(e["ours_loss"], e["ours_vars"]):.1e}/{max(e["xla_loss"], e["xla_vars"]):.1e}',
        '-' if e['floor'] is None else f'{e["floor"]:.1e}',
        str(e['round_off_only']),
        f'{e["ours_vs_xla"]:.1e}',
        'MISMATCH' if e['failures'] else 'ok',
      ]
    )
  widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
  for row in [header] + rows:
    print(' | '.join(str(x).ljust(w) for x, w in zip(row, widths)))
  bound = results[0]['errors']['bound'] if results else 1e-5
  print(
    f"\nrel err, floor, ours vs XLA: the oracle's normwise relative error, largest over the "
    f'tensors float32 resolves; bound {bound:g} (float32). round-off: variables holding '
    f'round-off alone. oracle: its verdict (the variables of the models with a float64 run '
    f"by its float64 rule: within 2 x the unpartitioned run's distance + {bound:g})"
  )
  notes = [
    explain_bytes(r)
    for r in results
    if r['collectives']['xla']['bytes'] < r['collectives']['ours']['bytes']
  ]
  if notes:
    print('\nWhere XLA moves fewer bytes per step:')
    print('\n'.join(notes))


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--models', default=','.join(MODELS))
  parser.add_argument('--quick', action='store_true', help='the small model sizes')
  parser.add_argument('--steps', type=int, default=20, help='timed executes per program')
  parser.add_argument('--check-steps', type=int, default=3)
  parser.add_argument('--json', default=None)
  args = parser.parse_args(argv)
  step_time.configure_logical_cpus(NUM_DEVICES)
  results, failed = [], False
  for name in args.models.split(','):
    if name not in MODELS:
      parser.error(f'unknown model {name!r}; choose from {MODELS}')
    r = measure(name, args.quick, args.steps, args.check_steps)
    bad = r['errors']['failures']  # the oracle's (check above)
    if bad:
      print(f'MISMATCH {name}:\n' + '\n'.join(bad), file=sys.stderr)
      failed = True
    results.append(r)
    print(f'# {name} done', file=sys.stderr, flush=True)
  print_table(results)
  if args.json:
    with open(args.json, 'w') as f:
      json.dump(results, f, indent=1, default=str)
  return 1 if failed else 0


if __name__ == '__main__':
  sys.exit(main())
