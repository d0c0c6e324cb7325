"""The same SPMD program over the devices of several TF tasks (processes).

Nothing here moves data: TF's distributed runtime does. Each task is a
`tf.distribute.Server` (gRPC) with some CPU devices; the client (the process
that calls the partitioned function) joins the cluster with
`tf.config.experimental_connect_to_cluster`, after which the tasks' devices
(`/job:worker/replica:0/task:k/device:CPU:d`) are ordinary device names to it.
The launcher's outer function places partition p's call op on its device, TF
ships each task its part of the function, and the collective V2 ops of
different tasks meet over gRPC (their group leader is task 0 of the job, which
`experimental_connect_to_cluster` configures).

This module only says *which* device runs which partition and how to start,
connect to and stop tasks:

* `serve(spec, task, devices_per_task, expose_to_network=True)`: a worker's whole life
  (blocks).
  Devices come from the server's `ConfigProto.device_count`: a server ignores
  the process's `tf.config.set_logical_device_configuration`.
* `connect(spec, devices_per_task, expose_to_network=True)`: join the cluster as the
  client (which serves too); returns each task's devices.
* `mesh_devices(mesh, task_devices, inside=('model',))`: the device of every
  partition, laid out so that the groups along `inside` each stay inside one
  task (their collectives never leave the process), the other axes spread over
  tasks.
* `LocalCluster`: worker processes with loopback addresses for examples and tests
  (start, kill a task, restart it).
* `raise_if_task_lost(devices, error, what)`: a `CollectiveError` naming the task a
  TF error says is gone (its address and the partitions it ran).

Every TF server listens on all interfaces, whatever address the spec gives it, and runs
any graph a client sends (`exposure.py`): `serve`, `connect` and `LocalCluster` refuse
to start one unless `expose_to_network=True` acknowledges that, or the process runs in a
network namespace with loopback only (`python -m tf_gspmd.runtime.loopback -- COMMAND`:
the client, and the LocalCluster workers it starts, then reach each other and nothing
outside does). Each server prints the address it is bound to when it starts.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from typing import Dict, List, Optional, Sequence

import numpy as np
import tensorflow as tf

from tf_gspmd.runtime import exposure

JOB = 'worker'
CLIENT_JOB = 'localhost'  # the job of the process that calls the partitioned function
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_client_address: Optional[str] = None  # this process's address in the cluster, once connected
# How many times `connect` ran: shards made before the last connect live in a remote context
# that is gone (runtime.ShardedVariable records the count it was made under).
_connections = [0]


def connection_count() -> int:
  return _connections[0]


# --- names ------------------------------------------------------------------------------------
def task_name(job: str, task: int) -> str:
  return f'/job:{job}/replica:0/task:{task}'


def device_name(job: str, task: int, index: int, device_type: str = 'CPU') -> str:
  return f'{task_name(job, task)}/device:{device_type}:{index}'


def task_devices(
  spec: tf.train.ClusterSpec, devices_per_task: int, job: str = JOB, device_type: str = 'CPU'
) -> List[List[str]]:
  """Per task of `job`, in task order, the names of its devices."""
  return [
    [device_name(job, t, d, device_type) for d in range(devices_per_task)]
    for t in spec.task_indices(job)
  ]


def task_of(device: str) -> str:
  """'/job:worker/replica:0/task:1' for any device of that task."""
  parsed = tf.DeviceSpec.from_string(device)
  return task_name(parsed.job or 'localhost', parsed.task or 0)


# --- the mesh over tasks ------------------------------------------------------------------
def mesh_devices(mesh, task_devices_: Sequence[Sequence[str]], inside: Sequence[str] = ()) -> tuple:
  """The device of each partition (mesh device id) so that every group along `inside` stays
  inside one task.

  The devices are ranked with the `inside` axes varying fastest (then the other
  axes row-major) and filled task by task: a group along `inside` is a run of
  consecutive ranks, so it lies in one task whenever its size divides the
  devices per task. The collectives over `inside` then never leave a process;
  those over the other axes cross tasks. Returns a tuple indexed by device id,
  the `devices=` of `tg.partition`.
  """
  axes = tuple(mesh.axis_names)
  inside = tuple(inside)
  for axis in inside:
    if axis not in axes:
      raise ValueError(f'mesh_devices: {axis!r} is not an axis of the mesh {axes}.')
  per_task = {len(devices) for devices in task_devices_}
  if len(per_task) != 1:
    raise ValueError(
      f'mesh_devices: tasks hold different numbers of devices '
      f'{[len(d) for d in task_devices_]}; give each task the same count.'
    )
  per_task = per_task.pop()
  total = per_task * len(task_devices_)
  if total != mesh.size:
    raise ValueError(
      f'mesh_devices: {len(task_devices_)} tasks x {per_task} devices = {total} '
      f'devices for a mesh of {mesh.size} ({mesh.shape}).'
    )
  group = int(np.prod([mesh.axis_size(a) for a in inside], dtype=np.int64))
  if per_task % group:
    raise ValueError(
      f'mesh_devices: a group along {inside} has {group} devices, which do not fit evenly in '
      f'a task of {per_task} devices; such groups would straddle tasks.'
    )
  outside = [a for a in axes if a not in inside]
  order = [axes.index(a) for a in outside + list(inside)]  # inside axes last = fastest
  ids = np.transpose(mesh.device_ids, order).reshape(-1)
  flat = [d for devices in task_devices_ for d in devices]
  placed = [None] * mesh.size
  for rank, device_id in enumerate(ids):
    placed[int(device_id)] = flat[rank]
  return tuple(placed)


# --- servers and the client -----------------------------------------------------------------
def free_ports(count: int) -> List[int]:
  """`count` distinct TCP ports free on the loopback interface right now."""
  sockets, ports = [], []
  try:
    for _ in range(count):
      s = socket.socket()
      s.bind(('127.0.0.1', 0))
      sockets.append(s)
      ports.append(s.getsockname()[1])
  finally:
    for s in sockets:
      s.close()
  return ports


def server_config(devices_per_task: int, job: str = JOB) -> tf.compat.v1.ConfigProto:
  """A worker's ConfigProto: its CPU device count and the job's collective group leader."""
  config = tf.compat.v1.ConfigProto(device_count={'CPU': int(devices_per_task)})
  config.experimental.collective_group_leader = task_name(job, 0)
  return config


def serve(
  spec: tf.train.ClusterSpec,
  task: int,
  devices_per_task: int,
  job: str = JOB,
  ready_file: Optional[str] = None,
  *,
  expose_to_network: bool = False,
) -> None:
  """Run task `task` of `job` until the process is killed.

  The server listens on all interfaces: `expose_to_network=True` acknowledges that (see
  the module's docstring). Prints the address it is bound to on stderr and, once serving,
  writes that line to `ready_file`.
  """
  what = task_name(job, task)
  exposure.require(expose_to_network, f'cluster.serve ({what})', 'expose_to_network=True')
  server = tf.distribute.Server(
    spec, job_name=job, task_index=task, config=server_config(devices_per_task, job), start=True
  )
  line = exposure.announce(what, _port(spec.task_address(job, task)))
  if ready_file:
    with open(ready_file + '.tmp', 'w') as f:
      f.write(line)
    os.replace(ready_file + '.tmp', ready_file)
  server.join()


def _port(address: str) -> int:
  return int(address.rpartition(':')[2])


def connect(
  spec: tf.train.ClusterSpec,
  devices_per_task: int,
  job: str = JOB,
  *,
  expose_to_network: bool = False,
) -> List[List[str]]:
  """Join `spec` as its client and return each task's device names (checked to exist).

  The client serves too (the tasks call back into it), on all interfaces:
  `expose_to_network=True` acknowledges that (see the module's docstring). A ClusterSpec
  (not a resolver, whose empty master makes TF treat it as a local run and connect
  nothing). Connecting again, after a task restarted, replaces the remote context:
  handles to the old remote tensors and variables are invalid afterwards, so partition
  again and restore from a checkpoint.
  """
  exposure.require(expose_to_network, 'cluster.connect', 'expose_to_network=True')
  _connections[0] += 1
  jobs = spec.as_dict()
  if CLIENT_JOB not in jobs:
    # The client's own address must stay the same across connections: left out,
    # connect_to_cluster picks a new port each time while the client keeps serving on the
    # first one, and a restarted task then cannot reach the client (Connection refused).
    global _client_address
    _client_address = _client_address or f'localhost:{free_ports(1)[0]}'
    jobs[CLIENT_JOB] = [_client_address]
  with_client = tf.train.ClusterSpec(jobs)
  tf.config.experimental_connect_to_cluster(with_client, job_name=CLIENT_JOB)
  names = task_devices(spec, devices_per_task, job)
  # Listing the devices initializes the eager context, which starts the client's server.
  known = {tf.DeviceSpec.from_string(d.name).to_string() for d in tf.config.list_logical_devices()}
  client = task_name(CLIENT_JOB, 0)
  exposure.announce(f'the client {client}', _port(with_client.task_address(CLIENT_JOB, 0)))
  missing = [
    d for devices in names for d in devices if tf.DeviceSpec.from_string(d).to_string() not in known
  ]
  if missing:
    raise ValueError(
      f'connect: the cluster has no devices {missing[:4]}; start each task with '
      f'{devices_per_task} devices (server_config).'
    )
  return names


# --- failures ----------------------------------------------------------------------------------
def task_addresses() -> Dict[str, str]:
  """Task name -> address of the cluster this process is connected to (empty when none)."""
  # context.get_server_def is TF-private; it is where connect_to_cluster keeps the ClusterDef.
  from tf_gspmd.tf_private import context

  server_def = context.get_server_def()
  if server_def is None:
    return {}
  return {
    task_name(job.name, t): address
    for job in server_def.cluster.job
    for t, address in job.tasks.items()
  }


def lost_tasks(devices: Sequence[str], error: Exception) -> List[str]:
  """The tasks among those running `devices` that are unreachable after a TF error.

  Only UNAVAILABLE errors mean a task is gone. The tasks whose server no longer
  accepts a connection are the lost ones. Only when every server still answers
  (a network failure that passed) do the tasks the error names count: TF names a
  task by its name ('/job:worker/replica:0/task:1', in 'remote target ...') or its
  address ('127.0.0.1:port'), and may name a live task whose collectives the
  lost one aborted, so the names alone can blame the wrong task.
  """
  if not isinstance(error, tf.errors.UnavailableError):
    return []
  text = str(error)
  addresses = task_addresses()
  tasks = sorted({task_of(d) for d in devices})
  dead = [t for t in tasks if addresses.get(t) and not _accepts_connections(addresses[t])]
  if dead:
    return dead
  return [
    t
    for t in tasks
    if re.search(re.escape(t) + r'(?!\d)', text) or (addresses.get(t) and addresses[t] in text)
  ]


def _accepts_connections(address: str, timeout: float = 1.0) -> bool:
  """Whether a TCP connection to `address` ('host:port') opens: a killed server's does not."""
  host, _, port = address.rpartition(':')
  try:
    with socket.create_connection((host.strip('[]'), int(port)), timeout=timeout):
      return True
  except (OSError, ValueError):
    return False


def raise_if_task_lost(devices: Sequence[str], error: Exception, what: str) -> None:
  """Raise a CollectiveError naming the unreachable task(s), their addresses and partitions."""
  # Imported here: a LocalCluster worker runs this file as a script, without the package.
  from tf_gspmd.runtime.errors import CollectiveError

  tasks = lost_tasks(devices, error)
  if not tasks:
    return
  addresses = task_addresses()
  lines = []
  for task in tasks:
    partitions = [p for p, d in enumerate(devices) if task_of(d) == task]
    lines.append(
      f'{what}: task {task} ({addresses.get(task, "address unknown")}), which runs '
      f'partitions {partitions}, is unreachable: it died or lost its network.'
    )
  lines.append(
    f'(TF reported {type(error).__name__}: {_root_cause(str(error))}.) Its devices and '
    'the variable shards they held are gone, and the failure aborted the collectives '
    'of the other tasks: restart every task, connect again '
    '(tf_gspmd.runtime.cluster.connect), partition again and restore the last '
    'checkpoint (tg.restore_checkpoint).'
  )
  raise CollectiveError('\n'.join(lines)) from error


def _root_cause(message: str) -> str:
  """The first 'UNAVAILABLE: ...' line of a TF error (the gRPC failure), else its first line."""
  for line in message.splitlines():
    if 'UNAVAILABLE:' in line:
      return line.split('UNAVAILABLE:', 1)[1].strip()
  return message.strip().splitlines()[0] if message.strip() else ''


# --- local worker processes ---------------------------------------------------------------
class LocalCluster:
  """`tasks` worker processes at loopback addresses, each with `devices_per_task` CPU devices.

  For examples and tests: `with LocalCluster(2, 4, expose_to_network=True) as cluster:`
  starts them (each a `serve`, each printing on this process's stderr the address it is
  bound to), `cluster.spec` is the ClusterSpec to `connect` to, `kill(task)` sends
  SIGKILL, `restart(task)` starts it again on its port. The servers listen on all
  interfaces, not loopback alone: without `expose_to_network=True` it refuses, unless
  this process runs in a network namespace with loopback only
  (`python -m tf_gspmd.runtime.loopback -- COMMAND`).
  """

  def __init__(
    self,
    tasks: int,
    devices_per_task: int,
    job: str = JOB,
    *,
    start_timeout: float = 60.0,
    workdir: Optional[str] = None,
    expose_to_network: bool = False,
  ):
    import tempfile

    exposure.require(expose_to_network, 'LocalCluster', 'expose_to_network=True')
    self.job = job
    self.devices_per_task = int(devices_per_task)
    self.start_timeout = start_timeout
    self.addresses = [f'127.0.0.1:{p}' for p in free_ports(tasks)]
    self.spec = tf.train.ClusterSpec({job: self.addresses})
    self._workdir = workdir or tempfile.mkdtemp(prefix='tf_gspmd_cluster_')
    self.processes: List[Optional[subprocess.Popen]] = [None] * tasks

  def __enter__(self) -> 'LocalCluster':
    self.start()
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def _ready_file(self, task: int) -> str:
    return os.path.join(self._workdir, f'task{task}.ready')

  def _launch(self, task: int) -> None:
    ready = self._ready_file(task)
    if os.path.exists(ready):
      os.remove(ready)
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL=os.environ.get('TF_CPP_MIN_LOG_LEVEL', '2'))
    # The worker runs this file as a script and imports tf_gspmd.runtime.exposure: from
    # the package this one is, whatever the caller's sys.path.
    env['PYTHONPATH'] = os.pathsep.join(filter(None, [_PACKAGE_ROOT, env.get('PYTHONPATH')]))
    log = open(os.path.join(self._workdir, f'task{task}.log'), 'ab')
    self.processes[task] = subprocess.Popen(
      [
        sys.executable,
        os.path.abspath(__file__),
        json.dumps(self.spec.as_dict()),
        str(task),
        str(self.devices_per_task),
        self.job,
        ready,
      ],
      stdout=log,
      stderr=subprocess.STDOUT,
      env=env,
    )
    log.close()

  def _wait_ready(self, tasks: Sequence[int]) -> None:
    deadline = time.time() + self.start_timeout
    for task in tasks:
      while not os.path.exists(self._ready_file(task)):
        process = self.processes[task]
        if process.poll() is not None:
          raise RuntimeError(
            f'LocalCluster: {task_name(self.job, task)} exited with '
            f'{process.returncode} before serving; see {self.log(task)}.'
          )
        if time.time() > deadline:
          raise TimeoutError(
            f'LocalCluster: {task_name(self.job, task)} did not start within '
            f'{self.start_timeout:g} s; see {self.log(task)}.'
          )
        time.sleep(0.05)

  def start(self) -> None:
    for task in range(len(self.processes)):
      self._launch(task)
    self._wait_ready(range(len(self.processes)))
    self._relay_notices(range(len(self.processes)))

  def _relay_notices(self, tasks: Sequence[int]) -> None:
    """Print each worker's line saying where it listens (its own output goes to its log)."""
    for task in tasks:
      with open(self._ready_file(task)) as f:
        print(f.read(), file=sys.stderr, flush=True)

  def log(self, task: int) -> str:
    return os.path.join(self._workdir, f'task{task}.log')

  def kill(self, task: int) -> None:
    """SIGKILL task `task` (no chance to say goodbye) and reap it."""
    process = self.processes[task]
    if process is not None and process.poll() is None:
      process.send_signal(signal.SIGKILL)
      process.wait()

  def stop(self, task: int) -> None:
    """SIGSTOP task `task`: it hangs without dying (its port still accepts connections)."""
    process = self.processes[task]
    if process is not None and process.poll() is None:
      process.send_signal(signal.SIGSTOP)

  def restart(self, task: int) -> None:
    """Start task `task` again, on the same address, after it died or was killed."""
    self.kill(task)
    self._launch(task)
    self._wait_ready([task])
    self._relay_notices([task])

  def close(self) -> None:
    for task in range(len(self.processes)):
      self.kill(task)


def _exit_with_parent() -> None:
  """End this worker when the process that started it is gone (no orphaned servers)."""
  import threading

  parent = os.getppid()

  def watch():
    while os.getppid() == parent:
      time.sleep(0.5)
    os._exit(1)  # noqa: SLF001

  threading.Thread(target=watch, daemon=True).start()


if __name__ == '__main__':  # a LocalCluster worker: spec task devices_per_task job ready_file
  _spec, _task, _count, _job, _ready = sys.argv[1:6]
  _exit_with_parent()
  # LocalCluster, which started this worker in its own network namespace, required the
  # acknowledgment (or found that namespace confined to loopback).
  spec_ = tf.train.ClusterSpec(json.loads(_spec))
  serve(spec_, int(_task), int(_count), _job, _ready, expose_to_network=True)
