"""Descriptors before trust and a table that runs full (issue 42, items 2 and 3; DESIGN §3b):
descriptors passed (SCM_RIGHTS) before a HELLO is proven are closed at once and the connection
refused, so they never pile up; a server whose descriptor table is full still writes its final
checkpoint at SIGTERM and exits 0; and clients that connect while it is full are accepted once
descriptors are free again, without connecting anew.

Against real server processes (their /proc/PID/fd counted), a low RLIMIT_NOFILE set with
prlimit where the table must really run full (EMFILE)."""

from __future__ import annotations

import os
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import gemps
from gemps_proto import data_plane_frames, proofs
from gemps_proto.data_plane_frames import REPLY, Op
from gemps_proto.v1 import parameter_server_pb2 as pb
from gemps_server.wire.data_plane import BACKLOG
from gemps_server.wire.refusal_budget import BURST_SECONDS
from gemps_worker.cluster import ServerProcess
from gemps_worker.processes import GEMPS_COMMAND
from tests.data_plane_client import DataPlaneClient
from tests.helpers import scrape_series, wait_for
from tests.integration.conftest import open_stub
from tests.integration.test_data_plane import P, register

pytestmark = [
    pytest.mark.skipif(sys.platform != "linux", reason="SCM_RIGHTS, abstract sockets and /proc are Linux's"),
    pytest.mark.skipif(shutil.which("prlimit") is None, reason="needs prlimit (util-linux)"),
]

# The open-file limit of the servers that must run out: room for what a server holds at start
# (about 40 descriptors, its reserve included) and a few dozen connections.
LIMIT = 96
# Unproven connections allowed (--max-unproven-data-connections): enough that idle ones fill
# LIMIT before the oldest is closed for a newcomer.
UNPROVEN = 200
# What the server may hold beyond its descriptors at start while hostile descriptors are passed:
# the attacking connections' sockets, and one passed descriptor in flight (closed at once).
HOSTILE_MARGIN = 8


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def refusals(server: ServerProcess) -> dict[str, float]:
    series = scrape_series(f"http://127.0.0.1:{server.metrics_port}/metrics")
    prefix = 'gemps_data_plane_refusals_total{reason="'
    return {name[len(prefix) : -2]: value for name, value in series.items() if name.startswith(prefix)}


def limited(limit: int) -> list[str]:
    """`gemps server` under RLIMIT_NOFILE `limit` (soft and hard: the server cannot raise it)."""
    return ["prlimit", f"--nofile={limit}:{limit}", *GEMPS_COMMAND]


@pytest.fixture
def passed_file() -> Iterator[int]:
    """A descriptor of a deleted temporary file: what a hostile client passes."""
    handle, path = tempfile.mkstemp()
    os.unlink(path)
    yield handle
    os.close(handle)


def pass_descriptors_during_hello(
    local_socket: str, fd: int, connections: int = 3, count: int = 1000, pid: int | None = None
) -> int:
    """`connections` local connections that send a HELLO one byte at a time, each byte carrying
    two descriptors, and never finish it; the most descriptors server `pid` had open meanwhile
    (counted every 50 bytes; 0 without `pid`)."""
    hello = data_plane_frames.frame_start(
        Op.CHALLENGE, pb.DataPlaneChallenge(worker_id="w" * 64, nonce=b"t" * 3900).SerializeToString()
    )
    socks = []
    for _ in range(connections):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect("\0" + local_socket)
        sock.settimeout(1.0)  # a server out of descriptors stops reading: its buffer fills
        socks.append(sock)
    peak = 0
    try:
        for index in range(min(count, len(hello) - 1)):
            for sock in list(socks):
                try:
                    socket.send_fds(sock, [hello[index : index + 1]], [fd, fd])
                except OSError:  # refused: closed by the server (or no longer reading)
                    socks.remove(sock)
            if pid is not None and index % 50 == 0:
                peak = max(peak, open_fds(pid))
            if not socks:
                break
    finally:
        for sock in socks:
            sock.close()
    return peak


