"""Differential fuzzing of Keras 3 models under `keras.distribution`, partitioned vs plain Keras.

The program fuzzer (`fuzz`) draws TF programs; this one draws what a Keras user writes: a
functional model of 2 to 8 layers (Dense, EinsumDense, Conv1D/Conv2D with strides and
padding, pooling, BatchNormalization, LayerNormalization, MultiHeadAttention,
GroupQueryAttention, Embedding, Dropout with a seed, residual adds, a layer called twice),
a `ModelParallel` over a 1-D, 2-D or 3-D `DeviceMesh` of the 8 devices (sometimes in another
device order) with a random `LayoutMap` (exact paths and regexes, layer '/output' entries,
dims split unevenly and dims smaller than their shard count), and a workflow (`fit` with
`steps_per_execution`, `set_weights` between fits, `evaluate`, `predict` with an uneven last
batch, a checkpoint written, trained past and restored).

A model is data (`Case`); `render` prints it as Python (a `build_<tag>()` returning the
model function, the distribution function, the data and the workflow) and that text is what
runs (`run`), so a printed case reproduces exactly. `run` executes the workflow on the model
built under the distribution (tf_gspmd.keras.enable(), partitioned) and on the same model
built plainly (same seed: the same starting weights), recording after every step the history,
evaluation, predictions, weights, variables and optimizer state, and compares the records by
the oracle; where float32 is ill-conditioned (BatchNorm in training, Adam's first steps) the
float64 rule decides against the same workflow run plainly in float64 from the same values
(`testing.float64`). A ValueError raised in tf_gspmd is a refusal, any other exception a
crash, a failing plain run 'invalid' (a fuzzer bug). `shrink` cuts a failing case (workflow
steps, layout entries, layers, the optimizer, device order) while it fails the same way and
`test_case` prints it as a pytest test. CLI:

  python -m tf_gspmd.testing.keras_fuzz --models N --seed S [--start I] [--out DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import tempfile
import time
import warnings
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from tf_gspmd.testing import fuzz
from tf_gspmd.testing.fuzz import Outcome, _error_text, _further, _further_from_float64, _record

__all__ = [
  'Case',
  'Layer',
  'check',
  'generate',
  'judge',
  'load',
  'render',
  'run',
  'shrink',
  'test_case',
]

MESHES = (
  ((8,), ('data',)),
  ((2, 4), ('data', 'model')),
  ((4, 2), ('data', 'model')),
  ((2, 2, 2), ('data', 'model', 'seq')),
)
DIMS = (1, 2, 3, 3, 4, 4, 5, 6, 7, 8, 8, 12)
BATCH = 16
SAMPLES = 32  # fit and evaluate: two batches
PREDICT_SAMPLES = 40  # predict: an uneven last batch of 8
MAX_ELEMENTS = 512  # per sample, per activation: models stay small enough to run in seconds


@dataclasses.dataclass(frozen=True)
class Layer:
  """One layer call. `kind` names the Keras class (`LAYER_CLASSES`); `args` its keyword arguments
  (positional ones under integer keys); `inputs` the tensors it reads ('x0' is the model's
  input); `reuse` the earlier layer this call applies again ('' for a new layer)."""

  name: str
  kind: str
  inputs: Tuple[str, ...]
  args: Tuple[Tuple[Any, Any], ...] = ()
  reuse: str = ''


@dataclasses.dataclass(frozen=True)
class Case:
  seed: int
  index: int
  input_shape: Tuple[int, ...]
  vocab: int  # > 0: the input is int32 token ids in [0, vocab)
  layers: Tuple[Layer, ...]
  output: str  # the tensor the model returns
  mesh_shape: Tuple[int, ...]
  axes: Tuple[str, ...]
  devices: Tuple[int, ...]
  layout: Tuple[Tuple[str, tuple], ...]  # LayoutMap key -> layout, in insertion order
  optimizer: str  # 'sgd' or 'adam'
  steps_per_execution: int
  workflow: Tuple[tuple, ...]

  def label(self) -> str:
    mesh = 'x'.join(map(str, self.mesh_shape))
    order = '' if self.devices == tuple(range(8)) else '*'
    kinds = ','.join(layer.kind + ('*' if layer.reuse else '') for layer in self.layers)
    steps = ','.join(str(step[0]) for step in self.workflow)
    steps += f' spe {self.steps_per_execution}' if self.steps_per_execution > 1 else ''
    return (
      f'[{self.seed}:{self.index}] {kinds} mesh {mesh}{order} {len(self.layout)} layouts '
      f'{self.optimizer} [{steps}]'
    )


LAYER_CLASSES = {
  'dense': 'Dense',
  'einsum': 'EinsumDense',
  'conv1d': 'Conv1D',
  'conv2d': 'Conv2D',
  'maxpool1d': 'MaxPooling1D',
  'avgpool1d': 'AveragePooling1D',
  'maxpool2d': 'MaxPooling2D',
  'avgpool2d': 'AveragePooling2D',
  'batchnorm': 'BatchNormalization',
  'layernorm': 'LayerNormalization',
  'mha': 'MultiHeadAttention',
  'gqa': 'GroupQueryAttention',
  'embedding': 'Embedding',
  'dropout': 'Dropout',
  'add': 'Add',
  'flatten': 'Flatten',
  'gap1d': 'GlobalAveragePooling1D',
  'gap2d': 'GlobalAveragePooling2D',
}
_ATTENTION = ('mha', 'gqa')  # called as layer(x, x): self-attention


# --- shapes ---------------------------------------------------------------------------------
def _window(size: int, window: int, stride: int, padding: str) -> int:
  if padding == 'same':
    return -(-size // stride)
  return (size - window) // stride + 1


def output_shape(layer: Layer, shapes: Dict[str, Tuple[int, ...]]) -> Tuple[int, ...]:
  """The per-sample shape `layer`'s call gives (its inputs' shapes in `shapes`)."""
  shape = shapes[layer.inputs[0]]
  args = dict(layer.args)
  kind = layer.kind
  if kind in ('dense',):
    return shape[:-1] + (args[0],)
  if kind == 'einsum':
    return tuple(args['output_shape']) if len(shape) > 1 else (args['output_shape'],)
  if kind in ('conv1d', 'conv2d', 'maxpool1d', 'avgpool1d', 'maxpool2d', 'avgpool2d'):
    window = args[1] if kind.startswith('conv') else args[0]
    spatial = tuple(_window(size, window, args['strides'], args['padding']) for size in shape[:-1])
    return spatial + ((args[0],) if kind.startswith('conv') else shape[-1:])
  if kind == 'embedding':
    return shape + (args[1],)
  if kind == 'flatten':
    return (int(np.prod(shape)),)
  if kind in ('gap1d', 'gap2d'):
    return shape[-1:]
  return shape  # norms, attention, dropout, add


# --- drawing cases --------------------------------------------------------------------------
class _Drawer:
  def __init__(self, rng):
    self.rng = rng
    self.layers: List[Layer] = []
    self.shapes: Dict[str, Tuple[int, ...]] = {}
    self.current = 'x0'
    self.inputs_of: Dict[str, Tuple[int, ...]] = {}  # a new layer's input shape (for reuse)

  def dim(self, low: int = 1) -> int:
    return int(self.rng.choice([d for d in DIMS if d >= low]))

  def name(self) -> str:
    return f'l{len(self.layers) + 1}'

  def add(self, kind: str, args: dict, inputs=None, reuse: str = '') -> bool:
    inputs = tuple(inputs or (self.current,))
    layer = Layer(self.name(), kind, inputs, tuple(args.items()), reuse)
    try:
      shape = output_shape(layer, self.shapes)
    except (KeyError, IndexError):
      return False
    if min(shape) < 1 or int(np.prod(shape)) > MAX_ELEMENTS:
      return False
    self.layers.append(layer)
    self.shapes[layer.name] = shape
    if not reuse:
      self.inputs_of[layer.name] = self.shapes[inputs[0]]
    self.current = layer.name
    return True

  def step(self) -> bool:
    """Append one layer fitting the current tensor's rank (False when the draw does not fit)."""
    shape = self.shapes[self.current]
    rank = len(shape)
    choices = ['dense', 'batchnorm', 'layernorm', 'dropout', 'add', 'reuse']
    choices += {
      1: ['einsum'],
      2: ['einsum', 'conv1d', 'pool1d', 'mha', 'gqa', 'gap1d', 'flatten'],
    }.get(rank, ['conv2d', 'pool2d', 'gap2d', 'flatten'] if rank == 3 else [])
    kind = str(self.rng.choice(choices))
    return getattr(self, f'_draw_{kind}')(shape)

  def _draw_dense(self, shape):
    units = shape[-1] if self.rng.rand() < 0.3 else self.dim()  # square ones can be reused
    args = {0: units}
    if self.rng.rand() < 0.5:
      args['activation'] = str(self.rng.choice(['relu', 'tanh']))
    if self.rng.rand() < 0.2:
      args['use_bias'] = False
    return self.add('dense', args)

  def _draw_einsum(self, shape):
    units = self.dim()
    if len(shape) == 1:
      args = {0: 'ab,bc->ac', 'output_shape': units}
      bias = 'c'
    else:
      args = {0: 'abc,cd->abd', 'output_shape': (shape[0], units)}
      bias = 'd'
    if self.rng.rand() < 0.6:
      args['bias_axes'] = bias
    return self.add('einsum', args)

  def _windowed(self, kind, shape, filters):
    window = int(self.rng.choice([1, 2, 3]))
    args = {0: filters, 1: window} if filters else {0: window}
    args['strides'] = int(self.rng.choice([1, 1, 2, 3]))
    args['padding'] = str(self.rng.choice(['valid', 'same']))
    return self.add(kind, args)

  def _draw_conv1d(self, shape):
    return self._windowed('conv1d', shape, self.dim())

  def _draw_conv2d(self, shape):
    return self._windowed('conv2d', shape, self.dim())

  def _draw_pool1d(self, shape):
    return self._windowed(str(self.rng.choice(['maxpool1d', 'avgpool1d'])), shape, 0)

  def _draw_pool2d(self, shape):
    return self._windowed(str(self.rng.choice(['maxpool2d', 'avgpool2d'])), shape, 0)

  def _draw_batchnorm(self, shape):
    self._drop_offset_before()
    return self.add('batchnorm', {'momentum': 0.9})

  def _drop_offset_before(self) -> None:
    """The layer feeding a BatchNorm (through pools, flattens, dropouts) gets no offset: the
    BatchNorm removes it, so its gradient is 0 in exact arithmetic and all round-off, on which
    no two float32 runs agree (Adam turns it into steps of the learning rate). Practice drops
    a bias before a BatchNorm too."""
    name = self.current
    passing = ('maxpool1d', 'avgpool1d', 'maxpool2d', 'avgpool2d', 'gap1d', 'gap2d')
    while name != 'x0':
      k, layer = next((k, x) for k, x in enumerate(self.layers) if x.name == name)
      if layer.kind in passing + ('flatten', 'dropout'):
        name = layer.inputs[0]
        continue
      original = layer.reuse or layer.name
      k = next(k for k, x in enumerate(self.layers) if x.name == original)
      args = dict(self.layers[k].args)
      if layer.kind in ('dense', 'conv1d', 'conv2d', 'mha', 'gqa'):
        args['use_bias'] = False
      elif layer.kind == 'einsum':
        args.pop('bias_axes', None)
      elif layer.kind in ('layernorm', 'batchnorm'):
        args['center'] = False
      self.layers[k] = dataclasses.replace(self.layers[k], args=tuple(args.items()))
      return

  def _draw_layernorm(self, shape):
    # Over 1 feature its output is its offset and x - mean is round-off (times 1/sqrt(eps)):
    # all noise, which two float32 runs do not agree on (the program fuzzer's BatchNorm
    # normalizes 4 values or more for the same reason).
    return shape[-1] >= 3 and self.add('layernorm', {})

  def _draw_dropout(self, shape):
    return self.add(
      'dropout', {0: float(self.rng.choice([0.25, 0.5])), 'seed': int(self.rng.randint(100))}
    )

  def _draw_mha(self, shape):
    return self.add(
      'mha', {0: int(self.rng.choice([1, 2, 3, 4])), 1: self.dim()}, (self.current,) * 2
    )

  def _draw_gqa(self, shape):
    kv_heads = int(self.rng.choice([1, 2]))
    query_heads = kv_heads * int(self.rng.choice([1, 2, 3]))
    return self.add('gqa', {0: self.dim(), 1: query_heads, 2: kv_heads}, (self.current,) * 2)

  def _draw_gap1d(self, shape):
    return self.add('gap1d', {})

  def _draw_gap2d(self, shape):
    return self.add('gap2d', {})

  def _draw_flatten(self, shape):
    return self.add('flatten', {})

  def _draw_add(self, shape):
    same = [n for n, s in self.shapes.items() if s == shape and n != self.current]
    if not same:
      return False
    return self.add('add', {}, (self.current, str(self.rng.choice(same))))

  def _draw_reuse(self, shape):
    """Call an earlier dense or conv layer again: one set of weights, two uses."""
    fits = [
      layer.name
      for layer in self.layers
      if not layer.reuse
      and layer.kind in ('dense', 'conv1d', 'conv2d', 'einsum')
      and self.inputs_of[layer.name] == shape
    ]
    if not fits:
      return False
    name = str(self.rng.choice(fits))
    original = next(layer for layer in self.layers if layer.name == name)
    return self.add(original.kind, dict(original.args), reuse=name)


