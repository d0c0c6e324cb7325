"""Pictures of a layout: tg.visualize's grids, pf.visualize, and the HTML report page.

The grids are compared as exact text; the page is parsed back (html.parser) and
every number on it checked against the sources it was drawn from
(`pf.variable_bytes()`, `pf.collectives()`, the shardings' own geometry).
"""

import html.parser
import pathlib
import re
import textwrap

import numpy as np
import pytest
import tensorflow as tf

import tf_gspmd as tg
from tf_gspmd import Mesh, NamedSharding, P, Sharding

MESH = Mesh.create((2, 4), ('data', 'model'))
LINE = Mesh.create((4,), ('x',))
# P('data', 'model') over an (8, 8) tensor, or the first and last dim of (8, 3, 8).
GRID_2X4 = """
            0:2   2:4   4:6   6:8
          ┌─────┬─────┬─────┬─────┐
      0:4 │  0  │  1  │  2  │  3  │
          ├─────┼─────┼─────┼─────┤
      4:8 │  4  │  5  │  6  │  7  │
          └─────┴─────┴─────┴─────┘
      """


def picture(text: str) -> str:
  return textwrap.dedent(text).strip('\n')


def check(got: str, want: str, capsys) -> None:
  printed = capsys.readouterr().out
  assert got == picture(want), '\n' + got
  assert printed == got + '\n'  # printed too, the same text


# --- tg.visualize: exact grids -------------------------------------------------------------
def test_2x4_mesh_split_both_dims(capsys):
  check(
    tg.visualize(NamedSharding(MESH, P('data', 'model')), (8, 8)),
    """
      (8, 8) P('data', 'model') on mesh data=2 x model=4; each device holds (4, 2)
      dim 0 (8): 2 blocks of 4 over 'data'
      dim 1 (8): 4 blocks of 2 over 'model'"""
    + GRID_2X4,
    capsys,
  )


def test_replicated_rows_list_both_copies(capsys):
  check(
    tg.visualize(NamedSharding(MESH, P(None, 'model')), (8, 8)),
    """
      (8, 8) P(None, 'model') on mesh data=2 x model=4; each device holds (8, 2)
      dim 0 (8): not split
      dim 1 (8): 4 blocks of 2 over 'model'
      each block on 2 devices: replicated over 'data'
            0:2   2:4   4:6   6:8
          ┌─────┬─────┬─────┬─────┐
      0:8 │ 0,4 │ 1,5 │ 2,6 │ 3,7 │
          └─────┴─────┴─────┴─────┘
      """,
    capsys,
  )


def test_uneven_blocks_show_their_real_sizes(capsys):
  check(
    tg.visualize(NamedSharding(LINE, P('x', None)), (10, 6)),
    """
      (10, 6) P('x', None) on mesh x=4; each device holds (3, 6)
      dim 0 (10): 4 blocks of 3, 3, 3, 1 over 'x'
      dim 1 (6): not split
             0:6
           ┌─────┐
       0:3 │  0  │
           ├─────┤
       3:6 │  1  │
           ├─────┤
       6:9 │  2  │
           ├─────┤
      9:10 │  3  │
           └─────┘
      """,
    capsys,
  )


def test_an_empty_block_is_marked(capsys):
  check(
    tg.visualize(NamedSharding(LINE, P(None, 'x')), (10, 6)),
    """
      (10, 6) P(None, 'x') on mesh x=4; each device holds (10, 2)
      dim 0 (10): not split
      dim 1 (6): 4 blocks of 2, 2, 2, 0 over 'x'; block 3 empty
                0:2         2:4         4:6         6:6
           ┌───────────┬───────────┬───────────┬───────────┐
      0:10 │     0     │     1     │     2     │ 3 (empty) │
           └───────────┴───────────┴───────────┴───────────┘
      """,
    capsys,
  )


