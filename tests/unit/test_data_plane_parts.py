"""The data plane's small parts: its thread-side buffer pool, its tickets, its write bookkeeping."""

from __future__ import annotations

import socket
import threading

from gemps_server.security import Tickets
from gemps_server.wire.data_plane_io import Channel, _advance
from gemps_server.wire.stream_buffers import ThreadBufferPool


def test_the_thread_pool_is_bounded_reuses_its_buffers_and_gives_up_when_told() -> None:
    pool = ThreadBufferPool(1)
    with pool.buffer(lambda: False) as first:
        assert first is not None
        memory = first.take(1000)
        with pool.buffer(lambda: True) as second:  # all in use, and told to give up: none
            assert second is None
    with pool.buffer(lambda: False) as again:
        assert again is not None and again.take(1000).ctypes.data == memory.ctypes.data  # the same bytes
    taken = threading.Event()
    released = threading.Event()

    def hold() -> None:
        with pool.buffer(lambda: False):
            taken.set()
            released.wait(5)

    holder = threading.Thread(target=hold)
    holder.start()
    taken.wait(5)
    threading.Timer(0.3, released.set).start()
    with pool.buffer(lambda: False) as waited:  # waits until the holder gives it back
        assert waited is not None and released.is_set()
    holder.join(5)


def test_a_ticket_proves_one_worker_of_one_client_to_this_process_only() -> None:
    tickets = Tickets()
    ticket = tickets.issue("worker-1", "client-a")
    assert len(ticket) == 32
    assert tickets.valid(ticket, "worker-1", "client-a")
    assert not tickets.valid(ticket, "worker-2", "client-a")
    assert not tickets.valid(ticket, "worker-1", "client-b")
    assert not tickets.valid(ticket, "worker-1\0client-a", "")  # the separator cannot be forged
    assert not Tickets().valid(ticket, "worker-1", "client-a")  # another process's key


def test_writes_go_out_whole_and_in_order_from_several_pieces() -> None:
    views = [memoryview(b"abc"), memoryview(b"defgh")]
    _advance(views, 4)
    assert [bytes(v) for v in views] == [b"efgh"]
    left, right = socket.socketpair()
    with left, right:
        channel = Channel(left)
        payload = bytes(range(256)) * 4096  # 1 MiB: more than one sendmsg on most kernels
        reader = threading.Thread(target=lambda: received.extend(read_all(right, 3 + len(payload))))
        received = bytearray()
        reader.start()
        channel.write([b"hdr", memoryview(payload)], timeout=5)
        reader.join(5)
        assert bytes(received) == b"hdr" + payload and channel.sent == len(received)


def read_all(sock: socket.socket, size: int) -> bytes:
    data = bytearray()
    while len(data) < size:
        data += sock.recv(size - len(data))
    return bytes(data)


def test_the_pool_hands_a_freed_buffer_to_the_longest_waiting_thread() -> None:
    """Waiters are served in arrival order: a freed buffer is not up for grabs (fairness under load)."""
    pool = ThreadBufferPool(1)
    order: list[int] = []
    queued = [threading.Event() for _ in range(3)]

    def wait_turn(index: int) -> None:
        queued[index].set()
        with pool.buffer(lambda: False) as buffer:
            assert buffer is not None
            order.append(index)

    with pool.buffer(lambda: False):
        threads = []
        for index in range(3):  # one at a time, so their arrival order is known
            threads.append(threading.Thread(target=wait_turn, args=(index,)))
            threads[-1].start()
            queued[index].wait(5)
            while len(pool._waiting) < index + 1:
                threading.Event().wait(0.01)
    for thread in threads:
        thread.join(10)
    assert order == [0, 1, 2]
