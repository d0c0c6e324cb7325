"""One definition per op type: hand-written handlers take their layouts from the op's rule.

- Every op type with a hand-written handler has a propagation rule (or, for
  control flow, the registry's call ties): a handler alone would partition an op
  that propagation knows nothing about.
- For op types with both, the layouts a handler actually uses (what it
  reshards each operand to, what layout it gives each result) are one factor
  assignment of the rule, on sample shardings and, by brute force, on every op
  sweep program of every such op type (a 4-device and a 2x4 mesh, the most
  uneven split and a seeded pick of operand/output shardings, values checked
  against the unpartitioned function): the two cannot drift.
- Depthwise convolutions (channel multiplier > 1, split channels, split
  spatial dims with halos) and both gradients, against the unpartitioned op.
"""

import collections
import contextlib

import numpy as np
import pytest
import tensorflow as tf

import tf_gspmd as tg
from tf_gspmd.graph_rewrite import dispatch, handlers
from tf_gspmd.propagation import registry
from tf_gspmd.propagation.rule import REDUCTION
from tf_gspmd.testing import assert_close, assert_close_to_float64

from helpers import NO_LAYOUT_DECISION, agreement_specs  # noqa: E402

MESH = tg.Mesh.create((2, 4), ('a', 'b'))


def _has_rule(op_type):
  entry = registry.lookup(op_type)
  return entry is not None and (entry.rule is not None or entry.call_ties is not None)


def test_every_op_type_with_a_handler_has_a_rule():
  dispatch._load_families()  # noqa: SLF001
  hand_written = handlers.hand_written()
  assert len(hand_written) > 20, sorted(hand_written)  # the families loaded: not vacuous
  missing = [op for op in sorted(hand_written) if not _has_rule(op)]
  assert not missing, f'op types with a handler but no rule: {missing}'


# --- the layouts a handler uses are the rule's ------------------------------------------------
@contextlib.contextmanager
def recording_layouts():
  """Record, per partitioned node, the layout each operand was used in and each result had
  when its handler produced it."""
  seen = []
  lookup = dispatch.lookup

  def recording_lookup(p, node, graph):
    handler, how = lookup(p, node, graph)
    if how != 'hand-written':
      return handler, how

    def recording(p, graph, node, operands):
      used = {id(v): (i, v.sharding) for i, v in enumerate(operands)}
      handles = {_name(v.tensor): i for i, v in enumerate(operands) if v.dtype == tf.resource}
      results = {}
      reshard, finish = p.reshard, p.finish

      def operand_index(value):
        """The operand `value` is, or was read from (a variable read, then resharded)."""
        if id(value) in used:
          return used[id(value)][0]
        op = getattr(value.tensor, 'op', None)
        if op is None or op.type != 'ReadVariableOp':
          return None
        # A handle captured from outside the trace (an eager one) is read through a placeholder:
        # then the one variable operand is the one read.
        only = list(handles.values()) if len(handles) == 1 else []
        return handles.get(_name(op.inputs[0]), only[0] if only else None)

      def reshard_spy(value, target, why=''):
        out = reshard(value, target, why)
        i = operand_index(value)
        if i is not None:
          used[id(value)] = (i, target)
          used[id(out)] = (i, target)
        return out

      def finish_spy(graph_, value, tensor):
        results[tensor] = value.sharding
        return finish(graph_, value, tensor)

      p.reshard, p.finish = reshard_spy, finish_spy
      try:
        outs = handler(p, graph, node, operands)
      finally:
        del p.reshard, p.finish
      operand_layouts = [None] * len(operands)
      for i, layout in used.values():
        operand_layouts[i] = layout
      result_layouts = [results.get(t.name, o.sharding) for t, o in zip(node.outputs, outs)]
      seen.append((p, graph, node, operand_layouts, result_layouts))
      return outs

    return recording, how

  dispatch.lookup = recording_lookup
  try:
    yield seen
  finally:
    dispatch.lookup = lookup


def _axes(sharding):
  return tuple(sharding.spec.axes_of(d) for d in range(len(sharding.spec)))


def _name(tensor):
  """A graph tensor's name (an eager tensor has none)."""
  try:
    return tensor.name
  except AttributeError:
    return None


def _summed_into(rule, node, graph):
  """Variables an op adds partial sums into in place (ResourceScatterAdd with its index dims
  split): the sums are reduce-scattered onto the variable's own layout, so that layout is
  where the reduction lands (a result's target), not one the handler chose for the op."""
  if node.outputs or not any(rule.kind(f) == REDUCTION for f in rule.factors()):
    return []
  return [i for i, t in enumerate(node.inputs) if registry.is_resource(graph.tensor(t).dtype)]


