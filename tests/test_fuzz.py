"""Whole-program fuzzing (tf_gspmd/testing/fuzz.py): a fixed budget of random programs, and
the generator and shrinker themselves.

CI runs a fixed seed and a fixed number of programs, so every run and every machine judges the
same programs (a campaign picks another seed with TF_GSPMD_FUZZ_SEED and more programs with
TF_GSPMD_FUZZ_PROGRAMS); the seed is printed, and a failure prints its shrunk program as a
pytest test, so any failure reproduces with
`python -m tf_gspmd.testing.fuzz --seed S --start I --programs 1`.
"""

import dataclasses
import os
import time
import warnings

import pytest

from tf_gspmd.graph_rewrite import factors, handlers
from tf_gspmd.propagation import registry
from tf_gspmd.testing import fuzz

SEED = 20261128
PROGRAMS = 40  # about 1 s each
SMALL = 8  # ops per program at most: many small programs find more in a minute than few big


def _setting(name: str, default: int) -> int:
  return int(os.environ.get(name) or default)


@pytest.fixture(autouse=True)
def _quiet():
  with warnings.catch_warnings():
    warnings.filterwarnings('ignore', message='tf_gspmd propagation: no sharding rule')
    yield


def test_fixed_budget_of_random_programs(capsys):
  seed = _setting('TF_GSPMD_FUZZ_SEED', SEED)
  programs = _setting('TF_GSPMD_FUZZ_PROGRAMS', PROGRAMS)
  with capsys.disabled():
    print(f'\nfuzz seed {seed}, {programs} programs (TF_GSPMD_FUZZ_SEED sets the seed)')
  start, lines, failures = time.time(), [], []
  for index in range(programs):
    program = fuzz.generate(seed, index, max_ops=SMALL)
    outcome = fuzz.run(program)
    lines.append(f'{program.label()}: {outcome.status} {outcome.message[:120]}')
    if outcome.status in ('mismatch', 'crash', 'invalid'):
      small = fuzz.shrink(program, fuzz.failing_like(outcome, 'tf'), budget=30)
      failures.append(fuzz.test_case(small, outcome))
  with capsys.disabled():
    print(f'{len(lines)} programs in {time.time() - start:.0f} s')
    for line in lines:
      print(' ', line)
  assert not failures, '\n'.join(lines) + '\n\nshrunk cases:\n\n' + '\n\n'.join(failures)


def test_generator_is_deterministic_per_seed():
  first = [fuzz.generate(7, i) for i in range(20)]
  again = [fuzz.generate(7, i) for i in range(20)]
  assert first == again
  assert [fuzz.render(p) for p in first] == [fuzz.render(p) for p in again]
  assert len({fuzz.render(p) for p in first}) == 20  # and programs differ from one another
  assert fuzz.generate(8, 0) != first[0]


def test_generator_covers_the_families_and_meshes():
  programs = [fuzz.generate(11, i) for i in range(300)]
  kinds = {op.kind for p in programs for op in p.ops}
  assert kinds == set(fuzz.FAMILIES)
  assert {p.mesh_shape for p in programs} == {m for m, _ in fuzz.MESHES}
  assert any(p.devices != tuple(range(8)) for p in programs)
  assert any(p.grad for p in programs) and any(p.assign for p in programs)
  assert all(fuzz.is_valid(p) for p in programs)


def test_printed_case_runs_and_passes(tmp_path):
  program = fuzz.generate(3, 1, max_ops=5)
  outcome = fuzz.run(program)
  assert outcome.status == 'pass', outcome.message
  test = _load_case(tmp_path, fuzz.test_case(program, outcome))
  test()


def _wrong_sin(p, graph, node, operands):
  """A planted bug: Sin partitioned as Cos (after its rule's reshard)."""
  chosen = factors.choose_layouts(p, graph, node, operands)
  src = p.reshard(operands[0], chosen.operands[0], 'sin operand')
  return handlers.emit_outputs(p, graph, node, [src.tensor], list(chosen.results), op_type='Cos')


def _program_with_sin():
  for index in range(500):
    program = fuzz.generate(5, index, max_ops=10)
    if len(program.ops) >= 6 and any(
      op.kind == 'unary' and op.param('fn') == 'sin' for op in program.ops
    ):
      return program
  raise AssertionError('no program with a sin in 500')


def test_shrinker_finds_a_planted_bug(monkeypatch, tmp_path):
  program = _program_with_sin()
  assert fuzz.run(program).status == 'pass'
  sin = registry.lookup('Sin')
  entries = registry.REGISTRY._entries  # noqa: SLF001 (plant a bug in one entry, undone below)
  monkeypatch.setitem(handlers.LOCAL, 'wrong_sin', _wrong_sin)
  monkeypatch.setitem(entries, 'Sin', dataclasses.replace(sin, local='wrong_sin'))
  outcome = fuzz.run(program)
  assert outcome.status == 'mismatch'
  small = fuzz.shrink(program, fuzz.failing_like(outcome, 'tf'), budget=80)
  assert 1 <= len(small.ops) <= 2, fuzz.render(small)
  assert any(op.kind == 'unary' and op.param('fn') == 'sin' for op in small.ops)
  assert not small.grad and not small.assign
  test = _load_case(tmp_path, fuzz.test_case(small, outcome))
  with pytest.raises(AssertionError, match='differs from unpartitioned'):
    test()  # the printed case reproduces the bug...
  monkeypatch.setitem(entries, 'Sin', sin)
  test()  # ...and passes once it is fixed


def test_refusals_and_crashes_are_told_apart():
  def raise_in(error, filename):
    code = compile('def f(e):\n  raise e\n', filename, 'exec')
    namespace = {}
    exec(code, namespace)
    try:
      namespace['f'](error)
    except Exception as raised:  # noqa: BLE001
      return raised

  package = os.path.dirname(fuzz.__file__).rsplit(os.sep, 1)[0]
  inside = os.path.join(package, 'graph_rewrite', 'x.py')
  assert fuzz.classify(raise_in(ValueError('P refused'), inside)) == 'refusal'
  assert fuzz.classify(raise_in(ValueError('This is a bug in X'), inside)) == 'crash'
  assert fuzz.classify(raise_in(ValueError('shapes'), '/site-packages/tensorflow/x.py')) == 'crash'
  assert fuzz.classify(raise_in(KeyError('k'), inside)) == 'crash'


def _load_case(tmp_path, text):
  path = tmp_path / 'case.py'
  path.write_text(text)
  namespace = {}
  exec(compile(text, str(path), 'exec'), namespace)
  return next(v for k, v in namespace.items() if k.startswith('test_fuzz_'))
