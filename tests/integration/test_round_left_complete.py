"""A worker that leaves after the others committed to the open round (a worker whose shard ran out
first, one stopped by its supervisor, one whose lease ran out), under the adamw rule's rounds: the
round then has every commit it waits for, and no commit comes to close it while its workers wait
for θ to move. They waited until their wait ran out (gemps.rounds: 60 s in a client's first round,
then 4x its longest round), with a WARNING; the server now answers their held pulls as the
worker leaves, saying the round has what it waits for (PullResponse.round_closable), and their
next gradients close it."""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

import gemps
from gemps.records import CommitResult
from tests.helpers import start_partitions, wait_for
from tests.integration.commit_threads import commit_together
from tests.integration.conftest import StartServer

P = 32


@pytest.mark.parametrize("plane,partitions", [("grpc", 1), ("data", 1), ("data", 2)])
def test_the_workers_waiting_on_a_round_a_departure_completed_go_on_at_once(
    start_server: StartServer, plane: str, partitions: int, caplog: pytest.LogCaptureFixture
) -> None:
    """Partitioned, each server's round is told apart: a worker goes on once every one says so."""
    # No backups: K = the workers registered.
    servers = start_partitions(start_server, partitions, rule="adamw", learning_rate=0.01)
    gradient = np.full(P, 0.1, np.float32)
    names = ("a", "b", "leaving")
    clients = {name: gemps.Client(servers[0].target, name=name, plane=plane, timeout=120) for name in names}
    caplog.set_level(logging.INFO, logger="gemps.rounds")
    try:
        for client in clients.values():
            client.register({"w": np.zeros(P, np.float32)})
        with ThreadPoolExecutor(2) as executor:
            waiting = {name: executor.submit(clients[name].commit, gradient) for name in ("a", "b")}
            held = lambda: all(len(server.server.service.waits) == 2 for server in servers)  # noqa: E731
            wait_for(held, 30, "both commits' round waits held")
            assert not any(result.done() for result in waiting.values())  # K = 3: the round waits for "leaving"
            left = time.monotonic()
            clients.pop("leaving").close()  # leaves: K = 2, and the round has its 2
            results: dict[str, CommitResult] = {name: done.result(timeout=120) for name, done in waiting.items()}
        waited = time.monotonic() - left
        assert sorted(result.round_pending for result in results.values()) == [1, 2]
        assert all(result.parameters.version <= 2 for result in results.values())  # θ as the round found it
        gave_up = [record.message for record in caplog.records if "did not move" in record.message]
        assert not gave_up, f"the waits ran out ({waited:.1f} s after the departure): {gave_up}"
        told = [record for record in caplog.records if "has every commit" in record.message]
        assert len(told) == 2 and all(record.levelno == logging.INFO for record in told)
        # Their next gradients, on that θ: the first closes the round (2 in it: K), the other is dropped.
        pending = commit_together(clients, gradient, 1)
        assert pending == {"a": [0], "b": [0]}
        theta = np.asarray(clients["a"].pull().flat)
        assert np.all(theta < 0), "the round's AdamW step did not move θ against the gradient"
    finally:
        for client in clients.values():
            client.close()


def test_a_registration_keeps_the_round_waiting(start_server: StartServer) -> None:
    """A worker joining while the round waits raises K: nobody is told to go on (a pull the round
    would have woken is still held), and the newcomer's commit closes the round."""
    server = start_server(rule="adamw", learning_rate=0.01)
    gradient = np.full(P, 0.1, np.float32)
    clients = {name: gemps.Client(server.target, name=name, timeout=120) for name in ("a", "b", "leaving", "new")}
    try:
        for name in ("a", "b", "leaving"):
            clients[name].register({"w": np.zeros(P, np.float32)})
        with ThreadPoolExecutor(2) as executor:
            waiting = {name: executor.submit(clients[name].commit, gradient) for name in ("a", "b")}
            wait_for(lambda: len(server.server.service.waits) == 2, 30, "both commits' round waits held")
            clients["new"].register({"w": np.zeros(P, np.float32)})  # K = 4
            clients.pop("leaving").close()  # K = 3: the round has 2
            time.sleep(0.5)
            assert len(server.server.service.waits) == 2 and not any(done.done() for done in waiting.values())
            closing = clients["new"].commit(gradient, base_version=0)
            assert closing.round_pending == 0 and closing.parameters.version == 3
            for done in waiting.values():
                assert done.result(timeout=30).parameters.version == 3  # woken by the move
    finally:
        for client in clients.values():
            client.close()
