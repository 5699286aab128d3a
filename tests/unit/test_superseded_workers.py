"""A worker killed without leaving, whose process starts again under the same name (a supervisor's
restart, compose's `restart: on-failure`, the rig's kills): the restart is a new registration, and
the dead one's stood for the whole lease (60 s by default), counted in the workers a round waits
for (adamw) and holding a slot. It is forgotten once silent after the newer registration for
SUPERSEDED_GAPS times its pace (its recent gaps between requests); a live worker of the name keeps its
place, and so does an unnamed one. One whose pace is not known yet (killed in its set-up) is
forgotten after SUPERSEDED_FLOOR_SECONDS, unless its name was found shared by live processes or it
was taken over from an image."""

from __future__ import annotations

import numpy as np
import pytest

from gemps_server.domain.journal import Departed
from gemps_server.domain.namesakes import SharedNames
from gemps_server.domain.state import ServerState
from gemps_server.domain.workers import (
    PACE_GAPS,
    SERVER_FULL,
    SUPERSEDED,
    SUPERSEDED_FLOOR_SECONDS,
    SUPERSEDED_GAPS,
    WorkerRecord,
    WorkerRegistry,
)
from gemps_server.replication import entries
from tests.helpers import encoded
from tests.unit.test_journal_replay import SPEC, Clock, ListJournal, new_state, replay_all


def scopes(state: ServerState) -> list[str]:
    """Each registered worker's scope (WorkerRecord.scope), in registration order."""
    return [record.scope for record in state.registry.records()]


def paced(registry: WorkerRegistry, clock: Clock, record: WorkerRecord, gap: float, requests: int = 3) -> None:
    """`requests` requests from `record`, `gap` seconds apart (its first right away)."""
    for _ in range(requests):
        registry.touch(record.worker_id)
        clock.now += gap


def test_a_restart_under_the_dead_workers_name_supersedes_it_after_its_own_pace() -> None:
    clock = Clock()
    registry = WorkerRegistry(max_workers=8, lease_ttl=60, clock=clock)
    dead, other = registry.add("w1"), registry.add("w2")
    paced(registry, clock, dead, 0.5)  # its pace: 0.5 s; then silent (killed)
    restarted = registry.add("w1")
    assert registry.superseded() == []  # silent for 0.5 s: within its pace
    clock.now = dead.last_seen + SUPERSEDED_GAPS * 0.5 - 0.01
    assert registry.superseded() == []
    clock.now = dead.last_seen + SUPERSEDED_GAPS * 0.5 + 0.01
    assert registry.superseded() == [dead.worker_id]
    assert registry.expired() == []  # the lease itself is far from over
    assert restarted.worker_id not in registry.superseded() and other.worker_id not in registry.superseded()


def test_a_live_worker_of_the_same_name_keeps_its_place() -> None:
    clock = Clock()
    registry = WorkerRegistry(max_workers=8, lease_ttl=60, clock=clock)
    first = registry.add("trainer")
    paced(registry, clock, first, 0.2)
    second = registry.add("trainer")  # another live worker given the same name
    for _ in range(50):
        clock.now += 0.2
        registry.touch(first.worker_id)
        registry.touch(second.worker_id)
        assert registry.superseded() == []


def test_the_floor_the_lease_and_what_is_not_known() -> None:
    clock = Clock()
    registry = WorkerRegistry(max_workers=10, lease_ttl=30, clock=clock)
    fast, slow, unnamed = registry.add("fast"), registry.add("slow"), registry.add("")
    fresh, silent = registry.add("fresh"), registry.add("silent")
    paced(registry, clock, fast, 0.01)  # 4 x 0.01 s: the floor holds
    paced(registry, clock, slow, 20.0)  # 4 x 20 s: the lease holds
    registry.touch(fresh.worker_id)  # one request: no gap known, the floor holds (killed at its first step)
    paced(registry, clock, unnamed, 0.01)
    for name in ("fast", "slow", "fresh", "silent", ""):
        registry.add(name)
    for gone in (fast, fresh, silent):  # `silent` never made a request: killed in its set-up
        clock.now = gone.last_seen + SUPERSEDED_FLOOR_SECONDS - 0.01
        assert gone.worker_id not in registry.superseded()
        clock.now = gone.last_seen + SUPERSEDED_FLOOR_SECONDS + 0.01
        assert gone.worker_id in registry.superseded()
    for waiting in (slow, unnamed):  # each waits out the lease, superseded or not
        clock.now = waiting.last_seen + 29.9
        assert waiting.worker_id not in registry.superseded() + registry.expired()
        clock.now = waiting.last_seen + 30.1
        assert waiting.worker_id in registry.expired()


