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
import re
import time
import warnings

import pytest
import tensorflow as tf

from tf_gspmd.errors import Unsupported
from tf_gspmd.graph_rewrite import factors, handlers, uneven
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


@pytest.mark.slow  # 40 programs, about 40 s
def test_fixed_budget_of_random_programs(capsys):
  seed = _setting('TF_GSPMD_FUZZ_SEED', SEED)
  programs = _setting('TF_GSPMD_FUZZ_PROGRAMS', PROGRAMS)
  with capsys.disabled():
    print(f'\nfuzz seed {seed}, {programs} programs (TF_GSPMD_FUZZ_SEED sets the seed)')
  start = time.time()
  lines, failures = _judged(fuzz.generate(seed, i, max_ops=SMALL) for i in range(programs))
  with capsys.disabled():
    print(f'{len(lines)} programs in {time.time() - start:.0f} s')
    for line in lines:
      print(' ', line)
  assert not failures, '\n'.join(lines) + '\n\nshrunk cases:\n\n' + '\n\n'.join(failures)


def _judged(programs, shrink_budget: int = 30):
  """A line per program, and the printed case of each that fails by the fuzzer's own
  `FAILURES` (a refusal, tf_gspmd's `Unsupported`, passes)."""
  lines, failures = [], []
  for program in programs:
    outcome = fuzz.run(program)
    lines.append(f'{program.label()}: {outcome.status} {outcome.message[:120]}')
    if outcome.status in fuzz.FAILURES:
      small = fuzz.shrunk(program, outcome, budget=shrink_budget)
      failures.append(fuzz.test_case(small, outcome))
  return lines, failures


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
  for nested in ('all', 'forward'):
    assert any(p.nested == nested and p.grad and p.assign for p in programs), nested
  for nested in ('twice', 'cond'):  # a gradient through two call sites, or an If's branches
    assert any(p.nested == nested and p.grad for p in programs), nested
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


def _noisy_sin(p, graph, node, operands):
  """A planted bug: Sin of its operand plus fresh random noise on every call."""
  chosen = factors.choose_layouts(p, graph, node, operands)
  x = p.reshard(operands[0], chosen.operands[0], 'sin operand').tensor
  noisy = x + tf.random.uniform(tf.shape(x), maxval=1e-3)
  return handlers.emit_outputs(p, graph, node, [noisy], list(chosen.results))


def _sin_missing_an_identity(p, graph, node, operands):
  """A planted bug: a plain ValueError from inside tf_gspmd (a handler asking for the
  identity of a reduction that has none), which is no refusal."""
  uneven.identity_value('median', tf.float32)


def _program_with_sin(stateless: bool = False, min_ops: int = 6):
  for index in range(500):
    program = fuzz.generate(5, index, max_ops=10)
    if (
      len(program.ops) >= min_ops
      and not (stateless and program.assign)
      and any(op.kind == 'unary' and op.param('fn') == 'sin' for op in program.ops)
    ):
      return program
  raise AssertionError('no program with a sin in 500')


def _plant(monkeypatch, local) -> dict:
  """Sin partitioned by `local` until the test ends; returns the registry's entries."""
  entries = registry.REGISTRY._entries  # noqa: SLF001 (plant a bug in one entry, undone after)
  monkeypatch.setitem(handlers.LOCAL, local.__name__, local)
  monkeypatch.setitem(entries, 'Sin', dataclasses.replace(entries['Sin'], local=local.__name__))
  return entries


@pytest.mark.parametrize(
  'local, status', [(_noisy_sin, 'nondeterministic'), (_sin_missing_an_identity, 'crash')]
)
def test_a_planted_bug_of_each_kind_fails_the_budget(monkeypatch, local, status):
  program = _program_with_sin(stateless=True, min_ops=1)
  _plant(monkeypatch, local)
  lines, failures = _judged([program], shrink_budget=0)
  assert f': {status} ' in lines[0] and len(failures) == 1, lines


@pytest.mark.slow  # a whole shrink: `make test` runs it, the edit loop not
def test_shrinker_finds_a_planted_bug(monkeypatch, tmp_path):
  program = _program_with_sin()
  assert fuzz.run(program).status == 'pass'
  sin = registry.lookup('Sin')
  entries = _plant(monkeypatch, _wrong_sin)
  outcome = fuzz.run(program)
  assert outcome.status == 'mismatch'
  small = fuzz.shrink(program, fuzz.failing_like(outcome, 'tf'), budget=80)
  assert 1 <= len(small.ops) <= 2, fuzz.render(small)
  assert any(op.kind == 'unary' and op.param('fn') == 'sin' for op in small.ops)
  assert not small.grad and not small.assign and not small.nested
  test = _load_case(tmp_path, fuzz.test_case(small, outcome))
  with pytest.raises(AssertionError, match='differs from unpartitioned'):
    test()  # the printed case reproduces the bug...
  monkeypatch.setitem(entries, 'Sin', sin)
  test()  # ...and passes once it is fixed


