"""Every TF server tf_gspmd starts says where it listens, and needs the exposure acknowledged.

TF's gRPC server listens on all interfaces and runs any graph a client sends
(tf_gspmd/runtime/exposure.py). Each test starts a server and reads what it is bound to from
/proc/<pid>/net/tcp and tcp6 (parsed here, apart from exposure.py's reader: the LISTEN
sockets, state 0A, that the process holds), which must be what it printed; nothing but
/proc is read, no connection is made. Refusals without the acknowledgment must name it.
"""

import os
import re
import select
import signal
import socket
import struct
import subprocess
import sys
import time

import pytest
import tensorflow as tf

from tf_gspmd.export import serve as export_serve
from tf_gspmd.runtime import cluster, exposure, loopback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL='2')
NOTICE = re.compile(r'^tf_gspmd: TF gRPC server \((.+?)\) listening on (.+?) \((.+?)\)(: .*)?$')
CONFINED = loopback.available()  # None when this machine can make a loopback-only namespace
exposed_here = pytest.mark.skipif(
  exposure.loopback_only(), reason='this process has loopback only: nothing is exposed'
)


# --- what /proc says a process listens on -------------------------------------------------
def _host(hex_address: str) -> str:
  """The text form of a /proc/net/tcp{,6} address: 32-bit words, each in native order."""
  words = [int(hex_address[i : i + 8], 16) for i in range(0, len(hex_address), 8)]
  raw = struct.pack(f'={len(words)}I', *words)
  if len(raw) == 4:
    return socket.inet_ntop(socket.AF_INET, raw)
  return '[' + socket.inet_ntop(socket.AF_INET6, raw) + ']'


def bound(pid: int, port: int) -> set:
  """'host:port' of each socket process `pid` listens on at `port`."""
  fds = f'/proc/{pid}/fd'
  links = [os.readlink(os.path.join(fds, fd)) for fd in os.listdir(fds)]
  inodes = {link[len('socket:[') : -1] for link in links if link.startswith('socket:[')}
  found = set()
  for table in ('tcp', 'tcp6'):
    with open(f'/proc/{pid}/net/{table}') as f:
      for row in (line.split() for line in f.read().splitlines()[1:]):
        host, hex_port = row[1].split(':')
        if row[3] == '0A' and int(hex_port, 16) == port and row[9] in inodes:
          found.add(f'{_host(host)}:{port}')
  return found


def interfaces(pid: int) -> set:
  with open(f'/proc/{pid}/net/dev') as f:
    return {line.split(':', 1)[0].strip() for line in f.read().splitlines()[2:]}


def printed(line: str):
  """(what, {addresses}, scope, the warning or '') of a server's notice line."""
  match = NOTICE.match(line.strip())
  assert match, line
  what, addresses, scope, warning = match.groups()
  return what, set(addresses.split(', ')), scope, warning or ''


def _port_of(addresses: set) -> int:
  (port,) = {int(a.rpartition(':')[2]) for a in addresses}
  return port


# --- python -m tf_gspmd.export.serve ------------------------------------------------------------
def _serve(*args, wrap=()):
  return subprocess.Popen(
    [*wrap, sys.executable, '-m', 'tf_gspmd.export.serve', '--devices', '1', *args],
    cwd=ROOT,
    env=ENV,
    stdout=subprocess.DEVNULL,
    stderr=subprocess.PIPE,
    text=True,
  )


def _notice_of(process, wait: float = 60.0) -> str:
  """The first line `process` prints on stderr that starts as a server's notice."""
  deadline = time.monotonic() + wait
  while True:
    ready, _, _ = select.select([process.stderr], [], [], max(deadline - time.monotonic(), 0))
    assert ready, 'no line saying where the server listens'
    line = process.stderr.readline()
    assert line, f'the server exited ({process.wait()}) without saying where it listens'
    if line.startswith('tf_gspmd: TF gRPC server'):
      return line


def _child_of(pid: int) -> int:
  """The one child process of `pid` (the command loopback.py runs)."""
  with open(f'/proc/{pid}/task/{pid}/children') as f:
    (child,) = f.read().split()
  return int(child)