def _draw_input(drawer: _Drawer) -> Tuple[Tuple[int, ...], int]:
  rng = drawer.rng
  kind = str(rng.choice(['vector', 'sequence', 'image', 'tokens']))
  if kind == 'vector':
    shape: Tuple[int, ...] = (drawer.dim(2),)
  elif kind == 'sequence':
    shape = (drawer.dim(2), drawer.dim(2))
  elif kind == 'image':
    shape = (
      int(rng.choice([3, 4, 5, 6, 8])),
      int(rng.choice([3, 4, 5, 7])),
      int(rng.choice([1, 2, 3])),
    )
  else:
    shape = (drawer.dim(2),)
  drawer.shapes['x0'] = shape
  if kind != 'tokens':
    return shape, 0
  vocab = int(rng.choice([5, 7, 12, 16]))
  drawer.add('embedding', {0: vocab, 1: drawer.dim()})
  return shape, vocab


def _draw_workflow(rng) -> Tuple[tuple, ...]:
  steps: List[tuple] = [('fit',)]
  for _ in range(int(rng.randint(1, 4))):
    kind = str(rng.choice(['fit', 'set_weights', 'evaluate', 'predict', 'checkpoint']))
    if kind == 'set_weights':
      steps.append(('set_weights', int(rng.randint(1000))))
    else:
      steps.append((kind,))
  return tuple(steps)