def test_descriptors_passed_before_a_hello_are_closed_at_once_and_the_connection_refused(passed_file: int) -> None:
    with ServerProcess(rule="downpour") as server:
        reply = register(open_stub(server.target))
        baseline = open_fds(server.pid)
        peak = baseline
        for _ in range(3):  # three rounds of three connections
            during = pass_descriptors_during_hello(reply.data_plane.local_socket, passed_file, 3, 300, server.pid)
            peak = max(peak, during, open_fds(server.pid))
        # Before the fix: 3 connections x 300 bytes x 1 descriptor kept = 900 more per round.
        assert peak <= baseline + HOSTILE_MARGIN, f"{peak} descriptors open (from {baseline})"
        wait_for(lambda: refusals(server)["descriptors"] == 9, timeout=10, what="9 refusals for descriptors")
        status = open_stub(server.target).Status(pb.StatusRequest(), timeout=5)
        assert status.version == 0
        wait_for(lambda: open_fds(server.pid) <= baseline, timeout=10, what="descriptors back to the baseline")


def test_sigterm_after_the_descriptor_table_ran_full_writes_the_final_checkpoint_and_exits_0(
    tmp_path: Path, passed_file: int
) -> None:
    directory = tmp_path / "checkpoints"
    # A checkpoint at the 101st commit only: the first 100 wait for one, the 101st is written
    # while the table is full, the 102nd is in none until the final one.
    options: dict[str, Any] = {
        "rule": "downpour",
        "checkpoint_dir": directory,
        "checkpoint_every": 101,
        "checkpoint_interval": 0,
    }
    server = ServerProcess(
        command=limited(LIMIT),
        shutdown_grace=1,
        data_plane_hello_timeout=60,  # the idle connections below hold their places
        max_unproven_data_connections=UNPROVEN,
        **options,
    )
    idle: list[socket.socket] = []
    with server:
        client = gemps.Client(server.target, plane="data", timeout=10)
        client.register({"w": np.zeros(P, np.float32)})
        for _ in range(100):
            client.commit(np.ones(P, np.float32))
        reply = register(open_stub(server.target))
        # What a hostile local client can do: descriptors during a HELLO, and connections that
        # never say HELLO on both data-plane sockets until no descriptor is left (EMFILE).
        pass_descriptors_during_hello(reply.data_plane.local_socket, passed_file)
        try:
            for index in range(LIMIT + 20):
                if index % 2:
                    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                    sock.connect("\0" + reply.data_plane.local_socket)
                else:
                    sock = socket.create_connection(("127.0.0.1", reply.data_plane.port))
                idle.append(sock)
            wait_for(lambda: open_fds(server.pid) >= LIMIT, timeout=10, what=f"{LIMIT} descriptors open")
            # A worker connected before still commits; the checkpoint due is written all the same.
            assert client.commit(np.ones(P, np.float32)).version == 101
            wait_for(lambda: "checkpoint written" in server.log(), timeout=10, what="the checkpoint at 101")
            assert client.commit(np.ones(P, np.float32)).version == 102
            client.close()
            # The places it let go of are taken by connections that waited in the queue.
            wait_for(lambda: open_fds(server.pid) >= LIMIT, timeout=10, what="the table full as SIGTERM comes")
            code = server.stop(timeout=30)
        finally:
            client.close()
            for sock in idle:
                sock.close()
        log = server.log()
    assert code == 0, f"exit {code}:\n{log[-3000:]}"
    assert "checkpoint failed" not in log and "version=101" in log and "version=102" in log
    with ServerProcess(**options) as restarted, gemps.Client(restarted.target) as observer:
        assert observer.status().version == 102


