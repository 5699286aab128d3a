"""A checkpoint's size and time, a graceful stop's, and a restart's restore, at one model size
(issue 79, item 2: the defaults a big model meets; docs/PERFORMANCE.md, "A checkpoint and a restart
as the model grows").

A `gemps server` (GEM, checkpoints every 2W commits, none by time) and W workers (the SDK) that
register a model of P float32 parameters and commit a pre-made gradient 3 times each; the server's
log gives each checkpoint's bytes and seconds. Then SIGTERM (the final checkpoint within --shutdown-grace), and the
server started again on the same folder: the seconds until it serves, and the version it restored.

    .venv/bin/python scripts/checkpoint_cost.py --params 100M --workers 2 --out docs/results/plan/checkpoint-100m.json
"""

from __future__ import annotations

import argparse
import json
import re
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from gemps_bench.counts import parse_counts

import gemps
from gemps_worker.cluster import ServerProcess

STARTUP_TIMEOUT = 600.0  # a restore of a large θ reads it from disk first


def logged(log: Path, event: str) -> list[dict[str, str]]:
    """The fields of each `event` line of a server's text log."""
    lines = log.read_text().splitlines()
    return [
        dict(re.findall(r"(\w+)=(\S+)", line.split(f": {event} ", 1)[1])) for line in lines if f": {event} " in line
    ]


def measure(parameters: int, workers: int, folder: Path) -> dict[str, Any]:
    checkpoints, log = folder / "checkpoints", folder / "server.log"
    options: dict[str, Any] = {"rule": "gem", "checkpoint_dir": str(checkpoints), "startup_timeout": STARTUP_TIMEOUT}
    server = ServerProcess(log_path=log, checkpoint_every=2 * workers, checkpoint_interval=0, **options).start()
    clients = [gemps.Client(server.target, name=f"worker-{index}") for index in range(workers)]
    began = time.monotonic()
    for client in clients:
        client.register({"theta": np.zeros(parameters, dtype=np.float32)})
    figures: dict[str, Any] = {"parameters": parameters, "workers": workers}
    figures["registered_s"] = time.monotonic() - began
    gradient = {"theta": np.full(parameters, 1e-3, dtype=np.float32)}
    for _ in range(2):
        for client in clients:
            client.commit(gradient)
    deadline = time.monotonic() + STARTUP_TIMEOUT
    while not logged(log, "checkpoint written") and time.monotonic() < deadline:
        time.sleep(0.2)
    for client in clients:  # the version moves past the checkpoint: the stop writes a final one
        client.commit(gradient)
        client.close()
    began = time.monotonic()
    figures["stop_exit_code"] = server.stop(timeout=STARTUP_TIMEOUT)
    figures["stopped_s"] = time.monotonic() - began  # SIGTERM to exit: the final checkpoint inside
    written = logged(log, "checkpoint written")
    figures["checkpoints"] = [
        {"version": int(w["version"]), "bytes": int(w["bytes"]), "seconds": float(w["seconds"])} for w in written
    ]
    began = time.monotonic()
    again = ServerProcess(log_path=folder / "restarted.log", **options).start()
    figures["restarted_s"] = time.monotonic() - began  # until it serves: the restore inside
    with gemps.Client(again.target) as client:
        figures["restored_version"] = client.status().version
    again.close()
    return figures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", type=lambda text: parse_counts(text)[0], default=1_000_000, help="e.g. 100M")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None, help="write the figures here (JSON)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="gemps-checkpoint-cost-") as folder:
        figures = measure(args.params, args.workers, Path(folder))
    print(json.dumps(figures, indent=1))
    if args.out is not None:
        args.out.write_text(json.dumps(figures, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
