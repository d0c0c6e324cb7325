"""`tf_gspmd.keras.auto_layout`: a Keras model's `LayoutMap`, chosen by `tg.auto_shard`.

`auto_layout(model, mesh, memory_budget=..., x=..., y=...)` runs the
`tg.auto_shard` search on Keras' own train step of the compiled model
(`model.train_step`: its loss, metrics and optimizer, the step `fit` runs) over
one batch shaped like `x` and `y`, and returns the choice in Keras' terms:

* `layout_map`: a `keras.distribution.LayoutMap` on a `DeviceMesh`, one key a
  model variable, anchored and escaped (`^block_0/attention/query/kernel$`), so
  each key matches exactly that variable whether Keras matches keys with
  `re.fullmatch` or `re.search` (checked: a key matching two variables, or none,
  is an error, never a map). Optimizer slots get no key: Keras gives each slot its
  variable's layout.
* `batch_dim_name`: the mesh axis the batch is split over (ModelParallel splits it
  over one axis, always: the search tries each axis that divides the batch, and
  splits each variable dim over one axis at most, as a `TensorLayout` can say);
* `distribution()`: `keras.distribution.ModelParallel(layout_map=...,
  batch_dim_name=...)`, to `fit` under unchanged (on TF after
  `tf_gspmd.keras.enable()`; being plain Keras, on JAX as well);
* `report()`: auto_shard's report (what was chosen, the runner-up, each group's
  best alternative, in Keras paths), the keys, and, given `baseline=` (a
  shipped `LayoutMap` or `ModelParallel`), that map priced the same way beside
  the choice. When the baseline is cheaper than the search's end (both planned
  with `tg.plan`) the baseline's layout is returned: the result is never worse.

The model is only traced, never run: its optimizer, when not built yet, stays
unbuilt (a copy made from its config is traced instead), so the same model can
then be fit under `distribution()` and its slots are made with their layouts.

>>> chosen = tf_gspmd.keras.auto_layout(model, mesh, memory_budget=2**20, x=x, y=y) # doctest: +SKIP
>>> print(chosen.report())                                                        # doctest: +SKIP
>>> with chosen.distribution().scope():                                           # doctest: +SKIP
...   model.fit(x, y, batch_size=16)
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Dict, List, Optional, Tuple

import keras
import numpy as np
import tensorflow as tf

from tf_gspmd.keras import translate
from tf_gspmd.keras.distribution_lib import all_variables
from tf_gspmd.keras.hooks import backing
from tf_gspmd.mesh import Mesh
from tf_gspmd.sharding import P

if TYPE_CHECKING:  # auto_shard imports the Keras layer (its LayoutMap): imported when called
  from tf_gspmd.auto_shard import AutoShardResult


_NO_LIMIT = 2**62  # bytes: the budget a baseline is priced under


class AutoLayout:
  """What `auto_layout` chose for a Keras model: the LayoutMap, the batch axis, why."""

  def __init__(
    self,
    model,
    device_mesh,
    result: AutoShardResult,
    specs: Dict[str, P],
    batch_dim_name: str,
    baseline: Optional[AutoShardResult] = None,
    kept_baseline: bool = False,
  ):
    self.model_name, self.device_mesh, self.result = model.name, device_mesh, result
    self.specs, self.batch_dim_name = specs, batch_dim_name
    self.baseline, self.kept_baseline = baseline, kept_baseline
    self.layout_map = keras.distribution.LayoutMap(device_mesh)
    for path, spec in specs.items():
      self.layout_map[key_of(path)] = tuple(spec)

  @property
  def chosen(self) -> AutoShardResult:
    """The search whose layout this is (the baseline's when it was kept)."""
    return self.baseline if self.kept_baseline else self.result

  @property
  def cost(self) -> float:
    """Predicted seconds per step of the returned layout (planned with tg.plan)."""
    return self.chosen.best.cost

  @property
  def memory(self) -> int:
    """Per-device bytes of the returned layout (parameters + optimizer + activation peak)."""
    return self.chosen.best.memory

  def distribution(self):
    """`keras.distribution.ModelParallel` of this layout (a new one each call)."""
    return keras.distribution.ModelParallel(
      layout_map=self.layout_map, batch_dim_name=self.batch_dim_name
    )

  def report(self) -> str:
    return _format_report(self)

  def __str__(self) -> str:
    return self.report()


def key_of(path: str) -> str:
  """The LayoutMap key matching variable path `path` and nothing else."""
  return f'^{re.escape(path)}$'


# --- the entry point -----------------------------------------------------------------------------
def auto_layout(
  model,
  mesh,
  memory_budget: int,
  x,
  y=None,
  *,
  batch_size: int = 32,
  batch_dim_name: Optional[str] = None,
  baseline=None,
  search: str = 'descent',
) -> AutoLayout:
  """A `keras.distribution.LayoutMap` for `model` chosen by `tg.auto_shard` (module doc).

  `model`: a compiled Keras 3 model (its loss and optimizer are the step's).
  `mesh`: a `keras.distribution.DeviceMesh` or a `tf_gspmd.Mesh`.
  `memory_budget`: bytes one device may hold (parameters + optimizer state +
  activation peak). `x`, `y`: training data as `fit` takes it (arrays, or dicts
  / lists of arrays, or a batched `tf.data.Dataset` of (x, y) as `x`; only shapes
  and dtypes are read), batched by `batch_size` rows as `fit` would.
  `batch_dim_name`: the batch's axis (default: searched).
  `baseline`: a LayoutMap or ModelParallel to price beside the choice (kept when
  cheaper). Raises ValueError when no layout fits the budget.
  """
  from tf_gspmd.auto_shard.search import auto_shard

  _check_keys(model, [v.path for v in model.variables])  # before the search: it fails fast
  device_mesh, tg_mesh = _meshes(mesh)
  batch = _batch_specs(x, y, batch_size)
  splits = [(a,) for a in ([batch_dim_name] if batch_dim_name else tg_mesh.axis_names)]
  with _traced_optimizer(model):
    step = keras_train_step(model, batch)
    paths = _step_paths(model)
    # Every group searched (none left to propagation): a propagated layout could split a
    # dim over two axes, which a TensorLayout cannot say.
    result = auto_shard(
      step,
      *tf.nest.flatten(batch),
      mesh=tg_mesh,
      memory_budget=memory_budget,
      search=search,
      min_group_fraction=0.0,
      axes_per_dim=1,
      batch_splits=splits,
    )
    priced = None
    if baseline is not None:  # every variable fixed: one layout, planned
      layouts, axis = _baseline_layouts(baseline, model, tg_mesh)
      priced = auto_shard(
        step,
        *tf.nest.flatten(batch),
        mesh=tg_mesh,
        memory_budget=_NO_LIMIT,  # priced, not refused: a baseline over the budget is reported
        fixed=layouts,
        batch_splits=[(axis,)],
      )
  kept = priced is not None and priced.best.key(memory_budget) < result.best.key(memory_budget)
  chosen = priced if kept else result
  specs = _model_specs(model, chosen, paths)
  _check_keys(model, specs)
  axes = chosen.best.choice[-1]
  return AutoLayout(model, device_mesh, result, specs, axes[0], priced, kept)


def keras_train_step(model, batch):
  """Keras' own train step of `model` (`model.train_step`: its loss, metrics, optimizer) as a
  tf.function of the flat tensors of `batch` (a structure of TensorSpecs: (x, y))."""

  def train_step(*flat):
    return model.train_step(tf.nest.pack_sequence_as(batch, list(flat)))

  train_step.__name__ = f'{model.name}_train_step'
  return tf.function(train_step)


# --- the pieces ----------------------------------------------------------------------------------
def _meshes(mesh) -> Tuple[object, Mesh]:
  """(DeviceMesh, tf_gspmd Mesh) of a DeviceMesh or a tf_gspmd Mesh."""
  if isinstance(mesh, keras.distribution.DeviceMesh):
    return mesh, translate.to_mesh(mesh)
  if not isinstance(mesh, Mesh):
    raise TypeError(
      f'auto_layout: mesh must be a keras.distribution.DeviceMesh or a tf_gspmd.Mesh, '
      f'got {type(mesh).__name__}.'
    )
  devices = keras.distribution.list_devices()
  ids = np.asarray(mesh.device_ids)
  device_mesh = keras.distribution.DeviceMesh(
    tuple(mesh.shape.values()), list(mesh.axis_names), np.asarray(devices)[ids]
  )
  return device_mesh, mesh


def _batch_specs(x, y, batch_size: int):
  """(x, y) as TensorSpecs of one batch of `fit`: `batch_size` rows (all, when fewer);
  floating arrays as Keras' floatx (Keras' data adapters cast them). A batched
  `tf.data.Dataset` `x` gives its first element's shapes (fit ignores `batch_size` then)."""
  if isinstance(x, tf.data.Dataset):
    first = next(iter(x.take(1)))
    return tf.nest.map_structure(lambda t: tf.TensorSpec(t.shape, t.dtype), first)
  data = (x,) if y is None else (x, y)
  flat = tf.nest.flatten(data)
  if not flat:
    raise ValueError('auto_layout: x holds no arrays.')
  rows = int(np.shape(flat[0])[0])
  batch = min(batch_size, rows)

  def spec(array):
    dtype = tf.as_dtype(getattr(array, 'dtype', np.asarray(array).dtype))
    dtype = tf.as_dtype(keras.config.floatx()) if dtype.is_floating else dtype
    return tf.TensorSpec((batch,) + tuple(np.shape(array)[1:]), dtype)

  return tf.nest.map_structure(spec, data)


class _traced_optimizer:
  """The optimizer the step is traced with: the model's own when built, else a copy from its
  config (the model's stays unbuilt, so `fit` under the distribution makes its slots with
  their variables' layouts); the model's is put back after."""

  def __init__(self, model):
    optimizer = getattr(model, 'optimizer', None)
    if optimizer is None or getattr(model, 'loss', None) is None and not model.losses:
      raise ValueError(
        f'auto_layout: compile {model.name} first (model.compile(optimizer=..., loss=...)): '
        "the search prices Keras' own train step, its loss and optimizer."
      )
    if keras.distribution.distribution() is not None:
      raise ValueError(
        f'auto_layout: a keras.distribution is set ({keras.distribution.distribution()}); '
        'call auto_layout outside any distribution scope, on a model built outside one (its '
        "variables' layouts would constrain the search), then fit under the result's."
      )
    if not model.built:
      raise ValueError(
        f'auto_layout: {model.name} is not built; build it (model.build(shape), or call it '
        'on a batch) so that its variables exist.'
      )
    self.model, self.own = model, optimizer
    self.copy = (
      optimizer if optimizer.built else type(optimizer).from_config(optimizer.get_config())
    )

  def __enter__(self):
    self.model.optimizer = self.copy
    if not self.copy.built:  # before tracing: no variable is made inside the step
      self.copy.build(self.model.trainable_variables)
    return self.copy

  def __exit__(self, *exc):
    self.model.optimizer = self.own


def _step_name(variable) -> str:
  """auto_shard's name of a Keras variable: its tf.Variable's (as `groups.variables_in` reads
  the captured step's variables)."""
  held = backing(variable)
  return getattr(held, 'path', None) or held.name.split(':')[0]


def _step_paths(model) -> Dict[str, str]:
  """auto_shard's name of each model variable (its tf.Variable's) -> the variable's path."""
  out: Dict[str, str] = {}
  for variable in model.variables:
    name = _step_name(variable)
    if name in out and out[name] != variable.path:
      raise ValueError(
        f'auto_layout: variables {out[name]} and {variable.path} of {model.name} share the '
        f'TF name {name!r}; the search cannot tell them apart.'
      )
    out[name] = variable.path
  return out


def _baseline_layouts(baseline, model, mesh: Mesh) -> Tuple[Dict[str, P], str]:
  """The layouts Keras' rules give each model variable under `baseline` (a ModelParallel, or
  a LayoutMap: its batch on the mesh's first axis) as auto_shard `fixed` entries, and the
  baseline's batch axis."""
  if isinstance(baseline, keras.distribution.LayoutMap):
    baseline = keras.distribution.ModelParallel(layout_map=baseline)
  fixed = {}
  for variable in model.variables:
    layout = baseline.get_variable_layout(variable)
    fixed[re.escape(_step_name(variable))] = translate.variable_spec(variable, layout)
  return fixed, baseline.batch_dim_name or mesh.axis_names[0]


def _model_specs(model, result: AutoShardResult, paths: Dict[str, str]) -> Dict[str, P]:
  """Path -> spec of every model variable: as the search planned it (replicated when the
  step does not read it)."""
  by_path = {paths[n]: s.spec for n, s in result.shardings.items() if n in paths}
  out = {}
  for variable in model.variables:
    spec = by_path.get(variable.path, P())
    entries = list(spec) + [None] * (len(variable.shape) - len(spec))
    if any(isinstance(e, tuple) and len(e) > 1 for e in entries):
      raise ValueError(
        f'auto_layout: the chosen layout splits a dim of {variable.path} over several axes '
        f'({spec}); a Keras TensorLayout names one axis a dim.'
      )
    out[variable.path] = P(*[e[0] if isinstance(e, tuple) else e for e in entries])
  return out


def _check_keys(model, specs) -> None:
  """Every key matches exactly one variable of the model, its optimizer and its metrics
  (by `re.search`, the looser of Keras' matchings: with `^...$` both agree)."""
  paths = [v.path for v in all_variables(model)]
  for path in specs:
    matched = [p for p in paths if re.search(key_of(path), p)]
    if matched != [path]:
      raise ValueError(
        f'auto_layout: key {key_of(path)!r} matches {matched or "no variable"}; variable '
        f'paths of {model.name} must be unique to be laid out one key a variable.'
      )


# --- the report ----------------------------------------------------------------------------------
def _format_report(chosen: AutoLayout) -> str:
  mesh = ' x '.join(
    f'{a}={s}' for a, s in zip(chosen.device_mesh.axis_names, chosen.device_mesh.shape)
  )
  split = {p: s for p, s in chosen.specs.items() if any(e is not None for e in s)}
  lines = [
    f'auto_layout {chosen.model_name}: ModelParallel(batch_dim_name={chosen.batch_dim_name!r}) '
    f'over DeviceMesh ({mesh}); {len(chosen.specs)} LayoutMap keys (one per model variable), '
    f'{len(split)} split, the rest replicated',
    *_baseline_lines(chosen),
    chosen.result.report(),
    'keys splitting a variable:',
  ]
  width = max((len(key_of(p)) for p in split), default=0)
  lines += [f'  {key_of(p):<{width}}  {tuple(s)}' for p, s in split.items()]
  return '\n'.join(lines)


def _baseline_lines(chosen: AutoLayout) -> List[str]:
  if chosen.baseline is None:
    return []
  budget = chosen.result.budget
  searched, given = chosen.result.best, chosen.baseline.best

  def text(e) -> str:
    fits = 'fits' if e.memory <= budget else 'over budget'
    return f'{e.cost * 1e3:.2f} ms per step, {e.memory:,} bytes per device ({fits})'

  verdict = (
    'the baseline is cheaper: its layout is returned'
    if chosen.kept_baseline
    else 'the search is no worse: its layout is returned'
  )
  return [
    f'baseline map (planned): {text(given)}',
    f'search (planned):       {text(searched)}; {verdict}',
  ]
