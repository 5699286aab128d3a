"""Where a backup replays its primary's entries (replication/follower.py): on the follower's own
thread while its applier is idle, as a primary applies a commit on its data plane's thread (issue
80: handing every entry to the applier's thread and back cost a backup two thread switches an
entry, and its primary the wait); queued behind the applier when something runs there."""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np
import pytest

from gemps_proto.schema import PayloadKind
from gemps_server.domain.applier import Applier
from gemps_server.domain.journal import Entry
from gemps_server.domain.records import Commit
from gemps_server.domain.state import ServerState
from tests.helpers import encoded, wait_for
from tests.unit.test_follower_acks import appliers as appliers  # the fixture
from tests.unit.test_follower_acks import following
from tests.unit.test_forwarder import P


def test_an_idle_backup_replays_on_its_follower_thread_and_a_busy_one_on_its_applier(
    appliers: tuple[Applier, Applier], monkeypatch: pytest.MonkeyPatch
) -> None:
    threads: list[str] = []
    replay = ServerState.replay

    def replaying(state: ServerState, entry: Entry) -> None:
        threads.append(threading.current_thread().name)
        replay(state, entry)

    monkeypatch.setattr(ServerState, "replay", replaying)
    primary_applier, backup_applier = appliers
    state, journal, worker, backup, stream = following(primary_applier, backup_applier)
    rng = np.random.default_rng(11)
    replicated: list[BaseException | None] = []

    def commit(number: int) -> None:
        payload = encoded(rng.standard_normal(P).astype(np.float32))
        outcome = state.core.commit_record(
            Commit(worker, state.core.version, PayloadKind.UPDATE, payload, f"r{number}")
        )
        journal.when_replicated(outcome.position, replicated.append)

    def acknowledged(count: int) -> Callable[[], bool]:
        return lambda: len(replicated) == count

    for number in range(3):  # one at a time: the backup's applier idle at each
        commit(number)
        wait_for(acknowledged(number + 1), 10, f"commit {number} acknowledged")
    assert threads == ["gemps-replication-follow"] * 3
    running, release = threading.Event(), threading.Event()

    def hold() -> None:  # busy: the next entry waits its turn
        running.set()
        release.wait()

    backup_applier.submit_then(hold, lambda timed, error: None)
    assert running.wait(10)
    commit(3)
    wait_for(lambda: backup_applier.depth == 1, 10, "the entry queued behind the applier's operation")
    release.set()
    wait_for(acknowledged(4), 10, "commit 3 acknowledged")
    assert threads[3] != "gemps-replication-follow"
    assert replicated == [None] * 4
    assert backup.core.theta_copy().tobytes() == state.core.theta_copy().tobytes()
    stream.stop()
    journal.close()
    stream.join(10)
