"""The command line that starts a reference worker as a child process (no torch imported here)."""

from __future__ import annotations

import sys


def worker_command(target: str, dataset: str, model: str, *flags: str) -> list[str]:
    """argv for `gemps worker` with this interpreter (works without the console script on PATH)."""
    return [
        sys.executable,
        "-m",
        "gemps.cli",
        "worker",
        "--server",
        target,
        "--dataset",
        dataset,
        "--model",
        model,
        *flags,
    ]
