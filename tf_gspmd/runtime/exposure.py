"""What a TF gRPC server started by tf_gspmd exposes: acknowledged before, said once it runs.

TF's gRPC server (`tf.distribute.Server`, and the one
`tf.config.experimental_connect_to_cluster` starts in the client) listens on every
interface whatever host its ClusterSpec names: grpc_server_lib.cc binds `0.0.0.0:<port>`,
which gRPC opens as `[::]` (IPv4 too), and has no option to bind one interface. It runs any
graph a client sends it, file reads and writes included; TF's security guidance is to run
it on trusted networks only. So every server tf_gspmd starts

* first calls `require(acknowledged, who, how)`: it refuses (`ExposureRefused`, naming the
  flag or keyword `how`) unless the caller acknowledged that the port is reachable from
  the network, or the process is in a network namespace whose only interface is loopback
  (`loopback_only`; `python -m tf_gspmd.runtime.loopback -- COMMAND` makes one), where
  nothing outside can reach it;
* once it listens, calls `announce(what, port)`: one line on stderr with the address it is
  bound to, read back from /proc/self/net/tcp and tcp6 (not assumed), and what that exposes.
"""

from __future__ import annotations

import ipaddress
import os
import sys
from typing import List, Optional, Set, TextIO, Union

EXPOSED = (
  'any host that reaches this port can run arbitrary TensorFlow graphs here, including file '
  'reads and writes; use only on a trusted network'
)
LISTEN = '0A'  # the TCP state column of /proc/net/tcp: TCP_LISTEN


class ExposureRefused(RuntimeError):
  """A TF server was not started: it would be reachable from the network, unacknowledged."""


def loopback_only() -> bool:
  """Whether this process's network namespace has no interface but loopback."""
  # /proc/self/net (not /sys/class/net, which shows the namespace sysfs was mounted in).
  try:
    with open('/proc/self/net/dev') as f:
      names = {line.split(':', 1)[0].strip() for line in f.read().splitlines()[2:]}
  except OSError:
    return False
  return names == {'lo'}


def require(acknowledged: bool, who: str, how: str) -> None:
  """Raise ExposureRefused naming `how` unless acknowledged or confined to loopback."""
  if acknowledged or loopback_only():
    return
  raise ExposureRefused(
    f'{who}: not starting a TF gRPC server without {how}. TF binds its server to all '
    'interfaces (0.0.0.0; there is no option to bind one), and it runs any TensorFlow graph '
    'a client sends, file reads and writes included. Pass '
    f'{how} to acknowledge that the port is reachable from the network (use only on a '
    'trusted network), or run in a private network namespace with loopback only: '
    'python -m tf_gspmd.runtime.loopback -- COMMAND.'
  )


# --- what is bound, read back from /proc ------------------------------------------------------
def _ip(hex_address: str) -> Union[ipaddress.IPv4Address, ipaddress.IPv6Address]:
  """The address of a /proc/net/tcp{,6} column: 32-bit words each printed in host order."""
  raw = bytes.fromhex(hex_address)
  if sys.byteorder == 'little':
    raw = b''.join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
  return ipaddress.ip_address(raw)


def _socket_inodes(pid: str) -> Set[str]:
  """The inodes of the sockets process `pid` holds open."""
  inodes = set()
  fds = f'/proc/{pid}/fd'
  for fd in os.listdir(fds):
    try:
      target = os.readlink(os.path.join(fds, fd))
    except OSError:  # closed meanwhile
      continue
    if target.startswith('socket:['):
      inodes.add(target[len('socket:[') : -1])
  return inodes


def listening(port: int, pid: str = 'self') -> List[str]:
  """'host:port' of each TCP socket process `pid` listens on at `port` ([::] for IPv6)."""
  try:
    inodes = _socket_inodes(pid)
  except OSError:
    return []
  found = []
  for table in ('tcp', 'tcp6'):
    try:
      with open(f'/proc/{pid}/net/{table}') as f:
        rows = [line.split() for line in f.read().splitlines()[1:]]
    except OSError:
      continue
    for row in rows:
      host, _, hex_port = row[1].partition(':')
      if row[3] == LISTEN and int(hex_port, 16) == port and row[9] in inodes:
        ip = _ip(host)
        found.append(f'[{ip}]:{port}' if ip.version == 6 else f'{ip}:{port}')
  return found


PRIVATE = 'a private network namespace whose only interface is loopback: reachable from it alone'


def _scope(addresses: List[str]) -> str:
  """Who can reach a server listening on `addresses`."""
  if loopback_only():
    return PRIVATE
  hosts = [ipaddress.ip_address(a.rsplit(':', 1)[0].strip('[]')) for a in addresses]
  if all(h.is_loopback for h in hosts):
    return 'loopback only'
  return 'all interfaces' if any(h.is_unspecified for h in hosts) else 'these interfaces'


def notice(what: str, port: int) -> str:
  """The line `announce` prints for a server of this process listening on `port`."""
  addresses = listening(port)
  if addresses:
    scope = _scope(addresses)
    where = f'{", ".join(addresses)} ({scope})'
  else:  # not found in /proc (not Linux?): what TF does, said as such
    scope = ''
    where = f'port {port} of all interfaces (TF binds 0.0.0.0; not read back from /proc)'
  line = f'tf_gspmd: TF gRPC server ({what}) listening on {where}'
  return line if scope == PRIVATE else f'{line}: {EXPOSED}'


def announce(what: str, port: int, file: Optional[TextIO] = None) -> str:
  """Print `notice(what, port)` on stderr (or `file`) and return it."""
  line = notice(what, port)
  print(line, file=file or sys.stderr, flush=True)
  return line
