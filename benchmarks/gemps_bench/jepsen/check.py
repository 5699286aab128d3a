"""The checker: what the workers were told (gemps_bench.jepsen.client's histories) against what
the replicas hold and said (the primary's θ, the monitor's views, the replicas' logs).

- **lost**: acknowledged commits missing from the final primary's θ (acknowledged - applied, when
  positive); **applied twice**: applied - (acknowledged + in doubt), when positive. Every commit
  adds 1 to θ, so θ's range must also equal the version. Every commit that ended in an error is in
  doubt, refusals too (one may answer the retry of an attempt that was applied), so a worker
  refused over and over hides commits applied twice: that count is a lower bound.
- **wrong θ** (a trial with a second job, issue 77 item 1): the job's θ holds more commits than
  its own workers could account for (applied - (acknowledged + in doubt), when positive: the
  count cannot tell another job's commits from this job's applied twice, so both are reported),
  and **acknowledged elsewhere**: acknowledgements this job's workers had from a server that is
  not one of its replicas (the other job's, on their replica list): commits in the wrong θ.
- **two primaries under one epoch**: an epoch under which two replicas acknowledged commits (from
  the histories), logged becoming primary, or said they were primary (Status, as the monitor saw);
  **stale acknowledgements**: a worker acknowledged under an epoch older than one it had already
  been acknowledged under.
- **epochs reused**: an epoch some replica logged becoming primary under more than once, or after
  a newer one (after etcd lost its data its revisions start again).
- **recovery** after each fault: from the first moment after it began when a safe primary existed
  to when every worker was acknowledged again (the end of its longest wait under way within
  EFFECT seconds of that moment). A safe primary exists while etcd is up and reachable (not killed, paused or
  parted) and some replica the last primary seen listed as in sync (or that primary) is up and
  reachable: one that holds every acknowledged commit could take over.
- **wedged**: a worker that waited more than `wedge_after` seconds, counted only while a safe
  primary existed, for an acknowledgement.
"""

from __future__ import annotations

import json
import math
from collections.abc import Collection, Iterable, Mapping, Sequence
from datetime import datetime
from typing import Any

from gemps_bench.jepsen.plan import FIRST_JOB

GRID = 0.1  # seconds: the resolution safety is computed at
EFFECT = 1.0  # seconds: a fault shows in the workers' waits within this
#: faults that take a replica (or etcd) out of reach while they last; `slow` does not
DISABLING = frozenset({"kill", "pause", "part", "part-etcd"})


def promotions(logs: Mapping[str, str]) -> list[dict[str, Any]]:
    """Each time a replica logged becoming primary: {"t", "host", "epoch"}, in time order (the
    servers log JSON lines: `--log-format json`)."""
    found: list[dict[str, Any]] = []
    for host, text in logs.items():
        for line in text.splitlines():
            if not line.startswith("{") or '"primary"' not in line:
                continue
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if record.get("event") == "primary":
                stamp = datetime.fromisoformat(record["time"].replace("Z", "+00:00")).timestamp()
                found.append({"t": stamp, "host": host, "epoch": int(record["epoch"])})
    return sorted(found, key=lambda promotion: promotion["t"])


def label(fault: Mapping[str, Any]) -> str:
    """A fault's `kind:role`, `@B` when it hit the second job's replicas (plan.Step.label)."""
    job = fault.get("job", FIRST_JOB)
    return f"{fault['kind']}:{fault['role']}" + ("" if job == FIRST_JOB else f"@{job}")


