"""A partition's server tied to its actor's life, the actor's to its raylet's (issue 42, item 7).

Ray restarts an actor whose node it lost on another node, and the new life takes the partition's
checkpoint folder. Nothing ended the old life: SIGKILL a raylet alone and, while its zombie is not
reaped, the workers it started never notice (Ray's check asks whether its pid exists); the actor
and its `gemps server` lived on, the server holding the folder's lock, and the restarted actor
failed five times with DirectoryInUse. Three ties now:

1. An actor watches its raylet, its parent process: the raylet gone (the actor re-parented), the
   actor exits, a partition's after stopping its server gracefully (SIGTERM: its final checkpoint).
   When the zombie is reaped, Ray's own check ends the actor within a second, SIGKILLing what it
   started: the final checkpoint then races that kill (it takes a few tenths of a second).
2. The server dies with its actor, however the actor ends: it is started with `--supervisor-pid`
   (the actor's pid), so it asks the kernel for SIGTERM when its parent dies (PR_SET_PDEATHSIG) and
   checks its parent every second (gemps_server.supervision). The kernel sends that signal when
   the *thread* that started the child ends, so the server is started from a thread of its own
   that lives until the server has exited (Ray may run an actor's calls on threads of a pool).
3. A restarted life on the machine of an earlier life's server that still runs (its final
   checkpoint under way, or a server no tie reached) asks it to stop (SIGTERM), waits up to
   TAKEOVER_SECONDS for it, then SIGKILLs it: the folder's lock and the ports are then free. The
   earlier server is named by the machine's boot id, its pid and its start time, never by a pid
   alone (reused) or across machines (a pid elsewhere names nothing here). A lock whose holder is
   dead needs none of this: the kernel drops a flock when its holder exits (directory_lock.py).
4. A restarted life on the same machine serves on the earlier life's ports (the layout and the
   workers name them), unless another process took one meanwhile (a port that a Ray worker or a
   test bound as a free one, while the partition was down): then it waits PORT_WAIT_SECONDS for
   it and serves on a fresh one, which the driver announces as it does a moved partition's.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from pathlib import Path

from gemps_worker.cluster import ServerProcess

log = logging.getLogger("gemps.ray")

WATCH_SECONDS = 0.1  # how often an actor looks at its server and its raylet
STOP_SECONDS = 30.0  # a server's graceful stop when its raylet is gone, before SIGKILL
TAKEOVER_SECONDS = 30.0  # what a restarted life gives an earlier life's server to stop
KILL_SECONDS = 5.0  # then for SIGKILL to take effect
PORT_WAIT_SECONDS = 5.0  # for an earlier life's port that another process holds
RAYLET = "raylet"  # the raylet's process name (/proc/PID/comm)


def parent_raylet() -> int:
    """This process's parent if it is a raylet (Ray starts its workers so), else 0 (no watch)."""
    parent = os.getppid()
    try:
        name = Path(f"/proc/{parent}/comm").read_text().strip()
    except OSError:  # not Linux
        return 0
    return parent if name == RAYLET else 0


def raylet_gone(raylet: int) -> bool:
    """The raylet that started this process has died (its children were re-parented)."""
    return bool(raylet) and os.getppid() != raylet


def exit_with_raylet(what: str) -> None:
    """A worker's or the evaluator's tie 1: exit once the raylet is gone, since Ray restarts the
    actor elsewhere and this life would go on beside the new one."""
    raylet = parent_raylet()
    if not raylet:
        return

    def watch() -> None:
        while not raylet_gone(raylet):
            time.sleep(WATCH_SECONDS)
        log.error("%s: its raylet (pid %d) is gone; this life ends (Ray restarts it elsewhere)", what, raylet)
        os._exit(1)

    threading.Thread(target=watch, name="watch-raylet", daemon=True).start()


class TetheredServer:
    """A partition's `gemps server` (`start()` makes it, retries included), started and watched
    from one thread that outlives it (ties 1 and 2). The actor's process exits when the server
    exits by itself (Ray then restarts the actor), or when the raylet is gone (after the server's
    graceful stop); `stopping` set, the server's exit is the actor's own doing."""

    def __init__(self, start: Callable[[], ServerProcess], what: str) -> None:
        self.what = what
        self.stopping = threading.Event()
        self.raylet = parent_raylet()
        started: Future[ServerProcess] = Future()
        threading.Thread(target=self._run, args=(start, started), name="server-tether", daemon=True).start()
        self.server = started.result()

    def _run(self, start: Callable[[], ServerProcess], started: Future[ServerProcess]) -> None:
        try:
            server = start()
        except BaseException as error:  # the actor's __init__ raises it
            started.set_exception(error)
            return
        started.set_result(server)
        while server.returncode is None:
            if raylet_gone(self.raylet) and not self.stopping.is_set():
                self.stopping.set()
                log.error(
                    "%s: its raylet (pid %d) is gone; stopping its server (final checkpoint)", self.what, self.raylet
                )
                code = server.stop(timeout=STOP_SECONDS)
                log.error("%s: server stopped with %s; this life ends (Ray restarts it elsewhere)", self.what, code)
                os._exit(1)
            time.sleep(WATCH_SECONDS)
        if not self.stopping.is_set():
            log.error("%s: server exited with %s; the actor exits so Ray restarts it", self.what, server.returncode)
            os._exit(1)


