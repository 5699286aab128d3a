"""The SDK on the data plane (DESIGN §3c) against real servers: what a worker gets is what gRPC
gives (bit for bit), exactly-once survives a dropped connection, a forgotten worker registers
again with a new ticket, and a data port that cannot be reached falls back to gRPC (plane="auto")
or raises (plane="data")."""

from __future__ import annotations

import functools
import logging
import socket
import threading
from collections.abc import Iterator

import numpy as np
import pytest

import gemps
from gemps.data_plane_connection import DataConnection
from gemps.data_plane_transport import DataPlaneTransport
from gemps_proto.data_plane_frames import Op
from gemps_worker.cluster import ServerProcess
from tests.helpers import InProcessServer, scrape_series, settled, start_partitions, wait_for
from tests.integration.conftest import StartServer, StartServerProcess
from tests.integration.test_security import Pki, pki

__all__ = ["pki"]  # the fixture, used here by name

LEARNING_RATE = 0.1
FAST_RETRY = gemps.RetryPolicy(max_attempts=30, initial_backoff=0.05, max_backoff=0.5)


def model(size: int) -> dict[str, np.ndarray]:
    return {"w": np.linspace(-1, 1, size, dtype=np.float32)}


def gradients(count: int, size: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(size).astype(np.float32) for _ in range(count)]


def transports(client: gemps.Client) -> list[DataPlaneTransport]:
    found = [session.transport for session in client._router.sessions]
    assert all(isinstance(t, DataPlaneTransport) for t in found)
    return found  # type: ignore[return-value]


def data_plane_calls(server: InProcessServer, method: str) -> float:
    series = scrape_series(f"http://127.0.0.1:{server.metrics_port}/metrics")
    labels = (f'method="{method}"', 'plane="data"')  # a partition's have its own label too
    return sum(
        value
        for name, value in series.items()
        if name.startswith("gemps_rpc_duration_seconds_count{") and all(label in name for label in labels)
    )


def trained(server: InProcessServer, plane: str, steps: list[np.ndarray], wire_dtype: str = "float32") -> np.ndarray:
    with gemps.Client(server.target, plane=plane, wire_dtype=wire_dtype) as client:
        client.register(model(steps[0].size))
        assert client.planes == [plane]
        for gradient in steps:
            result = client.commit(gradient, loss=1.0, num_samples=4)
        assert client.pull().version == len(steps)
        return np.array(result.parameters.flat)


@pytest.mark.parametrize("wire_dtype", ["float32", "bfloat16"])
def test_commits_on_the_data_plane_give_theta_bit_for_bit_as_grpc(start_server: StartServer, wire_dtype: str) -> None:
    steps = gradients(5, 1000)
    over = {}
    for plane in ("data", "grpc"):
        server = start_server(rule="gem", learning_rate=LEARNING_RATE)
        over[plane] = trained(server, plane, steps, wire_dtype)
        calls = 5.0 if plane == "data" else 0.0
        assert settled(functools.partial(data_plane_calls, server, "Commit"), calls) == calls
    np.testing.assert_array_equal(over["data"], over["grpc"])
    assert not np.array_equal(over["data"], model(1000)["w"])


def test_register_pull_commit_on_the_data_plane(start_server: StartServer) -> None:
    server = start_server(rule="downpour", learning_rate=LEARNING_RATE)
    with gemps.Client(server.target, plane="data") as client, gemps.Client(server.target, plane="data") as other:
        assert client.plane == "data" and client.planes == ["grpc"]  # nothing offered before Register
        client.register(model(100))
        other.register(model(100))
        assert client.planes == ["data"]
        result = client.commit(np.ones(100, np.float32))
        assert result.version == 1 and not result.parameters.flat.flags.writeable
        np.testing.assert_allclose(result.parameters.flat, model(100)["w"] - LEARNING_RATE, rtol=1e-6)
        pulled = other.pull()  # θ moved since `other` registered
        assert pulled.version == 1
        np.testing.assert_array_equal(pulled.flat, result.parameters.flat)
        assert other.pull() is pulled  # unchanged: no payload, the held θ
    assert settled(lambda: data_plane_calls(server, "Pull"), 2.0) == 2
    assert settled(lambda: data_plane_calls(server, "Commit"), 1.0) == 1


def test_buffers_travel_whole_in_the_headers(server: InProcessServer) -> None:
    params = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.zeros(2, np.float32)}
    buffers = {"bn.running_mean": np.zeros(3, np.float32), "bn.running_var": np.ones(3, np.float32)}
    delta = np.array([0.5, -0.25, 1.0, 0.0, 2.0, -0.5], np.float32)
    with gemps.Client(server.target, plane="data") as first, gemps.Client(server.target, plane="data") as second:
        first.register(params, buffers)
        result = first.commit(np.ones(8, np.float32), buffer_delta=delta)
        expected = np.array([0.5, -0.25, 1.0, 1.0, 3.0, 0.5], np.float32)
        np.testing.assert_array_equal(result.parameters.buffers, expected)
        np.testing.assert_array_equal(first.commit(np.ones(8, np.float32)).parameters.buffers, expected)
        second.register(params, buffers)
        np.testing.assert_array_equal(second.pull().buffers, expected)
        assert first.planes == second.planes == ["data"]


