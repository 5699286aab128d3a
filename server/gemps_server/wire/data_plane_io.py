"""Non-blocking socket I/O for one data-plane connection: reads into a caller's buffer and writes
of several pieces (a frame's start, θ's bytes) without joining them, each as far as the socket
allows now, plain TCP or TLS alike.

Nothing here waits: a call moves what it can and says how much, and `wants` tells the loop
(data_plane_loop.py) which readiness to wait for before the next try (TLS may need the socket
writable to read, and readable to write). The peer closing or resetting is `PeerClosed`.

On a local (Unix) socket reads also take the descriptors a peer passes (SCM_RIGHTS) into `fds`:
the protocol claims the one an ATTACH carries, and refuses any other; what is left is closed with
the channel, so a descriptor never outlives its connection. Never more than `fd_budget` are held
(none before the HELLO proved a ticket, then the one an ATTACH carries): one past it is closed at
once, and so is the connection (Hangup "descriptors"), so that a peer sending a frame a byte at a
time with a descriptor on each cannot pile them up in this process (issue 42, item 2).
"""

from __future__ import annotations

import array
import contextlib
import os
import selectors
import socket
import ssl
from collections.abc import Sequence

from gemps_proto.data_plane_protocol import TLS_PIECE, advance
from gemps_server.domain.errors import ServiceError

Piece = bytes | bytearray | memoryview
# Room for one descriptor's ancillary data per read (two, by alignment, on 64-bit Linux): a peer
# that passes more has the rest closed by the kernel (MSG_CTRUNC), and is refused.
FD_SPACE = socket.CMSG_SPACE(array.array("i").itemsize) if hasattr(socket, "CMSG_SPACE") else 0
# As a plain int: `flags & socket.MSG_CTRUNC` makes an enum.IntFlag, a few microseconds per read.
MSG_CTRUNC = int(getattr(socket, "MSG_CTRUNC", 0))


class Hangup(Exception):
    """End this connection; `reason` is the data-plane refusal to count (None: nothing to count,
    e.g. the peer went away or the server is stopping)."""

    def __init__(self, reason: str | None) -> None:
        super().__init__(reason or "closed")
        self.reason = reason


class Unread(Exception):
    """A request refused before its payload was read: answered, then the connection closes (its
    unread bytes are never read), counted as the data-plane refusal `refusal`."""

    def __init__(self, error: ServiceError, refusal: str = "refused_unread") -> None:
        super().__init__(error.message)
        self.error = error
        self.refusal = refusal


class Stalled(Exception):
    """No byte moved within the timeout (or the deadline passed)."""


class PeerClosed(Exception):
    """The peer closed or reset the connection."""


class Revoked(PeerClosed):
    """A TLS handshake that succeeded with a certificate --tls-crl revokes: the connection is closed."""


class Channel:
    """One connection's socket (plain or TLS), non-blocking."""

    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        self.sock = sock
        self.local = sock.family == getattr(socket, "AF_UNIX", None)
        self.received = 0  # bytes read so far (the byte metrics take differences)
        self.sent = 0
        self.wants = selectors.EVENT_READ  # what the last call that moved nothing waits for
        self.fds: list[int] = []  # descriptors passed and not claimed yet (local sockets)
        self.fds_cut = False  # a peer passed more descriptors than one read takes
        self.fd_budget = 0  # descriptors it may hold: 1 once its HELLO proved a ticket (an ATTACH's)

    def take_fds(self) -> list[int]:
        """The descriptors passed so far (the caller closes them); they are no longer the channel's."""
        fds, self.fds = self.fds, []
        return fds

    @property
    def tls(self) -> bool:
        return isinstance(self.sock, ssl.SSLSocket)

    @property
    def buffered(self) -> bool:
        """Bytes already read from the socket wait in TLS's buffer (no readiness will report them)."""
        return isinstance(self.sock, ssl.SSLSocket) and self.sock.pending() > 0

    def read_some(self, view: memoryview) -> int:
        """Read into `view` what has arrived (0: nothing yet; see `wants`)."""
        try:
            count = self._receive_fds(view) if self.local else self.sock.recv_into(view)
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

    def _receive_fds(self, view: memoryview) -> int:
        """recvmsg: the bytes into `view`, the descriptors into `fds`; Hangup past `fd_budget`."""
        count, ancillary, flags, _address = self.sock.recvmsg_into([view], FD_SPACE)
        cut = bool(flags & MSG_CTRUNC)  # more than fit: the kernel closed the rest
        if not ancillary and not cut:  # no descriptor: every frame but an ATTACH
            return count
        passed = array.array("i")
        for level, kind, data in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                passed.frombytes(data[: len(data) - len(data) % passed.itemsize])
        if (passed and len(self.fds) + len(passed) > self.fd_budget) or (cut and not self.fd_budget):
            close_fds(passed)
            raise Hangup("descriptors")
        self.fds.extend(passed)
        self.fds_cut |= cut  # within the budget: the protocol refuses it with its frame
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

    def shutdown(self) -> None:
        """Refuse further I/O (the peer sees the connection end)."""
        with contextlib.suppress(OSError):  # not connected any more
            self.sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        close_fds(self.take_fds())
        with contextlib.suppress(OSError):
            self.sock.close()


def close_fds(fds: Sequence[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


def pieces(parts: Sequence[Piece]) -> list[memoryview]:
    """Byte views of the non-empty `parts`, in order, for write_some."""
    return [memoryview(part).cast("B") for part in parts if len(part)]