def _draw_spec(rng, shape, axes, chance=0.45) -> tuple:
  free = list(axes)
  spec = []
  for _ in shape:
    if free and rng.rand() < chance:
      spec.append(free.pop(int(rng.randint(len(free)))))
    else:
      spec.append(None)
  return tuple(spec)


def _draw_layout(rng, case: Case) -> Tuple[Tuple[str, tuple], ...]:
  """Layouts for some of the model's variables and layer outputs."""
  entries: List[Tuple[str, tuple]] = []
  variables = variable_shapes(case)
  attention = [x.name for x in case.layers if x.kind in _ATTENTION and not x.reuse]
  by_regex = set()
  for name in attention:
    if rng.rand() < 0.5:  # one regex for q/k/v kernels: their heads dim over one axis
      by_regex.add(name)
      axis = str(rng.choice(case.axes))
      entries.append((f'{name}/(query|key|value)/kernel', (None, axis, None)))
  for path, shape in variables.items():
    if path.split('/')[0] in by_regex and path.split('/')[1] in ('query', 'key', 'value'):
      continue
    if 'seed_generator' in path or rng.rand() > 0.5:
      continue
    spec = _draw_spec(rng, shape, case.axes)
    if any(spec):
      entries.append((path, spec))
  shapes = shapes_of(case)
  for layer in case.layers:
    if rng.rand() < 0.12:
      entries.append(
        (f'{layer.name}/output', _draw_spec(rng, (0,) + shapes[layer.name], case.axes))
      )
  return tuple(entries)