class Safety:
    """When a safe primary existed (see the module's docstring), on a GRID-second grid."""

    def __init__(self, faults: Sequence[Mapping[str, Any]], timeline: Sequence[Mapping[str, Any]],
                 hosts: Mapping[str, str], start: float, end: float) -> None:  # fmt: skip
        self.start, self.end = start, end
        self.faults = [f for f in faults if f.get("host")]
        names = {v["name"]: target for line in timeline for target, v in line["views"].items() if v and "name" in v}
        in_sync: list[tuple[float, set[str]]] = []  # (time, hosts in sync), as the primary said
        for line in timeline:
            primaries = [v for v in line["views"].values() if v and v.get("role") == "primary"]
            if primaries:
                newest = max(primaries, key=lambda v: int(v["epoch"]))
                listed = [newest["name"], *(b[0] for b in newest["backups"] if b[1])]
                in_sync.append((float(line["t"]), {hosts[names[n]] for n in listed if n in names}))
        every = set(hosts.values())
        self.safe = [self._safe_at(start + i * GRID, in_sync, every) for i in range(self._index(end) + 1)]

    def _index(self, at: float) -> int:
        """The first grid point at or after `at`."""
        return max(0, math.ceil((at - self.start) / GRID - 1e-9))

    def _safe_at(self, now: float, in_sync: list[tuple[float, set[str]]], every: set[str]) -> bool:
        down = {f["host"] for f in self.faults if f["kind"] in DISABLING and f["start"] <= now < f["end"]}
        if "e" in down:
            return False
        listed = next((hosts for at, hosts in reversed(in_sync) if at <= now), every)
        return bool(listed - down)

    def first_safe(self, after: float) -> float | None:
        for i in range(self._index(after), len(self.safe)):
            if self.safe[i]:
                return self.start + i * GRID
        return None

    def safe_seconds(self, begin: float, until: float) -> float:
        first, last = self._index(begin), min(self._index(until), len(self.safe))
        return sum(self.safe[first:last]) * GRID


def _resumed(history: Mapping[str, Any], after: float) -> float | None:
    """Seconds from `after` until this worker was acknowledged again: the end of its longest wait
    under way within EFFECT seconds of `after` (a fault shows within that), however long it went on
    (through later faults too); 0 when it waited for none; None when it never was again."""
    if float(history["last_ack"]) < after:
        return None
    waits = [(end - start, end) for start, end in history["stalls"] if start < after + EFFECT and end > after]
    return max(0.0, max(waits)[1] - after) if waits else 0.0


def recovery(
    faults: Sequence[Mapping[str, Any]], histories: Sequence[Mapping[str, Any]], safety: Safety
) -> list[dict[str, Any]]:
    """Per applied fault: when a safe primary existed again, and seconds until every worker resumed."""
    applied = sorted((f for f in faults if f.get("host")), key=lambda f: f["start"])
    found = []
    for fault in applied:
        safe = safety.first_safe(fault["start"])
        entry: dict[str, Any] = {
            "fault": fault["id"],
            "kind": label(fault),
            "host": fault["host"],
        }
        if safe is None:
            found.append({**entry, "safe_after_s": None, "resumed_s": None})
            continue
        resumed = [_resumed(history, safe) for history in histories]
        worst = None if any(r is None for r in resumed) else max(r for r in resumed if r is not None)
        found.append({**entry, "safe_after_s": round(safe - fault["start"], 2), "resumed_s": _round(worst)})
    return found


def wedged(histories: Sequence[Mapping[str, Any]], safety: Safety, wedge_after: float) -> list[dict[str, Any]]:
    """Waits for an acknowledgement longer than `wedge_after` seconds of safe time."""
    found = []
    for index, history in enumerate(histories):
        waits = [*history["stalls"], [history["last_ack"] or history["started"], history["ended"]]]
        for begin, until in waits:
            safe = safety.safe_seconds(begin, until)
            if safe > wedge_after:
                found.append({"worker": index, "from": begin, "to": until, "safe_s": round(safe, 1)})
    return found


def primaries_seen(timeline: Sequence[Mapping[str, Any]], hosts: Mapping[str, str]) -> set[tuple[int, str]]:
    """Every (epoch, host) the monitor saw a replica say it was primary under."""
    return {
        (int(v["epoch"]), hosts[target])
        for line in timeline
        for target, v in line["views"].items()
        if v and v.get("role") == "primary"
    }


