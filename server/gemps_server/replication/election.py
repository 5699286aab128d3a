"""Who is a partition's primary: decided by etcd, never by gemps itself (docs/DESIGN.md, "Replicas").

Under a partition's prefix (`partition_prefix`) etcd holds two keys:

- `primary`: the holder's `Member` as JSON, bound to the holder's lease. Its create_revision is the
  **epoch**: it grows with every new primary, and a key re-created by anyone else gets a new one.
- `in-sync`: the replicas that hold every acknowledged commit, as JSON [name, incarnation] pairs.
  Only the epoch's holder writes it (a transaction fenced on the primary key's create_revision),
  and only a listed replica may campaign, so a backup that missed commits can never be promoted.
  Absent means a fresh job: anyone may campaign, and the winner lists itself.
- `members/<name>`: each live replica's incarnation and the (epoch, version) of the checkpoint it
  started from, bound to a lease of its own (`announce`). When no replica of the in-sync list has
  been alive for ORPHANED_LEASES leases (every process that held the acknowledged commits is
  gone: a whole job restarted, say), nobody could ever be promoted; then the live replica holding
  the newest checkpoint, by (epoch, version), may campaign (several, when tied), and says loudly
  that commits acknowledged after its checkpoint are lost. The durability rule holds: no replica
  of the partition lived. By epoch first: an old primary's checkpoint may hold commits past the
  new primary's version that were never acknowledged, while the new primary's are.

Fencing: a primary acknowledges commits only while `holds()`, which trusts the lease for 80 % of
its TTL counted from when the last successful renewal was *sent*. etcd counts its expiry from when
it received that request, which is later, so an old primary stops acknowledging before etcd lets
anyone else win; the margin covers clock-rate drift between the two machines.

`coordinator.Coordinator` is the loop each replica runs: renew while primary, else watch and campaign.
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import math
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from typing import TypeVar

from etcd3gw.client import Etcd3Client
from etcd3gw.lease import Lease

from gemps_server.replication.etcd_client import CoordinationUnavailable, EtcdAccess, EtcdEndpoints

log = logging.getLogger("gemps.server")
T = TypeVar("T")

#: the share of the lease a primary trusts, counted from when its last renewal was sent
HOLD_FRACTION = 0.8
#: leases without a live in-sync replica before another may take over (see the module's docstring)
ORPHANED_LEASES = 5


def partition_prefix(job: str, partition: int) -> str:
    """The etcd prefix of one partition's election keys."""
    return f"/gemps/{job}/partition/{partition}"


def new_incarnation() -> str:
    """A random id for this process: a restarted replica is a new incarnation, never in-sync."""
    return uuid.uuid4().hex


@dataclass(frozen=True)
class Member:
    """One replica process, as the primary key and the in-sync list name it."""

    name: str  # unique within the partition, e.g. "partition-0-replica-1"
    incarnation: str  # this process's random id (new_incarnation())
    address: str  # worker-facing gRPC host:port
    replication: str  # host:port of its replication listener (backups dial the primary here)

    @property
    def identity(self) -> tuple[str, str]:
        """(name, incarnation): what the in-sync list holds."""
        return (self.name, self.incarnation)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> Member:
        fields = json.loads(text)
        return cls(
            name=str(fields["name"]),
            incarnation=str(fields["incarnation"]),
            address=str(fields["address"]),
            replication=str(fields["replication"]),
        )


@dataclass(frozen=True)
class _Term:
    """What this replica holds while primary."""

    epoch: int
    lease_id: int


def _presence(name: str, raw: bytes) -> tuple[tuple[str, str], tuple[int, int]]:
    """A members/ key's (name, incarnation) and the (epoch, version) its replica started from; a
    value that is not such a record (a bare incarnation) holds nothing known: (0, 0)."""
    try:
        fields = json.loads(raw)
        return (name, str(fields["incarnation"])), (int(fields["epoch"]), int(fields["version"]))
    except (ValueError, KeyError, TypeError):
        return (name, raw.decode(errors="replace")), (0, 0)


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