def generate(seed: int, index: int, max_layers: int = 7) -> Case:
  """Case `index` of `seed`: the same pair always gives the same case."""
  case, rng = draft(seed, index, max_layers)
  return dataclasses.replace(case, layout=_draw_layout(rng, case))


def draft(seed: int, index: int, max_layers: int = 7):
  """(case `index` of `seed` before its layout is drawn, the rng that draws it): the model,
  mesh and workflow, drawn without building anything."""
  rng = np.random.RandomState((seed * 1_000_003 + index) % 2**32)
  drawer = _Drawer(rng)
  input_shape, vocab = _draw_input(drawer)
  wanted = int(rng.randint(1, max_layers))
  tries = 0
  while len(drawer.layers) < wanted and tries < 50:
    drawer.step()
    tries += 1
  drawer.add('dense', {0: int(rng.choice([1, 2, 3, 5]))})  # the head the loss reads
  mesh_shape, axes = MESHES[int(rng.randint(len(MESHES)))]
  devices = tuple(range(8)) if rng.rand() < 0.75 else tuple(int(d) for d in rng.permutation(8))
  case = Case(
    seed,
    index,
    input_shape,
    vocab,
    tuple(drawer.layers),
    drawer.current,
    mesh_shape,
    axes,
    devices,
    (),
    str(rng.choice(['sgd', 'sgd', 'adam'])),
    int(rng.choice([1, 1, 2, 3])),
    _draw_workflow(rng),
  )
  return case, rng


def shapes_of(case: Case) -> Dict[str, Tuple[int, ...]]:
  shapes = {'x0': case.input_shape}
  for layer in case.layers:
    shapes[layer.name] = output_shape(layer, shapes)
  return shapes


_VARIABLE_SHAPES: Dict[tuple, Dict[str, tuple]] = {}


