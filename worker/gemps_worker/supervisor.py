"""A warm restart: a supervisor that pays the imports once and forks a worker per life.

A killed worker process that is started again pays Python and torch's imports again: 10-17 s of
its 16-22 s back at a fifth of a core (issue 77, item 11; docs/RESULTS.md). `supervise(work)`
runs in a process that has imported what `work` needs (and loaded its data); it forks a child
that runs `work()` and exits with its return value, and when the child dies (SIGKILL, a crash, a
non-zero exit) it forks the next one at once, from the same warm interpreter.

What a user can count on:

- **Stopping**: SIGTERM or SIGHUP to the supervisor is passed on to the worker as SIGTERM, SIGINT
  as SIGINT (the reference worker finishes its step and leaves), whose exit status the supervisor then exits
  with (a code as is, a signal as 128 + its number); a second signal, or `stop_grace_s` without
  an exit, kills the worker. The supervisor's own death sends the worker SIGTERM (Linux's
  PR_SET_PDEATHSIG), so no orphan trains on.
- **Exit codes**: 0 (the worker finished) and the caller's `final_codes` (the reference worker's
  refused options, its divergence) end the supervisor with that code; any other code or a signal
  is a failure, and a new worker is forked.
- **No hot loop**: a worker that fails within `quick_s` of its start is a quick failure; the first
  is restarted at once (a kill soon after a start is no loop), the second after `first_delay_s`,
  each further one after twice the wait before (at most `max_delay_s`), and after `give_up_after`
  quick failures in a row the supervisor exits with the last one's status, saying why.
- **Pauses**: SIGSTOP ... SIGCONT of the supervisor or its worker, however long, stops nothing.
- **Logs** (logger gemps.worker): "worker pid N started (life L)", "restarting worker (pid N died
  with signal 9 (SIGKILL) after 63.2 s) now" or "in 4 s (...)".

Forking is safe only from a process that has created no thread and no gRPC object: gRPC's core
and torch's thread pools do not survive a fork, and gRPC supports objects made only after it
(grpc/grpc's doc/fork_support.md, "use after fork"). So the caller imports modules and loads data
before `supervise`, and makes its client, channels and threads inside `work`; a Python thread
alive at `supervise` is refused. Native pools that mend themselves at a fork (OpenBLAS's, started
by importing numpy) are not Python threads and are left alone.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import ctypes.util
import gc
import logging
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field

log = logging.getLogger("gemps.worker")

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
_WATCHED = {*STOP_SIGNALS, signal.SIGCHLD}
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
# How a signal was sent (<asm-generic/siginfo.h>): kill() SI_USER, the kernel (a hangup) SI_KERNEL,
# sigqueue() SI_QUEUE, tkill()/tgkill() SI_TKILL.
_SENT = frozenset({0, 0x80, -1, -6})
_POLL_S = 1.0  # the longest the supervisor sleeps between looks at its worker


@dataclass(frozen=True)
class RestartPolicy:
    """When a supervisor forks its next worker, and when it stops trying."""

    quick_s: float = 10.0  # a worker that fails sooner after its start is a quick failure
    first_delay_s: float = 1.0  # the wait after the second quick failure in a row, doubling
    max_delay_s: float = 30.0
    give_up_after: int = 5  # quick failures in a row
    stop_grace_s: float = 30.0  # after a stop signal is passed on, the worker is killed after this
    final_codes: frozenset[int] = field(default_factory=frozenset)  # besides 0: exit codes not worth a restart


@dataclass(frozen=True)
class SupervisorOptions:
    """`gemps worker`'s option for the supervisor (a flag and a GEMPS_* variable, as every option)."""

    supervise: bool = field(
        default=False,
        metadata={
            "help": "run the worker as a child of a supervisor that has imported torch and loaded the data once, "
            "and forks a new worker at once when one dies (SIGKILL, a crash, a non-zero exit): back in a second "
            "or two instead of a fresh start's import of torch; failures within 10 s of a start back off from the "
            "second in a row (1 s, doubling to 30 s) and 5 in a row end it; SIGTERM to the supervisor stops the "
            "worker, whose exit code it returns. Every life registers under --name, else HOST-PID (the "
            "supervisor's), so a new life takes a dead one's place in seconds, not after the server's lease"
        },
    )


def supervise(work: Callable[[], int], policy: RestartPolicy | None = None) -> int:
    """Run `work()` in a forked child, again after each failure, per `policy`; returns the exit
    status for this process (the module's docstring says which). Call it from the main thread of a
    process with no other Python thread and no gRPC object (RuntimeError otherwise)."""
    others = [thread.name for thread in threading.enumerate() if thread is not threading.current_thread()]
    if others or threading.current_thread() is not threading.main_thread():
        raise RuntimeError(
            f"supervise() forks, and a thread does not survive a fork: start {others or 'it'} in the worker "
            "(inside work()), and call supervise() from the main thread"
        )
    outer = signal.pthread_sigmask(signal.SIG_BLOCK, _WATCHED)  # delivered to sigtimedwait, never a handler
    try:
        return _Supervisor(work, policy or RestartPolicy(), outer).run()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, outer)


def describe(status: int) -> str:
    """A wait status in words: "exited with code 1", "died with signal 9 (SIGKILL)"."""
    code = os.waitstatus_to_exitcode(status)
    if code >= 0:
        return f"exited with code {code}"
    return f"died with signal {-code} ({signal.Signals(-code).name})"


def exit_code(status: int) -> int:
    """A wait status as a shell reports it: the code, or 128 + the signal's number."""
    code = os.waitstatus_to_exitcode(status)
    return code if code >= 0 else 128 - code


