"""The comparison's machine record: each cell says the CPU it ran on and how long a step of its
model takes there, and the command refuses to add a machine of another speed's cells to a table."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from gemps_bench.alternatives import machine
from gemps_bench.alternatives import main as command
from gemps_bench.alternatives.harness import Cell


def recorded(step_ms: float, cpu: str = "AMD EPYC") -> dict[str, Any]:
    return {"machine": {"cpu": cpu, "cores": 2, "step_ms": step_ms}}


def test_a_step_of_the_workload_is_timed_on_this_machine() -> None:
    found = machine.fingerprint("digits")
    assert found["cores"] == os.cpu_count()
    assert found["cpu"] and found["step_ms"] > 0
    assert machine.fingerprint("digits") is found  # once per process: the command's check
    now = machine.measure("digits")  # each cell's own record: measured again, just before it runs
    assert now is not found and now["cpu"] == found["cpu"] and now["step_ms"] > 0


def test_cells_of_a_machine_of_another_speed_or_cpu_are_told_apart() -> None:
    here = {"cpu": "AMD EPYC", "cores": 2, "step_ms": 214.2}
    assert machine.mismatch(here, [{"time_to_target_s": 70.0}]) is None  # nothing recorded to compare with
    assert machine.mismatch(here, [recorded(190.0), recorded(230.0), recorded(200.0)]) is None
    slower = machine.mismatch(here, [recorded(105.0), recorded(107.0)])
    assert (
        slower == "a step takes 214.2 ms on this machine (AMD EPYC) where the 2 cells recorded took 106.0 ms (AMD EPYC)"
    )
    other = machine.mismatch(here, [recorded(214.0, cpu="Intel Xeon")])
    assert other is not None and "(Intel Xeon)" in other


def test_the_command_refuses_to_mix_machines_before_any_cell_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    ran: list[str] = []

    def result(cell: Any, rate: float, step_ms: float) -> dict[str, Any]:
        return {"cell": {"scenario": cell.scenario, "system": cell.system, "workload": cell.workload,
                         "seed": cell.seed}, "time_to_target_s": 5.0, "final": {"accuracy": 0.98, "loss": 0.1},
                "goodput": 1.0, "bytes_per_sample": 100.0, "restarts": 0, "load_average": [1.0],
                "learning_rate": rate, "duration_s": 60.0, "target": 0.97, **recorded(step_ms)}  # fmt: skip

    def fake_run(cell: Any, runs: Path, rate: float, target: float) -> dict[str, Any]:
        ran.append(cell.system)
        return result(cell, rate, 214.2)

    monkeypatch.setattr(command, "run_cell", fake_run)
    monkeypatch.setattr(command, "unavailable_reason", lambda: None)
    monkeypatch.setattr(machine, "fingerprint", lambda name: {"cpu": "AMD EPYC", "cores": 2, "step_ms": 214.2})
    earlier = {"cells": {"a/ddp/0": result(Cell("a", "ddp", "digits", 0), 0.05, 105.0)}}
    (tmp_path / "digits.json").write_text(json.dumps(earlier))
    (tmp_path / "learning_rates.json").write_text(json.dumps({"digits": {"ddp": 0.05}}))
    argv = ["--systems", "ddp", "--seeds", "1", "--workload", "digits", "--results", str(tmp_path)]
    assert command.main(argv) == 2
    assert ran == []
    said = capsys.readouterr().err
    assert "214.2 ms on this machine" in said and "105.0 ms" in said and "--mixed-machines" in said
    assert command.main([*argv, "--mixed-machines"]) == 0  # asked for: merged, the records kept
    cells = json.loads((tmp_path / "digits.json").read_text())["cells"]
    assert ran == ["ddp"] and cells["a/ddp/1"]["machine"]["step_ms"] == 214.2
