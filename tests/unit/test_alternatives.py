"""The comparison with the alternatives (issue 58), what runs without root: the shipped scenarios and
their fault time lines, the workloads and the worker contract, the metrics from progress logs, the
report (one case, as root only, the quota groups). The rig itself (root) runs in
tests/e2e/test_alternatives_rig.py."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from gemps_bench.alternatives import main as command
from gemps_bench.alternatives import metrics, report
from gemps_bench.alternatives.cgroups import CpuGroup, Groups
from gemps_bench.alternatives.cgroups import unavailable_reason as cgroups_unavailable
from gemps_bench.alternatives.contract import (
    ProgressLog,
    Snapshots,
    parse_worker_args,
    snapshot_times,
    worker_parser,
)
from gemps_bench.alternatives.scenario import SCENARIOS_DIR, load, parse
from gemps_bench.alternatives.systems.base import RunPlan
from gemps_bench.alternatives.systems.ddp import Ddp
from gemps_bench.alternatives.systems.gemps import Gemps
from gemps_bench.alternatives.systems.registry import system, system_names
from gemps_bench.alternatives.workloads import WORKLOADS, loss, targets, workload


def test_the_six_scenarios_of_the_issue_are_shipped_and_valid() -> None:
    assert sorted(p.stem for p in SCENARIOS_DIR.glob("*.json")) == ["a", "b", "c", "d", "e", "f"]
    for name in "abcdef":
        scenario = load(name)
        assert scenario.workers == 8 and scenario.workers * scenario.worker_cpu + scenario.coordinator_cpu <= 2
    assert load("b").speed[0].factor == pytest.approx(1 / 3, abs=1e-3)
    assert load("f").link == "100mbit"


def test_events_are_the_same_for_a_seed_and_in_time_order() -> None:
    pauses = load("c")
    first, again, other = pauses.events(0, 60.0), pauses.events(0, 60.0), pauses.events(1, 60.0)
    assert first == again and first != other
    assert [e.at_s for e in first] == sorted(e.at_s for e in first)
    assert {e.action for e in first} == {"stop", "cont"} and {e.target for e in first} == set(range(8))
    for worker in range(8):  # each pause ends before the next starts, within its bound
        mine = [e for e in first if e.target == worker]
        for stop, cont in zip(mine[::2], mine[1::2], strict=False):
            assert stop.action == "stop" and cont.action == "cont" and 0 < cont.at_s - stop.at_s <= 10.0
    kills = load("d").events(0, 130.0)
    assert [(e.at_s, e.action, e.target) for e in kills] == [
        (5, "kill", 0), (10, "restart", 0), (65, "kill", 1), (70, "restart", 1), (125, "kill", 2)
    ]  # fmt: skip
    assert [(e.action, e.target) for e in load("e").events(0, 60.0)] == [("kill", -1), ("restart", -1)]


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"name": "x", "description": "", "wokers": 8}, "unknown fields wokers"),
        ({"name": "x", "description": "", "worker_cpu": 0.5}, "quotas sum to 4.3 cores"),
        ({"name": "x", "description": "", "link": "fast"}, "not a link rate: 'fast'"),
        ({"name": "x", "description": "", "speed": [{"worker": 9, "at_s": 0, "factor": 0.5}]},
         "needs a worker in [0, 8)"),
        ({"name": "x", "description": "", "pauses": {"distribution": "cauchy", "every_s": 1, "scale_s": 1, "shape": 1}},
         "pauses.distribution 'cauchy'"),
        ({"name": "x", "description": "", "kills": {"every_s": 60}}, "missing 2 required positional arguments"),
    ],
)  # fmt: skip
def test_a_bad_scenario_is_refused_naming_what_is_wrong(raw: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=r"x\.json") as refused:
        parse(raw, "x.json")
    assert message in str(refused.value)


def test_an_unknown_scenario_names_the_shipped_ones() -> None:
    with pytest.raises(ValueError, match="one of a, b, c, d, e, f"):
        load("z")


def test_workloads_give_disjoint_shards_the_same_start_and_a_held_out_metric() -> None:
    digits = workload("digits")
    shards = [set(digits.shard(rank, 8).tolist()) for rank in range(8)]
    assert sum(len(s) for s in shards) == len(digits.data().train_x) and not set.intersection(*shards[:2])
    a, b = digits.build_model(), digits.build_model()
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))
    inputs, labels = next(replace(digits, batch=5).batches(3, 8, seed=0))
    assert inputs.shape == (5, 1, 8, 8) and set(labels.tolist()) <= set(range(10))
    assert loss(a, inputs, labels).item() > 0
    evaluation = digits.evaluate(a)
    assert digits.reached({"accuracy": 0.98, "loss": 1.0}, 0.97) and not digits.reached(evaluation, 0.97)
    assert workload("charlm").reached({"accuracy": 0.0, "loss": 2.4}, 2.5)
    assert set(targets()) == set(WORKLOADS)
    with pytest.raises(ValueError, match="rank 8 of world 8"):
        digits.shard(8, 8)
    with pytest.raises(ValueError, match="unknown workload 'mnist'; choose from digits, charlm"):
        workload("mnist")


def test_the_char_lm_has_one_to_three_million_parameters() -> None:
    model = workload("charlm").build_model()
    assert 1_000_000 <= sum(p.numel() for p in model.parameters()) <= 3_000_000


def _write_log(path: Path, lines: list[tuple[float, str, int, int]], rank: int = 0) -> None:
    with path.open("a") as log:
        for t, event, samples, applied in lines:
            log.write(json.dumps({"t": t, "rank": rank, "event": event, "samples": samples, "applied": applied}) + "\n")


def test_goodput_counts_applied_steps_and_loses_rollbacks(tmp_path: Path) -> None:
    # rank 0: two applied steps of 1 s, then a process that computed one step never applied (local steps)
    _write_log(
        tmp_path / "worker-0.jsonl", [(0, "start", 0, 0), (0, "go", 0, 0), (1, "step", 10, 10), (2, "step", 20, 20)]
    )
    _write_log(tmp_path / "worker-0.jsonl", [(5, "start", 0, 0), (6, "step", 10, 0)])
    processes = metrics.incarnations(tmp_path)
    assert [len(p.lines) for p in processes] == [4, 2]
    assert metrics.useful_seconds(processes[0], None) == (2.0, 20, 20)
    assert metrics.useful_seconds(processes[1], None) == (0.0, 10, 0)
    # a rollback to a checkpoint at t = 1.5 loses the second step
    assert metrics.useful_seconds(processes[0], 1.5) == (1.0, 20, 10)
    # local steps: two steps of 1 s, then a commit covering both
    _write_log(tmp_path / "worker-1.jsonl", [(0, "go", 0, 0), (1, "step", 10, 0), (2, "step", 20, 20)], rank=1)
    assert metrics.useful_seconds(metrics.incarnations(tmp_path)[2], None) == (2.0, 20, 20)


def test_goodput_loses_the_seconds_a_worker_was_stopped(tmp_path: Path) -> None:
    # scenario (c): rank 0 stopped from 0.5 to 1.5 s (and again at 2.8 s, never continued), rank 1 not
    events = [
        {"t": 0.5, "at_s": 0.5, "action": "stop", "target": 0}, {"t": 1.5, "at_s": 1.5, "action": "cont", "target": 0},
        {"t": 2.8, "at_s": 2.8, "action": "stop", "target": 0},
    ]  # fmt: skip
    (tmp_path / "events.json").write_text(json.dumps(events))
    stopped = metrics.pauses(tmp_path)
    assert stopped == {0: [(0.5, 1.5), (2.8, float("inf"))]}
    _write_log(tmp_path / "worker-0.jsonl", [(0, "go", 0, 0), (2, "step", 10, 10), (3, "step", 20, 20)])
    process = metrics.incarnations(tmp_path)[0]
    # the first step took 2 s of which 1 s stopped; the second 1 s of which 0.2 s stopped
    useful, computed, applied = metrics.useful_seconds(process, None, stopped[0])
    assert useful == pytest.approx(1.8) and (computed, applied) == (20, 20)
    assert metrics.useful_seconds(process, None, stopped.get(1)) == (3.0, 20, 20)


def test_goodput_counts_no_second_outside_the_run(tmp_path: Path) -> None:
    """Steps logged after the run's end (the rig stopping the processes) count no second: CI met a
    goodput of 1.0015 on a 15 s DDP cell. Nor do seconds before its start."""
    _write_log(tmp_path / "worker-0.jsonl", [(0, "go", 0, 0), (4, "step", 10, 10), (11, "step", 20, 20)])
    process = metrics.incarnations(tmp_path)[0]
    assert metrics.useful_seconds(process, None, None, (1.0, 10.0)) == (9.0, 20, 20)
    for rank in range(1, 8):  # scenario (a)'s 8 workers, each logging past the end
        _write_log(
            tmp_path / f"worker-{rank}.jsonl", [(0, "go", 0, 0), (4, "step", 10, 10), (11, "step", 20, 20)], rank
        )
    curve = [{"t": 9.0, "loss": 0.1, "accuracy": 0.98}]
    found = metrics.cell_metrics(tmp_path, load("a"), workload("digits"), curve, 0.97, 0.0, 10.0, {"worker-0": 400})
    assert found["goodput"] == pytest.approx(1.0)


def test_cell_metrics_has_every_figure(tmp_path: Path) -> None:
    _write_log(tmp_path / "worker-0.jsonl", [(0, "start", 0, 0), (5, "step", 10, 10), (10, "checkpoint", 10, 10)])
    _write_log(tmp_path / "worker-0.jsonl", [(12, "start", 0, 0), (20, "step", 10, 10)])
    curve = [{"t": 4.0, "loss": 1.0, "accuracy": 0.5}, {"t": 9.0, "loss": 0.1, "accuracy": 0.98}]
    found = metrics.cell_metrics(tmp_path, load("a"), workload("digits"), curve, 0.97, 0.0, 20.0, {"worker-0": 400})
    assert found["time_to_target_s"] == 9.0 and found["final"]["accuracy"] == 0.98
    assert found["goodput"] == pytest.approx((5 + 8) / (8 * 20))
    assert found["samples_applied"] == 20 and found["bytes_per_sample"] == 20.0
    assert found["restarts"] == 1 and found["processes"] == 2


def test_each_kill_records_the_seconds_to_the_ranks_next_start_and_first_applied_step(tmp_path: Path) -> None:
    """Scenario (d)'s cost per kill, apart from the rest of the run: rank 1 killed at 105 (5 s into
    the run), its next process logs "start" at 107.5 and its first applied step at 109 (a step
    before it computed but not applied: local steps); rank 2's kill at 165 has no process after it."""
    applied = [(105.0, "kill", 1), (110.0, "restart", 1), (130.0, "kill", -1), (165.0, "kill", 2)]
    events = [{"t": t, "at_s": t - 100, "action": action, "target": target} for t, action, target in applied]
    (tmp_path / "events.json").write_text(json.dumps(events))
    _write_log(tmp_path / "worker-1.jsonl", [(90, "start", 0, 0), (104, "step", 10, 10)], rank=1)
    _write_log(tmp_path / "worker-1.jsonl", [(107.5, "start", 0, 0), (108, "step", 10, 0), (109, "step", 20, 20)], 1)
    _write_log(tmp_path / "worker-2.jsonl", [(90, "start", 0, 0), (164, "step", 10, 10)], rank=2)
    assert metrics.recoveries(tmp_path, 100.0) == [
        {"rank": 1, "at_s": 5.0, "started_s": 2.5, "applied_s": 4.0},
        {"rank": 2, "at_s": 65.0, "started_s": None, "applied_s": None},
    ]


