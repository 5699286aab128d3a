"""`gemps plan` as a user runs it: the plan in words or as JSON, and a job or a calibration it
cannot use refused with exit 2 and a line naming what is wrong."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def gemps_plan(*arguments: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "gemps_cli", "plan", *arguments]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)


def test_between_hosts_the_plan_gives_both_ends_of_its_range() -> None:
    done = gemps_plan("--params", "100M", "--workers", "2", "--partitions", "4", "--local-steps", "1",
                      "--link", "1gbit", "--worker-link", "4gbit")  # fmt: skip
    assert done.returncode == 0, done.stderr
    line = next(line for line in done.stdout.splitlines() if line.lstrip().startswith("commits/s"))
    assert "where the workers' transfers fall into step" in line and "between the two" in line
    as_json = gemps_plan("--params", "100M", "--workers", "2", "--partitions", "4", "--local-steps", "1",
                         "--link", "1gbit", "--worker-link", "4gbit", "--json")  # fmt: skip
    planned = json.loads(as_json.stdout)
    assert planned["commits_per_s_in_step"] < planned["commits_per_s"]
    assert f"{planned['commits_per_s']:.1f}" in line and f"{planned['commits_per_s_in_step']:.1f}" in line
    assert planned["server_memory_bytes"] > 4 * 100_000_000  # θ at least, in float32


def test_a_job_it_cannot_plan_is_refused_naming_the_option() -> None:
    done = gemps_plan("--params", "1M", "--workers", "2", "--partitions", "0")
    assert done.returncode == 2 and "--partitions" in done.stderr and done.stdout == ""


def test_a_calibration_that_is_no_bench_results_file_is_refused_naming_it(tmp_path: Path) -> None:
    not_bench = tmp_path / "notes.json"
    not_bench.write_text('{"x": 1}')
    done = gemps_plan("--params", "1M", "--workers", "2", "--calibration", str(not_bench))
    assert done.returncode == 2
    assert f"--calibration {not_bench} is not a `gemps bench` results.json" in done.stderr
    partial = tmp_path / "partial.json"
    partial.write_text(json.dumps({"runs": [{"system": "gemps", "wire_dtype": "float32"}]}))
    done = gemps_plan("--params", "1M", "--workers", "2", "--calibration", str(partial))
    assert done.returncode == 2 and "a run has no field 'num_parameters'" in done.stderr


def test_rounds_are_planned_with_every_worker_in_step_from_the_measured_adamw_costs() -> None:
    arguments = ("--params", "124M", "--workers", "16", "--step-seconds", "0.5", "--link", "10gbit", "--rule", "adamw")
    done = gemps_plan(*arguments)
    assert done.returncode == 0, done.stderr
    planned = json.loads(gemps_plan(*arguments, "--json").stdout)
    assert planned["path"] == "adamw/float32+tcp" and planned["local_steps"] == 1
    assert planned["commits_per_s_in_step"] == planned["commits_per_s"]
    round_line = next(line for line in done.stdout.splitlines() if line.lstrip().startswith("a round"))
    assert f"{16 / planned['commits_per_s']:.3f} s" in round_line and "16 commits in step" in round_line
    assert planned["server_memory_bytes"] > 16 * 124_000_000  # θ, AdamW's two moments and the round's sum


def test_an_install_without_the_compiled_codes_is_told_its_int8_costs_are_above_the_plans() -> None:
    """The default calibration's int8 costs are the codec's compiled passes: an install that built
    none (no C compiler) runs numpy's, at several times the CPU, and `gemps plan` says so."""
    without = "import sys; sys.modules['gemps_proto._codes'] = None; from gemps_cli.main import main; sys.exit(main())"

    def plan_without_codes(*arguments: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-c", without, "plan", *arguments]
        return subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)

    arguments = ("--params", "10M", "--workers", "4", "--encoding", "int8")
    numpy_codes = plan_without_codes(*arguments)
    assert numpy_codes.returncode == 0, numpy_codes.stderr
    assert "int8 codes are numpy's" in numpy_codes.stderr and "--calibration" in numpy_codes.stderr
    compiled = gemps_plan(*arguments)
    assert compiled.returncode == 0 and compiled.stderr == "" and compiled.stdout == numpy_codes.stdout
    float32 = plan_without_codes(*arguments[:-2])
    assert float32.returncode == 0 and float32.stderr == ""  # float32 plans use no codes
