"""N logical CPU devices on this machine's cores, with TF's thread pools sized for them.

A partitioned program on N logical CPU devices runs N per-device programs at once on the
machine's cores. TF's default pools are sized for one device: its inter-op threads and its
intra-op (Eigen) threads each take every core, and they spin while they wait for work, so N
programs of small ops and collectives spend cores on waiting. One thread in each pool,
measured here (Intel Xeon, 2 cores, 8 logical devices, fresh processes alternating with
TF's defaults): the Keras-Hub-style decoder's model-parallel step (`bench/keras_decoder.py`
`tg_mp`) 65 / 63 / 58 / 68 -> 50 / 49 / 57 / 45 ms, its process CPU 100-121 -> 71-88 ms per
step; its data-parallel step unchanged (32.9 / 33.6 against 33.9 / 33.0 ms, CPU 51-54 ->
38-39 ms); its plain one-device Keras step 6.9 / 7.6 -> 5.8 / 5.2 ms. A big matmul of
unpartitioned code in the same process loses the intra-op pool's second core
(`docs/api.md`): `threads=None` keeps TF's pools.
"""

from __future__ import annotations

from typing import Optional, Tuple

import tensorflow as tf


def configure_cpu_devices(n: int = 8, threads: Optional[int] = 1) -> Tuple[str, ...]:
  """Split the CPU into `n` logical devices; call before TensorFlow initializes.

  `threads`: the threads of TF's inter-op and of its intra-op pool (both shared by every
  logical device), 1 by default: N per-device programs already keep the cores busy (see
  the module's measurements); None leaves TF's defaults. Returns the devices' names (a
  mesh's device i is the i-th by default; `tg.partition(..., devices=...)` takes others).

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
