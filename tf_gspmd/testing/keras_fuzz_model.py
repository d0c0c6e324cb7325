"""A Keras fuzz case as data: what `keras_fuzz` draws (layers, their shapes, a layout map
over a mesh of the 8 devices, a workflow) and how a case prints as runnable Python.

`generate(seed, index)` draws a `Case`; `render` prints it as a `build()` function and `load`
runs that text back, so a printed case reproduces exactly. Running, judging and shrinking
cases is `keras_fuzz`'s (as `fuzz_program` is to `fuzz`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, List, Tuple

import numpy as np

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
    if filters and window == 1:
      # TF 2.21's oneDNN filter gradient of a strided 1x1 convolution corrupts the heap, plain
      # Keras too (tests/test_fuzz_regressions.py 1414_917): drawn, then not used.
      args['strides'] = 1
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
