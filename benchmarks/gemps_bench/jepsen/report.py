"""Many trials' verdicts (gemps_bench.jepsen.trial) summed up: totals, recovery by fault, a table.

A trial with a second job has a verdict per job (job A's as `verdict`, job B's in `second_job`):
its counts are both jobs' summed, and it is clean when both are."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from gemps_bench.jepsen.plan import FIRST_JOB, SECOND_JOB

SHORT = {"kill": "K", "pause": "P", "part": "X", "part-etcd": "Xe", "slow": "S", "wipe": "W"}  # + p/b/e: the role
#: "wrong θ": commits in a job's θ that its own workers cannot account for; "elsewhere":
#: acknowledgements a job's workers had from another job's server (check.py's docstring)
COLUMNS = ("seed", "R", "faults", "acked", "lost", "twice", "wrong θ", "elsewhere", "2 prim.", "reused", "wedged",
           "recov. max s", "ok")  # fmt: skip


def verdicts(trial: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    """A trial's verdicts by job: job A's, and the second job's when it ran one (none: a rig error)."""
    found = {FIRST_JOB: trial["verdict"]} if trial.get("verdict") else {}
    second = trial.get("second_job", {}).get("verdict")
    return {**found, SECOND_JOB: second} if found and second else found


def clean(trial: Mapping[str, Any]) -> bool:
    """Whether the trial ran and every job's verdict found nothing violated."""
    found = verdicts(trial)
    return bool(found) and all(verdict["ok"] for verdict in found.values())


def summary(trial: Mapping[str, Any]) -> str:
    """The trial's verdict in a line per job: what was violated, "wrong θ" said as such."""
    lines = []
    for job, v in verdicts(trial).items():
        said = [f"{v['acknowledged']} acknowledged", f"{v['lost']} lost", f"{v['applied_twice']} applied twice"]
        if v.get("wrong_theta"):
            said.append(f"WRONG θ: {v['wrong_theta']} commits more than its workers could account for")
        if v.get("acknowledged_elsewhere"):
            said.append(f"WRONG θ: {v['acknowledged_elsewhere']} acknowledged by another job's server")
        epochs = v["epochs"]
        said += [f"two primaries under {list(epochs['two_primaries'])}", f"epochs reused {epochs['reused']}",
                 f"{len(v['wedged'])} waits wedged"]  # fmt: skip
        lines.append(f"{'job ' + job + ': ' if len(verdicts(trial)) > 1 else ''}{'ok' if v['ok'] else 'VIOLATION'}: "
                     + ", ".join(said))  # fmt: skip
    return "; ".join(lines)


def totals(trials: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Sums over the trials (every job's), and how many trials saw each violation."""
    ran = [trial for trial in trials if verdicts(trial)]
    found: dict[str, Any] = {"trials": len(trials), "ok": sum(clean(trial) for trial in ran)}
    found["rig_errors"] = len(trials) - len(ran)
    found["acknowledged"] = sum(v["acknowledged"] for trial in ran for v in verdicts(trial).values())
    counts: dict[str, Callable[[Mapping[str, Any]], int]] = {
        "lost": lambda v: v["lost"],
        "applied_twice": lambda v: v["applied_twice"],
        "wrong_theta": lambda v: v.get("wrong_theta", 0),
        "acknowledged_elsewhere": lambda v: v.get("acknowledged_elsewhere", 0),
        "two_primaries": lambda v: len(v["epochs"]["two_primaries"]),
        "stale_acks": lambda v: len(v["epochs"]["stale_acks"]),
        "epochs_reused": lambda v: len(v["epochs"]["reused"]),
        "wedged_waits": lambda v: len(v["wedged"]),
    }
    for name, count in counts.items():
        found[name] = sum(count(v) for trial in ran for v in verdicts(trial).values())
        found[f"trials_with_{name}"] = sum(any(count(v) > 0 for v in verdicts(trial).values()) for trial in ran)
    found["recovery_by_fault"] = recovery_by_fault(trials)
    if any(SECOND_JOB in verdicts(trial) for trial in ran):
        found["second_job_recovery_by_fault"] = recovery_by_fault(trials, SECOND_JOB)
    return found


def recovery_by_fault(trials: Sequence[Mapping[str, Any]], job: str = FIRST_JOB) -> dict[str, dict[str, Any]]:
    """Per fault kind: seconds until every worker of job `job` was acknowledged again, once a safe
    primary existed (median, max), and how often they never were."""
    seen: dict[str, list[float | None]] = {}
    for verdict in (verdicts(trial).get(job) for trial in trials):
        for entry in verdict["recovery"] if verdict else ():
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
    """One line per trial (both jobs' counts summed), then the totals; then recovery by fault kind."""
    rows: list[tuple[str, ...]] = [COLUMNS]
    for trial in trials:
        found = list(verdicts(trial).values())
        if not found:  # the trial itself failed (the rig, not the servers)
            error = "rig error: " + str(trial.get("error", ""))[:40]
            rows.append((str(trial["seed"]), str(trial["replicas"]), error, *[""] * (len(COLUMNS) - 3)))
            continue
        recovery = [r for v in found for r in v["recovery"]]
        recoveries = [r["resumed_s"] for r in recovery if r["resumed_s"] is not None]
        never = sum(r["resumed_s"] is None and r["safe_after_s"] is not None for r in recovery)
        kinds = ",".join(_short(f) for f in trial["faults"] if f.get("host"))
        counts = [sum(count(v) for v in found) for count in (
            lambda v: v["acknowledged"], lambda v: v["lost"], lambda v: v["applied_twice"],
            lambda v: v.get("wrong_theta", 0), lambda v: v.get("acknowledged_elsewhere", 0),
            lambda v: len(v["epochs"]["two_primaries"]), lambda v: len(v["epochs"]["reused"]),
            lambda v: len(v["wedged"]),
        )]  # fmt: skip
        rows.append((
            str(trial["seed"]), str(trial["replicas"]), kinds, *map(str, counts),
            f"{max(recoveries, default=0.0):.1f}" + (f" ({never} never)" if never else ""),
            "yes" if clean(trial) else "NO",
        ))  # fmt: skip
    t = totals(trials)
    rows.append((
        "all", "", f"{t['trials']} trials", str(t["acknowledged"]), str(t["lost"]), str(t["applied_twice"]),
        str(t["wrong_theta"]), str(t["acknowledged_elsewhere"]), str(t["two_primaries"]), str(t["epochs_reused"]),
        str(t["wedged_waits"]), "", f"{t['ok']}/{t['trials']}",
    ))  # fmt: skip
    lines = [_aligned(rows)]
    for key, whose in (("recovery_by_fault", "job A's workers"), ("second_job_recovery_by_fault", "job B's workers")):
        if key in t:
            lines += ["", f"recovery once a safe primary existed (s), {whose}:"]
            by_fault: list[tuple[str, ...]] = [("fault", "faults", "median", "max", "never")]
            for kind, r in t[key].items():
                by_fault.append((kind, str(r["faults"]), str(r["median_s"]), str(r["max_s"]), str(r["never"])))
            lines.append(_aligned(by_fault))
    return "\n".join(lines)


def _short(fault: Mapping[str, Any]) -> str:
    """A fault in the table: Kp is kill:primary, KpB the second job's."""
    job = fault.get("job", FIRST_JOB)
    return f"{SHORT[fault['kind']]}{fault['role'][0]}" + ("" if job == FIRST_JOB else job)


def _aligned(rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)) for row in rows)