def _stop(process) -> None:
  process.send_signal(signal.SIGTERM)  # loopback.py passes it on to its child
  process.communicate(timeout=30)


@pytest.mark.slow  # a fresh interpreter: `make test` runs it, the edit loop not
@exposed_here
def test_serve_refuses_without_the_flag_and_names_it():
  process = _serve()
  _, err = process.communicate(timeout=60)
  assert process.returncode != 0
  assert '--expose-to-network' in err and 'not starting a TF gRPC server' in err, err


@pytest.mark.slow  # a fresh interpreter: `make test` runs it, the edit loop not
@exposed_here
def test_serve_prints_the_address_it_is_bound_to():
  port = export_serve.free_port()
  process = _serve('--port', str(port), '--expose-to-network')
  try:
    what, addresses, scope, warning = printed(_notice_of(process))
    assert bound(process.pid, port) == addresses and _port_of(addresses) == port
    assert what == 'tf_gspmd.export.serve'
    assert scope == 'all interfaces' and 'run arbitrary TensorFlow graphs' in warning
  finally:
    _stop(process)


@pytest.mark.skipif(CONFINED is not None, reason=f'no loopback-only namespace here: {CONFINED}')
@pytest.mark.slow  # a page or a fresh interpreter: `make test` runs it, the edit loop not
def test_serve_in_a_loopback_only_namespace_needs_no_flag():
  """Under `python -m tf_gspmd.runtime.loopback`, the server's namespace has lo alone."""
  wrapper = _serve(wrap=(sys.executable, '-m', 'tf_gspmd.runtime.loopback', '--'))
  try:
    _, addresses, scope, warning = printed(_notice_of(wrapper, wait=90))
    server = _child_of(wrapper.pid)
    assert bound(server, _port_of(addresses)) == addresses
    assert interfaces(server) == {'lo'} and interfaces(os.getpid()) != {'lo'}
    assert scope.startswith('a private network namespace') and not warning
  finally:
    _stop(wrapper)


# --- cluster: LocalCluster, serve, connect ------------------------------------------------------
@exposed_here
def test_cluster_servers_refuse_without_the_keyword_and_name_it():
  with pytest.raises(exposure.ExposureRefused, match=r'LocalCluster: .*expose_to_network=True'):
    cluster.LocalCluster(1, 1)
  addresses = {'worker': ['127.0.0.1:1']}  # never listened on: a refusal starts nothing
  with pytest.raises(exposure.ExposureRefused, match=r'cluster.serve .*expose_to_network=True'):
    cluster.serve(tf.train.ClusterSpec(addresses), 0, 1)
  with pytest.raises(exposure.ExposureRefused, match=r'cluster.connect.*expose_to_network=True'):
    cluster.connect(tf.train.ClusterSpec(addresses), 1)


@pytest.mark.slow  # a fresh interpreter: `make test` runs it, the edit loop not
def test_local_cluster_worker_prints_the_address_it_is_bound_to(capsys):
  with cluster.LocalCluster(1, 1, expose_to_network=True) as workers:
    what, addresses, scope, _ = printed(capsys.readouterr().err.strip().splitlines()[-1])
    port = int(workers.addresses[0].rpartition(':')[2])
    assert bound(workers.processes[0].pid, port) == addresses and _port_of(addresses) == port
    assert what == '/job:worker/replica:0/task:0'
    assert scope.startswith('a private' if exposure.loopback_only() else 'all interfaces')


@pytest.mark.skipif(CONFINED is not None, reason=f'no loopback-only namespace here: {CONFINED}')
def test_loopback_runs_a_command_with_lo_alone_and_passes_on_its_exit_code():
  # /proc/self/net/dev: two header lines, then one 'name:' line per interface.
  only_lo = 'test "$(grep : /proc/self/net/dev | cut -d: -f1 | tr -d " ")" = lo && exit 3'
  assert loopback.run(['sh', '-c', only_lo]) == 3
  with pytest.raises(OSError, match='could not run the command: no-such-command'):
    loopback.run(['no-such-command'])
