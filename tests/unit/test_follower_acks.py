"""A backup's acknowledgements (replication/follower.py), a real primary's forwarder and a real
follower on a TCP socket: entries that arrive back to back are acknowledged together, at most
ACK_EVERY at a time (issue 80: one acknowledgement per entry cost the primary a read and a
hand-over per commit), and the backup that replayed them holds the primary's θ bit for bit."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from typing import cast

import numpy as np
import pytest

from gemps_proto.schema import PayloadKind
from gemps_server.domain.applier import Applier
from gemps_server.domain.records import Commit
from gemps_server.domain.state import ServerState
from gemps_server.domain.workers import WorkerRegistry
from gemps_server.replication import follower, links
from gemps_server.replication.follower import Follower
from gemps_server.replication.forwarder import Forwarder, Peer
from gemps_server.replication.handshake import Handshake
from tests.helpers import encoded, training, wait_for
from tests.unit.test_forwarder import P, primary

BACKUP = Peer("backup", "i1")


class Proven:
    """The handshake's part once both sides proved themselves (handshake.py, tested on its own):
    the socket as it is, no ticket key, no certificate to check."""

    def join(self, sock: socket.socket, *_: object) -> tuple[socket.socket, bytes]:
        return sock, b""

    def certificate_check(self, sock: socket.socket, peer: str) -> object:
        return lambda: ""


@pytest.fixture
def appliers() -> Iterator[tuple[Applier, Applier]]:
    running = (Applier(), Applier())
    for applier in running:
        applier.start()
    yield running
    for applier in running:
        applier.stop()


def following(
    primary_applier: Applier, backup_applier: Applier
) -> tuple[ServerState, Forwarder, str, ServerState, Follower]:
    """A primary with one worker, and a backup seeded from it and in its in-sync set (its stream)."""
    in_sync: list[list[Peer]] = []
    state, journal, worker = primary(primary_applier, in_sync)
    listener = socket.create_server(("127.0.0.1", 0))
    accepted: list[socket.socket] = []
    threading.Thread(target=lambda: accepted.append(listener.accept()[0]), daemon=True).start()
    backup = ServerState(training("downpour"), WorkerRegistry(max_workers=4, lease_ttl=3600))
    address = f"127.0.0.1:{listener.getsockname()[1]}"
    handshake = cast(Handshake, Proven())
    stream = Follower(backup, backup_applier, BACKUP, address, 3, handshake, "primary", lambda why: None)
    stream.start()
    wait_for(lambda: bool(accepted), 10, "the backup dialled")
    listener.close()
    assert journal.attach(BACKUP, accepted[0]) == ""
    wait_for(lambda: in_sync == [[BACKUP]], 10, "the backup in sync")
    return state, journal, worker, backup, stream


@pytest.mark.parametrize("every", [follower.ACK_EVERY, 2])
def test_entries_that_arrive_together_are_acknowledged_together(
    appliers: tuple[Applier, Applier], monkeypatch: pytest.MonkeyPatch, every: int
) -> None:
    monkeypatch.setattr(follower, "ACK_WITHIN", 60.0)  # only what has arrived decides
    monkeypatch.setattr(follower, "ACK_EVERY", every)
    acknowledged: list[int] = []
    heard = links.Link.acknowledged

    def hearing(link: links.Link, position: int) -> str:
        acknowledged.append(position)
        return heard(link, position)

    monkeypatch.setattr(links.Link, "acknowledged", hearing)
    primary_applier, backup_applier = appliers
    state, journal, worker, backup, stream = following(primary_applier, backup_applier)
    seeded = journal.last
    # The backup's applier held: it reads the first entry and waits, the others arrive meanwhile.
    release = threading.Event()
    backup_applier.submit_then(release.wait, lambda timed, error: None)
    replicated: list[BaseException | None] = []
    rng = np.random.default_rng(5)
    for number in range(5):
        payload = encoded(rng.standard_normal(P).astype(np.float32))
        outcome = state.core.commit_record(
            Commit(worker, state.core.version, PayloadKind.UPDATE, payload, f"r{number}")
        )
        journal.when_replicated(outcome.position, replicated.append)
    release.set()
    wait_for(lambda: replicated == [None] * 5, 10, "the five commits acknowledged")
    entries = [position for position in acknowledged if position > seeded]
    last = journal.last
    expected = [last] if every >= 5 else [*range(seeded + every, last + 1, every), last]
    assert entries[: len(expected)] == expected
    assert set(entries[len(expected) :]) <= {last}  # beats answered since: the same position
    assert backup.core.theta_copy().tobytes() == state.core.theta_copy().tobytes()
    stream.stop()
    journal.close()
    stream.join(10)
