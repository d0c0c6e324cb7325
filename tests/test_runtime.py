"""The launcher and per-device values: splitting, assembling, sharded variables, outputs."""

import numpy as np
import pytest
import tensorflow as tf

from tf_gspmd import Mesh, NamedSharding, P, Sharding
from tf_gspmd.runtime import (
  ShardedValue,
  ShardedVariable,
  SpmdProgram,
  assemble,
  split,
  trace_per_partition,
)
from tf_gspmd.runtime.collectives import default_devices
from tf_gspmd.testing import assert_close

MESH = Mesh.create((2, 4), ('x', 'y'))
DEVICES = default_devices(8)
RNG = np.random.default_rng(1)

SHARDINGS = {
  'rows_x': NamedSharding(MESH, P('x', None)),
  'cols_y': NamedSharding(MESH, P(None, 'y')),
  'both': NamedSharding(MESH, P('x', 'y')),
  'rows_xy': NamedSharding(MESH, P(('x', 'y'), None)),
  'rows_yx_cols_none': NamedSharding(MESH, P(('y', 'x'), None)),
  'swapped': NamedSharding(MESH, P('y', 'x')),
  'replicated': NamedSharding(MESH, P(None, None)),
  'tiled_permuted': Sharding.tiled([[5, 2], [7, 0], [1, 3], [6, 4]]),
  'partial_tile': Sharding.partial_tile([[[0, 1]], [[2, 3]], [[4, 5]], [[6, 7]]]),
  'maximal': Sharding.maximal(6),
}
SHAPES = [(10, 7), (8, 4), (3, 5), (1, 1)]  # uneven, even, fewer rows than shards, tiny


def shard_reference(value, sharding, p):
  """Numpy: partition p's piece by Sharding.shard_bounds, zero-padded to shard_shape."""
  local = sharding.shard_shape(value.shape)
  bounds = sharding.shard_bounds(value.shape, p)
  out = np.zeros(local, value.dtype)
  if bounds is not None:
    piece = value[tuple(slice(a, b) for a, b in bounds)]
    out[tuple(slice(0, s) for s in piece.shape)] = piece
  return out


@pytest.mark.parametrize('name', sorted(SHARDINGS))
@pytest.mark.parametrize('shape', SHAPES)
def test_split_and_assemble_round_trip(name, shape):
  sharding = SHARDINGS[name]
  value = RNG.normal(size=shape).astype(np.float32)
  shards = split(value, sharding, DEVICES)
  assert len(shards) == 8
  for p, shard in enumerate(shards):
    np.testing.assert_array_equal(shard.numpy(), shard_reference(value, sharding, p))
  np.testing.assert_array_equal(assemble(shards, sharding, shape).numpy(), value)


def test_assemble_reduces_partial_shards():
  sharding = NamedSharding(MESH, P(None, 'y'), partial=('x',))
  value = RNG.normal(size=(3, 10)).astype(np.float32)
  plain = NamedSharding(MESH, P(None, 'y'))
  # Split the value in halves along 'x' terms: partition p holds value * weight(x).
  weights = {0: 0.25, 1: 0.75}
  shards = [
    tf.constant(shard_reference(value, plain, p) * weights[MESH.coords(p)['x']]) for p in range(8)
  ]
  assert_close(assemble(shards, sharding, (3, 10)), value, name='summed')
  maxed = NamedSharding(MESH, P(None, 'y'), partial=('x',), reduction='max')
  assert_close(
    assemble(shards, maxed, (3, 10)), np.maximum(value * 0.25, value * 0.75), name='maxed'
  )


def test_split_refuses_partial_and_manual():
  with pytest.raises(ValueError, match='partial'):
    split(np.ones((4, 4)), NamedSharding(MESH, P('x', None), partial=('y',)), DEVICES)
  with pytest.raises(ValueError, match='manual'):
    split(np.ones((4, 4)), Sharding.manual(), DEVICES)
  with pytest.raises(ValueError, match='rank'):
    split(np.ones((4,)), NamedSharding(MESH, P('x', None)), DEVICES)


