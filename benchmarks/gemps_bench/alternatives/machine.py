"""The machine a cell runs on: its CPU and how long one training step of the workload's model
takes on one of its cores. Times to target scale with that step, so cells of machines of
different speeds must not share a table's medians: `mismatch` says when they would.

    fingerprint(workload("charlm"))  -> {"cpu": "AMD EPYC", "cores": 2, "step_ms": 214.2}
"""

from __future__ import annotations

import functools
import os
import statistics
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from gemps_bench.alternatives.workloads import Workload, loss, workload

#: a step this much slower or faster (as a fraction) than the recorded cells' is another machine
TOLERANCE = 0.3
#: timed steps (after WARM_UP); their median is the figure
TIMED_STEPS = 7
WARM_UP = 2


@functools.cache
def fingerprint(name: str) -> dict[str, Any]:
    """`measure(name)` once per process: what the command compares with the recorded cells."""
    return measure(name)


def measure(name: str) -> dict[str, Any]:
    """This machine's CPU, cores and the CPU milliseconds of one step of workload `name` (forward,
    backward, SGD at its per-worker batch) on one thread, now (about 2 s for charlm). A shared host's
    step is not constant: here it went from 2.9 to 5.6 ms within the hour (2026-11-29), so each
    cell records the one measured just before it runs."""
    chosen = workload(name)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        step_ms = _step_ms(chosen)
    finally:
        torch.set_num_threads(threads)
    return {"cpu": _cpu_model(), "cores": os.cpu_count(), "step_ms": round(step_ms, 1)}


def _step_ms(chosen: Workload) -> float:
    model = chosen.build_model(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=chosen.learning_rates[0])
    batches = chosen.batches(0, 1, 0)
    times = []
    for step in range(WARM_UP + TIMED_STEPS):
        inputs, targets = next(batches)
        started = time.process_time()
        optimizer.zero_grad()
        loss(model, inputs, targets).backward()  # type: ignore[no-untyped-call]
        optimizer.step()
        if step >= WARM_UP:
            times.append(1000 * (time.process_time() - started))
    return statistics.median(times)


def _cpu_model(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    try:
        for row in cpuinfo.read_text().splitlines():
            if row.startswith("model name"):
                return row.partition(":")[2].strip()
    except OSError:
        pass
    return "unknown"


def mismatch(here: dict[str, Any], cells: Iterable[dict[str, Any]]) -> str | None:
    """Why `here` is not the machine the recorded `cells` ran on (None: it is, or none says)."""
    recorded = [cell["machine"] for cell in cells if "machine" in cell]
    if not recorded:
        return None
    step = statistics.median(m["step_ms"] for m in recorded)
    cpus = sorted({m["cpu"] for m in recorded})
    if abs(here["step_ms"] / step - 1) <= TOLERANCE and cpus == [here["cpu"]]:
        return None
    return (
        f"a step takes {here['step_ms']:.1f} ms on this machine ({here['cpu']}) where the "
        f"{len(recorded)} cells recorded took {step:.1f} ms ({', '.join(cpus)})"
    )
