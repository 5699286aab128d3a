"""The primary election against a real etcd: one winner, failover after a dead primary's lease,
fencing when etcd stops answering, the in-sync rule, and the Coordinator's callbacks."""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator
from typing import Protocol

import pytest

from gemps_server.replication.coordinator import Coordinator
from gemps_server.replication.election import (
    ORPHANED_LEASES,
    Election,
    Member,
    new_incarnation,
)
from gemps_server.replication.etcd_client import CoordinationUnavailable
from gemps_server.replication.local_etcd import LocalEtcd
from tests.etcd_server import etcd_server
from tests.helpers import wait_for

LEASE = 2.0  # seconds: etcd's shortest lease is about that anyway (it raises shorter ones)
EXPIRY = LEASE + 3.0  # etcd checks for expired leases every half second, and revokes through raft


class MakeElection(Protocol):
    def __call__(self, name: str, restored: tuple[int, int] = (0, 0)) -> Election: ...


@pytest.fixture
def elect(etcd: LocalEtcd) -> Iterator[MakeElection]:
    """Elections of one partition (a fresh prefix per test), closed after the test."""
    prefix = f"/gemps/test-{uuid.uuid4().hex[:8]}/partition/0"
    made: list[Election] = []

    def make(name: str, restored: tuple[int, int] = (0, 0)) -> Election:
        me = Member(name, new_incarnation(), f"127.0.0.1:{5000 + len(made)}", f"127.0.0.1:{6000 + len(made)}")
        election = Election(etcd.endpoint, prefix, me, lease_seconds=LEASE, restored=restored)
        made.append(election)
        return election

    yield make
    for election in made:
        election.close()


def test_one_of_two_wins_and_the_other_sees_it(elect: MakeElection) -> None:
    a, b = elect("replica-0"), elect("replica-1")
    epochs = [a.campaign(), b.campaign()]
    assert epochs[0] is not None and epochs[1] is None
    assert a.epoch == epochs[0] and a.holds() and b.epoch is None and not b.holds()
    assert b.primary() == (a.me, epochs[0])  # the epoch is the key's create_revision
    assert a.in_sync() == [a.me.identity]  # a fresh job: the winner lists itself
    assert b.campaign() is None and a.campaign() == epochs[0]


def test_failover_after_the_primary_stops_renewing_and_the_old_primary_is_fenced(elect: MakeElection) -> None:
    a, b = elect("replica-0"), elect("replica-1")
    old = a.campaign()
    assert old is not None and a.renew()
    assert a.set_in_sync([b.me]) and b.in_sync() == [a.me.identity, b.me.identity]
    # a dies: it stops renewing without resigning; b wins once etcd expires a's lease
    new = wait_for(b.campaign, timeout=EXPIRY, what="b to win after a's lease", poll=0.2)
    assert new > old and b.primary() == (b.me, new)
    assert not a.holds()  # it stopped trusting its lease long before etcd let b win
    assert not a.set_in_sync([a.me])  # fenced by etcd: the primary key is another epoch's
    assert a.epoch is None and not a.renew()
    assert a.in_sync() == [a.me.identity, b.me.identity]


def test_a_replica_not_in_sync_cannot_campaign(elect: MakeElection) -> None:
    a, b, c = elect("replica-0"), elect("replica-1"), elect("replica-2")
    assert a.campaign() is not None and a.set_in_sync([b.me])
    a.resign()
    assert a.primary() is None and not a.holds()
    restarted = elect("replica-0")  # the same name, a new incarnation: it may lack commits
    assert c.campaign() is None and restarted.campaign() is None
    assert b.campaign() is not None