def test_a_worker_taken_over_from_an_image_keeps_the_whole_lease() -> None:
    """A new primary adopts the registry with no pace known: it times nothing it did not see."""
    clock = Clock()
    primary = WorkerRegistry(max_workers=8, lease_ttl=60, clock=clock)
    dead = primary.add("w1")
    paced(primary, clock, dead, 0.5)
    primary.add("w1")
    taken_over = WorkerRegistry(max_workers=8, lease_ttl=60, clock=clock)
    taken_over.adopt(primary.export())
    clock.now += 59
    assert taken_over.superseded() == [] and primary.superseded() == [dead.worker_id]
    restarted = taken_over.add("w1")  # the namesake registering at the new primary
    assert taken_over.silent_namesake("w1", excluding=[restarted.worker_id]) is None


def test_a_name_found_shared_keeps_its_workers_the_lease_until_their_pace_shows() -> None:
    """Two live processes given one name: the second's registration takes the first, in its set-up,
    for a dead one. When the first's client registers again its name is known shared: said once,
    and a registration of that name with no pace known waits out the lease again."""
    clock = Clock()
    state = new_state("gem", clock)  # the lease 10 s
    first = state.register("trainer", SPEC, encoded(np.zeros(64, np.float32)), client_id="a").worker
    clock.now += 2.0  # the first loading its data
    second = state.register("trainer", SPEC, None, client_id="b")
    assert second.displaced is first and second.displaced_because == SUPERSEDED and second.shared_name == ""
    clock.now += 2.0
    back = state.register("trainer", SPEC, None, client_id="a")  # its next request refused: registered again
    assert (back.displaced, back.shared_name) == (None, "trainer")
    clock.now += 5.0
    assert state.evict_expired() == []  # neither is taken for dead any more before its lease
    third = state.register("trainer", SPEC, None, client_id="c")
    assert third.displaced is None and third.shared_name == ""  # said once a name
    clock.now = second.worker.last_seen + 10.1  # the second's lease (silent since it registered) and no more
    assert [worker.worker_id for worker, _ in state.evict_expired()] == [second.worker.worker_id]


def test_a_restart_after_its_dead_namesake_was_superseded_does_not_share_the_name() -> None:
    """Restarted twice (compose's crash loop): each life supersedes the one before, and none comes back."""
    clock = Clock()
    state = new_state("gem", clock)
    lives = [state.register("w1", SPEC, encoded(np.zeros(64, np.float32)), client_id="life-0")]
    for life in range(1, 4):
        clock.now += 1.5
        lives.append(state.register("w1", SPEC, None, client_id=f"life-{life}"))
        assert lives[-1].displaced is lives[-2].worker and lives[-1].shared_name == ""
    assert scopes(state) == ["life-3"] and "w1" not in state.registry.shared_names


def test_a_full_server_displacing_a_live_namesake_says_it_was_full() -> None:
    """The idlest worker of a full server (no commit for longer than the lease, its pulls keeping it
    alive and paced) happens to share the newcomer's name: displaced because the server was full,
    not superseded, and its client coming back does not make the name shared."""
    clock = Clock()
    state = new_state("gem", clock, max_workers=2)  # the lease 10 s
    puller = state.register("w1", SPEC, encoded(np.zeros(64, np.float32)), client_id="a").worker
    committer = state.register("w2", SPEC, None, client_id="b").worker
    for _ in range(24):  # 12 s: the puller pulls, the other commits
        clock.now += 0.5
        state.registry.touch(puller.worker_id)
        state.registry.touch(committer.worker_id, committed=True)
    newcomer = state.register("w1", SPEC, None, client_id="c")
    assert (newcomer.displaced, newcomer.displaced_because) == (puller, SERVER_FULL)
    state.leave(newcomer.worker.worker_id)
    assert state.register("w1", SPEC, None, client_id="a").shared_name == ""  # the puller back: no namesake's return