def epochs(
    histories: Sequence[Mapping[str, Any]],
    promoted: Sequence[Mapping[str, Any]],
    statuses: Iterable[tuple[int, str]] = (),
) -> dict[str, Any]:
    """Two primaries under one epoch (by acknowledgements, logs or Status), stale acknowledgements,
    epochs reused."""
    holders: dict[int, set[str]] = {}
    for epoch, host in statuses:
        holders.setdefault(epoch, set()).add(f"status {host}")
    stale: set[int] = set()
    for history in histories:
        newest = 0
        for epoch, replica, *_ in history["runs"]:
            holders.setdefault(int(epoch), set()).add(f"ack {replica}")
            if epoch < newest:
                stale.add(int(epoch))
            newest = max(newest, int(epoch))
    reused: set[int] = set()
    seen: list[int] = []
    for promotion in promoted:
        epoch = int(promotion["epoch"])
        if seen and epoch <= max(seen):
            reused.add(epoch)
        seen.append(epoch)
        holders.setdefault(epoch, set()).add(f"log {promotion['host']}")
    two = {}
    for epoch, who in holders.items():
        replicas = {name.split(" ", 1)[1] for name in who if name.startswith("ack")}
        hosts = {name.split(" ", 1)[1] for name in who if not name.startswith("ack")}
        if len(replicas) > 1 or len(hosts) > 1:
            two[str(epoch)] = sorted(who)
    return {"two_primaries": two, "stale_acks": sorted(stale), "reused": sorted(reused), "promotions": len(promoted)}


def check(
    histories: Sequence[Mapping[str, Any]],
    observed: Mapping[str, Any] | None,
    final_views: Mapping[str, Mapping[str, Any] | None],
    safety: Safety,
    faults: Sequence[Mapping[str, Any]],
    promoted: Sequence[Mapping[str, Any]],
    wedge_after: float = 10.0,
    statuses: Iterable[tuple[int, str]] = (),
    own: Collection[str] | None = None,
) -> dict[str, Any]:
    """The verdict of one trial, or of one of its jobs whose replicas are at `own` when another
    job ran beside it (see the module's docstring); "ok" when nothing was violated."""
    acknowledged = sum(int(h["acknowledged"]) for h in histories)
    in_doubt = sum(int(h["in_doubt"]) for h in histories)
    versions = {target: int(v["version"]) for target, v in final_views.items() if v}
    # No primary at the end: the best any replica holds bounds what was kept.
    applied = int(observed["version"]) if observed else max(versions.values(), default=0)
    theta_ok = observed is None or observed["theta_min"] == observed["theta_max"] == observed["version"]
    excess = max(0, applied - acknowledged - in_doubt)
    elsewhere = 0 if own is None else sum(run[4] for h in histories for run in h["runs"] if run[1] not in own)
    verdict: dict[str, Any] = {
        "acknowledged": acknowledged, "in_doubt": in_doubt, "applied": applied,
        "lost": max(0, acknowledged - applied), "applied_twice": excess,
        "wrong_theta": 0 if own is None else excess, "acknowledged_elsewhere": elsewhere,
        "theta_counts_commits": theta_ok, "primary_at_end": observed is not None, "final_versions": versions,
        "epochs": epochs(histories, promoted, statuses), "recovery": recovery(faults, histories, safety),
        "wedged": wedged(histories, safety, wedge_after),
        "errors": _merged([h["errors"] for h in histories]),
    }  # fmt: skip
    found = verdict["epochs"]
    verdict["ok"] = not (
        verdict["lost"] or excess or elsewhere or not theta_ok or found["two_primaries"]
        or found["stale_acks"] or found["reused"] or verdict["wedged"]
    )  # fmt: skip
    return verdict


def _merged(counts: Sequence[Mapping[str, int]]) -> dict[str, int]:
    total: dict[str, int] = {}
    for count in counts:
        for name, n in count.items():
            total[name] = total.get(name, 0) + n
    return total


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 2)
