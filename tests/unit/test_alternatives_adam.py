"""The comparison's Adam path (issue 78, item 3): each system's learning-rate grid as it declares it
(the SGD systems the workload's, the Adam-path ones one AdamW grid), the search running that grid,
and the command lines that give the workers nanoGPT's AdamW (and DDP its bf16 hook)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from gemps_bench.alternatives import main as command
from gemps_bench.alternatives.contract import local_optimizer, parse_worker_args, worker_argv, worker_parser
from gemps_bench.alternatives.systems.base import ADAMW_LEARNING_RATES, RunPlan
from gemps_bench.alternatives.systems.peers import manifest
from gemps_bench.alternatives.systems.registry import system, system_names
from gemps_bench.alternatives.workloads import WORKLOADS, targets, workload
from gemps_cli.server import parse_config

ADAM_PATH = {"gemps-adam", "gemps-adamw", "gemps-adamw-int8", "gemps-adamw-windows", "gemps-adamw-windows-long"}
ADAM_PATH |= {"ddp-adamw", "ddp-adamw-bf16"}
ADAM_PATH |= {"torchft_ddp_adamw", "hivemind_adamw", "gemps-adamw-all"}
# AdamW is the server's rule: its workers commit gradients
ON_THE_SERVER = {"gemps-adamw", "gemps-adamw-int8", "gemps-adamw-all"}


def plan(tmp_path: Path) -> RunPlan:
    return RunPlan(workload("charlm"), 8, 0, 1e-3, tmp_path, 90.0, "10.0.0.1", tuple(f"10.0.1.{i}" for i in range(8)))


def program_flags(argv: list[str]) -> list[str]:
    """A launch's worker-program flags: after its last `-m MODULE` (DDP's comes after torchrun's own)."""
    last = len(argv) - 1 - argv[::-1].index("-m")
    return argv[last + 2 :]


def test_every_system_declares_its_grid_the_sgd_ones_the_workloads_unchanged() -> None:
    assert set(system_names()) >= ADAM_PATH
    assert ADAMW_LEARNING_RATES == (5e-4, 1e-3, 2e-3, 4e-3)
    for name in system_names():
        for chosen in WORKLOADS.values():
            expected = ADAMW_LEARNING_RATES if name in ADAM_PATH else (0.025, 0.05, 0.1)
            assert system(name).learning_rates(chosen) == expected, (name, chosen.name)
    # DiLoCo's inner AdamW keeps its mapping of the SGD grid (4e-4 at 0.05): its recorded rate keeps its meaning
    assert system("torchft_diloco").optimizer == "sgd"


