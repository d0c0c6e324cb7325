"""Propagation on captured tf.functions and Keras 3 training steps."""

import collections

import keras
import tensorflow as tf
from keras import layers

import tf_gspmd
from tf_gspmd import Mesh, P
from tf_gspmd.propagation import propagate
from tf_gspmd.propagation.propagate import FORWARD

MESH = Mesh.create((2, 4), ('data', 'model'))
# Provenance kinds that mean "no rule or no path decided this tensor".
UNDECIDED = ('default', 'no_rule', 'unknown_rank')


def shard(x, *spec):
  return tf_gspmd.shard(x, MESH, P(*spec))


def test_megatron_mlp_with_adam():
  w1 = tf.Variable(tf.random.normal((16, 32)), name='w1')
  w2 = tf.Variable(tf.random.normal((32, 16)), name='w2')
  tf_gspmd.shard_variable(w1, MESH, P(None, 'model'))
  tf_gspmd.shard_variable(w2, MESH, P('model', None))
  opt = keras.optimizers.Adam(0.01)
  opt.build([w1, w2])

  @tf.function
  def step(x, y):
    x = shard(x, 'data', None)
    with tf.GradientTape() as tape:
      h = tf.nn.relu(tf.matmul(x, w1, name='hidden'))
      out = tf.matmul(h, w2, name='out')
      loss = tf.reduce_mean(tf.square(out - y))
    g1, g2 = tape.gradient(loss, [w1, w2])
    g1, g2 = tf.identity(g1, name='grad_w1'), tf.identity(g2, name='grad_w2')
    opt.apply_gradients(zip([g1, g2], [w1, w2]))
    return loss

  propagation = propagate(step, tf.zeros((8, 16)), tf.zeros((8, 16)), mesh=MESH)
  assert propagation.sharding('hidden:0').spec == P('data', 'model')
  assert propagation.sharding('out:0').spec == P('data', None)
  assert propagation.provenance('out:0').kind == FORWARD
  assert propagation.sharding('grad_w1').spec == P(None, 'model')
  assert propagation.sharding('grad_w2').spec == P('model', None)
  slots = {v.name: propagation.variable_sharding(v) for v in opt.variables if len(v.shape) == 2}
  assert len(slots) == 4
  for name, sharding in slots.items():
    expected = P(None, 'model') if 'w1' in name else P('model', None)
    assert sharding.spec == expected, name
  assert not propagation.warnings
  assert 'hidden' in propagation.explain()


def test_spatially_split_image_through_conv_batchnorm_pooling():
  model = keras.Sequential(
    [
      keras.Input((16, 16, 3)),
      layers.Conv2D(8, 3, padding='same', name='conv'),
      layers.BatchNormalization(name='bn'),
      layers.ReLU(name='relu'),
      layers.MaxPooling2D(name='pool'),
      layers.Conv2D(4, 3, padding='same', name='conv2'),
    ]
  )

  @tf.function
  def forward(x):
    return model(shard(x, None, 'data', None, None), training=True)

  propagation = propagate(forward, tf.zeros((4, 16, 16, 3)), mesh=MESH)
  by_op = collections.defaultdict(list)
  for rec in propagation.records():
    by_op[rec['op']].append(rec)
  for op in ('Conv2D', 'MaxPool', 'Relu'):
    assert by_op[op], op
    for rec in by_op[op]:
      assert rec['sharding'] == "P(None, 'data', None, None)", rec
  # BatchNorm statistics reduce over batch and space: replicated; the normalized output
  # keeps the spatial split.
  bn = [
    r for r in propagation.records() if '/bn' in r['node'] and r['node'].endswith('batchnorm/add_1')
  ]
  assert bn and bn[0]['sharding'] == "P(None, 'data', None, None)"
  means = [
    r for r in propagation.records() if '/bn' in r['node'] and r['node'].endswith('moments/mean')
  ]
  assert means and means[0]['sharding'] == 'P(None, None, None, None)'


def test_while_loop_body_keeps_the_loop_sharding():
  w = tf.Variable(tf.random.normal((16, 16)))

  @tf.function
  def f(x):
    x = shard(x, 'data', None)
    _, y = tf.while_loop(
      lambda i, x: i < 3, lambda i, x: (i + 1, tf.tanh(tf.matmul(x, w))), (tf.constant(0), x)
    )
    return y

  propagation = propagate(f, tf.zeros((8, 16)), mesh=MESH)
  whiles = [n for n in propagation.program.main.nodes if n.op in ('While', 'StatelessWhile')]
  assert len(whiles) == 1
  loop = whiles[0]
  called = loop.called_functions()
  body = propagation.program.functions[called['body'][0]]
  cond = propagation.program.functions[called['cond'][0]]
  k = (
    1
    + [i for i, t in enumerate(loop.inputs[1:]) if propagation.program.main.tensor(t).rank == 2][0]
  )
  for graph, tensor in (
    (body.name, body.inputs[k]),
    (body.name, body.outputs[k]),
    (cond.name, cond.inputs[k]),
    (None, f'{loop.name}:{k}'),
  ):
    assert propagation.sharding(tensor, graph).spec == P('data', None), (graph, tensor)
  matmuls = [n for n in body.nodes if n.op == 'MatMul']
  assert matmuls and propagation.sharding(matmuls[0].outputs[0].name, body.name).spec == P(
    'data', None
  )


