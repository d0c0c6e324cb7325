"""Checks that a supported TensorFlow is installed, before anything imports TensorFlow.

tf_gspmd does not depend on one TensorFlow wheel: `tensorflow`, `tensorflow-cpu`, a TPU VM's
build or a nightly all install the same `tensorflow` package, and a second one installed
beside the first overwrites its files. So setup.py leaves the choice to the user (extras) and
this module, run first by `tf_gspmd/__init__.py`, turns a missing or unsupported TensorFlow
into one ImportError that says what to install, instead of an error deep inside an op.

It imports nothing from tf_gspmd, and imports TensorFlow only when TensorFlow is importable
but no distribution metadata names its version (a source build on PYTHONPATH).
"""

import importlib
import importlib.metadata
import importlib.util
import os
import re
import sys
import warnings

SUPPORTED = (2, 21)
SUPPORTED_TEXT = '2.21.x'
SPECIFIER = '>=2.21,<2.22'
ALLOW_ANY_ENV = 'TF_GSPMD_ALLOW_ANY_TF'

# Distributions that install the `tensorflow` package. Checked by name first: asking for a
# few names is fast, while scanning every installed distribution (the fallback) is not.
TF_DISTRIBUTIONS = (
  'tensorflow',
  'tensorflow-cpu',
  'tensorflow-gpu',
  'tensorflow-intel',
  'tensorflow-macos',
  'tensorflow-aarch64',
  'tensorflow-cpu-aws',
  'tensorflow-rocm',
  'tensorflow-tpu',
  'intel-tensorflow',
  'tf-nightly',
  'tf-nightly-cpu',
  'tf-nightly-gpu',
  'tf-nightly-intel',
  'tf-nightly-macos',
  'tf-nightly-tpu',
)

EXTRAS_HELP = (
  '  pip install "tf_gspmd[cpu]"         # tensorflow-cpu: CPU only\n'
  '  pip install "tf_gspmd[tensorflow]"  # tensorflow: the standard wheel\n'
  '  pip install "tf_gspmd[and-cuda]"    # tensorflow[and-cuda]: NVIDIA GPUs\n'
)


def _normalize(name: str) -> str:
  return re.sub(r'[-_.]+', '-', name).lower()


def _tensorflow_importable() -> bool:
  if 'tensorflow' in sys.modules:  # find_spec raises ValueError on some stubs already loaded
    return True
  try:
    return importlib.util.find_spec('tensorflow') is not None
  except (ImportError, ValueError):
    return False


def installed_distributions():
  """[(distribution name, version)] of the installed distributions that ship TensorFlow."""
  found = []
  for name in TF_DISTRIBUTIONS:
    try:
      found.append((name, importlib.metadata.version(name)))
    except importlib.metadata.PackageNotFoundError:
      pass
  if not found:
    # A build under another name (a vendor's or a TPU image's): whatever ships `tensorflow/`.
    owners = importlib.metadata.packages_distributions().get('tensorflow', ())
    for name in dict.fromkeys(owners):
      try:
        found.append((_normalize(name), importlib.metadata.version(name)))
      except importlib.metadata.PackageNotFoundError:
        pass
  return found


def supported(version: str) -> bool:
  """Whether `version` is on the 2.21 line (releases, release candidates, patch releases)."""
  match = re.match(r'(\d+)\.(\d+)', version)
  return bool(match) and (int(match.group(1)), int(match.group(2))) == SUPPORTED


def _allow_any() -> bool:
  return os.environ.get(ALLOW_ANY_ENV, '').strip().lower() in ('1', 'true', 'yes')


def _files_owned(name: str) -> bool:
  """Whether distribution `name` writes files of the `tensorflow` package itself.

  Some are thin wheels that only depend on the real one (`tensorflow` on `tensorflow-intel`
  on Windows): both installed is normal there, and not the clash warned about below.
  """
  files = importlib.metadata.files(name) or ()
  return any(str(f).startswith('tensorflow/') for f in files)


def check():
  """Raises ImportError unless TensorFlow 2.21.x is installed (a warning with the escape hatch)."""
  if not _tensorflow_importable():
    found = installed_distributions()
    stale = ''
    if found:
      stale = (
        'Distribution metadata names '
        + ', '.join(f'{n} {v}' for n, v in found)
        + ' but its files are gone; reinstall it.\n'
      )
    raise ImportError(
      f'tf_gspmd needs TensorFlow {SUPPORTED_TEXT} and cannot import `tensorflow`.\n'
      + stale
      + 'Install tf_gspmd with the TensorFlow build for this machine:\n'
      + EXTRAS_HELP
      + f'or install TensorFlow {SUPPORTED_TEXT} another way (a TPU VM image, '
      'a source build):\na plain `pip install tf_gspmd` keeps it.'
    )

  found = installed_distributions()
  if not found:
    # Importable without any metadata: ask TensorFlow itself (tf_gspmd imports it next anyway).
    tf = importlib.import_module('tensorflow')
    found = [('tensorflow (no package metadata)', getattr(tf, '__version__', 'unknown'))]

  wrong = [(n, v) for n, v in found if not supported(v)]
  if wrong:
    found_text = ', '.join(f'{n} {v}' for n, v in wrong)
    name = wrong[0][0]
    # A nightly is always the next, unreleased line: its fix is a release, not a pin of it.
    same_build = (
      f'  pip install "{name}{SPECIFIER}"\nor one of\n'
      if name in TF_DISTRIBUTIONS and not name.startswith('tf-nightly')
      else ''
    )
    message = (
      f'tf_gspmd supports TensorFlow {SUPPORTED_TEXT} ({SPECIFIER}); found {found_text}.\n'
      'Install a supported one:\n'
      + same_build
      + EXTRAS_HELP
      + f'Set {ALLOW_ANY_ENV}=1 to import tf_gspmd anyway (untested with that TensorFlow).'
    )
    if not _allow_any():
      raise ImportError(message)
    warnings.warn(message, RuntimeWarning, stacklevel=2)

  if len(found) > 1:
    owners = [n for n, _ in found if _files_owned(n)]
    if len(owners) > 1:
      warnings.warn(
        f'{" and ".join(owners)} are both installed and write the same `tensorflow` '
        'package, so files of one overwrote the other. Keep one: pip uninstall both, '
        'then install one of them again.',
        RuntimeWarning,
        stacklevel=2,
      )


check()