class Election:
    """One replica's view of its partition's election. A call that reaches etcd raises
    CoordinationUnavailable when etcd does not answer within `timeout` (default lease_seconds / 3;
    it bounds connecting and each read, as requests' timeouts do). With several comma-separated
    endpoints, a failed call moves the next one on to the next endpoint."""

    def __init__(
        self,
        endpoints: str,
        prefix: str,
        me: Member,
        lease_seconds: float = 3.0,
        timeout: float | None = None,
        restored: tuple[int, int] = (0, 0),
        access: EtcdAccess | None = None,
    ) -> None:
        if lease_seconds <= 0:
            raise ValueError(f"lease_seconds must be positive, not {lease_seconds}")
        timeout = lease_seconds / 3 if timeout is None else timeout
        # Longer, and one slow renewal could outlast the window holds() trusts.
        if not 0 < timeout <= lease_seconds / 3:
            raise ValueError(f"timeout must be in (0, lease_seconds / 3], not {timeout}")
        self.me = me
        self.prefix = prefix.rstrip("/")
        self.lease_seconds = lease_seconds
        self.timeout = timeout
        self.primary_key = f"{self.prefix}/primary"
        self.in_sync_key = f"{self.prefix}/in-sync"
        self._ttl = max(1, math.ceil(lease_seconds))  # etcd grants whole seconds
        self._etcd = EtcdEndpoints(endpoints, timeout, access)  # access: TLS files and an etcd user
        self._lock = threading.Lock()  # guards _term and _holds_until (the Coordinator's thread and callers)
        self._term: _Term | None = None
        self._holds_until = 0.0  # time.monotonic() until which holds() answers True
        self.members_prefix = f"{self.prefix}/members/"
        self._presence: int | None = None  # the lease of this replica's members/ key
        self._orphaned_since: float | None = None  # when no in-sync replica was seen alive
        self.restored = restored  # (epoch, version) of the checkpoint this process started from
        self._alive: dict[tuple[str, str], tuple[int, int]] = {}  # members/ as last read: what each holds

    # -- what this replica holds ------------------------------------------------------------------

    @property
    def epoch(self) -> int | None:
        """The epoch this replica holds as primary (None: not primary)."""
        term = self._term
        return None if term is None else term.epoch

    def holds(self) -> bool:
        """Whether this replica may still acknowledge commits as primary (no I/O)."""
        return self._term is not None and time.monotonic() < self._holds_until

    def campaign(self) -> int | None:
        """Try to become primary: the epoch when won; None when another holds it or this replica is
        not in the in-sync list (it may lack acknowledged commits). Already primary: its epoch."""
        held = self._term
        if held is not None:
            if self.holds():
                return held.epoch
            self._demote(held, "the lease was not renewed in time")  # a lapsed epoch is never regained
        if self.primary() is not None:
            return None
        listed, listed_revision = self._read_in_sync()
        unclean = listed is not None and self.me.identity not in listed
        if unclean and (not self._orphaned(listed or []) or self._newer_elsewhere()):
            return None
        sent_at = time.monotonic()  # the lease's clock starts no earlier than its grant was sent
        lease_id = self._call("lease grant", lambda client: client.lease(self._ttl).id)
        put_me = {"request_put": {"key": _b64(self.primary_key), "value": _b64(self.me.to_json()), "lease": lease_id}}
        list_me = {"request_put": {"key": _b64(self.in_sync_key), "value": _b64(json.dumps([self.me.identity]))}}
        txn = {
            # Nobody holds it, and the in-sync list is the one read above (still absent, or still
            # naming this replica): both checked where they are decided, in one transaction.
            "compare": [
                {"key": _b64(self.primary_key), "target": "CREATE", "result": "EQUAL", "create_revision": 0},
                {"key": _b64(self.in_sync_key), "target": "MOD", "result": "EQUAL", "mod_revision": listed_revision},
            ],
            "success": [put_me] if listed is not None and not unclean else [put_me, list_me],
            "failure": [],
        }
        try:
            response = self._call("campaign", lambda client: client.transaction(txn))
        except CoordinationUnavailable:
            self._revoke_quietly(lease_id)  # it may have won: give the key back rather than hold it unrenewed
            raise
        if not response.get("succeeded"):
            self._revoke_quietly(lease_id)
            return None
        epoch = int(response["header"]["revision"])  # the transaction's revision: the key's create_revision
        won = _Term(epoch, lease_id)
        with self._lock:
            self._holds_until = sent_at + self.lease_seconds * HOLD_FRACTION
            self._term = won
        if not self.holds():  # the transaction took longer than the lease can be trusted
            self._demote(won, "the campaign's answer came too late")
            return None
        if unclean:
            log.error(
                "%s: primary of %s, epoch %d, though not in sync: no replica that held every acknowledged "
                "commit has been alive for %d leases (%s); this one holds the newest checkpoint of those "
                "alive (epoch %d, version %d): commits acknowledged after it are lost",
                self.me.name, self.prefix, epoch, ORPHANED_LEASES, ", ".join(name for name, _ in listed or []),
                *self.restored,
            )  # fmt: skip
        else:
            log.info("%s: primary of %s, epoch %d", self.me.name, self.prefix, epoch)
        return epoch

    def announce(self) -> None:
        """Say this replica is alive: its members/ key, bound to a lease of its own, kept."""
        if self._presence is not None:
            presence = self._presence
            if self._call("presence keep-alive", lambda client: Lease(presence, client).refresh()) > 0:
                return
        lease_id = self._call("lease grant", lambda client: client.lease(self._ttl).id)
        key = self.members_prefix + self.me.name
        epoch, version = self.restored
        value = json.dumps({"incarnation": self.me.incarnation, "epoch": epoch, "version": version})
        self._call("presence", lambda client: client.put(key, value, lease=Lease(lease_id, client)))
        self._presence = lease_id

    def _orphaned(self, listed: list[tuple[str, str]]) -> bool:
        """Whether no replica of the in-sync list has been alive for ORPHANED_LEASES leases."""
        self._alive = dict(
            _presence(metadata["key"].decode().removeprefix(self.members_prefix), value)
            for value, metadata in self._call("read", lambda client: client.get_prefix(self.members_prefix))
        )
        if set(self._alive) & set(listed):
            self._orphaned_since = None
            return False
        now = time.monotonic()
        self._orphaned_since = self._orphaned_since or now
        return now - self._orphaned_since >= ORPHANED_LEASES * self.lease_seconds

    def _newer_elsewhere(self) -> bool:
        """Whether another live replica (as `_orphaned` last read them) started from a newer
        checkpoint than this one, by (epoch, version): that one should take over, not this one."""
        return any(held > self.restored for identity, held in self._alive.items() if identity != self.me.identity)

    def renew(self) -> bool:
        """Keep the lease: True while held. False once it is gone (expired, lapsed past what holds()
        trusts, or the key is no longer this epoch's): then this replica is demoted, for good, and
        must campaign again for a new epoch. CoordinationUnavailable: etcd did not answer, and
        holds() still trusts the lease for a while."""
        term = self._term
        if term is None:
            return False
        if not self.holds():
            self._demote(term, "the lease was not renewed in time")
            return False
        sent_at = time.monotonic()
        try:
            ttl = self._call("lease keep-alive", lambda client: Lease(term.lease_id, client).refresh())
            holder = self._primary_revision() if ttl > 0 else None
        except CoordinationUnavailable:
            if not self.holds():
                self._demote(term, "etcd did not answer before the lease ran out")
                return False
            raise
        if ttl <= 0:
            self._demote(term, "the lease expired")
            return False
        if holder != term.epoch:  # deleted or re-created by someone else (an operator): not ours any more
            self._demote(term, "the primary key is no longer this epoch's")
            return False
        with self._lock:
            if self._term is not term or time.monotonic() >= self._holds_until:
                lapsed = True  # lapsed while waiting for etcd: the epoch is not regained
            else:
                lapsed = False
                self._holds_until = sent_at + self.lease_seconds * HOLD_FRACTION
        if lapsed:
            self._demote(term, "the renewal's answer came after the lease ran out")
            return False
        return True

    def set_in_sync(self, members: Iterable[Member]) -> bool:
        """Replace the in-sync list (this replica, the primary, is always listed first). False when
        fenced: this replica does not hold the current epoch (then it is demoted)."""
        term = self._term
        if term is None:
            return False
        pairs = [self.me.identity]
        pairs += [member.identity for member in members if member.identity not in pairs]
        txn = {
            "compare": [
                {"key": _b64(self.primary_key), "target": "CREATE", "result": "EQUAL", "create_revision": term.epoch}
            ],
            "success": [{"request_put": {"key": _b64(self.in_sync_key), "value": _b64(json.dumps(pairs))}}],
            "failure": [],
        }
        response = self._call("in-sync write", lambda client: client.transaction(txn))
        if not response.get("succeeded"):
            self._demote(term, "fenced: another epoch holds the primary key")
            return False
        return True

    def resign(self) -> None:
        """Step down (a graceful stop): holds() turns False at once, then the primary key is deleted
        if it is still this epoch's, and the lease revoked, so a backup can win without waiting for
        the lease to run out."""
        term = self._term
        if term is None:
            return
        self._demote(term, "resigned", graceful=True)
        txn = {
            "compare": [
                {"key": _b64(self.primary_key), "target": "CREATE", "result": "EQUAL", "create_revision": term.epoch}
            ],
            "success": [{"request_delete_range": {"key": _b64(self.primary_key)}}],
            "failure": [],
        }
        self._call("resign", lambda client: client.transaction(txn))
        self._revoke_quietly(term.lease_id)  # the key is gone; an already expired lease is no error here

    def withdraw(self) -> None:
        """This replica is stopping: its members/ key goes (its lease revoked)."""
        if self._presence is not None:
            self._revoke_quietly(self._presence)
            self._presence = None

    def close(self) -> None:
        """Close the HTTP connections (does not resign)."""
        self._etcd.close()

    # -- what etcd holds ----------------------------------------------------------------------------

    def primary(self) -> tuple[Member, int] | None:
        """The current primary and its epoch; None when there is none."""
        found = self._call("read", lambda client: client.get(self.primary_key, metadata=True))
        if not found:
            return None
        value, metadata = found[0]
        try:
            return Member.from_json(value), int(metadata["create_revision"])
        except (ValueError, KeyError, TypeError) as error:
            raise CoordinationUnavailable(f"malformed {self.primary_key}: {value!r}") from error

    def in_sync(self) -> list[tuple[str, str]] | None:
        """The in-sync list as (name, incarnation) pairs; None when the key is absent (a fresh job)."""
        return self._read_in_sync()[0]

    def _read_in_sync(self) -> tuple[list[tuple[str, str]] | None, int]:
        """The in-sync list and the key's mod_revision (0 when absent)."""
        found = self._call("read", lambda client: client.get(self.in_sync_key, metadata=True))
        if not found:
            return None, 0
        value, metadata = found[0]
        try:
            return [(str(name), str(incarnation)) for name, incarnation in json.loads(value)], int(
                metadata["mod_revision"]
            )
        except (ValueError, KeyError, TypeError) as error:
            raise CoordinationUnavailable(f"malformed {self.in_sync_key}: {value!r}") from error

    def _primary_revision(self) -> int | None:
        found = self._call("read", lambda client: client.get(self.primary_key, metadata=True))
        return int(found[0][1]["create_revision"]) if found else None

    # -- plumbing -----------------------------------------------------------------------------------

    def _demote(self, term: _Term | None, why: str, *, graceful: bool = False) -> None:
        """End `term` (unless already ended: a later term, won meanwhile, is left alone)."""
        with self._lock:
            if term is None or self._term is not term:
                return
            self._term, self._holds_until = None, 0.0
        level = logging.INFO if graceful else logging.WARNING
        log.log(level, "%s: no longer primary of %s (epoch %d): %s", self.me.name, self.prefix, term.epoch, why)
        if not graceful:  # (resign revokes it itself)
            self._revoke_quietly(term.lease_id)  # the key may still be alive at etcd: free it for a backup

    def _revoke_quietly(self, lease_id: int) -> None:
        with contextlib.suppress(CoordinationUnavailable):  # unreachable: the lease runs out on its own
            self._call("lease revoke", lambda client: Lease(lease_id, client).revoke())

    def _call(self, what: str, request: Callable[[Etcd3Client], T]) -> T:
        return self._etcd.call(what, request)