def test_a_large_model_on_the_data_plane(start_server: StartServer) -> None:
    """300K parameters (1.2 MB: gRPC would stream it in pieces), float32 and bfloat16 replies."""
    size = 300_000
    server = start_server(rule="downpour", learning_rate=LEARNING_RATE)
    gradient = gradients(1, size)[0]
    with (
        gemps.Client(server.target, plane="data") as client,
        gemps.Client(server.target, plane="data", wire_dtype="bfloat16") as half,
    ):
        client.register(model(size))
        half.register(model(size))
        result = client.commit(gradient)
        expected = model(size)["w"] - np.float32(LEARNING_RATE) * gradient
        np.testing.assert_allclose(result.parameters.flat, expected, rtol=1e-6, atol=1e-7)
        np.testing.assert_array_equal(half.pull().flat, _bfloat16(result.parameters.flat))
    assert settled(lambda: data_plane_calls(server, "Commit"), 1.0) == 1
    assert settled(lambda: data_plane_calls(server, "Pull"), 1.0) == 1


def _bfloat16(values: np.ndarray) -> np.ndarray:
    from gemps_proto.tensor_codec import bfloat16_to_float32, float32_to_bfloat16

    return bfloat16_to_float32(float32_to_bfloat16(values))


@pytest.mark.parametrize("count", [2, 3])
def test_each_partition_on_its_own_data_connection(start_server: StartServer, count: int) -> None:
    size = 10_007
    single = trained(start_server(rule="gem", learning_rate=LEARNING_RATE), "grpc", gradients(4, size))
    servers = start_partitions(start_server, count, rule="gem", learning_rate=LEARNING_RATE)
    with gemps.Client(servers[0].target, plane="data") as client:
        client.register(model(size))
        assert client.planes == ["data"] * count
        connections = [t._connection for t in transports(client)]
        assert len({c.sock.getpeername() for c in connections if c is not None}) == count
        for gradient in gradients(4, size):
            result = client.commit(gradient, loss=1.0, num_samples=4)
        assert result.parameters.versions == (4,) * count
        np.testing.assert_array_equal(result.parameters.flat, single)  # bit-identical to one server
    for server in servers:
        assert settled(functools.partial(data_plane_calls, server, "Commit"), 4.0) == 4


def test_a_partitions_broken_connection_is_retried_on_a_new_one(start_server: StartServer) -> None:
    """A send that fails while the router starts every partition's slice is retried like a reply
    that never came: on a new connection, the slice applied once."""
    servers = start_partitions(start_server, 2, rule="downpour", learning_rate=LEARNING_RATE)
    with gemps.Client(servers[0].target, plane="data", retry=FAST_RETRY) as client:
        client.register(model(1000))
        second = transports(client)[1]
        broken = second._connection
        assert broken is not None
        broken.sock.shutdown(socket.SHUT_WR)  # its next send fails (EPIPE)
        result = client.commit(np.ones(1000, np.float32))
        assert result.parameters.versions == (1, 1)
        assert broken.closed and second._connection is not None and second._connection is not broken
        np.testing.assert_allclose(result.parameters.flat, model(1000)["w"] - LEARNING_RATE, rtol=1e-6)
        assert client.planes == ["data", "data"]
    assert [settled(functools.partial(data_plane_calls, server, "Commit"), 1.0) for server in servers] == [1, 1]


