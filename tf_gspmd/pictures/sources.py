"""Pictures of a partitioned function or a `tg.plan` report: the layouts propagation chose.

Reads a `PartitionedFunction` (its variables, last compiled program and its
`Propagation`) or a `PlanReport` by their attributes only: both live above
this package, which must not import them.
"""

from __future__ import annotations

import difflib
from typing import Any, Callable, Dict, List, Optional

import numpy as np

from tf_gspmd.pictures import html, text
from tf_gspmd.pictures.geometry import tiling_of
from tf_gspmd.pictures.page import VARIABLE_ROLES, Page, TensorEntry, memory_of


# --- pf.visualize ------------------------------------------------------------------------
def visualize_named(pf, name: str) -> str:
  """Print (and return) the grid of variable or main-graph tensor `name` of `pf`."""
  found = named_layouts(pf)
  if name not in found:
    near = difflib.get_close_matches(name, list(found), n=6, cutoff=0.4)
    hint = f'; did you mean {", ".join(repr(n) for n in near)}?' if near else '.'
    raise KeyError(f'visualize: no variable or graph tensor named {name!r} in {_fn_name(pf)}{hint}')
  sharding, shape, label = found[name]()
  picture = text.render(tiling_of(sharding, shape), label)
  print(picture)
  return picture


def named_layouts(pf) -> Dict[str, Callable[[], tuple]]:
  """Every name `pf.visualize` takes -> a thunk giving (sharding, shape, label).

  Variables answer to their TF name with or without ':0' (and '#2'... as in
  `variable_bytes()`), tensors of the main graph to their name (and their op's
  name for output 0). Thunks: the sharding of a tensor is looked up only when asked.
  """
  found: Dict[str, Callable[[], tuple]] = {}
  # variable_bytes() and variable_pairs() walk the same store in the same order.
  for key, (original, sharded) in zip(pf.variable_bytes(), pf.variable_pairs()):

    def entry(s=sharded, k=key):
      return (s.sharding, s.shape, k)

    for alias in (key, original.name, original.name.split(':')[0], sharded.label):
      found.setdefault(alias, entry)
  compiled = pf._last  # noqa: SLF001
  main = compiled.program.main
  for tensor in main.tensors():
    if _drawable(tensor):

      def entry(t=tensor):
        return (compiled.propagation.target(main, t.name), t.shape, t.name)

      found.setdefault(tensor.name, entry)
      if tensor.index == 0:
        found.setdefault(tensor.node, entry)
  return found


def _drawable(tensor) -> bool:
  """A tensor of static shape holding values (not a resource handle or a variant)."""
  shape = tensor.shape
  kind = getattr(tensor.dtype, 'name', str(tensor.dtype))
  return shape is not None and None not in shape and kind not in ('resource', 'variant')


# --- the report page ---------------------------------------------------------------------
def function_page(pf) -> Page:
  """The page of a partitioned function's last compiled program."""
  compiled = pf._last  # noqa: SLF001
  propagation = compiled.propagation
  why = _variable_provenance(propagation)
  entries = [
    TensorEntry(
      key,
      tuple(sharded.shape),
      sharded.dtype.name,
      sharded.sharding,
      _role(getattr(original, 'trainable', True)),
      sizes['per_device'],
      sizes['total'],
      why(original),
    )
    for (key, sizes), (original, sharded) in zip(pf.variable_bytes().items(), pf.variable_pairs())
  ]
  notes = [
    'Activations: not measured for a partitioned function; '
    'tg.plan(step, *specs, mesh=...).report(path) adds the activation peak.'
  ]
  return Page(
    f'{_fn_name(pf)} on {compiled.mesh}',
    compiled.mesh,
    entries,
    pf.collectives(),
    memory_of(entries, None),
    propagation.records(),
    notes,
    _boundary(propagation),
  )


def plan_page(report) -> Page:
  """The page of a `tg.plan` report (with its activation peak)."""
  propagation = report.propagation
  why = _variable_provenance(propagation)
  by_name = (
    {v.name: v for v in propagation.program.variables.values()} if propagation is not None else {}
  )
  entries = [
    TensorEntry(
      key,
      tuple(v.shape),
      v.dtype,
      v.sharding,
      _role(v.trainable),
      v.per_device,
      v.total,
      why(by_name.get(v.name)),
    )
    for key, v in zip(report.variable_bytes(), report.variables)
  ]
  notes = [
    f'Activation peak: a liveness pass over the per-partition program '
    f'({report.activation_tensors} tensors counted; see tf_gspmd.planning.activation_peak).'
  ]
  return Page(
    f'plan {report.name} on {report.mesh}',
    report.mesh,
    entries,
    report.collectives(),
    memory_of(entries, report.activation_peak),
    propagation.records() if propagation is not None else [],
    notes,
    _boundary(propagation),
  )


def _role(trainable: bool) -> str:
  return VARIABLE_ROLES[0] if trainable else VARIABLE_ROLES[1]


def _boundary(propagation) -> List[TensorEntry]:
  """The main graph's arguments and outputs, laid out as propagation chose."""
  if propagation is None:
    return []
  main, out = propagation.program.main, []
  for role, names in (('argument', propagation.program.arg_inputs), ('output', main.outputs)):
    for name in names:
      tensor = main.tensor(name)
      if _drawable(tensor):
        sharding = propagation.target(main, name)
        size = tensor.dtype.size
        out.append(
          TensorEntry(
            name,
            tuple(tensor.shape),
            tensor.dtype.name,
            sharding,
            role,
            int(np.prod(sharding.shard_shape(tensor.shape), dtype=np.int64)) * size,
            int(np.prod(tensor.shape, dtype=np.int64)) * size,
            _provenance(propagation, name),
          )
        )
  return out


def write_report(source, path, kind: str) -> str:
  """Write the page of `source` (kind 'function' or 'plan') to `path`; returns the path."""
  page = function_page(source) if kind == 'function' else plan_page(source)
  return html.write(page, path)


def _variable_provenance(propagation) -> Callable[[Any], str]:
  """tf.Variable (or None) -> how propagation got its sharding ('' when it did not see it)."""
  tensors = (
    {} if propagation is None else {id(v): t for t, v in propagation.program.variables.items()}
  )
  return lambda var: '' if var is None else _provenance(propagation, tensors.get(id(var)))


def _provenance(propagation, tensor: Optional[str]) -> str:
  if propagation is None or tensor is None:
    return ''
  try:
    return propagation.provenance(tensor).describe()
  except KeyError:
    return ''


def _fn_name(pf) -> str:
  fn = pf.fn
  return getattr(fn, '__name__', None) or getattr(
    getattr(fn, 'python_function', None), '__name__', 'fn'
  )
