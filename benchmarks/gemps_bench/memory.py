"""Resident memory of processes, read from /proc (Linux)."""

from __future__ import annotations

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


def current_rss(pid: int) -> int | None:
    """The process's resident set size now (VmRSS), bytes."""
    return _status_field(pid, "VmRSS")