def _keras_step(model, x_spec, variable_specs=None):
  for var, spec in variable_specs or ():
    tf_gspmd.shard_variable(var, MESH, spec)
  opt = keras.optimizers.Adam(1e-3)
  opt.build(model.trainable_variables)
  loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
  metric = keras.metrics.SparseCategoricalAccuracy()

  @tf.function
  def step(x, y):
    with tf.GradientTape() as tape:
      p = model(tf_gspmd.shard(x, MESH, x_spec), training=True)
      loss = loss_fn(y, p)
    grads = tape.gradient(loss, model.trainable_variables)
    opt.apply_gradients(zip(grads, model.trainable_variables))
    metric.update_state(y, p)
    return loss

  return step, opt


def _assert_all_decided(propagation):
  kinds = collections.Counter(r['kind'] for r in propagation.records())
  undecided = [
    (r['node'], r['op'], r['kind']) for r in propagation.records() if r['kind'] in UNDECIDED
  ]
  assert not undecided, undecided[:10]
  assert not propagation.warnings
  assert kinds['forward'] > 20 and kinds['backward'] > 5
  for graph in propagation.program.graphs():
    for t in graph.tensors():
      _assert_fits(propagation.sharding(t.name, graph.name), t, graph.name)


def _assert_fits(sharding, tensor, graph):
  """`sharding` is one `tensor` can hold: on MESH, a spec of its rank (a variable handle's:
  its variable's; or P(), replicated), each mesh axis used once."""
  spec = tuple(sharding.spec)
  rank = len(tensor.handle_data[0][1]) if tensor.handle_data else tensor.rank
  assert sharding.mesh == MESH, (graph, tensor.name, sharding)
  assert rank is None or len(spec) in (0, rank), (graph, tensor.name, spec)
  axes = [a for entry in spec for a in ((entry,) if isinstance(entry, str) else entry or ())]
  assert len(axes) == len(set(axes)) and set(axes) <= {'data', 'model'}, (tensor.name, spec)


def test_keras_mlp_step_megatron():
  model = keras.Sequential(
    [keras.Input((16,)), layers.Dense(32, activation='relu', name='d1'), layers.Dense(8, name='d2')]
  )
  d1, d2 = model.get_layer('d1'), model.get_layer('d2')
  step, opt = _keras_step(
    model, P('data', None), [(d1.kernel, P(None, 'model')), (d2.kernel, P('model', None))]
  )
  propagation = propagate(step, tf.zeros((8, 16)), tf.zeros((8,), tf.int32), mesh=MESH)
  _assert_all_decided(propagation)
  hidden = [r for r in propagation.records() if r['op'] == 'Relu']
  assert hidden and hidden[0]['sharding'] == "P('data', 'model')"
  logits = [r for r in propagation.records() if r['op'] == 'BiasAdd' and 'd2' in r['node']]
  assert logits[0]['sharding'] == "P('data', None)"
  # The first layer's bias takes the hidden activation's 'model' split; slots follow.
  assert propagation.variable_sharding(d1.bias).spec == P('model')
  for v in opt.variables:
    if len(v.shape) == 2:
      expected = P(None, 'model') if tuple(v.shape) == (16, 32) else P('model', None)
      assert propagation.variable_sharding(v.value).spec == expected, v.path


def test_keras_transformer_block_step():
  inp = keras.Input((10,), dtype='int32')
  e = layers.Embedding(50, 16)(inp)
  a = layers.MultiHeadAttention(num_heads=2, key_dim=8)(e, e)
  h = layers.LayerNormalization()(e + layers.Dropout(0.1)(a))
  f = layers.Dense(32, activation='gelu')(h)
  f = layers.Dense(16)(f)
  h = layers.LayerNormalization()(h + layers.Dropout(0.1)(f))
  model = keras.Model(inp, layers.Dense(5)(layers.GlobalAveragePooling1D()(h)))
  step, _ = _keras_step(model, P('data', None))
  propagation = propagate(step, tf.zeros((4, 10), tf.int32), tf.zeros((4,), tf.int32), mesh=MESH)
  _assert_all_decided(propagation)
  softmax = [r for r in propagation.records() if r['op'] == 'Softmax']
  assert softmax and softmax[0]['sharding'].startswith("P('data'")
  gathers = [r for r in propagation.records() if r['op'] == 'GatherV2' and r['sharding'] != 'P()']
  assert gathers and gathers[0]['sharding'] == "P('data', None, None)"


def test_keras_cnn_step():
  model = keras.Sequential(
    [
      keras.Input((16, 16, 3)),
      layers.Conv2D(8, 3, padding='same'),
      layers.BatchNormalization(),
      layers.ReLU(),
      layers.MaxPooling2D(),
      layers.Conv2D(8, 3),
      layers.GlobalAveragePooling2D(),
      layers.Dense(4),
    ]
  )
  step, _ = _keras_step(model, P('data', 'model', None, None))
  propagation = propagate(step, tf.zeros((4, 16, 16, 3)), tf.zeros((4,), tf.int32), mesh=MESH)
  _assert_all_decided(propagation)
  for rec in propagation.records():
    if rec['op'] in ('Conv2D', 'MaxPool', 'MaxPoolGrad', 'Conv2DBackpropInput'):
      assert rec['sharding'] == "P('data', 'model', None, None)", rec
    if rec['op'] == 'Conv2DBackpropFilter':
      assert rec['sharding'] == 'P(None, None, None, None)', rec
