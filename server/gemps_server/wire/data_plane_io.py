"""Non-blocking socket I/O for one data-plane connection: reads into a caller's buffer and writes
of several pieces (a frame's start, θ's bytes) without joining them, each as far as the socket
allows now, plain TCP or TLS alike.

Nothing here waits: a call moves what it can and says how much, and `wants` tells the loop
(data_plane_loop.py) which readiness to wait for before the next try (TLS may need the socket
writable to read, and readable to write). The peer closing or resetting is `PeerClosed`.
"""

from __future__ import annotations

import contextlib
import selectors
import socket
import ssl
from collections.abc import Sequence

Piece = bytes | bytearray | memoryview
# Bytes handed to one TLS write (SSLSocket has no sendmsg, and encrypts, so copies, anyway).
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
    """One connection's socket (plain or TLS), non-blocking."""

    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        self.sock = sock
        self.received = 0  # bytes read so far (the byte metrics take differences)
        self.sent = 0
        self.wants = selectors.EVENT_READ  # what the last call that moved nothing waits for

    @property
    def tls(self) -> bool:
        return isinstance(self.sock, ssl.SSLSocket)

    def read_some(self, view: memoryview) -> int:
        """Read into `view` what has arrived (0: nothing yet; see `wants`)."""
        try:
            count = self.sock.recv_into(view)
        except (BlockingIOError, ssl.SSLWantReadError):
            self.wants = selectors.EVENT_READ
            return 0
        except ssl.SSLWantWriteError:
            self.wants = selectors.EVENT_WRITE
            return 0
        except (ConnectionError, ssl.SSLError, OSError):
            raise PeerClosed from None
        if count == 0:
            raise PeerClosed
        self.received += count
        return count

    def write_some(self, views: list[memoryview]) -> int:
        """Send from the front of `views` what the socket takes now, dropping what went (0: none)."""
        total = 0
        try:
            while views:
                # one system call for a header and θ's bytes on a plain socket
                count = self.sock.send(views[0][:TLS_PIECE]) if self.tls else self.sock.sendmsg(views)
                total += count
                advance(views, count)
        except (BlockingIOError, ssl.SSLWantWriteError):
            self.wants = selectors.EVENT_WRITE
        except ssl.SSLWantReadError:
            self.wants = selectors.EVENT_READ
        except (ConnectionError, ssl.SSLError, OSError):
            raise PeerClosed from None
        self.sent += total
        return total

    def try_send(self, data: bytes) -> None:
        """Send `data` only if the socket takes it now, and never mind if not (a last word)."""
        with contextlib.suppress(OSError):  # ssl.SSLError included
            self.sock.send(data)

    def handshake(self) -> bool:
        """Advance the TLS handshake; True once it is done, PeerClosed if it failed (a client
        certificate missing or untrusted, plaintext, the peer gone)."""
        assert isinstance(self.sock, ssl.SSLSocket)
        try:
            self.sock.do_handshake()
        except ssl.SSLWantReadError:
            self.wants = selectors.EVENT_READ
            return False
        except ssl.SSLWantWriteError:
            self.wants = selectors.EVENT_WRITE
            return False
        except (ssl.SSLError, OSError) as error:
            raise PeerClosed(str(error)) from None
        return True

    def shutdown(self) -> None:
        """Refuse further I/O (the peer sees the connection end)."""
        with contextlib.suppress(OSError):  # not connected any more
            self.sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


def pieces(parts: Sequence[Piece]) -> list[memoryview]:
    """Byte views of the non-empty `parts`, in order, for write_some."""
    return [memoryview(part).cast("B") for part in parts if len(part)]


def advance(views: list[memoryview], count: int) -> None:
    """Drop `count` sent bytes from the front of `views`."""
    while count and views:
        first = views[0]
        if count >= len(first):
            count -= len(first)
            views.pop(0)
        else:
            views[0] = first[count:]
            count = 0
