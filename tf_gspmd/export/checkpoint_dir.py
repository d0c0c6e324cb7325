"""A checkpoint directory: numbered checkpoints, TF's state file naming them, safe publishing.

`save_checkpoint` writes `ckpt-<n>` bundles into a directory as `tf.train.Checkpoint` does, so
`tf.train.latest_checkpoint` finds them: a new bundle is flushed to disk before the state file
names it (an atomic rename), and what a killed save left behind is removed by the next one.
"""

from __future__ import annotations

import os
import re
import shutil
import uuid
from typing import List, Sequence

import tensorflow as tf

STATE_FILE = 'checkpoint'  # TF's name: tf.train.latest_checkpoint reads it
PREFIX = 'ckpt'
_NUMBERED = re.compile(rf'^{PREFIX}-(\d+)(\.index|\.data-\d+-of-\d+)$')
TEMP_DIR = '.tmp-'  # a bundle or state file being written


def checkpoint_number(name: str) -> int:
  match = re.fullmatch(rf'{PREFIX}-(\d+)', os.path.basename(name))
  return int(match.group(1)) if match else 0


def published(directory: str) -> List[str]:
  """Base names of the checkpoints the state file lists, oldest first."""
  state = tf.train.get_checkpoint_state(directory)
  if state is None:
    return []
  names = [os.path.basename(p) for p in state.all_model_checkpoint_paths]
  latest = os.path.basename(state.model_checkpoint_path)
  return [n for n in names if n != latest] + [latest]


def remove_leftovers(directory: str, kept: Sequence[str]) -> None:
  """Delete what a killed save left: temporary bundles and unpublished numbered files."""
  for name in os.listdir(directory):
    path = os.path.join(directory, name)
    match = _NUMBERED.match(name)
    if name.startswith(TEMP_DIR):
      shutil.rmtree(path, ignore_errors=True)
    elif match and f'{PREFIX}-{match.group(1)}' not in kept:
      os.remove(path)


def _bundle_files(prefix: str) -> List[str]:
  directory, base = os.path.split(prefix)
  return [
    os.path.join(directory, n)
    for n in os.listdir(directory)
    if n == f'{base}.index' or n.startswith(f'{base}.data-')
  ]


def _fsync(path: str) -> None:
  fd = os.open(path, os.O_RDONLY)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)


def flush_bundle(prefix: str) -> None:
  """The new bundle's files on disk before anything names it."""
  for path in _bundle_files(prefix):
    _fsync(path)


def publish(directory: str, names: List[str], max_to_keep: int) -> None:
  """Name `names[-1]` the newest checkpoint (an atomic rename), then drop the oldest."""
  keep, drop = names[-max_to_keep:], names[:-max_to_keep]
  text = f'model_checkpoint_path: "{keep[-1]}"\n' + ''.join(
    f'all_model_checkpoint_paths: "{n}"\n' for n in keep
  )
  temp = os.path.join(directory, f'{TEMP_DIR}{STATE_FILE}-{uuid.uuid4().hex[:8]}')
  with open(temp, 'w') as f:
    f.write(text)
    f.flush()
    os.fsync(f.fileno())
  os.replace(temp, os.path.join(directory, STATE_FILE))
  _fsync(directory)
  for name in drop:
    for path in _bundle_files(os.path.join(directory, name)):
      os.remove(path)


def latest_checkpoint(path: str) -> str:
  """The prefix `path` names: the newest checkpoint of a directory, or `path` itself."""
  if os.path.isdir(path):
    prefix = tf.train.latest_checkpoint(path)
    if prefix is None:
      raise ValueError(
        f'restore_checkpoint: no checkpoint in {path} (no {STATE_FILE} file naming one).'
      )
    return prefix
  if not os.path.exists(f'{path}.index'):
    raise ValueError(
      f'restore_checkpoint: {path} is neither a checkpoint directory nor a '
      f'checkpoint prefix (no {path}.index).'
    )
  return path