def disagreements(p, graph, node, operand_layouts, result_layouts):
  """How the handler's layouts differ from one factor assignment of the node's rule."""
  rule = registry.rule_for(node, p.rule_context(graph))
  ctx = p.rule_context(graph)
  shapes = [None if d is None else ctx.shape(t) for d, t in zip(rule.operands, node.inputs)]
  shapes += [None if o.shape is None or None in o.shape else tuple(o.shape) for o in node.outputs]
  layouts = list(operand_layouts) + list(result_layouts)
  for i in _summed_into(rule, node, graph):
    layouts[i] = None  # the destination of sums, not a layout the handler chose
  specs = [
    None if dims is None or shape is None or lay is None else _axes(lay)
    for dims, shape, lay in zip(rule.tensor_dims(), shapes, layouts)
  ]
  fa = rule.representable(rule.factor_axes(specs, p.mesh), p.mesh, shapes)
  want = rule.operand_specs(fa, p.mesh, shapes[: len(rule.operands)]) + rule.result_specs(
    fa, p.mesh, shapes[len(rule.operands) :]
  )
  out = []
  for k, (spec, got, shape) in enumerate(zip(want, specs, shapes)):
    if spec is None or got is None:
      continue
    if tuple(spec.axes_of(d) for d in range(len(shape))) != got:
      what = f'operand {k}' if k < len(rule.operands) else f'result {k - len(rule.operands)}'
      out.append(f'{node.op} {what}: handler {got}, rule {spec}')
  for j, (dims, lay) in enumerate(zip(rule.results, result_layouts)):
    if dims is None or lay is None:
      continue
    present = {f for e in dims for f in ((e,) if isinstance(e, str) else e or ())}
    allowed = {a for f, axes in fa.items() if f not in present for a in axes}
    if set(lay.partial_axes) - allowed:
      out.append(
        f'{node.op} result {j}: partial over {lay.partial_axes}, the rule reduces '
        f'over {sorted(allowed)}'
      )
  return out


def _program(fn, specs):
  @tf.function(autograph=False)
  def f(*args):
    padded = list(specs) + [None] * (len(args) - len(specs))
    return fn(*[x if s is None else tg.shard(x, MESH, tg.P(*s)) for x, s in zip(args, padded)])

  return f


def _bn_forward(x, scale, offset):
  empty = tf.zeros([0], tf.float32)
  return tf.raw_ops.FusedBatchNormV3(
    x=x, scale=scale, offset=offset, mean=empty, variance=empty, epsilon=1e-3, is_training=True
  )[:3]


def _bn_grad(dy, x, scale, offset):
  empty = tf.zeros([0], tf.float32)
  f = tf.raw_ops.FusedBatchNormV3(
    x=x, scale=scale, offset=offset, mean=empty, variance=empty, epsilon=1e-3, is_training=True
  )
  return tf.raw_ops.FusedBatchNormGradV3(
    y_backprop=dy,
    x=x,
    scale=scale,
    reserve_space_1=f[3],
    reserve_space_2=f[4],
    reserve_space_3=f[5],
    epsilon=1e-3,
    is_training=True,
  )[:3]


def _bn_grad_float64(dy, x, scale, offset):
  """`_bn_grad` in float64 (numpy: FusedBatchNormGradV3 has no float64 kernel)."""
  del offset
  dy, x, scale = (np.asarray(a, np.float64) for a in (dy, x, scale))
  axes = (0, 1, 2)
  inv = 1 / np.sqrt(x.var(axes) + 1e-3)
  x_hat = (x - x.mean(axes)) * inv
  dx = scale * inv * (dy - dy.mean(axes) - x_hat * (dy * x_hat).mean(axes))
  return [dx, (dy * x_hat).sum(axes), dy.sum(axes)]


def _depthwise_grads(x, w, dy):
  sizes = dict(strides=[1, 1, 1, 1], padding='SAME')
  return (
    tf.raw_ops.DepthwiseConv2dNativeBackpropInput(
      input_sizes=tf.shape(x), filter=w, out_backprop=dy, **sizes
    ),
    tf.raw_ops.DepthwiseConv2dNativeBackpropFilter(
      input=x, filter_sizes=tf.shape(w), out_backprop=dy, **sizes
    ),
  )


