"""A worker driven line by line, for failover tests on simulated hosts: the test writes a command
on its stdin, it answers one JSON line on stdout (`{"error": ..., "reason": ...}` when the call
failed). Commands: register, commit (a gradient of ones), pull, status, quit.

    python -m tests.failover_driver --target 10.231.0.1:50051|10.231.0.2:50051 --name x
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import numpy as np

import gemps

PARAMETERS = 1000


def answer(client: gemps.Client, command: str) -> dict[str, Any]:
    if command == "register":
        central = client.register({"w": np.zeros(PARAMETERS, np.float32)})
        return {"worker_id": client.worker_id, "version": central.version}
    if command == "commit":
        result = client.commit(np.ones(PARAMETERS, np.float32))
        return {"worker_id": client.worker_id, "version": result.version}
    if command == "pull":
        return {"worker_id": client.worker_id, "version": client.pull().version}
    if command == "status":
        status = client.status()
        role = status.replication.role if status.replication is not None else ""
        return {"version": status.version, "active_workers": status.active_workers, "role": role}
    raise ValueError(f"unknown command {command!r}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", required=True)
    parser.add_argument("--name", default="")
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds each attempt of a call may take")
    args = parser.parse_args()
    with gemps.Client(args.target, name=args.name, timeout=60.0, attempt_timeout=args.timeout) as client:
        for line in sys.stdin:
            command = line.strip()
            if command == "quit":
                break
            try:
                reply = answer(client, command)
            except gemps.GempsError as error:
                reply = {"error": error.message, "reason": str(error.reason)}
            print(json.dumps(reply), flush=True)


if __name__ == "__main__":
    main()
