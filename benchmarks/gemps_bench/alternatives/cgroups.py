"""CPU quotas and process groups of cgroup v1: each worker of the emulated cluster in a cpu cgroup
of its own, its quota a fraction of one core (cpu.cfs_quota_us of cpu.cfs_period_us).

The group is also how the rig finds a worker's processes (its `cgroup.procs`: every process the
worker started, whatever the system's launcher does), to pause, resume or kill them together.
Needs root and cgroup v1's cpu controller at /sys/fs/cgroup/cpu (`unavailable_reason()`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

CPU_ROOT = Path("/sys/fs/cgroup/cpu")
PERIOD_US = 100_000


def unavailable_reason() -> str | None:
    """Why CPU quota groups cannot be made here (one line), or None."""
    if os.geteuid() != 0:
        return "the rig's CPU quotas need root (cgroup v1)"
    if not (CPU_ROOT / "cpu.cfs_quota_us").exists():
        return f"the rig's CPU quotas need cgroup v1's cpu controller at {CPU_ROOT}"
    return None


class CpuGroup:
    """One cpu cgroup: a quota in cores, the processes in it."""

    def __init__(self, parent: Path, name: str, cores: float, period_us: int = PERIOD_US) -> None:
        if not 1000 <= period_us <= 1_000_000:
            raise ValueError(f"a CPU period must be 1 ms to 1 s (the kernel's bounds), not {period_us} µs")
        self.path = parent / name
        self.path.mkdir(exist_ok=True)
        (self.path / "cpu.cfs_period_us").write_text(str(period_us))
        self.period_us = period_us
        self.cores = cores
        self.set_cores(cores)

    def set_cores(self, cores: float) -> None:
        """Quota `cores` of one core (0.2: a fifth), at least 1 ms a period (the kernel's minimum)."""
        if cores <= 0:
            raise ValueError(f"a CPU quota must be positive, not {cores}")
        (self.path / "cpu.cfs_quota_us").write_text(str(max(1000, round(cores * self.period_us))))

    def enter_argv(self) -> list[str]:
        """A prefix: the command after it runs in this group (its pid written first, then exec'd),
        so everything it starts is in the group from its first instruction."""
        return ["sh", "-c", f'echo $$ > "{self.path / "cgroup.procs"}" && exec "$@"', "sh"]

    def pids(self) -> list[int]:
        try:
            text = (self.path / "cgroup.procs").read_text()
        except FileNotFoundError:
            return []
        return [int(pid) for pid in text.split()]

    def signal(self, number: int, spare: set[int] | None = None) -> int:
        """Send `number` to every process in the group but `spare`; how many got it."""
        sent = 0
        for pid in self.pids():
            if spare and pid in spare:
                continue
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, number)
                sent += 1
        return sent

    def remove(self, timeout: float = 15.0) -> None:
        """SIGKILL what is left (resumed first: a stopped process dies only once continued), then
        rmdir, again until it goes: a dying launcher (DDP's agent) may start a process meanwhile."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.signal(signal.SIGCONT)
            self.signal(signal.SIGKILL)
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:  # EBUSY: a process is still in the group
                time.sleep(0.05)
        raise RuntimeError(f"{self.path} still holds processes {self.pids()} after {timeout} s")


class Groups:
    """A parent cgroup for one run (named after this process), its children the run's groups."""

    def __init__(self, label: str) -> None:
        reason = unavailable_reason()
        if reason is not None:
            raise RuntimeError(reason)
        self.parent = CPU_ROOT / f"gemps-alt-{os.getpid()}-{label}"
        self.parent.mkdir(exist_ok=True)
        self.groups: list[CpuGroup] = []

    def add(self, name: str, cores: float, period_us: int = PERIOD_US) -> CpuGroup:
        """A group of `cores`, given each `period_us` (a short period spreads the share finer: a
        fifth of each 10 ms rather than 20 ms of each 100 ms, nearer a core a fifth as fast)."""
        group = CpuGroup(self.parent, name, cores, period_us)
        self.groups.append(group)
        return group

    def close(self) -> None:
        for group in self.groups:
            group.remove()
        self.parent.rmdir()
