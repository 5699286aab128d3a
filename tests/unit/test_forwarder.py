"""The primary's forwarder, on a real socket pair: what a backup that is being seeded or has
fallen behind can cost the primary (bounded), and when a commit may be acknowledged."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterable, Iterator

import numpy as np
import pytest

from gemps_proto.schema import ParameterSpec, PayloadKind
from gemps_server.domain.applier import Applier
from gemps_server.domain.journal import Committed
from gemps_server.domain.records import Commit
from gemps_server.domain.state import ServerState
from gemps_server.domain.workers import WorkerRegistry
from gemps_server.replication import entries, frames, links
from gemps_server.replication.forwarder import Forwarder, Peer
from tests.helpers import encoded, training, wait_for

P = 100_000  # 400 KB per commit: a few fill a socket's buffers


@pytest.fixture
def applier() -> Iterator[Applier]:
    running = Applier()
    running.start()
    yield running
    running.stop()


def primary(
    applier: Applier,
    in_sync: list[list[Peer]],
    awaited: tuple[Peer, ...] = (),
    attach_within: float = 0.0,
    min_in_sync: int = 1,
) -> tuple[ServerState, Forwarder, str]:
    state = ServerState(training("downpour"), WorkerRegistry(max_workers=4, lease_ttl=3600))

    def set_in_sync(peers: Iterable[Peer]) -> bool:
        in_sync.append(list(peers))
        return True

    journal = Forwarder(
        state,
        applier,
        epoch=3,
        set_in_sync=set_in_sync,
        holds=lambda: True,
        timeout=5.0,
        backups=1,
        awaited=awaited,
        attach_within=attach_within,
        min_in_sync=min_in_sync,
    )
    state.core.journal = journal
    worker = state.register("w", (ParameterSpec("w", (P,)),), encoded(np.zeros(P, np.float32))).worker.worker_id
    return state, journal, worker


def commit(state: ServerState, worker: str, number: int) -> int:
    payload = encoded(np.ones(P, np.float32))
    outcome = state.core.commit_record(
        Commit(worker, state.core.version, PayloadKind.UPDATE, payload, request_id=f"r{number}")
    )
    return outcome.position


def test_a_backup_that_reads_nothing_is_let_go_past_its_queue_bound(
    applier: Applier, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(links, "QUEUE_FLOOR_BYTES", 4 * P * 4)
    in_sync: list[list[Peer]] = []
    state, journal, worker = primary(applier, in_sync)
    ours, theirs = socket.socketpair()
    with ours, theirs:
        journal.attach(Peer("backup", "i1"), ours)
        wait_for(lambda: journal.lags() != (), 10, "the backup attached")
        # Its seed is taken on the applier: in the server commits run there too, after it. These
        # commits do not, so wait for the applier first (the seed then holds none of them; a seed
        # taken after them held all 40, and the queue never filled).
        applied = threading.Event()
        applier.submit_then(lambda: None, lambda timed, error: applied.set())
        assert applied.wait(10)
        for number in range(40):  # it never reads: the socket fills, then its queue
            outcomes: list[BaseException | None] = []
            journal.when_replicated(commit(state, worker, number), outcomes.append)
            assert outcomes == [None]  # at once: a backup not in sync holds no commit back
        wait_for(lambda: journal.lags() == (), 10, "the backup let go")
    assert in_sync == []  # never in sync: the in-sync set was never written
    journal.close()


def test_a_seeded_backup_joins_the_in_sync_set_and_commits_wait_for_it(applier: Applier) -> None:
    in_sync: list[list[Peer]] = []
    state, journal, worker = primary(applier, in_sync)
    ours, theirs = socket.socketpair()
    with ours, theirs:
        journal.attach(Peer("backup", "i1"), ours)
        seed = frames.receive(theirs)
        # The seed carries no secret: the data plane's ticket key travels sealed in the handshake.
        assert seed.kind == frames.SEED
        assert seed.header == {"epoch": 3, "position": journal.last}
        frames.send(theirs, frames.Frame(frames.ACK, {"position": seed.header["position"]}))
        wait_for(lambda: in_sync == [[Peer("backup", "i1")]], 10, "the backup in sync")
        position = commit(state, worker, 1)
        acknowledged = threading.Event()
        journal.when_replicated(position, lambda error: acknowledged.set())
        entry = frames.receive(theirs)
        while entry.kind == frames.BEAT:
            entry = frames.receive(theirs)
        assert entry.kind == frames.ENTRY and entry.header["position"] == position
        assert not acknowledged.wait(0.3)  # not before the backup applied it
        frames.send(theirs, frames.Frame(frames.ACK, {"position": position}))
        assert acknowledged.wait(5)
    journal.close()


def test_a_new_primary_acknowledges_nothing_until_the_live_replica_it_awaits_is_seeded(applier: Applier) -> None:
    """Right after a failover the old primary, alive, is the only other replica that could hold
    what the new one acknowledges: it stays in the in-sync set, and commits wait for its seed."""
    in_sync: list[list[Peer]] = []
    old_primary = Peer("old-primary", "i0")
    state, journal, worker = primary(applier, in_sync, awaited=(old_primary,), attach_within=30.0)
    position = commit(state, worker, 1)
    acknowledged = threading.Event()
    journal.when_replicated(position, lambda error: acknowledged.set())
    assert not acknowledged.wait(0.3)  # nobody holds it but this replica yet
    assert [(lag.name, lag.in_sync) for lag in journal.lags()] == [("old-primary", True)]
    ours, theirs = socket.socketpair()
    with ours, theirs:
        journal.attach(Peer("old-primary", "i0"), ours)
        seed = frames.receive(theirs)
        assert seed.kind == frames.SEED and seed.header["position"] == position  # the seed holds it
        assert not acknowledged.is_set()
        frames.send(theirs, frames.Frame(frames.ACK, {"position": position}))
        assert acknowledged.wait(5)
        assert in_sync[-1] == [old_primary]  # listed all along: no write ever left it out
        assert all(old_primary in written for written in in_sync)
    journal.close()


def test_an_awaited_replica_that_does_not_attach_in_time_is_dropped_and_commits_go_on(applier: Applier) -> None:
    in_sync: list[list[Peer]] = []
    state, journal, worker = primary(applier, in_sync, awaited=(Peer("old-primary", "i0"),), attach_within=0.2)
    acknowledged = threading.Event()
    journal.when_replicated(commit(state, worker, 1), lambda error: acknowledged.set())
    assert acknowledged.wait(10)  # after attach_within: the etcd write leaves it out first
    assert in_sync == [[]] and journal.lags() == ()
    journal.close()


def seed_in_sync(
    journal: Forwarder, in_sync: list[list[Peer]], peer: Peer, ours: socket.socket, theirs: socket.socket
) -> int:
    """Attach `peer` on `ours`, acknowledge its seed from `theirs`, wait until it is listed: the seed's position."""
    assert journal.attach(peer, ours) == ""
    seed = frames.receive(theirs)
    assert seed.kind == frames.SEED
    frames.send(theirs, frames.Frame(frames.ACK, {"position": seed.header["position"]}))
    wait_for(lambda: bool(in_sync) and in_sync[-1] == [peer], 10, f"{peer.name} in sync")
    return int(seed.header["position"])


