"""The SDK against real servers: typed errors, retries, transparent re-registration, numpy-only use."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

import gemps
from gemps.router import PartitionRouter
from gemps_proto.status import ServerStatus
from gemps_worker.cluster import ServerProcess
from tests.helpers import InProcessServer
from tests.integration.conftest import StartServer, StartServerProcess

pytestmark = pytest.mark.usefixtures("plane")  # over shared memory, the data plane over TCP, and gRPC

PARAMS = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.zeros(2, np.float32)}


def test_register_pull_commit_leave(server: InProcessServer) -> None:
    with gemps.Client(server.target, name="t") as client:
        registration = client.register(PARAMS)
        assert registration.config.rule == "gem" and registration.version == 0
        np.testing.assert_array_equal(client.pull().named()["w"], PARAMS["w"])
        result = client.commit({"w": np.ones((2, 3), np.float32), "b": np.ones(2, np.float32)}, loss=1.0)
        # First GEM commit of a worker is unscaled: theta - eta * g.
        np.testing.assert_allclose(result.parameters.named()["w"], PARAMS["w"] - 0.05, rtol=1e-6)
        assert (result.version, result.staleness, result.scaling_mean) == (1, 0, 1.0)
        assert client.pull() is client.central  # unchanged version: no payload re-sent
        assert client.status().active_workers == 1
    with gemps.Client(server.target) as observer:
        assert observer.status().active_workers == 0


def test_an_observer_never_takes_the_spec_of_theta_not_yet_initialised(
    server: InProcessServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An unregistered pull takes the spec from Status; when the first worker initialises θ between
    that Status and the pull (an evaluator started with its workers), the pull is refused as not
    initialised, and the next one has θ's spec (it once returned θ under an empty spec)."""
    worker, observer = gemps.Client(server.target, name="w"), gemps.Client(server.target)
    status = PartitionRouter.status
    registered: list[bool] = []

    def a_worker_registers_right_after(router: PartitionRouter) -> ServerStatus:
        answer = status(router)
        if not registered:
            registered.append(True)
            worker.register(PARAMS)
        return answer

    monkeypatch.setattr(PartitionRouter, "status", a_worker_registers_right_after)
    with pytest.raises(gemps.FailedPreconditionError, match="not initialised") as refused:
        observer.pull()
    assert refused.value.reason == gemps.Reason.NOT_INITIALIZED and registered
    central = observer.pull()
    assert [p.name for p in central.spec] == list(PARAMS)
    np.testing.assert_array_equal(central.named()["w"], PARAMS["w"])
    for client in (worker, observer):
        client.close()


def test_update_payload_is_applied_as_given(start_server: StartServer) -> None:
    server = start_server(rule="downpour")
    with gemps.Client(server.target) as client:
        client.register(PARAMS)
        result = client.commit(np.full(8, 0.25, np.float32), kind="update")
        np.testing.assert_allclose(result.parameters.flat[:6], PARAMS["w"].reshape(-1) + 0.25)


def test_shards_are_distinct_and_reused(start_server: StartServer) -> None:
    server = start_server(num_shards=3)
    clients = [gemps.Client(server.target) for _ in range(3)]
    shards = [c.register(PARAMS).shard for c in clients]
    assert sorted(s.index for s in shards) == [0, 1, 2] and {s.count for s in shards} == {3}
    clients[1].leave()
    late = gemps.Client(server.target)
    assert late.register(PARAMS).shard.index == shards[1].index  # the freed slot
    for c in [*clients, late]:
        c.__exit__(None, None, None)


def test_typed_errors(server: InProcessServer) -> None:
    with gemps.Client(server.target) as client:
        with pytest.raises(gemps.NotRegisteredError):
            client.commit(np.zeros(8, np.float32))
        client.register(PARAMS)
        with pytest.raises(gemps.InvalidArgumentError, match="NaN or Inf"):
            client.commit(np.full(8, np.nan, np.float32))
        other = gemps.Client(server.target)
        with pytest.raises(gemps.FailedPreconditionError, match="server has 'w' \\[2, 3\\]"):
            other.register({"w": np.zeros((3, 2), np.float32), "b": np.zeros(2, np.float32)})
        other.close()


def test_unreachable_server_raises_after_retries() -> None:
    client = gemps.Client("127.0.0.1:1", retry=gemps.RetryPolicy(max_attempts=3, initial_backoff=0.01), timeout=2)
    started = time.monotonic()
    with pytest.raises(gemps.ServerUnavailableError, match="after 3 attempts"):
        client.status()
    assert time.monotonic() - started < 10
    client.close()


def test_reregisters_after_eviction(start_server: StartServer) -> None:
    server = start_server(lease_ttl=0.4)
    with gemps.Client(server.target) as client:
        client.register(PARAMS)
        first_id = client.worker_id
        while client.status().active_workers:  # wait for the eviction itself
            time.sleep(0.05)
        result = client.commit(np.ones(8, np.float32))
        assert client.worker_id != first_id
        assert result.version == 1


def test_retries_and_reregisters_across_a_server_restart(start_server_process: StartServerProcess) -> None:
    server = start_server_process()
    client = gemps.Client(
        server.target, retry=gemps.RetryPolicy(max_attempts=30, initial_backoff=0.05, max_backoff=0.5)
    )
    client.register(PARAMS)
    trained = client.commit(np.ones(8, np.float32)).parameters.flat.copy()
    server.kill()  # a crash: the new server has no state
    restarted = ServerProcess(port=server.port)
    restarter = threading.Timer(1.0, restarted.start)
    restarter.start()
    try:
        # UNAVAILABLE while down (retried with backoff), then NOT_FOUND (re-registered with our
        # newest central variable, which initialises the fresh server), then applied.
        result = client.commit(np.ones(8, np.float32))
        assert result.version == 1
        np.testing.assert_allclose(result.parameters.flat, trained - 0.05, rtol=1e-6)
    finally:
        restarter.join()
        client.close()
        restarted.close()


def test_numpy_only_use_without_torch(server: InProcessServer) -> None:
    script = textwrap.dedent(
        f"""
        import sys
        sys.modules["torch"] = None  # any import of torch now fails
        import numpy as np, gemps
        with gemps.Client("{server.target}") as c:
            c.register({{"w": np.zeros(4, np.float32)}})
            print(c.commit(np.ones(4, np.float32)).version)
        assert "gemps.pytorch" not in sys.modules
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "1"


def test_evaluation_reports_reach_status(server: InProcessServer) -> None:
    with gemps.Client(server.target) as worker, gemps.Client(server.target) as evaluator:
        worker.register(PARAMS)
        worker.commit(np.ones(8, np.float32))
        assert evaluator.status().last_evaluation is None
        evaluator.report_evaluation(version=1, loss=0.25, accuracy=0.9, num_samples=100, dataset="digits")
        assert evaluator.status().last_evaluation == gemps.Evaluation(1, 0.25, 0.9, 100, "digits")
        with pytest.raises(gemps.InvalidArgumentError, match="outside \\[0, 1\\]") as info:
            evaluator.report_evaluation(version=1, loss=0.25, accuracy=1.5, num_samples=100)
        assert info.value.reason == "bad_evaluation"
        with pytest.raises(gemps.InvalidArgumentError, match="ahead of the server's version 1") as info:
            evaluator.report_evaluation(version=7, loss=0.25, accuracy=0.5, num_samples=100)
        assert info.value.reason == "bad_version"
        assert evaluator.status().last_evaluation.accuracy == 0.9  # type: ignore[union-attr]
    assert "evaluation version=1 held_out_loss=0.25 held_out_accuracy=0.9" in server.log()
