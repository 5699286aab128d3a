"""The data plane's TLS handshakes under a flood (issue 42, item 4): done off the thread that
serves every connection, and bounded per address, so a flood of ClientHellos (the costliest
key exchange among them) leaves workers committing and a newcomer from elsewhere getting in."""

from __future__ import annotations

import os
import socket
import threading
import time

import numpy as np
import pytest
from gemps_bench.tls_flood import FloodProcess, client_hello

import gemps
from gemps_worker.cluster import ServerProcess
from tests.helpers import InProcessServer, free_port, scrape_series, wait_for
from tests.integration.conftest import StartServer, StartServerProcess
from tests.integration.test_security import Pki, pki

__all__ = ["pki"]  # the fixture, used here by name
pytestmark = pytest.mark.faults

P = 1000
COMMITS = 300
# Generous: a worker commits hundreds a second here; with the handshakes on the loop's thread,
# each "dh" ClientHello took ~80 ms of it and the worker committed a few a second.
WITHIN_SECONDS = 15.0
FLOOD_SOURCE = "127.0.0.2"  # the flood's address: the workers connect from 127.0.0.1


def refusals(server: ServerProcess | InProcessServer) -> dict[str, float]:
    series = scrape_series(f"http://127.0.0.1:{server.metrics_port}/metrics")
    prefix = 'gemps_data_plane_refusals_total{reason="'
    return {name[len(prefix) : -2]: value for name, value in series.items() if name.startswith(prefix)}


def descriptors(server: ServerProcess) -> int:
    return len(os.listdir(f"/proc/{server.pid}/fd"))


@pytest.mark.alone  # floods: the machine to itself
def test_a_handshake_flood_leaves_workers_committing(start_server_process: StartServerProcess, pki: Pki) -> None:
    port = free_port()
    server = start_server_process(
        rule="downpour", tls_cert=str(pki.server.cert), tls_key=str(pki.server.key), data_port=port
    )
    tls = {"ca_cert": str(pki.ca.cert), "shared_memory": False, "timeout": 30.0}
    payload = np.full(P, 1e-6, np.float32)
    with gemps.Client(server.target, plane="data", **tls) as worker:  # type: ignore[arg-type]
        worker.register({"w": np.zeros(P, np.float32)})
        worker.commit(payload)
        held = descriptors(server)
        # The flooders at the lowest priority, as on an attacker's own machine: beside the server at
        # equal priority, their threads took the worker's share of a core by the scheduler's fairness,
        # so the commits' rate was the host's speed (280 of 300 in 15 s under a 1-core quota).
        with (
            FloodProcess(port, "dh", threads=2, source=FLOOD_SOURCE, nice=19),
            FloodProcess(port, "hold", threads=1, source=FLOOD_SOURCE, nice=19),
            FloodProcess(port, "full", threads=1, source=FLOOD_SOURCE, nice=19),
        ):
            # The flood under way: its address already held to its handshake bounds (three processes
            # starting took longer than the 1 s slept here before on a slow host).
            wait_for(lambda: refusals(server).get("handshake_limit", 0) > 0, 60, "the flood held to its bounds")
            done, deadline = 0, time.monotonic() + WITHIN_SECONDS
            while done < COMMITS and time.monotonic() < deadline:
                worker.commit(payload)
                done += 1
            assert done == COMMITS, f"{done} of {COMMITS} commits in {WITHIN_SECONDS:g}s beside the flood"
            # A newcomer (from the workers' address, not the flood's) gets the data plane meanwhile.
            with gemps.Client(server.target, plane="data", **tls) as newcomer:  # type: ignore[arg-type]
                newcomer.register({"w": np.zeros(P, np.float32)})
                newcomer.commit(payload)
                assert newcomer.planes == ["data"]
            counted = refusals(server)
        assert worker.planes == ["data"]
        assert counted.get("handshake_limit", 0) > 0, counted  # the flood's address was held to its bounds
        # Every flood connection, and every descriptor a handshake held, is let go.
        wait_for(lambda: descriptors(server) <= held, timeout=15, what="the flood's descriptors closed")
        assert worker.commit(payload).version == COMMITS + 3


