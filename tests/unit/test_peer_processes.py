"""A peer's run of processes (gemps_bench.peers.common.run_processes): a failure that is only the
echo of another process's death says so, so a caller can tell torch RPC's own aborts from a fault."""

from __future__ import annotations

import os
import time

import pytest
from gemps_bench.peers.common import ChildSpec, PeerError, run_processes


def _abort() -> None:
    os.abort()  # as TensorPipe's SIGABRT ends a trainer


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
