"""The replication listener's door (replication/door.py, issue 77 item 8): its places for
connections waiting for their admission, and what it refuses at once. A real listener on loopback
and the door's own thread; the verdict on an admission is this module's (handshake.py's is tested
against a real primary: tests/integration/test_replica_handshake.py)."""

from __future__ import annotations

import collections
import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

from gemps_server.replication import frames
from gemps_server.replication.door import Door
from gemps_server.replication.handshake import Refused
from tests.helpers import wait_for

GOOD_NONCE = b"n" * 32
#: the most a test waits for the door's thread to do what it does at once
PATIENCE = 30.0


def admission(nonce: bytes = GOOD_NONCE) -> bytes:
    return frames.PREAMBLE.pack(frames.PREAMBLE_MAGIC, 7, 1, nonce, b"m" * 32)


@dataclass
class Doorway:
    """A door on a loopback listener, its thread running; what it handed on and turned away."""

    port: int
    door: Door
    entered: list[tuple[socket.socket, str]] = field(default_factory=list)
    turned: collections.Counter[str] = field(default_factory=collections.Counter)

    def dial(self, source: str = "127.0.0.1") -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.port), timeout=5, source_address=(source, 0))


@contextlib.contextmanager
def doorway(
    places: int, per_address: int, seconds: float = 30.0, held: threading.Event | None = None
) -> Iterator[Doorway]:
    """`held`: the door's thread waits for it at each connection it turns away (after counting it)."""

    def judge(preamble: bytes, host: str) -> str:
        if frames.PREAMBLE.unpack(preamble)[3] != GOOD_NONCE:
            raise Refused("no proof", reason="unproven")
        return "partition-0-replica-1"

    listener = socket.create_server(("127.0.0.1", 0))
    entered: list[tuple[socket.socket, str]] = []
    turned: collections.Counter[str] = collections.Counter()

    def turn(reason: str, host: str, why: str) -> None:
        turned[reason] += 1
        if held is not None:
            held.wait(PATIENCE)

    door = Door(
        listener, judge, lambda sock, host, name: entered.append((sock, name)), turn, places, per_address, seconds
    )
    thread = threading.Thread(target=door.run)
    thread.start()
    try:
        yield Doorway(listener.getsockname()[1], door, entered, turned)
    finally:
        door.stop()
        thread.join(10)
        for sock, _ in entered:
            sock.close()


def closed(sock: socket.socket) -> bool:
    """Whether the door closed `sock` (what it sent first read and dropped)."""
    sock.setblocking(False)
    try:
        while data := sock.recv(65536):
            del data
        return True
    except BlockingIOError:
        return False
    except OSError:
        return True


def test_past_its_address_places_a_newcomer_takes_the_oldest_ones() -> None:
    with doorway(places=8, per_address=2) as way:
        first, second = way.dial(), way.dial()
        wait_for(lambda: way.door.waiting == 2, PATIENCE, "both waiting")
        third = way.dial()
        wait_for(lambda: way.turned["displaced"] == 1, PATIENCE, "the oldest displaced")
        wait_for(lambda: closed(first), PATIENCE, "the oldest's socket closed (the door counts, then closes)")
        assert not closed(second) and not closed(third)
        # The door closes the oldest before it files the newcomer: read the count once it has.
        wait_for(lambda: way.door.waiting == 2, PATIENCE, "the newcomer waiting in the oldest's place")
        for sock in (first, second, third):
            sock.close()


def test_past_every_place_the_fullest_address_gives_way() -> None:
    with doorway(places=3, per_address=2) as way:
        flood = [way.dial("127.0.0.1"), way.dial("127.0.0.1")]
        other = way.dial("127.0.0.2")
        wait_for(lambda: way.door.waiting == 3, PATIENCE, "all three waiting")
        newcomer = way.dial("127.0.0.3")
        wait_for(lambda: way.turned["displaced"] == 1, PATIENCE, "one displaced")
        wait_for(lambda: closed(flood[0]), PATIENCE, "the fullest address's oldest socket closed")
        assert not closed(flood[1]) and not closed(other) and not closed(newcomer)
        for sock in (*flood, other, newcomer):
            sock.close()


def test_an_admission_is_handed_on_and_whatever_else_opens_is_refused_at_once() -> None:
    with doorway(places=4, per_address=2) as way:
        silent = [way.dial(), way.dial()]  # the address's places taken
        wait_for(lambda: way.door.waiting == 2, PATIENCE, "the silent ones waiting")
        backup = way.dial()  # displaces one of them, then shows its admission
        backup.sendall(admission())
        assert frames.door_answer(backup, time.monotonic() + PATIENCE) is None  # the door opened
        wait_for(lambda: len(way.entered) == 1, PATIENCE, "the backup handed on")
        assert way.entered[0][1] == "partition-0-replica-1"
        for opening in (b"\x16\x03\x01\x02\x00", admission(b"x" * 32)):  # a ClientHello's start; no proof
            with way.dial() as stranger:
                stranger.sendall(opening)
                refusal = frames.door_answer(stranger, time.monotonic() + PATIENCE)
                assert refusal is not None and refusal.kind == frames.REFUSED
        assert way.turned["unproven"] == 2  # (and those that waited for their bytes displaced a silent one each)
        for sock in (*silent, backup):
            sock.close()


@pytest.mark.parametrize("sent", [b"", frames.PREAMBLE_MAGIC[:5]], ids=["nothing", "half-a-magic"])
def test_a_connection_that_shows_no_admission_in_time_is_closed(sent: bytes) -> None:
    with doorway(places=4, per_address=2, seconds=0.2) as way, way.dial() as sock:
        sock.sendall(sent)
        wait_for(lambda: way.turned["silent"] == 1, PATIENCE, "closed at its deadline")
        wait_for(lambda: closed(sock), PATIENCE, "its socket closed (the door counts, then closes)")
        assert way.door.waiting == 0


def test_an_admission_that_arrived_is_judged_not_displaced() -> None:
    """A backup's connection waiting for its admission, which arrives while newcomers from its
    address queue up: accepted in one batch, they displaced it with its admission unread (a silent
    flood's bursts from a backup's own address kept it out). What it sent is read first now."""
    go_on = threading.Event()
    with doorway(places=8, per_address=2, held=go_on) as way:
        silent = [way.dial(), way.dial()]
        wait_for(lambda: way.door.waiting == 2, PATIENCE, "the address's places taken")
        backup = way.dial()  # displaces the oldest silent one: the door's thread is held there
        wait_for(lambda: way.turned["displaced"] == 1, PATIENCE, "the door's thread held")
        newcomers = [way.dial(), way.dial()]  # in the listener's queue: enough to displace the backup
        backup.sendall(admission())
        go_on.set()
        assert frames.door_answer(backup, time.monotonic() + PATIENCE) is None  # the door opened
        wait_for(lambda: len(way.entered) == 1, PATIENCE, "the backup handed on (the door answers, then hands on)")
        for sock in (*silent, backup, *newcomers):
            sock.close()
