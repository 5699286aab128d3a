"""Issue 50, item 5: the SDK's own metrics, opt-in, against a real server.

Before, a worker's /metrics held nothing of what the SDK saw (no `metrics_registry`): now a
`Client(..., metrics_registry=registry)` adds its commit latency, the bytes of θ's values it sent
and received per call, and its retries to the user's registry, and a client without one needs no
prometheus_client at all.
"""

from __future__ import annotations

import subprocess
import sys
import threading

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from gemps import Client
from gemps_proto.tensor_codec import INT8_BLOCK, expected_payload_nbytes
from tests.helpers import InProcessServer, free_port
from tests.integration.conftest import StartServer

pytestmark = pytest.mark.timeout(120)

P = 300
COMMITS = 4


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float:
    value = registry.get_sample_value(name, labels)
    assert value is not None, f"{name}{labels} not in the registry"
    return value


def test_a_client_counts_its_commits_latency_bytes_and_retries_into_the_users_registry() -> None:
    # The server starts a moment after the client's first call: registering is retried until it answers.
    port = free_port()
    started: list[InProcessServer] = []
    later = threading.Timer(0.5, lambda: started.append(InProcessServer(port=port).start()))
    later.start()
    registry = CollectorRegistry()
    try:
        with Client(f"127.0.0.1:{port}", name="metered", metrics_registry=registry) as client:
            client.register({"w": np.zeros(P, np.float32)})
            for _ in range(COMMITS):
                client.commit(np.ones(P, np.float32))
            client.pull()
    finally:
        later.join()
        for server in started:
            server.stop()
    assert sample(registry, "gemps_client_retries_total") >= 1  # the server was not up yet
    assert sample(registry, "gemps_client_commit_duration_seconds_count") == COMMITS
    assert 0 < sample(registry, "gemps_client_commit_duration_seconds_sum") < 60
    values = 4 * P  # float32 on the wire
    # Once, though registering took several attempts: those that failed are not counted.
    assert sample(registry, "gemps_client_sent_bytes_total", call="register") == values  # it set θ
    assert sample(registry, "gemps_client_received_bytes_total", call="register") == 0
    assert sample(registry, "gemps_client_sent_bytes_total", call="commit") == COMMITS * values
    assert sample(registry, "gemps_client_received_bytes_total", call="commit") == COMMITS * values
    assert sample(registry, "gemps_client_received_bytes_total", call="pull") in (0, values)  # 0: θ unchanged


def test_bfloat16_halves_the_bytes_and_a_second_client_gets_a_registry_of_its_own(start_server: StartServer) -> None:
    server = start_server()
    registry = CollectorRegistry()
    with (
        Client(server.target) as first,
        Client(server.target, wire_dtype="bfloat16", metrics_registry=registry) as half,
    ):
        first.register({"w": np.zeros(P, np.float32)})
        half.register({"w": np.zeros(P, np.float32)})  # receives θ, in bfloat16
        half.commit(np.ones(P, np.float32))
        assert sample(registry, "gemps_client_received_bytes_total", call="register") == 2 * P
        assert sample(registry, "gemps_client_sent_bytes_total", call="commit") == 2 * P
        assert sample(registry, "gemps_client_retries_total") == 0
        with pytest.raises(ValueError, match=r"holds another gemps client's metrics.*its own registry"):
            Client(server.target, metrics_registry=registry)


def test_codes_are_counted_at_their_bytes_each_way(start_server: StartServer) -> None:
    """int8 commits and int8 difference replies: the codes' bytes, and the first reply's θ whole in bfloat16."""
    server = start_server(rule="downpour")
    registry = CollectorRegistry()
    with Client(server.target, compression="int8", reply_compression="int8", metrics_registry=registry) as client:
        client.register({"w": np.zeros(P, np.float32)})
        for _ in range(COMMITS):
            client.commit(np.ones(P, np.float32), kind="update")
    codes = expected_payload_nbytes(INT8_BLOCK, [P])
    assert sample(registry, "gemps_client_sent_bytes_total", call="commit") == COMMITS * codes
    assert sample(registry, "gemps_client_received_bytes_total", call="commit") == 2 * P + (COMMITS - 1) * codes


def test_the_sdk_needs_no_prometheus_client_unless_asked_for_metrics() -> None:
    """Run where prometheus_client cannot be imported: a client works, and asking it for metrics
    names what to install."""
    script = """
import sys
sys.modules["prometheus_client"] = None  # not installed
import gemps
client = gemps.Client("127.0.0.1:1")
client.close()
try:
    gemps.Client("127.0.0.1:1", metrics_registry=object())
except ImportError as error:
    print(error)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "needs prometheus_client, not installed here: pip install 'gemps[metrics]'" in done.stdout