def test_clients_that_connect_while_the_table_is_full_are_served_once_it_frees() -> None:
    server = ServerProcess(
        command=limited(LIMIT),
        rule="downpour",
        data_plane_hello_timeout=60,
        max_unproven_data_connections=UNPROVEN,
    )
    idle: list[socket.socket] = []
    with server:
        stub = open_stub(server.target)
        tcp_worker, local_worker = register(stub), register(stub)
        port, name = tcp_worker.data_plane.port, tcp_worker.data_plane.local_socket
        try:
            # Idle connections until the table is full (those past it wait in the kernel's queue).
            idle.extend(socket.create_connection(("127.0.0.1", port)) for _ in range(LIMIT))
            wait_for(lambda: open_fds(server.pid) >= LIMIT, timeout=10, what=f"{LIMIT} descriptors open")
            honest = [DataPlaneClient(port, timeout=5), DataPlaneClient(0, timeout=5, local_socket=name)]
            nonces: list[bytes] = []
            for client, worker in zip(honest, (tcp_worker, local_worker), strict=True):
                nonces.append(proofs.nonce())  # the handshake's first frame: a CHALLENGE
                challenge = pb.DataPlaneChallenge(worker_id=worker.worker_id, nonce=nonces[-1])
                client.send(Op.CHALLENGE, challenge.SerializeToString())
        finally:
            for sock in idle:
                sock.close()  # the table frees: no new connection arrives to wake the listener
        try:
            for client, worker, nonce in zip(honest, (tcp_worker, local_worker), nonces, strict=True):
                try:
                    answer = client.receive()
                except (TimeoutError, ConnectionError) as error:
                    pytest.fail(f"a client that connected while the table was full got no answer: {error!r}")
                assert answer.op == Op.CHALLENGE | REPLY, answer.error
                server_nonce = pb.DataPlaneAnswer.FromString(answer.header).nonce
                proof = proofs.client_proof(worker.data_plane.ticket, nonce, server_nonce)
                client.send(Op.HELLO, pb.DataPlaneHello(worker_id=worker.worker_id, proof=proof).SerializeToString())
                assert client.receive().op == Op.HELLO | REPLY
        finally:
            for client in honest:
                client.close()


# The refusal budget of the next test's server, per second (bursts of BURST_SECONDS' worth).
REFUSALS_PER_SECOND = 50


def test_connections_refused_over_and_over_pause_their_listener_not_the_workers(passed_file: int) -> None:
    """A local process that connects, passes descriptors and is refused, over and over, for 3 s:
    the refusals the server does are bounded by --data-plane-refusals-per-second (the rest wait in
    the kernel's queue), said once at WARNING, a worker connected before goes on committing, and
    one that comes after the flood gets the data plane."""
    with ServerProcess(rule="downpour", data_plane_refusals_per_second=REFUSALS_PER_SECOND) as server:
        worker = gemps.Client(server.target, plane="data", timeout=30)
        with worker:
            worker.register({"w": np.zeros(P, np.float32)})
            local_socket = register(open_stub(server.target)).data_plane.local_socket
            started = time.monotonic()
            connected = tries = 0
            while time.monotonic() - started < 3.0:
                tries += 1
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.settimeout(0.2)  # a paused listener's queue fills: connects wait, then fail
                try:
                    sock.connect("\0" + local_socket)
                    socket.send_fds(sock, [b"\0"], [passed_file])
                    connected += 1
                except OSError:
                    pass
                finally:
                    sock.close()
                if tries % 50 == 0:
                    assert worker.commit(np.ones(P, np.float32)).version >= 1
            elapsed = time.monotonic() - started
            refused = refusals(server)["descriptors"]
            bound = REFUSALS_PER_SECOND * (BURST_SECONDS + elapsed) + BACKLOG  # + those the queue held
            assert 0 < refused <= bound, f"{refused} refused in {elapsed:.1f}s ({connected} connected)"
            assert "accepting paused" in server.log()
        # After the flood (its queue drained): a newcomer gets the data plane.
        with gemps.Client(server.target, plane="data", timeout=30) as newcomer:
            newcomer.register({"w": np.zeros(P, np.float32)})
            assert newcomer.commit(np.ones(P, np.float32)).version >= 1
            assert newcomer.planes == ["data"]