def test_sharded_value_holds_shards_on_their_devices():
  sharding = SHARDINGS['both']
  value = RNG.normal(size=(5, 9)).astype(np.float32)
  sv = ShardedValue.from_global(value, sharding, DEVICES)
  assert sv.shape == (5, 9) and sv.dtype == tf.float32 and sv.num_partitions == 8
  assert [tf.DeviceSpec.from_string(s.backing_device).device_index for s in sv.shards] == list(
    range(8)
  )
  np.testing.assert_array_equal(sv.numpy(), value)
  with pytest.raises(ValueError, match='padded shard shape'):
    ShardedValue([tf.zeros((2, 2))] * 8, sharding, (5, 9))


def test_sharded_variable_persists_assembles_and_scatters():
  sharding = NamedSharding(MESH, P('x', 'y'))
  init = RNG.normal(size=(7, 10)).astype(np.float32)
  var = ShardedVariable(init, sharding, name='w')
  assert var.local_shape == (4, 3) and var.shape == (7, 10)
  assert [tf.DeviceSpec.from_string(v.device).device_index for v in var.variables] == list(range(8))
  np.testing.assert_array_equal(var.numpy(), init)

  def step(ctx, w, x):
    w.assign_add(x * tf.cast(ctx.partition_id + 1, tf.float32))
    return ctx.collectives.all_reduce(tf.reduce_sum(w), ('x', 'y'))

  program = SpmdProgram(MESH, step, [None, sharding])
  delta = np.ones((7, 10), np.float32)
  factor = np.zeros((7, 10), np.float32)
  for p in range(8):
    (r0, r1), (c0, c1) = sharding.shard_bounds((7, 10), p)
    factor[r0:r1, c0:c1] = p + 1
  total = program(var, delta)
  expected = init + factor
  assert_close(var.numpy(), expected, name='w')
  # The padding stays zero (the split delta is zero-padded), so the local sums add up to the
  # global sum.
  assert_close(total, expected.sum(), name='total')
  program(var, delta)  # persists across calls
  assert_close(var.numpy(), init + 2 * factor, name='w')
  var.scatter(np.zeros((7, 10), np.float32))
  np.testing.assert_array_equal(var.numpy(), np.zeros((7, 10)))
  with pytest.raises(ValueError, match='shape'):
    var.scatter(np.zeros((7, 9), np.float32))


def test_uneven_sharded_matmul_outputs_global_and_sharded():
  """y = x @ w with x rows over ('x','y') and w columns replicated; 13 rows over 8 shards."""
  x = RNG.normal(size=(13, 6)).astype(np.float32)
  w = RNG.normal(size=(6, 5)).astype(np.float32)
  rows = NamedSharding(MESH, P(('x', 'y'), None))

  def fn(ctx, x_local, w_local):
    y = x_local @ w_local
    # Zero the padded rows before reducing: row offset + i < 13.
    start = ctx.shard_offsets(rows, (13, 6))[0]
    valid = tf.range(2) + start < 13
    y = tf.where(valid[:, None], y, 0.0)
    return y, ctx.collectives.all_reduce(tf.reduce_sum(y, 0), ('x', 'y'))

  program = SpmdProgram(MESH, fn, [rows, None], [rows, None], out_shapes=[(13, 5), None])
  y, col_sums = program(x, w)
  assert_close(y, x @ w, name='y')
  assert_close(col_sums, (x @ w).sum(0), name='col_sums')
  assert program.per_partition.records[0].kind == 'all_reduce'

  kept = SpmdProgram(
    MESH, fn, [rows, None], [rows, None], out_shapes=[(13, 5), None], keep_sharded=[True, False]
  )
  y_sharded, _ = kept(x, w)
  assert isinstance(y_sharded, ShardedValue) and y_sharded.sharding == rows
  assert_close(y_sharded.numpy(), x @ w, name='y_sharded')
  # A sharded output feeds the next call without a round trip through the host.
  again, _ = kept(y_sharded, 2 * np.eye(5, dtype=np.float32))
  assert_close(again, 2 * (x @ w), name='again')