_R = np.random.RandomState(0)
_IMG = _R.randn(4, 8, 6, 4).astype(np.float32)
_VEC = _R.uniform(0.5, 1.5, 4).astype(np.float32)
_W = _R.randn(3, 3, 4, 2).astype(np.float32)
_DY = _R.randn(4, 8, 6, 8).astype(np.float32)

# (name, fn, args, operand specs): hand-written handlers of rule-carrying ops on sample shardings.
AGREEMENT_CASES = [
  ('reshape merge', lambda x: tf.reshape(x, [32, 6, 4]), [_IMG], [('a', 'b', None, None)]),
  (
    'reshape split minor',
    lambda x: tf.reshape(x, [4, 8, 3, 2, 4]),
    [_IMG],
    [(None, None, 'a', None)],
  ),
  ('reshape uneven', lambda x: tf.reshape(x, [4, 48, 4]), [_IMG], [(None, 'b', None, None)]),
  (
    'bias_add_grad',
    lambda x: tf.raw_ops.BiasAddGrad(out_backprop=x),
    [_IMG],
    [('a', None, None, 'b')],
  ),
  ('batch_norm batch x height', _bn_forward, [_IMG, _VEC, _VEC], [('a', 'b', None, None)]),
  ('batch_norm channels', _bn_forward, [_IMG, _VEC, _VEC], [(None, None, None, 'b')]),
  ('batch_norm_grad', _bn_grad, [_IMG, _IMG, _VEC, _VEC], [('b', None, 'a', None)]),
  (
    'depthwise channels',
    lambda x, w: tf.nn.depthwise_conv2d(x, w, [1] * 4, 'SAME'),
    [_IMG, _W],
    [(None, None, None, 'b'), (None, None, None, 'a')],
  ),
  (
    'depthwise halo',
    lambda x, w: tf.nn.depthwise_conv2d(x, w, [1] * 4, 'SAME'),
    [_IMG, _W],
    [(None, 'b', None, 'a'), None],
  ),
  (
    'depthwise grads',
    _depthwise_grads,
    [_IMG, _W, _DY],
    [('a', 'b', None, None), None, (None, None, None, 'b')],
  ),
]


# Cases where float32 is ill-conditioned, compared by the oracle's float64 rule. The batch norm
# gradient is fed y_backprop = x: dx = scale/sigma * (dy - mean(dy) - x_hat * mean(dy x_hat))
# then cancels to scale * x_hat * eps / (var + eps), ~1e-3 of its terms. Measured, dx: two
# correct float32 runs 2.2e-4 (oneDNN on) / 2.9e-4 (off) apart, normwise; partitioned 1.4e-4
# and unpartitioned 1.1e-4 / 2.1e-4 from float64.
FLOAT64_REFERENCES = {'batch_norm_grad': _bn_grad_float64}


@pytest.mark.parametrize('name,fn,args,specs', AGREEMENT_CASES, ids=[c[0] for c in AGREEMENT_CASES])
def test_hand_written_handlers_use_the_layouts_of_the_rule(name, fn, args, specs):
  program = _program(fn, specs)
  want = program(*args)
  with recording_layouts() as seen:
    pf = tg.partition(program, MESH)
    got = pf(*args)
  if name in FLOAT64_REFERENCES:
    exact = FLOAT64_REFERENCES[name](*args)
    assert_close_to_float64(tf.nest.flatten(got), tf.nest.flatten(want), exact, name)
  else:
    assert_close(tf.nest.flatten(got), tf.nest.flatten(want), name)
  checked = [
    s
    for s in seen
    if registry.lookup(s[2].op) is not None and registry.lookup(s[2].op).rule is not None
  ]
  assert checked, f'{name}: no hand-written handler of a rule-carrying op ran'
  problems = [msg for s in checked for msg in disagreements(*s)]
  assert not problems, problems


@pytest.mark.parametrize('op', ['scatter_add', 'scatter_sub'])
def test_row_sums_scattered_where_the_updates_are_use_the_layouts_of_the_rule(op):
  """A variable split on its trailing dim over the axis the updates' rows are split on: each
  partition sums its own updates into rows, reduce-scattered onto the variable's layout."""

  def program(var):
    @tf.function(autograph=False)
    def f(i, u):
      i, u = tg.shard(i, MESH, tg.P('a')), tg.shard(u, MESH, tg.P('a', None))
      getattr(var, op)(tf.IndexedSlices(u, i))
      return var.read_value()

    return f

  rows = _R.randn(10, 6).astype(np.float32)
  var, ref = tf.Variable(rows), tf.Variable(rows)
  tg.shard_variable(var, MESH, tg.P(None, 'a'))
  i, u = _R.randint(0, 10, 33).astype(np.int32), _R.randn(33, 6).astype(np.float32)
  with recording_layouts() as seen:
    pf = tg.partition(program(var), MESH)
    assert_close(pf(i, u), program(ref)(i, u), op)
  ((scatter),) = [s for s in seen if s[2].op.startswith('ResourceScatter')]
  assert scatter[3][2].spec == tg.P('a', None), 'the updates stay where they are'
  assert not disagreements(*scatter)
  assert [r['kind'] for r in pf.collectives()] == ['reduce_scatter']


