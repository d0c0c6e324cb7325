"""One SPMD program over two TF worker processes: the demo transformer on a (data=2, model=4) mesh.

    python examples/multi_worker.py            # train 3 steps across the two workers
    python examples/multi_worker.py --fault    # ... and kill worker 1 mid-step before the last
    python examples/multi_worker.py --hang     # ... or stop it (SIGSTOP: hangs, never dies)
    python examples/multi_worker.py --fault --hang  # ... both, one after the other

TF's servers listen on all interfaces, not loopback alone, and run any graph a client
sends: the example refuses to start them without --expose-to-network, which
acknowledges that, unless it runs in a network namespace with loopback only, where the
workers and this client reach each other and nothing else does (Linux):

    python -m tf_gspmd.runtime.loopback -- python examples/multi_worker.py

Two `tf.distribute.Server` processes (the job 'worker', tasks 0 and 1, at
loopback addresses) hold 4 CPU devices each. This process is the client: it
connects to them (`tf.config.experimental_connect_to_cluster`), partitions the
Keras training step with `devices=` naming the workers' devices, and runs it;
TF ships each task its partitions, and the collectives between tasks go over
gRPC. The mesh is laid over the tasks so that every 'model' group (the
Megatron all-reduces of every layer) stays inside one worker and only the
'data' all-reduces of the gradients cross between them. The same steps run
unpartitioned in this process for comparison.

With --fault, a checkpoint is saved after step 2 (each worker writes its own
slices), then steps run back to back while worker 1 is killed with SIGKILL
from a timer, and the step in flight raises a CollectiveError naming the dead
task. The example then restarts the workers, connects again,
partitions again, restores the checkpoint and runs step 3 again. With --hang,
worker 1 is stopped (SIGSTOP) instead: it keeps its port open and never
answers, and the step in flight raises a CollectiveError naming it once the
collective timeout has passed; the recovery is the same. With both flags, the kill and
its recovery come first, then the stop and its recovery, then step 3.

The last line is `max relative error vs unpartitioned: <x>`: the largest normwise
relative error (the oracle's, tf_gspmd.testing; bound 1e-5 for float32) of every
loss and of each weight after the last step, against the unpartitioned run. The
weights float32 cannot resolve (the attention key biases: zero gradient in exact
arithmetic, round-off alone) are judged by the oracle's float64 rule against the
same steps run in float64, on the lines before it (examples/keras/float64_check.py).
The exit status is 1 when the oracle fails anything.
"""

import argparse
import collections
import os
import sys
import tempfile
import threading
import time

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
os.environ.setdefault('KERAS_BACKEND', 'tensorflow')


HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, '..'))
sys.path.insert(0, os.path.join(HERE, 'keras'))
import float64_check  # noqa: E402  (examples/keras/float64_check.py: the weights' check)
import numpy as np  # noqa: E402
import transformer  # noqa: E402  (examples/keras/transformer.py: the demo's model and layout)

import tf_gspmd as tg  # noqa: E402
from tf_gspmd.runtime import cluster, exposure  # noqa: E402
from tf_gspmd.testing import check  # noqa: E402
from tf_gspmd.testing.float64 import float64_policy, float64_twin  # noqa: E402

TASKS, DEVICES_PER_TASK = 2, 4
STEPS = 3
TIMEOUT = float(os.environ.get('TF_GSPMD_EXAMPLE_TIMEOUT', 30.0))  # a collective's wait, s


def partition_step(model, optimizer, mesh, devices):
  return tg.partition(
    transformer.train_step(model, optimizer, mesh), mesh, devices=devices, timeout=TIMEOUT
  )