def test_progress_log_and_snapshots_follow_the_contract(tmp_path: Path) -> None:
    log = ProgressLog(tmp_path, 3)
    (tmp_path / "go").touch()
    log.wait_for_go(tmp_path)
    log.step(8, 0)
    log.step(8, 16)
    log.close()
    lines = [json.loads(line) for line in (tmp_path / "worker-3.jsonl").read_text().splitlines()]
    assert [line["event"] for line in lines] == ["start", "go", "step", "step", "exit"]
    assert lines[3]["samples"] == 16 and lines[3]["applied"] == 16 and lines[3]["rank"] == 3
    snapshots = Snapshots(tmp_path, every=3600.0)
    model = workload("digits").build_model()
    assert snapshots.write(model) and not snapshots.write(model) and snapshots.write(model, force=True)
    found = snapshot_times(tmp_path)
    assert len(found) == 2 and not list((tmp_path / "snapshots").glob(".*"))
    assert set(torch.load(found[0][1])) == set(model.state_dict())


def test_snapshots_within_one_millisecond_are_all_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Snapshots are named by their wall time to the millisecond: on a fast machine a forced one
    came within the same millisecond as the one before and replaced it."""
    monkeypatch.setattr("time.time", lambda: 1_800_000_000.0)
    snapshots = Snapshots(tmp_path, every=3600.0)
    model = workload("digits").build_model()
    assert all(snapshots.write(model, force=True) for _ in range(3))
    assert [when for when, _ in snapshot_times(tmp_path)] == [1_800_000_000.0, 1_800_000_000.001, 1_800_000_000.002]


def test_systems_build_their_command_lines(tmp_path: Path) -> None:
    assert {"gemps-gem", "gemps-gem-int8", "gemps-gem-local", "gemps-dn-dylu", "ddp"} <= set(system_names())
    plan = RunPlan(workload("digits"), 8, 0, 0.05, tmp_path, 90.0, "10.0.0.1", tuple(f"10.0.1.{i}" for i in range(8)))
    server = Gemps("gemps-gem").coordinator(plan).argv
    assert server[1:4] == ["-m", "gemps_cli", "server"] and "--learning-rate" in server and "10.0.0.1" in server
    local = Gemps("gemps-gem-local").worker(plan, 2).argv
    assert local[local.index("--mode") + 1] == "dynsgd" and local[local.index("--compression") + 1] == "int8"
    assert local[local.index("--local-steps") + 1] == "8"  # issue 59's setting: local Adam, its rate 0.06 eta
    assert local[local.index("--local-optimizer") + 1] == "adam"
    assert float(local[local.index("--local-learning-rate") + 1]) == pytest.approx(0.003)
    plain = Gemps("gemps-gem-int8").worker(plan, 2).argv  # gradient commits: no local rate of its own
    assert float(plain[plain.index("--local-learning-rate") + 1]) == 0.0
    dn = Gemps("gemps-dn-dylu")
    dn_server, dn_worker = dn.coordinator(plan).argv, dn.worker(plan, 1).argv
    assert dn_server[dn_server.index("--rule") + 1] == "delayed-nesterov"
    assert dn_worker[dn_worker.index("--mode") + 1] == "dylu" and dn_worker[dn_worker.index("--local-steps") + 1] == "8"
    ddp = Ddp().worker(plan, 0)
    assert "is_host=true" in ddp.argv and ddp.argv[ddp.argv.index("--rdzv-endpoint") + 1] == "10.0.1.0:29400"
    assert "is_host=true" not in Ddp().worker(plan, 1).argv
    # a worker's kill spares its elastic agent (the process the rig started), which restarts the group
    assert Ddp().killed(1, [42, 43], 42) == [43] and Ddp().restarts_itself(1)
    assert Ddp().killed(-1, [42, 43], 42) == [42, 43] and not Ddp().restarts_itself(-1)
    # a gemps worker runs under its supervisor (the process the rig started), spared by a worker
    # kill: it forks the next worker itself, warm
    assert "--supervise" in plain
    assert Gemps("gemps-gem").killed(1, [42, 43], 42) == [43] and Gemps("gemps-gem").restarts_itself(1)
    replicated = Gemps("gemps-gem")
    server = replicated.coordinator(replace(plan, replicas=2)).argv
    assert server[server.index("--replicas") + 1] == "2" and replicated.restarts_itself(-1)
    assert "10.0.0.1:50051|10.0.0.1:50052" in replicated.worker(replace(plan, replicas=2), 0).argv
    with pytest.raises(ValueError, match="unknown system 'horovod'"):
        system("horovod")


def test_a_cpu_period_outside_the_kernels_bounds_is_refused_before_any_group_is_made(tmp_path: Path) -> None:
    for period_us in (500, 2_000_000):
        with pytest.raises(ValueError, match=f"a CPU period must be 1 ms to 1 s .*not {period_us} µs"):
            CpuGroup(tmp_path, "w0", 0.2, period_us)
    assert not any(tmp_path.iterdir())


def test_a_quota_is_its_share_of_the_groups_own_period() -> None:
    reason = cgroups_unavailable()
    if reason is not None:
        pytest.skip(reason)
    groups = Groups("test-period")
    try:
        fine, default = groups.add("fine", 0.2, period_us=10_000), groups.add("default", 0.2)
        assert (fine.path / "cpu.cfs_period_us").read_text().strip() == "10000"
        assert (fine.path / "cpu.cfs_quota_us").read_text().strip() == "2000"
        assert (default.path / "cpu.cfs_quota_us").read_text().strip() == "20000"
        fine.set_cores(0.5)
        assert (fine.path / "cpu.cfs_quota_us").read_text().strip() == "5000"
    finally:
        groups.close()


def test_every_system_passes_the_runs_snapshot_interval_to_its_programs(tmp_path: Path) -> None:
    plan = RunPlan(workload("digits"), 8, 0, 0.05, tmp_path, 90.0, "10.0.0.1", tuple(f"10.0.1.{i}" for i in range(8)))
    fine = replace(plan, snapshot_every=0.5)
    for name in ("gemps-gem", "ddp", "torchft_localsgd"):
        chosen = system(name)
        launches = [chosen.worker(fine, 0), chosen.observer(fine) or chosen.worker(fine, 1)]
        for launch in launches:
            argv = launch.argv[launch.argv.index("-m") + 2 :]  # the program's own flags
            parsed = parse_worker_args(worker_parser(""), argv)
            assert parsed.snapshot_every == 0.5, name
    default = system("gemps-gem").worker(plan, 0).argv
    assert parse_worker_args(worker_parser(""), default[default.index("-m") + 2 :]).snapshot_every == 2.0
    with pytest.raises(SystemExit):
        parse_worker_args(worker_parser(""), [*default[default.index("-m") + 2 :], "--snapshot-every", "0"])


def test_the_report_takes_the_median_and_says_never(tmp_path: Path) -> None:
    def result(seed: int, reached: float | None) -> dict[str, object]:
        cell = {"scenario": "b", "system": "ddp", "workload": "digits", "seed": seed}
        return {"cell": cell, "time_to_target_s": reached, "final": {"accuracy": 0.97, "loss": 0.1},
                "goodput": 0.9, "bytes_per_sample": 9000.0, "restarts": 0, "load_average": [3.0],
                "learning_rate": 0.05, "duration_s": 90.0}  # fmt: skip

    data = {"cells": {str(s): result(s, t) for s, t in enumerate((10.0, None, 20.0))}}
    assert report.median_time(data["cells"].values()) == 20.0  # type: ignore[arg-type]
    rows = report.table(data)
    assert "20.0 s (10.0, never, 20.0)" in rows[2] and "9.0 KB" in rows[2]
    assert rows[2].endswith("| 3.0 | - |")  # the load, then no seed with its host's step recorded
    data["cells"]["1"]["machine"] = {"cpu": "AMD EPYC", "cores": 2, "step_ms": 5.62}
    assert report.table(data)[2].endswith("| -, 5.6, - |")  # each seed's, in the times' order
    data["cells"]["2"] = result(2, None)
    assert report.median_time(list(data["cells"].values())) is None
    report.figure(data, tmp_path / "f.png", "digits")
    assert (tmp_path / "f.png").stat().st_size > 0


def test_the_search_chooses_the_soonest_rate_then_the_best_final_metric() -> None:
    def run(rate: float, reached: float | None, accuracy: float) -> dict[str, Any]:
        final = {"accuracy": accuracy, "loss": 1 - accuracy}
        return {"learning_rate": rate, "time_to_target_s": reached, "final": final}

    searched = [run(0.025, 9.0, 0.98), run(0.05, 5.0, 0.97), run(0.1, None, 0.99)]
    assert report.search_best(searched, "accuracy") == run(0.05, 5.0, 0.97)  # the soonest, not the best final
    never = [run(0.025, None, 0.90), run(0.05, None, 0.95), run(0.1, None, 0.93)]
    assert report.search_best(never, "accuracy")["learning_rate"] == 0.05  # the highest accuracy
    assert report.search_best(never, "loss")["learning_rate"] == 0.05  # the lowest loss
    assert report.search_best([run(0.1, 4.0, 0.97), run(0.05, 4.0, 0.97)], "accuracy")["learning_rate"] == 0.05


def test_the_goals_table_sets_gemps_best_setting_against_the_best_peer() -> None:
    def result(scenario: str, system: str, reached: float | None, seed: int = 0) -> dict[str, object]:
        cell = {"scenario": scenario, "system": system, "workload": "digits", "seed": seed}
        return {"cell": cell, "time_to_target_s": reached, "duration_s": 90.0}

    cells = [
        result("a", "gemps-gem", 12.0), result("a", "ddp", 11.0), result("a", "torchft_ddp", 9.0),
        result("b", "gemps-gem", 8.0), result("b", "gemps-gem-int8", 5.0), result("b", "torchft_ddp", 6.0),
        result("b", "gemps-gem-int8", 3.0, seed=1), result("b", "gemps-gem-int8", 7.0, seed=2),
        result("d", "gemps-gem", 4.5), result("d", "ddp", None),
    ]  # fmt: skip
    rows = report.goals({"cells": {str(i): c for i, c in enumerate(cells)}})
    # (a): within 1.2x of DDP (12 <= 13.2), though torchft is the best peer
    assert (
        rows[2] == "| a | gemps-gem 12.0 s (1 seed) | torchft_ddp 9.0 s (1 seed) | 0.75x | within 1.2x of DDP | yes |"
    )
    # (b): the best gemps setting (int8, the median of its three seeds) is first but not 1.5x sooner
    # than the best peer, whose one seed is said beside it
    assert rows[3] == (
        "| b | gemps-gem-int8 5.0 s (3 seeds) | torchft_ddp 6.0 s (1 seed) | 1.20x | first, 1.5x sooner | no |"
    )
    # (d): a peer that never reached the target took the whole run at least
    assert rows[4] == "| d | gemps-gem 4.5 s (1 seed) | ddp never (1 seed) | > 20.00x | first, 1.5x sooner | yes |"


def test_the_no_fault_goal_holds_gemps_to_the_soonest_ddp_and_never_passes_a_gemps_that_never_arrived() -> None:
    """(a)'s goal is DDP's: with the Adam path's `ddp-adamw` in the cells (no plain `ddp`), gemps is
    held to it; a gemps setting that never reached the target does not meet it; cells with no DDP
    system at all say so, not "yes"."""

    def result(system: str, reached: float | None, seed: int = 0) -> dict[str, object]:
        cell = {"scenario": "a", "system": system, "workload": "charlm", "seed": seed}
        return {"cell": cell, "time_to_target_s": reached, "duration_s": 420.0}

    def goal_row(*cells: dict[str, object]) -> str:
        return report.goals({"cells": {str(i): c for i, c in enumerate(cells)}})[2]

    never = goal_row(result("gemps-adamw", 365.5, 1), result("gemps-adamw", None, 2),
                     result("ddp-adamw", 406.6, 1), result("ddp-adamw", 393.8, 2))  # fmt: skip
    assert never == "| a | gemps-adamw never (2 seeds) | ddp-adamw 400.2 s (2 seeds) | - | within 1.2x of DDP | no |"
    held = goal_row(result("gemps-adamw", 470.0), result("ddp-adamw", 400.0), result("ddp-adamw-bf16", 380.0))
    assert held.endswith("| within 1.2x of DDP | no |"), held  # 470 > 1.2 x 380, the better DDP
    within = goal_row(result("gemps-adamw", 450.0), result("ddp-adamw-bf16", 380.0))
    assert within.endswith("| within 1.2x of DDP | yes |"), within
    alone = goal_row(result("gemps-adamw", 300.0), result("torchft_ddp_adamw", 250.0))
    assert alone.endswith("| within 1.2x of DDP: no DDP cell | no |"), alone


def fake_run(cell: Any, runs: Path, rate: float, target: float) -> dict[str, Any]:
    """A cell's result as the rig writes it, without running it: only rate 0.05 reaches the target."""
    reached = {0.05: 40.0}.get(rate)
    return {"cell": {"scenario": cell.scenario, "system": cell.system, "workload": cell.workload,
                     "seed": cell.seed}, "time_to_target_s": reached, "final": {"accuracy": 0.9, "loss": 0.3},
            "goodput": 1.0, "bytes_per_sample": 100.0, "restarts": 0, "load_average": [1.0],
            "learning_rate": rate, "duration_s": 60.0, "target": target}  # fmt: skip


