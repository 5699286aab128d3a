"""The replication listener's places for unproven connections (greetings.py, issue 61 item 11)."""

from __future__ import annotations

import socket
from collections.abc import Sequence

from gemps_server.replication.greetings import Greeting, Greetings


def oldest(waiting: Sequence[Greeting]) -> Greeting:
    return waiting[0]


def test_an_address_holds_its_places_and_a_newcomer_displaces_one_of_them() -> None:
    greetings = Greetings(total=8, per_address=2, choose=oldest)
    with socket.socket() as a, socket.socket() as b, socket.socket() as c:
        first, none = greetings.place(a, "10.0.0.1")
        second, _ = greetings.place(b, "10.0.0.1")
        assert first is not None and second is not None and none is None
        third, displaced = greetings.place(c, "10.0.0.1")
        assert third is not None and displaced is first and not first.placed
        assert greetings.from_address("10.0.0.1") == 2 and greetings.held == 2
        greetings.release(first)  # its thread's own release, after the displacement: nothing
        assert greetings.held == 2


def test_vouched_for_a_connection_leaves_its_place_and_cannot_be_displaced() -> None:
    greetings = Greetings(total=8, per_address=1, choose=oldest)
    with socket.socket() as backup, socket.socket() as flood:
        mine, _ = greetings.place(backup, "10.0.0.1")
        assert mine is not None
        greetings.release(mine)  # its hello proved the key
        theirs, displaced = greetings.place(flood, "10.0.0.1")
        assert theirs is not None and displaced is None and greetings.held == 1


def test_past_the_total_a_new_address_is_refused() -> None:
    greetings = Greetings(total=2, per_address=2)
    sockets = [socket.socket() for _ in range(4)]
    try:
        assert greetings.place(sockets[0], "10.0.0.1")[0] is not None
        assert greetings.place(sockets[1], "10.0.0.2")[0] is not None
        assert greetings.place(sockets[2], "10.0.0.3") == (None, None)
        assert greetings.from_address("10.0.0.3") == 0
        # below its own share (1 of 2) an address takes nothing from another's: refused at the total
        assert greetings.place(sockets[3], "10.0.0.1") == (None, None) and greetings.held == 2
    finally:
        for sock in sockets:
            sock.close()