class _Supervisor:
    def __init__(self, work: Callable[[], int], policy: RestartPolicy, outer_mask: set[int | signal.Signals]) -> None:
        self.work = work
        self.policy = policy
        self.outer_mask = outer_mask
        self.lives = 0

    def run(self) -> int:
        quick = 0  # quick failures in a row
        delay = 0.0
        while True:
            if delay > 0:
                stop = self._signal_within(delay)
                if stop is not None:
                    log.info("signal %d while waiting to restart the worker: leaving", stop)
                    return 128 + stop
            pid, started = self._fork(), time.monotonic()
            status, stopped_by = self._wait(pid)
            lived = time.monotonic() - started
            ended = f"pid {pid} {describe(status)} after {lived:.1f} s"
            code = os.waitstatus_to_exitcode(status)
            if stopped_by is not None or code == 0 or code in self.policy.final_codes:
                log.info("worker %s: leaving with %d", ended, exit_code(status))
                return exit_code(status)
            quick = quick + 1 if lived < self.policy.quick_s else 0
            if quick >= self.policy.give_up_after:
                log.error(
                    "giving up: the worker failed %d times in a row within %g s of its start (the last: %s)",
                    quick, self.policy.quick_s, ended,
                )  # fmt: skip
                return exit_code(status)
            # the first quick failure restarts at once too: a kill soon after a start is no loop
            delay = min(self.policy.max_delay_s, self.policy.first_delay_s * 2 ** (quick - 2)) if quick > 1 else 0.0
            when = f"in {delay:g} s" if delay else "now"
            if quick:
                log.warning(
                    "restarting worker (%s) %s: quick failure %d in a row of the %d that end the supervisor",
                    ended, when, quick, self.policy.give_up_after,
                )  # fmt: skip
            else:
                log.warning("restarting worker (%s) %s", ended, when)

    def _fork(self) -> int:
        self.lives += 1
        for stream in (sys.stdout, sys.stderr):
            stream.flush()  # else the child would print the parent's buffered lines again
        gc.freeze()  # the imports' objects out of the child's collections: fewer pages copied on write
        parent = os.getpid()
        pid = os.fork()
        if pid == 0:
            self._child(parent)  # never returns
        gc.unfreeze()
        log.info("worker pid %d started (life %d)", pid, self.lives)
        return pid

    def _child(self, parent: int) -> None:
        code: object = 1
        try:
            signal.pthread_sigmask(signal.SIG_SETMASK, self.outer_mask)
            _die_with_parent()
            # the supervisor may have died before the request was made: then no signal will come
            code = 128 + signal.SIGTERM if os.getppid() != parent else self.work()
        except SystemExit as exit:
            code = 0 if exit.code is None else exit.code
            if not isinstance(code, int):
                print(code, file=sys.stderr)
        except KeyboardInterrupt:
            code = 128 + signal.SIGINT
        except BaseException:
            traceback.print_exc()
        finally:
            # Leave as a process that ends does (the SDK's clients still registered leave, logs
            # flush), but never return into the supervisor's frames, which are the parent's.
            with contextlib.suppress(BaseException):
                atexit._run_exitfuncs()
                sys.stdout.flush()
                sys.stderr.flush()
            os._exit(code if isinstance(code, int) else 1)

    def _wait(self, pid: int) -> tuple[int, int | None]:
        """The child's wait status, and the stop signal passed on to it (None: it ended by itself)."""
        stopped_by: int | None = None
        kill_at = float("inf")
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                return status, stopped_by
            now = time.monotonic()
            if now >= kill_at:
                log.warning("worker pid %d still there %g s after the signal: killed", pid, self.policy.stop_grace_s)
                os.kill(pid, signal.SIGKILL)
                kill_at = float("inf")
            got = _stop_signal(min(_POLL_S, max(0.0, kill_at - now)))
            if got is None:
                continue
            if stopped_by is None:
                stopped_by = got
                passed = signal.SIGINT if got == signal.SIGINT else signal.SIGTERM  # a hangup too
                log.info("signal %d: passing %s on to worker pid %d", got, passed.name, pid)
                os.kill(pid, passed)
                kill_at = time.monotonic() + self.policy.stop_grace_s
            else:
                log.warning("signal %d again: killing worker pid %d", got, pid)
                os.kill(pid, signal.SIGKILL)

    def _signal_within(self, seconds: float) -> int | None:
        """A stop signal received within `seconds` (SIGCHLD and others ignored), or None."""
        until = time.monotonic() + seconds
        while (left := until - time.monotonic()) > 0:
            got = _stop_signal(left)
            if got is not None:
                return got
        return None


def _stop_signal(seconds: float) -> int | None:
    """A stop signal (STOP_SIGNALS) received within `seconds`, or None: SIGCHLD, the timeout, and
    what CPython's sigtimedwait returns when a SIGSTOP ... SIGCONT of this process outlasts its
    timeout: it leaves its EINTR retry and fills the result from a siginfo never written (signal
    numbers such as 437918234, and codes as random). Read as a stop, that pause ended the worker
    (a paused host, a debugger, `kill -STOP`, the comparison's scenario (c)). A stop signal is one
    sent as signals are sent (its code one of _SENT), so stale memory is not taken for one."""
    got = signal.sigtimedwait(_WATCHED, seconds)
    if got is None or got.si_signo not in STOP_SIGNALS or got.si_code not in _SENT:
        return None
    return got.si_signo


def _die_with_parent(signum: int = signal.SIGTERM) -> None:
    """Ask the kernel for `signum` when this process's parent dies (Linux; elsewhere nothing). As
    gemps_server.supervision does for a partition: the reference worker cannot import the server."""
    name = ctypes.util.find_library("c")
    if name is None:
        return
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(name, use_errno=True).prctl(_PR_SET_PDEATHSIG, signum, 0, 0, 0)
