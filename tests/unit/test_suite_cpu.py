"""scripts/suite_cpu.py, run for real on child commands: it charges each process's CPU to the kind its
command line names (a server's arguments naming a pytest folder or its etcd make it neither a test
runner nor an etcd), passes the command's exit status on, and refuses to run nothing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "suite_cpu.py"
# Spends a second of CPU (not of wall: a loaded machine only makes it longer), then stays 3 s, so a
# sample reads that CPU before it ends: one that ended between two passes over /proc kept the CPU
# of the first pass's read, 0 (a fresh clone's `make test`, 19ea08a, with a pass slowed by load).
BUSY = "import time\nwhile time.process_time() < 1.0: pass\ntime.sleep(3)"


def profile(tmp_path: Path, *command: str) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    out = tmp_path / "cpu.json"
    argv = [sys.executable, str(SCRIPT), "--out", str(out), "--", *command]
    ran = subprocess.run(argv, capture_output=True, text=True)
    return ran, json.loads(out.read_text()) if out.exists() else {}


def test_each_process_is_charged_to_the_kind_its_command_line_names(tmp_path: Path) -> None:
    server = [
        sys.executable,
        "-c",
        BUSY,
        "gemps_cli",
        "server",
        "--etcd",
        "http://127.0.0.1:2379",
        "--port-file",
        "/tmp/pytest-of-root/p",
    ]
    etcd = [sys.executable, "-c", BUSY, "etcd"]
    driver = tmp_path / "driver.py"  # a file: its command line names neither kind
    driver.write_text(f"import subprocess\nfor c in ({server!r}, {etcd!r}): subprocess.run(c, check=True)\n")
    ran, figures = profile(tmp_path, sys.executable, str(driver))
    assert ran.returncode == 0, ran.stderr
    # Its own processes: the sampler sees the whole machine, other tests' processes too in a parallel run.
    own = {seen["kind"]: seen for seen in figures["processes"] if "process_time" in seen["command"]}
    assert set(own) == {"gemps servers", "etcd"} and all(seen["cpu_s"] > 0 for seen in own.values()), own
    (driving,) = [seen for seen in figures["processes"] if str(driver) in seen["command"]]
    assert driving["kind"] == "workers, scripts, other", driving
    kinds = figures["kinds"]  # rounded to a tenth
    assert kinds["gemps servers"]["cpu_s"] >= own["gemps servers"]["cpu_s"] - 0.05, kinds
    # Not `"test runners" not in kinds`: another test's `python -m pytest --collect-only`
    # (test_suite_split), started meanwhile in a parallel run, is one (CI of 76fbd22).
    assert kinds["etcd"]["cpu_s"] >= own["etcd"]["cpu_s"] - 0.05, kinds
    # Each figure rounded to a tenth: the two kinds' may come to 0.1 more than the rounded total.
    both = kinds["etcd"]["cpu_s"] + kinds["gemps servers"]["cpu_s"]
    assert figures["exit"] == 0 and figures["cpu_s"] >= both - 0.1 - 1e-9, figures
    assert "cores busy on average" in ran.stderr and "gemps servers" in ran.stderr


def test_the_commands_exit_status_is_passed_on(tmp_path: Path) -> None:
    ran, figures = profile(tmp_path, sys.executable, "-c", "raise SystemExit(3)")
    assert ran.returncode == 3 and figures["exit"] == 3, ran.stderr


def test_no_command_is_refused_saying_where_it_goes(tmp_path: Path) -> None:
    ran, figures = profile(tmp_path)
    assert ran.returncode == 2 and figures == {}
    assert "no command given: put it after --" in ran.stderr


def test_a_process_is_known_by_the_command_it_was_started_with_not_a_title_it_takes(tmp_path: Path) -> None:
    """A test runner's in-process server retitles the runner: charged by its newest title, the runners'
    CPU went to the servers. (Ray's workers, which retitle themselves at once, are known by "ray::".)"""
    title = "'gemps ' + 'server --port 1'"  # joined when run: the command line itself names no server
    retitled = f"import setproctitle, time\ntime.sleep(1.5)\nsetproctitle.setproctitle({title})\n{BUSY}"
    ran, figures = profile(tmp_path, sys.executable, "-c", retitled, "etcd")
    assert ran.returncode == 0, ran.stderr
    # Only the command's own process: other tests' processes run beside it under a parallel run.
    (process,) = [seen for seen in figures["processes"] if "setproctitle" in seen["command"]]
    assert process["kind"] == "etcd" and process["command"].endswith(" etcd") and process["cpu_s"] > 0.3, process
    assert figures["kinds"]["etcd"]["cpu_s"] >= process["cpu_s"] - 0.05, figures["kinds"]  # rounded to a tenth