def variable_shapes(case: Case) -> Dict[str, tuple]:
  """Path -> shape of the case's model variables (built plainly once per model)."""
  key = (case.input_shape, case.vocab, case.layers, case.output)
  if key not in _VARIABLE_SHAPES:
    model = load(render(case))()[0]()
    _VARIABLE_SHAPES[key] = {v.path: tuple(v.shape) for v in model.variables}
  return _VARIABLE_SHAPES[key]


# --- printing -------------------------------------------------------------------------------
def _call_args(args) -> str:
  positional = [repr(v) for k, v in args if isinstance(k, int)]
  named = [f'{k}={v!r}' for k, v in args if not isinstance(k, int)]
  return ', '.join(positional + named)


def _layer_lines(case: Case) -> List[str]:
  lines = []
  for layer in case.layers:
    if not layer.reuse:
      args = _call_args(layer.args + (('name', layer.name),))
      lines.append(f'    {layer.name} = keras.layers.{LAYER_CLASSES[layer.kind]}({args})')
    inputs = [f't_{n}' if n != 'x0' else 'x0' for n in layer.inputs]
    called = f'[{", ".join(inputs)}]' if layer.kind == 'add' else ', '.join(inputs)
    lines.append(f'    t_{layer.name} = {layer.reuse or layer.name}({called})')
  return lines


def render(case: Case, name: str = 'build') -> str:
  """`case` as Python: `{name}() -> (model, distribution, data, workflow)`: `model()` builds
  and compiles the model (seeded: the same starting weights each time), `distribution()`
  makes the ModelParallel."""
  dtype = ", dtype='int32'" if case.vocab else ''
  optimizer = (
    'keras.optimizers.SGD(0.05, momentum=0.9)'
    if case.optimizer == 'sgd'
    else 'keras.optimizers.Adam(0.01)'
  )
  lines = [
    f'def {name}():',
    f'  """{case.label()}"""',
    '',
    '  def model(jit_compile=False):',
    f'    keras.utils.set_random_seed({case.seed % 2**31 + case.index})',
    f"    x0 = keras.Input({case.input_shape!r}{dtype}, name='x0')",
    *_layer_lines(case),
    f"    model = keras.Model(x0, t_{case.output}, name='m')",
    f"    model.compile(optimizer={optimizer}, loss='mse', "
    f'steps_per_execution={case.steps_per_execution}, jit_compile=jit_compile)',
    '    return model',
    '',
    '  def distribution():',
    '    devices = keras.distribution.list_devices()',
    f'    devices = [devices[i] for i in {list(case.devices)}]',
    f'    mesh = keras.distribution.DeviceMesh({case.mesh_shape}, {list(case.axes)}, devices)',
    '    layout_map = keras.distribution.LayoutMap(mesh)',
    *[f'    layout_map[{key!r}] = {spec!r}' for key, spec in case.layout],
    "    return keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name='data')",
    '',
    f'  data = dict(seed={case.seed % 2**31 + case.index}, vocab={case.vocab})',
    f'  workflow = {case.workflow!r}',
    '  return model, distribution, data, workflow',
  ]
  return '\n'.join(lines) + '\n'


HEADER = 'import keras\n\nfrom tf_gspmd.testing import keras_fuzz\n'


def load(source: str, name: str = 'build') -> Callable:
  """The `build` function a rendered case defines."""
  namespace: Dict[str, Any] = {}
  exec(compile(HEADER + source, f'<keras fuzz case {name}>', 'exec'), namespace)
  return namespace[name]


# --- running a workflow ---------------------------------------------------------------------
def make_data(model, data: dict) -> Tuple[np.ndarray, np.ndarray]:
  """PREDICT_SAMPLES inputs and targets for `model` (fit and evaluate use the first SAMPLES)."""
  rng = np.random.RandomState(data['seed'])
  shape = (PREDICT_SAMPLES,) + tuple(model.input_shape[1:])
  if data['vocab']:
    x = rng.randint(0, data['vocab'], shape).astype(np.int32)
  else:
    x = rng.randn(*shape).astype(np.float32)
  y = rng.randn(PREDICT_SAMPLES, *model.output_shape[1:]).astype(np.float32)
  return x, y


def fresh_weights(model, seed: int) -> List[np.ndarray]:
  """Values for `model.set_weights` drawn from `seed` and the weights' paths and shapes only
  (the same for every run of a case); variances stay positive."""
  rng = np.random.RandomState(seed)
  values = []
  for variable in model.weights:
    shape, path = tuple(variable.shape), variable.path
    if path.endswith('moving_variance'):
      value = rng.uniform(0.5, 1.5, shape)
    elif path.endswith('gamma'):
      value = 1 + 0.1 * rng.randn(*shape)
    else:
      value = 0.3 * rng.randn(*shape)
    values.append(value.astype(np.float32))
  return values