def test_connections_in_handshake_are_bounded_and_unproven(start_server: StartServer, pki: Pki) -> None:
    """A handshake under way holds a place among the unproven (evicted for a newcomer as the
    oldest, closed at the HELLO's deadline from accept), and at most --max-handshakes-per-source
    from one address are under way: more are closed at once."""
    server = start_server(
        rule="downpour",
        tls_cert=pki.server.cert,
        tls_key=pki.server.key,
        max_unproven_data_connections=3,
        max_handshakes_per_source=2,
        data_plane_hello_timeout=1.5,
    )
    plane = server.server.data_plane
    assert plane is not None
    hello = client_hello()
    held: list[socket.socket] = []

    def hold(source: str) -> socket.socket:
        """A connection from `source` that sends a ClientHello and never says more."""
        sock = socket.create_connection(("127.0.0.1", server.server.data_port), timeout=5, source_address=(source, 0))
        sock.sendall(hello)
        held.append(sock)
        return sock

    try:
        oldest = hold("127.0.0.2")
        wait_for(lambda: plane.connections == 1, timeout=5, what="the first accepted")
        hold("127.0.0.2")
        wait_for(lambda: plane.connections == 2, timeout=5, what="the second accepted")
        hold("127.0.0.2")  # a third from that address: closed before any handshake work
        wait_for(lambda: refusals(server)["handshake_limit"] == 1, timeout=5, what="the third refused")
        hold("127.0.0.3")  # the third unproven place
        wait_for(lambda: plane.connections == 3, timeout=5, what="another address's accepted")
        hold("127.0.0.3")  # no place left: the oldest, in handshake, is closed for it
        wait_for(lambda: refusals(server)["unproven_limit"] == 1, timeout=5, what="the oldest evicted")
        assert closed_by_server(oldest)
        # Past its address's bound while every place is taken: refused before it can cost
        # another connection its place (no second eviction).
        hold("127.0.0.3")
        wait_for(lambda: refusals(server)["handshake_limit"] == 2, timeout=5, what="the third from .3 refused")
        assert refusals(server)["unproven_limit"] == 1
        # The others end at the HELLO's deadline, counted; nothing is left of them.
        wait_for(
            lambda: refusals(server)["handshake_timeout"] == 3,
            timeout=10,
            what="the rest timed out",
            explain=lambda: f"refusals: {refusals(server)}; connections: {plane.connections}",
        )
        wait_for(lambda: plane.connections == 0, timeout=5, what="every connection closed")
    finally:
        for sock in held:
            sock.close()
    # The bounds were the address's and the place's: a worker (from 127.0.0.1) gets in at once.
    with gemps.Client(server.target, plane="data", ca_cert=str(pki.ca.cert), shared_memory=False) as worker:
        worker.register({"w": np.zeros(P, np.float32)})
        assert worker.commit(np.ones(P, np.float32)).version == 1
        assert worker.planes == ["data"]
    assert refusals(server)["tls"] == 0


def closed_by_server(sock: socket.socket) -> bool:
    """Whether the server closed `sock` (EOF or reset), reading what it sent before."""
    try:
        while sock.recv(65536):
            pass
    except ConnectionResetError:
        pass
    return True


def test_a_stopping_server_closes_connections_in_handshake_at_once(start_server: StartServer, pki: Pki) -> None:
    """Nothing of a connection still in its TLS handshake (or before its HELLO) waits to be
    acknowledged: a stopping server closes it at once instead of at the grace's end."""
    server = start_server(tls_cert=pki.server.cert, tls_key=pki.server.key, data_plane_hello_timeout=60)
    plane = server.server.data_plane
    assert plane is not None
    held = socket.create_connection(("127.0.0.1", server.server.data_port), timeout=30)
    try:
        held.sendall(client_hello())
        wait_for(lambda: plane.connections == 1, timeout=5, what="the connection accepted")
        stopping = threading.Thread(target=server.stop, kwargs={"grace": 60.0})
        stopping.start()
        stopping.join(timeout=20)  # a bound on a hang: the grace is 60 s
        assert not stopping.is_alive(), "the server waited out its grace for a connection in handshake"
        assert closed_by_server(held)
    finally:
        held.close()
