"""One attached backup as its primary's forwarder holds it: its socket, what is queued for it,
how far it applied, and what it may cost the primary (DESIGN §3d).

A backup costs at most one image while its seed is sent (the image's tensors go from memory to
the socket, never encoded into a second copy), and entries queued up to the largest of an image's
bytes, QUEUE_FLOOR_BYTES and ENTRIES_BEHIND of the largest entry forwarded: past that, seeding it
again costs less than catching it up. The last is for a backup seeded before θ was: its image was
empty, and a model past 16M parameters sends entries of θ's size (its registration, each float32
commit) that a 64 MiB queue could not hold one of: the backup was let go at the first. A send
that makes no progress for SEND_STALL seconds (a peer that does not read) fails, and the link is
let go with whatever it held.
"""

from __future__ import annotations

import contextlib
import queue
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from gemps_server.replication import frames
from gemps_server.replication.lag import LagWindow

#: bytes of entries a backup's queue may hold at least (an image's bytes when that is more)
QUEUE_FLOOR_BYTES = 64 << 20
#: a backup's queue holds at least this many of the largest entry forwarded to it: the one on its
#: way and the next (a re-seed would send at least θ, which such an entry is the size of)
ENTRIES_BEHIND = 2
#: the slowest a backup may take in an entry (read it, apply it) and not be late for its size: it
#: acknowledges nothing meanwhile, so --replica-timeout is lengthened by the largest entry's bytes
#: at this rate (at 100M float32 parameters, 4 s: applying θ's registration took a backup 7 s here)
ENTRY_BYTES_PER_SECOND = 100 << 20
#: seconds a send to a backup may make no progress at least (--replica-timeout when longer)
SEND_STALL_FLOOR = 5.0
#: how long a seeded backup may take to adopt its seed and acknowledge it
SEEDING_SECONDS = 120.0


@dataclass(frozen=True)
class Outgoing:
    """A journal entry's bytes on their way to one backup, queued for its sender thread."""

    position: int
    views: list[memoryview]  # the frame's bytes (frames.buffers), or what is left of them
    entry_bytes: int  # what it adds to the link's queued_bytes


@dataclass(frozen=True)
class Peer:
    """A backup as it introduced itself."""

    name: str
    incarnation: str
    address: str = ""  # worker-facing
    replication: str = ""


class Link:
    """One attached backup: its socket, what is queued for it, how far it applied."""

    def __init__(
        self, peer: Peer, sock: socket.socket, send_stall: float, revoked: Callable[[], str] = lambda: ""
    ) -> None:
        self.peer = peer
        self.sock = sock
        self.revoked = revoked  # why its certificate is refused now (--tls-crl), asked while it is attached
        # A peer that stops reading fails the send blocked on it (SO_SNDTIMEO: sends only, so acks
        # are still waited for as long as the monitor allows).
        self.send_stall = seconds = max(send_stall, SEND_STALL_FLOOR)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", int(seconds), int(seconds % 1 * 1e6)))
        self.seed_position: int | None = None  # the journal's position its seed holds, once taken
        self.seed_sent: float | None = None  # when its seed had been handed to the socket
        self.seed_acked = threading.Event()
        self.sent = -1  # the last position handed to its socket: it may acknowledge no further
        self.acked = -1  # no position yet: not even the seed's
        self.heard = time.monotonic()  # its last ack (heartbeats are acked too)
        self.in_sync = False
        self.lag: LagWindow | None = None  # while in sync
        self.slow = ""  # the lag rule's verdict, once it has one
        self.closed = False
        self.outbox: queue.SimpleQueue[Outgoing | None] = queue.SimpleQueue()
        self.queued_bytes = 0  # of the entries in `outbox` (the sender subtracts what it sent); under `writing`
        # Who writes to the socket. The thread that appends an entry writes it there itself when
        # nothing is queued for the sender (`pending` 0: the seed counts until acknowledged) and the
        # socket takes it without waiting; the sender thread writes the rest, in order, and beats.
        # `writing` guards `pending` and those direct writes. TLS: always the sender (one TLS
        # write's retry must come from the same caller: tls_stream.py).
        self.writing = threading.Lock()
        self.pending = 1
        self.direct = not isinstance(sock, ssl.SSLSocket)
        self.wrote = time.monotonic()  # the last frame written to it: the sender beats after BEAT_SECONDS quiet
        self.queue_limit = QUEUE_FLOOR_BYTES  # raised to the seed's bytes, and ENTRIES_BEHIND entries', as they come
        self.largest_entry = 0  # bytes of the largest entry queued for it

    @property
    def entry_seconds(self) -> float:
        """What its largest entry may take it at ENTRY_BYTES_PER_SECOND: an honest backup is that far behind."""
        return self.largest_entry / ENTRY_BYTES_PER_SECOND

    def timeout(self, replica_timeout: float) -> float:
        """How long it may leave an entry (or a heartbeat) unacknowledged: --replica-timeout and entry_seconds."""
        return replica_timeout + self.entry_seconds

    @property
    def seeded(self) -> bool:
        return self.seed_position is not None and self.acked >= self.seed_position

    def acknowledged(self, position: int) -> str:
        """Record an ack of `position`; why the backup must be let go ("" when it need not)."""
        if position > self.sent:
            return f"it acknowledged position {position}, past the {self.sent} it was sent: what it never applied"
        self.acked = max(self.acked, position)
        self.heard = time.monotonic()
        if self.seeded:
            self.seed_acked.set()
        return ""

    def base(self) -> int:
        """The position it holds: its seed's until it acknowledged further."""
        return self.acked if self.seed_position is None else max(self.acked, self.seed_position)

    def forward(self, position: int, views: list[memoryview], entry_bytes: int) -> OSError | None:
        """Hand entry `position` (its frame's bytes) to the socket now, on the appending thread,
        when nothing is queued before it and the socket takes it whole without waiting (no thread
        woken per commit), else queue it, or what is left of it, for the sender thread. The error
        when the socket failed: the link is to be let go."""
        with self.writing:
            if self.pending == 0 and self.direct and not self.closed:
                self.sent = position  # before it can be acknowledged
                try:
                    views = frames.send_some(self.sock, views)
                except OSError as error:
                    return error
                if not views:
                    self.wrote = time.monotonic()
                    return None
            self.pending += 1
            self.queued_bytes += entry_bytes
            self.outbox.put(Outgoing(position, views, entry_bytes))
        return None

    def beat(self, epoch: int) -> None:
        """On the sender's thread: a beat of `epoch`, when nothing was written for BEAT_SECONDS and
        nothing is queued (no entry's bytes are on their way: it would fall between them)."""
        with self.writing:
            if self.pending or time.monotonic() - self.wrote < frames.BEAT_SECONDS:
                return
            self.pending += 1
        frames.send(self.sock, frames.Frame(frames.BEAT, {"epoch": epoch}))
        self.written()

    def written(self, entry_bytes: int = 0) -> None:
        """The sender wrote one of what it held (its seed, a beat, or a queued entry of `entry_bytes`)."""
        with self.writing:
            self.pending -= 1
            self.queued_bytes -= entry_bytes
            self.wrote = time.monotonic()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.outbox.put(None)
            self.seed_acked.set()  # the sender waits for it: let it see the link closed
            with contextlib.suppress(OSError):
                self.sock.shutdown(socket.SHUT_RDWR)
            self.sock.close()
