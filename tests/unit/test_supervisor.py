"""gemps_worker.supervisor's promises, each in a process of its own (it forks): a worker that fails
is forked again, quick failures back off and end it, exit codes and signals pass through, and no
worker outlives its supervisor. The reference worker under it: tests/integration/test_worker_supervisor.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from gemps_worker.supervisor import RestartPolicy, supervise
from tests.helpers import stop_process, wait_for

# A supervisor whose worker does what argv[1] says; argv[2] is a folder for its files.
PROGRAM = """
import logging, os, signal, sys, time
from pathlib import Path
from gemps_worker.supervisor import RestartPolicy, supervise

logging.basicConfig(level=logging.INFO, format="%(message)s")
behaviour, folder = sys.argv[1], Path(sys.argv[2])
policy = RestartPolicy(quick_s=float(sys.argv[3]), first_delay_s=float(sys.argv[4]), give_up_after=4,
                       stop_grace_s=0.2, final_codes=frozenset({3}))

def work() -> int:
    lives = len(list(folder.glob("life-*"))) + 1
    (folder / f"life-{lives}").write_text(str(os.getpid()))
    if behaviour == "fail":
        return 1
    if behaviour == "diverge":
        return 3
    if behaviour == "crash":
        raise RuntimeError("a crash in the worker")
    if behaviour == "fail-thrice":
        return 1 if lives <= 3 else 0
    if behaviour == "wait-for-sigterm":
        signal.signal(signal.SIGTERM, lambda *_: ((folder / "terminated").touch(), sys.exit(0)))
    if behaviour == "ignore-sigterm":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    (folder / "ready").touch()
    while True:
        time.sleep(1)