def describe_collectives(step, devices):
  """Per kind and axes: how many collectives one step runs and whether they cross tasks."""
  mesh = step.mesh
  counts = collections.Counter()
  for rec in step.collectives():
    axes = tuple(rec['axes'])
    groups = mesh.groups(axes) if axes else ()
    crosses = any(len({cluster.task_of(devices[p]) for p in g}) > 1 for g in groups)
    counts[(rec['kind'], ','.join(axes), 'between tasks' if crosses else 'inside a task')] += 1
  print(f'collectives per step: {sum(counts.values())}')
  for (kind, axes, where), n in sorted(counts.items()):
    print(f'  {n:3d} {kind:<12} over {axes:<11} {where}')


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
    '--fault',
    action='store_true',
    help='kill worker 1 before the last step, restart it, restore, continue (with --hang: '
    'first this, then the stop)',
  )
  parser.add_argument(
    '--hang',
    action='store_true',
    help='as --fault, but stop worker 1 (SIGSTOP) instead of killing it',
  )
  parser.add_argument(
    '--expose-to-network',
    action='store_true',
    help="acknowledge that the servers' ports are reachable from the network (TF listens on "
    'all interfaces and runs any graph a client sends, file reads and writes included)',
  )
  args = parser.parse_args()
  faults = [kind for kind, asked in (('kill', args.fault), ('hang', args.hang)) if asked]

  mesh = tg.Mesh.create((2, 4), ('data', 'model'))
  start = time.time()
  expose = args.expose_to_network
  try:
    workers = cluster.LocalCluster(TASKS, DEVICES_PER_TASK, expose_to_network=expose)
  except exposure.ExposureRefused as refused:
    raise SystemExit(
      f'{refused}\nThis example takes the acknowledgment as --expose-to-network.'
    ) from None
  with workers:
    # Connect before making any variable: connecting resets TF's eager context
    # (see docs/scaling_out.md).
    names = cluster.connect(workers.spec, DEVICES_PER_TASK, expose_to_network=expose)
    print(f'{TASKS} workers {workers.addresses} up and connected in {time.time() - start:.1f} s')
    model, optimizer = transformer.build(seed=0)
    ref_model, ref_optimizer = transformer.build(seed=0)
    exact_model, exact_optimizer = float64_twin(transformer.build, seed=0)
    transformer.layout(mesh).apply(model)
    reference = transformer.train_step(ref_model, ref_optimizer)
    with float64_policy():  # its loss in float64 too
      exact = transformer.train_step(exact_model, exact_optimizer)
    devices = cluster.mesh_devices(mesh, names, inside=('model',))
    for data in range(mesh.shape['data']):
      row = [p for p in mesh.devices if mesh.coords(p)['data'] == data]
      print(f'  data={data}: partitions {row} on {cluster.task_of(devices[row[0]])}')
    step = partition_step(model, optimizer, mesh, devices)
    checkpoints = tempfile.mkdtemp(prefix='multi_worker_ckpt_')

    errors, ok = [], True
    for i in range(STEPS):
      tokens, labels = transformer.batch(seed=i)
      for fault in faults if i == STEPS - 1 else ():
        step = fail_and_recover(
          workers, step, mesh, model, optimizer, checkpoints, tokens, labels, fault, expose
        )
      t = time.time()
      loss = step(tokens, labels)
      seconds = time.time() - t
      want = reference(tokens, labels)
      exact(tokens, labels)
      verdict = check(loss, want, f'step {i + 1} loss')
      errors.append(verdict.error)
      ok = ok and verdict.ok
      print(
        f'step {i + 1}: loss {float(loss):.7f} unpartitioned {float(want):.7f} '
        f'({seconds:.2f} s){"" if verdict.ok else " MISMATCH"}'
      )
      if faults and i == STEPS - 2:
        record = tg.save_checkpoint(step, checkpoints)
        writers = sorted({cluster.task_of(device) for device, *_ in record.slices})
        print(f'checkpoint {os.path.basename(record.prefix)} written by {writers}')
    describe_collectives(step, devices)
    report = float64_check.compare_weights(
      model.trainable_variables, ref_model.trainable_variables, exact_model.trainable_variables
    )
  print(
    f'weights: relative error {report.error:.3e} (normwise, the worst of {report.compared}: '
    f'{report.worst}; bound 1e-05)'
  )
  print('\n'.join(report.lines))
  if not report.ok:  # which state went wrong: the optimizer's slots, or the weights alone
    print_optimizer_differences(optimizer, ref_optimizer)
  print(f'max relative error vs unpartitioned: {max(errors + [report.error]):.3e}')
  return 0 if ok and report.ok else 1


def print_optimizer_differences(optimizer, ref_optimizer):
  """Each optimizer variable (iterations, slots) further than the bound from the reference's."""
  for got, want in zip(optimizer.variables, ref_optimizer.variables):
    a, b = np.asarray(got, np.float64), np.asarray(want, np.float64)
    error = np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)
    if error > 1e-5:
      print(f'  optimizer state {got.path}: normwise error {error:.3g} (zero: {not a.any()})')


def fail_and_recover(
  workers, step, mesh, model, optimizer, checkpoints, tokens, labels, fault, expose
):
  """Kill (or stop) worker 1 while steps run, see the call in flight fail, restart the workers,
  continue from the checkpoint (the steps run meanwhile are discarded by the restore)."""
  killed_at = []

  def kill():
    killed_at.append(time.time())
    (workers.stop if fault == 'hang' else workers.kill)(1)

  timer = threading.Timer(0.5, kill)
  timer.start()
  calls, started = 0, time.time()
  try:
    while True:  # back-to-back steps: the kill lands while one is running
      step(tokens, labels)
      calls += 1
      if time.time() - started > TIMEOUT + 60:
        raise SystemExit('the steps ran on although task 1 is dead')
  except tg.CollectiveError as error:
    timer.join()
    print(
      f'{"stopped task 1 (SIGSTOP)" if fault == "hang" else "killed task 1 (SIGKILL)"} '
      f'while steps ran ({calls} calls had completed)'
    )
    print(f'CollectiveError after {time.time() - killed_at[0]:.2f} s: {error}')
  t = time.time()
  # Every task restarts, not only the dead one: the failure aborted the collectives of the
  # live tasks for good, and the group leader (task 0) would refuse the new task 1
  # ("current incarnation doesn't match with one in the group").
  for task in range(TASKS):
    workers.restart(task)
  names = cluster.connect(workers.spec, DEVICES_PER_TASK, expose_to_network=expose)
  devices = cluster.mesh_devices(mesh, names, inside=('model',))
  step = partition_step(model, optimizer, mesh, devices)
  step.get_program(tokens, labels)  # makes the sharded variables on the new devices
  tg.restore_checkpoint(checkpoints, step)
  print(
    f'restarted the workers, connected again and restored the checkpoint in {time.time() - t:.1f} s'
  )
  return step


if __name__ == '__main__':
  sys.exit(main())
