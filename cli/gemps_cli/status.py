"""`gemps status`: a running server's state, for humans."""

from __future__ import annotations

import argparse
import sys

from gemps.errors import GempsError
from gemps.retry import NO_RETRY
from gemps_cli.connection import add_connection_flags, connect


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--server", default="127.0.0.1:50051", help="HOST:PORT (default 127.0.0.1:50051)")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the server")
    add_connection_flags(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    client = connect(args, timeout=args.timeout, retry=NO_RETRY)
    try:
        status = client.status()
    except GempsError as error:
        print(f"gemps status: {args.server}: {error}", file=sys.stderr)
        return 1
    finally:
        client.close()
    settings = " ".join(f"{name}={value:g}" for name, value in status.config.as_dict().items() if type(value) is float)
    print(f"server          {args.server}")
    print(f"initialized     {status.initialized}")
    print(f"version         {status.version}")
    print(f"active workers  {status.active_workers}")
    print(f"parameters      {status.num_parameters} in {len(status.spec)} tensors")
    if status.buffer_spec:
        print(f"buffers         {sum(entry.size for entry in status.buffer_spec)} in {len(status.buffer_spec)} tensors")
    print(f"commits         {status.commits_applied} applied, {status.commits_rejected} rejected")
    print(f"rule            {status.config.rule} ({settings})")
    print(f"learning rate   {status.learning_rate:g} now ({status.config.lr_schedule} schedule)")
    print(f"uptime          {status.uptime_seconds:.0f}s")
    return 0
