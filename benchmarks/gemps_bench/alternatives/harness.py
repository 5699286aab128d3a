"""One cell of the comparison: a system trains a workload under a scenario for a seed, on the rig;
then its snapshots are evaluated (outside every quota, after the run) and its metrics computed.

    run_cell(Cell("b", "gemps-gem", "digits", seed=0), Path("runs/alternatives")) -> dict (cell.json)

A run's folder: worker-R.jsonl (the contract's progress), snapshots/, logs/, events.json (the
faults applied, with their wall times), cell.json (metrics.py's figures and the held-out curve).
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from gemps_bench.alternatives import machine, metrics
from gemps_bench.alternatives.contract import GO_FILE, SNAPSHOT_EVERY, snapshot_times
from gemps_bench.alternatives.rig import Rig
from gemps_bench.alternatives.scenario import load
from gemps_bench.alternatives.systems.base import COORDINATOR, RunPlan
from gemps_bench.alternatives.systems.registry import system
from gemps_bench.alternatives.workloads import Workload, workload

#: seconds the harness waits for every rank to be set up before it gives the cell up
STARTUP_TIMEOUT_S = 240.0
#: lines of each log a cell that did not start quotes
LOG_TAIL_LINES = 5
#: snapshots evaluated per run at most (evenly spread; the first reaching the target is found among them)
MAX_EVALUATIONS = 200  # a 90-s run at --snapshot-every 0.5 with its start-up


class CellNotStarted(RuntimeError):
    """Some rank was not set up within STARTUP_TIMEOUT_S: the cell is not run (its figures would
    be of fewer workers than its scenario's, or of none)."""


@dataclass(frozen=True)
class Cell:
    scenario: str
    system: str
    workload: str
    seed: int
    learning_rate: float | None = None  # None: the workload's chosen one (the search's result)
    duration_s: float | None = None  # None: the scenario's for the workload
    snapshot_every: float = SNAPSHOT_EVERY  # seconds between two snapshots (the curve's resolution)
    scenario_file: str | None = None  # the JSON file `scenario` was read from; None: a shipped one

    def label(self) -> str:
        return f"{self.scenario}-{self.system}-{self.workload}-s{self.seed}-lr{self.learning_rate}"


def run_cell(cell: Cell, out: Path, learning_rate: float, target: float) -> dict[str, Any]:
    """Run `cell` on the rig into out/<label>/ (replacing an earlier run of it) and return its
    metrics, also written to cell.json there."""
    scenario = load(cell.scenario_file or cell.scenario)
    chosen = workload(cell.workload)
    duration = cell.duration_s or scenario.duration(cell.workload)
    run_dir = out / cell.label()
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    the_system = system(cell.system)
    host = machine.measure(cell.workload)  # before the run, the machine idle: its speed this minute
    with Rig(scenario, run_dir, the_system) as rig:
        plan = RunPlan(
            chosen, scenario.workers, cell.seed, learning_rate, run_dir, duration + STARTUP_TIMEOUT_S,
            rig.address(COORDINATOR), tuple(rig.address(i) for i in range(scenario.workers)),
            replicas=2 if scenario.coordinator_kill is not None else 1, snapshot_every=cell.snapshot_every,
        )  # fmt: skip
        coordinator = the_system.coordinator(plan)
        if coordinator is not None:
            rig.start(COORDINATOR, coordinator)
        observer = the_system.observer(plan)
        if observer is not None:
            rig.start_outside(COORDINATOR, observer, "observer")
        for rank in range(scenario.workers):
            rig.start(rank, the_system.worker(plan, rank))
        ready = _open_gate(run_dir, scenario.workers, cell.label(), rig.logs)
        started = time.time()
        for event in scenario.events(cell.seed, duration):
            _sleep_until(started + event.at_s)
            rig.apply(event)
        _sleep_until(started + duration)
        wire = rig.wire_bytes()
        ended = time.time()
        rig.stop_all()
        (run_dir / "events.json").write_text(json.dumps(rig.applied, indent=1))
    curve = evaluate_snapshots(run_dir, chosen, started)
    result = metrics.cell_metrics(run_dir, scenario, chosen, curve, target, started, ended, wire)
    result.update(
        cell=asdict(cell), learning_rate=learning_rate, duration_s=duration, target=target,
        quotas={"worker_cpu": scenario.worker_cpu, "coordinator_cpu": scenario.coordinator_cpu,
                "workers": scenario.workers, "link": scenario.link},
        curve=curve, load_average=_load_average(), ranks_ready_at_start=ready,
        machine=host,
    )  # fmt: skip
    (run_dir / "cell.json").write_text(json.dumps(result, indent=1))
    return result


def evaluate_snapshots(run_dir: Path, chosen: Workload, started: float) -> list[dict[str, float]]:
    """Held-out {"t" (seconds since the run started), "loss", "accuracy"} of the run's snapshots,
    at most MAX_EVALUATIONS of them evenly spread, in this (unlimited) process."""
    found = snapshot_times(run_dir)
    if len(found) > MAX_EVALUATIONS:
        step = len(found) / MAX_EVALUATIONS
        found = [found[int(i * step)] for i in range(MAX_EVALUATIONS)] + [found[-1]]
    model = chosen.build_model()
    curve = []
    for wall, path in found:
        model.load_state_dict(torch.load(path))
        curve.append({"t": wall - started, **chosen.evaluate(model)})
    return curve


def _open_gate(run_dir: Path, workers: int, label: str, logs: Path, timeout: float = STARTUP_TIMEOUT_S) -> int:
    """Wait until every rank logged its "start" (at most `timeout` seconds), then create the gate
    file (contract.GO_FILE) and return how many ranks were ready; CellNotStarted, quoting the
    logs of the coordinator and of the ranks missing, when one was not."""
    deadline = time.monotonic() + timeout
    missing = list(range(workers))
    while True:
        missing = [rank for rank in missing if not (run_dir / f"worker-{rank}.jsonl").exists()]
        if not missing or time.monotonic() >= deadline:
            break
        time.sleep(0.2)
    if missing:
        quoted = [_log_tail(logs / f"{name}.log") for name in ("coordinator", *(f"worker-{r}" for r in missing[:2]))]
        raise CellNotStarted(
            f"{label}: rank(s) {', '.join(map(str, missing))} of {workers} not set up within {timeout:.0f} s; "
            "the cell is not run\n" + "\n".join(quoted)
        )
    (run_dir / GO_FILE).touch()
    return workers


def _log_tail(path: Path) -> str:
    """The last LOG_TAIL_LINES lines of a log, headed by its path (or that it is absent)."""
    if not path.exists():
        return f"{path}: no log"
    lines = path.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:]
    return "\n".join([f"{path} ends:", *(f"    {line}" for line in lines)])


def _sleep_until(when: float) -> None:
    delay = when - time.time()
    if delay > 0:
        time.sleep(delay)


def _load_average() -> list[float]:
    return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]