def test_a_search_records_the_rate_and_redraws_the_table_and_figure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The command's own order of work, the rig's runs replaced by their results (the rig runs for
    real in tests/e2e/test_alternatives_rig.py)."""
    monkeypatch.setattr(command, "run_cell", fake_run)
    monkeypatch.setattr(command, "unavailable_reason", lambda: None)
    argv = ["--search", "--systems", "ddp", "--workload", "digits", "--results", str(tmp_path)]
    assert command.main(argv) == 0
    assert json.loads((tmp_path / "learning_rates.json").read_text()) == {"digits": {"ddp": 0.05}}
    assert json.loads((tmp_path / "digits.json").read_text())["cells"]["a/ddp/0"]["time_to_target_s"] == 40.0
    assert "40.0 s" in (tmp_path / "digits.md").read_text()  # the table is drawn after the search
    assert (tmp_path / "digits.png").stat().st_size > 0


def test_the_systems_of_one_seed_run_back_to_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A deciding pair's cells of one seed meet the host at one moment: seed by seed, every system
    of the seed, not every seed of one system and then the other's."""
    ran: list[tuple[str, str, int]] = []

    def recorded(cell: Any, runs: Path, rate: float, target: float) -> dict[str, Any]:
        ran.append((cell.scenario, cell.system, cell.seed))
        return fake_run(cell, runs, rate, target)

    monkeypatch.setattr(command, "run_cell", recorded)
    monkeypatch.setattr(command, "unavailable_reason", lambda: None)
    argv = ["--scenarios", "a,b", "--systems", "gemps-gem,ddp", "--workload", "digits", "--seeds", "1,2",
            "--lr", "0.05", "--results", str(tmp_path)]  # fmt: skip
    assert command.main(argv) == 0
    assert ran == [
        ("a", "gemps-gem", 1), ("a", "ddp", 1), ("a", "gemps-gem", 2), ("a", "ddp", 2),
        ("b", "gemps-gem", 1), ("b", "ddp", 1), ("b", "gemps-gem", 2), ("b", "ddp", 2),
    ]  # fmt: skip


