"""Writing a payload to a data-plane server that takes it in late, without taking it for dead.

A data-plane socket fails when bytes sent wait UNACKNOWLEDGED_MS for the peer's acknowledgement
(TCP_USER_TIMEOUT): a server whose machine died sends nothing, and a reply awaited would wait
out the call's whole deadline before the client tried another replica. But Linux counts a full
window against that timeout too: a server that is there and acknowledges everything, yet reads
nothing for a while (its upload buffers all taken by other workers' commits: tens of workers at
100M parameters wait seconds for one), had the connection fail after 5 s, and the worker sent its
payload again from the start (4 commits of 80 MB in 3 with one buffer at a fiftieth of a core).

So a write the socket's buffers do not take at once goes on with the kernel's timeout off, looking
every POLL_SECONDS itself: bytes that wait for an acknowledgement longer than UNACKNOWLEDGED_MS
still fail the connection (the peer is gone), a full window of acknowledged bytes waits for as long
as the call's time allows (the peer is busy). Where TCP_INFO cannot tell (not Linux, a Unix
socket), the call's time alone bounds the write.

A server that dies while its window is full has every byte sent acknowledged: what goes unanswered
then is the kernel's window probes (sent at its retransmission timeout, doubling up to 2 minutes
apart), which a live server answers at once. So a probe found unanswered at two looks in a row,
with nothing heard from the server for UNACKNOWLEDGED_MS, fails the connection too (before, the
call's whole time went by). Two looks: a live server's answer may be a round trip away at one.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import time
from collections.abc import Callable

from gemps_proto.data_plane_protocol import advance

#: bytes unacknowledged this long fail a connection (milliseconds; TCP_USER_TIMEOUT outside writes)
UNACKNOWLEDGED_MS = 5000
#: how often a write the peer does not take in looks at whether the peer is still there (seconds)
POLL_SECONDS = 1.0

_TCP_INFO_BYTES = 104  # struct tcp_info up to its times (linux/tcp.h), the fields read below
_PROBES_AT, _UNACKED_AT, _LAST_ACK_RECV_AT = 3, 24, 56  # tcpi_probes (unanswered window probes),
# tcpi_unacked (segments), tcpi_last_ack_recv (ms ago)


def write_all(sock: socket.socket, views: list[memoryview], send: Callable[[list[memoryview]], int]) -> None:
    """Every byte of `views` through `send` (it returns how many it sent), within the socket's
    timeout as a whole (the call's time left; None: no bound), patiently (above)."""
    advance(views, send(views))  # mostly all of it: what the socket's buffers take in at once
    if not views:
        return
    limit = sock.gettimeout()
    deadline = None if limit is None else time.monotonic() + limit
    _user_timeout(sock, 0)  # the system's (retransmissions only): a full window is looked at below
    probed_silence: int | None = None  # ms without a word from the server, at the last look that found a probe waiting
    try:
        while views:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise TimeoutError("the server took in no more of the request within the call's time")
            sock.settimeout(POLL_SECONDS if left is None else min(POLL_SECONDS, left))
            try:
                advance(views, send(views))
            except TimeoutError as error:
                if error.errno is not None:  # the kernel's (ETIMEDOUT): the connection itself failed
                    raise
                looked = _look(sock)
                if looked is None:
                    continue  # the system cannot tell: the call's time bounds the write
                unacked, probes, silence = looked
                if unacked and silence > UNACKNOWLEDGED_MS:
                    raise ConnectionResetError(
                        f"the server acknowledged none of the request's bytes for {silence / 1000:.1f} s"
                    ) from None
                if probes and probed_silence is not None and silence > max(probed_silence, UNACKNOWLEDGED_MS):
                    raise ConnectionResetError(
                        f"the server answered none of the window probes for {silence / 1000:.1f} s "
                        "(its window full, and nothing heard from it since: its machine gone or cut off?)"
                    ) from None
                probed_silence = silence if probes else None
    finally:  # a socket closed meanwhile (another thread's wake) keeps the failure that brought us here
        with contextlib.suppress(OSError):
            sock.settimeout(limit)
            _user_timeout(sock, UNACKNOWLEDGED_MS)


def _look(sock: socket.socket) -> tuple[int, int, int] | None:
    """(segments unacknowledged, window probes unanswered, milliseconds since the peer last
    acknowledged anything) from TCP_INFO; None where the system cannot tell (Linux, TCP only)."""
    if not hasattr(socket, "TCP_INFO") or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return None
    info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_BYTES)
    (probes,) = struct.unpack_from("=B", info, _PROBES_AT)
    (unacked,) = struct.unpack_from("=I", info, _UNACKED_AT)
    (last_ack_received,) = struct.unpack_from("=I", info, _LAST_ACK_RECV_AT)
    return int(unacked), int(probes), int(last_ack_received)


def _user_timeout(sock: socket.socket, milliseconds: int) -> None:
    if hasattr(socket, "TCP_USER_TIMEOUT") and sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, milliseconds)
