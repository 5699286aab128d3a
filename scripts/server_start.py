"""A plain `gemps server --port 0`'s start-up: its CPU and wall time until it writes its port file,
for this tree and, with --old-tree, another checkout alternating with it (the A/B of
docs/PERFORMANCE.md's "A server's start-up"; these machines are shared, so only same-run ratios count).

    .venv/bin/python scripts/server_start.py --starts 12 --old-tree /tmp/old

The other tree runs on this virtualenv with its source folders first on PYTHONPATH: byte-compile it
first (`python -m compileall`) where PYTHONDONTWRITEBYTECODE is set, and copy in its compiled
commit core, or both trees do not start alike.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SOURCE_FOLDERS = ("proto", "server", "client_sdk", "cli", "worker", "benchmarks")
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def start(tree: Path | None, port_file: Path) -> tuple[float, float]:
    """(seconds to serving, CPU seconds by then) of one server, stopped after."""
    env = dict(os.environ)
    if tree is not None:
        env["PYTHONPATH"] = os.pathsep.join(str(tree / folder) for folder in SOURCE_FOLDERS)
    began = time.monotonic()
    argv = [sys.executable, "-m", "gemps_cli", "server", "--port", "0", "--port-file", str(port_file)]
    server = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        while not (port_file.exists() and port_file.read_text().strip()):
            if server.poll() is not None:
                said = server.stderr.read().decode() if server.stderr is not None else ""
                raise SystemExit(f"the server exited with {server.returncode}: {said[-2000:]}")
            time.sleep(0.01)
        return time.monotonic() - began, cpu_seconds(server.pid)
    finally:
        server.terminate()
        server.wait()
        port_file.unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--starts", type=int, default=12, help="starts of each tree (default 12)")
    parser.add_argument("--old-tree", type=Path, help="another checkout, started in turn with this one")
    options = parser.parse_args(argv)
    if options.starts < 1:
        parser.error(f"--starts must be at least 1, not {options.starts}")
    trees: dict[str, Path | None] = {"this tree": None}
    if options.old_tree is not None:
        if not (options.old_tree / "server" / "gemps_server").is_dir():
            parser.error(f"--old-tree {options.old_tree}: not a gemps checkout (no server/gemps_server)")
        trees = {"old tree": options.old_tree.resolve(), "this tree": None}
    figures: dict[str, list[tuple[float, float]]] = {name: [] for name in trees}
    with tempfile.TemporaryDirectory() as scratch:
        for turn in range(options.starts):
            for name in list(trees)[:: 1 if turn % 2 == 0 else -1]:  # each tree first in every other turn
                figures[name].append(start(trees[name], Path(scratch) / "port"))
    for name, runs in figures.items():
        ready, cpu = statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)
        each = [round(r[1], 2) for r in runs]
        print(f"{name}: median {ready:.3f} s to serving, {cpu:.3f} s of CPU; CPU of each start {each}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