def test_the_search_runs_each_systems_own_grid_and_keeps_the_recorded_rates(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The command's own order of work, the rig's runs replaced by their results (they run for real in
    tests/integration/test_alternatives_adam.py and tests/e2e/test_alternatives_rig.py)."""
    ran: list[tuple[str, float]] = []

    def fake_run(cell: Any, runs: Path, rate: float, target: float) -> dict[str, Any]:
        ran.append((cell.system, rate))
        final = 2.0 - rate if cell.system == "ddp-adamw" else 2.0 + rate  # AdamW's best: its largest rate
        return {"cell": {"scenario": cell.scenario, "system": cell.system, "workload": cell.workload,
                         "seed": cell.seed}, "time_to_target_s": None, "final": {"accuracy": 0.3, "loss": final},
                "goodput": 1.0, "bytes_per_sample": 100.0, "restarts": 0, "load_average": [1.0],
                "learning_rate": rate, "duration_s": 60.0, "target": target}  # fmt: skip

    monkeypatch.setattr(command, "run_cell", fake_run)
    monkeypatch.setattr(command, "unavailable_reason", lambda: None)
    recorded = {"charlm": {"ddp": 0.025, "torchft_diloco": 0.05}, "digits": {"gemps-gem": 0.1}}
    (tmp_path / "learning_rates.json").write_text(json.dumps(recorded))
    argv = ["--search", "--systems", "ddp,ddp-adamw", "--workload", "charlm", "--results", str(tmp_path)]
    assert command.main(argv) == 0
    assert ran == [("ddp", r) for r in (0.025, 0.05, 0.1)] + [("ddp-adamw", r) for r in ADAMW_LEARNING_RATES]
    rates = json.loads((tmp_path / "learning_rates.json").read_text())
    assert rates == {"charlm": {"ddp": 0.025, "torchft_diloco": 0.05, "ddp-adamw": 4e-3}, "digits": {"gemps-gem": 0.1}}
    table = (tmp_path / "charlm.md").read_text()
    assert "| a | ddp | 0.025 |" in table and "| a | ddp-adamw | 0.004 |" in table


def test_the_adam_path_systems_give_their_workers_adamw_and_the_sgd_ones_nothing_new(tmp_path: Path) -> None:
    chosen = plan(tmp_path)
    for name in system_names():
        flags = program_flags(system(name).worker(chosen, 1).argv)
        parsed = parse_worker_args(worker_parser(""), flags)
        workers_adamw = name in ADAM_PATH - ON_THE_SERVER
        assert parsed.optimizer == ("adamw" if workers_adamw else "sgd"), name
        assert ("--optimizer" in flags) == workers_adamw, name  # the SGD systems' command lines as before
    server = system("gemps-adam").coordinator(chosen)
    worker = system("gemps-adam").worker(chosen, 0).argv
    assert server is not None and server.argv[server.argv.index("--rule") + 1] == "downpour"
    assert worker[worker.index("--mode") + 1] == "local-steps" and "--supervise" in worker
    assert parse_worker_args(worker_parser(""), program_flags(worker)).lr == 1e-3  # AdamW's own rate, as searched
    rounds = system("gemps-adamw").coordinator(chosen)
    assert rounds is not None
    assert [rounds.argv[rounds.argv.index(flag) + 1] for flag in ("--rule", "--backup-workers", "--learning-rate")] == [
        "adamw", "1", "0.001",
    ]  # fmt: skip
    coded = system("gemps-adamw-int8")
    assert coded.coordinator(chosen) == rounds  # the same server: only the workers' codes differ
    waiting = system("gemps-adamw-all").coordinator(chosen)  # every round waits for all 8: DDP's computation
    expected = list(rounds.argv)
    expected[expected.index("--backup-workers") + 1] = "0"
    assert waiting is not None and list(waiting.argv) == expected
    for name, codes in (("gemps-adamw-int8", "int8"), ("gemps-adamw", "none")):
        argv = system(name).worker(chosen, 0).argv
        assert argv[argv.index("--compression") + 1] == codes, name
    hooked = system("ddp-adamw-bf16").worker(chosen, 0).argv
    assert hooked[hooked.index("--comm-hook") + 1] == "bf16"
    assert "--comm-hook" not in system("ddp-adamw").worker(chosen, 0).argv
    assert "--comm-hook" not in system("ddp").worker(chosen, 0).argv
    for name, program in (("torchft_ddp_adamw", "torchft_ddp"), ("hivemind_adamw", "hivemind")):
        argv = system(name).worker(chosen, 0).argv
        assert argv[argv.index("-m") + 1] == f"gemps_bench.alternatives.peers.{program}", name


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_the_slow_link_windows_are_the_guides_recipe_and_every_gemps_server_starts_as_given(tmp_path: Path) -> None:
    """gemps-adamw-windows: each worker's AdamW in LocalSteps(steps=8), int8 both ways, the server's
    rounds averaged (outer_rate 1), none waiting for the slowest; gemps-adam keeps a step a commit.
    Every gemps system's server command is one `gemps server` accepts as it stands (an option the
    rule would leave idle, as AdamW's betas under outer_rate, is refused there)."""
    chosen = plan(tmp_path)
    windows = system("gemps-adamw-windows")
    worker = windows.worker(chosen, 0).argv
    assert [flag(worker, name) for name in ("--mode", "--local-steps", "--compression", "--optimizer")] == [
        "local-steps", "8", "int8", "adamw",
    ]  # fmt: skip
    assert "--beta1" not in worker  # nanoGPT's 0.9: a cell is a short run
    long_run = system("gemps-adamw-windows-long").worker(chosen, 0).argv
    assert flag(long_run, "--beta1") == "0.95" and long_run[: long_run.index("--beta1")] == worker
    every_step = system("gemps-adam").worker(chosen, 0).argv
    assert flag(every_step, "--local-steps") == "1" and "--beta1" not in every_step
    server = windows.coordinator(chosen)
    assert server is not None
    training = parse_config(server.argv[server.argv.index("server") + 1 :]).training
    options = training.rule_options
    assert (training.rule, options["outer_rate"], options["backup_workers"]) == ("adamw", 1.0, 1)
    for name in system_names():
        launch = system(name).coordinator(chosen)
        if name.startswith("gemps") and launch is not None:
            parse_config(launch.argv[launch.argv.index("server") + 1 :])  # raises ValueError naming a problem


def test_the_local_optimizers_are_the_contracts_sgd_and_nanogpts_adamw() -> None:
    model = workload("charlm").build_model()
    sgd = local_optimizer("sgd", model, 0.05)
    assert isinstance(sgd, torch.optim.SGD) and sgd.defaults["momentum"] == 0.9 and sgd.defaults["lr"] == 0.05
    adamw = local_optimizer("adamw", model, 2e-3)
    assert isinstance(adamw, torch.optim.AdamW) and adamw.defaults["betas"] == (0.9, 0.99)
    decays = {group["weight_decay"]: group for group in adamw.param_groups}
    assert set(decays) == {0.1, 0.0} and all(p.dim() >= 2 for p in decays[0.1]["params"])
    assert all(p.dim() < 2 for p in decays[0.0]["params"]) and all(g["lr"] == 2e-3 for g in adamw.param_groups)
    with pytest.raises(ValueError, match="unknown --optimizer 'lamb'; choose from sgd, adamw"):
        local_optimizer("lamb", model, 1e-3)
    assert local_optimizer("adamw", model, 2e-3, beta1=0.95).defaults["betas"] == (0.95, 0.99)
    with pytest.raises(ValueError, match=r"a β1 of 0\.95 is AdamW's; --optimizer sgd steps with momentum 0\.9"):
        local_optimizer("sgd", model, 0.05, beta1=0.95)
    flags = worker_argv("m", "digits", 0, 1, 0, 32, 1e-3, Path("run"), 5.0)
    with pytest.raises(SystemExit):
        parse_worker_args(worker_parser(""), [*flags[2:], "--optimizer", "lamb"])


def test_a_manifest_entry_with_an_unknown_optimizer_is_refused_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "peers.json"
    path.write_text(json.dumps({"torchft_ddp_lamb": {"program": "torchft_ddp", "optimizer": "lamb"}}))
    with pytest.raises(ValueError, match="torchft_ddp_lamb's optimizer 'lamb'; choose from sgd, adamw"):
        manifest(path)


def test_a_deeper_target_is_chosen_by_name_and_never_mixed_with_another_in_one_table(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--target deep` measures charlm's cells to the loss read from one AdamW worker's curve
    (targets.json); a name the workload lacks is refused naming the ones it has, and cells of one
    target are refused a folder of another's, where the table's times would mean two things."""
    ran: list[float] = []

    def fake_run(cell: Any, runs: Path, rate: float, target: float) -> dict[str, Any]:
        ran.append(target)
        return {"cell": {"scenario": cell.scenario, "system": cell.system, "workload": cell.workload,
                         "seed": cell.seed}, "time_to_target_s": 9.0, "final": {"accuracy": 0.3, "loss": 2.0},
                "goodput": 1.0, "bytes_per_sample": 100.0, "restarts": 0, "load_average": [1.0],
                "learning_rate": rate, "duration_s": 60.0, "target": target}  # fmt: skip

    monkeypatch.setattr(command, "run_cell", fake_run)
    monkeypatch.setattr(command, "unavailable_reason", lambda: None)
    deep = targets()["charlm"]["deep"]
    assert deep < targets()["charlm"]["target"]
    argv = ["--systems", "ddp-adamw", "--workload", "charlm", "--lr", "2e-3", "--results", str(tmp_path)]
    assert command.main([*argv, "--target", "deep"]) == 0
    assert ran == [deep] and f"Time to target: to held-out loss {deep:g}." in (tmp_path / "charlm.md").read_text()
    assert command.main([*argv, "--target", "target"]) == 2
    said = capsys.readouterr().err
    assert f"holds cells measured to {deep:g}, not 2.5" in said and "their own --results folder" in said
    assert command.main([*argv, "--target", "deeper"]) == 2
    assert "no target 'deeper' for charlm in targets.json: choose from target, ci, deep" in capsys.readouterr().err
    assert command.main(["--workload", "digits", "--target", "deep", "--results", str(tmp_path)]) == 2
    assert "no target 'deep' for digits in targets.json: choose from target, ci" in capsys.readouterr().err
    assert ran == [deep]


@pytest.mark.parametrize(
    "flags",
    [
        ["--mode", "gradient", "--optimizer", "adamw", "--beta1", "0.95"],  # no local AdamW to give it to
        ["--mode", "local-steps", "--beta1", "0.95"],  # the contract's SGD
        ["--mode", "local-steps", "--optimizer", "adamw", "--beta1", "1.0"],  # outside [0, 1)
    ],
)
def test_the_gemps_programs_beta1_is_refused_where_no_adamw_would_use_it(flags: list[str], tmp_path: Path) -> None:
    program = "gemps_bench.alternatives.systems.gemps_program"
    argv = [sys.executable, *worker_argv(program, "charlm", 0, 1, 0, 16, 1e-3, tmp_path, 5.0), *flags]
    finished = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    assert finished.returncode == 2
    assert "--beta1" in finished.stderr and "for --mode local-steps --optimizer adamw" in finished.stderr