def _state(model, floating) -> dict:
  """Every model and optimizer variable, by path (optimizer slots by place: Keras numbers
  optimizers per instance)."""
  state = {
    v.path: _cast(np.asarray(w), floating) for v, w in zip(model.weights, model.get_weights())
  }
  for i, v in enumerate(model.variables):  # seed generators' states: numbered per instance
    if v.path not in state:
      state[f'variables[{i}]'] = _cast(v.numpy(), floating)
  if model.optimizer is not None and model.optimizer.built:
    for i, v in enumerate(model.optimizer.variables):
      state[f'optimizer[{i}]'] = _cast(v.numpy(), floating)
  return state


def _cast(value, floating):
  value = np.asarray(value)
  return value.astype(floating) if value.dtype.kind == 'f' else value


class _Run:
  """One run of a workflow: a model, its data and where its checkpoints go."""

  def __init__(self, model, data, directory, floating):
    self.model = model
    self.x, self.y = make_data(model, data)
    self.directory = directory
    self.floating = floating
    self.records: List[Tuple[str, Any]] = [('built', _state(model, floating))]

  def fit(self):
    n = SAMPLES
    history = self.model.fit(
      self.x[:n], self.y[:n], batch_size=BATCH, epochs=1, shuffle=False, verbose=0
    )
    return {'loss': _cast(history.history['loss'], self.floating)}

  def step(self, k: int, step: tuple) -> None:
    kind = step[0]
    if kind == 'fit':
      result = self.fit()
    elif kind == 'set_weights':
      values = fresh_weights(self.model, step[1])
      self.model.set_weights([v.astype(self.floating) for v in values])
      result = {}
    elif kind == 'evaluate':
      loss = self.model.evaluate(self.x[:SAMPLES], self.y[:SAMPLES], batch_size=BATCH, verbose=0)
      result = {'loss': _cast(loss, self.floating)}
    elif kind == 'predict':
      result = {'predict': self.model.predict(self.x, batch_size=BATCH, verbose=0)}
    else:
      result = self.checkpoint(k)
    result['state'] = _state(self.model, self.floating)
    self.records.append((f'{k}:{kind}', result))

  def checkpoint(self, k: int) -> dict:
    """Write a checkpoint, fit past it, restore it: the restored values are what is left."""
    import tensorflow as tf

    checkpoint = tf.train.Checkpoint(model=self.model, optimizer=self.model.optimizer)
    path = checkpoint.write(os.path.join(self.directory, f'ckpt{k}'))
    moved = self.fit()
    tf.train.Checkpoint(model=self.model, optimizer=self.model.optimizer).read(
      path
    ).assert_consumed()
    return {'fit past the checkpoint': moved}


def execute(build, mode: str, initial: Optional[List[np.ndarray]] = None):
  """The workflow's records run `mode`: 'partitioned' (under the case's distribution),
  'plain', 'jit' (plain, compiled by XLA on one device) or 'float64' (plain, in float64,
  from `initial`: the plain build's variables)."""
  import keras

  from tf_gspmd import keras as tg_keras
  from tf_gspmd.testing.float64 import float64_policy

  model_fn, distribution_fn, data, workflow = build()
  floating = np.float64 if mode == 'float64' else np.float32
  with tempfile.TemporaryDirectory() as directory:
    if mode == 'partitioned':
      tg_keras.enable()
      try:
        distribution = distribution_fn()
        with distribution.scope():
          model = model_fn()
          records = _steps(model, data, workflow, directory, floating)
        _check_layouts(model, distribution, tg_keras.shard_layouts(model))
        return records
      finally:
        keras.distribution.set_distribution(None)
        tg_keras.disable()
    if mode in ('plain', 'jit'):
      return _steps(model_fn(jit_compile=mode == 'jit'), data, workflow, directory, floating)
    with float64_policy():
      model = model_fn()
      for variable, value in zip(model.variables, initial):
        variable.assign(np.asarray(value, variable.dtype))
      return _steps(model, data, workflow, directory, floating)


def _check_layouts(model, distribution, held) -> None:
  """Each model variable's shards are split as its layout says: a layout quietly dropped
  (the variable replicated) would still give the plain results."""
  for variable in model.variables:
    if variable.path not in held:
      continue
    want = tuple(distribution.get_variable_layout(variable).axes)
    got = tuple(held[variable.path][0])
    if got != want:
      raise AssertionError(
        f'{variable.path} {tuple(variable.shape)}: its layout is {want}, its shards are {got}'
      )


def _steps(model, data, workflow, directory, floating):
  run = _Run(model, data, directory, floating)
  for k, step in enumerate(workflow):
    run.step(k, step)
  return run.records