def test_refusals_and_crashes_are_told_apart():
  """A refusal is tf_gspmd's own `Unsupported` (a rule's RuleError is one); any other error,
  a plain ValueError raised inside tf_gspmd too, is a crash."""
  assert fuzz.classify(Unsupported('P refused')) == 'refusal'
  assert fuzz.classify(registry.RuleError('axis not a constant')) == 'refusal'
  assert fuzz.classify(Unsupported('This is a bug in X')) == 'crash'
  with pytest.raises(ValueError) as raised:
    uneven.identity_value('median', tf.float32)
  assert fuzz.classify(raised.value) == 'crash'
  assert fuzz.classify(KeyError('k')) == 'crash'


def _load_case(tmp_path, text):
  path = tmp_path / 'case.py'
  path.write_text(text)
  namespace = {}
  exec(compile(text, str(path), 'exec'), namespace)
  return next(v for k, v in namespace.items() if k.startswith('test_fuzz_'))


def _square_or_fail(index: int, scale: int):
  """A worker's work for the pool test: its process dies at index 3, asks to be replaced
  at index 1 (as after a failed collective)."""
  if index == 3 and os.environ.get('FUZZ_POOL_TEST_WORKER'):
    os._exit(7)
  return (index * index * scale, os.getpid()), index == 1


def _mark_worker():
  os.environ['FUZZ_POOL_TEST_WORKER'] = '1'


@pytest.mark.slow  # a worker process starts: about 10 s
@pytest.mark.sweep  # campaign tooling (--jobs): with the full sweep, not in make test's budget
def test_workers_answer_in_order_and_replace_a_dead_or_poisoned_worker():
  from tf_gspmd.testing import fuzz_pool

  died = lambda index, code: ('died', code)  # noqa: E731
  with fuzz_pool.Workers(2, _square_or_fail, (10,), _mark_worker, died) as workers:
    got = list(workers.results(range(8)))
  assert [index for index, _ in got] == list(range(8))
  here = [index for index, result in got if result[1] == os.getpid()]
  for index, result in got:
    if index == 3 and 3 not in here:  # judged by a worker, which died: replaced
      assert result == ('died', 7)
    else:
      assert result[0] == index * index * 10
  if 1 in here:  # this process's collectives "failed": it judged nothing after
    assert max(here) == 1


@pytest.mark.slow  # a worker process starts TF: about 20 s
@pytest.mark.sweep  # campaign tooling (--jobs): with the full sweep, not in make test's budget
def test_a_campaign_on_two_processes_prints_what_one_process_does():
  def verdicts(jobs):
    echoed = []
    tally = fuzz.campaign(SEED, 3, start=6, max_ops=SMALL, echo=echoed.append, jobs=jobs)
    lines = [re.sub(r' \d+\.\d+s', '', line) for line in echoed if line.startswith('[')]
    return lines, tally

  one, tally_one = verdicts(1)
  two, tally_two = verdicts(2)
  assert len(one) == 3 and one == two
  assert tally_one.counts == tally_two.counts and tally_two.programs == 3


_FORKED_CAMPAIGN = """
import multiprocessing, os, sys
from tf_gspmd.testing import fuzz, fuzz_pool

started = []  # how the pool started its workers
get_context = multiprocessing.get_context
multiprocessing.get_context = lambda method=None: started.append(method) or get_context(method)
print('before the runtime:', fuzz_pool.start_method(), flush=True)
code = fuzz.main(['--programs', '2', '--seed', '20261128', '--max-ops', '8',
                  '--shrink-budget', '0', '--jobs', '2'])
print('after the runtime:', fuzz_pool.start_method(), flush=True)
print('workers started by:', started, flush=True)
sys.exit(code)
"""


@pytest.mark.slow  # a campaign of two programs on two processes: about 8 s
def test_a_campaign_forks_its_worker_before_tf_starts_and_spawns_after(tmp_path):
  """The CLI's worker is forked (no second TF import) while TF's runtime has not started in
  the campaign's process, and the start method once it has (a replacement's) is spawn. Both
  programs are judged and pass."""
  from tests.helpers import run_python

  script = tmp_path / 'campaign.py'
  script.write_text(_FORKED_CAMPAIGN)
  done = run_python(script, timeout=300)
  assert done.returncode == 0, done.stderr[-3000:]
  assert 'before the runtime: fork' in done.stdout
  assert 'after the runtime: spawn' in done.stdout
  assert "workers started by: ['fork']" in done.stdout, done.stdout
  verdicts = [line for line in done.stdout.splitlines() if re.match(r'\[20261128:[01]\]', line)]
  assert len(verdicts) == 2 and all(' tf: pass ' in line for line in verdicts), done.stdout


def test_a_worker_that_died_is_a_crash_of_its_program():
  tally = fuzz.Tally()
  echoed = []
  died = fuzz._died(lambda index: f'[{SEED}:{index}] (a label)')  # noqa: SLF001
  for event in died(5, -6):  # what the pool gives for a program whose worker died
    fuzz.replay(event, tally, '', echoed.append)
  assert tally.counts['crash'] == 1 and 'crash' in fuzz.FAILURES
  assert 'died (exit code -6)' in echoed[0] and tally.failures