def test_sharded_value_argument_and_program_cache():
  rows = NamedSharding(MESH, P('y', None))
  value = RNG.normal(size=(9, 3)).astype(np.float32)
  sv = ShardedValue.from_global(value, rows, DEVICES)

  def double(ctx, a):
    return a * 2.0

  program = SpmdProgram(MESH, double, [rows], rows, out_shapes=[(9, 3)], keep_sharded=True)
  out = program(sv)
  assert_close(out.numpy(), 2 * value, name='out')
  first = program.per_partition
  out2 = program(out)  # same local specs: no new per-partition trace
  assert program.per_partition is first
  assert_close(out2.numpy(), 4 * value, name='out2')
  with pytest.raises(ValueError, match='reshard'):
    SpmdProgram(MESH, double, [NamedSharding(MESH, P('x', None))])(sv)


def test_trace_needs_no_devices_for_large_meshes():
  big = Mesh.create((64, 4), ('data', 'model'))

  def fn(ctx, x):
    return ctx.collectives.all_gather(x, 'model', 1)

  program = SpmdProgram(
    big, fn, [NamedSharding(big, P('data', 'model'))], NamedSharding(big, P('data', None))
  )
  outer = program.trace(tf.TensorSpec((128, 8), tf.float32))
  calls = [op for op in outer.graph.get_operations() if op.type == 'StatefulPartitionedCall']
  assert len(calls) == 256
  assert tuple(outer.outputs[0].shape) == (128, 8)
  with pytest.raises(ValueError, match='do not exist'):
    program(np.zeros((128, 8), np.float32))


def test_per_partition_program_size_does_not_depend_on_n():
  def fn(ctx, x):
    c = ctx.collectives
    return c.all_reduce(c.shift(x, 'data', 1), 'model') + c.all_gather(x, 'data', 0)[:2]

  counts = []
  # (Not 2 or 4 rows: the all-gather's group size would be a pair group's (2) or the
  # all-reduce's (4), and share its constant.)
  for rows in (8, 16, 128):
    mesh = Mesh.create((rows, 4), ('data', 'model'))
    program = trace_per_partition(mesh, fn, [tf.TensorSpec((2, 3), tf.float32)], autograph=False)
    ops = program.function.graph.get_operations()
    counts.append(len(ops))
    big_consts = [op for op in ops if op.type == 'Const' and op.outputs[0].shape.num_elements() > 8]
    # Only the partition-id tables are O(N): one entry per partition.
    assert all(op.outputs[0].shape[0] == rows * 4 for op in big_consts)
  assert len(set(counts)) == 1


def test_a_per_partition_program_holds_each_constant_once():
  mesh = Mesh.create((2, 4), ('data', 'model'))

  def fn(ctx, x):
    # Each reshape, slice and concat makes its own shape, begin or axis constant.
    parts = [tf.reshape(x[:, k : k + 1], [-1]) for k in range(3)]
    return ctx.collectives.all_reduce(tf.concat(parts, 0), 'model')

  program = trace_per_partition(mesh, fn, [tf.TensorSpec((2, 3), tf.float32)], autograph=False)
  consts = [op for op in program.function.graph.get_operations() if op.type == 'Const']
  # A value's TensorProto holds its dtype and shape: equal protos are equal constants.
  values = [op.get_attr('value').SerializeToString() for op in consts if not op.control_inputs]
  assert len(values) == len(set(values)), 'an equal constant made twice'
  out = SpmdProgram(
    mesh, fn, [NamedSharding(mesh, P('data', None))], NamedSharding(mesh, P('data'))
  )
  x = np.arange(12, dtype=np.float32).reshape(4, 3)
  got = out(x)
  shards = [x[2 * d : 2 * d + 2] for d in range(2)]  # the rows each 'data' index holds
  want = np.concatenate([np.concatenate([s[:, k] for k in range(3)]) * 4 for s in shards])
  assert_close(got, want)


