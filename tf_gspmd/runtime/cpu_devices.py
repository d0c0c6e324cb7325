"""N logical CPU devices on this machine's cores, and optionally TF's pools sized for them.

A partitioned program on N logical CPU devices runs N per-device programs at once on the
machine's cores. TF's default pools are sized for one device (its inter-op and its intra-op
threads each take every core) and spin while they wait for work. Whether one thread per
pool is better depends on the program, measured here (Intel Xeon, 2 cores, 8 logical
devices, fresh processes alternating with TF's defaults):
- many small ops and collectives gain: the Keras-Hub-style decoder's model-parallel step
  (`bench/keras_decoder.py` `tg_mp`) 65 / 63 / 58 / 68 -> 50 / 49 / 57 / 45 ms (process
  CPU 100-121 -> 71-88 ms per step), its data-parallel step unchanged with a third less CPU,
  its plain one-device Keras step 6.9 / 7.6 -> 5.8 / 5.2 ms;
- big kernels lose, one op then runs at a time (`bench/limit.py --tf-threads 1`): ResNet50
  data parallel 1962 / 1585 -> 2480 / 3213 ms, the bench transformer's 129 / 122 -> 140 /
  145 ms, their unpartitioned steps 1.6-2.2x slower.
So the default leaves TF's pools (`threads=None`); `threads=1` is for the first kind.
"""

from __future__ import annotations

from typing import Optional, Tuple

import tensorflow as tf


def configure_cpu_devices(n: int = 8, threads: Optional[int] = None) -> Tuple[str, ...]:
  """Split the CPU into `n` logical devices; call before TensorFlow initializes.

  `threads`: the threads of TF's inter-op and of its intra-op pool (both shared by every
  logical device); None (the default) leaves TF's pools. 1 suits steps of many small ops
  and collectives, where TF's pools spin (a model-parallel decoder: -23%), not steps of
  big kernels (ResNet50 data parallel: 1.3-2x slower); see the module's measurements.
  Returns the devices' names (a mesh's device i is the i-th by default;
  `tg.partition(..., devices=...)` takes others).

  TF fixes both at its first use: called after, it raises a RuntimeError that says so,
  unless the process already has exactly this configuration.

  >>> devices = tg.configure_cpu_devices(8)           # doctest: +SKIP  (before TF starts)
  >>> devices[-1]                                      # doctest: +SKIP
  '/job:localhost/replica:0/task:0/device:CPU:7'
  """
  if n < 1:
    raise ValueError(f'configure_cpu_devices: n must be at least 1, got {n}.')
  cpu = tf.config.list_physical_devices('CPU')[0]
  try:
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * n)
    if threads is not None:
      tf.config.threading.set_inter_op_parallelism_threads(threads)
      tf.config.threading.set_intra_op_parallelism_threads(threads)
  except RuntimeError as error:
    if not _already(n, threads):
      raise RuntimeError(
        f'configure_cpu_devices({n}, threads={threads}): TensorFlow is already initialized '
        f'with {len(tf.config.list_logical_devices("CPU"))} logical CPU devices and '
        f'{tf.config.threading.get_inter_op_parallelism_threads()} / '
        f'{tf.config.threading.get_intra_op_parallelism_threads()} inter-op / intra-op '
        'threads (0: TF chooses). Call it first, before anything runs a TF op or lists '
        'logical devices.'
      ) from error
  return tuple(d.name for d in tf.config.list_logical_devices('CPU'))


def _already(n: int, threads: Optional[int]) -> bool:
  """Whether the initialized process has `n` logical CPUs and, if asked, those threads."""
  if len(tf.config.list_logical_devices('CPU')) != n:
    return False
  if threads is None:
    return True
  pools = tf.config.threading
  return (
    pools.get_inter_op_parallelism_threads()
    == threads
    == (pools.get_intra_op_parallelism_threads())
  )
