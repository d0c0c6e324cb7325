"""tf_gspmd installs beside the TensorFlow a user has, and says what to install when none is.

setup.py names no TensorFlow build outside extras: `tensorflow`, `tensorflow-cpu`, a TPU VM's
build all write the same `tensorflow` package, so requiring one would put it over another.
tf_gspmd/_tf_version.py checks at import instead. Everything here runs offline: pip gets
`--no-index` and hand-made wheels (a few hundred bytes each, no real TensorFlow).
"""

import base64
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import warnings
import zipfile

import pytest

from tf_gspmd import _tf_version

ROOT = pathlib.Path(__file__).resolve().parent.parent
TF_NAMES = {'tensorflow', 'tensorflow-cpu', 'tensorflow-gpu', 'tensorflow-intel', 'tf-nightly'}
PIP_EXTRAS = (
  'pip install "tf_gspmd[cpu]"',
  'pip install "tf_gspmd[tensorflow]"',
  'pip install "tf_gspmd[and-cuda]"',
)


def normalize(name: str) -> str:
  return re.sub(r'[-_.]+', '-', name).lower()


# --- the check as a unit: importlib's lookups answer as on another machine ---------------------


@pytest.fixture
def machine(monkeypatch):
  """Makes the metadata lookups see `dists` ({name: version}) as the installed TF builds."""
  real_version, real_find_spec = importlib.metadata.version, importlib.util.find_spec
  monkeypatch.delenv(_tf_version.ALLOW_ANY_ENV, raising=False)

  def install(dists, importable=True, owners=None, files=None):
    dists = {normalize(n): v for n, v in dists.items()}
    owners = owners or {}

    def version(name):
      key = normalize(name)
      if key in dists:
        return dists[key]
      if key in {normalize(n) for n in _tf_version.TF_DISTRIBUTIONS} or key in owners:
        raise importlib.metadata.PackageNotFoundError(name)
      return real_version(name)

    def find_spec(name, *args, **kwargs):
      if name == 'tensorflow':
        return object() if importable else None
      return real_find_spec(name, *args, **kwargs)

    monkeypatch.setattr(importlib.metadata, 'version', version)
    monkeypatch.setattr(
      importlib.metadata,
      'packages_distributions',
      lambda: {'tensorflow': list(owners)} if owners else {},
    )
    monkeypatch.setattr(
      importlib.metadata, 'files', lambda name: (files or {}).get(normalize(name), [])
    )
    monkeypatch.setattr(importlib.util, 'find_spec', find_spec)
    if not importable:  # this process did import TensorFlow; the check must not see that
      monkeypatch.delitem(sys.modules, 'tensorflow')
    return dists

  return install


def check_raises(*fragments) -> str:
  with pytest.raises(ImportError) as error:
    _tf_version.check()
  message = str(error.value)
  for fragment in fragments:
    assert fragment in message, message
  return message


def check_passes_quietly():
  with warnings.catch_warnings():
    warnings.simplefilter('error')
    _tf_version.check()


def test_no_tensorflow_names_the_supported_versions_and_the_pip_commands(machine):
  machine({}, importable=False)
  message = check_raises('TensorFlow 2.21.x', 'cannot import `tensorflow`', *PIP_EXTRAS)
  assert 'reinstall' not in message


def test_metadata_without_the_package_asks_for_a_reinstall(machine):
  machine({'tensorflow-cpu': '2.21.0'}, importable=False)
  check_raises('tensorflow-cpu 2.21.0', 'reinstall', *PIP_EXTRAS)


def test_tensorflow_2_20_names_found_and_supported_versions(machine):
  machine({'tensorflow': '2.20.0'})
  check_raises(
    'found tensorflow 2.20.0',
    '2.21.x',
    'pip install "tensorflow>=2.21,<2.22"',
    'TF_GSPMD_ALLOW_ANY_TF=1',
    *PIP_EXTRAS,
  )


@pytest.mark.parametrize(
  'name, version',
  [
    ('tensorflow-cpu', '2.21.3'),
    ('tensorflow', '2.21.0'),
    ('tensorflow-intel', '2.21.1'),
    ('tensorflow', '2.21.0rc1'),
  ],
)
def test_any_2_21_build_passes(machine, name, version):
  machine({name: version})
  check_passes_quietly()


def test_tf_nightly_is_the_next_line_and_is_refused(machine):
  machine({'tf-nightly': '2.22.0.dev20260301'})
  message = check_raises('found tf-nightly 2.22.0.dev20260301', '2.21.x', *PIP_EXTRAS)
  assert 'pip install "tf-nightly' not in message  # pinning a nightly to 2.21 finds nothing


def test_escape_hatch_turns_the_error_into_a_warning(machine, monkeypatch):
  machine({'tensorflow': '2.20.0'})
  monkeypatch.setenv('TF_GSPMD_ALLOW_ANY_TF', '1')
  with pytest.warns(RuntimeWarning, match=r'found tensorflow 2\.20\.0.*'):
    _tf_version.check()
  monkeypatch.setenv('TF_GSPMD_ALLOW_ANY_TF', '0')
  check_raises('found tensorflow 2.20.0')


