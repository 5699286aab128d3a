"""Client and the partition router against in-memory server processes: no server, no gRPC."""

from __future__ import annotations

import numpy as np
import pytest

import gemps
from gemps.records import Layout, Partition
from gemps.retry import RetryPolicy
from tests.unit.memory_transport import MemoryServer, connector, memory_cluster

P = 10
NO_WAIT = RetryPolicy(max_attempts=3, initial_backoff=0.0)


def _client(servers: list[MemoryServer], retry: RetryPolicy = NO_WAIT) -> gemps.Client:
    return gemps.Client(servers[0].target, retry=retry, connect=connector(servers))


def _initial() -> dict[str, np.ndarray]:
    return {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.full(4, 10.0, np.float32)}


def _theta() -> np.ndarray:
    return np.concatenate([np.arange(6, dtype=np.float32), np.full(4, 10.0, np.float32)])


def test_one_server_register_commit_pull() -> None:
    [server] = servers = memory_cluster(P, 1)
    client, later = _client(servers), _client(servers)
    registration = client.register(_initial())
    assert registration.initialized_central and client.worker_id == registration.worker_id
    assert client.layout is None and client.targets == [server.target]
    assert [entry.name for entry in client.spec] == ["w", "b"]
    gradient = np.linspace(-1, 1, P, dtype=np.float32)
    result = client.commit(gradient, loss=0.5)
    expected = _theta() - 0.5 * gradient
    np.testing.assert_allclose(result.parameters.flat, expected)
    assert (result.version, result.staleness) == (1, 0) and result.parameters.versions == (1,)
    assert client.pull() is client.central  # unchanged: nothing sent back
    assert server.pulls[-1].known_version == 1
    assert not later.register({"w": np.zeros((2, 3), np.float32), "b": np.zeros(4, np.float32)}).initialized_central
    assert later.central is not None
    np.testing.assert_allclose(later.central.flat, expected)
    update = later.commit({"w": np.ones((2, 3), np.float32), "b": np.ones(4, np.float32)}, kind="update")
    np.testing.assert_allclose(update.parameters.flat, expected + 1)
    np.testing.assert_allclose(client.pull().flat, expected + 1)
    client.close()
    assert server.closed


def test_partitions_get_their_slices_and_theta_is_assembled_in_order() -> None:
    servers = memory_cluster(P, 3)  # ranges [0, 4), [4, 7), [7, 10)
    client = _client(servers)
    client.register(_initial())
    assert client.targets == [s.target for s in servers]
    assert client.layout is not None and len(client.layout.partitions) == 3
    np.testing.assert_array_equal(servers[0].enrolments[0].values, _theta())  # the first: all of θ
    np.testing.assert_array_equal(servers[1].enrolments[0].values, _theta()[4:7])
    np.testing.assert_array_equal(servers[2].enrolments[0].values, _theta()[7:])
    for server, scaling in zip(servers, (0.1, 0.2, 0.4), strict=True):
        server.scaling = scaling
    servers[2].version += 5  # other workers' commits, on partition 2 only
    gradient = np.arange(P, dtype=np.float32)
    result = client.commit(gradient)
    np.testing.assert_array_equal(servers[1].commits[0].payload, gradient[4:7])
    np.testing.assert_array_equal(servers[2].commits[0].payload, gradient[7:])
    np.testing.assert_allclose(result.parameters.flat, _theta() - 0.5 * gradient)
    assert result.parameters.versions == (1, 1, 6) and result.version == 1  # partition 0's
    assert result.staleness == 5  # the largest
    assert result.scaling_mean == pytest.approx((0.1 * 4 + 0.2 * 3 + 0.4 * 3) / P)  # weighted by size
    assert len({call.request_id for s in servers for call in s.commits}) == 1


def test_partitions_start_every_call_before_waiting_for_one() -> None:
    servers = memory_cluster(P, 3)
    client = _client(servers)
    client.register(_initial())
    client.commit(np.ones(P, np.float32))
    targets = [server.target for server in servers]
    assert servers[0].events == [f"start {t}" for t in targets] + [f"finish {t}" for t in targets]


def test_a_partition_that_forgot_the_worker_gets_the_newest_slice_and_a_clamped_base() -> None:
    servers = memory_cluster(P, 2)  # [0, 5), [5, 10)
    client = _client(servers)
    client.register(_initial())
    first = client.commit(np.ones(P, np.float32))
    newest = first.parameters.flat.copy()
    servers[1].restart_empty(version=0)  # lost θ and its workers; counts from 0 again
    result = client.commit(np.ones(P, np.float32))
    again = servers[1].enrolments[-1]
    np.testing.assert_array_equal(again.values, newest[5:])  # our newest copy of its slice
    assert again.buffers is None and again.buffer_spec == ()
    attempts = servers[1].commits[-2:]
    assert attempts[0].request_id == attempts[1].request_id  # the same commit, once
    assert (attempts[0].base_version, attempts[1].base_version) == (1, 0)  # clamped to the registration's
    assert attempts[1].worker_id != attempts[0].worker_id == first_worker(servers[1])
    np.testing.assert_allclose(result.parameters.flat, newest - 0.5)
    assert result.parameters.versions == (2, 1) and client.retries == 0