def test_partial_sum_joins_its_parts_with_plus(capsys):
  partial = NamedSharding(MESH, P(None, 'model'), partial=('data',))
  check(
    tg.visualize(partial, (8, 8)),
    """
      (8, 8) P(None, 'model') partial_sum('data') on mesh data=2 x model=4; each device holds (8, 2)
      dim 0 (8): not split
      dim 1 (8): 4 blocks of 2 over 'model'
      pending sum over 'data': a block is the sum of the values its '+'-joined devices hold
            0:2   2:4   4:6   6:8
          ┌─────┬─────┬─────┬─────┐
      0:8 │ 0+4 │ 1+5 │ 2+6 │ 3+7 │
          └─────┴─────┴─────┴─────┘
      """,
    capsys,
  )


def test_maximal_sharding_is_one_device(capsys):
  check(
    tg.visualize(Sharding.maximal(3), (8, 8)),
    """
      (8, 8) {maximal device=3}
      dim 0 (8): not split
      dim 1 (8): not split
      maximal: the whole tensor on device 3 only
            0:8
          ┌─────┐
      0:8 │  3  │
          └─────┘
      """,
    capsys,
  )


def test_tile_assignment_in_another_device_order(capsys):
  tiled = Sharding.tiled(np.array([[0, 2], [1, 3]]))
  grid = """
            0:3   3:6
          ┌─────┬─────┐
      0:2 │  0  │  2  │
          ├─────┼─────┤
      2:4 │  1  │  3  │
          └─────┴─────┘
      """
  check(
    tg.visualize(tiled, (4, 6)),
    """
      (4, 6) {devices=[2,2]0,2,1,3}; each device holds (2, 3)
      dim 0 (4): 2 blocks of 2
      dim 1 (6): 2 blocks of 3"""
    + grid,
    capsys,
  )
  # With a mesh, the axes get their names: rows go over 'b', columns over 'a'.
  check(
    tg.visualize(tiled, (4, 6), mesh=Mesh.create((2, 2), ('a', 'b'))),
    """
      (4, 6) P('b', 'a') on mesh a=2 x b=2; each device holds (2, 3)
      dim 0 (4): 2 blocks of 2 over 'b'
      dim 1 (6): 2 blocks of 3 over 'a'"""
    + grid,
    capsys,
  )


def test_a_hand_ordered_mesh_names_its_device_order(capsys):
  tiled = Sharding.tiled(np.array([[0, 2, 1, 3], [4, 6, 5, 7]]))
  lines = tg.visualize(tiled, (4, 8), mesh=MESH).splitlines()
  assert lines[0] == (
    "(4, 8) P('data', 'model') on mesh data=2 x model=4 (devices in order "
    '0,2,1,3,4,6,5,7); each device holds (2, 2)'
  )
  assert lines[-4] == '0:2 │  0  │  2  │  1  │  3  │'
  capsys.readouterr()


def test_rank_3_grid_over_the_split_dims(capsys):
  check(
    tg.visualize(NamedSharding(MESH, P('data', None, 'model')), (8, 3, 8)),
    """
      (8, 3, 8) P('data', None, 'model') on mesh data=2 x model=4; each device holds (4, 3, 2)
      dim 0 (8): 2 blocks of 4 over 'data' -> rows
      dim 1 (3): not split -> folded into each cell
      dim 2 (8): 4 blocks of 2 over 'model' -> columns"""
    + GRID_2X4,
    capsys,
  )


def test_rank_3_with_three_split_dims_folds_one_into_cells(capsys):
  cube = Mesh.create((2, 2, 2), ('a', 'b', 'c'))
  check(
    tg.visualize(NamedSharding(cube, P('a', 'b', 'c')), (4, 6, 8)),
    """
      (4, 6, 8) P('a', 'b', 'c') on mesh a=2 x b=2 x c=2; each device holds (2, 3, 4)
      dim 0 (4): 2 blocks of 2 over 'a' -> folded into each cell, '|' between its blocks
      dim 1 (6): 2 blocks of 3 over 'b' -> rows
      dim 2 (8): 2 blocks of 4 over 'c' -> columns
             0:4     4:8
          ┌───────┬───────┐
      0:3 │ 0 | 4 │ 1 | 5 │
          ├───────┼───────┤
      3:6 │ 2 | 6 │ 3 | 7 │
          └───────┴───────┘
      """,
    capsys,
  )


