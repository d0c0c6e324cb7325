"""Data at risk under load: train, checkpoint every K steps, SIGKILL the trainer during saves.

    python examples/soak.py --steps 2000 --every 100 --kills 8

Two runs of the demo transformer (examples/keras/transformer.py, Megatron layout
on a (data=2, model=4) mesh of 8 logical CPU devices, Adam):

* uninterrupted: one trainer process runs every step and writes the final
  weights;
* killed: a trainer saves `tg.save_checkpoint` every K steps; the driver
  SIGKILLs it at a random moment of a save (between the line the trainer
  prints as the save starts and the one as it ends), `--kills` times over
  the run, and starts a new trainer, which restores the newest published
  checkpoint and goes on from its step.

Every restart checks that it restored the last published checkpoint
bitwise: each variable it holds after `tg.restore_checkpoint` (assembled from
its shards) equals, byte for byte, the tensor TF's own reader
(`tf.train.load_checkpoint`) finds in that checkpoint, and the step it resumes
from is the checkpoint's (the optimizer's iteration count). Batches depend only
on the step number, so the killed run must end with the uninterrupted run's
weights; the driver compares them bitwise and by the oracle (normwise relative
error, tf_gspmd.testing). The last line is `soak: ...` with the figures; the
exit status is 1 when anything differs.
"""

import argparse
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


# --- the trainer (a child process) ------------------------------------------------------------
def train(directory: str, steps: int, every: int) -> int:
  os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
  os.environ.setdefault('KERAS_BACKEND', 'tensorflow')
  import numpy as np
  import tensorflow as tf

  tf.config.set_logical_device_configuration(
    tf.config.list_physical_devices('CPU')[0], [tf.config.LogicalDeviceConfiguration()] * 8
  )
  sys.path[:0] = [os.path.join(HERE, '..'), os.path.join(HERE, 'keras')]
  import transformer

  import tf_gspmd as tg

  os.makedirs(directory, exist_ok=True)
  mesh = tg.Mesh.create((2, 4), ('data', 'model'))
  model, optimizer = transformer.build(seed=0)
  transformer.layout(mesh).apply(model)
  step = tg.partition(transformer.train_step(model, optimizer, mesh), mesh)
  step.get_program(*transformer.batch(seed=0))  # the sharded variables, before a restore
  start = 0
  if tf.train.latest_checkpoint(directory):
    record = tg.restore_checkpoint(directory, step)
    start = _iterations(step, optimizer)
    _check_bitwise(step, record.prefix, np, tf)
    print(
      f'restored {os.path.basename(record.prefix)} at step {start}: every variable bitwise '
      'as TF reads the checkpoint',
      flush=True,
    )
  else:
    print('starting at step 0: no checkpoint published', flush=True)
  for i in range(start, steps):
    step(*transformer.batch(seed=i))
    if (i + 1) % every == 0 and i + 1 < steps:
      print(f'saving at step {i + 1}', flush=True)
      started = time.time()
      tg.save_checkpoint(step, directory)
      print(f'saved at step {i + 1} in {time.time() - started:.3f} s', flush=True)
  np.savez(os.path.join(directory, 'weights.npz'), **{v.path: v.numpy() for v in model.variables})
  np.savez(
    os.path.join(directory, 'optimizer.npz'), **{v.path: v.numpy() for v in optimizer.variables}
  )
  print(f'trained to step {steps}', flush=True)
  return 0


def _iterations(step, optimizer) -> int:
  """The optimizer's step count as the partitioned step holds it (its shard, not the original)."""
  from tf_gspmd.keras.hooks import backing  # the tf.Variable behind the Keras variable

  pairs = {id(o): s for o, s in step.variable_pairs()}
  counter = backing(optimizer.iterations)
  return int(pairs[id(counter)].assemble().numpy())


def _check_bitwise(step, prefix: str, np, tf) -> None:
  """Each restored variable equals, byte for byte, what TF's checkpoint reader reads."""
  from tf_gspmd.export.checkpoint import values_by_name

  reader = tf.train.load_checkpoint(prefix)
  for name, held in values_by_name(step).items():
    saved = np.asarray(reader.get_tensor(name))
    if held.dtype != saved.dtype or held.tobytes() != saved.tobytes():
      raise SystemExit(f'restore of {prefix}: {name} differs from the checkpoint')


# --- the driver ---------------------------------------------------------------------------------
def _trainer(directory: str, steps: int, every: int) -> subprocess.Popen:
  return subprocess.Popen(
    [sys.executable, os.path.abspath(__file__), 'train', directory, str(steps), str(every)],
    stdout=subprocess.PIPE,
    text=True,
  )


def uninterrupted(directory: str, steps: int, every: int) -> float:
  start = time.time()
  process = _trainer(directory, steps, every)
  process.communicate()
  if process.returncode:
    raise SystemExit(f'the uninterrupted trainer failed ({process.returncode})')
  return time.time() - start


