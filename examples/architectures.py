"""Small image classifiers built the way production model code builds them.

Three architectures, each in two styles:

- raw TF, as TF-slim / tf_keras / the TF model garden emit ops: `tf.nn.conv2d`,
  `tf.nn.depthwise_conv2d`, `tf.compat.v1.nn.fused_batch_norm` (FusedBatchNormV3 and its
  gradient), stride-2 downsampling as an explicit `tf.pad` then a VALID conv ("fixed
  padding"), global pooling as `reduce_mean(keepdims=True)` + `tf.squeeze`, `tf.nn.silu`
  (whose custom gradient is an `IdentityN`), `tf.identity_n`, stateless dropout and a
  `ResourceApplyMomentum` update (what `tf.compat.v1.train.MomentumOptimizer` emits);
- Keras 3 layers (`Conv2D`, `DepthwiseConv2D`, `BatchNormalization` -- moments plus
  arithmetic, not a fused op --, `ZeroPadding2D`, `GlobalAveragePooling2D`, `Dropout`,
  SGD with momentum).

The architectures are small (32x32 images, a few channels) but keep the structure of the
real ones: a ResNet bottleneck stack with projection shortcuts, a MobileNetV2 inverted-
residual stack (1x1 expand + BN + relu6, 3x3 depthwise + BN, 1x1 project + BN, residual
add) and EfficientNet MBConv blocks with squeeze-excite (5x5 depthwise included).

Every builder takes a dtype, so the same network can run in float64 as the reference a
float32 training step is measured against. FusedBatchNorm has no float64 kernel: the
float64 raw twin computes batch norm with `tf.nn.moments` (the same formula, including
the op's Bessel-corrected batch variance).
"""

from __future__ import annotations

from typing import Callable, Dict, Optional

import keras
import numpy as np
import tensorflow as tf

import tf_gspmd as tg

IMAGE, CHANNELS, CLASSES, BATCH = 32, 3, 10, 8
BN_MOMENTUM, BN_EPSILON = 0.9, 1e-3
DROPOUT, DROPOUT_SEED = 0.2, (7, 11)
LEARNING_RATE, MOMENTUM = 0.05, 0.9


def batch(seed: int, batch_size: int = BATCH):
  """Images [B, 32, 32, 3] float32 and integer labels [B]."""
  rng = np.random.RandomState(seed)
  return (
    rng.randn(batch_size, IMAGE, IMAGE, CHANNELS).astype(np.float32),
    rng.randint(0, CLASSES, batch_size).astype(np.int32),
  )


