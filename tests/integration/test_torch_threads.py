"""RemoteOptimizer against a real server sets torch's threads for the workers sharing this
machine, or warns once where they were set otherwise (gemps.pytorch.threads)."""

from __future__ import annotations

import logging
import os
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

from gemps.pytorch import RemoteOptimizer
from gemps.pytorch import threads as torch_threads
from gemps.pytorch.threads import Roster, usable_cores
from tests.helpers import InProcessServer


@pytest.fixture
def roster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """This machine's roster of workers in a folder of the test's own, torch's threads restored after."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(torch_threads, "_ours", None)
    monkeypatch.setattr(torch_threads, "_warned", False)
    # Counted from none in this test, whatever an earlier test in this process left bound.
    monkeypatch.setattr(Roster, "_bound", 0)
    monkeypatch.setattr(Roster, "_pid", os.getpid())
    before = torch.get_num_threads()
    Roster.folder().mkdir(mode=0o700)
    yield Roster.folder()
    torch.set_num_threads(before)


@pytest.fixture
def two_other_workers(roster: Path) -> Iterator[list[subprocess.Popen[bytes]]]:
    """Two live processes counted as workers of this machine (as RemoteModel counts itself)."""
    others = [subprocess.Popen(["sleep", "60"]) for _ in range(2)]
    for other in others:
        (roster / str(other.pid)).touch()
    yield others
    for other in others:
        other.kill()
        other.wait()


def test_threads_as_torch_set_them_are_shared_among_the_workers_here(
    server: InProcessServer,
    monkeypatch: pytest.MonkeyPatch,
    roster: Path,
    two_other_workers: list[subprocess.Popen[bytes]],
) -> None:
    cores = usable_cores()
    torch.set_num_threads(cores)
    monkeypatch.setattr(torch_threads, "_FOUND", cores)  # as torch chose them: gemps may move them
    with RemoteOptimizer(nn.Linear(3, 1), server.target) as optimizer:
        assert torch.get_num_threads() == max(1, cores // 3)  # three workers share the cores
        assert (roster / str(os.getpid())).exists()
        for other in two_other_workers:
            other.kill()
            other.wait()
        optimizer.remote._threads.check(now=float("inf"))  # the next re-check: alone again
        assert torch.get_num_threads() == cores
        assert sorted(path.name for path in roster.iterdir()) == [str(os.getpid())]  # the dead removed
        with RemoteOptimizer(nn.Linear(3, 1), server.target) as second:  # one process: counted once
            second.close()  # closed twice: still counted for the first model
            assert (roster / str(os.getpid())).exists()
    assert list(roster.iterdir()) == []


def test_threads_set_otherwise_are_left_with_one_warning(
    server: InProcessServer,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    roster: Path,
    two_other_workers: list[subprocess.Popen[bytes]],
) -> None:
    cores = usable_cores()
    torch.set_num_threads(cores + 1)  # the user's: not what torch chose at import
    monkeypatch.setattr(torch_threads, "_FOUND", cores + 2)
    with caplog.at_level(logging.WARNING, "gemps.pytorch"):
        for _ in range(2):
            with RemoteOptimizer(nn.Linear(3, 1), server.target):
                assert torch.get_num_threads() == cores + 1
    warnings = [record.getMessage() for record in caplog.records if "oversubscribes" in record.getMessage()]
    assert len(warnings) == 1
    assert f"torch.set_num_threads({max(1, cores // 3)})" in warnings[0] and "threads=" in warnings[0]


def test_a_number_of_threads_is_set_as_given(server: InProcessServer, roster: Path) -> None:
    with RemoteOptimizer(nn.Linear(3, 1), server.target, threads=1):
        assert torch.get_num_threads() == 1
    with pytest.raises(ValueError, match="threads=0"):
        RemoteOptimizer(nn.Linear(3, 1), server.target, threads=0)


def test_a_roster_that_cannot_be_used_counts_this_worker_alone(
    server: InProcessServer, monkeypatch: pytest.MonkeyPatch, roster: Path
) -> None:
    roster.rmdir()
    roster.write_text("not a folder")  # or another user's: binding must not fail for it
    cores = usable_cores()
    torch.set_num_threads(cores)
    monkeypatch.setattr(torch_threads, "_FOUND", cores)
    with RemoteOptimizer(nn.Linear(3, 1), server.target):
        assert torch.get_num_threads() == cores  # alone: torch's own choice stands
    assert roster.read_text() == "not a folder"