def first_worker(server: MemoryServer) -> str:
    return f"{server.target}/worker-0"


def test_a_single_server_that_forgot_the_worker_is_registered_with_again_on_pull() -> None:
    [server] = servers = memory_cluster(P, 1)
    client = _client(servers)
    client.register(_initial())
    client.commit(np.ones(P, np.float32))
    server.forget_workers()
    pulled = client.pull()
    assert len(server.enrolments) == 2 and server.pulls[-1].worker_id == client.worker_id
    assert client.worker_id in server.workers
    np.testing.assert_allclose(pulled.flat, _theta() - 0.5)


def test_retries_are_counted_and_the_request_id_reused() -> None:
    [server] = servers = memory_cluster(P, 1)
    client = _client(servers)
    client.register(_initial())
    server.fail_next = 2
    result = client.commit(np.ones(P, np.float32))
    assert client.retries == 2 and result.version == 1
    server.lose_next_reply = True  # applied, but the reply never came: the retry must not apply it again
    result = client.commit(np.ones(P, np.float32))
    assert client.retries == 3 and result.version == 2 and server.version == 2
    assert server.commits[-1].request_id == server.commits[-2].request_id
    assert server.commits[-1].request_id != server.commits[0].request_id
    np.testing.assert_allclose(result.parameters.flat, _theta() - 1.0)


def test_retries_exhausted_raise_a_typed_error() -> None:
    [server] = servers = memory_cluster(P, 1)
    client = _client(servers)
    client.register(_initial())
    server.fail_next = 3
    with pytest.raises(gemps.ServerUnavailableError, match="unreachable after 3 attempts"):
        client.commit(np.ones(P, np.float32))
    assert client.retries == 2 and server.version == 0


def test_a_started_partition_call_that_failed_is_retried() -> None:
    servers = memory_cluster(P, 2)
    client = _client(servers)
    client.register(_initial())
    servers[1].fail_next = 2
    result = client.commit(np.ones(P, np.float32))
    assert client.retries == 1 and result.parameters.versions == (1, 1)
    assert [call.request_id for call in servers[1].commits] == [servers[0].commits[0].request_id]


def test_a_partition_count_change_is_refused() -> None:
    servers = memory_cluster(P, 2)
    client = _client(servers)
    client.register(_initial())
    bounds = ((0, 4), (4, 7), (7, 10))
    servers[0].layout = Layout(0, tuple(Partition("", start, stop) for start, stop in bounds), P)
    servers[0].forget_workers()
    with pytest.raises(gemps.FailedPreconditionError, match="now has 3 partitions, not 2"):
        client.commit(np.ones(P, np.float32))
    assert servers[0].commits[-1].worker_id != client.worker_id  # refused before it was sent again
    with pytest.raises(gemps.FailedPreconditionError, match="now has 3 partitions, not 2"):
        client.statuses()


def test_buffers_go_to_and_come_from_partition_0_only() -> None:
    servers = memory_cluster(P, 2)
    client = _client(servers)
    client.register(_initial(), {"running_mean": np.zeros(3, np.float32)})
    assert servers[0].enrolments[0].buffer_spec and servers[1].enrolments[0].buffer_spec == ()
    assert servers[1].enrolments[0].buffers is None
    delta = np.array([1.0, 2.0, 3.0], np.float32)
    result = client.commit(np.zeros(P, np.float32), buffer_delta={"running_mean": delta})
    assert servers[1].commits[0].buffer_delta is None
    delivered = servers[0].commits[0].buffer_delta
    assert delivered is not None
    np.testing.assert_array_equal(delivered.floats, delta)
    np.testing.assert_array_equal(result.parameters.buffers, delta)
    assert result.parameters.named_buffers().keys() == {"running_mean"}


def test_an_unregistered_client_pulls_with_the_status_spec_and_layout() -> None:
    servers = memory_cluster(P, 2)
    worker = _client(servers)
    worker.register(_initial())
    worker.commit(np.ones(P, np.float32))
    observer = _client(servers)
    central = observer.pull()
    assert observer.registration is None and [s.worker_id for s in servers[1].pulls] == [""]
    assert [entry.name for entry in observer.spec] == ["w", "b"] and central.versions == (1, 1)
    np.testing.assert_allclose(central.flat, _theta() - 0.5)
    with pytest.raises(gemps.NotRegisteredError):
        observer.commit(np.ones(P, np.float32))


def test_leave_and_report_go_to_the_right_servers() -> None:
    servers = memory_cluster(P, 2)
    with _client(servers) as client:
        client.register(_initial())
        client.report_evaluation(0, 0.5, 0.9, 10)
    assert [len(s.workers) for s in servers] == [0, 0]
    assert len(servers[0].evaluations) == 1 and servers[1].evaluations == []
    assert all(s.closed for s in servers)