# -- tie 3: an earlier life's server on this machine ------------------------------------------------


def boot_id() -> str:
    """This machine's boot, as Linux names it ('' elsewhere)."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def _state_and_start(stat: Path) -> tuple[str, int]:
    """A /proc stat file's state letter and start time ('', -1 if it is gone)."""
    try:
        fields = stat.read_text().rsplit(")", 1)[1].split()
        return fields[0], int(fields[19])
    except (OSError, IndexError, ValueError):
        return "", -1


def started_at(pid: int) -> int:
    """Process `pid`'s start time in clock ticks since boot; -1 if it is gone or a zombie. A leader
    thread that exited while other threads of the process still run reads Z too: the process still
    holds its files (the folder's lock) and is not yet waitable, so it still counts as running."""
    state, started = _state_and_start(Path(f"/proc/{pid}/stat"))
    if state != "Z":
        return started
    threads = Path(f"/proc/{pid}/task").glob("*/stat")
    return started if any(_state_and_start(thread)[0] not in ("", "Z", "X") for thread in threads) else -1


def life_of(pid: int) -> dict[str, object]:
    """What names process `pid` on this machine, past pid reuse: for the partition's state file."""
    return {"boot": boot_id(), "pid": pid, "started": started_at(pid)}


def running(life: Mapping[str, object]) -> bool:
    """The process `life_of` named still runs, on this machine (elsewhere: nothing to know here)."""
    boot, pid = str(life.get("boot", "")), int(str(life.get("pid", 0)))
    return bool(boot) and boot == boot_id() and pid > 0 and started_at(pid) == life.get("started")


def stop_earlier(life: Mapping[str, object] | None, what: str) -> None:
    """An earlier life's server (as `life_of` named it) that still runs here: SIGTERM (its final
    checkpoint), up to TAKEOVER_SECONDS, then SIGKILL; returns once it is gone."""
    if not life or not running(life):
        return
    pid = int(str(life["pid"]))
    log.warning(
        "%s: the server of its earlier life (pid %d) still runs here, holding its folder: asking it to stop "
        "(SIGTERM, its final checkpoint), waiting up to %.0fs",
        what,
        pid,
        TAKEOVER_SECONDS,
    )
    began = time.monotonic()
    deadline, killed = began + TAKEOVER_SECONDS, False
    _signal(pid, signal.SIGTERM)
    while running(life):
        if time.monotonic() > deadline:
            if killed:
                raise RuntimeError(f"{what}: the earlier server (pid {pid}) still runs after SIGKILL")
            log.error(
                "%s: pid %d did not stop in %.0fs; killing it (SIGKILL: no final checkpoint)",
                what,
                pid,
                TAKEOVER_SECONDS,
            )
            _signal(pid, signal.SIGKILL)
            deadline, killed = deadline + KILL_SECONDS, True
        time.sleep(WATCH_SECONDS / 2)
    log.warning(
        "%s: the earlier server (pid %d) is gone after %.1fs; taking its folder", what, pid, time.monotonic() - began
    )


def _signal(pid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # gone meanwhile
        os.kill(pid, signum)


def bindable(host: str, port: int) -> bool:
    """Nothing listens on host:port now: a listener refuses the bind even with SO_REUSEADDR, a
    socket of a dead server's connections (TIME_WAIT) does not."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except OSError:  # a name this machine cannot resolve: the server's start says so
        return True
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError:
            return False
    return True


def earlier_ports(host: str, ports: Mapping[str, int], what: str, wait: float = PORT_WAIT_SECONDS) -> dict[str, int]:
    """The earlier life's `ports` (by server option), each kept where it is free within `wait`
    seconds and 0 (a fresh one) where another process holds it (point 4 above)."""
    deadline = time.monotonic() + wait
    while True:
        taken = [name for name, port in ports.items() if port > 0 and not bindable(host, port)]
        if not taken or time.monotonic() >= deadline:
            break
        time.sleep(WATCH_SECONDS)
    for name in taken:
        log.warning(
            "%s: its earlier %s %s:%d is held by another process; it serves on a fresh one, which the "
            "driver announces",
            what, name.replace("_", " "), host, ports[name],
        )  # fmt: skip
    return {name: 0 if name in taken else port for name, port in ports.items()}
