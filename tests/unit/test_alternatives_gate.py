"""The comparison's start gate: a cell whose ranks are not all set up is not run, and says why.

A coordinator that cannot start (2026-12-03: `gemps server --replicas 2` on a host without etcd)
left every rank retrying its registration; the harness opened the gate anyway, ran the scenario's
420 s on no worker and recorded "final loss None, goodput 0%". Now the cell stops at the gate,
quoting the coordinator's log and the missing ranks' own, and the command exits 1 with the cells
run before it merged."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from gemps_bench.alternatives import harness
from gemps_bench.alternatives import main as command
from gemps_bench.alternatives.contract import GO_FILE, ProgressLog
from gemps_bench.alternatives.systems import peers

from tests.unit.test_alternatives import fake_run


def _logs(tmp_path: Path) -> Path:
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "coordinator.log").write_text("starting\nEtcdNotInstalled: etcd not found on PATH\n")
    (logs / "worker-2.log").write_text("ServerUnavailableError: 10.231.0.1:50051 did not answer\n")
    return logs


def test_a_rank_not_set_up_stops_the_cell_at_the_gate_quoting_the_logs(tmp_path: Path) -> None:
    logs = _logs(tmp_path)
    for rank in (0, 1, 3):
        ProgressLog(tmp_path, rank)
    with pytest.raises(harness.CellNotStarted) as raised:
        harness._open_gate(tmp_path, 4, "e-gemps-adamw-charlm-s1", logs, timeout=0.3)
    message = str(raised.value)
    assert "e-gemps-adamw-charlm-s1: rank(s) 2 of 4 not set up" in message
    assert "EtcdNotInstalled: etcd not found on PATH" in message  # the coordinator's log
    assert "ServerUnavailableError" in message  # the missing rank's own
    assert not (tmp_path / GO_FILE).exists()  # no rank was let go


def test_no_rank_set_up_names_every_rank_and_a_missing_log(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    with pytest.raises(harness.CellNotStarted, match=r"rank\(s\) 0, 1, 2 of 3 not set up") as raised:
        harness._open_gate(tmp_path, 3, "a-ddp-digits-s0", logs, timeout=0.0)
    assert f"{logs / 'coordinator.log'}: no log" in str(raised.value)


def test_every_rank_set_up_opens_the_gate(tmp_path: Path) -> None:
    for rank in range(3):
        ProgressLog(tmp_path, rank)
    assert harness._open_gate(tmp_path, 3, "a-ddp-digits-s0", _logs(tmp_path), timeout=5.0) == 3
    assert (tmp_path / GO_FILE).exists()


def test_the_command_exits_1_on_a_cell_not_started_keeping_the_cells_before_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    ran: list[str] = []

    def run(cell: Any, runs: Path, rate: float, target: float) -> dict[str, Any]:
        ran.append(cell.system)
        if cell.system == "ddp":
            raise harness.CellNotStarted("a-ddp-digits-s0: rank(s) 0 of 8 not set up within 240 s")
        return fake_run(cell, runs, rate, target)

    monkeypatch.setattr(command, "run_cell", run)
    monkeypatch.setattr(command, "unavailable_reason", lambda: None)
    argv = ["--scenarios", "a", "--systems", "gemps-gem,ddp,gemps-adam", "--workload", "digits", "--seeds", "0",
            "--lr", "0.05", "--results", str(tmp_path)]  # fmt: skip
    assert command.main(argv) == 1
    assert ran == ["gemps-gem", "ddp"]  # the sweep stops at the cell that did not start
    assert "alternatives: a-ddp-digits-s0: rank(s) 0 of 8 not set up" in capsys.readouterr().err
    merged = json.loads((tmp_path / "digits.json").read_text())
    assert list(merged["cells"]) == ["a/gemps-gem/0"]


def test_a_peer_whose_interpreter_is_missing_is_named_before_any_cell_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A checkout without the peers' virtualenv (`make peers-venv`) ran torchft's cell anyway, every
    rank's exec failing: refused up front, naming what builds it."""
    ran: list[str] = []
    monkeypatch.setattr(command, "run_cell", lambda cell, *rest: ran.append(cell.system))
    monkeypatch.setattr(command, "unavailable_reason", lambda: None)
    monkeypatch.setattr(peers, "REPOSITORY", tmp_path)  # a checkout without .venv-peers
    argv = ["--scenarios", "e", "--systems", "gemps-adamw,torchft_ddp_adamw", "--workload", "charlm",
            "--seeds", "1", "--lr", "2e-3", "--results", str(tmp_path)]  # fmt: skip
    assert command.main(argv) == 2
    assert ran == []
    error = capsys.readouterr().err
    assert "torchft_ddp_adamw runs .venv-peers/bin/python, which is not there: `make peers-venv` builds it" in error
    assert error.count("alternatives: ") == 1  # gemps-adamw needs no other interpreter


def test_a_search_cell_not_started_exits_1_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def not_started(*args: Any) -> dict[str, Any]:
        raise harness.CellNotStarted("a-ddp-digits-s0: rank(s) 3 of 8 not set up within 240 s")

    monkeypatch.setattr(command, "_search", not_started)
    monkeypatch.setattr(command, "unavailable_reason", lambda: None)
    argv = ["--search", "--systems", "ddp", "--workload", "digits", "--results", str(tmp_path)]
    assert command.main(argv) == 1
    assert "alternatives: a-ddp-digits-s0: rank(s) 3 of 8 not set up" in capsys.readouterr().err
    assert not (tmp_path / "learning_rates.json").exists()
