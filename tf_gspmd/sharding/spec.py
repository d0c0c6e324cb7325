"""`P`, a partition spec: per tensor dim, the mesh axes that split it."""

from __future__ import annotations


class P(tuple):
  """A partition spec: per tensor dim, `None`, a mesh axis name, or a tuple of names.

  >>> P('data', None)
  P('data', None)
  >>> P(('x', 'y'), None)[0]
  ('x', 'y')

  As for `tuple`, one list argument is the list of entries:
  `P(['data', None]) == P('data', None)`. Generic code rebuilds tuple
  subclasses that way (tf.nest, Keras 3's attribute tracking when a layer
  stores a P), so a P survives being stored on a Keras layer.
  """

  def __new__(cls, *entries):
    if len(entries) == 1 and isinstance(entries[0], list):
      entries = tuple(entries[0])
    norm = []
    for e in entries:
      if e is None or isinstance(e, str):
        norm.append(e)
      elif isinstance(e, (tuple, list)):
        if not all(isinstance(a, str) for a in e):
          raise TypeError(f'P: a tuple entry must hold axis names, got {e!r}.')
        norm.append(None if not e else (e[0] if len(e) == 1 else tuple(e)))
      else:
        raise TypeError(f'P: each entry must be None, an axis name or a tuple of names; got {e!r}.')
    return super().__new__(cls, norm)

  def axes_of(self, dim: int) -> tuple:
    """The mesh axes that split `dim`, major to minor (empty when not split)."""
    e = self[dim]
    return () if e is None else ((e,) if isinstance(e, str) else e)

  def used_axes(self) -> tuple:
    return tuple(a for d in range(len(self)) for a in self.axes_of(d))

  def __repr__(self):
    return 'P(' + ', '.join(repr(e) for e in self) + ')'

  __str__ = __repr__

  def __getnewargs__(self):
    return tuple(self)
