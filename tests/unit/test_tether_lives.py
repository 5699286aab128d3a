"""Tie 3's notion of "the earlier server still runs here" (gemps_worker.on_ray.tether.running), on
real processes: it may say "gone" only once the process is waitable, so its files (the folder's
lock) are closed and a new server can take the folder."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

from gemps_worker.on_ray.tether import life_of, running

# Busy threads make the window real: on SIGTERM the leader thread turns zombie first and the other
# threads take a moment longer to exit, all the while holding the process's files.
BUSY_CHILD = r"""
import signal, sys, threading, time
def spin() -> None:
    while True:
        pass
for _ in range(8):
    threading.Thread(target=spin, daemon=True).start()
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
print("ready", flush=True)
while True:
    time.sleep(0.01)
"""
TRIALS = 12  # before the fix, running() said "gone" early in 15 of 40 trials here


def test_a_process_counts_as_running_until_it_can_be_reaped() -> None:
    early: list[int] = []
    for trial in range(TRIALS):
        child = subprocess.Popen([sys.executable, "-c", BUSY_CHILD], stdout=subprocess.PIPE)
        try:
            assert child.stdout is not None and child.stdout.readline() == b"ready\n"
            life = life_of(child.pid)
            assert running(life)
            child.send_signal(signal.SIGTERM)
            while running(life):
                time.sleep(0.0005)
            if child.poll() is None:
                early.append(trial)
        finally:
            child.kill()
            child.wait()
    assert not early, f"running() said gone before the process could be reaped in trials {early}"


def test_a_life_recorded_on_another_boot_or_with_another_start_is_not_running() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        life = life_of(child.pid)
        assert running(life)
        assert not running({**life, "boot": "another machine"})
        assert not running({**life, "started": int(str(life["started"])) + 1})
    finally:
        child.kill()
        child.wait()
    assert not running(life)
