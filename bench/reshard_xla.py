"""Reshards timed, not only counted: tf_gspmd's reshard programs beside XLA's own (issue #15.5).

For every case of `bench/reshard_cases.py` (the suite `bench/reshard.py` counts
and `bench/xla_reference.py` runs through jax) one tiny TF program moves a
tensor from the case's source layout to its target layout:

    x = tg.shard(x, mesh, src)         # the argument, laid out as the source
    y = tg.shard(x, mesh, dst)         # the result, laid out as the target
    return y

and is compiled twice, in one process, on the same 8 PJRT CPU devices:

  ours  `tg.partition(f, mesh, in_shardings=src, out_shardings=dst, backend='xla')`:
        tf_gspmd's per-replica program (its reshard search's collectives,
        lowered by `graph_rewrite.lower_reshard`), exported to StableHLO and
        compiled by XLA with num_replicas=8.
  xla   `reference_partitioner.XlaPartitionedStep` on the same tf.function with the
        same argument and result shardings: XLA's SPMD partitioner (GSPMD)
        writes the reshard itself.

The same two programs as `bench/vs_xla.py` uses for whole training steps, so
the same machinery: inputs are placed on the devices once; a timed call is one
`execute_sharded` of the compiled executable with every output buffer waited
for; the two executables are called in turn (interleaved rounds, two warm-up
rounds) and each gets the median of --reps calls. 'ratio' = XLA / ours of the
medians (> 1: ours is faster); the closing line is the geometric mean of the
ratios over the cases (the goal of issue #15: >= 1.22, the figure Rink et al.
report for their memory-efficient redistribution against XLA). The machine is
shared (2 cores, other jobs): medians of interleaved calls, not minima.

Pending sums (src_partial): a program cannot take a partial value as input, so
(as in `bench/xla_reference.py`) the argument gets a leading dim of size K (the
product of the partial axes' sizes) sharded over the partial axes and the
program sums it away: each device holds one summand of its shard, the local
sum is free, and the rest is the reshard of the pending sum. Uneven sizes: XLA's
side feeds its parameters as jax arrays, which hold only even shards, so the
argument is the tensor padded to a multiple of the source's shard counts, the
program slices it back to the true shape (a local op: ceil-sized shards, the
same bounds padded or not), reshards, and pads the result to a multiple of the
target's shard counts. Both sides run that same program.

Checked: both programs' outputs equal numpy's exactly (the values are small
integers held in float32, so a pending sum is exact in any order).

Memory, per device, from each compiled executable (`reference_partitioner.compiled_memory`,
XLA's buffer assignment; neither side donates its input): 'peak' = arguments +
outputs + temporaries, 'temp' = the temporaries alone, 'max buf' = the largest
array any instruction of the optimized entry computation produces (parameters
and results included). 'bound' = max(source shard, target shard) bytes of the
program's parameter and result, each dim's size first rounded up to a multiple of its
shard counts in source or target (the reshard search's `bound_bytes`; exactly
max(source, target) for sizes that divide evenly). The memory goal (peak <= max(source, target))
is read per buffer, as the guarantee of Rink et al. states it: 'mem ok' says
max buf <= bound, and 'temp ok' whether the temporaries alone also fit in it.
(arguments + outputs is already src + dst whenever both are live: no program
without donation can have a total below that.)

  .venv/bin/python bench/reshard_xla.py [--cases NAME,NAME] [--reps 15] [--quick]
                                        [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time
from typing import List, Optional

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')  # before TensorFlow is first imported

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [ROOT, HERE]

import numpy as np  # noqa: E402
import reshard_cases  # noqa: E402  (sibling: the shared case list)
import tensorflow as tf  # noqa: E402

NUM_DEVICES = 8
GOAL_RATIO = 1.22
# --quick: three cases of different kinds (an axis swap, a pending sum, an uneven size), the
# 1024-row tensors cut to 128 rows so that the run (compile included) takes seconds.
QUICK_CASES = ('2x4_xy_to_yx', '2x4_partial_y_to_y', 'uneven_10_over_4_dim0_to_dim1')
QUICK_DIM = 128


# ================================ the program of one case ================================
def shard_counts(case: dict, spec) -> List[int]:
  """How many shards each dim of a case's tensor is split into under `spec`."""
  sizes = dict(zip(case['axis_names'], case['mesh_shape']))
  return [
    1 if e is None else math.prod(sizes[a] for a in ((e,) if isinstance(e, str) else e))
    for e in spec
  ]


