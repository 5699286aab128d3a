"""A run's figures, from its own logs: time to the held-out target, final held-out at the run's end
(equal wall time for every system), goodput, bytes on the wire per sample.

Goodput = worker-seconds whose work was applied / worker-seconds provisioned, where
- provisioned = workers x the run's wall time (every slot is paid for all along, running or not);
- a step's worker-seconds = the wall time from the previous line of the same process's progress
  log (its "start" for the first step) to this step's line, waits inside the step included (DDP's
  all-reduce waiting for a straggler counts as work applied: synchronous training pays for it in
  time to target, not here);
- applied: the step's samples were counted applied by the process (gemps: its commit was
  acknowledged, the samples of local steps once the commit covering them was; DDP: the all-reduce
  completed) and not lost afterwards: DDP's steps after the last checkpoint before a group
  restart (a process whose rank has a later one) are rolled back (torchrun restarts from the
  checkpoint) and not counted. Not detected:
  gemps commits lost to a server restarted from its last checkpoint (scenario e).
Lost: start-up and restarts, pauses (a step's seconds while its slot was stopped, from
events.json), killed processes' unapplied steps, rollbacks.

Recoveries: each worker kill's seconds to the rank's next process's start and first applied step
(`recoveries`): what a kill costs, apart from the rest of the run.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gemps_bench.alternatives.scenario import Scenario
from gemps_bench.alternatives.workloads import Workload


@dataclass
class Incarnation:
    """One process's lines of one rank's progress log, from its "start" to its last line."""

    rank: int
    lines: list[dict[str, Any]] = field(default_factory=list)

    @property
    def end(self) -> float:
        return float(self.lines[-1]["t"])


def incarnations(run_dir: Path) -> list[Incarnation]:
    """Every process's progress, split at each "start" line of each worker-R.jsonl."""
    found: list[Incarnation] = []
    for path in sorted(run_dir.glob("worker-*.jsonl")):
        current: Incarnation | None = None
        for text in path.read_text().splitlines():
            if not text.strip():
                continue
            line = json.loads(text)
            if line["event"] == "start" or current is None:
                current = Incarnation(int(line["rank"]))
                found.append(current)
            current.lines.append(line)
    return found


Pauses = list[tuple[float, float]]  # a slot's stopped spans (SIGSTOP to SIGCONT), wall times


def pauses(run_dir: Path) -> dict[int, Pauses]:
    """Each slot's stopped spans, from the faults the rig applied (events.json; a stop without
    its cont lasts to the end of the run)."""
    path = run_dir / "events.json"
    spans: dict[int, Pauses] = {}
    stopped: dict[int, float] = {}
    events = json.loads(path.read_text()) if path.exists() else []
    for event in events:
        if event["action"] == "stop":
            stopped[event["target"]] = event["t"]
        elif event["action"] == "cont" and event["target"] in stopped:
            spans.setdefault(event["target"], []).append((stopped.pop(event["target"]), event["t"]))
    for target, since in stopped.items():
        spans.setdefault(target, []).append((since, float("inf")))
    return spans


def _paused_within(spans: Pauses, start: float, end: float) -> float:
    return sum(max(0.0, min(end, stop) - max(start, begin)) for begin, stop in spans)


def useful_seconds(
    incarnation: Incarnation,
    rolled_back_after: float | None,
    paused: Pauses | None = None,
    window: tuple[float, float] = (float("-inf"), float("inf")),
) -> tuple[float, int, int]:
    """(worker-seconds of applied work, samples computed, samples applied) of one process; steps
    after `rolled_back_after` (a wall time) are not counted as applied, nor a step's seconds
    its process spent stopped (`paused`: it did no work then), nor its seconds outside the run's
    `window` (start, end), which is all that is provisioned (a step logged after the end, while
    the rig stopped the processes, made goodput exceed 1)."""
    useful, pending_seconds, pending_samples = 0.0, 0.0, 0
    previous = incarnation.lines[0]
    applied = 0
    for line in incarnation.lines[1:]:
        if line["event"] != "step":
            previous = line
            continue
        begin, end = max(previous["t"], window[0]), min(line["t"], window[1])
        pending_seconds += max(0.0, end - begin) - _paused_within(paused or [], begin, max(begin, end))
        pending_samples += line["samples"] - previous["samples"]
        newly = line["applied"] - previous["applied"]
        if newly > 0 and (rolled_back_after is None or line["t"] <= rolled_back_after):
            share = min(1.0, newly / pending_samples) if pending_samples else 1.0
            useful += pending_seconds * share
            pending_seconds *= 1.0 - share
            pending_samples = max(0, pending_samples - newly)
            applied += newly
        previous = line
    return useful, int(incarnation.lines[-1]["samples"]), applied


