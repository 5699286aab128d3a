"""Blocking socket I/O for one data-plane connection: exact reads into a caller's buffer, and
writes of several pieces (a frame's start, θ's bytes) without joining them.

Every read and write has a timeout: no byte for that long and the connection is given up
(`Stalled`); the peer closing is `PeerClosed`. Both end the connection; neither is an error of
the server's.
"""

from __future__ import annotations

import contextlib
import socket
import ssl
import time
from collections.abc import Sequence

from gemps_proto import dataplane

Piece = bytes | bytearray | memoryview
# Bytes handed to one TLS write (a record is at most 16 KiB; this bounds one call's wait).
TLS_PIECE = 1 << 20


class Hangup(Exception):
    """End this connection; `reason` is the data-plane refusal to count (None: nothing to count,
    e.g. the peer went away or the server is stopping)."""

    def __init__(self, reason: str | None) -> None:
        super().__init__(reason or "closed")
        self.reason = reason


class Stalled(Exception):
    """No byte moved within the timeout (or the deadline passed)."""


class PeerClosed(Exception):
    """The peer closed or reset the connection."""


class Channel:
    """One connection's socket (plain or TLS), in blocking mode with per-call timeouts."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.received = 0  # bytes read so far (the byte metrics take differences)
        self.sent = 0

    @property
    def tls(self) -> bool:
        return isinstance(self.sock, ssl.SSLSocket)

    def read_into(self, view: memoryview, timeout: float, deadline: float | None = None) -> None:
        """Fill `view` from the socket: each wait at most `timeout` seconds (and none past
        `deadline`, a time.monotonic() value)."""
        filled, size = 0, len(view)
        while filled < size:
            self._set_timeout(timeout, deadline)
            try:
                count = self.sock.recv_into(view[filled:])
            except TimeoutError:
                raise Stalled from None
            except (ConnectionError, ssl.SSLError, OSError):
                raise PeerClosed from None
            if count == 0:
                raise PeerClosed
            filled += count
            self.received += count

    def read_bytes(self, size: int, timeout: float, deadline: float | None = None) -> bytearray:
        data = bytearray(size)
        self.read_into(memoryview(data), timeout, deadline)
        return data

    def write(self, pieces: Sequence[Piece], timeout: float, deadline: float | None = None) -> None:
        """Send `pieces` in order, from their own memory: sendmsg on a plain socket (one system
        call for a small header and θ's bytes), under TLS piece by piece (it encrypts anyway).
        Each wait at most `timeout`, none past `deadline`."""
        views = [memoryview(piece).cast("B") for piece in pieces if len(piece)]
        try:
            while views:
                self._set_timeout(timeout, deadline)
                # (SSLSocket has no sendmsg)
                count = self.sock.send(views[0][:TLS_PIECE]) if self.tls else self.sock.sendmsg(views)
                self.sent += count
                _advance(views, count)
        except TimeoutError:
            raise Stalled from None
        except (ConnectionError, ssl.SSLError, OSError):
            raise PeerClosed from None

    def write_frame(
        self, op: int, header: bytes, payload: Piece = b"", timeout: float = 5.0, deadline: float | None = None
    ) -> None:
        start = dataplane.frame_start(op, header, len(memoryview(payload).cast("B")))
        self.write([start, payload], timeout, deadline)

    def _set_timeout(self, timeout: float, deadline: float | None) -> None:
        if deadline is not None:
            timeout = min(timeout, deadline - time.monotonic())
            if timeout <= 0:
                raise Stalled
        self.sock.settimeout(timeout)

    def shutdown(self) -> None:
        """Wake whatever waits on this socket (another thread's recv) and refuse further I/O."""
        with contextlib.suppress(OSError):  # not connected any more
            self.sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


def _advance(views: list[memoryview], count: int) -> None:
    """Drop `count` sent bytes from the front of `views`."""
    while count and views:
        first = views[0]
        if count >= len(first):
            count -= len(first)
            views.pop(0)
        else:
            views[0] = first[count:]
            count = 0
