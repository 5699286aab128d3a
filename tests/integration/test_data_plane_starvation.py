"""What one client's slowness or silence can take from the others on the data plane (issue 37,
items 1 and 2), on both routes an honest worker takes: TCP, and the local socket with shared
memory. Slow uploads in progress must not stop an honest worker's commits; connections that
never say HELLO must not keep it off the data plane; and a worker pushed to gRPC by a fault comes
back to the data plane once the fault clears."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator

import numpy as np
import pytest

import gemps
from gemps.data_plane_transport import DataPlaneTransport
from gemps_proto import data_plane_frames
from gemps_proto.data_plane_frames import REPLY, Op
from gemps_proto.v1 import parameter_server_pb2 as pb
from tests.data_plane_client import DataPlaneClient, commit_header
from tests.helpers import InProcessServer, scrape_series, wait_for
from tests.integration.conftest import StartServer, open_stub
from tests.integration.test_data_plane import connected, register

P = 1000  # test_data_plane's model, which `register` makes
ROUTES = ("tcp", "shared")
FAST_RETRY = gemps.RetryPolicy(max_attempts=30, initial_backoff=0.05, max_backoff=0.5)


def refusals(server: InProcessServer) -> dict[str, float]:
    series = scrape_series(f"http://127.0.0.1:{server.metrics_port}/metrics")
    prefix = 'gemps_data_plane_refusals_total{reason="'
    return {name[len(prefix) : -2]: value for name, value in series.items() if name.startswith(prefix)}


def transport_of(client: gemps.Client) -> DataPlaneTransport:
    (session,) = client._router.sessions
    assert isinstance(session.transport, DataPlaneTransport)
    return session.transport


def honest_client(server: InProcessServer, route: str, **options: object) -> gemps.Client:
    """A worker on `route` (auto: it may fall back to gRPC), registered to test_data_plane's model."""
    client = gemps.Client(server.target, plane="auto", shared_memory=route == "shared", retry=FAST_RETRY, **options)  # type: ignore[arg-type]
    client.register({"w": np.linspace(-1, 1, P, dtype=np.float32)})
    return client


class Committing:
    """A worker committing in a thread until stopped: `acked` counts its acknowledged commits."""

    def __init__(self, client: gemps.Client) -> None:
        self.client = client
        self.acked = 0
        self.failures: list[BaseException] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self.client.commit(np.full(P, 1e-3, np.float32))
                self.acked += 1
        except BaseException as error:  # reported by the test
            self.failures.append(error)

    def __enter__(self) -> Committing:
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        self._thread.join(60)

    def more(self, count: int, what: str, timeout: float = 30) -> None:
        """Until `count` more commits are acknowledged (or one failed)."""
        target = self.acked + count
        wait_for(lambda: self.acked >= target or self.failures, timeout, what)
        assert not self.failures, self.failures


# -- item 1: slow uploads ------------------------------------------------------------------------


@pytest.mark.parametrize("route", ROUTES)
def test_slow_uploads_in_progress_do_not_hold_an_honest_workers_commits(start_server: StartServer, route: str) -> None:
    """Four workers' uploads stop halfway (their bytes still to come, well within the stall timeout
    and the floor's allowance) while they hold both pooled buffers. An honest worker must get 50
    commits through before any of them finishes. Before issue 37 it waited for the pool until the
    uploads stalled out (60 s each, two rounds). Now the uploads, of workers not yet proven fast,
    hold one pooled buffer at a time, each for its window: two move to the two slow-lane buffers
    and complete when their bytes come; the other two find the slow lane full and are refused
    DEADLINE_EXCEEDED (the SDK would retry them)."""
    server = start_server(rule="downpour", data_plane_buffers=2, slow_upload_buffers=2, stream_idle_timeout=60)
    stub = open_stub(server.target)
    payload = np.zeros(P, np.float32).tobytes()
    half = len(payload) // 2
    uploaders: list[tuple[DataPlaneClient, pb.RegisterResponse]] = []
    try:
        for _ in range(4):
            reply = register(stub)
            uploader = connected(reply)
            uploader.sock.sendall(data_plane_frames.frame_start(Op.COMMIT, commit_header(reply.worker_id, P, 0), 4 * P))
            uploader.sock.sendall(payload[:half])  # and the rest only at the end
            uploaders.append((uploader, reply))
        with honest_client(server, route) as client:
            with Committing(client) as honest:
                honest.more(50, "50 honest commits while four uploads are in progress", timeout=25)
            assert client.planes == ["data"] and transport_of(client).shared == (route == "shared")
            assert server.server.state.core.version == honest.acked  # none of the uploads applied yet
        # Each upload's window passes (its pooled buffer was the newcomers' share): two move to the
        # slow lane, two find it full.
        wait_for(lambda: refusals(server).get("slow_upload", 0) == 2, 20, "two uploads refused: slow lane full")
        outcomes = []
        for uploader, _reply in uploaders:
            with contextlib.suppress(OSError):  # refused and closed already
                uploader.sock.sendall(payload[half:])
            frame = uploader.receive()
            outcomes.append("applied" if frame.op == Op.COMMIT | REPLY else frame.error.reason)  # type: ignore[union-attr]
    finally:
        for uploader, _reply in uploaders:
            uploader.close()
    assert sorted(outcomes) == ["applied", "applied", "stream_idle", "stream_idle"], outcomes
    assert refusals(server)["slow_upload"] == 2


