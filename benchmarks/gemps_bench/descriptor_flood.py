"""Issue 42, items 2 and 3: an honest worker's commits per second before and during two attacks on
a server's descriptors, on each route (shared memory, the data plane over TCP, gRPC).

- `descriptors`: a local process opens data-plane connections three at a time and sends a HELLO
  a byte at a time, two descriptors (SCM_RIGHTS) on each byte, never finishing it, over and over.
- `a core spun`: the floor to compare them with: a local process that spins without touching the
  server (on 2 cores, any process burning one costs the honest worker about this much).
- `full table`: a server under RLIMIT_NOFILE 96 whose descriptor table idle data-plane connections
  hold full (the honest worker connected before).

    python -m gemps_bench.descriptor_flood [--seconds 5]

prints one line per attack and route; docs/RELIABILITY.md has the figures.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing.synchronize import Event
from typing import Any

import grpc
import numpy as np

import gemps
from gemps_bench.honest_worker import commit_rate
from gemps_proto import data_plane_frames
from gemps_proto.data_plane_frames import Op
from gemps_proto.schema_proto import tensor_to_proto
from gemps_proto.v1 import parameter_server_pb2 as pb
from gemps_proto.v1 import parameter_server_pb2_grpc as pb_grpc
from gemps_worker.cluster import ServerProcess
from gemps_worker.processes import GEMPS_COMMAND

PARAMETERS = 10_000
ROUTES = {"shared memory": ("data", True), "data plane (TCP)": ("data", False), "gRPC": ("grpc", True)}
LIMIT = 96  # the full table's RLIMIT_NOFILE
HELLO = data_plane_frames.frame_start(
    Op.CHALLENGE, pb.DataPlaneChallenge(worker_id="w" * 64, nonce=b"t" * 3900).SerializeToString()
)


def flood(local_socket: str, stop: Event) -> None:
    """The `descriptors` attack, until `stop`: in a process of its own (its own interpreter lock)."""
    passed = os.open(os.devnull, os.O_RDONLY)
    while not stop.is_set():
        socks = []
        for _ in range(3):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(1.0)
            try:
                sock.connect("\0" + local_socket)
            except OSError:
                sock.close()
                continue
            socks.append(sock)
        for index in range(len(HELLO) - 1):
            for sock in list(socks):
                try:
                    socket.send_fds(sock, [HELLO[index : index + 1]], [passed, passed])
                except OSError:  # refused
                    socks.remove(sock)
                    sock.close()
            if not socks:
                break
        for sock in socks:
            sock.close()


def burn(_local_socket: str, stop: Event) -> None:
    """The floor: a process that only spins, never touching the server (what any local process
    burning a core costs the honest worker on this machine, to compare the floods with)."""
    while not stop.is_set():
        sum(range(10_000))


@contextmanager
def descriptors_attack(server: ServerProcess, local_socket: str, attacker_loop: Any = flood) -> Iterator[None]:
    context = multiprocessing.get_context("spawn")
    stop = context.Event()
    attacker = context.Process(target=attacker_loop, args=(local_socket, stop), daemon=True)
    attacker.start()
    try:
        time.sleep(0.5)  # under way
        yield
    finally:
        stop.set()
        attacker.join(10)


@contextmanager
def full_table(server: ServerProcess, local_socket: str, port: int) -> Iterator[None]:
    idle = []
    try:
        for index in range(LIMIT):
            if index % 2:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.connect("\0" + local_socket)
            else:
                sock = socket.create_connection(("127.0.0.1", port))
            idle.append(sock)
        deadline = time.monotonic() + 10
        while len(os.listdir(f"/proc/{server.pid}/fd")) < LIMIT:
            if time.monotonic() > deadline:
                raise RuntimeError("the table did not run full")
            time.sleep(0.05)
        yield
    finally:
        for sock in idle:
            sock.close()


def announcement(target: str) -> pb.DataPlane:
    """What a registration announces of the data plane (its port, its local socket's name): what
    any local process that registers learns."""
    spec = [pb.ParameterSpec(name="w", shape=[PARAMETERS], dtype=pb.DTYPE_FLOAT32)]
    request = pb.RegisterRequest(spec=spec, initial_parameters=tensor_to_proto(np.zeros(PARAMETERS, np.float32)))
    with grpc.insecure_channel(target) as channel:
        return pb_grpc.ParameterServerStub(channel).Register(request, timeout=30).data_plane


def measure(attack: str, route: str, seconds: float) -> tuple[float, float]:
    """Commits per second before and during `attack`."""
    plane, shared = ROUTES[route]
    command = ["prlimit", f"--nofile={LIMIT}:{LIMIT}", *GEMPS_COMMAND] if attack == "full table" else GEMPS_COMMAND
    server = ServerProcess(
        command=command, rule="downpour", data_plane_hello_timeout=60, max_unproven_data_connections=200
    )
    with server, gemps.Client(server.target, plane=plane, shared_memory=shared, timeout=30) as client:
        client.register({"w": np.zeros(PARAMETERS, np.float32)})
        announced = announcement(server.target)
        commit_rate(client, PARAMETERS, 1.0)  # warm
        before = commit_rate(client, PARAMETERS, seconds)
        if attack == "descriptors":
            during_attack = descriptors_attack(server, announced.local_socket)
        elif attack == "a core spun":
            during_attack = descriptors_attack(server, announced.local_socket, burn)
        else:
            during_attack = full_table(server, announced.local_socket, announced.port)
        with during_attack:
            during = commit_rate(client, PARAMETERS, seconds)
    return before, during


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=5.0, help="each measurement's length")
    args = parser.parse_args()
    print(f"{'attack':<12} {'route':<18} {'before /s':>10} {'during /s':>10} {'ratio':>6}")
    for attack in ("a core spun", "descriptors", "full table"):
        for route in ROUTES:
            before, during = measure(attack, route, args.seconds)
            print(f"{attack:<12} {route:<18} {before:>10.0f} {during:>10.0f} {during / before:>6.2f}", flush=True)


if __name__ == "__main__":
    main()
