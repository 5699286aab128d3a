"""When the adamw rule's open round wants the waiting workers' next gradients rather than others'
(PullResponse.round_takes_next), the server answers their held pulls and the SDK's wait ends:

- a worker leaves after the others committed to the round (a worker whose shard ran out first, one
  stopped by its supervisor, one whose lease ran out): the round has every commit it waits for and
  nobody commits to close it;
- a round size above the workers (`--round-size 4`, two workers): each owes two gradients a round,
  and the SDK waits for θ after each commit.

Before, the workers waited until their wait ran out (gemps.rounds: 60 s in a client's first round,
then four times its longest round, at least 1 s), with a WARNING."""

from __future__ import annotations

import functools
import logging
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

import gemps
from gemps.records import CommitResult
from tests.helpers import start_partitions, wait_for
from tests.integration.commit_threads import commit_together, run_together
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
    caplog.set_level(logging.DEBUG, logger="gemps.rounds")
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
        # K = 3 (the largest of the partitions', whose orders may differ): one of 2 and 1, or 2 and 2
        assert sorted(result.round_pending for result in results.values()) in ([1, 2], [2, 2])[: len(servers)]
        assert all(result.parameters.version <= 2 for result in results.values())  # θ as the round found it
        gave_up = [record.message for record in caplog.records if "did not move" in record.message]
        assert not gave_up, f"the waits ran out ({waited:.1f} s after the departure): {gave_up}"
        told = [record for record in caplog.records if "takes this worker's next gradient" in record.message]
        assert len(told) == 2
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


def test_a_round_size_above_the_workers_is_filled_by_their_next_gradients_without_waiting(
    start_server: StartServer, caplog: pytest.LogCaptureFixture
) -> None:
    server = start_server(rule="adamw", learning_rate=0.01, round_size=4)
    clients = {name: gemps.Client(server.target, name=name, timeout=120) for name in ("a", "b")}
    caplog.set_level(logging.WARNING, logger="gemps.rounds")
    try:
        for client in clients.values():
            client.register({"w": np.zeros(P, np.float32)})
        gradient = np.full(P, 0.1, np.float32)
        pending: dict[str, list[int]] = {name: [] for name in clients}

        def train(name: str) -> None:  # 6 commits, then leave, as a worker whose samples ran out
            for _ in range(6):
                pending[name].append(clients[name].commit(gradient).round_pending)
            clients[name].leave()

        run_together([functools.partial(train, name) for name in clients])  # 12 commits: 3 rounds of 4
        closing = [value for values in pending.values() for value in values if value == 0]
        assert len(closing) == 3, pending  # a round's closing commits alone say 0: no gradient dropped
        gave_up = [record.message for record in caplog.records if record.name == "gemps.rounds"]
        assert not gave_up, gave_up  # no wait ran out
        with gemps.Client(server.target) as observer:
            assert observer.status().commits_applied == 12
    finally:
        for client in clients.values():
            client.close()
