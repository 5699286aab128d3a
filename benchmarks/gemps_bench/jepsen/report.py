"""Many trials' verdicts (gemps_bench.jepsen.trial) summed up: totals, recovery by fault, a table."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence
from typing import Any

SHORT = {"kill": "K", "pause": "P", "part": "X", "part-etcd": "Xe", "slow": "S", "wipe": "W"}  # + p/b/e: the role
COLUMNS = ("seed", "R", "faults", "acked", "lost", "twice", "2 prim.", "reused", "wedged", "recov. max s", "ok")


def _verdicts(trials: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    return [trial["verdict"] for trial in trials if trial.get("verdict")]


def totals(trials: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Sums over the trials, and how many trials saw each violation."""
    done = _verdicts(trials)
    found: dict[str, Any] = {"trials": len(trials), "ok": sum(bool(v["ok"]) for v in done)}
    found["rig_errors"] = len(trials) - len(done)
    found["acknowledged"] = sum(v["acknowledged"] for v in done)
    counts: dict[str, Callable[[Mapping[str, Any]], int]] = {
        "lost": lambda v: v["lost"],
        "applied_twice": lambda v: v["applied_twice"],
        "two_primaries": lambda v: len(v["epochs"]["two_primaries"]),
        "stale_acks": lambda v: len(v["epochs"]["stale_acks"]),
        "epochs_reused": lambda v: len(v["epochs"]["reused"]),
        "wedged_waits": lambda v: len(v["wedged"]),
    }
    for name, count in counts.items():
        found[name] = sum(count(v) for v in done)
        found[f"trials_with_{name}"] = sum(count(v) > 0 for v in done)
    found["recovery_by_fault"] = recovery_by_fault(trials)
    return found


def recovery_by_fault(trials: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per fault kind: seconds until every worker was acknowledged again, once a safe primary
    existed (median, max), and how often they never were."""
    seen: dict[str, list[float | None]] = {}
    for verdict in _verdicts(trials):
        for entry in verdict["recovery"]:
            if entry["safe_after_s"] is not None:
                seen.setdefault(entry["kind"], []).append(entry["resumed_s"])
    found = {}
    for kind, values in sorted(seen.items()):
        resumed = [value for value in values if value is not None]
        found[kind] = {
            "faults": len(values), "never": len(values) - len(resumed),
            "median_s": round(statistics.median(resumed), 2) if resumed else None,
            "max_s": round(max(resumed), 2) if resumed else None,
        }  # fmt: skip
    return found


def table(trials: Sequence[Mapping[str, Any]]) -> str:
    """One line per trial, then the totals; then recovery by fault kind."""
    rows: list[tuple[str, ...]] = [COLUMNS]
    for trial in trials:
        v = trial.get("verdict")
        if v is None:  # the trial itself failed (the rig, not the servers)
            error = "rig error: " + str(trial.get("error", ""))[:40]
            rows.append((str(trial["seed"]), str(trial["replicas"]), error, *[""] * (len(COLUMNS) - 3)))
            continue
        recoveries = [r["resumed_s"] for r in v["recovery"] if r["resumed_s"] is not None]
        never = sum(r["resumed_s"] is None and r["safe_after_s"] is not None for r in v["recovery"])
        kinds = ",".join(f"{SHORT[f['kind']]}{f['role'][0]}" for f in trial["faults"] if f.get("host"))
        rows.append((
            str(trial["seed"]), str(trial["replicas"]), kinds, str(v["acknowledged"]), str(v["lost"]),
            str(v["applied_twice"]), str(len(v["epochs"]["two_primaries"])), str(len(v["epochs"]["reused"])),
            str(len(v["wedged"])), f"{max(recoveries, default=0.0):.1f}" + (f" ({never} never)" if never else ""),
            "yes" if v["ok"] else "NO",
        ))  # fmt: skip
    t = totals(trials)
    rows.append((
        "all", "", f"{t['trials']} trials", str(t["acknowledged"]), str(t["lost"]), str(t["applied_twice"]),
        str(t["two_primaries"]), str(t["epochs_reused"]), str(t["wedged_waits"]), "", f"{t['ok']}/{t['trials']}",
    ))  # fmt: skip
    lines = [_aligned(rows), "", "recovery once a safe primary existed (s):"]
    by_fault: list[tuple[str, ...]] = [("fault", "faults", "median", "max", "never")]
    for kind, r in t["recovery_by_fault"].items():
        by_fault.append((kind, str(r["faults"]), str(r["median_s"]), str(r["max_s"]), str(r["never"])))
    return "\n".join([*lines, _aligned(by_fault)])


def _aligned(rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)) for row in rows)
