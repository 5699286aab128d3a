"""One replica of a partition: its role, decided by etcd, and what that role does.

The coordinator (election.py) tells it when it became primary, lost its lease, or saw another
replica become primary. As primary it journals to a Forwarder and answers workers; as a backup it
follows the primary's stream (Follower) and refuses workers with `not_primary` (the SDK tries the
partition's next replica). Its replication listener is always bound: backups dial a primary there.
The service asks it, through the layer (layer.py; the port: gemps_server.replicas.Replicas),
whether it may answer a worker now, and when a commit may be acknowledged.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
import uuid
from collections.abc import Iterable

from gemps_proto.reasons import Reason
from gemps_server.domain.applier import Applier
from gemps_server.domain.errors import Unavailable
from gemps_server.domain.journal import NoJournal
from gemps_server.domain.state import ServerState
from gemps_server.logs import event
from gemps_server.replication.coordinator import Coordinator
from gemps_server.replication.election import Election, Member
from gemps_server.replication.follower import CONNECT_SECONDS, Follower, _on_applier
from gemps_server.replication.forwarder import Done, Forwarder, Peer
from gemps_server.replication.handshake import Handshake
from gemps_server.replication.listener import Listener, Refusals
from gemps_server.replication.status import BACKUP, CANDIDATE, PRIMARY, ReplicationStatus
from gemps_server.security import Tickets

log = logging.getLogger("gemps.server")

#: seconds before a backup dials its primary again after the stream ended
REDIAL_SECONDS = 0.5


class Replica:
    """This process as one of `replicas` replicas of its partition."""

    def __init__(
        self,
        state: ServerState,
        applier: Applier,
        replicas: int,
        timeout: float,
        handshake: Handshake,
        tickets: Tickets,
        min_in_sync: int = 1,
    ) -> None:
        self._state, self._applier = state, applier
        # The data plane's ticket key: sent with a primary's seed, adopted by its backups.
        self._tickets = tickets
        self.replicas = replicas
        self._timeout = timeout
        self._min_in_sync = min_in_sync
        self._handshake = handshake
        self.me = Member("", "", "", "")  # known once started
        self._lock = threading.RLock()  # role changes come from the coordinator and the follower's end
        self.role = CANDIDATE
        self.epoch = 0
        self._held_epoch = 0  # the epoch of the journal its state follows: promoted to, or seeded by
        self._primary: Member | None = None
        self._forwarder: Forwarder | None = None
        self._follower: Follower | None = None
        self.failovers = 0
        self.applied = 0  # entries applied from primaries, over this process's life
        # replica name -> when it last showed it lives: it refused this one's dial, or dialed this one
        self._heard_from: dict[str, float] = {}
        self._stopped = False
        self._started = False
        self.refusals = Refusals()  # what its replication listener turned away (listener.py)

    @staticmethod
    def incarnation() -> str:
        return uuid.uuid4().hex

    def start(self, election: Election, listener: socket.socket) -> None:
        """Take part in `election` (as its member), taking backups on `listener` when primary."""
        self._election, self.me = election, election.me
        self._coordinator = Coordinator(
            election,
            self._promoted,
            self._demoted,
            self._primary_is,
            unfit=self._handshake.unfit,
            revoked=self._handshake.revoked,
        )
        self._listener = Listener(
            listener, self._handshake, self.me, self._tickets, self.refusals, self._refusal, lambda: self._forwarder
        )
        self._listener.start()
        self._coordinator.start()
        self._started = True

    def stop(self) -> None:
        """Step down (the lease is given back, so a backup takes over at once) and let go."""
        self._stopped = True
        if not self._started:
            return
        self._coordinator.stop(resign=True)
        with self._lock:
            if self._forwarder is not None:
                self._forwarder.close()
            if self._follower is not None:
                self._follower.stop()
        self._listener.stop()

    # -- what the service asks (gemps_server.replicas.Replicas) ------------------------------------

    def leads(self) -> bool:
        """Whether this replica is primary and knows its lease valid now: the election's local
        deadline (holds(): the last renewal sent + 80 % of the lease, on the monotonic clock), read
        at the call. A primary paused past its lease is not one, though its coordinator only
        demotes it at its next tick, an etcd round trip after it resumes (issue 77, item 9)."""
        return self.role == PRIMARY and self._started and self._election.holds()

    def require_primary(self) -> None:
        if self.leads():
            return
        role = self.role
        if role == PRIMARY:
            raise Unavailable(
                f"replica {self.me.name}'s lease as primary of epoch {self.epoch} has run out (another replica may "
                "hold the partition now): retry at another replica",
                Reason.NOT_PRIMARY,
            )
        primary = self._primary.address if self._primary is not None and role == BACKUP else ""
        where = f"; the primary is at {primary}" if primary else "; no primary is known yet"
        raise Unavailable(
            f"replica {self.me.name} is a {role}, not its partition's primary{where}: retry at another replica",
            Reason.NOT_PRIMARY,
        )

    @property
    def held_epoch(self) -> int:
        """The epoch of the journal this replica's state follows (0: none in this process): a backup
        not yet seeded by its primary still holds its previous epoch's state (election.py reports it)."""
        follower = self._follower
        return follower.epoch if follower is not None and follower.seeded else self._held_epoch

    def when_replicated(self, position: int, done: Done) -> None:
        forwarder = self._forwarder
        if forwarder is None:
            done(Unavailable(f"replica {self.me.name} stopped being primary: retry", Reason.NOT_PRIMARY))
        else:
            forwarder.when_replicated(position, done)

    def status(self) -> ReplicationStatus:
        """The role its lease allows now (`leads`): a primary whose lease ran out reports itself a
        candidate, without backups, before its coordinator demotes it (what metrics and Status show)."""
        forwarder, follower, primary, role = self._forwarder, self._follower, self._primary, self.role
        lapsed = role == PRIMARY and not self.leads()
        if lapsed:
            role, primary = CANDIDATE, None
        return ReplicationStatus(
            name=self.me.name,
            role=role,
            epoch=self.epoch,
            replicas=self.replicas,
            primary=primary.address if primary is not None else "",
            backups=forwarder.lags() if forwarder is not None and not lapsed else (),
            forwarded=forwarder.forwarded if forwarder is not None else 0,
            applied=self.applied + (follower.applied if follower is not None else 0),
            failovers=self.failovers,
            unavailable=forwarder.stalled() if forwarder is not None and not lapsed else "",
        )

    # -- the coordinator's news (its thread) ----------------------------------------------------------

    def _promoted(self, epoch: int) -> None:
        awaited = self._alive_in_sync()  # an etcd read: not under the lock
        with self._lock:
            self._let_go_of_primary()
            forwarder = Forwarder(
                self._state,
                self._applier,
                epoch,
                self._set_in_sync,
                self._election.holds,
                self._timeout,
                backups=self.replicas - 1,
                awaited=awaited,
                # a live replica that reaches etcd sees the new primary within a tick (a quarter lease)
                attach_within=self._election.lease_seconds / 2,
                min_in_sync=self._min_in_sync,
            )
            if awaited:
                event(log, "awaiting backups", backups=",".join(peer.name for peer in awaited), epoch=epoch)
            if not self._set_in_sync(awaited):  # those and this replica, until backups are seeded
                forwarder.close()
                event(log, "promotion abandoned", level=logging.WARNING, epoch=epoch)
                return
            self._set_journal(forwarder)
            self._forwarder, self.role, self.epoch, self._primary = forwarder, PRIMARY, epoch, self.me
            self._held_epoch = epoch
            self.failovers += 1
        # Worth a warning only when it took over from another primary (not at a job's start).
        level = logging.WARNING if self._state.core.version else logging.INFO
        event(log, "primary", level=level, replica=self.me.name, epoch=epoch, version=self._state.core.version)

    def _alive_in_sync(self) -> list[Peer]:
        """The replicas of the in-sync list this one won with, but itself, that are alive: within
        the last lease they refused a dial of this one's (a primary demoted) or dialed this one,
        or etcd has their presence. Until they are seeded the new primary acknowledges nothing
        (forwarder.py): right after a failover one of them is the only other replica that could
        hold what it acknowledges."""
        try:
            announced = self._election.announced()
        except Exception as error:  # etcd unreachable: those heard from lately
            event(log, "presence not read", level=logging.WARNING, error=f"{type(error).__name__}: {error}")
            announced = set()
        now = time.monotonic()
        heard = {name for name, at in self._heard_from.items() if now - at < self._election.lease_seconds}
        return [
            Peer(name, incarnation)
            for name, incarnation in self._election.won_with
            if name != self.me.name and (name in heard or (name, incarnation) in announced)
        ]

    def _demoted(self) -> None:
        with self._lock:
            forwarder, self._forwarder = self._forwarder, None
            self.role, self._primary = CANDIDATE, None
            if forwarder is not None:
                forwarder.close()
                self._set_journal(NoJournal())
        event(log, "lost primacy", level=logging.WARNING, replica=self.me.name, epoch=self.epoch)

    def _primary_is(self, primary: Member | None, epoch: int) -> None:
        with self._lock:
            if primary is None or self._stopped:
                return
            if (primary.name, primary.incarnation) == (self.me.name, self.me.incarnation):
                return
            if self.role == PRIMARY:  # another holds the key: this one's lease is gone
                self._demoted()
            self._primary, self.epoch, self.role = primary, epoch, BACKUP
            follower = self._follower
            if follower is None or follower.epoch != epoch or follower.primary != primary.replication:
                self._follow(primary, epoch)

    def _follow(self, primary: Member, epoch: int) -> None:
        self._let_go_of_primary()
        me = Peer(self.me.name, self.me.incarnation, self.me.address, self.me.replication)

        def ended(why: str) -> None:
            if follower.refused:
                self._heard_from[primary.name] = time.monotonic()
            timer = threading.Timer(REDIAL_SECONDS, self._redial, args=(follower,))
            timer.daemon = True
            timer.start()

        follower = Follower(
            self._state,
            self._applier,
            me,
            primary.replication,
            epoch,
            self._handshake,
            primary.name,
            ended,
            self._tickets.adopt,
        )
        self._follower = follower
        follower.start()

    def _redial(self, ended: Follower) -> None:
        with self._lock:
            if self._follower is ended and self.role == BACKUP and self._primary is not None and not self._stopped:
                self.applied += ended.applied
                self._follow(self._primary, self.epoch)

    def _let_go_of_primary(self) -> None:
        """Stop following (the follower's thread is waited for: nothing of the old stream is applied
        after this replica starts serving)."""
        follower, self._follower = self._follower, None
        if follower is not None:
            follower.stop()
            follower.join(timeout=2 * CONNECT_SECONDS)
            self.applied += follower.applied
            if follower.seeded:
                self._held_epoch = follower.epoch

    def _set_in_sync(self, backups: Iterable[Peer]) -> bool:
        members = [self.me, *(Member(p.name, p.incarnation, p.address, p.replication) for p in backups)]
        try:
            return self._election.set_in_sync(members)
        except Exception as error:  # etcd unreachable: nothing changes; the lease decides
            event(log, "in-sync set not written", level=logging.WARNING, error=f"{type(error).__name__}: {error}")
            return False

    def _set_journal(self, journal: Forwarder | NoJournal) -> None:
        def swap() -> None:
            self._state.core.journal = journal

        _on_applier(self._applier, swap)

    # -- the replication listener's questions (listener.py) -------------------------------------------

    def _refusal(self, name: str, epoch: object) -> str:
        """Why this replica takes no backup `name` (proven) dialling `epoch` now ('' when it does)."""
        if not self.leads() or self._forwarder is None:
            # It lives and reaches this replica: awaited should this one be promoted (_alive_in_sync).
            if not self._handshake.name_refusal(name, self.me.name):  # the partition's names only: bounded
                self._heard_from[name] = time.monotonic()
            return f"{self.me.name} is not primary"
        if epoch != self.epoch:
            return f"epoch {str(epoch)[:20]} is not the primary's ({self.epoch})"
        return ""
