"""tools/install-system-deps --all on the route without ../shared/tools/container-rig (a fresh Debian
machine): a podman-compose too old to honour `--scale` (Debian bookworm's 1.0.3 accepts it and
starts one replica) is replaced by PyPI's, in a virtual environment of its own, linked first on
PATH. The other tools are present (stand-ins that only exist), so nothing else is installed; the
venv and the link go to temporary folders (GEMPS_TOOLS_DIR, GEMPS_TOOLS_BIN). Needs PyPI.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "install-system-deps"
# What Debian bookworm's podman-compose 1.0.3 prints for --version (it runs podman too).
DEBIAN_VERSION_OUTPUT = "podman-composer version  1.0.3\npodman --version \npodman version 4.3.1\nexit code: 0\n"

pytestmark = pytest.mark.timeout(600)


def stub(path: Path, output: str = "") -> None:
    path.write_text(f"#!/bin/sh\ncat <<'OUT'\n{output}OUT\n")
    path.chmod(0o755)


def version_of(command: Path) -> tuple[int, ...]:
    printed = subprocess.run([str(command), "--version"], capture_output=True, text=True, timeout=60).stdout
    found = re.search(r"podman-compos(?:e|er) version:? +(\d+(?:\.\d+)+)", printed)
    assert found is not None, printed
    return tuple(int(part) for part in found.group(1).split("."))


def debian_machine(tmp_path: Path) -> dict[str, str]:
    """The environment of a machine with Debian's podman-compose 1.0.3 and no rig; stand-ins for the rest."""
    bin_dir, tools = tmp_path / "bin", tmp_path / "tools"
    bin_dir.mkdir()
    for tool in ("prometheus", "promtool"):
        stub(bin_dir / tool)
    stub(bin_dir / "podman", "podman version 4.3.1\n")  # podman-compose --version asks it
    stub(bin_dir / "podman-compose", DEBIAN_VERSION_OUTPUT)
    assert version_of(bin_dir / "podman-compose") == (1, 0, 3)
    python_dir = str(Path(sys.base_prefix) / "bin")  # a python3 with venv, as Debian's
    return {
        **os.environ,
        "PATH": os.pathsep.join([str(bin_dir), "/usr/bin", "/bin", python_dir]),  # not /usr/local/bin
        "GEMPS_CONTAINER_RIG": str(tmp_path / "no-rig"),
        "GEMPS_TOOLS_DIR": str(tools),
        "GEMPS_TOOLS_BIN": str(bin_dir),
    }


def test_make_tests_own_route_leaves_the_containers_tools_alone(tmp_path: Path) -> None:
    """Without --all (what `make test` runs) nothing of the long suites' is checked or installed."""
    env = debian_machine(tmp_path)
    result = subprocess.run([str(SCRIPT)], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stderr == "", result.stderr
    assert version_of(tmp_path / "bin" / "podman-compose") == (1, 0, 3) and not (tmp_path / "tools").exists()


def test_an_unknown_argument_is_refused_by_name(tmp_path: Path) -> None:
    result = subprocess.run([str(SCRIPT), "--containers"], env=debian_machine(tmp_path), capture_output=True, text=True)
    assert result.returncode == 2 and "unknown argument '--containers'" in result.stderr, result.stderr


def test_an_old_podman_compose_is_replaced_by_one_that_honours_scale(tmp_path: Path) -> None:
    env = debian_machine(tmp_path)
    bin_dir, tools = tmp_path / "bin", tmp_path / "tools"
    result = subprocess.run([str(SCRIPT), "--all"], env=env, capture_output=True, text=True, timeout=540)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "found: 1.0.3; --scale needs 1.1 or later" in result.stderr
    installed = bin_dir / "podman-compose"
    assert installed.resolve() == tools / "podman-compose" / "bin" / "podman-compose"
    assert version_of(installed) >= (1, 1)
    again = subprocess.run([str(SCRIPT), "--all"], env=env, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0 and again.stderr == "", again.stderr  # idempotent: silent when done