def test_the_agreement_check_catches_a_handler_that_drifts():
  """A handler using a layout its rule cannot give is reported (the check can fail)."""
  program = _program(lambda x: tf.reshape(x, [32, 6, 4]), [('a', 'b', None, None)])
  with recording_layouts() as seen:
    tg.partition(program, MESH)(_IMG)
  ((p, graph, node, operands, results),) = [s for s in seen if s[2].op == 'Reshape']
  drifted = [tg.NamedSharding(MESH, tg.P(None, None, None, None))]
  assert disagreements(p, graph, node, operands, drifted)


# --- depthwise with a channel multiplier ---------------------------------------------------
def _depthwise_step(specs, out_spec=None):
  @tf.function(autograph=False)
  def f(x, w, dy):
    x = x if specs[0] is None else tg.shard(x, MESH, tg.P(*specs[0]))
    w = w if specs[1] is None else tg.shard(w, MESH, tg.P(*specs[1]))
    with tf.GradientTape() as tape:
      tape.watch([x, w])
      y = tf.nn.depthwise_conv2d(x, w, [1, 1, 1, 1], 'SAME')
      if out_spec is not None:
        y = tg.shard(y, MESH, tg.P(*out_spec))
      loss = tf.reduce_sum(y * dy)
    return (y,) + tuple(tape.gradient(loss, [x, w]))

  return f


DEPTHWISE_CASES = [  # image spec, filter spec, output spec, expected collectives per op
  # Channels split, multiplier 2: no communication at all.
  ((None, None, None, 'b'), (None, None, 'b', None), None, {}),
  # Height split (halos both ways) and channels split.
  ((None, 'a', None, 'b'), None, None, {'permute': 6, 'all_reduce': 1}),
  # Height and width split on uneven sizes (9 rows over 4, 7 columns over 2).
  ((None, 'b', 'a', None), None, None, {'permute': 12, 'all_reduce': 1}),
  # Channels split into single channels, the multiplier split too (output channel (c, m)):
  # the image gradient sums over the multiplier, one all-reduce over 'a'.
  (
    (None, None, None, 'b'),
    (None, None, 'b', 'a'),
    (None, None, None, ('b', 'a')),
    {'all_reduce': 1},
  ),
]


@pytest.mark.parametrize('specs_in,filter_spec,out_spec,expected', DEPTHWISE_CASES)
def test_depthwise_with_multiplier_and_its_gradients(specs_in, filter_spec, out_spec, expected):
  rng = np.random.RandomState(1)
  shape = (2, 9, 7, 4)
  x = rng.randn(*shape).astype(np.float32)
  w = rng.randn(3, 3, 4, 2).astype(np.float32)
  dy = rng.randn(2, 9, 7, 8).astype(np.float32)
  want = _depthwise_step((None, None))(x, w, dy)
  pf = tg.partition(_depthwise_step((specs_in, filter_spec), out_spec), MESH)
  got = pf(x, w, dy)
  assert_close(list(got), list(want), 'y, dx, dw')
  records = [r for r in pf.op_records() if r.op.startswith('DepthwiseConv2dNative')]
  assert {r.op for r in records} == {
    'DepthwiseConv2dNative',
    'DepthwiseConv2dNativeBackpropInput',
    'DepthwiseConv2dNativeBackpropFilter',
  }
  assert all(r.how == 'hand-written' for r in records)
  # (a gradient's pending sum is resolved at the function's end: the 'outputs' record)
  records += [r for r in pf.op_records() if r.op == 'outputs']
  kinds = collections.Counter(c['kind'] for r in records for c in r.collectives)
  assert kinds == expected, kinds


# --- brute force: every op type with a rule and a hand-written handler --------------------
# Sharding combinations per program and mesh: the most uneven split first, then a seeded pick
# (operands or outputs) from the op sweep's enumeration. The op sweep's CI sample leaves these
# op types to this brute force (tests/helpers.py `agreement_specs`).
CASES_PER_MESH = 2
AGREEMENT_SPECS = agreement_specs()


