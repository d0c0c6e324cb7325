"""A local TF device server with N CPU devices, for TF1 clients of a tf_gspmd SavedModel.

`saved_model_cli run` (and any TF1 `Session`) opens a session with one CPU
device, while an export of an N-partition program needs N devices. Pointed at
this server with `--worker grpc://localhost:PORT`, the session runs on the
server's devices instead:

    python -m tf_gspmd.export.serve --export DIR --port 2222 --expose-to-network &
    saved_model_cli run --dir DIR --tag_set serve --signature_def serving_default \\
        --inputs 'x=x.npy' --worker grpc://localhost:2222

The server is a one-task cluster whose job is named `localhost`, so its device
names are the ones the export was placed on (`/job:localhost/replica:0/task:0/
device:CPU:k`); `device_count` in its session config gives it N CPU devices (a
gRPC server builds its devices from that config, not from the process's
logical device configuration). A step's collectives need a collective executor,
which the session grants because the export carries a collective key marker
(`saved_model._add_session_collective_key`).

TF's server listens on all interfaces, not only localhost, and runs any graph a
client sends (runtime/exposure.py): the command refuses to start without
`--expose-to-network`, which acknowledges that, unless it runs in a network
namespace with loopback only (`python -m tf_gspmd.runtime.loopback -- sh -c '...'`
with its client). Once serving it prints, on stderr, the address it is bound to
and what that exposes; the first line on stdout is `tf_gspmd device server:
grpc://localhost:PORT, N CPU devices`. The server then runs until the process is
stopped.
"""

from __future__ import annotations

import argparse
import socket
import sys
from typing import Optional, Sequence

import tensorflow as tf

from tf_gspmd.runtime import exposure

JOB = 'localhost'  # the job name in the devices of an export saved in a local process
FLAG = '--expose-to-network'  # acknowledges that the server's port is reachable from the network


def free_port() -> int:
  """A TCP port nothing listens on now (the OS picks it)."""
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
    probe.bind(('localhost', 0))
    return probe.getsockname()[1]


def start(devices: int, port: int = 0, *, expose_to_network: bool = False) -> tf.distribute.Server:
  """A started in-process server on `port` (0: a free one) with `devices` CPU devices.

  It listens on all interfaces (TF has no other choice): `expose_to_network=True`
  acknowledges that, else it refuses (exposure.ExposureRefused) outside a loopback-only
  network namespace. Prints the address it is bound to on stderr.
  """
  if devices < 1:
    raise ValueError(f'tf_gspmd.export.serve: --devices must be at least 1, got {devices}.')
  exposure.require(expose_to_network, 'tf_gspmd.export.serve', f'{FLAG} (expose_to_network=True)')
  port = port or free_port()
  cluster = tf.train.ClusterSpec({JOB: [f'localhost:{port}']})
  config = tf.compat.v1.ConfigProto(device_count={'CPU': devices})
  server = tf.distribute.Server(cluster, job_name=JOB, task_index=0, config=config, start=True)
  exposure.announce('tf_gspmd.export.serve', port)
  return server


def devices_of_export(export_dir: str) -> int:
  """How many devices the tf_gspmd SavedModel in `export_dir` runs on (its metadata says)."""
  from tf_gspmd.export.saved_model import metadata

  meta = metadata(export_dir)
  kinds = {tf.DeviceSpec.from_string(d).device_type for d in meta['devices']}
  if kinds != {'CPU'}:
    raise ValueError(
      f'tf_gspmd.export.serve: {export_dir} runs on {sorted(kinds)} devices; this server '
      'provides CPU devices only.'
    )
  return int(meta['num_partitions'])


def main(argv: Optional[Sequence[str]] = None) -> None:
  parser = argparse.ArgumentParser(
    prog='python -m tf_gspmd.export.serve',
    description='A local TF gRPC server with N CPU devices for saved_model_cli run --worker.',
  )
  count = parser.add_mutually_exclusive_group(required=True)
  count.add_argument('--devices', type=int, help='number of CPU devices')
  count.add_argument(
    '--export', help='a tf_gspmd SavedModel directory: as many devices as it needs'
  )
  parser.add_argument('--port', type=int, default=0, help='the port (default: a free one)')
  parser.add_argument(
    FLAG,
    action='store_true',
    help='acknowledge that the port is reachable from the network: TF listens on all '
    'interfaces and runs any graph a client sends, file reads and writes included',
  )
  args = parser.parse_args(argv)
  devices = args.devices if args.devices is not None else devices_of_export(args.export)
  try:
    server = start(devices, args.port, expose_to_network=args.expose_to_network)
  except exposure.ExposureRefused as refused:
    raise SystemExit(str(refused)) from None
  print(f'tf_gspmd device server: {server.target}, {devices} CPU devices', flush=True)
  server.join()


if __name__ == '__main__':
  main(sys.argv[1:])