def test_shared_constants_share_across_control_inputs_and_keep_device_scopes_apart():
  """A constant asked for under control dependencies is the one shared constant (no effect
  to order), while the other ops made there keep their control inputs; a placed one is its
  own."""
  from tf_gspmd.tf_private import shared_values

  graph = tf.Graph()
  with graph.as_default(), shared_values(graph):
    data = tf.compat.v1.placeholder(tf.int32, [])
    a, b = tf.constant(0), tf.constant(0)
    gate = tf.no_op(name='gate')
    with tf.control_dependencies([gate]):
      gated = tf.constant(0)
      used = tf.add(gated, data, name='used')
    with tf.device('/device:CPU:1'):
      placed = tf.constant(0)
    other_dtype = tf.constant(0.0)
  assert a.op is b.op
  assert gated.op is a.op and not a.op.control_inputs
  assert [op.name for op in used.op.control_inputs] == ['gate']
  assert placed.op is not a.op and placed.device.endswith('CPU:1')
  assert other_dtype.op is not a.op
  with graph.as_default():
    assert tf.constant(0).op is not a.op  # the sharing ends with the scope


def test_shared_constants_tell_python_and_numpy_values_apart():
  """The constants looked up before TF builds their TensorProto: one per value, dtype and
  shape; True, 1, 1.0, [1] and np.int64(1) are five; a constant asked for in a branch graph
  or another graph is made there."""
  from tf_gspmd.tf_private import shared_values

  graph = tf.Graph()
  with graph.as_default(), shared_values(graph):
    ones = [tf.constant(v) for v in (True, 1, 1.0, [1], np.int64(1))]
    again = [tf.constant(v) for v in (True, 1, 1.0, [1], np.int64(1))]
    as_float = tf.constant(1, tf.float32)
    shaped = tf.constant(1, shape=[2])
    table = tf.constant(np.arange(6).reshape(2, 3))
    table_again = tf.constant(np.arange(6).reshape(2, 3))
    other_table = tf.constant(np.arange(6).reshape(3, 2))
    inner = tf.Graph()
    with inner.as_default():
      elsewhere = tf.constant(1)
  assert len({t.op.name for t in ones}) == 5
  assert [t.op for t in again] == [t.op for t in ones]
  assert [t.dtype for t in ones] == [tf.bool, tf.int32, tf.float32, tf.int32, tf.int64]
  assert as_float.op is not ones[1].op and as_float.dtype == tf.float32
  assert shaped.shape == [2] and shaped.op is not ones[1].op
  assert table_again.op is table.op and other_table.op is not table.op
  assert other_table.shape == [3, 2] and elsewhere.graph is inner
  with tf.compat.v1.Session(graph=graph) as session:
    got = session.run(ones + [as_float, shaped, other_table])
  assert [g.tolist() for g in got[:5]] == [True, 1, 1.0, [1], 1]
  np.testing.assert_array_equal(got[7], np.arange(6).reshape(3, 2))