def test_the_names_remembered_are_bounded() -> None:
    names = SharedNames(remembered=3)
    for client in range(10):
        names.superseded(f"client-{client}", f"name-{client}")
    assert [names.returned(f"client-{client}") for client in range(10)] == [""] * 7 + ["name-7", "name-8", "name-9"]
    for client in range(10, 20):
        names.superseded(f"client-{client}", f"name-{client}")
        names.returned(f"client-{client}")
    assert [f"name-{n}" in names for n in (7, 16, 17, 18, 19)] == [False, False, True, True, True]
    names.superseded("", "unnamed-client")  # neither an unnamed client nor an unnamed worker is remembered
    names.superseded("client", "")
    assert names.returned("") == names.returned("client") == ""


def test_the_primary_journals_the_eviction_and_a_backup_forgets_the_same_worker() -> None:
    clock = Clock()
    primary, backup = new_state("gem", clock), new_state("gem", Clock())  # lease 10 s
    journal = ListJournal()
    primary.core.journal = journal
    dead = primary.register("w1", SPEC, encoded(np.zeros(64, np.float32))).worker
    alive = primary.register("w2", SPEC, None).worker
    paced(primary.registry, clock, dead, 0.5)
    restarted = primary.register("w1", SPEC, None).worker
    clock.now = dead.last_seen + SUPERSEDED_GAPS * 0.5 + 0.01
    assert [(worker.worker_id, why) for worker, why in primary.evict_expired()] == [(dead.worker_id, SUPERSEDED)]
    assert isinstance(entries.decode(journal.frames[-1])[0], Departed)
    replay_all(primary, backup, journal)
    assert scopes(backup) == scopes(primary) == [alive.worker_id, restarted.worker_id]


def test_a_restart_registering_after_its_pace_ran_out_takes_the_dead_ones_place_at_once() -> None:
    """Its slot, so its data shard too: the dead one's shard is read again, not shared with another."""
    clock = Clock()
    primary, backup = new_state("gem", clock, max_workers=4), new_state("gem", Clock(), max_workers=4)
    journal = ListJournal()
    primary.core.journal = journal
    first = primary.register("w0", SPEC, encoded(np.zeros(64, np.float32))).worker
    dead, live = primary.register("w1", SPEC, None).worker, primary.register("w2", SPEC, None).worker
    for worker in (first, dead, live):
        paced(primary.registry, clock, worker, 0.25)
    clock.now += SUPERSEDED_GAPS * 0.25  # w1 died a moment ago; w2 is busy
    primary.registry.touch(live.worker_id)
    namesake_of_the_live_one = primary.register("w2", SPEC, None)
    assert namesake_of_the_live_one.displaced is None
    restarted = primary.register("w1", SPEC, None)
    assert restarted.displaced is dead and restarted.displaced_because == SUPERSEDED
    assert restarted.worker.slot == dead.slot and dead.worker_id not in primary.registry
    replay_all(primary, backup, journal)
    assert scopes(backup) == scopes(primary)
    assert backup.registry.slot_of(restarted.worker.worker_id) == dead.slot


def test_its_pace_is_its_recent_gaps_not_a_start_ups_waits() -> None:
    """The rig's workers waited seconds for the first rounds while the others started (16 processes
    importing torch on 2 cores): timed by their longest gap ever, a dead one stood 12-13 s after its
    restart registered, where its pace of the minute before was a fraction of a second."""
    clock = Clock()
    registry = WorkerRegistry(max_workers=8, lease_ttl=60, clock=clock)
    dead = registry.add("w1")
    registry.touch(dead.worker_id)
    clock.now += 4.0  # the first round, waiting for the others to start
    paced(registry, clock, dead, 0.2, requests=PACE_GAPS)
    assert dead.pace == pytest.approx(4.0)
    paced(registry, clock, dead, 0.2, requests=1)
    assert dead.pace == pytest.approx(0.2)
    clock.now += 5.0  # killed; restarted 5 s later
    restarted = registry.add("w1")
    assert registry.silent_namesake("w1", excluding=[restarted.worker_id]) is dead
