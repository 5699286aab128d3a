"""The primary's side of replication: the journal that forwards, the backups' links, and when a
commit may be acknowledged (DESIGN §3d).

Every entry the state appends is framed at once (its payload copied unless the commit owns it) and
written to every attached backup's socket by the appending thread, or queued for the backup's
sender thread (links.py): forwarding is pipelined. A backup acknowledges positions it applied.
A commit's reply waits (`when_replicated`) until every backup in the in-sync set acknowledged its
position, and is refused instead when this replica no longer holds its lease (fencing).

A new primary keeps in the set the replicas listed in sync before it that are known alive (the
replica decides which: replica.py), and acknowledges nothing until each is seeded, or has not
attached within `attach_within` seconds or been seeded within `timeout` (then it is dropped, in
etcd first): until one of them holds its entries, the new primary alone would hold what it
acknowledges, and dying at once it would lose them while that replica lives.

A backup joins by saying hello: the applier takes the state's whole image and the journal's
position in one operation (nothing can be appended in between), the image goes first, streamed,
then every entry after that position. Once it acknowledged the image it is added to the in-sync
set, in etcd first (only members of that set may become primary). One name, one backup: while a
backup of a name is attached and alive, a second peer under that name is refused, and so is any
peer past the partition's R-1 backups (the in-sync set never lists more than R replicas). A
backup is let go when its connection breaks, when it acknowledges what it was never sent, when it
leaves an entry unacknowledged for `timeout` seconds, or runs far behind for long (lag.py), or
falls an image behind while it catches up (links.py), or when --tls-crl comes to revoke its
certificate (its stream closed at once). An in-sync one leaves the set in etcd first: until then
commits wait for it, so a backup that could still be promoted never misses an acknowledged
commit. It is re-seeded when it comes back.
The set never shrinks below --min-in-sync replicas (floor.py).
"""

from __future__ import annotations

import collections
import heapq
import itertools
import logging
import queue
import socket
import threading
import time
from collections.abc import Callable, Iterable

from gemps_proto.reasons import Reason
from gemps_server.domain import images
from gemps_server.domain.applier import Applier, Timed
from gemps_server.domain.errors import Unavailable
from gemps_server.domain.journal import Entry
from gemps_server.domain.replica_image import ReplicaImage
from gemps_server.domain.state import ServerState
from gemps_server.logs import Throttle, event
from gemps_server.replication import entries, frames, image_codec
from gemps_server.replication.floor import InSyncFloor
from gemps_server.replication.lag import LagWindow
from gemps_server.replication.links import ENTRIES_BEHIND, SEEDING_SECONDS, Link
from gemps_server.replication.links import Peer as Peer  # what a backup says it is (follower.py too)
from gemps_server.replication.status import BackupLag

log = logging.getLogger("gemps.server")

#: how often timeouts and in-sync changes are looked at
MONITOR_SECONDS = 0.1
#: seconds between two warnings about one backup's refusals
REFUSAL_LOG_SECONDS = 5.0

# Called with a commit's outcome once it may be acknowledged (None) or must not be (the error).
Done = Callable[[BaseException | None], None]


