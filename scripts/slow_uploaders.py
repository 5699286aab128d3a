"""An honest worker's commit latency on the data plane, alone and beside slow uploaders (issue 37,
item 1): registered workers that each announce a commit of P values and send its bytes at
--rate-mb MiB/s (just above the server's --min-stream-rate-mb floor by default), reconnecting
when dropped, as many as --uploaders says, from a process of their own.

    .venv/bin/python scripts/slow_uploaders.py --parameters 1M --uploaders 0,4,16 --routes tcp,shared

For each route the honest worker takes (tcp: the data port; shared: the local socket and shared
memory), one `gemps server` process (defaults otherwise); for each count of uploaders, a warm-up,
then the honest worker commits for --window seconds. Prints one JSON line per count: commits,
p50 and p90 latency, and how many uploads the uploaders completed meanwhile. Results:
docs/RELIABILITY.md ("Slow uploads").
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import socket
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
from gemps_proto.data_plane_frames import REPLY, Op
from gemps_proto.v1 import parameter_server_pb2 as pb
from gemps_proto.v1 import parameter_server_pb2_grpc as pb_grpc
from gemps_worker.cluster import ServerProcess

CHUNK = 64 << 10  # bytes an uploader sends at a time


def _exactly(sock: socket.socket, size: int) -> bytes:
    data = bytearray(size)
    view, filled = memoryview(data), 0
    while filled < size:
        count = sock.recv_into(view[filled:])
        if not count:
            raise ConnectionError("closed")
        filled += count
    return bytes(data)


def _upload_once(sock: socket.socket, worker_id: str, size: int, rate: float) -> bool:
    """One commit whose payload goes at `rate` bytes/s; True when it was applied."""
    header = pb.CommitRequest(
        worker_id=worker_id,
        kind=pb.PAYLOAD_KIND_GRADIENT,
        payload=pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[size]),
    ).SerializeToString()
    sock.sendall(data_plane_frames.frame_start(Op.COMMIT, header, 4 * size))
    chunk, left, due = bytes(CHUNK), 4 * size, time.monotonic()
    while left:
        due = max(due, time.monotonic()) + min(CHUNK, left) / rate  # never faster than `rate`, even after a wait
        sock.sendall(chunk[: min(CHUNK, left)])
        left -= min(CHUNK, left)
        time.sleep(max(0.0, due - time.monotonic()))
    preamble = data_plane_frames.read_preamble(_exactly(sock, data_plane_frames.PREAMBLE.size))
    _exactly(sock, preamble.header_bytes)
    _exactly(sock, preamble.payload_bytes)
    return preamble.op == Op.COMMIT | REPLY


def _uploader(target: str, size: int, rate: float, stop: Event, done: list[int]) -> None:
    """Register once; connect, HELLO and upload until dropped, then connect again (and register
    again only when the HELLO is refused)."""
    stub = pb_grpc.ParameterServerStub(grpc.insecure_channel(target))
    spec = [pb.ParameterSpec(name="w", shape=[size], dtype=pb.DTYPE_FLOAT32)]
    reply: pb.RegisterResponse | None = None
    while not stop.is_set():
        try:
            if reply is None:
                reply = stub.Register(pb.RegisterRequest(spec=spec), timeout=30)
            connection = DataConnection.open("127.0.0.1", reply.data_plane.port, timeout=60, tls=None)
            with connection.sock as sock:
                try:  # the handshake, as the SDK does it
                    connection.hello(reply.worker_id, reply.data_plane.ticket)
                except errors.GempsError:
                    reply = None  # forgotten (or refused): register again
                    continue
                while not stop.is_set() and _upload_once(sock, reply.worker_id, size, rate):
                    done[0] += 1
        except (OSError, grpc.RpcError, data_plane_frames.FrameError, Unreachable):
            time.sleep(0.1)  # dropped or refused: connect again


def uploaders(target: str, count: int, size: int, rate: float, stop: Event, completed: Any) -> None:
    """`count` slow uploaders in threads until `stop`; `completed` gets the uploads applied."""
    in_threads(lambda done: _uploader(target, size, rate, stop, done), count, stop, completed)


def one_route(route: str, size: int, counts: list[int], rate: float, window: float, warmup: float) -> None:
    context = multiprocessing.get_context("spawn")
    with ServerProcess(rule="downpour", metrics_port=-1, log_level="warning") as server:
        client = gemps.Client(server.target, plane="data", shared_memory=route == "shared", timeout=120)
        with client:
            client.register({"w": np.zeros(size, np.float32)})
            for count in counts:
                stop, completed = context.Event(), context.Value("i", 0)
                process = context.Process(target=uploaders, args=(server.target, count, size, rate, stop, completed))
                process.start()
                commit_latencies(client, size, warmup)  # the uploaders register, connect and start
                latencies = commit_latencies(client, size, window)
                stop.set()
                process.join(120)
                milliseconds = np.array(latencies) * 1e3
                line = {
                    "route": route,
                    "parameters": size,
                    "uploaders": count,
                    "rate_mib_s": rate / (1 << 20),
                    "commits": len(latencies),
                    "window_s": window,
                    "p50_ms": round(float(np.percentile(milliseconds, 50)), 1),
                    "p90_ms": round(float(np.percentile(milliseconds, 90)), 1),
                    "uploads_completed": completed.value,
                }
                print(json.dumps(line), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parameters", default="1M", help="P, e.g. 1M")
    parser.add_argument("--uploaders", default="0,4,16", help="counts of slow uploaders, measured in turn")
    parser.add_argument("--routes", default="tcp,shared", help="the honest worker's routes: tcp, shared")
    parser.add_argument("--rate-mb", type=float, default=1.25, help="each uploader's rate, MiB/s")
    parser.add_argument("--window", type=float, default=8.0, help="measured seconds per count")
    parser.add_argument("--warmup", type=float, default=3.0, help="seconds after the uploaders start")
    args = parser.parse_args()
    (size,) = parse_counts(args.parameters)
    counts = [int(count) for count in args.uploaders.split(",")]
    for route in args.routes.split(","):
        one_route(route, size, counts, args.rate_mb * (1 << 20), args.window, args.warmup)


if __name__ == "__main__":
    main()
