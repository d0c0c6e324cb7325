"""`tg.auto_shard`: every variable's layout and the inputs' batch split, under a memory budget.

`auto_shard(fn, *arg_specs, mesh=..., memory_budget=...)` searches layouts:
the cheapest one whose per-device bytes (parameters + optimizer state +
activation peak, as `PlanReport` counts them) fit `memory_budget` wins. The
step is traced and captured once; the search prices each candidate on that
program with the fast model (`simulate`: the partitioner's rules and reshard
routes walked op by op, milliseconds a layout), and the layout it ends on is
planned with `tg.plan` (exact bytes and collectives, from the same
partitioner `tg.partition` runs). The plan's price replaces the fast
model's and the search runs again, until it ends on a planned layout (at
most `MAX_PLANNED` plans): the choice and its report come from a plan.

What is searched. Variables are grouped: an optimizer slot follows the
variable it is named after (Keras' `adam/<path>_momentum`, `<name>_m`), or
when not named after one, the same-shape trainable variable whose name
shares the longest prefix with its own (BatchNorm's moving statistics
follow its gamma); a lower-rank variable of the same layer whose shape is
the trailing dims of another's (a bias) takes that one's layout of those
dims; the rest group by (shape, dtype, name with digit runs stripped), so
the layers of a stack share one decision. A group's candidates are every
assignment of mesh-axis groups (each axis alone, or several in mesh order)
to its dims that divide them, each axis used once; the inputs' candidates
are their batch dim unsplit or split over such an axis group. Groups holding
less than `min_group_fraction` of the parameter bytes are left to
propagation (they follow their neighbours, as in a hand-written layout),
and so are scalars. Annotations the user wrote (`fixed`, `shard_variable`,
`tg.shard` inside `fn`) are constraints, never changed.

How. Coordinate descent over the groups (largest first, then the inputs):
each group tries all its candidates with the others held, and keeps the
best; sweeps repeat until one changes nothing or, within the budget, gains
less than 1% (a move gaining less than 0.1% is no move). Every sweep tries
every option (when every candidate is planned instead, as `Search` does
without a simulator, a group tries after the first sweep only the `SHORTLIST`
options that were best in its last try).
Best, while over the budget: a layout that fits (the cheapest), else the one
paying the least cost per byte saved (the one saving the most bytes at any
price strands the walk far from the cheap layouts); once within it, the
cheapest that stays within. Candidates whose variables alone exceed what
they must beat are not priced. Two starts, the better end wins: data
parallelism, and the batch on the first mesh axis alone (from data
parallelism one move cannot take the batch off the model axes and split
weights over them); small searches also start from the batch unsplit.
`search='exhaustive'` prices the product of all candidates instead (small
cases: it confirms the descent's optimum). Every price and plan is memoized.

The cost model (seconds per step; `tf_gspmd.step_cost`)::

    cost = share * (ops * op_seconds + small_ops * small_op_seconds
                    + flops / core_flops + elementwise_bytes / memory_bandwidth)
         + sum over collectives c of scale_c *
             (latency[kind_c, g_c] + bytes_c * (g_c-1)/g_c / bw[kind_c, g_c])
         + step_seconds

`share` is N / cores: the mesh's N logical CPU devices run their programs on the machine's
cores, so what every device does is paid N / cores times over. `ops` are the ops of the
step's program on tensors, `small_ops` those on scalars or views; `flops` the
contractions' (matmul, einsum, convolution: 2 per point of their iteration space over the
devices that split it, so work repeated on replicated operands counts; each tensor's
innermost dim padded to the lanes of this CPU's vector register, 16 floats with AVX-512:
a convolution whose output channels are split to 4 per device runs at the cost of 16, as
oneDNN's blocked layouts make it);
`elementwise_bytes` what every other ruled op reads and writes (the optimizer's update
included). `g_c` is the number of devices of the collective's mesh axes, `bytes_c` its
local operand (as `collectives()` reports it), `scale_c` `collective_scale` for a collective
over the whole mesh and `part_collective_scale` for one over a part of it (the table times
one group alone; in a step every group of the mesh runs its collective at once). The
collectives' latency and bandwidth come from `calibrate()` on this machine (all-reduce,
all-gather, reduce-scatter and all-to-all over 2/4/8 logical CPU devices; permutes use
all-to-all's), stored as JSON in the user cache dir (`DEFAULT_CONSTANTS_FILE` holds those
measured where the package was written); the other seven numbers are fit to measured steps
of other models on this CPU (`fit.calibrate_steps`, cached per CPU model; `DEFAULT_FIT_FILE`
shipped).
`Constants.profile()` is this machine as a `tg.HardwareProfile`; `tg.plan(...,
profile=tg.TPU_V3)` prices the same features on a TPU.

>>> result = tg.auto_shard(step, *specs, mesh=mesh, memory_budget=200_000)   # doctest: +SKIP
>>> print(result.report())                                                # doctest: +SKIP
>>> result.layout_map.apply(model)                                        # doctest: +SKIP

The modules: `groups` (variables grouped, each group's candidates), `constants` (the
measured constants, `calibrate`), `fit` (the step model fit to measured steps), `cost` (a
plan priced: `estimate`), `simulate` (a layout priced without a plan: `Simulator`),
`search` (the descent and the entry point, `auto_shard`), `result` (`AutoShardResult`).
"""

import sys
import types

from tf_gspmd.auto_shard import fit
from tf_gspmd.auto_shard.constants import (
  DEFAULT_CONSTANTS_FILE,
  DEFAULT_FIT_FILE,
  KINDS,
  Constants,
  calibrate,
  constants_path,
  cpu_key,
  load_constants,
  step_fit_path,
)
from tf_gspmd.auto_shard.cost import Evaluation, collective_cost, estimate, work_per_device
from tf_gspmd.auto_shard.fit import calibrate_steps, load_step_fit
from tf_gspmd.auto_shard.groups import (
  AUTO,
  INPUTS,
  Group,
  axis_groups,
  group_variables,
  spec_candidates,
)
from tf_gspmd.auto_shard.result import AutoShardResult
from tf_gspmd.auto_shard.search import (
  MAX_PLANNED,
  SHORTLIST,
  SMALL_SEARCH,
  SWEEP_GAIN,
  TIE,
  auto_shard,
)
from tf_gspmd.auto_shard.simulate import Simulator


class _CallablePackage(types.ModuleType):
  """This package, callable: `tg.auto_shard(fn, ...)` runs the search (`search.auto_shard`)
  while `tf_gspmd.auto_shard` stays the package, so `import tf_gspmd.auto_shard.groups` and
  `tg.auto_shard.calibrate()` work too (a function of the package's name would shadow it)."""

  def __call__(self, *args, **kwargs) -> AutoShardResult:
    return auto_shard(*args, **kwargs)


sys.modules[__name__].__class__ = _CallablePackage

__all__ = [
  'AUTO',
  'AutoShardResult',
  'Constants',
  'DEFAULT_CONSTANTS_FILE',
  'DEFAULT_FIT_FILE',
  'Evaluation',
  'Group',
  'INPUTS',
  'KINDS',
  'MAX_PLANNED',
  'SHORTLIST',
  'SMALL_SEARCH',
  'SWEEP_GAIN',
  'Simulator',
  'TIE',
  'auto_shard',
  'axis_groups',
  'calibrate',
  'calibrate_steps',
  'fit',
  'load_step_fit',
  'collective_cost',
  'constants_path',
  'cpu_key',
  'estimate',
  'group_variables',
  'load_constants',
  'spec_candidates',
  'step_fit_path',
  'work_per_device',
]