def test_shared_constants_reach_the_branches_traced_inside_the_scope():
  """A cond's branch graphs traced inside `shared_values` share their constants too (each
  graph its own), made without the control inputs around them; a graph another thread
  traces meanwhile does not."""
  import threading

  from tf_gspmd.tf_private import shared_values

  graph = tf.Graph()
  seen, elsewhere = {}, {}

  def branch(tag):
    def body():
      gate = tf.no_op(name='gate')
      first = tf.constant([1, 2, 3])
      with tf.control_dependencies([gate]):
        second = tf.constant([1, 2, 3])
      seen[tag] = (first, second)
      return first + second

    return body

  def other_thread():
    with tf.Graph().as_default():
      elsewhere['ops'] = [tf.constant(7).op, tf.constant(7).op]

  with graph.as_default(), shared_values(graph):
    flag = tf.compat.v1.placeholder(tf.bool, [])
    out = tf.cond(flag, branch('then'), branch('else'))
    worker = threading.Thread(target=other_thread)
    worker.start()
    worker.join()
  for tag in ('then', 'else'):
    first, second = seen[tag]
    assert first.op is second.op and not first.op.control_inputs, tag
    assert first.graph is not graph
  assert seen['then'][0].graph is not seen['else'][0].graph
  assert elsewhere['ops'][0] is not elsewhere['ops'][1]
  with tf.compat.v1.Session(graph=graph) as session:
    assert session.run(out, {flag: True}).tolist() == [2, 4, 6]


def test_ops_made_without_tracebacks_keep_none_and_other_ops_keep_theirs():
  """Inside `without_op_tracebacks` (the per-partition program, launch and capture traces) a
  graph op records one frame, tf_private's; outside, and in another thread meanwhile, ops keep
  their stacks."""
  import threading

  from tf_gspmd import tf_private
  from tf_gspmd.tf_private import without_op_tracebacks

  graph = tf.Graph()
  elsewhere = {}

  def other_thread():
    with tf.Graph().as_default():
      elsewhere['op'] = tf.constant(2.0).op

  with graph.as_default():
    before = tf.constant(1.0).op
    with without_op_tracebacks():
      inside = tf.constant(3.0).op
      worker = threading.Thread(target=other_thread)
      worker.start()
      worker.join()
    after = tf.constant(4.0).op
  # One frame, tf_private's own line (TF's XLA lowering crashes on an op without any).
  assert [frame.filename for frame in inside.traceback] == [tf_private.__file__]
  for op in (before, after, elsewhere['op']):
    assert len(op.traceback) > 0
  assert __file__ in [frame.filename for frame in before.traceback]


def test_fast_graph_building_builds_the_same_ops_and_puts_the_flag_back():
  """Inside `fast_graph_building` (nested, and with another scope open in a second thread) TF
  builds ops through its C++ path: the flag is on, the ops' NodeDefs are those built without
  it, a dtype the op does not allow is still refused by name; the last scope left puts the
  flag back as it was."""
  import threading

  from tf_gspmd import tf_private
  from tf_gspmd.tf_private import fast_graph_building

  flag = tf_private.tf_flags.config().graph_building_optimization
  before = flag.value()

  def build():
    graph = tf.Graph()
    with graph.as_default():
      x = tf.compat.v1.placeholder(tf.float32, [4], name='x')
      y = tf.raw_ops.AddV2(x=tf.raw_ops.Mul(x=x, y=x), y=x, name='y')
      tf.raw_ops.Reshape(tensor=y, shape=[2, 2], name='z')
    return [node for node in graph.as_graph_def().node]

  plain = build()
  entered, leave = threading.Event(), threading.Event()

  def other_scope():
    with fast_graph_building():
      entered.set()
      leave.wait(30)

  worker = threading.Thread(target=other_scope)
  worker.start()
  entered.wait(30)
  with fast_graph_building():
    with fast_graph_building():
      assert flag.value()
      fast = build()
      with tf.Graph().as_default():
        bad = tf.compat.v1.placeholder(tf.string, [])
        with pytest.raises(TypeError, match='DataType string not in list of allowed values'):
          tf.raw_ops.Mul(x=bad, y=bad)
  assert flag.value()  # the other thread's scope is still open
  leave.set()
  worker.join()
  assert flag.value() == before
  assert fast == plain