def killed(directory: str, steps: int, every: int, kills: int, rng: random.Random) -> dict:
  """Run trainers until one finishes, killing `kills` of them at a random moment of a save.

  Each new trainer must restore exactly when a checkpoint is published, and from the last
  save that completed or the one it was killed in (killed after publishing)."""
  saves = steps // every - (steps % every == 0)
  chosen = set(rng.sample(range(1, saves + 1), min(kills, saves)))  # the saves to kill in
  figures = {'kills': 0, 'restores': 0, 'fresh_starts': 0, 'seconds': time.time()}
  done, in_save = 0, None  # the last save seen complete; the one the trainer was killed in
  restarted, save_seconds = False, []
  while True:
    published = os.path.exists(os.path.join(directory, 'checkpoint'))
    process = _trainer(directory, steps, every)
    died, first = False, True
    for line in process.stdout:
      if first:
        done = _check_start(line, published, done, in_save)
        if restarted:
          figures['restores' if published else 'fresh_starts'] += 1
          print(f'  trainer: {line.strip()}', flush=True)
        first = False
      if line.startswith('saved at step '):
        done = int(line.split()[3])
        save_seconds.append(float(line.split()[-2]))
      if line.startswith('saving at step ') and int(line.split()[-1]) // every in chosen:
        in_save = int(line.split()[-1])
        chosen.discard(in_save // every)
        # Somewhere inside the save: a save takes about as long as the ones before it.
        time.sleep(
          rng.uniform(
            0.0, 0.9 * (sorted(save_seconds)[len(save_seconds) // 2] if save_seconds else 0.05)
          )
        )
        process.send_signal(signal.SIGKILL)
        figures['kills'] += 1
        print(
          f'  killed the trainer during its save at step {in_save} '
          f'(newest completed save: step {done})',
          flush=True,
        )
        died = True
        break
    process.wait()
    restarted = True
    if not died:
      if process.returncode:
        raise SystemExit(f'a trainer failed ({process.returncode})')
      figures['seconds'] = time.time() - figures['seconds']
      return figures


def _check_start(line: str, published: bool, done: int, in_save) -> int:
  """A trainer's first line: a restore exactly when a checkpoint is published, of the newest."""
  if not published:
    if not line.startswith('starting at step 0'):
      raise SystemExit(f'no checkpoint was published, but the trainer said: {line}')
    return 0
  if not line.startswith('restored '):
    raise SystemExit(f'a checkpoint was published, but the trainer said: {line}')
  step = int(line.split(' at step ')[1].split(':')[0])
  if step not in (done, in_save):
    raise SystemExit(
      f'restored step {step}, but the newest published save is {done} '
      f'(or {in_save}, killed after publishing): {line}'
    )
  return step  # the newest published checkpoint now


# The attention key biases have a zero gradient in exact arithmetic (a softmax over keys is
# unchanged by the constant q.b_k they add to a query's scores): their updates and Adam slots
# are round-off alone, so no float32 bound holds for them (examples/multi_worker.py judges them
# against a float64 run instead).
ROUND_OFF_ALONE = re.compile(r'.*/key/bias$')


def compare(a: str, b: str) -> dict:
  """The killed run's final state against the uninterrupted run's: bitwise, and by the oracle
  (normwise relative error per weight, bound 1e-5 for float32)."""
  import numpy as np

  sys.path.insert(0, os.path.join(HERE, '..'))
  from tf_gspmd.testing import check

  out = {}
  for what in ('weights', 'optimizer'):
    with np.load(os.path.join(a, f'{what}.npz')) as x, np.load(os.path.join(b, f'{what}.npz')) as y:
      names = sorted(x.files)
      assert names == sorted(y.files), (names, sorted(y.files))
      out[what] = {n: (x[n].tobytes() == y[n].tobytes(), check(y[n], x[n], n)) for n in names}
  return out


def _summary(compared: dict) -> tuple:
  """(every weight bitwise equal, weights judged by the oracle all pass, the worst error, text)."""
  weights = compared['weights']
  bitwise = all(same for same, _ in weights.values())
  judged = {n: v for n, (_, v) in weights.items() if not ROUND_OFF_ALONE.match(n)}
  worst = max(judged.values(), key=lambda v: v.error)
  slots_bitwise = all(same for same, _ in compared['optimizer'].values())
  text = (
    f'{len(weights)} weights {"bitwise equal" if bitwise else "not bitwise equal"} to the '
    f'uninterrupted run (oracle: worst normwise relative error {worst.error:.1e} at '
    f'{worst.name}, {len(judged)} judged; key biases are round-off alone), optimizer '
    f'state {"bitwise equal" if slots_bitwise else "not bitwise equal"}'
  )
  return bitwise, all(v.ok for v in judged.values()), worst.error, text


def main() -> int:
  if len(sys.argv) > 1 and sys.argv[1] == 'train':
    return train(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--steps', type=int, default=2000)
  parser.add_argument('--every', type=int, default=100)
  parser.add_argument('--kills', type=int, default=8)
  parser.add_argument('--seed', type=int, default=None)
  args = parser.parse_args()
  seed = args.seed if args.seed is not None else random.randrange(1 << 30)
  print(
    f'soak: {args.steps} steps, a checkpoint every {args.every}, {args.kills} SIGKILLs '
    f'during saves, seed {seed}',
    flush=True,
  )
  base = tempfile.mkdtemp(prefix='soak_')
  plain, interrupted = os.path.join(base, 'plain'), os.path.join(base, 'killed')
  plain_seconds = uninterrupted(plain, args.steps, args.every)
  figures = killed(interrupted, args.steps, args.every, args.kills, random.Random(seed))
  _, passed, _, text = _summary(compare(plain, interrupted))
  ok = passed and figures['restores'] + figures['fresh_starts'] == figures['kills']
  print(
    f'soak: {figures["kills"]} kills during saves, {figures["restores"]} restores of the '
    f'newest published checkpoint (each bitwise), {figures["fresh_starts"]} fresh starts '
    f'(killed before any was published); final {text}; uninterrupted '
    f'{plain_seconds:.0f} s, killed run {figures["seconds"]:.0f} s',
    flush=True,
  )
  return 0 if ok else 1


if __name__ == '__main__':
  sys.exit(main())