def _initial(build) -> List[np.ndarray]:
  model_fn = build()[0]
  return [v.numpy() for v in model_fn().variables]


# --- judging --------------------------------------------------------------------------------
def _records_tree(records) -> dict:
  return {label: value for label, value in records}


def compare(build, got, want) -> Optional[str]:
  """None when the partitioned records are the plain ones by the oracle; '' when they pass
  only by the float64 rule; else why not."""
  from tf_gspmd.testing.oracle import assert_close

  got, want = _records_tree(got), _records_tree(want)
  try:
    assert_close(got, want, 'workflow')
    return None
  except AssertionError as error:
    first = str(error)
  exact = _records_tree(execute(build, 'float64', _initial(build)))
  why = _further_from_float64(got, want, exact)
  if why:
    # A second float32 witness, as the program fuzzer takes (fuzz.compare): the plain model
    # compiled by XLA sums in other orders. Where the exact value is all cancellation (a
    # LayerNorm's offset before a BatchNorm: its gradient is 0), the two float32 runs are
    # rounding noise of one size, and each tensor is measured against the plain run further
    # from float64.
    try:
      witness = _records_tree(execute(build, 'jit'))
    except Exception:  # noqa: BLE001  (an op XLA cannot compile: no witness)
      witness = None
    if witness is not None:
      why = _further_from_float64(got, _further(want, witness, exact), exact)
  return '' if not why else f'{first}\n{why}'


def judge(build) -> Outcome:
  """Run `build`'s case plainly and partitioned and say how it went."""
  return fuzz.outcome_of(
    lambda: execute(build, 'plain'),
    lambda: execute(build, 'partitioned'),
    lambda got, want: _compare_or_say(build, got, want),
  )


def _compare_or_say(build, got, want) -> Optional[str]:
  try:
    return compare(build, got, want)
  except Exception as error:  # noqa: BLE001  (the float64 or XLA run itself failed)
    return f'the float64 run failed: {_error_text(error)}'


def run(case: Case) -> Outcome:
  return judge(load(render(case)))


def check(build) -> None:
  """For tests: raise unless `build`'s case runs partitioned as it runs plainly."""
  want = execute(build, 'plain')
  why = compare(build, execute(build, 'partitioned'), want)
  if why:
    raise AssertionError(why)


# --- shrinking ------------------------------------------------------------------------------
def shrink(
  case: Case,
  fails: Callable[[Case], bool],
  budget: int = 60,
  log: Callable[[str], None] = lambda _: None,
  seconds: float = math.inf,
) -> Case:
  """The smallest case found (greedily) that still `fails` (the program fuzzer's shrinker on
  this fuzzer's `candidates`)."""
  return fuzz.shrink(case, fails, budget, log, seconds, candidates, is_valid)


def candidates(case: Case):
  """Smaller cases, the biggest cuts first."""
  for k in range(len(case.workflow) - 1, 0, -1):
    yield dataclasses.replace(case, workflow=case.workflow[:k])
  for k in range(len(case.workflow)):
    if len(case.workflow) > 1:
      yield dataclasses.replace(case, workflow=case.workflow[:k] + case.workflow[k + 1 :])
  for k in range(len(case.layout)):
    yield dataclasses.replace(case, layout=case.layout[:k] + case.layout[k + 1 :])
  for layer in reversed(case.layers[:-1]):
    for source in layer.inputs:
      yield _bypass(case, layer, source)
  if case.steps_per_execution > 1:
    yield dataclasses.replace(case, steps_per_execution=1)
  if case.optimizer != 'sgd':
    yield dataclasses.replace(case, optimizer='sgd')
  if case.devices != tuple(range(8)):
    yield dataclasses.replace(case, devices=tuple(range(8)))


def _bypass(case: Case, layer: Layer, source: str) -> Case:
  """`layer` removed, its readers reading `source` instead (valid when the shapes agree);
  its layout entries go with it."""
  layers = tuple(
    dataclasses.replace(x, inputs=tuple(source if n == layer.name else n for n in x.inputs))
    for x in case.layers
    if x is not layer and x.reuse != layer.name
  )
  layout = tuple((k, v) for k, v in case.layout if k.split('/')[0] != layer.name)
  output = source if case.output == layer.name else case.output
  return dataclasses.replace(case, layers=layers, layout=layout, output=output)


