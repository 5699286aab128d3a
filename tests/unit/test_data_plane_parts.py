"""The data plane's small parts: its lanes of buffers, its tickets, its write bookkeeping."""

from __future__ import annotations

import select
import socket
import threading

import pytest

from gemps_proto.data_plane_protocol import advance
from gemps_server.security import Tickets
from gemps_server.wire.data_plane_io import Channel, pieces
from gemps_server.wire.data_plane_uploads import Lane
from gemps_server.wire.stream_buffers import Buffer


def test_a_lane_is_bounded_reuses_its_buffers_and_turns_waiters_away_when_told() -> None:
    pool = Lane(1)
    granted: list[Buffer | None] = []
    first = pool.take(granted.append)
    assert first is not None
    memory = first.take(1000)
    assert pool.take(granted.append) is None and not granted  # all in use: in line, nothing yet
    pool.turn_away()  # the server stops: the one waiting gets None
    assert granted == [None]
    pool.give_back(first)
    again = pool.take(granted.append)
    assert again is not None and again.take(1000).ctypes.data == memory.ctypes.data  # the same bytes
    assert pool.take(granted.append) is None
    pool.give_back(again)  # handed to the one waiting, not put back
    handed = granted[-1]
    assert handed is not None and handed.bytes is again.bytes and pool.take(granted.append) is None


def test_a_ticket_proves_one_worker_of_one_client_to_this_process_only() -> None:
    tickets = Tickets()
    ticket = tickets.issue("worker-1", "client-a")
    assert len(ticket) == 32
    assert tickets.valid(ticket, "worker-1", "client-a")
    assert not tickets.valid(ticket, "worker-2", "client-a")
    assert not tickets.valid(ticket, "worker-1", "client-b")
    assert not tickets.valid(ticket, "worker-1\0client-a", "")  # the separator cannot be forged
    assert not Tickets().valid(ticket, "worker-1", "client-a")  # another process's key


def test_a_backup_that_adopts_its_primarys_key_takes_the_primarys_tickets() -> None:
    primary, backup = Tickets(), Tickets()
    ticket = primary.issue("worker-1", "client-a")
    assert not backup.valid(ticket, "worker-1", "client-a")
    backup.adopt(primary.key)
    assert backup.valid(ticket, "worker-1", "client-a")
    with pytest.raises(ValueError, match="32 bytes"):
        backup.adopt(b"short")


def test_writes_go_out_whole_and_in_order_from_several_pieces() -> None:
    views = [memoryview(b"abc"), memoryview(b"defgh")]
    advance(views, 4)
    assert [bytes(v) for v in views] == [b"efgh"]
    left, right = socket.socketpair()
    with left, right:
        channel = Channel(left)
        payload = bytes(range(256)) * 4096  # 1 MiB: more than one sendmsg on most kernels
        reader = threading.Thread(target=lambda: received.extend(read_all(right, 3 + len(payload))))
        received = bytearray()
        reader.start()
        remaining = pieces([b"hdr", memoryview(payload)])
        while remaining:  # non-blocking: as far as the socket takes it each time
            if not channel.write_some(remaining):
                select.select([], [left], [], 5)
        reader.join(5)
        assert bytes(received) == b"hdr" + payload and channel.sent == len(received)


def read_all(sock: socket.socket, size: int) -> bytes:
    data = bytearray()
    while len(data) < size:
        data += sock.recv(size - len(data))
    return bytes(data)


def test_a_lane_hands_a_freed_buffer_to_the_longest_waiting_connection() -> None:
    """Waiters are served in arrival order: a freed buffer is not up for grabs (fairness under load)."""
    pool = Lane(1)
    order: list[int] = []
    held = pool.take(lambda buffer: None)
    assert held is not None
    for index in range(3):  # in line in this order
        assert pool.take(lambda buffer, index=index: order.append(index)) is None  # type: ignore[misc]
    assert pool.take(lambda buffer: order.append(99)) is None
    pool.withdraw(pool._waiting[-1][0])  # the last one leaves the line (its connection ended)
    for _ in range(3):
        pool.give_back(held)
    assert order == [0, 1, 2] and pool.waiting == 0


def test_newcomers_hold_their_share_of_a_lane_and_never_stand_in_the_others_way() -> None:
    """Workers not yet proven fast hold at most `share` buffers; a proven worker's request takes a
    free one past the newcomers waiting, and a newcomer's buffer freed goes to the next newcomer."""
    lane = Lane(3, share=1)
    order: list[str] = []
    newcomer = lane.take(lambda buffer: order.append("first newcomer"), newcomer=True)
    assert newcomer is not None
    for name in ("second newcomer", "third newcomer"):  # past the share: in line
        assert lane.take(lambda buffer, name=name: order.append(name), newcomer=True) is None  # type: ignore[misc]
    proven = [lane.take(lambda buffer: order.append("proven")) for _ in range(2)]
    assert all(buffer is not None for buffer in proven) and not order  # straight past them
    assert lane.take(lambda buffer: order.append("proven, waiting")) is None  # all three in use
    lane.give_back(newcomer, newcomer=True)  # the longest waiting that may take it: a newcomer
    assert order == ["second newcomer"]
    assert proven[0] is not None
    lane.give_back(proven[0])  # the proven one (the third newcomer may not take it: share held)
    assert order == ["second newcomer", "proven, waiting"] and lane.waiting == 1