def test_rank_1_and_replicated_and_many_blocks(capsys):
  check(
    tg.visualize(NamedSharding(MESH, P('model')), (8,)),
    """
      (8,) P('model') on mesh data=2 x model=4; each device holds (2,)
      dim 0 (8): 4 blocks of 2 over 'model'
      each block on 2 devices: replicated over 'data'
        0:2   2:4   4:6   6:8
      ┌─────┬─────┬─────┬─────┐
      │ 0,4 │ 1,5 │ 2,6 │ 3,7 │
      └─────┴─────┴─────┴─────┘
      """,
    capsys,
  )
  check(
    tg.visualize(NamedSharding(MESH, P(None)), (5,)),
    """
      (5,) P(None) on mesh data=2 x model=4
      dim 0 (5): not split
      replicated: every device holds the whole tensor
        0:5
      ┌─────┐
      │ 0-7 │
      └─────┘
      """,
    capsys,
  )
  wide = tg.visualize(NamedSharding(Mesh.create((32,), ('x',)), P('x')), (64,))
  cells = '│   0   │   1   │   2   │   3   │   …   │   29  │   30  │   31  │'
  assert wide.splitlines()[-2] == cells
  assert '0:2' in wide and '62:64' in wide and '8:10' not in wide  # 8 blocks around an ellipsis


def test_annotated_tensors_variables_and_sharded_variables(capsys):
  w = tf.Variable(np.zeros((16, 32), np.float32), name='w')
  tg.shard_variable(w, MESH, P(None, 'model'))
  from_variable = tg.visualize(w)
  assert from_variable.startswith("w:0: (16, 32) P(None, 'model')")
  sharded = tg.ShardedVariable(
    np.zeros((16, 32), np.float32), NamedSharding(MESH, P(None, 'model')), name='w_sharded'
  )
  assert tg.visualize(sharded).split('\n', 1)[1] == from_variable.split('\n', 1)[1]
  seen = []

  @tf.function
  def f(x):
    seen.append(tg.visualize(tg.shard(x, MESH, P('data', 'model')), mesh=MESH))
    return x

  f(tf.zeros((8, 8)))
  assert "(8, 8) P('data', 'model') on mesh data=2 x model=4" in seen[0]
  assert '4:8 │  4  │  5  │  6  │  7  │' in seen[0]
  capsys.readouterr()


def test_bad_input_says_what_to_pass():
  with pytest.raises(ValueError, match='pass shape='):
    tg.visualize(NamedSharding(MESH, P('data', None)))
  with pytest.raises(ValueError, match='carries no tf_gspmd sharding'):
    tg.visualize(tf.zeros((4, 4)))
  with pytest.raises(ValueError, match='rank 2'):
    tg.visualize(NamedSharding(MESH, P('data', None)), (8,))


# --- a partitioned Megatron MLP ------------------------------------------------------------
def _mlp_step():
  rng = np.random.RandomState(0)
  w1 = tf.Variable(rng.randn(16, 32).astype(np.float32), name='w1')
  w2 = tf.Variable(rng.randn(32, 8).astype(np.float32), name='w2')
  m1 = tf.Variable(np.zeros((16, 32), np.float32), name='w1_momentum', trainable=False)
  tg.shard_variable(w1, MESH, P(None, 'model'))
  tg.shard_variable(w2, MESH, P('model', None))

  @tf.function
  def train_step(x):
    x = tg.shard(x, MESH, P('data', None))
    with tf.GradientTape() as tape:
      y = tf.matmul(tf.nn.relu(tf.matmul(x, w1)), w2)
      loss = tf.reduce_sum(y * y)
    g1, g2 = tape.gradient(loss, [w1, w2])
    m1.assign(0.9 * m1 + g1)
    w1.assign_sub(0.01 * m1)
    w2.assign_sub(0.01 * g2)
    return loss

  return train_step, rng.randn(8, 16).astype(np.float32)


@pytest.fixture(scope='module')
def mlp():
  step, x = _mlp_step()
  pf = tg.partition(step, MESH)
  pf(x)
  return pf