# --- raw TF ---------------------------------------------------------------------------
class RawNet:
  """Variables created on first use (by name) and the ops production code writes.

  `RawNet(arch)` builds `arch(net, images, training) -> logits` by running it once
  eagerly; `twin(dtype)` is the same network with the same values in another dtype.
  """

  def __init__(
    self,
    arch: Callable,
    seed: int = 0,
    dtype=tf.float32,
    values: Optional[Dict[str, np.ndarray]] = None,
  ):
    self.arch = arch
    self.dtype = tf.as_dtype(dtype)
    self.fused = self.dtype == tf.float32  # FusedBatchNormV3 has float32 kernels only
    self._rng = np.random.RandomState(seed)
    self._values = values
    self.variables: Dict[str, tf.Variable] = {}  # every variable, in creation order
    self.trainable: Dict[str, tf.Variable] = {}
    arch(self, tf.zeros([2, IMAGE, IMAGE, CHANNELS], self.dtype), training=False)
    self.slots = {
      name: tf.Variable(
        tf.zeros_like(v), trainable=False, name=name.replace('/', '_') + '_momentum'
      )
      for name, v in self.trainable.items()
    }

  def __call__(self, images, training: bool):
    return self.arch(self, tf.cast(images, self.dtype), training)

  def twin(self, dtype) -> 'RawNet':
    return RawNet(self.arch, dtype=dtype, values={k: v.numpy() for k, v in self.variables.items()})

  def all_variables(self):
    return list(self.variables.values()) + list(self.slots.values())

  # variables
  def var(self, name: str, shape, init: str, trainable: bool = True) -> tf.Variable:
    if name in self.variables:
      return self.variables[name]
    if self._values is not None:
      value = self._values[name]
    elif init == 'he':  # fan-in scaled normal, as the real models initialize conv kernels
      value = self._rng.randn(*shape) * np.sqrt(2.0 / np.prod(shape[:-1]))
    elif init == 'ones':
      value = np.ones(shape)
    else:
      value = np.zeros(shape)
    v = tf.Variable(
      np.asarray(value).astype(self.dtype.as_numpy_dtype),
      trainable=trainable,
      name=name.replace('/', '_'),
    )
    self.variables[name] = v
    if trainable:
      self.trainable[name] = v
    return v

  # layers
  def conv(self, x, name: str, kernel: int, filters: int, stride: int = 1, bias: bool = False):
    w = self.var(f'{name}/kernel', [kernel, kernel, x.shape[-1], filters], 'he')
    if stride > 1:
      x = fixed_padding(x, kernel)
    y = tf.nn.conv2d(x, w, stride, 'VALID' if stride > 1 else 'SAME', name=name)
    if bias:
      y = tf.nn.bias_add(y, self.var(f'{name}/bias', [filters], 'zeros'))
    return y

  def depthwise(self, x, name: str, kernel: int, stride: int = 1):
    w = self.var(f'{name}/depthwise_kernel', [kernel, kernel, x.shape[-1], 1], 'he')
    if stride > 1:
      x = fixed_padding(x, kernel)
    return tf.nn.depthwise_conv2d(
      x, w, [1, stride, stride, 1], 'VALID' if stride > 1 else 'SAME', name=name
    )

  def batch_norm(self, x, name: str, training: bool):
    channels = [x.shape[-1]]
    gamma = self.var(f'{name}/gamma', channels, 'ones')
    beta = self.var(f'{name}/beta', channels, 'zeros')
    moving_mean = self.var(f'{name}/moving_mean', channels, 'zeros', trainable=False)
    moving_var = self.var(f'{name}/moving_variance', channels, 'ones', trainable=False)
    if not training:
      if self.fused:
        return tf.compat.v1.nn.fused_batch_norm(
          x, gamma, beta, moving_mean, moving_var, epsilon=BN_EPSILON, is_training=False
        )[0]
      return tf.nn.batch_normalization(x, moving_mean, moving_var, beta, gamma, BN_EPSILON)
    if self.fused:
      y, mean, variance = tf.compat.v1.nn.fused_batch_norm(
        x, gamma, beta, epsilon=BN_EPSILON, is_training=True
      )
    else:
      mean, variance = tf.nn.moments(x, [0, 1, 2])
      y = tf.nn.batch_normalization(x, mean, variance, beta, gamma, BN_EPSILON)
      count = float(np.prod(x.shape[:3]))
      variance = variance * (count / (count - 1.0))  # the fused op's batch variance is unbiased
    # tf_keras's assign_moving_average: v -= (v - value) * (1 - momentum)
    moving_mean.assign_sub((moving_mean - mean) * (1.0 - BN_MOMENTUM))
    moving_var.assign_sub((moving_var - variance) * (1.0 - BN_MOMENTUM))
    return y

  def dense(self, x, name: str, units: int):
    w = self.var(f'{name}/kernel', [x.shape[-1], units], 'he')
    return tf.nn.bias_add(tf.matmul(x, w), self.var(f'{name}/bias', [units], 'zeros'))

  def dropout(self, x, training: bool):
    if not training:
      return x
    if x.dtype == tf.float32:
      return tf.nn.experimental.stateless_dropout(x, DROPOUT, seed=DROPOUT_SEED)
    # The same mask as the float32 op draws (its uniform is drawn in x's dtype).
    keep = tf.random.stateless_uniform(tf.shape(x), DROPOUT_SEED, dtype=tf.float32) >= DROPOUT
    return x * (1.0 / (1.0 - DROPOUT)) * tf.cast(keep, x.dtype)


def fixed_padding(x, kernel: int):
  """Pad H and W independently of the input size, as the TF model garden's ResNet does."""
  total = kernel - 1
  begin = total // 2
  return tf.pad(x, [[0, 0], [begin, total - begin], [begin, total - begin], [0, 0]])


def global_pool(x):
  """reduce_mean over H, W with kept dims, then Squeeze: the model garden's ResNet head."""
  return tf.squeeze(tf.reduce_mean(x, [1, 2], keepdims=True), [1, 2])