def test_shared_values_made_from_the_seeds_alone_are_one_node_and_data_ops_are_not():
  """A value computed from constants and the seed (the partition id) alone, asked for twice,
  is one node, also under control dependencies; an op reading anything else is made each
  time with its control inputs; a Reshape of an unordered Reshape reshapes its input, and a
  Reshape ordered by a control input stays."""
  from tf_gspmd.tf_private import shared_values

  graph = tf.Graph()
  with graph.as_default():
    pid = tf.compat.v1.placeholder(tf.int32, [], name='partition_id')
    data = tf.compat.v1.placeholder(tf.float32, [4, 6], name='data')
    with shared_values(graph, seeds=[pid]):
      offsets = tf.constant([0, 3, 6, 9])
      first = tf.gather(offsets, pid) + 1
      gate = tf.no_op(name='gate')
      with tf.control_dependencies([gate]):
        again = tf.gather(offsets, pid) + 1
        scaled = data * 2.0
      twice = data * 2.0
      other = tf.gather(offsets, pid) + 2
      flat = tf.reshape(tf.reshape(data, [24]), [6, 4])
      with tf.control_dependencies([gate]):
        ordered = tf.reshape(data, [24])
      kept = tf.reshape(ordered, [6, 4])
  assert again.op is first.op and not first.op.control_inputs
  assert other.op is not first.op
  assert twice.op is not scaled.op and [op.name for op in scaled.op.control_inputs] == ['gate']
  assert flat.op.inputs[0] is data
  assert kept.op.inputs[0] is ordered
  with tf.compat.v1.Session(graph=graph) as session:
    x = np.arange(24, dtype=np.float32).reshape(4, 6)
    got = session.run([first, other, flat, kept], {pid: 2, data: x})
  assert got[0] == 7 and got[1] == 8
  np.testing.assert_array_equal(got[2], x.reshape(6, 4))
  np.testing.assert_array_equal(got[3], x.reshape(6, 4))


def test_unknown_mesh_ids_and_bad_layouts_raise():
  with pytest.raises(ValueError, match='0..3'):
    SpmdProgram(Mesh(np.array([1, 2, 3, 4]), ('x',)), lambda ctx: 0)
  program = SpmdProgram(
    MESH,
    lambda ctx, a: a,
    [NamedSharding(MESH, P('x', None))],
    NamedSharding(MESH, P('x', None)),
    out_shapes=[(9, 2)],
  )
  with pytest.raises(ValueError, match='shard shape'):
    program(np.zeros((4, 2), np.float32))


def test_step_without_outputs_updates_variables_and_checkpoints(tmp_path):
  sharding = NamedSharding(MESH, P(None, ('x', 'y')))
  init = RNG.normal(size=(3, 11)).astype(np.float32)
  var = ShardedVariable(init, sharding, name='layer/kernel:0')

  def scale(ctx, w):
    w.assign(w * 3.0)

  program = SpmdProgram(MESH, scale, [sharding])
  assert program(var) is None
  assert_close(var.numpy(), 3 * init, name='w')
  path = tf.train.Checkpoint(v=var).save(str(tmp_path / 'ckpt'))
  other = ShardedVariable(np.zeros((3, 11), np.float32), sharding, name='restored')
  tf.train.Checkpoint(v=other).restore(path).assert_consumed()
  assert_close(other.numpy(), 3 * init, name='restored')
  assert len(var.trainable_variables) == 8


def test_graph_constants_leave_their_graph_collectable():
  """`emit.constant`'s one op per value and graph lives on the graph: a graph nobody holds is
  collected with its constants (a table keyed by graphs kept every traced program's graph,
  and its functions in TF's context, for the process's life)."""
  import gc
  import weakref

  from tf_gspmd.graph import emit

  graph = tf.Graph()
  with graph.as_default():
    first, again, other = emit.constant([1, 2]), emit.constant([1, 2]), emit.constant([1, 3])
  assert first is again and other is not first
  gone = weakref.ref(graph)
  del graph, first, again, other
  gc.collect()
  assert gone() is None
