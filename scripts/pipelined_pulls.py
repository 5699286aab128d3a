"""An honest worker's commit rate on the data plane, alone and beside registered connections
that pipeline PULLs and never read their replies (issue 42, item 5), from a process of their own:
each registers once, connects, says HELLO and sends --pipelined PULLs of θ, then keeps sending
more (blocked while the server does not read them), and connects again when closed.

    .venv/bin/python scripts/pipelined_pulls.py --parameters 1M --attackers 0,4 --routes tcp,shared

For each route the honest worker takes (tcp: the data port; shared: the local socket and shared
memory), one `gemps server` process (defaults otherwise); for each count of attackers, a warm-up,
then the honest worker commits for --window seconds, then a new client registers and commits
once. Prints one JSON line per count: commits/s, p50, p90 and worst latency, the new client's
seconds to its first commit, and the connections the attackers opened. Results:
docs/RELIABILITY.md ("Issue 42, item 5").
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import time
from multiprocessing.synchronize import Event
from typing import Any

import grpc
import numpy as np
from gemps_bench.counts import parse_counts
from gemps_bench.honest_worker import commit_latencies, in_threads

import gemps
from gemps import errors
from gemps.data_plane_connection import DataConnection, Unreachable
from gemps_proto import data_plane_frames
from gemps_proto.data_plane_frames import Op
from gemps_proto.v1 import parameter_server_pb2 as pb
from gemps_proto.v1 import parameter_server_pb2_grpc as pb_grpc
from gemps_worker.cluster import ServerProcess


def _attacker(target: str, size: int, pipelined: int, stop: Event, connections: list[int]) -> None:
    """Register once; connect, the handshake, pipeline PULLs without reading, until closed; again."""
    stub = pb_grpc.ParameterServerStub(grpc.insecure_channel(target))
    spec = [pb.ParameterSpec(name="w", shape=[size], dtype=pb.DTYPE_FLOAT32)]
    reply = stub.Register(pb.RegisterRequest(spec=spec, omit_parameters=True), timeout=30)
    pull = pb.PullRequest(worker_id=reply.worker_id, known_version=-1).SerializeToString()
    frame = data_plane_frames.frame_start(Op.PULL, pull)
    while not stop.is_set():
        try:
            connection = DataConnection.open("127.0.0.1", reply.data_plane.port, timeout=1.0, tls=None)
            with connection.sock as sock:
                connections[0] += 1
                connection.hello(reply.worker_id, reply.data_plane.ticket)  # the handshake, as the SDK's
                sock.sendall(frame * pipelined)
                while not stop.is_set():  # more, blocked while the server reads none: until closed
                    with contextlib.suppress(TimeoutError):  # (a frame cut short: the server closes it)
                        sock.sendall(frame)
                    time.sleep(0.05)
        except (OSError, data_plane_frames.FrameError, errors.GempsError, Unreachable):
            time.sleep(0.05)


def attackers(target: str, count: int, size: int, pipelined: int, stop: Event, opened: Any) -> None:
    in_threads(lambda connections: _attacker(target, size, pipelined, stop, connections), count, stop, opened)


def newcomer(target: str, route: str, size: int) -> float:
    """Seconds a new client takes to register and commit once."""
    began = time.monotonic()
    with gemps.Client(target, plane="data", shared_memory=route == "shared", timeout=120) as client:
        client.register({"w": np.zeros(size, np.float32)})
        client.commit(np.zeros(size, np.float32))
    return time.monotonic() - began


def one_route(route: str, size: int, counts: list[int], pipelined: int, window: float, warmup: float) -> None:
    context = multiprocessing.get_context("spawn")
    with ServerProcess(rule="downpour", metrics_port=-1, log_level="warning") as server:
        client = gemps.Client(server.target, plane="data", shared_memory=route == "shared", timeout=120)
        with client:
            client.register({"w": np.zeros(size, np.float32)})
            for count in counts:
                stop, opened = context.Event(), context.Value("i", 0)
                process = context.Process(target=attackers, args=(server.target, count, size, pipelined, stop, opened))
                process.start()
                commit_latencies(client, size, warmup)  # the attackers register, connect and pipeline
                latencies = commit_latencies(client, size, window)
                joined = newcomer(server.target, route, size)
                stop.set()
                process.join(120)
                milliseconds = np.array(latencies) * 1e3
                line = {
                    "route": route,
                    "parameters": size,
                    "attackers": count,
                    "pipelined": pipelined,
                    "commits_per_s": round(len(latencies) / window, 1),
                    "p50_ms": round(float(np.percentile(milliseconds, 50)), 1),
                    "p90_ms": round(float(np.percentile(milliseconds, 90)), 1),
                    "worst_ms": round(float(milliseconds.max()), 1),
                    "newcomer_s": round(joined, 2),
                    "attacker_connections": opened.value,
                }
                print(json.dumps(line), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parameters", default="1M", help="P, e.g. 1M")
    parser.add_argument("--attackers", default="0,4", help="counts of pipelining connections, measured in turn")
    parser.add_argument("--routes", default="tcp,shared", help="the honest worker's routes: tcp, shared")
    parser.add_argument("--pipelined", type=int, default=16, help="PULLs each attacker sends before reading")
    parser.add_argument("--window", type=float, default=10.0, help="measured seconds per count")
    parser.add_argument("--warmup", type=float, default=2.0, help="seconds after the attackers start")
    args = parser.parse_args()
    (size,) = parse_counts(args.parameters)
    counts = [int(count) for count in args.attackers.split(",")]
    for route in args.routes.split(","):
        one_route(route, size, counts, args.pipelined, args.window, args.warmup)


if __name__ == "__main__":
    main()
