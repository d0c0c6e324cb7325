"""Test session setup: 8 logical CPU devices, configured once before TF initializes."""
import os

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')

import tensorflow as tf  # noqa: E402

NUM_DEVICES = 8


def _configure_devices():
  cpus = tf.config.list_physical_devices('CPU')
  try:
    tf.config.set_logical_device_configuration(
        cpus[0], [tf.config.LogicalDeviceConfiguration()] * NUM_DEVICES)
  except RuntimeError:
    pass  # already initialized (e.g. by a plugin); the assertion below checks the count


def _configure_threads():
  """TF_GSPMD_TEST_INTRA_OP_THREADS=1 runs every op's kernel on one thread: another code
  path through TF's (and oneDNN's) kernels, on which the suite must hold too (.ci/run)."""
  threads = os.environ.get('TF_GSPMD_TEST_INTRA_OP_THREADS')
  if threads:
    tf.config.threading.set_intra_op_parallelism_threads(int(threads))


_configure_devices()
_configure_threads()
assert len(tf.config.list_logical_devices('CPU')) == NUM_DEVICES, (
    'tests need 8 logical CPU devices; TensorFlow was initialized before conftest ran')
