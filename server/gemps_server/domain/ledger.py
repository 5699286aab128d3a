"""Commit deduplication: the outcome of each client's last commit, by its client-chosen request id.

A client that lost a Commit's reply (the server crashed, paused, or the deadline passed) sends
the same commit again with the same `request_id`. When the first one was applied, the server
must not apply it again: it answers with the recorded outcome instead.

Request ids are unique per client, not globally: two clients may well both count `step-1`,
`step-2`, ... So a receipt belongs to a *scope*: the client's `client_id` (sent at Register,
the same for every registration of one client process, so a retry is recognised after the
client registered again: lease expiry, server restart), or, for a client that sends none, its
worker id (a retry is then recognised only within that registration).

Each scope has at most one commit in flight, but the network may still hold an old attempt of an
earlier one: a request sitting in TCP retransmission behind a cut cable arrives after its retry
succeeded and after later commits of the same client. Its request id is no longer the scope's
last, so request ids alone cannot tell it from a new commit. Clients therefore number their
commits (`sequence`: 1, 2, ... per client, the same on every attempt): a commit numbered at or
below the scope's last applied number is such a late attempt, and is refused (`superseded`).
Remembering each scope's last commit and the highest number applied is then enough, whatever
order the network delivers attempts in. Unnumbered commits (sequence 0, clients that do not
count) are deduplicated by their last request id only. A scope without a registered worker keeps
its last receipt in a bounded FIFO (it may be retrying from a new registration). The ledger
lives on the applier thread, like the rest of the state, and goes into checkpoints so that a
retry across a server restart is recognised too.

Checkpoints written before scopes existed hold receipts by request id alone: they are restored
under the empty scope and match a retry from any client (as they did when written).
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from dataclasses import dataclass

from gemps_server.domain.rules import ApplyStats

# Longest request id accepted: ids are opaque, and this bounds the ledger's memory.
MAX_REQUEST_ID_LENGTH = 128
# Longest client id accepted (printable ASCII without spaces: it never holds KEY_SEPARATOR).
MAX_CLIENT_ID_LENGTH = 128
# A receipt's key in checkpoints: scope, separator, request id ("" scope: written before scopes).
KEY_SEPARATOR = "\n"
LEGACY_SCOPE = ""


def valid_client_id(client_id: str) -> bool:
    """At most MAX_CLIENT_ID_LENGTH visible ASCII characters (empty: none given)."""
    return len(client_id) <= MAX_CLIENT_ID_LENGTH and all(33 <= ord(c) <= 126 for c in client_id)


def receipt_key(scope: str, request_id: str) -> str:
    return f"{scope}{KEY_SEPARATOR}{request_id}"


def split_key(key: str) -> tuple[str, str]:
    """(scope, request id) of a receipt_key (the scope never holds the separator)."""
    scope, separator, request_id = key.partition(KEY_SEPARATOR)
    if not separator:
        raise ValueError(f"receipt key {key[:40]!r} names no scope")
    return scope, request_id


@dataclass(frozen=True)
class Receipt:
    """What a commit did: the version it produced, its staleness and how it was scaled, and its
    place among its client's commits (0: unnumbered)."""

    version: int
    staleness: int
    stats: ApplyStats
    sequence: int = 0

    def to_list(self) -> list[float]:
        s = self.stats
        scaling = [s.scaling_mean, s.scaling_median, s.fraction_at_zero, s.fraction_at_max]
        return [self.version, self.staleness, *scaling, self.sequence]

    @classmethod
    def from_list(cls, values: list[float]) -> Receipt:
        """Seven numbers; six in checkpoints written before commits were numbered (sequence 0)."""
        if len(values) not in (6, 7):
            raise ValueError(f"a receipt has 6 or 7 numbers, not {len(values)}")
        version, staleness, mean, median, zero, at_max, *numbered = values
        sequence = numbered[0] if numbered else 0
        counts = (version, staleness, sequence)
        if any(int(count) != count or count < 0 for count in counts):
            raise ValueError(f"bad receipt version/staleness/sequence {version!r}, {staleness!r}, {sequence!r}")
        stats = ApplyStats(float(mean), float(median), float(zero), float(at_max))
        return cls(int(version), int(staleness), stats, int(sequence))


@dataclass(frozen=True)
class LedgerImage:
    """A ledger's whole content in its order, for a replica (CommitLedger.export and adopt):
    each scope's last request id and receipt, the scopes without a registered worker (oldest
    first), and the receipts of old checkpoints by request id (oldest first)."""

    last: tuple[tuple[str, str, Receipt], ...] = ()  # (scope, request id, receipt)
    departed: tuple[str, ...] = ()
    legacy: tuple[tuple[str, Receipt], ...] = ()  # (request id, receipt)


