"""Test session setup: 8 logical CPU devices, configured once before TF initializes."""

import os

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')

import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

NUM_DEVICES = 8


def _configure_devices():
  cpus = tf.config.list_physical_devices('CPU')
  try:
    tf.config.set_logical_device_configuration(
      cpus[0], [tf.config.LogicalDeviceConfiguration()] * NUM_DEVICES
    )
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
  'tests need 8 logical CPU devices; TensorFlow was initialized before conftest ran'
)


def _machine_lines():
  """The CPU and TF's kernel choice, for the record: other CPUs take other code paths."""
  model, flags = 'unknown CPU', []
  try:
    with open('/proc/cpuinfo') as info:
      for line in info:
        key, _, value = line.partition(':')
        if key.strip() == 'model name' and model == 'unknown CPU':
          model = value.strip()
        elif key.strip() == 'flags':
          flags = sorted(f for f in value.split() if f.startswith(('avx512', 'avx_vnni', 'amx')))
          break
  except OSError:
    pass
  threads = os.environ.get('TF_GSPMD_TEST_INTRA_OP_THREADS', 'default')
  return [
    f'cpu: {model}; {" ".join(flags) or "no avx512"}',
    f'TF_ENABLE_ONEDNN_OPTS={os.environ.get("TF_ENABLE_ONEDNN_OPTS", "unset (on)")}; '
    f'intra-op threads: {threads}',
  ]


def pytest_sessionstart(session):
  reporter = session.config.pluginmanager.get_plugin('terminalreporter')
  if reporter is not None:  # printed even under -q (CI's log says which code path ran)
    for line in _machine_lines():
      reporter.write_line(line)


def pytest_collection_modifyitems(config, items):
  """The full op sweep (marked `sweep`, hours) runs only with TF_GSPMD_FULL_SWEEP=1; without it
  it is deselected (said in the summary's count), not skipped: a skip in CI means a test that
  could not run where it should have."""
  if os.environ.get('TF_GSPMD_FULL_SWEEP') == '1':
    return
  sweep = [item for item in items if item.get_closest_marker('sweep')]
  if sweep:
    config.hook.pytest_deselected(items=sweep)
    items[:] = [item for item in items if not item.get_closest_marker('sweep')]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
  """With TF_GSPMD_NO_SKIPS=1 (`make test`, which installs everything the suite needs: jax in
  .venv) a skipped test fails, naming why it skipped: a missing dependency
  there is a broken setup, not a test to leave out."""
  outcome = yield
  report = outcome.get_result()
  if report.skipped and not hasattr(report, 'wasxfail') and os.environ.get('TF_GSPMD_NO_SKIPS'):
    why = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr
    report.outcome = 'failed'
    report.longrepr = f'skipped where nothing may skip (TF_GSPMD_NO_SKIPS=1): {why}'


@pytest.fixture
def keras_enabled():
  """tf_gspmd.keras.enable() for one test, undone after it (no distribution left set)."""
  import keras

  import tf_gspmd as tg

  tg.keras.enable()
  yield
  keras.distribution.set_distribution(None)
  tg.keras.disable()