def test_a_floor_of_two_keeps_a_lost_backup_listed_and_commits_wait_for_its_successor(applier: Applier) -> None:
    """--min-in-sync 2 (issue 77, Jepsen seed 19): the only backup's connection breaks. It is not
    dropped (it could still be promoted, holding every acknowledged commit), nothing is acknowledged
    while the primary alone holds it, Status says why, and the backup's next hello takes its place:
    once it is seeded, what waited is acknowledged."""
    in_sync: list[list[Peer]] = []
    state, journal, worker = primary(applier, in_sync, min_in_sync=2)
    backup = Peer("backup", "i1")
    first = commit(state, worker, 0)
    waited: list[BaseException | None] = []
    journal.when_replicated(first, waited.append)
    assert waited == []  # no backup in the set yet: the primary alone holds it
    ours, theirs = socket.socketpair()
    with ours:
        assert seed_in_sync(journal, in_sync, backup, ours, theirs) >= first
        wait_for(lambda: waited == [None], 10, "the first commit acknowledged once the backup holds it")
        theirs.close()  # the backup goes away
        wait_for(lambda: "disconnected" in journal.stalled(), 10, "the lost backup kept in the set")
    assert "--min-in-sync 2" in journal.stalled()
    second = commit(state, worker, 1)
    acknowledged = threading.Event()
    journal.when_replicated(second, lambda error: acknowledged.set())
    assert not acknowledged.wait(0.5)  # the primary alone holds it
    assert all(written == [backup] for written in in_sync)  # never written out of the set
    assert [(lag.name, lag.in_sync) for lag in journal.lags()] == [("backup", True)]
    ours, theirs = socket.socketpair()
    with ours, theirs:
        assert seed_in_sync(journal, in_sync, backup, ours, theirs) >= second  # its successor
        assert acknowledged.wait(10)
        assert journal.stalled() == ""
    journal.close()