def padded(shape, counts) -> tuple:
  return tuple(-(-n // k) * k for n, k in zip(shape, counts))


class ReshardProgram:
  """One case as a TF program: its argument, function, shardings and expected result."""

  def __init__(self, case: dict, seed: int = 0):
    import tf_gspmd as tg

    self.case = case
    self.mesh = tg.Mesh.create(tuple(case['mesh_shape']), tuple(case['axis_names']))
    shape = tuple(case['shape'])
    src_shape = padded(shape, shard_counts(case, case['src_spec']))
    dst_shape = padded(shape, shard_counts(case, case['dst_spec']))
    partial = tuple(case['src_partial'])
    sizes = dict(zip(case['axis_names'], case['mesh_shape']))
    summands = math.prod(sizes[a] for a in partial)
    arg_spec = ((partial,) if partial else ()) + tuple(case['src_spec'])
    arg_shape = ((summands,) if partial else ()) + src_shape
    # Small integers: float32 sums of them are exact in any order, so checks are exact.
    rng = np.random.RandomState(seed)
    self.x = rng.randint(-8, 9, size=arg_shape).astype(np.float32)
    total = self.x.sum(axis=0) if partial else self.x
    want = np.zeros(dst_shape, np.float32)
    want[tuple(slice(0, n) for n in shape)] = total[tuple(slice(0, n) for n in shape)]
    self.want = want
    self.in_sharding = tg.NamedSharding(self.mesh, tg.P(*arg_spec))
    self.out_sharding = tg.NamedSharding(self.mesh, tg.P(*case['dst_spec']))
    self.src_bytes = _shard_bytes(arg_shape, self.in_sharding)
    self.dst_bytes = _shard_bytes(dst_shape, self.out_sharding)
    mesh, src, dst = self.mesh, tg.P(*arg_spec), tg.P(*case['dst_spec'])

    def reshard(x):
      x = tg.shard(x, mesh, src)
      if partial:
        x = tf.reduce_sum(x, axis=0)  # one summand per device: the pending sum
      if src_shape != shape:
        x = x[tuple(slice(0, n) for n in shape)]
      y = tg.shard(x, mesh, dst)
      if dst_shape != shape:
        y = tg.shard(tf.pad(y, [[0, p - n] for n, p in zip(shape, dst_shape)]), mesh, dst)
      return y

    reshard.__name__ = 'reshard_' + re.sub(r'\W', '_', case['name'])
    self.fn = tf.function(reshard)


def _shard_bytes(shape, sharding) -> int:
  return 4 * math.prod(sharding.shard_shape(tuple(shape)))


# ================================ measuring ================================
def build(program: ReshardProgram):
  """(ours, xla, seconds to build each): both compiled for the same 8 PJRT devices."""
  import tf_gspmd as tg
  from tf_gspmd.xla_bridge import reference_partitioner

  start = time.perf_counter()
  ours = tg.partition(
    program.fn,
    program.mesh,
    in_shardings=program.in_sharding,
    out_shardings=program.out_sharding,
    backend='xla',
  )
  ours.xla_executable(program.x)
  ours_seconds = time.perf_counter() - start
  start = time.perf_counter()
  xla = reference_partitioner.XlaPartitionedStep(
    program.fn,
    (program.x,),
    NUM_DEVICES,
    arg_shardings=[program.in_sharding],
    out_shardings=[program.out_sharding],
  )
  return ours, xla, ours_seconds, time.perf_counter() - start


def largest_buffer(hlo_text: str) -> int:
  """Bytes of the largest array an instruction of the entry computation produces.

  Fused computations are skipped (their values live in registers or are the fusion's
  own result, which the entry computation lists).
  """
  # The HLO text reader of reference_partitioner (shapes to bytes); private there, used as is.
  from tf_gspmd.xla_bridge import reference_partitioner as xp

  entry = re.search(r'^ENTRY[^\n]*\{\n(.*?)^\}', hlo_text, re.M | re.S)
  if entry is None:
    raise ValueError('no ENTRY computation in the compiled HLO')
  largest = 0
  for line in entry.group(1).splitlines():
    parsed = xp._split_instruction(line)  # noqa: SLF001
    if parsed is None:
      continue
    for dtype, dims in xp._arrays(parsed[1]):  # noqa: SLF001
      largest = max(largest, xp._DTYPE_BYTES[dtype] * math.prod(dims))  # noqa: SLF001
  return largest


def memory_bound(case: dict) -> int:
  """max(source shard, target shard) bytes, each dim first rounded up to a multiple of its
  shard counts (the reshard search's `bound_bytes`: exact for even sizes)."""
  import reshard  # (sibling: the case's NamedShardings)

  from tf_gspmd.graph_rewrite.reshard import route_reshard

  src, dst = reshard.shardings(case)
  return route_reshard(src, dst, case['shape'], 4).bound_bytes


def measure(case: dict, reps: int) -> dict:
  import vs_xla  # (sibling: the timing loop and inputs)

  from tf_gspmd.xla_bridge import reference_partitioner

  program = ReshardProgram(case)
  ours, xla, ours_build, xla_build = build(program)
  executable = ours.xla_executable(program.x)
  ours_hlo, xla_hlo = executable.compiled_hlo(), xla.partitioned_hlo()
  got_ours = np.asarray(ours(program.x))
  got_xla = np.asarray(xla(program.x))
  times = vs_xla.time_both(ours, xla, (program.x,), reps)
  memory = {
    'ours': reference_partitioner.compiled_memory(executable.executable),
    'xla': xla.memory(),
  }
  collectives = {
    'ours': reference_partitioner.partitioned_collectives(ours_hlo, NUM_DEVICES),
    'xla': xla.collectives(),
  }
  bound = memory_bound(case)
  out = dict(
    name=case['name'],
    src_bytes=program.src_bytes,
    dst_bytes=program.dst_bytes,
    bound=bound,
    build_s=dict(ours=ours_build, xla=xla_build),
    step_ms=times,
    ratio=times['xla'] / times['ours'],
    reps=reps,
  )
  for side, got, hlo in (('ours', got_ours, ours_hlo), ('xla', got_xla, xla_hlo)):
    out[side] = dict(
      exact=bool(got.shape == program.want.shape and np.array_equal(got, program.want)),
      peak=memory[side]['peak'],
      temp=memory[side]['temps'],
      max_buffer=largest_buffer(hlo),
      collectives=vs_xla.collective_summary(collectives[side]),
    )
  return out


# ================================ printing ================================
HEADER = [
  'case',
  'ours ms',
  'xla ms',
  'ratio xla/ours',
  'ours coll',
  'xla coll',
  'ours bytes',
  'xla bytes',
  'bound KiB',
  'ours peak/temp/max buf KiB',
  'xla peak/temp/max buf KiB',
  'mem ok',
  'temp ok',
  'exact',
]


def _kib(n: int) -> str:
  return f'{n / 1024:.1f}'


def row(r: dict) -> List[str]:
  def mem(side):
    m = r[side]
    return f'{_kib(m["peak"])}/{_kib(m["temp"])}/{_kib(m["max_buffer"])}'

  def kinds(side):
    c = r[side]['collectives']
    return ' '.join(f'{k}x{n}' for k, n in sorted(c['kinds'].items())) or '-'

  def ok(side, key):
    return 'ok' if r[side][key] <= r['bound'] else 'OVER'

  return [
    r['name'],
    f'{r["step_ms"]["ours"]:.3f}',
    f'{r["step_ms"]["xla"]:.3f}',
    f'{r["ratio"]:.2f}',
    kinds('ours'),
    kinds('xla'),
    f'{r["ours"]["collectives"]["bytes"]:,}',
    f'{r["xla"]["collectives"]["bytes"]:,}',
    _kib(r['bound']),
    mem('ours'),
    mem('xla'),
    f'{ok("ours", "max_buffer")}/{ok("xla", "max_buffer")}',
    f'{ok("ours", "temp")}/{ok("xla", "temp")}',
    f'{"yes" if r["ours"]["exact"] else "NO"}/{"yes" if r["xla"]["exact"] else "NO"}',
  ]


def geometric_mean(values) -> float:
  values = list(values)
  return math.exp(sum(math.log(v) for v in values) / len(values))


def summary(results: List[dict]) -> List[str]:
  ratios = [r['ratio'] for r in results]
  mean = geometric_mean(ratios)
  over = [r['name'] for r in results if r['ours']['max_buffer'] > r['bound']]
  temp_over = [r['name'] for r in results if r['ours']['temp'] > r['bound']]
  return [
    f'geometric mean of xla/ours over {len(results)} cases: {mean:.3f} (goal >= {GOAL_RATIO}: '
    f'{"met" if mean >= GOAL_RATIO else "NOT met"}); range {min(ratios):.2f} .. {max(ratios):.2f}, '
    f'ours faster on {sum(x > 1 for x in ratios)} of {len(ratios)}',
    f'ours: largest buffer <= max(source, target) on '
    f'{len(results) - len(over)} of {len(results)} cases'
    + (f' (over: {", ".join(over)})' if over else ''),
    f'ours: temporaries <= max(source, target) on {len(results) - len(temp_over)} of '
    f'{len(results)} cases' + (f' (over: {", ".join(temp_over)})' if temp_over else ''),
  ]


def table(rows: List[List[str]], header: List[str]) -> str:
  widths = [max(len(r[i]) for r in rows + [header]) for i in range(len(header))]

  def line(cells):
    return ' | '.join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()

  return '\n'.join([line(header), '-+-'.join('-' * w for w in widths)] + [line(r) for r in rows])


def quick_case(case: dict) -> dict:
  return dict(case, shape=tuple(min(n, QUICK_DIM) for n in case['shape']))


def select(names: Optional[str], quick: bool) -> List[dict]:
  chosen = names.split(',') if names else (QUICK_CASES if quick else None)
  cases = [reshard_cases.case_by_name(n) for n in chosen] if chosen else list(reshard_cases.CASES)
  return [quick_case(c) for c in cases] if quick else cases


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--cases', help='comma list of case names (default: all)')
  parser.add_argument('--reps', type=int, default=None, help='timed calls (default 15; quick 5)')
  parser.add_argument(
    '--quick', action='store_true', help=f'{len(QUICK_CASES)} cases, dims cut to {QUICK_DIM}'
  )
  parser.add_argument('--json', help='also write the raw results here')
  args = parser.parse_args(argv)
  reps = args.reps or (5 if args.quick else 15)
  cases = select(args.cases, args.quick)
  print(
    f'reshard_xla: {len(cases)} cases on {NUM_DEVICES} PJRT CPU devices, {os.cpu_count()} '
    f'cores; median of {reps} interleaved calls each',
    file=sys.stderr,
  )
  results, failures = [], []
  for case in cases:
    start = time.perf_counter()
    try:
      result = measure(case, reps)
    except Exception as e:  # noqa: BLE001
      failures.append(f'{case["name"]}: {type(e).__name__}: {str(e).splitlines()[0][:200]}')
      print(f'  {case["name"]}: FAILED {failures[-1]}', file=sys.stderr)
      continue
    results.append(result)
    print(f'  {case["name"]}: {time.perf_counter() - start:.1f} s', file=sys.stderr)
  if results:
    print(table([row(r) for r in results], HEADER))
    print('\n'.join(summary(results)))
  wrong = [
    f'{r["name"]} ({side})' for r in results for side in ('ours', 'xla') if not r[side]['exact']
  ]
  if wrong:
    print('MISMATCH: ' + ', '.join(wrong))
  if failures:
    print('FAILED: ' + '; '.join(failures))
  if args.json:
    with open(args.json, 'w') as f:
      json.dump(dict(results=results, failures=failures), f, indent=1)
  return 1 if wrong or failures else 0


if __name__ == '__main__':
  sys.exit(main())
