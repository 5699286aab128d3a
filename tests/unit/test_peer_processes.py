"""A peer's run of processes (gemps_bench.peers.common.run_processes): a failure that is only the
echo of another process's death says so, so a caller can tell torch RPC's own aborts from a fault."""

from __future__ import annotations

import os
import signal
import time

import pytest
from gemps_bench.peers.common import ChildSpec, PeerError, once_more_if_aborted, run_processes


def _abort() -> None:
    os.abort()  # as TensorPipe's SIGABRT ends a trainer


def _segfault() -> None:
    os.kill(os.getpid(), signal.SIGSEGV)  # native code ended by a signal other than its own abort


def _fail_once_the_other_is_gone() -> None:
    time.sleep(1.0)  # its peer is gone by now: the connection's EOF, as a server reports it
    raise RuntimeError("EOF: end of file")


def _fail() -> None:
    raise RuntimeError("a fault of its own")


def test_a_failure_names_the_process_a_signal_ended_beside_it() -> None:
    children = [ChildSpec("ps", _fail_once_the_other_is_gone, ()), ChildSpec("trainer1", _abort, ())]
    with pytest.raises(PeerError) as failed:
        run_processes(children, timeout=30.0, preload=[])
    assert "process ps failed (trainer1 exited with code -6 meanwhile)" in str(failed.value)
    assert "EOF: end of file" in str(failed.value)


def test_a_failure_of_its_own_names_no_other_process() -> None:
    children = [ChildSpec("ps", _fail, ()), ChildSpec("trainer0", time.sleep, (5.0,))]
    with pytest.raises(PeerError) as failed:
        run_processes(children, timeout=30.0, preload=[])
    assert "process ps failed:\n" in str(failed.value) and "a fault of its own" in str(failed.value)


def _ok() -> None:
    time.sleep(0.1)


def test_a_run_whose_process_aborted_runs_once_more_and_says_why() -> None:
    """A peer's own native abort (TensorPipe's SIGABRT) costs one more run, noted; not a lost cell."""
    runs: list[list[ChildSpec]] = [[ChildSpec("trainer1", _abort, ())], [ChildSpec("trainer1", _ok, ())]]
    reports, first = once_more_if_aborted(lambda: run_processes(runs.pop(0), timeout=30.0, preload=[]))
    assert not runs and set(reports) == {"trainer1"}
    assert first == "process trainer1 exited with code -6 without reporting"


def test_a_run_whose_server_another_signal_ended_runs_once_more() -> None:
    """Once, in a loaded suite, torch RPC's server died by a signal other than SIGABRT, and its
    trainer failed on the closed connection: the peer's own native code too, so one more run."""
    first_run = [ChildSpec("ps", _segfault, ()), ChildSpec("trainer1", _fail_once_the_other_is_gone, ())]
    runs: list[list[ChildSpec]] = [first_run, [ChildSpec("ps", _ok, ()), ChildSpec("trainer1", _ok, ())]]
    reports, first = once_more_if_aborted(lambda: run_processes(runs.pop(0), timeout=30.0, preload=[]))
    assert not runs and set(reports) == {"ps", "trainer1"}
    assert first is not None and f"exited with code -{int(signal.SIGSEGV)}" in first


def test_a_run_that_failed_on_its_own_is_not_run_again() -> None:
    runs: list[list[ChildSpec]] = [[ChildSpec("ps", _fail, ())], [ChildSpec("ps", _ok, ())]]
    with pytest.raises(PeerError, match="a fault of its own"):
        once_more_if_aborted(lambda: run_processes(runs.pop(0), timeout=30.0, preload=[]))
    assert len(runs) == 1
