"""The primary's side of replication: the journal that forwards, the backups' links, and when a
commit may be acknowledged (DESIGN §3d).

Every entry the state appends is framed at once (its payload copied: the wire reuses its buffers)
and queued for every attached backup, whose sender thread writes it while the applier goes on
with the next commit: forwarding is pipelined. A backup acknowledges positions as it applies them.
A commit's reply waits (`when_replicated`) until every backup in the in-sync set acknowledged its
position, and is refused instead when this replica no longer holds its lease (fencing).

A backup joins by saying hello: the applier takes the state's whole image and the journal's
position in one operation (nothing can be appended in between), the image goes first, then every
entry after that position. Once it acknowledged the image it is added to the in-sync set, in etcd
first (only members of that set may become primary). One that stops acknowledging for
`timeout` seconds, or whose connection breaks, is removed from the set, in etcd first: until
then commits wait for it, so a backup that could still be promoted never misses an acknowledged
commit. It is re-seeded when it comes back.
"""

from __future__ import annotations

import collections
import contextlib
import heapq
import itertools
import logging
import queue
import socket
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from gemps_proto.reasons import Reason
from gemps_server.domain import images
from gemps_server.domain.applier import Applier, Timed
from gemps_server.domain.errors import Unavailable
from gemps_server.domain.journal import Entry
from gemps_server.domain.replica_image import ReplicaImage
from gemps_server.domain.state import ServerState
from gemps_server.logs import event
from gemps_server.replication import entries, frames, image_codec
from gemps_server.replication.status import BackupLag

log = logging.getLogger("gemps.server")

#: how often timeouts and in-sync changes are looked at
MONITOR_SECONDS = 0.1
#: bytes of entries queued for one backup at most: past it a backup that is not keeping up (one
#: being seeded: commits wait for in-sync backups only) is let go, and seeded again when it returns
MAX_QUEUED_BYTES = 1 << 30
#: how long a backup being seeded may go without acknowledging (the image is encoded, sent, adopted)
SEEDING_SECONDS = 120.0

# Called with a commit's outcome once it may be acknowledged (None) or must not be (the error).
Done = Callable[[BaseException | None], None]


@dataclass(frozen=True)
class Peer:
    """A backup as it introduced itself."""

    name: str
    incarnation: str
    address: str = ""  # worker-facing
    replication: str = ""


class _Link:
    """One attached backup: its socket, what is queued for it, how far it applied."""

    def __init__(self, peer: Peer, sock: socket.socket, seed_position: int) -> None:
        self.peer = peer
        self.sock = sock
        self.seed_position = seed_position
        self.acked = -1  # no position yet: not even the seed's
        self.heard = time.monotonic()  # its last ack (heartbeats are acked too)
        self.in_sync = False
        self.closed = False
        self.outbox: queue.SimpleQueue[frames.Frame | None] = queue.SimpleQueue()
        self.queued_bytes = 0  # of the entries in `outbox` (the sender subtracts what it sent)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.outbox.put(None)
            with contextlib.suppress(OSError):
                self.sock.shutdown(socket.SHUT_RDWR)
            self.sock.close()


