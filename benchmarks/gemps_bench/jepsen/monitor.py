"""Every replica's replication status, polled a few times a second from the workers' host: who is
primary under which epoch, its backups and whether each is in sync, each replica's version.

    python -m gemps_bench.jepsen.monitor --targets A|B --out monitor.jsonl --stop-file stop

Each replica is asked by a thread of its own (a paused one answers nothing until its deadline),
and every PERIOD seconds one line goes to `--out`: {"t": now, "views": {target: view or null}},
a view being the replica's latest answer with its own time ("at"). The rig reads the last line to
resolve a fault's role to a host; the checker reads them all to tell when a safe primary existed.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from pathlib import Path
from typing import Any

import gemps

PERIOD, DEADLINE = 0.25, 1.0  # seconds: between lines; each Status call's
STALE = 2.0  # seconds: a view older than this is written as null (the replica does not answer)


def view(client: gemps.Client) -> dict[str, Any]:
    status = client.status()
    found = status.replication
    if found is None:
        return {"role": "", "version": status.version}
    backups = [[b.name, b.in_sync, b.lag_commits] for b in found.backups]
    return {"name": found.name, "role": found.role, "epoch": found.epoch, "version": status.version, "backups": backups}


class Poller(threading.Thread):
    def __init__(self, target: str, stop: threading.Event) -> None:
        super().__init__(name=f"poll-{target}", daemon=True)
        self.target, self.stop = target, stop
        self.latest: dict[str, Any] | None = None

    def run(self) -> None:
        client: gemps.Client | None = None
        while not self.stop.is_set():
            try:
                client = client or gemps.Client(self.target, timeout=DEADLINE, retry=gemps.RetryPolicy(max_attempts=1))
                self.latest = {**view(client), "at": time.time()}
            except Exception:  # not answering (dead, paused, parted): say nothing new; start afresh
                if client is not None:
                    client.close()
                client = None
            self.stop.wait(PERIOD)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--targets", required=True, help="every replica, A|B")
    parser.add_argument("--out", required=True)
    parser.add_argument("--stop-file", required=True)
    args = parser.parse_args()
    stop = threading.Event()
    pollers = [Poller(target, stop) for target in args.targets.split("|")]
    for poller in pollers:
        poller.start()
    with open(args.out, "a") as out:
        while not Path(args.stop_file).exists():
            now = time.time()
            views = {
                p.target: p.latest if p.latest is not None and now - p.latest["at"] < STALE else None for p in pollers
            }
            out.write(json.dumps({"t": now, "views": views}) + "\n")
            out.flush()
            time.sleep(PERIOD)
    stop.set()


if __name__ == "__main__":
    main()
