"""Pictures of a partitioned function or a plan: the layouts propagation chose, by name.

Reads a `PartitionedFunction` (its variables, last compiled program and
propagation plan) or a `PlanReport` by their attributes only: both live above
this package, which must not import them.
"""

from __future__ import annotations

import difflib
from typing import Callable, Dict, Optional

from tf_gspmd.pictures import html, text
from tf_gspmd.pictures.geometry import layout_of
from tf_gspmd.pictures.page import Page, VariableEntry, memory_of


# --- pf.visualize ------------------------------------------------------------------------
def visualize_named(pf, name: str) -> str:
  """Print (and return) the grid of variable or main-graph tensor `name` of `pf`."""
  found = named_layouts(pf)
  if name not in found:
    near = difflib.get_close_matches(name, list(found), n=6, cutoff=0.4)
    hint = f'; did you mean {", ".join(repr(n) for n in near)}?' if near else '.'
    raise KeyError(f'visualize: no variable or graph tensor named {name!r} in '
                   f'{_fn_name(pf)}{hint}')
  sharding, shape, label = found[name]()
  picture = text.render(layout_of(sharding, shape), label)
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
    entry = (lambda s=sharded, k=key: (s.sharding, s.shape, k))
    for alias in (key, original.name, original.name.split(':')[0], sharded.label):
      found.setdefault(alias, entry)
  compiled = pf._last  # pylint: disable=protected-access
  main = compiled.program.main
  for tensor in main.tensors():
    if _drawable(tensor):
      entry = (lambda t=tensor: (compiled.plan.target(main, t.name), t.shape, t.name))
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
  compiled = pf._last  # pylint: disable=protected-access
  plan = compiled.plan
  tensors = _variable_tensors(plan)
  entries = []
  for (key, sizes), (original, sharded) in zip(pf.variable_bytes().items(), pf.variable_pairs()):
    entries.append(VariableEntry(
        key, tuple(sharded.shape), sharded.dtype.name, sharded.sharding,
        bool(getattr(original, 'trainable', True)), sizes['per_device'], sizes['total'],
        _provenance(plan, tensors.get(id(original)))))
  notes = ['Activations: not measured for a partitioned function; '
           'tg.plan(step, *specs, mesh=...).report(path) adds the activation peak.']
  return Page(f'{_fn_name(pf)} on {compiled.mesh}', compiled.mesh, entries, pf.collectives(),
              memory_of(entries, None), plan.records(), notes)


def plan_page(report) -> Page:
  """The page of a `tg.plan` report (with its activation peak)."""
  plan = report.plan
  tensors = _variable_tensors(plan) if plan is not None else {}
  by_name = {v.name: v for v in plan.program.variables.values()} if plan is not None else {}
  entries = []
  for key, v in zip(report.variable_bytes(), report.variables):
    var = by_name.get(v.name)
    entries.append(VariableEntry(key, tuple(v.shape), v.dtype, v.sharding, v.trainable,
                                 v.per_device, v.total,
                                 _provenance(plan, tensors.get(id(var)) if var is not None else None)))
  notes = [f'Activation peak: a liveness pass over the per-partition program '
           f'({report.activation_tensors} tensors counted; see tf_gspmd.planning.activation_peak).']
  return Page(f'plan {report.name} on {report.mesh}', report.mesh, entries,
              report.collectives(), memory_of(entries, report.activation_peak),
              plan.records() if plan is not None else [], notes)


def write_report(source, path, kind: str) -> str:
  """Write the page of `source` (kind 'function' or 'plan') to `path`; returns the path."""
  page = function_page(source) if kind == 'function' else plan_page(source)
  return html.write(page, path)


def _variable_tensors(plan) -> Dict[int, str]:
  """id(tf.Variable) -> the main-graph tensor standing for it."""
  return {id(var): tensor for tensor, var in plan.program.variables.items()}


def _provenance(plan, tensor: Optional[str]) -> str:
  if plan is None or tensor is None:
    return ''
  try:
    return plan.provenance(tensor).describe()
  except KeyError:
    return ''


def _fn_name(pf) -> str:
  fn = pf.fn
  return getattr(fn, '__name__', None) or getattr(getattr(fn, 'python_function', None),
                                                  '__name__', 'fn')