def test_pf_visualize_by_variable_and_tensor_name(mlp, capsys):
  want = """
      w1:0: (16, 32) P(None, 'model') on mesh data=2 x model=4; each device holds (16, 8)
      dim 0 (16): not split
      dim 1 (32): 4 blocks of 8 over 'model'
      each block on 2 devices: replicated over 'data'
              0:8     8:16   16:24   24:32
           ┌───────┬───────┬───────┬───────┐
      0:16 │  0,4  │  1,5  │  2,6  │  3,7  │
           └───────┴───────┴───────┴───────┘
      """
  check(mlp.visualize('w1'), want, capsys)
  assert mlp.visualize('w1:0') == picture(want)
  # The first matmul's result: rows over 'data' (from x), columns over 'model' (from w1).
  first = mlp.visualize('MatMul')
  assert first.startswith("MatMul:0: (8, 32) P('data', 'model')")
  assert '4:8 │   4   │   5   │   6   │   7   │' in first
  capsys.readouterr()


def test_pf_visualize_unknown_name_lists_near_matches(mlp):
  with pytest.raises(KeyError, match=r"no variable or graph tensor named 'w3'.*'w1'"):
    mlp.visualize('w3')


# --- the HTML page -------------------------------------------------------------------------
class _Page(html.parser.HTMLParser):
  """The elements the tests read, with their attributes and the text inside them."""

  def __init__(self):
    super().__init__()
    self.grids, self.bars, self.memory, self.variables, self.urls = {}, [], {}, {}, []
    self.provenance, self.boundary = {}, {}  # the grids of arguments and outputs in `boundary`
    self.text, self._grid = [], None

  def handle_starttag(self, tag, attrs):
    a = dict(attrs)
    classes = (a.get('class') or '').split()
    self.urls += [v for k, v in attrs if k in ('src', 'href') and not (v or '').startswith('#')]
    if tag == 'svg' and 'grid' in classes:
      variable = a['data-role'] in ('parameters', 'optimizer state')
      self._grid = (self.grids if variable else self.boundary).setdefault(a['data-name'], [])
    elif tag == 'g' and 'block' in classes:
      self._grid.append(a)
    elif tag == 'g' and 'bar' in classes:
      self.bars.append(a)
    elif tag == 'tr' and 'mem' in classes:
      self.memory[a['data-part']] = a['data-bytes']
    elif tag == 'tr' and 'var' in classes:
      self.variables[a['data-name']] = a
    elif tag == 'tr' and 'why' in classes:
      self.provenance[a['data-name']] = a['data-why']

  def handle_data(self, data):
    self.text.append(data)


def read_page(path) -> tuple:
  source = path.read_text()
  page = _Page()
  page.feed(source)
  return source, page


def devices_of_block(sharding, shape, rows: str, cols: str) -> str:
  """Device ids whose shard is [rows] x [cols], from the sharding's own geometry."""
  want = tuple(tuple(int(i) for i in r.split(':')) for r in (rows, cols))
  return ','.join(
    str(d) for d in sorted(sharding.devices) if sharding.shard_bounds(shape, d) == want
  )


def check_self_contained(source: str, page: _Page) -> None:
  assert 'http' not in source and 'src=' not in source and not page.urls
  assert '<script src' not in source and '<link' not in source


def check_bars(page: _Page, records) -> None:
  want = {}
  for r in records:
    key = (r['kind'], ','.join(r['axes']))
    want[key] = want.get(key, 0) + r['bytes']
  got = {(b['data-kind'], b['data-axes']): int(b['data-bytes']) for b in page.bars}
  assert got == want and want