class Forwarder:
    """The journal of a primary at `epoch`; `set_in_sync` writes the in-sync set (etcd), False when
    this replica is fenced off; `holds` says whether it may still acknowledge."""

    def __init__(
        self,
        state: ServerState,
        applier: Applier,
        epoch: int,
        set_in_sync: Callable[[Iterable[Peer]], bool],
        holds: Callable[[], bool],
        timeout: float,
        ticket_key: bytes = b"",
    ) -> None:
        self._state = state
        self._ticket_key = ticket_key  # sent with each seed: the backups' data planes take the same tickets
        self._applier = applier
        self.epoch = epoch
        self._set_in_sync = set_in_sync
        self._holds = holds
        self.timeout = timeout
        self._lock = threading.Lock()
        self._last = 0
        self._links: dict[str, _Link] = {}
        self._appended: collections.deque[tuple[int, float]] = collections.deque()  # (position, when)
        self._waiters: list[tuple[int, int, Done]] = []
        self._order = itertools.count()
        self._closed = False
        self.forwarded = 0
        self._monitor = threading.Thread(target=self._watch, name="gemps-replication-monitor", daemon=True)
        self._monitor.start()

    # -- the journal (state.journal), on the applier --------------------------------------------

    def append(self, entry: Entry) -> int:
        with self._lock:
            self._last += 1
            position = self._last
            links = [link for link in self._links.values() if not link.closed]
            if links:
                self._appended.append((position, time.monotonic()))
        if links:
            frame = entries.encode(entry, position, self.epoch)
            size = sum(memoryview(blob).nbytes for blob in frame.blobs)
            with self._lock:  # the senders subtract what they sent
                for link in links:
                    link.queued_bytes += size
            for link in links:
                link.outbox.put(frame)
            self.forwarded += 1
        return position

    @property
    def last(self) -> int:
        return self._last

    # -- acknowledgements -----------------------------------------------------------------------

    def when_replicated(self, position: int, done: Done) -> None:
        """Call `done` once every in-sync backup applied `position` (at once when they have)."""
        with self._lock:
            if position > self._replicated() and not self._closed:
                heapq.heappush(self._waiters, (position, next(self._order), done))
                return
        done(self._fenced())

    def _replicated(self) -> int:
        """The highest position every in-sync backup applied (with none: the last)."""
        acked = [link.acked for link in self._links.values() if link.in_sync]
        return min(acked) if acked else self._last

    def _fenced(self) -> BaseException | None:
        if self._closed or not self._holds():
            return Unavailable(
                "this replica is no longer its partition's primary (it lost its lease): the commit may not "
                "be acknowledged; retry, at the new primary",
                Reason.NOT_PRIMARY,
            )
        return None

    def _release(self) -> None:
        """Hand every waiter whose position is replicated its outcome (outside the lock)."""
        ready = []
        with self._lock:
            replicated = self._replicated() if not self._closed else 1 << 62
            while self._waiters and self._waiters[0][0] <= replicated:
                ready.append(heapq.heappop(self._waiters)[2])
            while self._appended and self._appended[0][0] <= replicated:
                self._appended.popleft()
        if ready:
            outcome = self._fenced()
            for done in ready:
                done(outcome)

    # -- backups ----------------------------------------------------------------------------------

    def attach(self, peer: Peer, sock: socket.socket) -> None:
        """Seed a backup that said hello on `sock`, then forward every later entry to it."""

        def seed() -> tuple[_Link, ReplicaImage]:  # on the applier: no entry appended in between
            image = images.take(self._state)  # a copy: encoded on the sender's thread
            with self._lock:
                if (old := self._links.pop(peer.name, None)) is not None:
                    old.close()
                link = _Link(peer, sock, self._last)
                self._links[peer.name] = link
            return link, image

        def seeded(timed: Timed[tuple[_Link, ReplicaImage]] | None, error: BaseException | None) -> None:
            if error is not None or timed is None:
                event(log, "backup not seeded", level=logging.WARNING, backup=peer.name, error=str(error))
                sock.close()
                return
            link, image = timed.result
            threading.Thread(target=self._send, args=(link, image), name="gemps-replication-send", daemon=True).start()
            threading.Thread(target=self._receive, args=(link,), name="gemps-replication-acks", daemon=True).start()

        self._applier.submit_then(seed, seeded)

    def _send(self, link: _Link, image: ReplicaImage) -> None:
        try:
            header = {"epoch": self.epoch, "position": link.seed_position, "tickets": self._ticket_key.hex()}
            seed = frames.Frame(frames.SEED, header, [image_codec.encode(image)])
            del image
            frames.send(link.sock, seed)
            del seed
            while True:
                try:
                    frame = link.outbox.get(timeout=frames.BEAT_SECONDS)
                except queue.Empty:
                    frame = frames.Frame(frames.BEAT, {"epoch": self.epoch})
                if frame is None:
                    return
                frames.send(link.sock, frame)
                sent = sum(memoryview(blob).nbytes for blob in frame.blobs)
                with self._lock:
                    link.queued_bytes -= sent
        except OSError as error:
            self._lost(link, f"sending: {error}")

    def _receive(self, link: _Link) -> None:
        try:
            while True:
                frame = frames.receive(link.sock, max_body=0)  # acks are headers alone
                if frame.kind != frames.ACK:
                    raise frames.StreamClosed(f"a backup sent {frame.kind!r}, not an acknowledgement")
                link.acked = max(link.acked, int(frame.header["position"]))
                link.heard = time.monotonic()
                self._release()
        except (OSError, ValueError, KeyError, TypeError) as error:
            self._lost(link, str(error))

    def _lost(self, link: _Link, why: str) -> None:
        if link.closed:
            return
        event(log, "backup lost", level=logging.WARNING, backup=link.peer.name, reason=why)
        link.close()  # the monitor takes it out of the in-sync set (etcd first)

    def _watch(self) -> None:
        """Move backups in and out of the in-sync set: a seeded one in, a lost or late one out."""
        while not self._closed:
            time.sleep(MONITOR_SECONDS)
            with self._lock:
                links = list(self._links.values())
            for link in links:
                quiet = time.monotonic() - link.heard
                if not link.closed and (
                    link.queued_bytes > MAX_QUEUED_BYTES or (not link.in_sync and quiet > SEEDING_SECONDS)
                ):
                    self._lost(link, f"not keeping up: {link.queued_bytes} bytes queued, silent {quiet:.0f} s")
                late = link.in_sync and (quiet > self.timeout or self._waiting(link) > self.timeout)
                if link.in_sync and (link.closed or late):
                    self._change(
                        link, join=False, why="connection lost" if link.closed else f"no ack for {self.timeout:g} s"
                    )
                elif not link.in_sync and not link.closed and link.acked >= link.seed_position:
                    self._change(link, join=True, why="seeded")
                elif link.closed and not link.in_sync:
                    with self._lock:
                        if self._links.get(link.peer.name) is link:
                            del self._links[link.peer.name]

    def _change(self, link: _Link, join: bool, why: str) -> None:
        with self._lock:
            members = [other.peer for other in self._links.values() if other.in_sync and other is not link]
        if join:
            members.append(link.peer)
        if not self._set_in_sync(members):
            return  # fenced off, or etcd unreachable: commits wait; the lease decides
        link.in_sync = join
        if not join:
            link.close()
        event(log, "backup in sync" if join else "backup dropped", backup=link.peer.name, reason=why, epoch=self.epoch)
        self._release()

    # -- what status reads ------------------------------------------------------------------------

    def _waiting(self, link: _Link) -> float:
        """How long the oldest entry `link` has not acknowledged has waited (0: none)."""
        with self._lock:
            oldest = next((when for position, when in self._appended if position > link.acked), None)
        return 0.0 if oldest is None else time.monotonic() - oldest

    def lags(self) -> tuple[BackupLag, ...]:
        with self._lock:
            links = list(self._links.values())
        lags = (
            BackupLag(
                link.peer.name, link.in_sync, self._last - max(link.acked, link.seed_position), self._waiting(link)
            )
            for link in links
        )
        return tuple(sorted(lags, key=lambda lag: lag.name))

    def close(self) -> None:
        """This replica stopped being primary: every waiting commit is refused, every backup let go."""
        with self._lock:
            self._closed = True
            links = list(self._links.values())
            self._links.clear()
        for link in links:
            link.close()
        self._release()
