"""Who is a partition's primary: decided by etcd, never by gemps itself (docs/DESIGN.md, "Replicas").

Under a partition's prefix (`partition_prefix`) etcd holds two keys:

- `primary`: the holder's `Member` as JSON with the epoch's `base`, bound to the holder's lease.
  The **epoch** is its create_revision + base: it grows with every new primary, and a key
  re-created by anyone else gets a new one. The base is 0 until etcd loses its data; then the first
  primary after it takes every replica's highest epoch seen (epoch_record.py) as the base, so that
  epochs never repeat although etcd's revisions start again at 1 (fencing compares the revision).
- `in-sync`: the replicas that hold every acknowledged commit, as JSON {"base", "members":
  [[name, incarnation], ...]}. Only the epoch's holder writes it (a transaction fenced on the
  primary key's create_revision), and only a listed replica may campaign, so a backup that missed
  commits can never be promoted. Absent: a fresh job, or etcd lost its data; then nobody knows who
  holds every acknowledged commit, and a replica may campaign only once all R replicas report
  their state and none holds a newer one (recovery.py; DESIGN §3d); until then `unavailable` says why.
- `members/<name>`: each live replica's `recovery.Report` (incarnation, highest epoch seen, the
  (epoch, version) of the state it holds), bound to a lease of its own (`announce`). When every
  replica of the in-sync list has been replaced by a new process of its name for ORPHANED_LEASES
  leases (every process that held the acknowledged commits is gone: a whole job restarted, say),
  nobody could ever be promoted; then the live replica holding the newest state, by (epoch,
  version), may campaign (several, when tied), and says loudly that commits acknowledged after its
  checkpoint are lost. The durability rule holds: no replica of the partition lived. A listed
  replica that is only silent (paused, cut off: its presence key expired) is not gone, however
  long: it may come back holding commits nobody else has, so it is waited for (starting a process
  under its name is how an operator says it is gone for good). By epoch first: an old primary's
  checkpoint may hold unacknowledged commits past the new primary's version.

Fencing: a primary acknowledges only while `holds()`: it trusts the lease for 80 % of its TTL from
when its last good renewal was *sent*; etcd counts from when it received it (later), so an old
primary stops acknowledging before anyone else can win; the margin covers clock-rate drift.

`coordinator.Coordinator` is the loop each replica runs: renew while primary, else watch and campaign.
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

from etcd3gw.client import Etcd3Client
from etcd3gw.lease import Lease

from gemps_server.replication.epoch_record import EpochRecord, EpochRecordError
from gemps_server.replication.etcd_client import CoordinationUnavailable, EtcdAccess, EtcdEndpoints, lease_ttl
from gemps_server.replication.member import Member, new_incarnation, partition_prefix
from gemps_server.replication.recovery import Held, Report, Unavailable, Verdict, judge

__all__ = ["HOLD_FRACTION", "ORPHANED_LEASES", "Election", "Member", "new_incarnation", "partition_prefix"]

log = logging.getLogger("gemps.server")
T = TypeVar("T")

#: the share of the lease a primary trusts, counted from when its last renewal was sent
HOLD_FRACTION = 0.8
#: leases without a live in-sync replica before another may take over (see the module's docstring)
ORPHANED_LEASES = 5


@dataclass(frozen=True)
class _Term:
    """What this replica holds while primary."""

    epoch: int  # revision + base
    lease_id: int
    revision: int  # the primary key's create_revision: what fencing transactions compare
    base: int  # carried into the in-sync key, so that the next primary's epoch is above this one's


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def _in_sync_value(base: int, members: Iterable[tuple[str, str]]) -> str:
    return json.dumps({"base": base, "members": [list(identity) for identity in members]})


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
        restored: Held = (0, 0),
        replicas: Sequence[str] = (),
        record: EpochRecord | None = None,
        held: Callable[[], Held] | None = None,
        access: EtcdAccess | None = None,
    ) -> None:
        """`replicas`: the names of the partition's R replicas (every one must report before a
        primary is chosen without an in-sync list; empty: those that report). `record`: the highest
        epoch seen, on disk (default: in memory). `held`: the (epoch, version) of the state this
        replica holds now (default: `restored`, the checkpoint it started from)."""
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
        self._ttl = lease_ttl(lease_seconds)
        self._etcd = EtcdEndpoints(endpoints, timeout, access)  # access: TLS files and an etcd user
        self._lock = threading.Lock()  # guards _term and _holds_until (the Coordinator's thread and callers)
        self._term: _Term | None = None
        self._holds_until = 0.0  # time.monotonic() until which holds() answers True
        self.members_prefix = f"{self.prefix}/members/"
        self._presence: int | None = None  # the lease of this replica's members/ key
        self._orphaned_since: float | None = None  # since when every in-sync replica was seen replaced
        self.restored = restored  # (epoch, version) of the checkpoint this process started from
        self.replicas = tuple(replicas)
        self.record = EpochRecord(None) if record is None else record
        self.held = held or (lambda: restored)
        self._alive: dict[tuple[str, str], Report] = {}  # members/ as last read
        self._reported: Report | None = None  # this replica's members/ value as last written
        self._primary_known = False  # whether the last read of the primary key found one
        self.won_with: list[tuple[str, str]] = []  # the in-sync list of this replica's last win
        self.unavailable = Unavailable(me.name, self.prefix)  # why nobody may campaign, if so

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
        listed, listed_revision, base = self._read_in_sync()
        unclean = listed is not None and self.me.identity not in listed
        if listed is None:
            verdict = self._judge()
            if not self._may_recover(verdict):
                return None
            base = verdict.floor  # every replica's highest epoch seen: the new one is above them all
        else:
            self.unavailable.clear()
            if unclean and (not self._orphaned(listed) or self._newer_elsewhere()):
                return None
        sent_at = time.monotonic()  # the lease's clock starts no earlier than its grant was sent
        lease_id = self._etcd.grant(self._ttl)
        value = json.dumps({**json.loads(self.me.to_json()), "base": base}, sort_keys=True)
        members = listed if listed is not None and not unclean else [self.me.identity]
        txn = {
            # Nobody holds it, and the in-sync list is the one read above (still absent, or still
            # naming this replica): both checked where they are decided, in one transaction. The
            # list is written again with the base the epoch is counted from (the next primary's).
            "compare": [
                {"key": _b64(self.primary_key), "target": "CREATE", "result": "EQUAL", "create_revision": 0},
                {"key": _b64(self.in_sync_key), "target": "MOD", "result": "EQUAL", "mod_revision": listed_revision},
            ],
            "success": [
                {"request_put": {"key": _b64(self.primary_key), "value": _b64(value), "lease": lease_id}},
                {"request_put": {"key": _b64(self.in_sync_key), "value": _b64(_in_sync_value(base, members))}},
            ],
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
        revision = int(response["header"]["revision"])  # the transaction's revision: the key's create_revision
        won = _Term(revision + base, lease_id, revision, base)
        epoch = won.epoch
        try:
            self.record.raise_to(epoch)  # on disk before anything acts on the epoch
        except EpochRecordError as error:
            log.error("%s: gives up epoch %d of %s: %s", self.me.name, epoch, self.prefix, error)
            self._revoke_quietly(lease_id)
            return None
        with self._lock:
            self._holds_until = sent_at + self.lease_seconds * HOLD_FRACTION
            self._term = won
            self.won_with = list(members)
        if not self.holds():  # the transaction took longer than the lease can be trusted
            self._demote(won, "the campaign's answer came too late")
            return None
        if unclean:
            log.error(
                "%s: primary of %s, epoch %d, though not in sync: every replica that held every "
                "acknowledged commit was restarted at least %d leases ago (%s); this one holds the newest "
                "state of those alive (epoch %d, version %d): commits acknowledged after it are lost",
                self.me.name, self.prefix, epoch, ORPHANED_LEASES, ", ".join(name for name, _ in listed or []),
                *self.held(),
            )  # fmt: skip
        elif listed is None and base > 0:
            log.warning(
                "%s: primary of %s, epoch %d: etcd had lost the in-sync list; every replica reported, and "
                "this one holds the newest state (epoch %d, version %d)",
                self.me.name, self.prefix, epoch, *self.held(),
            )  # fmt: skip
        else:
            log.info("%s: primary of %s, epoch %d", self.me.name, self.prefix, epoch)
        return epoch

    def saw(self, epoch: int) -> None:
        """Another replica is primary at `epoch`: recorded (on disk) before this one follows it.
        EpochRecordError when the disk refuses (then it must not follow)."""
        self.record.raise_to(epoch)

    def announce(self) -> None:
        """Say this replica is alive, and what it holds: its members/ key (a `Report`), bound to a
        lease of its own, kept, and written again when the report changed. While a primary is
        known a backup's state is not re-reported (an older report of it is a state it held, which
        is what the rule needs, and a put per tick per backup would load etcd for nothing)."""
        report = self._report()
        if self._presence is not None:
            presence = self._presence
            if self._call("presence keep-alive", lambda client: Lease(presence, client).refresh()) > 0:
                if report == self._reported:
                    return
            else:
                self._presence = None  # expired, or etcd lost it: a new lease
        lease_id = self._presence or self._etcd.grant(self._ttl)
        key = self.members_prefix + self.me.name
        self._call("presence", lambda client: client.put(key, report.to_json(), lease=Lease(lease_id, client)))
        self._presence, self._reported = lease_id, report

    def _report(self) -> Report:
        """This replica's report now: no state while it holds a lease (it may be acknowledging)."""
        held: Held | None = None
        if self._term is None:
            last = self._reported
            keep = self._primary_known and last is not None and last.held is not None
            held = last.held if keep and last is not None else self.held()
        return Report(self.me.name, self.me.incarnation, self.record.seen, held)

    def announced(self) -> set[tuple[str, str]]:  # every replica's with a live members/ key (a read)
        return {report.identity for report in self._read_reports().values()}

    def _read_reports(self) -> dict[str, Report]:
        """The members/ keys by name, and this replica's own report as it is now."""
        reports = {
            name: Report.from_json(name, value)
            for value, metadata in self._call("read", lambda client: client.get_prefix(self.members_prefix))
            for name in [metadata["key"].decode().removeprefix(self.members_prefix)]
        }
        reports[self.me.name] = Report(self.me.name, self.me.incarnation, self.record.seen, self.held())
        self._alive = {report.identity: report for report in reports.values()}
        return reports

    def _judge(self) -> Verdict:
        return judge(self.replicas, self._read_reports(), self.record.seen, self.held())

    def _may_recover(self, verdict: Verdict) -> bool:
        """Without an in-sync list: whether this replica may campaign (else `unavailable` says why)."""
        if verdict.missing:
            self.unavailable.waiting_for(verdict.missing, loud=self.record.seen > 0)
            return False
        self.unavailable.clear()
        return verdict.allows(self.held())

    def _orphaned(self, listed: list[tuple[str, str]]) -> bool:
        """Whether every in-sync replica has been replaced by a live process of its name, for
        ORPHANED_LEASES leases. Silence is not enough: a paused primary's presence key expires too."""
        self._read_reports()
        live = dict(self._alive.keys())  # name -> incarnation of the live process of that name
        if not all(name in live and live[name] != incarnation for name, incarnation in listed):
            self._orphaned_since = None
            return False
        now = time.monotonic()
        self._orphaned_since = self._orphaned_since or now
        return now - self._orphaned_since >= ORPHANED_LEASES * self.lease_seconds

    def _newer_elsewhere(self) -> bool:
        """Whether another live replica (as `_orphaned` last read them) holds a newer state than
        this one, by (epoch, version): that one should take over, not this one."""
        mine = self.held()
        return any(
            report.held is None or report.held > mine
            for identity, report in self._alive.items()
            if identity != self.me.identity
        )

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
        if holder != term.revision:  # deleted or re-created by someone else (an operator): not ours any more
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
        put = {"request_put": {"key": _b64(self.in_sync_key), "value": _b64(_in_sync_value(term.base, pairs))}}
        response = self._call("in-sync write", lambda client: client.transaction(self._fenced(term, put)))
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
        delete = {"request_delete_range": {"key": _b64(self.primary_key)}}
        self._call("resign", lambda client: client.transaction(self._fenced(term, delete)))
        self._revoke_quietly(term.lease_id)  # the key is gone; an already expired lease is no error here

    def withdraw(self) -> None:  # this replica is stopping: its members/ key goes (its lease revoked)
        if self._presence is not None:
            self._revoke_quietly(self._presence)
            self._presence = None

    def close(self) -> None:  # the HTTP connections (does not resign)
        self._etcd.close()

    # -- what etcd holds ----------------------------------------------------------------------------

    def primary(self) -> tuple[Member, int] | None:
        """The current primary and its epoch; None when there is none."""
        found = self._call("read", lambda client: client.get(self.primary_key, metadata=True))
        self._primary_known = bool(found)
        if not found:
            return None
        self.unavailable.clear()
        value, metadata = found[0]
        try:
            return Member.from_json(value), int(metadata["create_revision"]) + int(json.loads(value).get("base", 0))
        except (ValueError, KeyError, TypeError, AttributeError) as error:
            raise CoordinationUnavailable(f"malformed {self.primary_key}: {value!r}") from error

    def in_sync(self) -> list[tuple[str, str]] | None:
        """The in-sync list as (name, incarnation) pairs; None when the key is absent (a fresh job,
        or etcd lost its data)."""
        return self._read_in_sync()[0]

    def _read_in_sync(self) -> tuple[list[tuple[str, str]] | None, int, int]:
        """The in-sync list, the key's mod_revision (0 when absent) and the epochs' base."""
        found = self._call("read", lambda client: client.get(self.in_sync_key, metadata=True))
        if not found:
            return None, 0, 0
        value, metadata = found[0]
        try:
            fields = json.loads(value)
            if isinstance(fields, list):  # as written before epochs had a base
                fields = {"base": 0, "members": fields}
            listed = [(str(name), str(incarnation)) for name, incarnation in fields["members"]]
            return listed, int(metadata["mod_revision"]), int(fields["base"])
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

    def _fenced(self, term: _Term, operation: Mapping[str, object]) -> dict[str, object]:
        """A transaction doing `operation` only while the primary key is still `term`'s."""
        compare = {
            "key": _b64(self.primary_key),
            "target": "CREATE",
            "result": "EQUAL",
            "create_revision": term.revision,
        }
        return {"compare": [compare], "success": [operation], "failure": []}

    def _revoke_quietly(self, lease_id: int) -> None:
        with contextlib.suppress(CoordinationUnavailable):  # unreachable: the lease runs out on its own
            self._call("lease revoke", lambda client: Lease(lease_id, client).revoke())

    def _call(self, what: str, request: Callable[[Etcd3Client], T]) -> T:
        return self._etcd.call(what, request)
