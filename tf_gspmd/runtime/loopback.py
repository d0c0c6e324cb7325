"""Run a command in a private network namespace whose only interface is loopback (up).

    python -m tf_gspmd.runtime.loopback -- python examples/multi_worker.py

TF's gRPC servers listen on all interfaces (exposure.py). Inside such a namespace all
interfaces are the loopback alone: the servers the command starts (LocalCluster's workers,
the client `cluster.connect` makes of it, `tf_gspmd.export.serve` with its client) reach
each other and nothing outside reaches them, so they need no `expose_to_network`. The
namespace has no other network at all: nothing in it can reach another machine.

Linux only. As root a network namespace is a plain unshare(CLONE_NEWNET); otherwise (or
where that is refused: a container without CAP_SYS_ADMIN) it takes a user namespace too,
unshare(CLONE_NEWUSER | CLONE_NEWNET), the user mapped to itself, which the kernel
(user.max_user_namespaces, an AppArmor or seccomp policy) may forbid; `run` then raises
OSError saying what was refused. The unshare happens in a forked child (a user namespace
needs a single-threaded process, and TF has started threads by the time this module is
imported), which brings loopback up and execs the command; the parent waits for it.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import signal
import socket
import struct
import sys
from typing import Callable, List, Optional, Sequence

CLONE_NEWNET = 0x40000000
CLONE_NEWUSER = 0x10000000
SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1
PR_SET_PDEATHSIG = 1
IFREQ = '16sH22x'  # struct ifreq on 64-bit Linux: the name, then ifr_flags in a 24-byte union
# Loaded before any fork: the child of a threaded process should do as little as it can.
_libc = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith('linux') else None


def _unshare(flags: int) -> Optional[str]:
  """unshare(2) this process; None, or why it was refused."""
  if _libc is None:
    return f'no network namespaces on {sys.platform}'
  if _libc.unshare(flags) == 0:
    return None
  errno = ctypes.get_errno()
  return f'{os.strerror(errno)} (errno {errno})'


def _write(path: str, text: str) -> None:
  with open(path, 'w') as f:
    f.write(text)


def _enter_namespace() -> None:
  """A new network namespace, in a new user namespace when a plain one is refused."""
  refused = _unshare(CLONE_NEWNET)
  if refused is None:
    return
  uid, gid = os.getuid(), os.getgid()
  also = _unshare(CLONE_NEWUSER | CLONE_NEWNET)
  if also is not None:
    raise OSError(
      f'unshare(CLONE_NEWNET) refused: {refused}; unshare(CLONE_NEWUSER | CLONE_NEWNET) '
      f'refused: {also}'
    )
  # The user is itself inside (files it writes keep their owner); setgroups must be
  # denied before an unprivileged process may map its group.
  _write('/proc/self/setgroups', 'deny')
  _write('/proc/self/uid_map', f'{uid} {uid} 1')
  _write('/proc/self/gid_map', f'{gid} {gid} 1')


def _loopback_up() -> None:
  """Set IFF_UP on lo (a new namespace's lo is down); the kernel adds 127.0.0.1 and ::1."""
  with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
    request = struct.pack(IFREQ, b'lo', 0)
    flags = struct.unpack(IFREQ, fcntl.ioctl(s, SIOCGIFFLAGS, request))[1]
    fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack(IFREQ, b'lo', flags | IFF_UP))


def confine() -> None:
  """Move this (single-threaded) process into a new network namespace with loopback up."""
  _enter_namespace()
  _loopback_up()


def _child(then: Callable[[], None], write_end: int, parent: int) -> None:
  """In the forked child: confine, then `then` (exec or exit); a failure goes to the pipe."""
  stage = 'could not make a network namespace with loopback only'
  try:
    _die_with_parent(parent)
    confine()
    stage = 'could not run the command'
    then()
  except BaseException as error:  # noqa: BLE001  (whatever failed, the parent says it)
    os.write(write_end, f'{stage}: {error or type(error).__name__}'.encode())
  os._exit(127)  # noqa: SLF001


def _die_with_parent(parent: int) -> None:
  """SIGTERM this process (kept across exec) when `parent`, waiting, dies, killed or not."""
  if _libc is not None:
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
  if os.getppid() != parent:  # it died before the prctl
    os._exit(1)  # noqa: SLF001


def _in_child(then: Callable[[], None]) -> int:
  """Fork; the child confines itself and runs `then`; the child's exit code.

  A failure in the child comes back through a pipe as OSError; a successful exec closes
  the pipe (its end is close-on-exec) with nothing written.
  """
  read_end, write_end = os.pipe()
  parent = os.getpid()
  pid = os.fork()
  if pid == 0:
    os.close(read_end)
    _child(then, write_end, parent)
  os.close(write_end)
  with os.fdopen(read_end, 'rb') as pipe:
    error = pipe.read().decode()
  # Ctrl-C reaches the child too (same process group), which decides; SIGTERM is passed on.
  interrupt = signal.signal(signal.SIGINT, signal.SIG_IGN)
  terminate = signal.signal(signal.SIGTERM, lambda *_: os.kill(pid, signal.SIGTERM))
  try:
    code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
  finally:
    signal.signal(signal.SIGINT, interrupt)
    signal.signal(signal.SIGTERM, terminate)
  if error:
    raise OSError(error)
  return code


def run(argv: Sequence[str]) -> int:
  """Run `argv` in a new network namespace with loopback only; its exit code."""
  argv = list(argv)

  def execute():
    try:
      os.execvp(argv[0], argv)
    except OSError as error:
      raise OSError(f'{argv[0]}: {error.strerror}') from None

  return _in_child(execute)


def available() -> Optional[str]:
  """None when this process can make such a namespace, else the reason it cannot."""
  try:
    _in_child(lambda: os._exit(0))  # noqa: SLF001
  except OSError as error:
    return str(error)
  return None


def main(argv: Optional[List[str]] = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  if argv[:1] == ['--']:
    argv = argv[1:]
  if not argv:
    print(__doc__.strip().splitlines()[0], file=sys.stderr)
    print('usage: python -m tf_gspmd.runtime.loopback -- COMMAND [ARG ...]', file=sys.stderr)
    return 2
  try:
    return run(argv)
  except OSError as error:
    print(f'tf_gspmd.runtime.loopback: {error}', file=sys.stderr)
    return 1


if __name__ == '__main__':
  sys.exit(main())
