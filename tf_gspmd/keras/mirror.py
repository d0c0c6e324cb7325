"""The two copies of a partitioned Keras model's variables, kept agreeing.

The model's own tf.Variables are what Keras, callbacks, checkpoints and the user read and
write; their shards are what the partitioned steps read and write. `Mirror` fingerprints the
originals to find the ones written since the copies last agreed (a write to an original wins)
and copies the shards back when Keras or the user is about to read the originals;
tf_gspmd/keras/fit.py says when each happens.
"""

from __future__ import annotations

from typing import Any, Dict, List

import keras
import tensorflow as tf

from tf_gspmd.partitioned import VariableStore
from tf_gspmd.runtime.grappler import without_grappler
from tf_gspmd.runtime.sharded import read


def _fingerprint(value) -> tf.Tensor:
  """[1, 8] uint8: tf.fingerprint hashes each row's raw bytes (farmhash64), any dtype."""
  return tf.fingerprint(tf.reshape(value, [1, -1]))


class Mirror:
  """Keeps the model's own variables and their shards agreeing; a write to an original wins."""

  def __init__(self, store: VariableStore):
    self.store = store
    self._agreed: Dict[int, bytes] = {}  # id(original) -> its fingerprint when both copies agreed
    self._compiled: Dict[tuple, Any] = {}  # fingerprint checks and copies, per variable list

  def _fingerprints(self, originals) -> List[bytes]:
    if not originals:
      return []
    with without_grappler():  # a hash per variable: nothing to optimize, much to pay for
      return [row.tobytes() for row in self._fingerprint_function(originals)().numpy()]

  def _fingerprint_function(self, originals):
    """One compiled call fingerprinting these originals, cached per list (a model checks the
    same lists every call). The variables are captured, not passed: passing V variables
    costs a call V argument checks."""
    captured = list(originals)
    return self._compiled_once(
      ('fingerprints',) + tuple(id(o) for o in captured),
      lambda: tf.concat([_fingerprint(read(v)) for v in captured], 0),
    )

  def _compiled_once(self, key: tuple, body):
    """`tf.function(body)`, made once per key (ids of the variables it captures, which the
    cached function keeps alive, so they are not reused)."""
    function = self._compiled.get(key)
    if function is None:
      # Rare lists (the few originals a user wrote) add entries too; keep the cache small.
      if len(self._compiled) >= 32:
        self._compiled.clear()
      function = self._compiled[key] = tf.function(body, autograph=False)
    return function

  def _agree(self, originals) -> None:
    for var, fp in zip(originals, self._fingerprints(originals)):
      self._agreed[id(var)] = fp

  def _changed(self, pairs) -> List[tuple]:
    known = [(o, s) for o, s in pairs if id(o) in self._agreed]
    fps = self._fingerprints([o for o, _ in known])
    return [(o, s) for (o, s), fp in zip(known, fps) if fp != self._agreed[id(o)]]

  def push_changed(self) -> int:
    """Scatter every original written since the copies last agreed; returns how many."""
    changed = self._changed(self.store.pairs())
    self.push([o for o, _ in changed])
    return len(changed)

  def push(self, originals) -> None:
    """Scatter these originals to their shards (an explicit write: no check)."""
    pairs = self.store.pairs(originals)
    for original, sharded in pairs:
      sharded.scatter(original.read_value())
    self._agree([o for o, _ in pairs])

  def note_new(self) -> None:
    """Record the agreement of variables whose shards were just made from their originals."""
    self._agree([o for o, _ in self.store.pairs() if id(o) not in self._agreed])

  def pull(self, originals=None, check: bool = True) -> None:
    """Copy the shards back to the originals, except originals written meanwhile (those push).

    `check=False` when nothing can have written them since the last launch pushed every
    write (after a `*_on_batch` call): one fingerprint pass fewer per call."""
    pairs = self.store.pairs(originals)
    written = {id(o) for o, _ in self._changed(pairs)} if check else set()
    for original, sharded in pairs:
      if id(original) in written:
        sharded.scatter(original.read_value())
    copied = [(o, s) for o, s in pairs if id(o) not in written]
    in_graph = [(o, s) for o, s in copied if getattr(s, 'assembles_in_graph', True)]
    on_host = [(o, s) for o, s in copied if not getattr(s, 'assembles_in_graph', True)]
    with without_grappler():  # reads and assigns: nothing to optimize
      if in_graph:
        self._note_agreed(in_graph, self._copy_back(in_graph)().numpy())
      if on_host:  # device buffers outside TF (backend='xla'): assembled eagerly, then assigned
        values = [s.assemble() for _, s in on_host]
        self._note_agreed(on_host, self._assign(on_host)(values).numpy())
    self._agree([o for o, _ in pairs if id(o) in written])

  def _note_agreed(self, pairs, fingerprints) -> None:
    for (original, _), fp in zip(pairs, fingerprints):
      self._agreed[id(original)] = fp.tobytes()

  def _assign(self, pairs):
    """One compiled call assigning given global values to these originals; returns their
    fingerprints (the agreement). For shards that live outside TF's runtime (PJRT buffers),
    which a traced function cannot read."""
    originals = [o for o, _ in pairs]

    def assign(values):
      for original, value in zip(originals, values):
        original.assign(value, read_value=False)
      return tf.concat([_fingerprint(v) for v in values], 0)

    return self._compiled_once(('assign',) + tuple(id(o) for o in originals), assign)

  def _copy_back(self, pairs):
    """One compiled call assigning each pair's assembled shards to its original and returning
    the fingerprints of the values assigned (the agreement). Eagerly, each pair cost an
    assemble and an assign from Python: 83 ms per train_on_batch of a 2-layer transformer
    whose step is 140 ms. Cached per list of pairs: a model pulls the same lists each call."""

    def copy_back():  # few ops per variable: tracing it is part of the first step
      fingerprints = []
      for original, sharded in pairs:
        value = sharded.assemble()
        original.assign(value, read_value=False)
        fingerprints.append(_fingerprint(value))
      return tf.concat(fingerprints, 0)

    return self._compiled_once(('copy back',) + tuple((id(o), id(s)) for o, s in pairs), copy_back)


class SyncAtEpochEnd(keras.callbacks.Callback):
  """Copies every shard back at each epoch's end, before other callbacks read the weights."""

  def __init__(self, mirror: Mirror):
    super().__init__()
    self._mirror = mirror

  def on_epoch_end(self, epoch, logs=None):
    self._mirror.pull()