sys.exit(supervise(work, policy))
"""


def supervisor(tmp_path: Path, behaviour: str, quick_s: float = 10.0, first_delay_s: float = 0.01) -> list[str]:
    return [sys.executable, "-c", PROGRAM, behaviour, str(tmp_path), str(quick_s), str(first_delay_s)]


def lives(tmp_path: Path) -> int:
    return len(list(tmp_path.glob("life-*")))


def test_quick_failures_back_off_from_the_second_then_end_it_with_the_workers_code(tmp_path: Path) -> None:
    run = subprocess.run(supervisor(tmp_path, "fail"), capture_output=True, text=True, timeout=120)
    assert run.returncode == 1 and lives(tmp_path) == 4, run.stderr
    assert "exited with code 1 after" in run.stderr
    assert ") now: quick failure 1 in a row of the 4" in run.stderr  # one kill soon after a start: no loop
    assert ") in 0.01 s: quick failure 2 in a row of the 4" in run.stderr
    assert ") in 0.02 s: quick failure 3 in a row of the 4" in run.stderr
    assert "giving up: the worker failed 4 times in a row within 10 s of its start" in run.stderr


def test_a_worker_that_lived_past_quick_s_is_restarted_at_once_until_it_exits_0(tmp_path: Path) -> None:
    run = subprocess.run(supervisor(tmp_path, "fail-thrice", quick_s=0), capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and lives(tmp_path) == 4, run.stderr
    assert run.stderr.count("exited with code 1 after") == 3 and run.stderr.count(") now") == 3
    assert "leaving with 0" in run.stderr


def test_a_final_code_ends_it_at_once_and_a_crash_is_a_failure(tmp_path: Path) -> None:
    diverged = subprocess.run(supervisor(tmp_path, "diverge"), capture_output=True, text=True, timeout=120)
    assert diverged.returncode == 3 and lives(tmp_path) == 1 and "restarting" not in diverged.stderr
    crashed = tmp_path / "crashed"
    crashed.mkdir()
    run = subprocess.run(supervisor(crashed, "crash"), capture_output=True, text=True, timeout=120)
    assert run.returncode == 1 and lives(crashed) == 4
    assert run.stderr.count("RuntimeError: a crash in the worker") == 4  # each life's traceback


def test_sigterm_while_backing_off_leaves_without_another_worker(tmp_path: Path) -> None:
    log = tmp_path / "supervisor.log"
    with log.open("w") as output:
        process = subprocess.Popen(supervisor(tmp_path, "fail", first_delay_s=25), stderr=output)
    try:
        wait_for(lambda: "in 25 s" in log.read_text(), timeout=60, what="the back-off", explain=log.read_text)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 128 + signal.SIGTERM
    finally:
        process.kill()
        process.wait()
    assert lives(tmp_path) == 2 and "while waiting to restart the worker: leaving" in log.read_text()


def test_pauses_longer_than_a_poll_stop_nothing(tmp_path: Path) -> None:
    """SIGSTOP ... SIGCONT of the supervisor and its worker (a paused host, the comparison's
    scenario (c)), each pause longer than the supervisor's 1-s poll: CPython's sigtimedwait then
    returns a siginfo never written, which was read as a stop signal and ended the worker."""
    log = tmp_path / "supervisor.log"
    with log.open("w") as output:
        process = subprocess.Popen(supervisor(tmp_path, "wait-for-sigterm"), stderr=output)
    try:
        wait_for(lambda: (tmp_path / "ready").exists(), timeout=60, what="the worker", explain=log.read_text)
        worker = int((tmp_path / "life-1").read_text())
        for pause in range(3):
            stop_process(process.pid)
            stop_process(worker)
            time.sleep(2.0)
            os.kill(worker, signal.SIGCONT)
            os.kill(process.pid, signal.SIGCONT)
            time.sleep(1.0)  # the supervisor reads its signals again
            ended = (tmp_path / "terminated").exists() or process.poll() is not None
            assert not ended and "passing" not in log.read_text(), f"after pause {pause + 1}: {log.read_text()}"
        process.send_signal(signal.SIGTERM)  # a stop signal still stops it
        assert process.wait(timeout=60) == 0, log.read_text()
    finally:
        process.kill()
        process.wait()
    assert lives(tmp_path) == 1 and (tmp_path / "terminated").exists()
    assert "signal 15: passing SIGTERM on to worker pid" in log.read_text()


def test_a_worker_deaf_to_sigterm_is_killed_after_the_grace(tmp_path: Path) -> None:
    log = tmp_path / "supervisor.log"
    with log.open("w") as output:
        process = subprocess.Popen(supervisor(tmp_path, "ignore-sigterm"), stderr=output)
    try:
        wait_for(lambda: (tmp_path / "ready").exists(), timeout=60, what="the worker", explain=log.read_text)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 128 + signal.SIGKILL, log.read_text()
    finally:
        process.kill()
        process.wait()
    assert "still there 0.2 s after the signal: killed" in log.read_text()


def test_a_supervisor_killed_outright_takes_its_worker_with_it(tmp_path: Path) -> None:
    """SIGKILL gives the supervisor no say: the kernel sends its worker SIGTERM (PR_SET_PDEATHSIG)."""
    process = subprocess.Popen(supervisor(tmp_path, "wait-for-sigterm"), stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: (tmp_path / "ready").exists(), timeout=60, what="the worker")
        worker = int((tmp_path / "life-1").read_text())
        process.kill()
        wait_for(lambda: (tmp_path / "terminated").exists(), timeout=60, what="the worker's SIGTERM")
    finally:
        process.kill()
        process.wait()
    wait_for(lambda: not Path(f"/proc/{worker}").exists(), timeout=60, what="the worker's end")


def test_a_thread_alive_at_supervise_is_refused_before_any_fork() -> None:
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait, name="a-channel-poller")
    thread.start()
    try:
        with pytest.raises(RuntimeError, match=r"a thread does not survive a fork: start .*a-channel-poller"):
            supervise(lambda: os._exit(0))  # never forked: this test's process would be the parent
    finally:
        stop.set()
        thread.join()
    with pytest.raises(RuntimeError, match=r"call supervise\(\) from the main thread"):
        failure: list[BaseException] = []

        def from_a_thread() -> None:
            try:
                supervise(lambda: 0, RestartPolicy())
            except RuntimeError as error:
                failure.append(error)

        worker = threading.Thread(target=from_a_thread)
        worker.start()
        worker.join()
        raise failure[0]
