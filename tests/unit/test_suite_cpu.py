"""scripts/suite_cpu.py, run for real on child commands: it charges each process's CPU to the kind its
command line names (a server's argument naming a pytest folder does not make it a test runner), passes
the command's exit status on, and refuses to run nothing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "suite_cpu.py"
# Spends a second of CPU (not of wall: a loaded machine only makes it longer), so samples see it.
BUSY = "import time\nwhile time.process_time() < 1.0: pass"


def profile(tmp_path: Path, *command: str) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    out = tmp_path / "cpu.json"
    argv = [sys.executable, str(SCRIPT), "--out", str(out), "--", *command]
    ran = subprocess.run(argv, capture_output=True, text=True)
    return ran, json.loads(out.read_text()) if out.exists() else {}


def test_each_process_is_charged_to_the_kind_its_command_line_names(tmp_path: Path) -> None:
    server = [sys.executable, "-c", BUSY, "gemps_cli", "server", "--port-file", "/tmp/pytest-of-root/port"]
    etcd = [sys.executable, "-c", BUSY, "etcd"]
    driver = tmp_path / "driver.py"  # a file: its command line names neither kind
    driver.write_text(f"import subprocess\nfor c in ({server!r}, {etcd!r}): subprocess.run(c, check=True)\n")
    ran, figures = profile(tmp_path, sys.executable, str(driver))
    assert ran.returncode == 0, ran.stderr
    kinds = figures["kinds"]
    assert kinds["gemps servers"]["processes"] == 1 and kinds["gemps servers"]["cpu_s"] > 0, kinds
    assert kinds["etcd"]["processes"] == 1 and kinds["etcd"]["cpu_s"] > 0, kinds
    assert "test runners" not in kinds, kinds
    assert figures["exit"] == 0 and figures["cpu_s"] >= kinds["etcd"]["cpu_s"] + kinds["gemps servers"]["cpu_s"]
    assert "cores busy on average" in ran.stderr and "gemps servers" in ran.stderr


def test_the_commands_exit_status_is_passed_on(tmp_path: Path) -> None:
    ran, figures = profile(tmp_path, sys.executable, "-c", "raise SystemExit(3)")
    assert ran.returncode == 3 and figures["exit"] == 3, ran.stderr


def test_no_command_is_refused_saying_where_it_goes(tmp_path: Path) -> None:
    ran, figures = profile(tmp_path)
    assert ran.returncode == 2 and figures == {}
    assert "no command given: put it after --" in ran.stderr
