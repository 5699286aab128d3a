"""A worker killed without leaving, under the adamw rule's rounds (issue 78's kills): it stays
registered for its lease (60 s by default), and its restart is a new registration. The rounds, sized
by the workers registered, waited for it: every round then stood until the SDK's wait for it ran
out (gemps.rounds, a second or more), for the whole lease, 10x fewer commits a second. A worker with
no commit among the last 2N versions no longer sizes the round (CommitCore.live_workers)."""

from __future__ import annotations

import numpy as np

import gemps
from tests.integration.commit_threads import commit_together
from tests.integration.conftest import StartServer

P = 64
COMMITS = 12  # by each live worker after the death


def test_the_rounds_go_on_without_a_worker_killed_without_leaving(start_server: StartServer) -> None:
    server = start_server(rule="adamw", learning_rate=0.01)  # backup_workers 0, the lease 60 s
    gradient = np.full(P, 0.1, np.float32)
    clients = {name: gemps.Client(server.target, name=name, timeout=120) for name in ("a", "b", "ghost")}
    try:
        for client in clients.values():
            client.register({"w": np.zeros(P, np.float32)})
        commit_together(clients, gradient, 3)
        # The ghost is silent from now on and never leaves (its client stays open, as a SIGKILLed
        # process's registration stays); its process, started again, registers anew.
        clients["restarted"] = gemps.Client(server.target, name="restarted", timeout=120)
        clients["restarted"].register({"w": np.zeros(P, np.float32)})
        pending = commit_together({name: clients[name] for name in ("a", "b", "restarted")}, gradient, COMMITS)
        # A round's first commit says K - 1: the ghost counted (4 a round) at first, then no longer.
        later = [value for values in pending.values() for value in values[COMMITS // 2 :]]
        assert max(later) == 2, pending
    finally:
        for client in clients.values():
            client.close()