@pytest.fixture(scope='module')
def sweep():
  from tf_gspmd.testing import op_sweep

  previous = op_sweep.fast_first_runs()
  yield op_sweep.Sweep(AGREEMENT_SPECS)
  op_sweep.restore_optimizer(previous)


def _cpu_kernel(op_type: str) -> bool:
  # TF's kernel registry is the only place that says which devices an op runs on.
  from tensorflow.python.framework import kernels

  return any(k.device_type == 'CPU' for k in kernels.get_registered_kernels_for_op(op_type).kernel)


# Rules and handlers no program can check here: TF has no CPU kernel for them (checked below,
# so a CPU kernel appearing in TF fails this test until a sweep program covers the op type).
NO_CPU_KERNEL = (
  'CudnnRNN',
  'CudnnRNNBackprop',
  'CudnnRNNBackpropV2',
  'CudnnRNNBackpropV3',
  'CudnnRNNV2',
  'CudnnRNNV3',
)
# Manual-region ops, partitioned only between a region's boundaries on per-partition values
# (no sweep program makes one alone): tests/test_manual.py checks each against its automatic
# twin.
MANUAL_REGION_OPS = (
  'AllToAll',
  'CollectivePermute',
  'CrossReplicaSum',
  'XlaAllReduce',
  'XlaCustomCall',
  'XlaReduceScatter',
  'XlaSpmdFullToShardShape',
  'XlaSpmdShardToFullShape',
)


def test_the_brute_force_covers_every_op_type_with_a_rule_and_a_handler():
  dispatch._load_families()  # noqa: SLF001
  covered = {s.op_type for s in AGREEMENT_SPECS}
  missing = sorted(
    op
    for op, fn in handlers.hand_written().items()
    if fn.__name__ not in NO_LAYOUT_DECISION
    and registry.lookup(op) is not None
    and registry.lookup(op).rule is not None
    and op not in covered
    and op not in NO_CPU_KERNEL
    and op not in MANUAL_REGION_OPS
  )
  assert not missing, f'op types with a rule and a handler but no sweep program: {missing}'
  assert not [op for op in NO_CPU_KERNEL if _cpu_kernel(op) or op in covered]
  assert _cpu_kernel('MatMul')  # the check itself can tell


def _run_recorded(sweep, case):
  """(problems, disagreements) of one sweep case."""
  op_type = sweep.specs[case.spec].op_type
  with recording_layouts() as seen:
    result = sweep.run(case)
  problems = []
  if result.status != 'pass' and not result.known:  # known: a refusal the sweep expects
    problems.append(f'{case.label()}: {result.status} {result.message}')
  drift = [
    f'{case.label()}: {msg}' for s in seen if s[2].op == op_type for msg in disagreements(*s)
  ]
  return problems, drift


@pytest.mark.slow  # the brute force: every such program, partitioned and run, on two meshes
@pytest.mark.parametrize('mesh_name', ['1d', '2d'])
@pytest.mark.parametrize('name', [s.name for s in AGREEMENT_SPECS])
def test_every_handler_uses_a_factor_assignment_of_its_rule(sweep, name, mesh_name):
  """On a 4-device and a 2x4 mesh, uneven sizes included: the layouts each hand-written
  handler uses are one valid factor assignment of the op's rule, and the values are the
  unpartitioned function's."""
  problems = []
  for case in sweep.sample(name, mesh_name, CASES_PER_MESH):
    errors, drift = _run_recorded(sweep, case)
    problems += errors + drift
  assert not problems, '\n'.join(problems)


def test_a_sharded_reduction_factor_shares_no_axis_with_the_results():
  """A gather's table rows (a reduction) and its indices' dims are in no common tensor, but
  the result is partial over the rows' axes: the two cannot take the same axes."""
  from tf_gspmd.propagation.rule import REDUCTION, OpRule

  gather = OpRule(
    operands=(('i', 'j'), ('k',)),
    results=(('k', 'j'),),
    kinds={'i': REDUCTION},
    sizes={'i': 8, 'j': 4, 'k': 6},
  )
  got = gather.resolve_axes({'i': ('a', 'b'), 'k': ('a', 'b'), 'j': ()})
  assert got == {'i': ('a', 'b'), 'j': (), 'k': ()}
  # Factors in no common tensor and no partial result may still share axes (IdentityN).
  pair = OpRule(operands=(('i',), ('k',)), results=(('i',), ('k',)))
  assert pair.resolve_axes({'i': ('a',), 'k': ('a',)}) == {'i': ('a',), 'k': ('a',)}
