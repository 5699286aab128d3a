"""adamw's rounds across a restart from a checkpoint, on real servers: the job's round size holds
until its workers are back. The first worker to register again would otherwise take AdamW steps
of its own gradient alone (K = the one worker registered), each one a step at the job's rate on a
batch K times smaller, until its peers had registered again."""

from __future__ import annotations

from pathlib import Path

import numpy as np

import gemps
from gemps_proto.status import Rounds
from tests.helpers import free_port
from tests.integration.commit_threads import commit_together
from tests.integration.conftest import StartServer

P = 64
WORKERS = "abcd"


def test_a_worker_back_first_after_a_restart_gives_the_rounds_the_jobs_size_until_its_peers_return(
    start_server: StartServer, tmp_path: Path
) -> None:
    """Four workers, two rounds; the server restarts on its ports from its final checkpoint while the
    workers stay up. One comes back and commits alone: the round still takes four gradients, the
    server naming it the round's taker of each next one, and θ moves once. Then the others come
    back (the θ each held before the restart is behind: a pull first) and the round closes at the
    fourth commit of the four."""
    ports = {"port": free_port(), "data_port": free_port()}
    options = {"rule": "adamw", "checkpoint_dir": tmp_path, "checkpoint_every": 0, "checkpoint_interval": 0, **ports}
    server = start_server(**options)
    gradient = np.ones(P, np.float32)
    clients = {name: gemps.Client(server.target, name=name) for name in WORKERS}
    try:
        for client in clients.values():
            client.register({"w": np.zeros(P, np.float32)})
        commit_together(clients, gradient, 2)  # two rounds of K 4
        server.stop()  # the final checkpoint, at version 8; the workers stay up
        start_server(**options)
        first = clients["a"]
        # Alone, it owes the round all four gradients; the server says so to its held pulls, so
        # each commit returns at once, and θ moves at the fourth, once.
        results = [first.commit(gradient) for _ in range(4)]
        assert [result.round_pending for result in results] == [3, 2, 1, 0]
        assert first.status().rounds == Rounds(closed=3, size=4, held=0)
        assert first.pull().version == 12
        for name in WORKERS[1:]:  # the others come back (registering again at their first call)
            assert clients[name].pull().version == 12
        assert first.status().rounds == Rounds(closed=3, size=4, held=0)  # now the four workers' K
        pending = commit_together(clients, gradient, 1)
        assert sorted(pending[name][0] for name in WORKERS) == [0, 1, 2, 3], pending
        assert first.status().rounds == Rounds(closed=4, size=4, held=0)
    finally:
        for client in clients.values():
            client.close()