def resnet(net: RawNet, x, training: bool):
  """ResNet v1.5 bottlenecks: projection shortcuts, stride-2 3x3 convs by fixed padding."""
  x = tf.nn.relu(net.batch_norm(net.conv(x, 'stem', 3, 8), 'stem_bn', training))
  for i, (width, stride) in enumerate([(4, 1), (8, 2), (8, 2)]):
    x = _bottleneck(net, x, f'block{i}', width, stride, training)
  features = global_pool(x)
  # Logits and an end point leave together through identity_n, as tf.custom_gradient and
  # model-garden heads write them.
  logits, _ = tf.identity_n([net.dense(features, 'logits', CLASSES), features])
  return logits


def _bottleneck(net, x, name, width, stride, training):
  shortcut = net.batch_norm(
    net.conv(x, f'{name}/proj', 1, 4 * width, stride), f'{name}/proj_bn', training
  )
  y = tf.nn.relu(net.batch_norm(net.conv(x, f'{name}/a', 1, width), f'{name}/a_bn', training))
  y = tf.nn.relu(
    net.batch_norm(net.conv(y, f'{name}/b', 3, width, stride), f'{name}/b_bn', training)
  )
  y = net.batch_norm(net.conv(y, f'{name}/c', 1, 4 * width), f'{name}/c_bn', training)
  return tf.nn.relu(y + shortcut)


def mobilenet_v2(net: RawNet, x, training: bool):
  """MobileNetV2: inverted residuals, linear bottlenecks, relu6."""
  x = tf.nn.relu6(net.batch_norm(net.conv(x, 'stem', 3, 8, 2), 'stem_bn', training))
  for i, (expand, filters, stride) in enumerate([(1, 8, 1), (4, 12, 2), (4, 12, 1)]):
    x = _inverted_residual(net, x, f'block{i}', expand, filters, stride, training)
  x = tf.nn.relu6(net.batch_norm(net.conv(x, 'head', 1, 32), 'head_bn', training))
  return net.dense(global_pool(x), 'logits', CLASSES)


def _inverted_residual(net, x, name, expand, filters, stride, training):
  y = x
  if expand != 1:
    y = tf.nn.relu6(
      net.batch_norm(
        net.conv(y, f'{name}/expand', 1, expand * x.shape[-1]), f'{name}/expand_bn', training
      )
    )
  y = tf.nn.relu6(
    net.batch_norm(
      net.depthwise(y, f'{name}/depthwise', 3, stride), f'{name}/depthwise_bn', training
    )
  )
  y = net.batch_norm(net.conv(y, f'{name}/project', 1, filters), f'{name}/project_bn', training)
  return x + y if stride == 1 and x.shape[-1] == filters else y


def efficientnet(net: RawNet, x, training: bool):
  """EfficientNet MBConv blocks with squeeze-excite, swish and head dropout."""
  x = tf.nn.silu(net.batch_norm(net.conv(x, 'stem', 3, 8, 2), 'stem_bn', training))
  for i, (expand, kernel, filters, stride) in enumerate(
    [(1, 3, 8, 1), (4, 3, 12, 2), (4, 5, 12, 1)]
  ):
    x = _mbconv(net, x, f'block{i}', expand, kernel, filters, stride, training)
  x = tf.nn.silu(net.batch_norm(net.conv(x, 'head', 1, 32), 'head_bn', training))
  x = net.dropout(global_pool(x), training)
  return net.dense(x, 'logits', CLASSES)


def _mbconv(net, x, name, expand, kernel, filters, stride, training):
  y = x
  if expand != 1:
    y = tf.nn.silu(
      net.batch_norm(
        net.conv(y, f'{name}/expand', 1, expand * x.shape[-1]), f'{name}/expand_bn', training
      )
    )
  y = tf.nn.silu(
    net.batch_norm(
      net.depthwise(y, f'{name}/depthwise', kernel, stride), f'{name}/depthwise_bn', training
    )
  )
  squeezed = max(1, x.shape[-1] // 4)
  gate = tf.reduce_mean(y, [1, 2], keepdims=True)
  gate = tf.nn.silu(net.conv(gate, f'{name}/se_reduce', 1, squeezed, bias=True))
  y = y * tf.sigmoid(net.conv(gate, f'{name}/se_expand', 1, y.shape[-1], bias=True))
  y = net.batch_norm(net.conv(y, f'{name}/project', 1, filters), f'{name}/project_bn', training)
  return x + y if stride == 1 and x.shape[-1] == filters else y


RAW = {'resnet': resnet, 'mobilenet_v2': mobilenet_v2, 'efficientnet': efficientnet}


def raw_train_step(net: RawNet, annotate=None):
  """Forward, backward and a momentum update (ResourceApplyMomentum) in one tf.function.

  Returns the training-mode logits and the loss.
  """
  names = list(net.trainable)

  @tf.function
  def train_step(images, labels):
    if annotate is not None:
      images = annotate(images)
    with tf.GradientTape() as tape:
      logits = net(images, training=True)
      loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels, logits))
    grads = tape.gradient(loss, [net.trainable[n] for n in names])
    for name, grad in zip(names, grads):
      tf.raw_ops.ResourceApplyMomentum(
        var=_handle(net.trainable[name]),
        accum=_handle(net.slots[name]),
        lr=tf.constant(LEARNING_RATE, net.dtype),
        grad=grad,
        momentum=tf.constant(MOMENTUM, net.dtype),
      )
    return logits, loss

  return train_step