class Forwarder:
    """The journal of a primary at `epoch` with at most `backups` backups; `set_in_sync` writes the
    in-sync set (etcd), False when this replica is fenced off; `holds` says whether it may still
    acknowledge."""

    def __init__(
        self,
        state: ServerState,
        applier: Applier,
        epoch: int,
        set_in_sync: Callable[[Iterable[Peer]], bool],
        holds: Callable[[], bool],
        timeout: float,
        *,
        backups: int,
        awaited: Iterable[Peer] = (),
        attach_within: float = 0.0,
        min_in_sync: int = 1,
    ) -> None:
        self._state = state
        self._applier = applier
        self.epoch = epoch
        self._set_in_sync = set_in_sync
        self._holds = holds
        self.timeout = timeout
        self._backups = backups
        self._floor = InSyncFloor(min_in_sync, backups)
        self._lock = threading.Lock()
        self._last = 0
        self._links: dict[str, Link] = {}
        self._appended: collections.deque[tuple[int, float]] = collections.deque()  # (position, when)
        self._waiters: list[tuple[int, int, Done]] = []
        self._order = itertools.count()
        self._closed = False
        self._refusals = Throttle(REFUSAL_LOG_SECONDS)
        self.forwarded = 0
        # Replicas listed in sync before this epoch, alive: by name, with when they are given up.
        self._promoted_at = time.monotonic()
        self._awaited = {peer.name: peer for peer in awaited}
        self._attach_within = attach_within
        self._monitor = threading.Thread(target=self._watch, name="gemps-replication-monitor", daemon=True)
        self._monitor.start()

    # -- the journal (state.core.journal), on the applier ---------------------------------------

    def append(self, entry: Entry) -> int:
        with self._lock:
            self._last += 1
            position = self._last
            # Not to a backup whose seed is not taken yet: its seed will hold this entry.
            links = [link for link in self._links.values() if not link.closed and link.seed_position is not None]
            if links:
                self._appended.append((position, time.monotonic()))
        if links:
            views = entries.encoded(entry, position, self.epoch)
            size = sum(view.nbytes for view in views[1:])  # the blobs: the frame's prefix and header aside
            with self._lock:
                for link in links:
                    link.queue_limit = max(link.queue_limit, ENTRIES_BEHIND * size)
                    link.largest_entry = max(link.largest_entry, size)
            for link in links:
                if (error := link.forward(position, views, size)) is not None:
                    self._lost(link, f"sending: {error}")
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
        """The highest position every in-sync backup applied (with none: the last; with a replica
        still awaited, or fewer in the set than --min-in-sync asks: none)."""
        if self._awaited:
            return 0
        acked = [link.acked for link in self._links.values() if link.in_sync]
        if self._floor.above(len(acked)):
            return 0
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

    def attach(self, peer: Peer, sock: socket.socket, revoked: Callable[[], str] = lambda: "") -> str:
        """Seed a backup that said hello on `sock`, then forward every later entry to it; "" when
        it is attached, else why it is refused (the caller says so to the peer and closes `sock`).
        `revoked()`: why its certificate is refused now (--tls-crl): asked while it is attached."""
        with self._lock:
            refusal, dead = self._refusal(peer)
            if not refusal:
                link = Link(peer, sock, self.timeout, revoked)
                self._links[peer.name] = link
            # One line per backup's name every few seconds, one for every other name together.
            throttled = peer.name if peer.name in self._links else ""
        if dead is not None:
            self._lost(dead, f"a peer of its name said hello: {refusal}")
        if refusal:
            if (suppressed := self._refusals.allow(throttled)) is not None:
                event(log, "backup refused", level=logging.WARNING, backup=peer.name, reason=refusal,
                      suppressed=suppressed or None)  # fmt: skip
            return refusal

        def seed() -> ReplicaImage | None:  # on the applier: no entry appended in between
            if link.closed:
                return None
            image = images.take(self._state)  # a copy: streamed by the sender's thread
            with self._lock:
                link.seed_position = link.sent = self._last
            return image

        def seeded(timed: Timed[ReplicaImage | None] | None, error: BaseException | None) -> None:
            if error is not None or timed is None or timed.result is None:
                self._lost(link, f"not seeded: {error}")
                return
            holder = [timed.result]  # the sender lets go of the image once it is sent
            threading.Thread(target=self._send, args=(link, holder), name="gemps-replication-send", daemon=True).start()
            threading.Thread(target=self._receive, args=(link,), name="gemps-replication-acks", daemon=True).start()

        self._applier.submit_then(seed, seeded)
        return ""

    def _refusal(self, peer: Peer) -> tuple[str, Link | None]:
        """Why `peer` may not attach now ("" when it may), and a dead link of its name to let go
        (the monitor then takes it out of the in-sync set: the peer's next try takes its place)."""
        if self._closed:
            return "this replica stopped being primary", None
        for name, link in list(self._links.items()):
            if link.closed and not link.in_sync:  # gone (the monitor would remove it next)
                del self._links[name]
        old = self._links.get(peer.name)
        if old is not None and not old.closed:
            why = self._trouble(old, time.monotonic())
            if not why:
                return f"a backup named {peer.name} is attached and alive: one per name", None
            return f"the backup named {peer.name} before it is let go ({why}): retry", old
        if old is not None and not (old.in_sync and self._floor_holds(old)):
            # closed, and still in the in-sync set until etcd says otherwise
            return f"the backup named {peer.name} before it is leaving the in-sync set: retry", None
        if old is not None:  # kept in the set by --min-in-sync: this hello takes its place (no ack meanwhile)
            del self._links[peer.name]
        if len(self._links) >= self._backups:
            return f"{self._backups} backups are attached already (--replicas {self._backups + 1})", None
        return "", None

    def _send(self, link: Link, image: list[ReplicaImage]) -> None:
        try:
            header = {"epoch": self.epoch, "position": link.seed_position}  # (the ticket key: sealed in the handshake)
            parts = image_codec.encode_parts(image.pop())
            link.queue_limit = max(link.queue_limit, sum(part.nbytes for part in parts))
            frames.send(link.sock, frames.Frame(frames.SEED, header, parts))
            del parts  # the image with it
            link.seed_sent = time.monotonic()
            # The backup reads nothing while it adopts its seed: entries wait in the outbox (bounded).
            link.seed_acked.wait()
            link.written()  # the seed: from now on an entry is written as it is appended, when nothing is queued
            while not link.closed:
                try:
                    outgoing = link.outbox.get(timeout=frames.BEAT_SECONDS)
                except queue.Empty:
                    link.beat(self.epoch)  # when one is due
                    continue
                if outgoing is None:
                    return
                link.sent = outgoing.position  # before it can be acknowledged
                frames.send_buffers(link.sock, outgoing.views)
                link.written(outgoing.entry_bytes)
        except (BlockingIOError, TimeoutError):  # SO_SNDTIMEO: not a byte taken for that long
            self._lost(link, f"sending: it read nothing for {link.send_stall:g} s")
        except OSError as error:
            self._lost(link, f"sending: {error}")

    def _receive(self, link: Link) -> None:
        try:
            while True:
                frame = frames.receive(link.sock, max_body=0)  # acks are headers alone
                if frame.kind != frames.ACK:
                    raise frames.StreamClosed(f"a backup sent {frame.kind!r}, not an acknowledgement")
                lie = link.acknowledged(int(frame.header["position"]))
                if lie:
                    self._lost(link, lie)
                    return
                self._release()
        except (OSError, ValueError, KeyError, TypeError) as error:
            self._lost(link, str(error))

    def _lost(self, link: Link, why: str) -> None:
        if link.closed:
            return
        event(log, "backup lost", level=logging.WARNING, backup=link.peer.name, reason=why)
        link.close()  # the monitor takes it out of the in-sync set (etcd first)

    def _trouble(self, link: Link, now: float) -> str:
        """Why `link` must be let go now ("" while it need not); with the lock held."""
        if link.queued_bytes > link.queue_limit:
            return f"not keeping up: {link.queued_bytes} bytes of entries queued (at most {link.queue_limit})"
        if not link.seeded:
            late = link.seed_sent is not None and now - link.seed_sent > SEEDING_SECONDS
            return f"its seed not acknowledged {SEEDING_SECONDS:g} s after it was sent" if late else ""
        allowed = link.timeout(self.timeout)
        why = f"--replica-timeout {self.timeout:g}"
        why += f", {allowed:.1f} s for its entries" if allowed > self.timeout else ""
        if (quiet := now - link.heard) > allowed:
            return f"no ack for {quiet:.1f} s ({why})"
        if link.in_sync and (waiting := self._age(link, now)) > allowed:
            return f"an entry unacknowledged for {waiting:.1f} s ({why})"
        return link.slow if link.in_sync else ""

    def _watch(self) -> None:
        """Move backups in and out of the in-sync set: a seeded one in, a lost, late or slow one out."""
        while not self._closed:
            time.sleep(MONITOR_SECONDS)
            now = time.monotonic()
            if self._awaited:
                self._give_up_awaited(now)
            with self._lock:
                links = list(self._links.values())
            # a revoked certificate (it may read the list's file: not under the lock)
            revoked = {link.peer.name: why for link in links if not link.closed and (why := link.revoked())}
            with self._lock:
                for link in links:
                    if link.lag is not None and link.in_sync and not link.closed and not link.slow:
                        link.slow = link.lag.add(now, self._age(link, now), self._last, link.acked, link.entry_seconds)
                troubles = {
                    link.peer.name: "" if link.closed else revoked.get(link.peer.name) or self._trouble(link, now)
                    for link in links
                }
            for link in links:
                why = troubles[link.peer.name]
                if link.peer.name in revoked:  # not a frame more, whatever etcd says (until told, commits wait)
                    self._lost(link, why)
                if link.in_sync and (link.closed or why):
                    self._change(link, join=False, why=why or "connection lost")
                elif why:
                    self._lost(link, why)
                elif not link.in_sync and not link.closed and link.seeded:
                    self._change(link, join=True, why="seeded")
                elif link.closed and not link.in_sync:
                    with self._lock:
                        if self._links.get(link.peer.name) is link:
                            del self._links[link.peer.name]

    def _give_up_awaited(self, now: float) -> None:
        """The replicas awaited since the promotion that did not attach in time, or were not seeded
        in time, leave the set."""
        waited = now - self._promoted_at
        with self._lock:
            attached = {name for name, link in self._links.items() if not link.closed}
            late = [
                name for name in self._awaited
                if waited > (self.timeout if name in attached else min(self._attach_within, self.timeout))
            ]  # fmt: skip
            members = [link.peer for link in self._links.values() if link.in_sync]
            members += [peer for name, peer in self._awaited.items() if name not in late]
            kept = late[: self._floor.missing(len(members))]
            late = late[len(kept) :]
            members += [self._awaited[name] for name in kept]
        for name in kept:
            self._floor.log_kept(name, f"did not attach in time ({waited:.1f} s after the promotion)", self.epoch)
        if not late:
            return
        if not self._set_in_sync(members):
            return  # fenced off, or etcd unreachable: commits wait; the lease decides
        with self._lock:
            for name in late:
                self._awaited.pop(name, None)
        for name in late:
            why = "not seeded within --replica-timeout" if name in attached else "did not attach in time"
            event(log, "backup dropped", level=logging.WARNING, backup=name, epoch=self.epoch,
                  reason=f"{why} ({waited:.1f} s after the promotion)")  # fmt: skip
        self._release()

    def _change(self, link: Link, join: bool, why: str) -> None:
        with self._lock:
            members = self._listed_besides(link)
        if not join and self._floor.above(len(members)):  # listed still: commits wait for it
            self._floor.log_kept(link.peer.name, why, self.epoch)
            if link.queued_bytes > link.queue_limit or time.monotonic() - link.heard > link.timeout(self.timeout):
                link.close()  # memory bounded; a hello of its takes its place, seeded anew
            return
        if join:
            if len(members) >= self._backups:  # never more than R in the set (the primary is one)
                return
            members.append(link.peer)
        if not self._set_in_sync(members):
            return  # fenced off, or etcd unreachable: commits wait; the lease decides
        if join:
            link.lag = LagWindow(self.timeout, time.monotonic())
        link.in_sync = join
        if join:  # seeded: a backup like any other now (in sync first: no moment waits on neither)
            with self._lock:
                self._awaited.pop(link.peer.name, None)
        if not join:
            link.close()
        level = logging.INFO if join else logging.WARNING  # under-replicated from now on
        event(log, "backup in sync" if join else "backup dropped", level=level, backup=link.peer.name, reason=why,
              epoch=self.epoch)  # fmt: skip
        self._release()

    def _listed_besides(self, link: Link) -> list[Peer]:
        """The backups the in-sync set lists other than `link`'s: in sync, or awaited (lock held)."""
        members = [other.peer for other in self._links.values() if other.in_sync and other is not link]
        return members + [peer for name, peer in self._awaited.items() if name != link.peer.name]

    def _floor_holds(self, link: Link) -> bool:
        """Whether --min-in-sync keeps `link` in the set: the others listed are too few (lock held)."""
        return self._floor.above(len(self._listed_besides(link)))

    # -- what status reads ------------------------------------------------------------------------

    def _age(self, link: Link, now: float) -> float:
        """How long the oldest entry `link` has not acknowledged has waited (0: none); with the lock held."""
        oldest = next((when for position, when in self._appended if position > link.acked), None)
        return 0.0 if oldest is None else now - oldest

    def lags(self) -> tuple[BackupLag, ...]:
        now = time.monotonic()
        with self._lock:
            lags = [
                BackupLag(link.peer.name, link.in_sync, max(0, self._last - link.base()), self._age(link, now))
                for link in self._links.values()
                if link.peer.name not in self._awaited
            ]
            # in sync (etcd lists them) and nothing applied yet: every entry waits on them
            oldest = self._appended[0][1] if self._appended else now
            lags += [BackupLag(name, True, self._last, now - oldest) for name in self._awaited]
        return tuple(sorted(lags, key=lambda lag: lag.name))

    def stalled(self) -> str:
        """Why commits wait now that the set's floor keeps an out-of-reach backup in it ("": none is)."""
        now = time.monotonic()
        with self._lock:
            held = [
                (link.peer.name, None if link.closed else self._age(link, now))
                for link in self._links.values()
                if link.in_sync and (link.closed or self._age(link, now) > link.timeout(self.timeout))
                and self._floor_holds(link)
            ]  # fmt: skip
        return self._floor.describe(held)

    def close(self) -> None:
        """This replica stopped being primary: every waiting commit is refused, every backup let go."""
        with self._lock:
            self._closed = True
            links = list(self._links.values())
            self._links.clear()
        for link in links:
            link.close()
        self._release()