def test_pf_report_page(mlp, tmp_path):
  path = mlp.report(tmp_path / 'r.html')
  source, page = read_page(tmp_path / 'r.html')
  assert str(path) == str(tmp_path / 'r.html')
  check_self_contained(source, page)
  # One grid per variable, each block naming exactly the devices whose shard it is.
  pairs = {key: sharded for key, (_, sharded) in zip(mlp.variable_bytes(), mlp.variable_pairs())}
  assert sorted(page.grids) == sorted(pairs) == ['w1:0', 'w1_momentum:0', 'w2:0']
  for name, blocks in page.grids.items():
    sharded = pairs[name]
    assert len(blocks) == 4, name  # 4 blocks of 2 copies each
    for block in blocks:
      want = devices_of_block(
        sharded.sharding, sharded.shape, block['data-rows'], block['data-cols']
      )
      assert block['data-devices'] == want and len(want.split(',')) == 2, (name, block)
  # The argument: rows over 'data' (its annotation), each half on the 4 devices of its row.
  argument = page.boundary['x:0']
  assert [b['data-devices'] for b in argument] == ['0,1,2,3', '4,5,6,7']
  assert [b['data-rows'] for b in argument] == ['0:4', '4:8']
  check_bars(page, mlp.collectives())
  sizes = mlp.variable_bytes()
  assert page.memory['parameters'] == str(sizes['w1:0']['per_device'] + sizes['w2:0']['per_device'])
  assert page.memory['optimizer state'] == str(sizes['w1_momentum:0']['per_device'])
  assert page.memory['activations'] == ''  # not measured for a partitioned function
  for name, entry in sizes.items():
    assert int(page.variables[name]['data-per-device']) == entry['per_device']
    assert int(page.variables[name]['data-total']) == entry['total']
  assert page.provenance['w1:0'] == page.provenance['w2:0'] == 'user annotation'  # shard_variable
  assert re.match(r'backward via \S+ \(ReadVariableOp\)', page.provenance['w1_momentum:0'])
  words = ' '.join(page.text)
  assert 'user annotation' in words and 'not measured' in words


def test_plan_report_page(tmp_path):
  sharded = {'w1': P(None, 'model'), 'w2': P('model', None)}
  w1 = tg.abstract_variable([16, 32], sharding=NamedSharding(MESH, sharded['w1']), name='w1')
  w2 = tg.abstract_variable([32, 8], sharding=NamedSharding(MESH, sharded['w2']), name='w2')
  m1 = tg.abstract_variable([16, 32], name='w1_momentum', trainable=False)

  @tf.function
  def step(x):
    x = tg.shard(x, MESH, P('data', None))
    with tf.GradientTape() as tape:
      loss = tf.reduce_sum(tf.matmul(tf.nn.relu(tf.matmul(x, w1)), w2) ** 2)
    g1, g2 = tape.gradient(loss, [w1, w2])
    m1.assign(0.9 * m1 + g1)
    w1.assign_sub(0.01 * m1)
    w2.assign_sub(0.01 * g2)
    return loss

  report = tg.plan(step, tf.TensorSpec([8, 16]), mesh=MESH)
  report.report(tmp_path / 'plan.html')
  source, page = read_page(tmp_path / 'plan.html')
  check_self_contained(source, page)
  assert sorted(page.grids) == ['w1:0', 'w1_momentum:0', 'w2:0']
  for v in report.variables:
    for block in page.grids[v.name]:
      assert block['data-devices'] == devices_of_block(
        v.sharding, v.shape, block['data-rows'], block['data-cols']
      )
  check_bars(page, report.collectives())
  assert page.memory == {
    'parameters': str(report.parameter_bytes),
    'optimizer state': str(report.optimizer_bytes),
    'activations': str(report.activation_peak),
  }
  assert report.activation_peak > 0
  assert page.provenance['w1:0'] == page.provenance['w2:0'] == 'user annotation'
  assert page.provenance['w1_momentum:0'].startswith('backward via')


def test_readme_pictures_are_what_visualize_prints(capsys):
  page = pathlib.Path(__file__).resolve().parent.parent / 'docs' / 'auto_shard_and_pictures.md'
  section = page.read_text().split('## Pictures of a layout', 1)[1].split('\n## ', 1)[0]
  fenced = re.findall(r'^```(\w*)\n(.*?)^```$', section, re.S | re.M)
  shown_blocks = [body for language, body in fenced if not language]  # the printed text
  printed = [
    tg.visualize(NamedSharding(MESH, P('data', 'model')), (8, 8)),
    tg.visualize(NamedSharding(MESH, P(None, 'model')), (4, 10)),
  ]
  assert [b.rstrip('\n') for b in shown_blocks[:2]] == printed
  capsys.readouterr()