def test_a_system_without_a_learning_rate_is_named_before_any_cell_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    ran: list[str] = []
    monkeypatch.setattr(command, "run_cell", lambda cell, *rest: ran.append(cell.system))
    monkeypatch.setattr(command, "unavailable_reason", lambda: None)
    (tmp_path / "learning_rates.json").write_text(json.dumps({"digits": {"ddp": 0.05}}))
    argv = ["--systems", "ddp,gemps-gem,hivemind", "--workload", "digits", "--results", str(tmp_path)]
    assert command.main(argv) == 2
    assert ran == []  # ddp has its rate, but the sweep does not start to stop at gemps-gem
    assert "no learning rate for gemps-gem, hivemind on digits" in capsys.readouterr().err


def test_scenario_files_keep_their_path_and_names_that_would_collide_are_refused(tmp_path: Path) -> None:
    mine = tmp_path / "mine.json"
    mine.write_text(
        json.dumps({"name": "mine", "description": "(a), its server at 0.35 of a core", "coordinator_cpu": 0.35})
    )
    assert command._scenarios(["a", str(mine)]) == {"a": None, "mine": str(mine.resolve())}
    copied = tmp_path / "copy.json"
    copied.write_text(json.dumps({"name": "b", "description": "a copy of (b) that keeps its name"}))
    with pytest.raises(ValueError, match=r"copy.json is named 'b', as a shipped scenario is"):
        command._scenarios([str(copied)])
    with pytest.raises(ValueError, match=r"two scenarios are named 'mine'"):
        command._scenarios([str(mine), str(mine)])
