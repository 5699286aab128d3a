"""A worker killed without leaving and started again under its name (a supervisor's restart, the
rig's kill a minute), under adamw with a backup worker: the dead registration stood for the whole
lease (60 s by default), so the round waited for every live worker, the backup's place taken by the
dead one (issue 78). A registration not heard from since a newer one of its name, silent for more
than its own pace allows, is now forgotten within seconds (WorkerRegistry.superseded). Under GEM,
the default, the pace comes from commits, which the compiled core books."""

from __future__ import annotations

import time

import numpy as np
import pytest

import gemps
from gemps_server.domain.workers import PACE_GAPS
from tests.integration.commit_threads import commit_together
from tests.integration.conftest import StartServer

P = 64


@pytest.mark.parametrize("restart_seconds", [0.0, 3.0])  # within the dead one's pace (1 s here), well past it
def test_a_restart_under_the_dead_workers_name_frees_the_backups_place(
    start_server: StartServer, restart_seconds: float
) -> None:
    server = start_server(rule="adamw", learning_rate=0.01, backup_workers=1)  # the lease 60 s
    gradient = np.full(P, 0.1, np.float32)
    names = ("w0", "w1", "w2")
    clients = {name: gemps.Client(server.target, name=name, timeout=120) for name in names}
    try:
        for client in clients.values():
            client.register({"w": np.zeros(P, np.float32)})
        for _ in range(PACE_GAPS + 1):  # w2's pace, its gaps between pulls: then it is killed (silent, never leaving)
            clients["w2"].pull()
        time.sleep(restart_seconds)
        restarted = clients["w2 restarted"] = gemps.Client(server.target, name="w2", timeout=120)
        shard = restarted.register({"w": np.zeros(P, np.float32)}).shard
        if restart_seconds:  # the registration took the dead one's place: its slot, its shard
            assert restarted.status().active_workers == 3 and shard.index == 2
        deadline = time.monotonic() + 20  # well within the lease
        while (active := restarted.status().active_workers) > 3 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert active == 3, "the dead registration of w2 is still there"
        # One round: K = 3 registered - 1 backup = 2, its first commit says K - 1 = 1 and the second
        # closes it (the dead one counted: K = 3, and both would wait for a third).
        pending = commit_together({key: clients[key] for key in ("w0", "w1")}, gradient, 1)
        assert sorted(pending["w0"] + pending["w1"]) == [0, 1], pending
    finally:
        for client in clients.values():
            client.close()


@pytest.mark.parametrize("commit_core", ["compiled", "python"])
def test_a_restart_takes_the_place_of_a_dead_worker_paced_by_its_commits(
    start_server: StartServer, commit_core: str
) -> None:
    """GEM on a lone server, the compose stack's: the dead worker only committed, and the compiled
    core, which books a commit in C, kept its lease but not its pace, so the restart stood beside it
    for the whole lease."""
    server = start_server(commit_core=commit_core)  # the lease 60 s
    dead = gemps.Client(server.target, name="w0", timeout=30)
    live = gemps.Client(server.target, name="w1", timeout=30)
    restarted = gemps.Client(server.target, name="w0", timeout=30)
    try:
        slot = dead.register({"w": np.zeros(P, np.float32)}).shard.index
        live.register({"w": np.zeros(P, np.float32)})
        for _ in range(PACE_GAPS + 1):  # its pace: the gaps between its commits, then it is killed
            dead.commit({"w": np.full(P, 0.1, np.float32)})
        time.sleep(4.0)  # well past 4x its pace (the 1-s floor: gaps of milliseconds, or a stall of up to 1 s)
        shard = restarted.register({"w": np.zeros(P, np.float32)}).shard
        assert (restarted.status().active_workers, shard.index) == (2, slot), "the restart stood beside the dead w0"
    finally:
        for client in (dead, live, restarted):
            client.close()


def test_a_restart_takes_the_place_of_a_worker_killed_before_its_pace_showed(start_server: StartServer) -> None:
    """Killed in its set-up (an out-of-memory kill at a big model's first step), the dead worker
    never made a request, so it had no pace and stood for the whole lease: under adamw it was
    counted among the workers still committing (not committed yet), so every round waited for it."""
    server = start_server(rule="adamw", learning_rate=0.01)  # the lease 60 s, no backup workers
    gradient = np.full(P, 0.1, np.float32)
    live = gemps.Client(server.target, name="w0", timeout=120)
    dead = gemps.Client(server.target, name="w1", timeout=120)
    restarted = gemps.Client(server.target, name="w1", timeout=120)
    try:
        live.register({"w": np.zeros(P, np.float32)})
        slot = dead.register({"w": np.zeros(P, np.float32)}).shard.index  # then killed, before a request
        time.sleep(1.5)  # the restart's start-up, past the 1-s floor
        shard = restarted.register({"w": np.zeros(P, np.float32)}).shard
        assert (restarted.status().active_workers, shard.index) == (2, slot), "the restart stood beside the dead w1"
        # One round of K = 2: the first commit says K - 1 = 1, the second closes it.
        pending = commit_together({"w0": live, "w1": restarted}, gradient, 1)
        assert sorted(pending["w0"] + pending["w1"]) == [0, 1], pending
    finally:
        for client in (live, dead, restarted):
            client.close()


def test_two_live_workers_of_one_name_are_told_of_and_keep_their_places(
    start_server: StartServer, caplog: pytest.LogCaptureFixture
) -> None:
    """The same --name given to two live workers: the second's registration takes the first, still
    in its set-up, for a dead one. The first's next request finds itself forgotten and registers
    again: its name is then known shared, the server warns once, and both keep their places."""
    server = start_server()
    first = gemps.Client(server.target, name="trainer", timeout=30)
    second = gemps.Client(server.target, name="trainer", timeout=30)
    try:
        first.register({"w": np.zeros(P, np.float32)})
        time.sleep(1.5)  # the first still loading its data
        second.register({"w": np.zeros(P, np.float32)})
        assert second.status().active_workers == 1  # the first taken for a dead process
        with caplog.at_level("WARNING", logger="gemps.server"):
            first.commit({"w": np.full(P, 0.1, np.float32)})  # refused (unknown_worker), registered again, committed
            time.sleep(2.5)  # past the floor, the lease check twice
            second.commit({"w": np.full(P, 0.1, np.float32)})
            assert second.status().active_workers == 2
        warnings = [record.getMessage() for record in caplog.records if "worker name shared" in record.getMessage()]
        assert len(warnings) == 1 and "name=trainer" in warnings[0], warnings
    finally:
        for client in (first, second):
            client.close()
