"""Where a command's CPU goes, by kind of process: runs it while sampling every process in /proc
twice a second, then sums each process's last CPU time seen by what its command line says it is
(gemps servers, workers, Ray, containers, etcd, the test runners...).

    .venv/bin/python scripts/suite_cpu.py --out /tmp/suite-cpu.json -- \
        .venv/bin/python -m pytest -n 2 --dist loadgroup -m "not alone"

This is how docs/guides/testing.md's profile of the suite was taken. Processes that live under half
a second are missed, and each one's last half second: the sums are lower bounds. Processes started
before the command (a daemon, the kernel's threads) are left out, so a long-lived helper that the
command only talks to is not charged to it. A process is known by the first command line seen, not
a title it gives itself later (a test runner's in-process server retitles the runner). --out also
keeps every process, for the questions the kinds do not answer.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

PERIOD_S = 0.5
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")

# First match wins: a server's command line names a pytest folder, so the runners are matched by
# how xdist starts them, not by "pytest" anywhere.
KINDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("ray", ("ray::", "default_worker", "raylet", "gcs_server", "/ray/", "dashboard")),
    ("test runners", ("import sys;exec", "-m pytest")),
    ("containers", ("runc", "podman", "conmon", "buildah", "/opt/gemps/")),
    ("gemps servers", ("gemps_cli server", "gemps server")),  # before etcd: a replica's names its --etcd
    ("etcd", ("etcd",)),
    ("bench, peers, DDP", ("gemps_bench", "forkserver", "torch.distributed", "ddp_worker", "multiprocessing.spawn")),
    ("type checks, docs", ("mypy", "mkdocs")),
    ("soak clients", ("soak",)),
)
OTHER = "workers, scripts, other"


def kind_of(command: str) -> str:
    for kind, signs in KINDS:
        if any(sign in command for sign in signs):
            return kind
    return OTHER


@dataclass
class Seen:
    command: str  # as started: the first line seen that is not its parent's (fork before exec)
    cpu_s: float
    parent: str  # the parent's pid


@dataclass(frozen=True)
class Read:
    start: str  # clock ticks after boot: with the pid, names the process
    cpu_s: float
    command: str
    parent: str


def _read(pid: str) -> Read | None:
    """One process now; None if it ended meanwhile."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        fields = stat[stat.rindex(")") + 2 :].split()
        command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except (OSError, ValueError):
        return None
    cpu = (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime + stime
    return Read(fields[19], cpu, command.strip(), fields[1])


def _processes() -> Iterator[tuple[tuple[str, str], Read]]:
    """((pid, start), what it is now) of every process running now."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        read = _read(pid)
        if read is not None:
            yield (pid, read.start), read


class Sampler:
    """Every process that started after it did, keyed by (pid, start) so a reused pid is a new one."""

    def __init__(self) -> None:
        self.before = {key for key, _ in _processes()}
        self.seen: dict[tuple[str, str], Seen] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def sample(self) -> None:
        now = dict(_processes())
        lines = {pid: read.command for (pid, _), read in now.items()}
        for key, read in now.items():
            if key in self.before:
                continue
            entry = self.seen.setdefault(key, Seen(read.command, read.cpu_s, read.parent))
            entry.cpu_s = read.cpu_s
            if not entry.command or lines.get(entry.parent) == entry.command:
                entry.command = read.command  # seen before its exec (or as a zombie): not yet its own

    def _run(self) -> None:
        while not self._stop.wait(PERIOD_S):
            self.sample()

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()


def by_kind(seen: dict[tuple[str, str], Seen]) -> dict[str, dict[str, float]]:
    cpu: defaultdict[str, float] = defaultdict(float)
    count: Counter[str] = Counter()
    for process in seen.values():
        kind = kind_of(process.command)
        cpu[kind] += process.cpu_s
        count[kind] += 1
    most_first = sorted(cpu.items(), key=lambda item: -item[1])
    return {kind: {"cpu_s": round(seconds, 1), "processes": count[kind]} for kind, seconds in most_first}


def main(argv: list[str] | None = None) -> int:
    summary = __doc__.split("\n\n")[0]
    parser = argparse.ArgumentParser(description=summary, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--out", type=Path, help="also write the figures as JSON here")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command to run, after --")
    options = parser.parse_args(argv)
    command = options.command[1:] if options.command[:1] == ["--"] else options.command
    if not command:
        parser.error("no command given: put it after --, e.g. -- make test")
    started = time.monotonic()
    with Sampler() as sampler:
        returncode = subprocess.call(command)
    wall = time.monotonic() - started
    kinds = by_kind(sampler.seen)
    total = sum(kind["cpu_s"] for kind in kinds.values())
    print(f"\n{' '.join(command)}: exit {returncode}, {wall:.0f} s wall, {total:.0f} s of CPU seen "
          f"({total / wall:.2f} cores busy on average)", file=sys.stderr)  # fmt: skip
    for kind, figures in kinds.items():
        print(f"{figures['cpu_s']:8.0f} s  {figures['processes']:5.0f} processes  {kind}", file=sys.stderr)
    if options.out is not None:
        figures = {"command": command, "exit": returncode, "wall_s": round(wall, 1), "cpu_s": round(total, 1)}
        processes = [
            {"pid": pid, "cpu_s": seen.cpu_s, "kind": kind_of(seen.command), "command": seen.command}
            for (pid, _), seen in sorted(sampler.seen.items(), key=lambda item: -item[1].cpu_s)
        ]
        options.out.write_text(json.dumps({**figures, "kinds": kinds, "processes": processes}, indent=1) + "\n")
    return returncode


if __name__ == "__main__":
    sys.exit(main())