def test_a_build_under_another_name_is_found_by_its_package(machine):
  machine({'acme-tf': '2.21.2'}, owners={'acme_tf': None})
  check_passes_quietly()
  machine({'acme-tf': '2.19.0'}, owners={'acme_tf': None})
  message = check_raises('found acme-tf 2.19.0')
  assert 'pip install "acme-tf' not in message  # not a name pip would find


def test_two_builds_writing_tensorflow_warn(machine):
  files = {'tensorflow': ['tensorflow/__init__.py'], 'tensorflow-cpu': ['tensorflow/__init__.py']}
  machine({'tensorflow': '2.21.0', 'tensorflow-cpu': '2.21.0'}, files=files)
  with pytest.warns(RuntimeWarning, match='tensorflow and tensorflow-cpu are both installed'):
    _tf_version.check()
  # Windows' `tensorflow` is a thin wheel that depends on tensorflow-intel: normal, no warning.
  machine(
    {'tensorflow': '2.21.0', 'tensorflow-intel': '2.21.0'},
    files={'tensorflow-intel': ['tensorflow/__init__.py']},
  )
  check_passes_quietly()


# --- import tf_gspmd in another interpreter --------------------------------------------------


def run_python(code: str, *, isolated: bool, path=(), env=None) -> subprocess.CompletedProcess:
  """`code` in a fresh interpreter; `isolated` (-S) leaves site-packages off sys.path."""
  env = dict(os.environ if env is None else env)
  env['PYTHONPATH'] = os.pathsep.join([str(ROOT), *map(str, path)])
  flags = ['-S'] if isolated else []
  return subprocess.run(
    [sys.executable, *flags, '-c', code],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=120,
    check=False,
  )


IMPORT = 'import tf_gspmd'


def test_import_without_tensorflow_raises_with_the_pip_commands():
  # -S: no site-packages, so neither the tensorflow package nor its metadata exists.
  result = run_python(IMPORT, isolated=True)
  assert result.returncode != 0
  assert 'ImportError: tf_gspmd needs TensorFlow 2.21.x' in result.stderr, result.stderr
  for command in PIP_EXTRAS:
    assert command in result.stderr, result.stderr


def test_import_with_tensorflow_hidden_by_an_import_hook_raises():
  blocker = (
    'import sys\n'
    'class Hide:\n'
    '  def find_spec(self, name, path=None, target=None):\n'
    '    if name.split(".")[0] == "tensorflow":\n'
    '      raise ModuleNotFoundError(f"No module named {name!r}", name=name)\n'
    'sys.meta_path.insert(0, Hide())\n'
  )
  result = run_python(blocker + IMPORT, isolated=False)
  assert result.returncode != 0
  assert 'ImportError: tf_gspmd needs TensorFlow 2.21.x' in result.stderr, result.stderr
  assert 'pip install "tf_gspmd[cpu]"' in result.stderr, result.stderr
  assert 'Traceback' in result.stderr and 'tf_gspmd/mesh' not in result.stderr  # raised first


def test_import_with_tensorflow_2_20_raises_before_importing_it(tmp_path):
  # A fake TensorFlow 2.20 whose import would fail loudly: the check must stop before it.
  (tmp_path / 'tensorflow').mkdir()
  (tmp_path / 'tensorflow' / '__init__.py').write_text('raise SystemExit("imported")\n')
  info = tmp_path / 'tensorflow-2.20.0.dist-info'
  info.mkdir()
  (info / 'METADATA').write_text('Metadata-Version: 2.1\nName: tensorflow\nVersion: 2.20.0\n')
  result = run_python(IMPORT, isolated=True, path=[tmp_path])
  assert 'ImportError: tf_gspmd supports TensorFlow 2.21.x' in result.stderr, result.stderr
  assert 'found tensorflow 2.20.0' in result.stderr and 'imported' not in result.stderr


# --- pip: a wheel of tf_gspmd, installed offline into a fresh venv ---------------------------


def pip_env() -> dict:
  """The environment minus pip's configuration (indexes, find-links, constraints)."""
  env = {k: v for k, v in os.environ.items() if not k.startswith('PIP_') and k != 'PYTHONPATH'}
  env.update(PIP_CONFIG_FILE=os.devnull, PIP_DISABLE_PIP_VERSION_CHECK='1', PIP_NO_INPUT='1')
  return env


def pip(*args, python=None) -> str:
  """This venv's pip (no pip in the fresh venv itself: `--python` points it there)."""
  target = ['--python', str(python)] if python else []
  result = subprocess.run(
    [sys.executable, '-m', 'pip', *target, *args],
    env=pip_env(),
    capture_output=True,
    text=True,
    timeout=300,
    check=False,
  )
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
  return result.stdout


def record_hash(data: bytes) -> str:
  return 'sha256=' + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b'=').decode()


