"""What /proc says about a process (Linux): resident memory and CPU time, and the CPU time a
process spends inside a measurement window."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path


def _status_field(pid: int, name: str) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(name + ":"):
                return int(line.split()[1]) * 1024  # reported in kB
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    return None


def peak_rss(pid: int) -> int | None:
    """The process's peak resident set size so far (VmHWM), bytes; None once it has exited."""
    return _status_field(pid, "VmHWM")


def resident_bytes(pid: int) -> int | None:
    """The process's resident set size now (VmRSS), bytes; None once it has exited."""
    return _status_field(pid, "VmRSS")


def shared_rss(pid: int) -> int | None:
    """Resident shared memory the process maps (RssShmem), bytes: a gemps server's share of the
    memory its local clients attached (theirs, mapped here); None once it has exited."""
    return _status_field(pid, "RssShmem")


def private_rss(pid: int) -> int | None:
    """Resident private anonymous memory (RssAnon), bytes: the heap numpy's arrays live in (no
    shared memory, no mapped files); None once the process has exited."""
    return _status_field(pid, "RssAnon")


def cpu_seconds(pid: int) -> float | None:
    """User plus system CPU time the process (all its threads) has used, seconds; None once gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime in clock ticks


def machine_cpu_ticks() -> tuple[int, int]:
    """(busy, total) clock ticks of every core since boot (/proc/stat): busy is all but idle and iowait."""
    ticks = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    return sum(ticks) - ticks[3] - ticks[4], sum(ticks)


def children(pid: int) -> list[int]:
    """The process's child processes (e.g. a `gemps server --partitions K`'s partitions)."""
    try:
        return [int(child) for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return []


def partition_pids(supervisor_pid: int) -> dict[int, int]:
    """Partition index -> pid of a `gemps server --partitions K` supervisor's live children."""
    found = {}
    for pid in children(supervisor_pid):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:  # exited and gone
            continue
        index = next((v for v in environ if v.startswith(b"GEMPS_PARTITION_INDEX=")), None)
        if index is None:  # exited, not reaped yet: a zombie's environ reads empty
            continue
        found[int(index.split(b"=")[1])] = pid
    return found


def tree_peak_rss(pid: int) -> int | None:
    """Peak resident memory of the process and its children, summed (each one's own peak)."""
    peaks = [peak_rss(p) for p in (pid, *children(pid))]
    return sum(p for p in peaks if p is not None) if peaks[0] is not None else None


class WindowCpu:
    """The CPU seconds process `pid` and its children use between two monotonic instants,
    sampled by a thread: start() before the window, `seconds` (the total) and `per_child`
    after it ends (None when a sample was missed); `shared_bytes`, their resident shared memory
    at the window's end (the clients are still connected then); `machine_busy`, the share of
    the machine's cores busy in the window, whoever used them (on a shared machine: how much CPU
    there was to spare)."""

    def __init__(self, pid: int, begin: float, end: float) -> None:
        self._pid, self._begin, self._end = pid, begin, end
        self._samples: list[dict[int, float | None]] = []
        self._machine: list[tuple[int, int]] = []
        self.shared_bytes: int | None = None
        self._thread = threading.Thread(target=self._run, name="window-cpu", daemon=True)

    def start(self) -> WindowCpu:
        self._thread.start()
        return self

    def _run(self) -> None:
        for instant in (self._begin, self._end):
            time.sleep(max(0.0, instant - time.monotonic()))
            processes = (self._pid, *children(self._pid))
            self._samples.append({p: cpu_seconds(p) for p in processes})
            self._machine.append(machine_cpu_ticks())
        self.shared_bytes = sum(shared_rss(p) or 0 for p in processes)

    def _deltas(self) -> dict[int, float] | None:
        self._thread.join(timeout=max(0.0, self._end - time.monotonic()) + 5.0)
        if len(self._samples) != 2:
            return None
        before, after = self._samples
        if set(before) != set(after) or None in before.values() or None in after.values():
            return None  # a process came or went inside the window
        return {p: after[p] - before[p] for p in before}  # type: ignore[operator]

    @property
    def machine_busy(self) -> float | None:
        if self._deltas() is None or len(self._machine) != 2:
            return None
        (busy_before, total_before), (busy_after, total_after) = self._machine
        return (busy_after - busy_before) / max(1, total_after - total_before)

    @property
    def seconds(self) -> float | None:
        deltas = self._deltas()
        return None if deltas is None else sum(deltas.values())

    @property
    def per_child(self) -> list[float] | None:
        """Each child's CPU seconds in the window, in pid order (empty: no children)."""
        deltas = self._deltas()
        return None if deltas is None else [deltas[p] for p in sorted(deltas) if p != self._pid]