def test_a_floor_of_two_keeps_the_awaited_replica_listed_when_it_does_not_attach_in_time(applier: Applier) -> None:
    """Unlike --min-in-sync 1 (the test above it): a new primary whose only other replica does not
    attach keeps it listed and acknowledges nothing alone."""
    in_sync: list[list[Peer]] = []
    old_primary = Peer("old-primary", "i0")
    state, journal, worker = primary(applier, in_sync, awaited=(old_primary,), attach_within=0.2, min_in_sync=2)
    acknowledged = threading.Event()
    journal.when_replicated(commit(state, worker, 1), lambda error: acknowledged.set())
    assert not acknowledged.wait(1.0)  # five times attach_within
    assert in_sync == [] and [(lag.name, lag.in_sync) for lag in journal.lags()] == [("old-primary", True)]
    ours, theirs = socket.socketpair()
    with ours, theirs:
        seed_in_sync(journal, in_sync, old_primary, ours, theirs)
        assert acknowledged.wait(10)
    journal.close()


def test_a_seed_of_more_tensors_than_one_sendmsg_takes_arrives_whole() -> None:
    # A seed is a buffer per tensor (per-worker rule state makes many): past IOV_MAX in one frame.
    blobs = [bytes([n % 251]) * (n % 7) for n in range(3 * frames.MAX_BUFFERS)]
    ours, theirs = socket.socketpair()
    with ours, theirs:
        sender = threading.Thread(target=frames.send, args=(ours, frames.Frame(frames.SEED, {}, blobs)))
        sender.start()
        received = frames.receive(theirs)
        sender.join()
    assert [bytes(blob) for blob in received.blobs] == blobs


def entry_now(sock: socket.socket) -> frames.Frame:
    """The next entry on `sock` (beats passed over), read without waiting: BlockingIOError if none is there."""
    sock.setblocking(False)
    try:
        frame = frames.receive(sock)
        while frame.kind == frames.BEAT:
            frame = frames.receive(sock)
        return frame
    finally:
        sock.setblocking(True)


def test_an_entry_is_on_the_backups_socket_when_its_commit_returns(applier: Applier) -> None:
    """With nothing queued before it, the thread that applies a commit writes its entry to the
    backup's socket itself (issue 80: a sender thread was woken for each): the whole entry is
    there to read the moment the commit returns."""
    in_sync: list[list[Peer]] = []
    state, journal, worker = primary(applier, in_sync)
    ours, theirs = socket.socketpair()
    ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)  # room for an entry of 400 KB
    with ours, theirs:
        seed_in_sync(journal, in_sync, Peer("backup", "i1"), ours, theirs)
        for number in range(3):
            position = commit(state, worker, number)
            entry = entry_now(theirs)
            assert (entry.kind, entry.header["position"]) == (frames.ENTRY, position)
            frames.send(theirs, frames.Frame(frames.ACK, {"position": position}))
    journal.close()


def test_entries_the_socket_cannot_take_at_once_follow_whole_and_in_order(applier: Applier) -> None:
    """What the socket does not take at once goes to the sender thread, and so does every entry
    after it until that is written: a backup that reads nothing while 12 entries of 400 KB are
    appended (its socket holds about half of one; beats fall due meanwhile) then reads them all
    gets each whole, in order, and beats only between frames; one acknowledgement of the last
    acknowledges every commit."""
    in_sync: list[list[Peer]] = []
    state, journal, worker = primary(applier, in_sync)
    ours, theirs = socket.socketpair()
    with ours, theirs:
        seed_in_sync(journal, in_sync, Peer("backup", "i1"), ours, theirs)
        positions: list[int] = []
        acknowledged: list[BaseException | None] = []
        for number in range(12):
            payload = encoded(np.full(P, number + 1.0, np.float32))
            position = state.core.commit_record(
                Commit(worker, state.core.version, PayloadKind.UPDATE, payload, f"r{number}")
            ).position
            journal.when_replicated(position, acknowledged.append)
            positions.append(position)
            if number == 5:
                time.sleep(2 * frames.BEAT_SECONDS)  # a beat is due: it must wait for the queue
        received: list[tuple[int, float, float]] = []
        while len(received) < len(positions):
            frame = frames.receive(theirs)
            if frame.kind == frames.ENTRY:
                entry, position, epoch = entries.decode(frame)
                assert isinstance(entry, Committed) and epoch == 3
                values = np.frombuffer(entry.commit.payload.data, np.float32)
                received.append((position, float(values[0]), float(values[-1])))
            else:
                assert frame.kind == frames.BEAT
        assert received == [(position, n + 1.0, n + 1.0) for n, position in enumerate(positions)]
        assert acknowledged == []
        frames.send(theirs, frames.Frame(frames.ACK, {"position": positions[-1]}))
        wait_for(lambda: acknowledged == [None] * len(positions), 10, "every commit acknowledged")
    journal.close()