def _handle(variable):
  """`variable.handle` with the variable recorded as used by the function being traced: a bare
  handle (how MomentumOptimizer passes its slots) leaves it out of the function's variables."""
  tf.compat.v1.get_default_graph().watch_variable(variable)
  return variable.handle


def raw_predict(net: RawNet, annotate=None):
  @tf.function
  def predict(images):
    if annotate is not None:
      images = annotate(images)
    return net(images, training=False)

  return predict


# --- Keras 3 layers ----------------------------------------------------------------------
L = keras.layers


def _k_conv(x, name, kernel, filters, stride=1, bias=False):
  if stride > 1:  # keras.applications' "correct_pad" + VALID conv
    total = kernel - 1
    x = L.ZeroPadding2D(((total // 2, total - total // 2),) * 2, name=f'{name}_pad')(x)
  return L.Conv2D(
    filters,
    kernel,
    stride,
    'valid' if stride > 1 else 'same',
    use_bias=bias,
    kernel_initializer='he_normal',
    name=name,
  )(x)


def _k_depthwise(x, name, kernel, stride=1):
  if stride > 1:
    total = kernel - 1
    x = L.ZeroPadding2D(((total // 2, total - total // 2),) * 2, name=f'{name}_pad')(x)
  return L.DepthwiseConv2D(
    kernel,
    stride,
    'valid' if stride > 1 else 'same',
    use_bias=False,
    depthwise_initializer='he_normal',
    name=name,
  )(x)


def _k_bn(x, name):
  return L.BatchNormalization(momentum=BN_MOMENTUM, epsilon=BN_EPSILON, name=name)(x)


def _k_head(x, dropout: bool = False):
  x = L.GlobalAveragePooling2D(keepdims=True, name='avg_pool')(x)
  x = L.Reshape((x.shape[-1],), name='squeeze')(x)
  if dropout:  # float32 in every twin: its mask is drawn in the layer's dtype
    x = L.Dropout(DROPOUT, seed=DROPOUT_SEED[0], dtype='float32', name='dropout')(x)
  return L.Dense(CLASSES, kernel_initializer='he_normal', name='logits')(x)


def keras_resnet(inputs):
  x = L.ReLU(name='stem_relu')(_k_bn(_k_conv(inputs, 'stem', 3, 8), 'stem_bn'))
  for i, (width, stride) in enumerate([(4, 1), (8, 2), (8, 2)]):
    name = f'block{i}'
    shortcut = _k_bn(_k_conv(x, f'{name}_proj', 1, 4 * width, stride), f'{name}_proj_bn')
    y = L.ReLU()(_k_bn(_k_conv(x, f'{name}_a', 1, width), f'{name}_a_bn'))
    y = L.ReLU()(_k_bn(_k_conv(y, f'{name}_b', 3, width, stride), f'{name}_b_bn'))
    y = _k_bn(_k_conv(y, f'{name}_c', 1, 4 * width), f'{name}_c_bn')
    x = L.ReLU()(L.Add()([y, shortcut]))
  return _k_head(x)


def keras_mobilenet_v2(inputs):
  x = L.ReLU(6.0)(_k_bn(_k_conv(inputs, 'stem', 3, 8, 2), 'stem_bn'))
  for i, (expand, filters, stride) in enumerate([(1, 8, 1), (4, 12, 2), (4, 12, 1)]):
    name, y = f'block{i}', x
    if expand != 1:
      y = L.ReLU(6.0)(
        _k_bn(_k_conv(y, f'{name}_expand', 1, expand * x.shape[-1]), f'{name}_expand_bn')
      )
    y = L.ReLU(6.0)(_k_bn(_k_depthwise(y, f'{name}_depthwise', 3, stride), f'{name}_depthwise_bn'))
    y = _k_bn(_k_conv(y, f'{name}_project', 1, filters), f'{name}_project_bn')
    x = L.Add()([x, y]) if stride == 1 and x.shape[-1] == filters else y
  x = L.ReLU(6.0)(_k_bn(_k_conv(x, 'head', 1, 32), 'head_bn'))
  return _k_head(x)


def keras_efficientnet(inputs):
  swish = lambda: L.Activation('swish')  # noqa: E731
  x = swish()(_k_bn(_k_conv(inputs, 'stem', 3, 8, 2), 'stem_bn'))
  for i, (expand, kernel, filters, stride) in enumerate(
    [(1, 3, 8, 1), (4, 3, 12, 2), (4, 5, 12, 1)]
  ):
    name, y = f'block{i}', x
    if expand != 1:
      y = swish()(_k_bn(_k_conv(y, f'{name}_expand', 1, expand * x.shape[-1]), f'{name}_expand_bn'))
    y = swish()(_k_bn(_k_depthwise(y, f'{name}_depthwise', kernel, stride), f'{name}_depthwise_bn'))
    gate = L.GlobalAveragePooling2D(keepdims=True, name=f'{name}_se_squeeze')(y)
    gate = L.Conv2D(max(1, x.shape[-1] // 4), 1, activation='swish', name=f'{name}_se_reduce')(gate)
    gate = L.Conv2D(y.shape[-1], 1, activation='sigmoid', name=f'{name}_se_expand')(gate)
    y = L.Multiply(name=f'{name}_se_excite')([y, gate])
    y = _k_bn(_k_conv(y, f'{name}_project', 1, filters), f'{name}_project_bn')
    x = L.Add()([x, y]) if stride == 1 and x.shape[-1] == filters else y
  x = swish()(_k_bn(_k_conv(x, 'head', 1, 32), 'head_bn'))
  return _k_head(x, dropout=True)


KERAS = {
  'resnet': keras_resnet,
  'mobilenet_v2': keras_mobilenet_v2,
  'efficientnet': keras_efficientnet,
}


def keras_model(arch: str, seed: int = 0, dtype: str = 'float32', weights_from=None):
  """A functional Keras model and its SGD-with-momentum optimizer (built)."""
  keras.utils.set_random_seed(seed)
  previous = keras.config.dtype_policy()
  keras.config.set_dtype_policy(dtype)
  try:
    inputs = keras.Input((IMAGE, IMAGE, CHANNELS))
    model = keras.Model(inputs, KERAS[arch](inputs), name=arch)
  finally:
    keras.config.set_dtype_policy(previous)
  if weights_from is not None:
    for v, w in zip(model.variables, weights_from.variables):
      v.assign(tf.cast(w, v.dtype))
  optimizer = keras.optimizers.SGD(LEARNING_RATE, momentum=MOMENTUM)
  optimizer.build(model.trainable_variables)
  return model, optimizer


def keras_train_step(model, optimizer, annotate=None):
  loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

  @tf.function
  def train_step(images, labels):
    if annotate is not None:
      images = annotate(images)
    with tf.GradientTape() as tape:
      logits = model(images, training=True)
      loss = loss_fn(labels, logits)
    grads = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(grads, model.trainable_variables))
    return logits, loss

  return train_step


def keras_predict(model, annotate=None):
  @tf.function
  def predict(images):
    if annotate is not None:
      images = annotate(images)
    return model(images, training=False)

  return predict


# --- layouts -----------------------------------------------------------------------------
LAYOUTS = {
  'batch': ((8,), ('b',), ('b', None, None, None)),
  'height': ((8,), ('h',), (None, 'h', None, None)),
  'height_width': ((4, 2), ('h', 'w'), (None, 'h', 'w', None)),
  'batch_height': ((2, 4), ('b', 'h'), ('b', 'h', None, None)),
}


def layout(name: str):
  """(mesh, annotate) for a layout of the images over 8 devices."""
  shape, axes, spec = LAYOUTS[name]
  mesh = tg.Mesh.create(shape, axes)
  return mesh, lambda images: tg.shard(images, mesh, tg.P(*spec))
