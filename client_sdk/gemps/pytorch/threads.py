"""torch's intra-op threads for workers that share a machine: so that they do not oversubscribe it.

torch starts as many intra-op threads as the machine has cores, in every process: four workers
on two cores then run eight threads or more that wait on each other (measured: 0.9-1.2 s a step
against 0.23 s with one thread each). `RemoteModel(..., threads=)` and `RemoteOptimizer(...,
threads=)` choose:

- `"auto"` (the default): the cores this process may use (its CPU affinity, bounded by a cgroup
  CPU quota) shared among the gemps worker processes running on this machine for this user (each
  counts itself in a folder of the temporary directory while it is bound), at least 1:
  `torch.set_num_threads(max(1, cores // workers))`, re-checked as workers come and go. It only
  ever lowers torch's threads, and only while they are as torch set them: when they were set
  otherwise (`torch.set_num_threads` after importing gemps.pytorch, or OMP_NUM_THREADS /
  MKL_NUM_THREADS), it leaves them and logs a WARNING once if they oversubscribe the machine. A
  setting made before gemps.pytorch was imported looks like torch's own: pass `threads=` then.
  The environment variable GEMPS_THREADS (a number; the reference worker's `--threads` reads it
  too), when set, is taken instead of "auto".
- a number: `torch.set_num_threads(number)`, as asked.
- None: torch's threads are left alone, and nothing is said.

Workers in separate containers do not see each other's folders; a container's CPU quota bounds
its cores instead.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger("gemps.pytorch")

AUTO = "auto"
ENVIRONMENT = "GEMPS_THREADS"
EXPLICIT_ENVIRONMENT = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
# How often a bound worker looks again at how many workers share the machine.
RECHECK_SECONDS = 2.0

Threads = int | str | None

# torch's threads as gemps.pytorch found them; `_ours` what gemps last set them to.
_FOUND = torch.get_num_threads()
_lock = threading.Lock()
_ours: int | None = None
_warned = False


@dataclass(frozen=True)
class Decision:
    """What to do with torch's threads: set them (`threads`), or warn (`warning`), or neither."""

    threads: int | None = None
    warning: str = ""


def requested(threads: Threads) -> Threads:
    """`threads=` as given, GEMPS_THREADS standing in for "auto"; ValueError naming a bad one."""
    source = "threads"
    if threads == AUTO and (environment := os.environ.get(ENVIRONMENT, "").strip()):
        threads, source = (int(environment) if environment.isdigit() else environment), ENVIRONMENT
    if threads is None or threads == AUTO:
        return threads
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ValueError(f"{source}={threads!r}: a number of threads (1 or more), 'auto' or None")
    return threads


def decide(
    threads: Threads, *, current: int, found: int, ours: int | None, explicit: bool, cores: int, workers: int
) -> Decision:
    """The decision for `threads=` (as `requested` returns it), given torch's threads now
    (`current`), as found at import (`found`) and as gemps last set them (`ours`), whether the
    environment set them (`explicit`), the usable `cores` and the `workers` sharing them."""
    if threads is None:
        return Decision()
    if isinstance(threads, int):
        return Decision(threads if threads != current else None)
    share = max(1, cores // max(1, workers))
    torchs_own = not explicit and current == (found if ours is None else ours)
    if torchs_own:
        target = min(found, share)  # lower only; back up to what torch chose as workers leave
        return Decision(target if target != current else None)
    if current > share:
        return Decision(
            warning=f"gemps: torch runs {current} threads in each of {workers} worker process(es) sharing {cores} "
            f"core(s) here, which oversubscribes them (steps run several times slower): call "
            f"torch.set_num_threads({share}) or pass threads={share} to RemoteOptimizer/RemoteModel (threads='auto', "
            "the default, moves only threads left as torch set them, and these were set otherwise)"
        )
    return Decision()


def usable_cores() -> int:
    """The cores this process may run on: its CPU affinity, bounded by a cgroup v2 CPU quota."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cores = os.cpu_count() or 1
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            cores = min(cores, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):
        pass  # no cgroup v2 quota readable: the affinity it is
    return max(1, cores)


class Roster:
    """This process counted among the gemps workers of this machine (a file named by its pid in a
    folder of the temporary directory, this user's) while at least one model is bound here. A
    folder that is not this user's (made by another, or a link to one) is not used: the roster
    then counts this process alone, and binding a model never fails for it."""

    _bound = 0
    _pid = 0  # the process `_bound` counts for: a forked child starts from none
    _lock = threading.Lock()

    @staticmethod
    def folder() -> Path:
        return Path(tempfile.gettempdir()) / f"gemps-workers-{os.getuid()}"

    @classmethod
    def _own_folder(cls) -> Path | None:
        folder = cls.folder()
        try:
            folder.mkdir(mode=0o700, exist_ok=True)
            return folder if folder.stat().st_uid == os.getuid() else None
        except OSError:
            return None

    @classmethod
    def join(cls) -> None:
        with cls._lock:
            if cls._pid != os.getpid():
                cls._bound, cls._pid = 0, os.getpid()
            cls._bound += 1
            if cls._bound == 1 and (folder := cls._own_folder()) is not None:
                with contextlib.suppress(OSError):
                    (folder / str(os.getpid())).touch()

    @classmethod
    def leave(cls) -> None:
        with cls._lock:
            cls._bound -= 1
            if cls._bound == 0 and (folder := cls._own_folder()) is not None:
                with contextlib.suppress(OSError):
                    (folder / str(os.getpid())).unlink(missing_ok=True)

    @classmethod
    def count(cls) -> int:
        """The worker processes alive in the roster (a dead one's file is removed), this one included."""
        folder = cls._own_folder()
        try:
            entries = list(folder.iterdir()) if folder is not None else []
        except OSError:
            entries = []
        alive = 1
        for entry in entries:
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            try:
                os.kill(int(entry.name), 0)
            except ProcessLookupError:
                with contextlib.suppress(OSError):
                    entry.unlink(missing_ok=True)
                continue
            except PermissionError:
                pass  # alive, another user's pid reused: counted, it is busy anyway
            alive += 1
        return alive


class ThreadKeeper:
    """Applies `threads=` (as `requested` returns it) for one bound model: at binding, and again
    every RECHECK_SECONDS at a step."""

    def __init__(self, threads: Threads) -> None:
        self._threads = threads
        self._checked = 0.0
        self._closed = False
        Roster.join()
        self.check()

    def check(self, *, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        if self._threads is None or (self._threads != AUTO and self._checked):
            return
        if self._checked and now - self._checked < RECHECK_SECONDS:
            return
        self._checked = now
        global _ours, _warned
        with _lock:
            decision = decide(
                self._threads,
                current=torch.get_num_threads(),
                found=_FOUND,
                ours=_ours,
                explicit=any(os.environ.get(name) for name in EXPLICIT_ENVIRONMENT),
                cores=usable_cores(),
                workers=Roster.count(),
            )
            if decision.threads is not None:
                torch.set_num_threads(decision.threads)
                if self._threads == AUTO:  # a number asked for is the caller's, not gemps' to move
                    _ours = decision.threads
                log.info("gemps: torch.set_num_threads(%d) (threads=%r)", decision.threads, self._threads)
            elif decision.warning and not _warned:
                _warned = True
                log.warning(decision.warning)

    def close(self) -> None:
        """Leave the roster (once: closing a model twice must not count another model out)."""
        if not self._closed:
            self._closed = True
            Roster.leave()
