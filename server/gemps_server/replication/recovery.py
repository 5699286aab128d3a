"""What the replicas report of themselves in etcd, and who may become primary when etcd cannot say
who holds every acknowledged commit (docs/DESIGN.md §3d, "when etcd loses its data").

Each live replica keeps a presence key (`members/<name>`, bound to a lease of its own) holding a
`Report`: its incarnation, the highest epoch it has seen (its EpochRecord), and the (epoch,
version) of the state it holds: the epoch of the primary whose journal its state follows (a
backup not yet seeded by a new primary still holds its previous one's), and the commits applied.
A replica that holds a primary's lease reports no state (`held` None): it may still acknowledge.

`judge` is the rule for a partition without an in-sync list in etcd (a fresh job, or etcd
restarted empty): only once every one of the R replicas reports a state may the one holding the
newest, by (epoch, version), campaign. Why that one holds every acknowledged commit: DESIGN §3d.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

log = logging.getLogger("gemps.server")

#: seconds between two ERROR lines saying a partition waits for replicas to report
UNAVAILABLE_LOG_SECONDS = 30.0

#: a state by (epoch, version): the epoch first (an old primary's commits past the new primary's
#: version were never acknowledged)
Held = tuple[int, int]


@dataclass(frozen=True)
class Report:
    """One replica's presence key, read back."""

    name: str
    incarnation: str
    seen: int  # the highest epoch it has seen
    held: Held | None  # the state it holds; None while it may be acknowledging as primary

    def to_json(self) -> str:
        fields: dict[str, object] = {"incarnation": self.incarnation, "seen": self.seen}
        if self.held is not None:
            fields["epoch"], fields["version"] = self.held
        return json.dumps(fields, sort_keys=True)

    @classmethod
    def from_json(cls, name: str, raw: bytes) -> Report:
        """A presence key's report; a value that is not one (a bare incarnation, a garbled record)
        reports no state."""
        try:
            fields = json.loads(raw)
            incarnation = str(fields["incarnation"])
        except (ValueError, KeyError, TypeError):
            return cls(name, raw.decode(errors="replace"), 0, None)
        try:
            held: Held | None = (int(fields["epoch"]), int(fields["version"]))
        except (KeyError, TypeError, ValueError):
            held = None
        try:
            seen = int(fields.get("seen", held[0] if held else 0))
        except (TypeError, ValueError):
            seen = 0
        return cls(name, incarnation, max(seen, held[0] if held else 0), held)

    @property
    def identity(self) -> tuple[str, str]:
        return (self.name, self.incarnation)


@dataclass(frozen=True)
class Verdict:
    """What the reports of a partition without an in-sync list allow."""

    missing: tuple[str, ...]  # replicas with no state reported: absent, or still holding a lease
    newest: Held  # the newest state reported (by every replica when none is missing)
    floor: int  # the highest epoch any reporting replica has seen

    def allows(self, mine: Held) -> bool:
        """Whether a replica holding `mine` may campaign: every replica reported, and none holds a
        newer state (several may, when tied: etcd lets one win)."""
        return not self.missing and mine >= self.newest


def judge(replicas: Iterable[str], reports: Mapping[str, Report], seen: int, mine: Held) -> Verdict:
    """The verdict for a replica that has seen epoch `seen` and holds `mine`, given the presence
    `reports` by name and the partition's replica names (all R of them)."""
    missing = tuple(name for name in replicas if name not in reports or reports[name].held is None)
    held = [report.held for report in reports.values() if report.held is not None]
    return Verdict(
        missing=missing,
        newest=max([mine, *held]),
        floor=max([seen, *(report.seen for report in reports.values())]),
    )


def replica_names(partition: int, replicas: int) -> tuple[str, ...]:
    """The names of a partition's R replicas (each process's Member.name)."""
    return tuple(f"partition-{partition}-replica-{index}" for index in range(replicas))


class Unavailable:
    """Why a partition without an in-sync list has no primary yet, as one replica sees it: `reason`
    ("" when nothing stops an election), and an ERROR line naming the missing replicas at most
    every UNAVAILABLE_LOG_SECONDS."""

    def __init__(self, replica: str, partition: str) -> None:
        self.replica, self.partition = replica, partition
        self.reason = ""
        self.missing: tuple[str, ...] = ()
        self._logged = -math.inf  # time.monotonic() of the last ERROR line

    def waiting_for(self, missing: tuple[str, ...], loud: bool) -> None:
        """Nobody may campaign until `missing` report; `loud`: etcd lost its data (an ERROR line;
        a fresh job waiting for its replicas to start is no error)."""
        self.missing = missing
        self.reason = (
            "no primary: etcd holds no in-sync list (a fresh job, or etcd lost its data), and a primary is "
            "chosen only once every replica reports what it holds; waiting for " + ", ".join(missing)
        )
        now = time.monotonic()
        if loud and now - self._logged >= UNAVAILABLE_LOG_SECONDS:
            self._logged = now
            log.error("%s: partition %s unavailable: %s", self.replica, self.partition, self.reason)

    def clear(self) -> None:
        if self.reason:
            log.info("%s: %s may elect a primary again", self.replica, self.partition)
        self.reason, self.missing = "", ()
