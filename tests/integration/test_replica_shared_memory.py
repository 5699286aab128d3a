"""Shared memory after a replicated partition's replicas restart (issue 61, item 2): 0 of 446
commits used it after both replicas restarted at once (the local socket, unreachable while its
server restarted, was dropped for good, said at DEBUG, while the offered socket name stayed the
same); without replicas 643 of 643 did. Now every restart finds it again, and a fallback from
shared memory is a WARNING with its reason, counted (`Client.shared_memory_fallbacks`)."""

from __future__ import annotations

import logging
import os
import signal
import threading

import numpy as np
import pytest

import gemps
from gemps_proto.status import BACKUP, PRIMARY
from gemps_server.replication.local_etcd import LocalEtcd
from gemps_worker.cluster import ServerProcess
from tests.helpers import free_port, wait_for
from tests.integration.conftest import StartServerProcess
from tests.integration.test_replicas import PARAMETERS, replica_options, role_of


def shared_now(client: gemps.Client) -> bool:
    """Whether the client's commits go through shared memory with its server now."""
    return bool(getattr(client._router.sessions[0].transport, "shared", False))


def test_shared_memory_comes_back_after_both_replicas_restarted_at_once(
    start_server_process: StartServerProcess, etcd: LocalEtcd, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="gemps.client")
    ports = [free_port(), free_port()]

    def start(index: int) -> ServerProcess:
        return start_server_process(**replica_options(etcd, index, "shm-restart", rule="downpour", port=ports[index]))

    def settled() -> bool:
        return sorted(role_of(target) for target in targets) == [BACKUP, PRIMARY]

    servers = [start(0), start(1)]
    targets = [server.target for server in servers]
    wait_for(settled, 30, "a primary and a backup")
    ones = np.ones(PARAMETERS, np.float32)
    with gemps.Client("|".join(targets), name="w", timeout=60) as client:
        client.register({"w": np.zeros(PARAMETERS, np.float32)})
        client.commit(ones, kind="update")
        assert shared_now(client) and client.shared_memory_fallbacks == 0
        for restart in range(2):
            for server in servers:
                os.kill(server.pid, signal.SIGKILL)
            client_commit = client.commit  # the worker's next commit meets both down
            servers = [start(0), start(1)]
            wait_for(settled, 30, "restarted: a primary and a backup", tolerate=(gemps.GempsError,))
            for _ in range(5):
                client_commit(ones, kind="update")
            assert shared_now(client), f"restart {restart}: commits no longer through shared memory"
    assert client.shared_memory_fallbacks == len(fallbacks_said(caplog)), fallbacks_said(caplog)


def fallbacks_said(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "shared memory" in r.getMessage()
    ]


def test_a_fallback_from_shared_memory_is_said_counted_and_undone(
    start_server_process: StartServerProcess, caplog: pytest.LogCaptureFixture
) -> None:
    """One server, killed and started again on its port while its worker commits: the worker's
    connection to it falls from shared memory (its local socket not answering), a WARNING with the
    reason and a count, and comes back to it once the server is up."""
    caplog.set_level(logging.WARNING, logger="gemps.client")
    port = free_port()
    server = start_server_process(rule="downpour", port=port)
    ones = np.ones(PARAMETERS, np.float32)
    with gemps.Client(server.target, name="w", timeout=60) as client:
        client.register({"w": np.zeros(PARAMETERS, np.float32)})
        client.commit(ones, kind="update")
        assert shared_now(client)
        os.kill(server.pid, signal.SIGKILL)
        restart = threading.Timer(1.0, lambda: start_server_process(rule="downpour", port=port))
        restart.start()
        try:
            for _ in range(5):
                client.commit(ones, kind="update")  # the first waits for the server, its worker registered again
        finally:
            restart.join()
        assert shared_now(client)
    said = fallbacks_said(caplog)
    assert client.shared_memory_fallbacks == len(said) >= 1, said
    assert "local socket is not answering" in said[0]
