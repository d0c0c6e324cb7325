"""The executor registry: every backend `tg.partition(..., backend=name)` can run on, by name.

A backend is what runs the per-partition program on devices. Everything that differs
between backends is a method of its `Executor` (below), so the rest of tf_gspmd asks the
executor instead of comparing backend names: the front, the compile step, the variable
store and Keras hold an `Executor`, never a `'tf'`/`'xla'` string
(`tests/test_executors.py` refuses a comparison with a backend name outside this module).

An executor provides:

- `collectives_class()`: its `Collectives` (the collective ops the program emits); a
  subclass of `collectives.Collectives` keeps autograph out of its methods by itself;
- `sharded_variable_class()`: what holds a variable's shards between calls;
- `devices(mesh, devices)` / `devices_named(names)`: the devices it runs on;
- `check_fits(layouts, mesh, devices)`: refuse shards that would not fit, before any is made;
- `prepare(...)` and `run(...)`: the compiled program made ready to run (`Compiled.prepared`),
  then called once with global values;
- what differs in how a program is built and handed out: `working_mesh` (the device order it
  computes in), `dtensor_devices`, `built` (prepare at build), `xla_executable`,
  `check_python_callback`.

Adding a backend: write an `Executor` subclass in its own module and add one line to
`EXECUTORS` (docs/architecture.md, "How to add a backend").
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

# name -> 'module:class' of its Executor, loaded on first use (a backend's dependencies, such
# as jax for 'xla', are imported only when it is used).
EXECUTORS: Dict[str, str] = {
  'tf': 'tf_gspmd.partitioned.tf_executor:TFExecutor',  # TF collectives on TF devices
  'xla': 'tf_gspmd.partitioned.xla_executor:XlaExecutor',  # StableHLO, compiled, run by PJRT
}
DEFAULT = 'tf'
# Where a program's shards live, as `Executor.devices` gives it: a function returning the
# device list (None: the backend's default devices), so a backend whose devices need an import
# (jax's for 'xla') is asked only when shards are made.
DeviceSource = Callable[[], Optional[Sequence]]
NAMES: Tuple[str, ...] = tuple(EXECUTORS)
_LOADED: Dict[str, 'Executor'] = {}


class Executor:
  """What one backend provides (the defaults are the TF backend's choices where it has one)."""

  name = ''

  def collectives_class(self) -> type:
    raise NotImplementedError

  def sharded_variable_class(self) -> type:
    raise NotImplementedError

  def devices(self, mesh, devices: Optional[Sequence]) -> DeviceSource:
    """The devices shards are made on, as a function giving them (None: the backend's default
    ones), asked only when shards are made or compared."""
    del mesh
    given = None if devices is None else list(devices)
    return lambda: given

  def devices_named(self, names: Sequence[str]) -> list:
    """This backend's devices for TF device names (a Keras DeviceMesh's)."""
    return list(names)

  def check_fits(self, layouts, mesh_size: int, devices: Optional[Sequence]) -> None:
    """Refuse `layouts` ((name, shape, dtype, sharding) each) whose shards would not fit."""

  def running_phase(self, mesh) -> str:
    """The build phase named once the per-partition program is written."""
    raise NotImplementedError

  def prepare(self, compiled, sharded_variables: dict, devices, timeout, name: str) -> Any:
    raise NotImplementedError

  def run(self, compiled, flat_args, sharded_variables: dict, what: str):
    raise NotImplementedError

  def working_mesh(self, main, propagation, mesh, arg_names, variables):
    """The device order the program computes in: `mesh` itself, unless the backend moves to
    the order most of the layouts name (`boundary.working_order`)."""
    del main, propagation, arg_names, variables
    return mesh

  def dtensor_devices(self, mesh) -> Optional[list]:
    """The devices a DTensor mesh runs on when none are given: None, the backend's own."""
    del mesh
    return None

  def built(self, compiled, prepare: Callable) -> None:
    """Called once the program is built: a backend that prepares then calls prepare(compiled)
    (else the first call does)."""

  def xla_executable(self, prepared: Callable[[], Any]) -> Any:
    """The compiled XLA executable of the program `prepared()` gives (only a backend that
    compiles with XLA has one: the others refuse before anything is built)."""
    del prepared
    raise ValueError(f'xla_executable(): this function was partitioned with backend={self.name!r}.')

  def tf_launcher(self, prepared, what: str) -> Any:
    """The TF launcher (`runtime.SpmdProgram`) of a prepared program, which a SavedModel
    serves; a backend without one refuses, naming what serves its programs."""
    del prepared
    raise ValueError(
      f'{what}: the function was partitioned with backend={self.name!r}; a SavedModel serves '
      "the TF backend's program (use saved_model.save_xla for an XLA module)."
    )

  def check_python_callback(self, op: str, node: str, name: str) -> None:
    """Refuse a Python callback op (tf.py_function, tf.numpy_function) the backend cannot run;
    TF's runtime runs them."""


def get(name: str, what: str = 'partition') -> Executor:
  """The executor called `name`; a ValueError naming the known ones for any other."""
  if name not in EXECUTORS:
    raise ValueError(f'{what}: backend must be one of {NAMES}, got {name!r}.')
  if name not in _LOADED:
    module, _, cls = EXECUTORS[name].partition(':')
    _LOADED[name] = getattr(importlib.import_module(module), cls)()
  return _LOADED[name]