# -- item 2: connections that never say HELLO ------------------------------------------------------


def silent(server: InProcessServer, count: int) -> list[socket.socket]:
    """`count` TCP connections to the data port that send nothing."""
    return [socket.create_connection(("127.0.0.1", server.server.data_port), timeout=5) for _ in range(count)]


@pytest.fixture
def closing() -> Iterator[list[socket.socket]]:
    opened: list[socket.socket] = []
    yield opened
    for sock in opened:
        sock.close()


@pytest.mark.parametrize("token", ["", "t0k"])
@pytest.mark.parametrize("route", ROUTES)
def test_silent_connections_do_not_keep_a_worker_off_the_data_plane(
    start_server: StartServer, closing: list[socket.socket], route: str, token: str
) -> None:
    """Three times --max-data-connections of connections that send nothing, before and after an
    honest worker registers: it gets the data plane, keeps it, and every silent connection closed
    for a newcomer is counted. Before issue 37 the silent ones took every place and the worker
    fell back to gRPC."""
    server = start_server(
        rule="downpour",
        max_data_connections=8,
        max_unproven_data_connections=4,
        auth_token=token,
        data_plane_hello_timeout=60,  # none closed for its silence during the test: the counts are exact
    )

    def closed() -> float:
        counted = refusals(server)
        return counted.get("unproven_limit", 0) + counted.get("too_many_connections", 0)

    closing += silent(server, 24)
    wait_for(lambda: closed() >= 16, 10, "the flood accepted or refused")
    with honest_client(server, route, token=token or None) as client:
        assert client.planes == ["data"]
        assert client.commit(np.ones(P, np.float32)).version == 1
        closing += silent(server, 24)  # a proved connection is never the one closed
        wait_for(lambda: closed() >= 44, 10, "the second flood accepted")
        assert client.commit(np.ones(P, np.float32)).version == 2
        assert client.planes == ["data"] and transport_of(client).shared == (route == "shared")
    counted = refusals(server)
    # 20 of the first 24, one for the worker's connection, 23 of the next 24 (the worker's HELLO left a place)
    assert counted["unproven_limit"] == 44 and counted["too_many_connections"] == 0


@pytest.mark.parametrize("route", ROUTES)
def test_a_worker_that_fell_back_returns_to_the_data_plane(start_server: StartServer, route: str) -> None:
    """Every data-plane place held by other workers' connections: an honest worker falls back to
    gRPC. Once they leave it comes back to the data plane (shared memory included) by itself,
    every commit applied once. Before issue 37 it stayed on gRPC for good."""
    server = start_server(rule="downpour", max_data_connections=1)
    holder = connected(register(open_stub(server.target)))  # a proved connection: never closed for others
    try:
        client = honest_client(server, route)
        with client, Committing(client) as honest:
            transport = transport_of(client)
            assert transport.fell_back and client.planes == ["grpc"]
            honest.more(5, "commits on gRPC while the data plane is full")
            holder.close()
            wait_for(lambda: client.planes == ["data"] or honest.failures, 20, "the worker back on the data plane")
            honest.more(5, "commits on the data plane again")
            assert transport.returns == 1 and transport.shared == (route == "shared")
        assert server.server.state.core.version == honest.acked  # each commit applied once
    finally:
        holder.close()
    assert refusals(server)["too_many_connections"] >= 1