class CommitLedger:
    """The receipt of each active scope's last commit, plus the last receipts of up to `capacity`
    scopes without a registered worker (and those restored from a checkpoint), oldest dropped first."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._last: dict[str, tuple[str, Receipt]] = {}  # scope -> (its last request id, receipt)
        self._departed: OrderedDict[str, None] = OrderedDict()  # scopes with no registered worker
        self._legacy: OrderedDict[str, Receipt] = OrderedDict()  # request id -> receipt, from old checkpoints

    def __len__(self) -> int:
        return len(self._last) + len(self._legacy)

    def lookup(self, scope: str, request_id: str) -> Receipt | None:
        if not request_id:
            return None
        found = self._last.get(scope)
        if found is not None and found[0] == request_id:
            return found[1]
        return self._legacy.get(request_id)

    def superseded(self, scope: str, sequence: int) -> int | None:
        """The highest number applied for `scope` when a commit numbered `sequence` (not found by
        `lookup`) is a late attempt its client has moved past; None when it may be applied."""
        found = self._last.get(scope)
        if not sequence or found is None or sequence > found[1].sequence:
            return None
        return found[1].sequence

    def last_version(self, scope: str) -> int | None:
        """The version `scope`'s last commit produced (None: none is held for it)."""
        found = self._last.get(scope)
        return None if found is None else found[1].version

    def record(self, scope: str, request_id: str, receipt: Receipt) -> None:
        if not request_id:
            return
        previous = self._last.get(scope)
        if previous is not None and previous[1].sequence > receipt.sequence:  # an unnumbered commit
            receipt = dataclasses.replace(receipt, sequence=previous[1].sequence)  # keeps the mark
        self._last[scope] = (request_id, receipt)
        self._departed.pop(scope, None)

    def activate(self, scope: str) -> None:
        """A worker of `scope` registered: its receipt is kept for as long as it stays."""
        self._departed.pop(scope, None)

    def depart(self, scope: str) -> None:
        """The scope's worker left or was evicted: keep its last receipt among the departed ones."""
        if scope in self._last:
            self._keep_departed(scope)

    def entries(self) -> dict[str, Receipt]:
        """Every receipt held, by receipt_key (for checkpoints)."""
        found = {receipt_key(LEGACY_SCOPE, request_id): receipt for request_id, receipt in self._legacy.items()}
        found.update({receipt_key(scope, request_id): receipt for scope, (request_id, receipt) in self._last.items()})
        return found

    def restore(self, receipts: dict[str, Receipt]) -> None:
        """Receipts from a checkpoint, by receipt_key: their workers are gone, so they count as departed."""
        for key, receipt in receipts.items():
            scope, request_id = split_key(key)
            if scope == LEGACY_SCOPE:
                self._legacy[request_id] = receipt
                while len(self._legacy) > self.capacity:
                    self._legacy.popitem(last=False)
                continue
            self._last[scope] = (request_id, receipt)
            self._keep_departed(scope)

    def export(self) -> LedgerImage:
        """Everything held, in order (for a replica: `adopt` rebuilds this ledger from it)."""
        return LedgerImage(
            tuple((scope, request_id, receipt) for scope, (request_id, receipt) in self._last.items()),
            tuple(self._departed),
            tuple(self._legacy.items()),
        )

    def adopt(self, image: LedgerImage) -> None:
        """Replace everything held by `image`'s; a ValueError naming the problem, with nothing
        changed, when it is inconsistent or holds more than `capacity` departed or legacy scopes."""
        scopes = [scope for scope, _, _ in image.last]
        legacy = [request_id for request_id, _ in image.legacy]
        if len(set(scopes)) != len(scopes) or len(set(image.departed)) != len(image.departed):
            raise ValueError("a scope appears twice in the ledger")
        if len(set(legacy)) != len(legacy) or not all(request_id for _, request_id, _ in image.last) or not all(legacy):
            raise ValueError("ledger request ids must be distinct within their scope and not empty")
        if not set(image.departed) <= set(scopes):
            raise ValueError("a departed scope has no receipt in the ledger")
        if max(len(image.departed), len(image.legacy)) > self.capacity:
            raise ValueError(f"more departed or legacy receipts than this ledger's capacity {self.capacity}")
        self._last = {scope: (request_id, receipt) for scope, request_id, receipt in image.last}
        self._departed = OrderedDict.fromkeys(image.departed)
        self._legacy = OrderedDict(image.legacy)

    def _keep_departed(self, scope: str) -> None:
        self._departed[scope] = None
        self._departed.move_to_end(scope)
        while len(self._departed) > self.capacity:
            oldest, _ = self._departed.popitem(last=False)
            self._last.pop(oldest, None)