def _rollback_time(processes: list[Incarnation], process: Incarnation) -> float | None:
    """Where a process that was restarted (its rank has a later process) lost its steps: the last
    checkpoint line (DDP's rank 0 writes them) before its end; None where no checkpoint came before."""
    checkpoints = [
        line["t"] for other in processes for line in other.lines
        if line["event"] == "checkpoint" and line["t"] <= process.end
    ]  # fmt: skip
    return max(checkpoints) if checkpoints else None


def recoveries(run_dir: Path, started: float) -> list[dict[str, Any]]:
    """Each worker kill the rig applied (events.json): the rank, when (seconds into the run), and
    the seconds from the kill to the rank's next process's "start" line (set up: imported,
    registered or rendezvoused) and to its first applied step (None: not within the run)."""
    path = run_dir / "events.json"
    events = json.loads(path.read_text()) if path.exists() else []
    processes = incarnations(run_dir)
    found = []
    for kill in (e for e in events if e["action"] == "kill" and e["target"] >= 0):
        later = sorted(
            (p for p in processes if p.rank == kill["target"] and p.lines[0]["t"] > kill["t"]),
            key=lambda p: float(p.lines[0]["t"]),
        )
        applied = [line["t"] for p in later for line in p.lines if line["event"] == "step" and line["applied"] > 0]
        found.append({
            "rank": kill["target"], "at_s": kill["t"] - started,
            "started_s": later[0].lines[0]["t"] - kill["t"] if later else None,
            "applied_s": min(applied) - kill["t"] if applied else None,
        })  # fmt: skip
    return found


def time_to_target(curve: list[dict[str, float]], chosen: Workload, target: float) -> float | None:
    """Seconds from the run's start to the first evaluated snapshot at the target; None: never."""
    return next((point["t"] for point in curve if chosen.reached(point, target)), None)


def cell_metrics(
    run_dir: Path,
    scenario: Scenario,
    chosen: Workload,
    curve: list[dict[str, float]],
    target: float,
    started: float,
    ended: float,
    wire: dict[str, int],
) -> dict[str, Any]:
    processes = incarnations(run_dir)
    stopped = pauses(run_dir)
    useful, computed, applied = 0.0, 0, 0
    has_checkpoints = any(line["event"] == "checkpoint" for p in processes for line in p.lines)
    for index, process in enumerate(processes):
        restarted = any(later.rank == process.rank for later in processes[index + 1 :])
        rollback = _rollback_time(processes, process) if has_checkpoints and restarted else None
        seconds, samples, kept = useful_seconds(process, rollback, stopped.get(process.rank, []), (started, ended))
        useful += seconds
        computed += samples
        applied += kept
    provisioned = scenario.workers * (ended - started)
    final = curve[-1] if curve else {}
    total_bytes = sum(wire.values())
    return {
        "time_to_target_s": time_to_target(curve, chosen, target),
        "final": {"t": final.get("t"), "loss": final.get("loss"), "accuracy": final.get("accuracy")},
        "goodput": useful / provisioned if provisioned > 0 else None,
        "samples_computed": computed,
        "samples_applied": applied,
        "wire_bytes": wire,
        "bytes_per_sample": total_bytes / applied if applied else None,
        "processes": len(processes),
        "restarts": len(processes) - len({p.rank for p in processes}),
        "recoveries": recoveries(run_dir, started),
        "snapshots": len(curve),
        "wall_s": ended - started,
    }