def is_valid(case: Case) -> bool:
  """Every layer's input exists with a shape it takes, and every layout names a variable or
  layer output of the rank it gives."""
  try:
    shapes = shapes_of(case)
  except (KeyError, IndexError, TypeError):
    return False
  names = {layer.name for layer in case.layers if not layer.reuse}
  if any(layer.reuse and layer.reuse not in names for layer in case.layers):
    return False
  if any(min(s) < 1 for s in shapes.values()):
    return False
  try:
    variables = variable_shapes(case)
  except Exception:  # noqa: BLE001  (Keras refuses the model: a shape a layer cannot take)
    return False
  for key, spec in case.layout:
    if key.endswith('/output'):
      layer = key.split('/')[0]
      if layer not in shapes or len(shapes[layer]) + 1 != len(spec):
        return False
    elif '(' not in key and (key not in variables or len(variables[key]) != len(spec)):
      return False
  return True


def failing_like(outcome: Outcome) -> Callable[[Case], bool]:
  def fails(candidate: Case) -> bool:
    return run(candidate).same_failure(outcome)

  return fails


def test_case(case: Case, outcome: Outcome) -> str:
  """A pytest module reproducing `case`'s failure."""
  tag = f'{case.seed}_{case.index}'
  why = '\n'.join(outcome.message.splitlines()[:2]) if outcome.message else outcome.status
  return (
    f'"""Shrunk by tf_gspmd.testing.keras_fuzz (seed {case.seed}, model {case.index}): '
    f'{outcome.status}.\n\n{why}\n"""\n'
    + HEADER
    + '\n\n'
    + render(case, f'build_{tag}')
    + f'\n\ndef test_keras_fuzz_{tag}():\n  keras_fuzz.check(build_{tag})\n'
  )


# --- the campaign ---------------------------------------------------------------------------
class Tally(fuzz.Tally):
  """The program fuzzer's tally (its `programs` are models here), in the Keras fuzzer's words."""

  def line(self, seconds: float) -> str:
    c = self.counts
    return (
      f'models run {self.programs}, passed {c["pass"]} (float64 rule {c["float64"]}), '
      f'mismatches {c["mismatch"]}, crashes {c["crash"]}, refusals {c["refusal"]}, '
      f'invalid {c["invalid"]}; {seconds:.1f} s ({self.programs / max(seconds, 1e-9):.3f} models/s)'
    )


def campaign(
  seed: int,
  models: int,
  start: int = 0,
  out: str = '',
  shrink_budget: int = 40,
  shrink_seconds: float = 600,
  echo=print,
) -> Tally:
  """Run models start..start+models-1 of `seed`; shrink and write each failure."""
  tally = Tally()
  began = time.time()
  for index in range(start, start + models):
    case = generate(seed, index)
    outcome = run(case)
    _record(tally, case, 'tf', outcome, echo)  # the program fuzzer's counts and line
    tally.programs += 1
    if outcome.poisoned:
      echo(f'POISONED: a collective failed; resume with --start {index + 1}')
      break
    if outcome.status in ('mismatch', 'crash', 'invalid'):
      small = case
      if outcome.status != 'invalid' and shrink_budget:
        small = shrink(case, failing_like(outcome), shrink_budget, echo, shrink_seconds)
      name = f'test_keras_fuzz_case_{case.seed}_{case.index}.py'
      fuzz.write_case(test_case(small, outcome), out, name, echo)
  echo(tally.line(time.time() - began))
  for reason, n in tally.refusals.most_common():
    echo(f'  refusal x{n}: {reason}')
  return tally


def quiet() -> None:
  """The warnings every fuzz model would print (Keras' and tf_gspmd's notes on ops without
  rules), off: the campaign's lines are its verdicts."""
  warnings.filterwarnings('ignore', message='tf_gspmd propagation: no sharding rule')
  warnings.filterwarnings('ignore', module='keras')
  import absl.logging

  absl.logging.set_verbosity(absl.logging.ERROR)


def main(argv: Optional[Sequence[str]] = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--models', type=int, default=50)
  parser.add_argument('--seed', type=int, default=0)
  parser.add_argument('--start', type=int, default=0, help='first model index (to resume)')
  parser.add_argument('--out', default='', help='directory for shrunk test cases')
  parser.add_argument('--shrink-budget', type=int, default=40, help='candidates per failure')
  parser.add_argument('--shrink-seconds', type=float, default=600, help='time per failure')
  args = parser.parse_args(argv)
  os.environ.setdefault('KERAS_BACKEND', 'tensorflow')
  from tf_gspmd.testing.op_sweep import configure_devices

  configure_devices(8)
  quiet()
  tally = campaign(
    args.seed,
    args.models,
    args.start,
    args.out,
    args.shrink_budget,
    args.shrink_seconds,
    echo=lambda s: print(s, flush=True),
  )
  return 1 if tally.counts['mismatch'] or tally.counts['crash'] else 0


if __name__ == '__main__':
  os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
  sys.exit(main())