def test_a_paused_etcd_fences_the_primary_within_the_lease(etcd: LocalEtcd, elect: MakeElection) -> None:
    a = elect("replica-0")
    assert a.campaign() is not None and a.renew()
    renewed_at = time.monotonic()
    etcd.pause()
    try:
        with pytest.raises(CoordinationUnavailable):
            a.renew()  # times out: etcd does not answer
        wait_for(lambda: not a.holds(), timeout=LEASE, what="holds() to turn False")
        assert time.monotonic() - renewed_at < LEASE
        fenced = False
        try:
            fenced = not a.set_in_sync([])
        except CoordinationUnavailable:
            fenced = True
        assert fenced
        assert not a.renew() and a.epoch is None  # demoted for good
    finally:
        etcd.resume()
    assert not a.renew() and not a.holds()


def test_the_coordinators_callbacks(etcd: LocalEtcd, elect: MakeElection) -> None:
    a, b = elect("replica-0"), elect("replica-1")
    events: dict[str, list[object]] = {"a": [], "b": []}

    def coordinator(election: Election, key: str) -> Coordinator:
        return Coordinator(
            election,
            on_promoted=lambda epoch: events[key].append(("promoted", epoch)),
            on_demoted=lambda: events[key].append("demoted"),
            on_primary=lambda member, epoch: events[key].append(("primary", member, epoch)),
        )

    ca, cb = coordinator(a, "a"), coordinator(b, "b")
    ca.step()
    first = ca.epoch
    assert first is not None and events["a"] == [("primary", None, 0), ("promoted", first)]
    cb.step()
    cb.step()  # no change: nothing more reported
    assert events["b"] == [("primary", a.me, first)]
    assert a.set_in_sync([b.me])
    ca.step()  # renews
    assert events["a"] == [("primary", None, 0), ("promoted", first)]

    etcd.pause()
    try:
        wait_for(lambda: not a.holds(), timeout=LEASE, what="holds() to turn False")
        ca.step()
        ca.step()
        cb.step()  # etcd unreachable: logged, nothing raised
    finally:
        etcd.resume()
    assert events["a"][-1] == "demoted" and events["a"].count("demoted") == 1

    def b_promoted() -> bool:
        cb.step()
        return cb.epoch is not None

    wait_for(b_promoted, timeout=EXPIRY, what="b to be promoted", poll=0.2)
    second = cb.epoch
    assert second is not None and second > first
    ca.step()
    assert events["a"][-1:] == [("primary", b.me, second)] and events["a"].count(("promoted", first)) == 1
    assert ("promoted", second) in events["b"] and "demoted" not in events["b"]


def test_a_replica_unfit_to_lead_does_not_campaign_and_a_fit_one_leads(elect: MakeElection) -> None:
    """Issue 61 item 4: a replica whose certificate expired won its partition's election (its
    backups refuse that certificate: none could join). The unfit one stands aside."""
    a, b = elect("replica-0"), elect("replica-1")
    unfit = Coordinator(a, lambda _: None, lambda: None, lambda *_: None, unfit=lambda: "its certificate expired")
    fit = Coordinator(b, lambda _: None, lambda: None, lambda *_: None)
    unfit.step()
    assert unfit.epoch is None and a.primary() is None  # nobody leads, and it did not campaign
    fit.step()
    assert fit.epoch is not None and a.primary() == (b.me, fit.epoch)


def test_the_coordinator_thread_campaigns_and_resigns_on_stop(elect: MakeElection) -> None:
    a, b = elect("replica-0"), elect("replica-1")
    promoted: list[int] = []
    coordinator = Coordinator(a, on_promoted=promoted.append, on_demoted=lambda: None, on_primary=lambda *_: None)
    coordinator.start()
    try:
        epoch = wait_for(lambda: promoted and promoted[0], timeout=5.0, what="promotion")
        time.sleep(LEASE)  # the thread renews: still primary after a whole lease
        assert a.holds() and b.primary() == (a.me, epoch)
    finally:
        coordinator.stop(resign=True)
    assert b.primary() is None and promoted == [epoch]


