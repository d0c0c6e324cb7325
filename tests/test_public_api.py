"""The public API: one name per concept at top level; old names warn for one release.

TF's `xla_sharding` functions live in `tg.xla_sharding` under TF's names; internals of
one stage (capture, rebuild, route_reshard, SpmdProgram, OpSharding conversion) in their
modules. `tg.auto_shard` is both the package and the search (`import
tf_gspmd.auto_shard.groups` works).
"""

import importlib
import subprocess
import sys
import warnings

import pytest
from tensorflow.python.compiler.xla.experimental import xla_sharding as tf_xla_sharding

import tf_gspmd as tg


@pytest.mark.parametrize('name', sorted(tg._DEPRECATED))  # noqa: SLF001
def test_a_deprecated_name_warns_and_is_the_object_it_named(name):
  module, attr, instead = tg._DEPRECATED[name]  # noqa: SLF001
  with pytest.warns(DeprecationWarning, match=f'tf_gspmd.{name} is deprecated.*use '):
    old = getattr(tg, name)
  assert old is getattr(importlib.import_module(module), attr)
  assert name not in tg.__all__


def test_plan_report_plan_warns_and_is_its_propagation():
  report = tg.PlanReport('f', tg.Mesh.create((2,), ('x',)), [], 0, 0, [], {}, propagation='p')
  with pytest.warns(
    DeprecationWarning, match='PlanReport.plan is deprecated.*PlanReport.propagation'
  ):
    assert report.plan == 'p'


def test_every_public_name_resolves_without_a_warning():
  with warnings.catch_warnings():
    warnings.simplefilter('error')
    for name in tg.__all__:
      getattr(tg, name)


def test_an_unknown_name_is_an_attribute_error():
  with pytest.raises(AttributeError, match='no attribute'):
    tg.no_such_name  # noqa: B018


def test_xla_sharding_mirrors_tfs_module_by_name():
  assert tg.xla_sharding.__all__
  assert 'xla_sharding' not in tg.__all__  # a star import keeps TF's module of that name
  for name in tg.xla_sharding.__all__:
    assert callable(getattr(tf_xla_sharding, name)), name  # TF's own name
    assert callable(getattr(tg.xla_sharding, name))


def test_auto_shard_is_the_package_and_the_search(monkeypatch):
  import tf_gspmd.auto_shard.groups as groups

  assert groups.__name__ == 'tf_gspmd.auto_shard.groups'
  assert tg.auto_shard is sys.modules['tf_gspmd.auto_shard']
  assert callable(tg.auto_shard.calibrate)
  monkeypatch.setattr(tg.auto_shard, 'auto_shard', lambda *a, **k: ('searched', a, k))
  assert tg.auto_shard(1, mesh=2) == ('searched', (1,), {'mesh': 2})


@pytest.mark.slow  # a page or a fresh interpreter: `make test` runs it, the edit loop not
def test_importing_a_submodule_of_auto_shard_first_works():
  code = (
    'import tf_gspmd.auto_shard.groups as g; import tf_gspmd as tg; print(callable(tg.auto_shard))'
  )
  out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, check=True)
  assert out.stdout.strip().endswith('True')
