"""An honest worker's commit rate beside a flood of data-plane connections that never say HELLO
(issue 37, item 2): --connections TCP connections to the data port that send nothing, each
opened again when the server closes it, from a process of their own.

    .venv/bin/python scripts/silent_flood.py --parameters 100K --connections 300 [--token T]

One `gemps server` process (defaults otherwise). Three phases, one JSON line each: a worker's
commits/s with no flood; a second worker's, registered while the flood goes on; the same
worker's --after seconds after the flood stopped and every flood socket closed (it keeps
committing meanwhile). Each line says which plane the worker's commits took. Results:
docs/RELIABILITY.md ("Silent connections").
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import selectors
import socket
from multiprocessing.synchronize import Event

import numpy as np
from gemps_bench.counts import parse_counts
from gemps_bench.honest_worker import commit_rate

import gemps
from gemps_worker.cluster import ServerProcess, free_port


def flood(port: int, count: int, opened: Event, stop: Event) -> None:
    """`count` silent connections to 127.0.0.1:`port`, each opened again once the server closes it;
    `opened` is set once the first `count` were tried."""
    selector = selectors.DefaultSelector()

    def open_one() -> None:
        try:
            sock = socket.create_connection(("127.0.0.1", port), timeout=1)
        except OSError:
            return
        sock.setblocking(False)
        selector.register(sock, selectors.EVENT_READ)

    for _ in range(count):
        open_one()
    opened.set()
    while not stop.is_set():
        for key, _events in selector.select(0.05):
            sock = key.fileobj
            assert isinstance(sock, socket.socket)
            try:
                still_open = bool(sock.recv(4096))
            except OSError:
                still_open = False
            if not still_open:
                selector.unregister(sock)
                sock.close()
        for _ in range(count - len(selector.get_map())):
            open_one()
    for key in list(selector.get_map().values()):
        key.fileobj.close()  # type: ignore[union-attr]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parameters", default="100K", help="P, e.g. 100K")
    parser.add_argument("--connections", type=int, default=300, help="silent connections kept open")
    parser.add_argument("--token", default="", help="run the server with this --auth-token")
    parser.add_argument("--window", type=float, default=5.0, help="measured seconds per phase")
    parser.add_argument("--after", type=float, default=15.0, help="seconds after the flood stops")
    args = parser.parse_args()
    (size,) = parse_counts(args.parameters)
    token = args.token or None
    context = multiprocessing.get_context("spawn")
    data_port = free_port()
    with ServerProcess(
        rule="downpour", metrics_port=-1, log_level="warning", data_port=data_port, auth_token=args.token
    ) as server:
        model = {"w": np.zeros(size, np.float32)}

        def line(phase: str, client: gemps.Client, value: float) -> None:
            fields = {"phase": phase, "parameters": size, "connections": args.connections, "token": bool(token)}
            print(json.dumps({**fields, "commits_per_s": round(value, 1), "planes": client.planes}), flush=True)

        with gemps.Client(server.target, token=token) as alone:
            alone.register(model)
            line("no flood", alone, commit_rate(alone, size, args.window))
        opened, stop = context.Event(), context.Event()
        process = context.Process(target=flood, args=(data_port, args.connections, opened, stop))
        process.start()
        try:
            opened.wait(60)
            with gemps.Client(server.target, token=token) as worker:
                worker.register(model)
                line("registered during the flood", worker, commit_rate(worker, size, args.window))
                stop.set()
                process.join(30)
                commit_rate(worker, size, args.after)
                line(f"{args.after:g} s after the flood", worker, commit_rate(worker, size, args.window))
        finally:
            stop.set()
            process.join(30)


if __name__ == "__main__":
    main()