@pytest.fixture
def drop_first_commit_reply(server: InProcessServer, monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """The first COMMIT's connection is killed after the server applied it, before its reply is
    read; yields the number of connections dropped so."""
    dropped: list[int] = []
    receive = DataConnection.receive

    def receive_or_drop(self: DataConnection, op: int) -> tuple[bytes, int]:
        if op == Op.COMMIT and not dropped:
            wait_for(lambda: server.server.state.core.version >= 1, 10, "the commit applied")
            self.sock.close()  # its reply (maybe already here) is lost with it
            dropped.append(1)
        return receive(self, op)

    monkeypatch.setattr(DataConnection, "receive", receive_or_drop)
    yield dropped


def test_a_commit_is_applied_once_when_its_connection_drops_before_the_reply(
    server: InProcessServer, drop_first_commit_reply: list[int]
) -> None:
    with gemps.Client(server.target, plane="data", retry=FAST_RETRY) as client:
        client.register(model(50))
        result = client.commit(np.ones(50, np.float32))  # dropped, retried with the same request id
        assert drop_first_commit_reply == [1] and client.retries >= 1
        assert result.version == 1 and server.server.state.core.version == 1  # applied once
        np.testing.assert_array_equal(result.parameters.flat, client.pull().flat)
        assert client.commit(np.ones(50, np.float32)).version == 2  # on a new connection
        assert client.planes == ["data"]
    assert settled(lambda: data_plane_calls(server, "Commit"), 3.0) == 3  # the original, its duplicate, the next


def test_a_forgotten_worker_registers_again_with_a_new_ticket(start_server: StartServer) -> None:
    server = start_server(lease_ttl=0.4)
    with gemps.Client(server.target, plane="data") as client:
        client.register(model(8))
        (transport,) = transports(client)
        first_ticket, first_id = transport.ticket, client.worker_id
        wait_for(lambda: client.status().active_workers == 0, 10, "the eviction")
        result = client.commit(np.ones(8, np.float32))  # refused NOT_FOUND, registered again, applied
        assert result.version == 1 and client.worker_id != first_id
        assert transport.ticket is not None and transport.ticket != first_ticket
        assert client.planes == ["data"]


def test_a_restarted_server_gets_the_worker_again_on_its_new_data_port(
    start_server_process: StartServerProcess,
) -> None:
    server = start_server_process()
    client = gemps.Client(server.target, plane="data", retry=FAST_RETRY)
    try:
        client.register(model(8))
        (transport,) = transports(client)
        before = transport.ticket
        client.commit(np.ones(8, np.float32))
        server.kill()  # a crash: the new server has no state, and another data port
        restarted = ServerProcess(port=server.port)
        restarter = threading.Timer(1.0, restarted.start)
        restarter.start()
        try:
            assert client.commit(np.ones(8, np.float32)).version == 1
            assert client.planes == ["data"] and transport.ticket != before
        finally:
            restarter.join()
            restarted.close()
    finally:
        client.close()


def test_no_data_plane_offered_means_grpc_or_a_clear_refusal(start_server: StartServer) -> None:
    server = start_server(data_plane="off")
    with gemps.Client(server.target) as client:
        client.register(model(8))
        assert client.planes == ["grpc"] and client.commit(np.ones(8, np.float32)).version == 1
    with (
        gemps.Client(server.target, plane="data") as client,
        pytest.raises(gemps.FailedPreconditionError, match="offers no data plane"),
    ):
        client.register(model(8))


def test_an_unreachable_data_port_falls_back_to_grpc_with_one_warning(
    server: InProcessServer, caplog: pytest.LogCaptureFixture
) -> None:
    assert server.server.data_plane is not None
    server.server.data_plane.stop(0)  # still offered at Register; nothing listens there now
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as holder:
        # Held bound, not listening: a connection there is refused, and no other test's server is
        # given the freed port (the other runner's gRPC server was, once, 5 ms later: "it answers in
        # another protocol"). No SO_REUSEADDR: with it, a gRPC server's bind (which sets it too)
        # shares a port nobody listens on.
        holder.bind(("127.0.0.1", server.server.data_port))
        with caplog.at_level(logging.WARNING, logger="gemps.client"), gemps.Client(server.target) as client:
            client.register(model(8))
            for version in (1, 2, 3):
                assert client.commit(np.ones(8, np.float32)).version == version
            assert client.pull().version == 3
            assert client.planes == ["grpc"]
        warnings = [r.getMessage() for r in caplog.records if "data plane" in r.getMessage()]
        assert len(warnings) == 1, warnings
        assert "cannot be used (Connection refused)" in warnings[0]
        assert f"127.0.0.1:{server.server.data_port}" in warnings[0] and "using gRPC" in warnings[0]
        with (
            gemps.Client(
                server.target, plane="data", retry=gemps.RetryPolicy(max_attempts=2, initial_backoff=0.01)
            ) as strict,
            pytest.raises(gemps.ServerUnavailableError, match="data plane"),
        ):
            strict.register(model(8))


def test_mutual_tls_and_a_token_on_the_data_plane(start_server: StartServer, pki: Pki) -> None:
    """The gRPC connection's certificates (the CA, the client's) serve the data plane too."""
    server = start_server(
        rule="downpour", tls_cert=pki.server.cert, tls_key=pki.server.key, tls_client_ca=pki.ca.cert, auth_token="t0k"
    )
    with gemps.Client(
        server.target,
        plane="data",
        token="t0k",
        ca_cert=str(pki.ca.cert),
        client_cert=str(pki.client.cert),
        client_key=str(pki.client.key),
    ) as client:
        client.register(model(100))
        assert client.planes == ["data"] and client.commit(np.ones(100, np.float32)).version == 1
        assert client.pull().version == 1
    assert settled(lambda: data_plane_calls(server, "Commit"), 1.0) == 1


def test_the_plane_comes_from_the_environment(server: InProcessServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GEMPS_PLANE", "grpc")
    with gemps.Client(server.target) as client:
        client.register(model(8))
        assert client.plane == "grpc" and client.planes == ["grpc"]
        client.commit(np.ones(8, np.float32))
    assert data_plane_calls(server, "Commit") == 0
