"""What `pip install gemps` adds to a fresh virtual environment, and that the SDK it installs trains.

Builds this checkout's wheel, makes two fresh venvs with the interpreter this runs on (one bare, one
with the wheel installed from the package index: the SDK alone, as a worker installs it), and
reports the distributions and megabytes the SDK added (`du` of site-packages, the bare venv's pip
and setuptools taken off). Then a real `gemps server` (this environment's) serves a worker that
runs in the SDK's venv, where numpy is not installed (tests/numpy_free_worker.py: register, commit
by name, flat and with buffers, pull): the install is not only small, it works.

    .venv/bin/python scripts/sdk_install_size.py [--extras numpy] [--keep /tmp/sdk-venvs]
    .venv/bin/python scripts/sdk_install_size.py --source /tmp/old-checkout --no-worker   # an earlier commit's

Needs the package index (pip downloads grpcio and protobuf). Results: docs/guides/install.md.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from gemps_worker.cluster import ServerProcess

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "numpy_free_worker.py"


def run(*command: str | Path, cwd: Path | None = None) -> str:
    done = subprocess.run([str(part) for part in command], cwd=cwd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(map(str, command))} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return done.stdout


def site_packages_kib(venv: Path) -> int:
    (site,) = venv.glob("lib/python*/site-packages")
    return int(run("du", "-sk", site).split()[0])


def distributions(venv: Path) -> list[str]:
    listed = json.loads(run(venv / "bin" / "python", "-m", "pip", "list", "--format", "json"))
    return sorted(f"{entry['name']} {entry['version']}" for entry in listed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--extras", default="", help="install gemps[EXTRAS] instead (numpy: the SDK with numpy)")
    parser.add_argument("--keep", type=Path, help="build the venvs here and leave them (default: a temporary folder)")
    parser.add_argument("--source", type=Path, default=ROOT, help="the checkout to build (default: this one)")
    parser.add_argument(
        "--no-worker", action="store_true", help="measure only (an earlier SDK lacks the worker's needs)"
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        folder = args.keep or Path(scratch)
        folder.mkdir(parents=True, exist_ok=True)
        run(
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            args.source,
            "-w",
            folder,
        )
        (wheel,) = folder.glob("gemps-*.whl")
        base = getattr(sys, "_base_executable", sys.executable)  # the interpreter, not this venv's
        bare, sdk = folder / "bare", folder / "sdk"
        for venv in (bare, sdk):
            run(base, "-m", "venv", "--clear", venv)
        requirement = f"{wheel}[{args.extras}]" if args.extras else str(wheel)
        run(sdk / "bin" / "python", "-m", "pip", "install", "--quiet", requirement)
        added = distributions(sdk)
        added = [entry for entry in added if entry not in distributions(bare)]
        mib = (site_packages_kib(sdk) - site_packages_kib(bare)) / 1024
        installed = f"gemps[{args.extras}]" if args.extras else "gemps"
        print(f"pip install {installed} adds {mib:.1f} MiB in {len(added)} distributions:")
        print("  " + ", ".join(added))
        if args.no_worker:
            return
        with ServerProcess(rule="downpour", learning_rate=1.0) as server:
            flags = ["--with-numpy"] if "numpy" in args.extras else []
            found = json.loads(run(sdk / "bin" / "python", WORKER, "--target", server.target, *flags, cwd=folder))
        theta = found["committed"]["theta"]
        print(f"a worker in that venv (numpy importable: {found['numpy']}) registered and committed 3 times:")
        print(f"  version {found['committed']['version']}, θ[:3] = {[round(value, 4) for value in theta[:3]]}")


if __name__ == "__main__":
    main()
