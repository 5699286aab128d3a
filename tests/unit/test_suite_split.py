"""The suite's split between `make test` and `make test-long` (tests/conftest.py): the marker
expressions the Makefile gives pytest, applied by pytest's own collection to a few modules of each
kind, select every test exactly once between them, and CI runs both targets."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MODULES = {
    "plain": "tests/unit/test_framing.py",
    "alone module": "tests/e2e/test_demo.py",
    "a group's module": "tests/e2e/test_install_system_deps.py",
    "one alone test beside others": "tests/integration/test_data_plane_tls_flood.py",
    "an experiment": "tests/e2e/test_adam_replay.py",
}


def target_markers(target: str) -> list[str]:
    """The `-m` expressions of a Makefile target's pytest lines, in order."""
    recipe = re.search(rf"^{re.escape(target)}:.*\n((?:\t.*\n|.*\\\n)+)", (ROOT / "Makefile").read_text(), re.M)
    assert recipe is not None, f"no {target} target"
    return re.findall(r'pytest [^\n]*?-m ("[^"]+"|\S+)', recipe.group(1))


def collected(markers: str, *modules: str) -> set[str]:
    listed = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-m", markers, *modules],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert listed.returncode in (0, 5), listed.stdout + listed.stderr  # 5: nothing selected
    return {line for line in listed.stdout.splitlines() if "::" in line}


def test_make_test_and_make_test_long_select_every_test_once() -> None:
    short, long = target_markers("test"), target_markers("test-long")
    assert [m.strip('"') for m in short] == ["not long"], short
    assert len(long) == 2, long
    every = collected("", *MODULES.values())
    phases = [collected(m.strip('"'), *MODULES.values()) for m in (*short, *long)]
    assert sum(len(p) for p in phases) == len(every) and set().union(*phases) == every  # disjoint, and all of them
    in_make_test = {test.split("::")[0] for test in phases[0]}
    assert in_make_test == {MODULES["plain"], MODULES["one alone test beside others"]}, in_make_test
    alone_modules = {test.split("::")[0] for test in phases[2]}
    assert alone_modules == {MODULES["alone module"], MODULES["one alone test beside others"]}, alone_modules


def test_ci_runs_the_readme_command_and_the_long_suites() -> None:
    steps = [line.strip() for line in (ROOT / ".ci/run").read_text().splitlines() if line.startswith("make ")]
    assert steps == ["make test", "make test-long"], steps
    assert "make test " in (ROOT / "README.md").read_text()