def fake_wheel(directory: pathlib.Path, name: str, version: str, files=None) -> pathlib.Path:
  """A pure-Python wheel `name` `version` holding `files` ({path: text}) and its metadata."""
  stem = f'{re.sub(r"[-_.]+", "_", name)}-{version}'
  info = f'{stem}.dist-info'
  contents = dict(files or {})
  contents[f'{info}/METADATA'] = f'Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n'
  contents[f'{info}/WHEEL'] = (
    'Wheel-Version: 1.0\nGenerator: tf_gspmd-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n'
  )
  path = directory / f'{stem}-py3-none-any.whl'
  with zipfile.ZipFile(path, 'w') as wheel:
    record = []
    for name_in_zip, text in contents.items():
      data = text.encode()
      wheel.writestr(name_in_zip, data)
      record.append(f'{name_in_zip},{record_hash(data)},{len(data)}')
    record.append(f'{info}/RECORD,,')
    wheel.writestr(f'{info}/RECORD', '\n'.join(record) + '\n')
  return path


@pytest.fixture(scope='module')
def wheelhouse(tmp_path_factory):
  """tf_gspmd's wheel, built offline from a copy of the sources, beside fake dependencies.

  Every TensorFlow build is there too, so a requirement on any of them would be installed
  (and caught below), not fail to resolve.
  """
  for module in ('setuptools', 'wheel'):  # TensorFlow's own dependencies put both in .venv
    if importlib.util.find_spec(module) is None:
      pytest.skip(f'building the wheel offline needs {module} in {sys.prefix}')
  src = tmp_path_factory.mktemp('src')
  for name in ('setup.py', 'pyproject.toml'):
    shutil.copy(ROOT / name, src / name)
  shutil.copytree(
    ROOT / 'tf_gspmd', src / 'tf_gspmd', ignore=shutil.ignore_patterns('__pycache__', '*.pyc')
  )
  house = tmp_path_factory.mktemp('wheelhouse')
  pip('wheel', '--no-deps', '--no-build-isolation', '--no-index', '-w', str(house), str(src))
  for name in ('numpy', 'protobuf', 'absl-py'):
    fake_wheel(house, name, '1.0')
  for name in ('tensorflow', 'tensorflow-cpu', 'tf-nightly'):
    fake_wheel(house, name, '2.21.0', {'tensorflow/__init__.py': f'# {name}\n'})
  return house


def requires_dist(wheel: pathlib.Path):
  """{(requirement name, extra or None)} from the wheel's METADATA."""
  with zipfile.ZipFile(wheel) as archive:
    metadata = next(n for n in archive.namelist() if n.endswith('.dist-info/METADATA'))
    text = archive.read(metadata).decode()
  out = {}
  for line in re.findall(r'^Requires-Dist: (.*)$', text, re.M):
    requirement, _, marker = line.partition(';')
    extra = re.search(r'extra == "([^"]+)"', marker)
    name = re.match(r'[A-Za-z0-9._-]+(\[[^\]]*\])?', requirement.strip()).group(0)
    out.setdefault(extra.group(1) if extra else None, set()).add(
      (normalize(name), requirement.strip()[len(name) :].strip(' ()'))
    )
  return out


def test_wheel_requires_tensorflow_only_through_extras(wheelhouse):
  (wheel,) = wheelhouse.glob('tf_gspmd-*.whl')
  requires = requires_dist(wheel)
  assert {name for name, _ in requires[None]} == {'numpy', 'protobuf', 'absl-py'}
  assert requires['cpu'] == {('tensorflow-cpu', '<2.22,>=2.21')}
  assert requires['tensorflow'] == {('tensorflow', '<2.22,>=2.21')}
  assert requires['and-cuda'] == {('tensorflow[and-cuda]', '<2.22,>=2.21')}
  assert {'keras', 'test', 'jax', 'xla'} <= set(requires)


@pytest.mark.slow  # a fresh interpreter: `make test` runs it, the edit loop not
@pytest.mark.parametrize('user_tf', ['tensorflow-cpu', 'tensorflow'])
def test_install_beside_the_users_tensorflow_adds_no_second_one(wheelhouse, tmp_path, user_tf):
  venv = tmp_path / 'venv'
  subprocess.run(
    [sys.executable, '-m', 'venv', '--without-pip', str(venv)], check=True, timeout=120
  )
  python = venv / 'bin' / 'python'
  offline = ['--no-index', '--find-links', str(wheelhouse)]
  pip('install', *offline, f'{user_tf}==2.21.0', python=python)

  pip('install', *offline, 'tf_gspmd', python=python)
  installed = {
    normalize(d['name']) for d in json.loads(pip('list', '--format=json', python=python))
  }
  assert installed & TF_NAMES == {user_tf}
  assert installed == {user_tf, 'tf-gspmd', 'numpy', 'protobuf', 'absl-py'}

  # Asked for, an extra does bring its build: [cpu] would add tensorflow-cpu.
  report = json.loads(
    pip(
      'install', *offline, '--dry-run', '--quiet', '--report', '-', 'tf_gspmd[cpu]', python=python
    )
  )
  would_install = {normalize(item['metadata']['name']) for item in report['install']}
  assert would_install == (set() if user_tf == 'tensorflow-cpu' else {'tensorflow-cpu'})