def test_a_dead_endpoint_is_skipped_for_the_next(etcd: LocalEtcd) -> None:
    me = Member("replica-0", new_incarnation(), "127.0.0.1:5000", "127.0.0.1:6000")
    closed = "http://127.0.0.1:1"  # nothing listens on port 1: refused at once
    election = Election(f"{closed},{etcd.endpoint}", f"/gemps/test-{uuid.uuid4().hex[:8]}/partition/0", me, LEASE)
    try:
        with pytest.raises(CoordinationUnavailable, match=r"127\.0\.0\.1:1\b"):
            election.primary()
        assert election.primary() is None  # the next call went to the live endpoint
    finally:
        election.close()
    with pytest.raises(ValueError, match="timeout"):
        Election(etcd.endpoint, "/p", me, lease_seconds=3.0, timeout=2.0)  # over a third of the lease


def test_local_etcd_stops_and_removes_its_data() -> None:
    with etcd_server() as etcd:
        data_dir, pid = etcd.data_dir, etcd.pid
        assert data_dir is not None and data_dir.is_dir()
    assert not data_dir.exists() and etcd.data_dir is None
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # gone (reaped by the stop)


def test_a_job_whose_in_sync_replicas_are_all_gone_is_taken_over_after_the_grace(elect: MakeElection) -> None:
    """Every process that held the acknowledged commits is gone (a whole job restarted): without a
    way out nobody could ever be promoted. After ORPHANED_LEASES leases with none of them alive,
    another replica may take over (and lists itself alone)."""
    old = elect("replica-0")
    assert old.campaign() is not None
    old.announce()
    old.close()  # the process dies: it renews nothing, its keys expire with their leases
    restarted = elect("replica-0")  # same name, new incarnation: not in sync
    restarted.announce()
    wait_for(lambda: restarted.primary() is None, EXPIRY * 2, "the dead primary's key to expire")
    assert restarted.campaign() is None  # orphaned only just now: it waits the grace out
    started = time.monotonic()
    wait_for(lambda: restarted.campaign() is not None, ORPHANED_LEASES * LEASE + EXPIRY * 2, "the takeover")
    assert time.monotonic() - started >= ORPHANED_LEASES * LEASE - 1.0
    assert restarted.in_sync() == [restarted.me.identity]


def test_the_takeover_goes_to_the_newest_checkpoint_by_epoch_then_version(elect: MakeElection) -> None:
    """A whole job restarted: each replica holds only its checkpoint. The one whose checkpoint is of
    the later epoch takes over, though the other's has the higher version (an old primary's
    commits past the new primary's, never acknowledged); the other never campaigns."""
    old = elect("replica-0")
    assert old.campaign() is not None
    old.close()
    stale, newest = elect("replica-0", restored=(7, 100)), elect("replica-1", restored=(9, 90))
    wait_for(lambda: newest.primary() is None, EXPIRY * 2, "the dead primary's key to expire")
    deadline = time.monotonic() + ORPHANED_LEASES * LEASE + EXPIRY * 2
    won = None
    while won is None and time.monotonic() < deadline:
        stale.announce()
        newest.announce()
        assert stale.campaign() is None
        won = newest.campaign()
        time.sleep(LEASE / 4)
    assert won is not None, "the replica with the newest checkpoint never took over"
    assert newest.in_sync() == [newest.me.identity]


def test_an_in_sync_replica_alive_keeps_a_replica_that_is_not_from_taking_over(elect: MakeElection) -> None:
    primary, backup, newcomer = elect("replica-0"), elect("replica-1"), elect("replica-2")
    assert primary.campaign() is not None
    assert primary.set_in_sync([backup.me])
    primary.close()  # dies; the backup lives (announces) but is cut off from campaigning here
    deadline = time.monotonic() + ORPHANED_LEASES * LEASE + EXPIRY * 2
    while time.monotonic() < deadline:
        backup.announce()
        newcomer.announce()
        assert newcomer.campaign() is None
        time.sleep(LEASE / 4)
    assert backup.campaign() is not None  # the one that holds every acknowledged commit may
