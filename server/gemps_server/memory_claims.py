"""What the other gemps servers on this host have claimed of its memory and not yet taken, so that
separate jobs on one host do not each admit all of it (issue 61, item 9).

A server's budget (memory_budget.py) is settled from what the process may still allocate when θ
is initialised; the rule's per-worker vectors are allocated lazily, so a job settling after
another saw the other's future state as free, and both admitted it. Now each server, when it
settles, writes a *claim* in a folder its user's gemps servers on the host share (tmpfs,
--memory-claims-dir): the bytes of rule state it could ever admit, and its anonymous resident
memory then (RssAnon). A server settling later subtracts what each live claimant has not taken
yet: its claim less what its anonymous memory grew since (floor 0); what it took, the host's
available memory no longer has. Not its whole resident memory (VmRSS): that counts the θ regions
its local workers share with it (RssShmem), the clients' memory, which the host's available
memory had lost already, so a job whose workers ran on the host seemed to have taken its claim
and the next job admitted that memory again (issue 77, item 7); nor the files it maps (RssFile,
page cache, which the host counts as available). A claim whose process is gone, or whose pid
another process holds now (its start time in /proc/<pid>/stat differs), is removed. Settling
holds a lock on the folder, so two servers settling at once see each other. Claims of one
supervisor's processes (the same --supervisor-pid) are not subtracted from each other: their
--memory-share divides the host between them already. A server that cannot use the folder says
so and settles as before.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import json
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from gemps_server.logs import event

log = logging.getLogger("gemps.server")

#: --memory-claims-dir's values besides a folder: the default folder, and none (no claims)
AUTO, OFF = "auto", "off"
#: how long a server waits for another that is settling (it holds the lock for a few reads and a write)
LOCK_SECONDS = 5.0
_serials = itertools.count()  # one file per server of this process (tests run several in one)


def default_folder() -> Path:
    """On tmpfs (gone at reboot, with the processes that claimed), one per user."""
    return Path(f"/dev/shm/gemps-memory-claims-{os.getuid()}")


def folder_of(option: str) -> Path | None:
    """The folder --memory-claims-dir names (None: off)."""
    return None if option == OFF else default_folder() if option == AUTO else Path(option)


def option_problems(option: str) -> list[str]:
    """A folder named relatively would differ between jobs started from different folders."""
    if option in (AUTO, OFF) or (option.startswith("/") and "\0" not in option):
        return []
    return [f"memory_claims_dir {option!r} is not an absolute path (nor {AUTO} or {OFF})"]


@dataclass(frozen=True)
class Claim:
    """One server's claim: the bytes of rule state it may still allocate, as it wrote them."""

    pid: int
    started: int  # the process's start time (/proc/<pid>/stat field 22): a reused pid is not it
    bytes: int
    resident: int  # its anonymous resident bytes when it claimed (Processes.resident)
    group: int  # its supervisor's pid (0: none): one supervisor's processes share by --memory-share


@dataclass(frozen=True)
class Outstanding:
    """What live claimants other than this server have claimed and not taken yet."""

    bytes: int = 0
    pids: tuple[int, ...] = ()


class Processes:
    """What /proc (or a folder laid out as it, in tests) says of a process."""

    def __init__(self, root: Path = Path("/proc")) -> None:
        self.root = root

    def started(self, pid: int) -> int | None:
        """Its start time, None when no such process is running."""
        try:
            stat = (self.root / str(pid) / "stat").read_text()
        except OSError:
            return None
        return int(stat.rsplit(")", 1)[1].split()[19])  # after the name (which may hold spaces): field 3 on

    def resident(self, pid: int) -> int | None:
        """What it allocated and holds: its anonymous resident bytes (RssAnon; VmRSS on a kernel
        before 4.5, which has no RssAnon), None when they cannot be read."""
        try:
            lines = (self.root / str(pid) / "status").read_text().splitlines()
        except OSError:
            return None
        fields = {name: rest for name, _, rest in (line.partition(":") for line in lines)}
        found = fields.get("RssAnon", fields.get("VmRSS"))
        return None if found is None else int(found.split()[0]) * 1024


class MemoryClaims:
    """This server's claim in `folder`, and the others'; `pid`, `group` and `processes` are the
    process's own unless a test stands in for another."""

    def __init__(
        self, folder: Path, group: int = 0, pid: int | None = None, processes: Processes | None = None
    ) -> None:
        self.folder = folder
        self.group = group
        self.pid = os.getpid() if pid is None else pid
        self.processes = processes or Processes()
        self.path = folder / f"{self.pid}.{next(_serials)}.claim"
        self._warned = False

    @contextlib.contextmanager
    def settling(self) -> Iterator[None]:
        """Hold the folder's lock (made if need be) while the budget is settled and claimed."""
        try:
            self.folder.mkdir(mode=0o700, parents=True, exist_ok=True)
            lock = os.open(self.folder / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as error:
            self._cannot(error)
            yield
            return
        try:
            deadline = time.monotonic() + LOCK_SECONDS
            while True:
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:  # one stopped while settling (SIGSTOP): go on
                        self._cannot(TimeoutError(f"its lock held past {LOCK_SECONDS:.0f} s"))
                        break
                    time.sleep(0.01)
            yield
        finally:
            os.close(lock)  # releases the lock

    def outstanding(self) -> Outstanding:
        """What the other live claimants' claims still hold back; dead ones' claims removed."""
        total, pids = 0, []
        try:
            paths = sorted(self.folder.glob("*.claim"))
        except OSError as error:
            self._cannot(error)
            return Outstanding()
        for path in paths:
            claim = self._read(path)
            if claim is None or claim.pid == self.pid or (self.group and claim.group == self.group):
                continue  # this process's own servers are one job; a supervisor's children share
            if self.processes.started(claim.pid) != claim.started:  # gone, or its pid is another's now
                with contextlib.suppress(OSError):
                    path.unlink()
                continue
            resident = self.processes.resident(claim.pid)
            taken = 0 if resident is None else max(0, resident - claim.resident)
            if claim.bytes > taken:
                total += claim.bytes - taken
                pids.append(claim.pid)
        return Outstanding(total, tuple(pids))

    def claim(self, count: int) -> None:
        """Write this server's claim of `count` bytes, whole or not at all (a file renamed in place)."""
        started = self.processes.started(self.pid)
        claim = Claim(self.pid, started or 0, count, self.processes.resident(self.pid) or 0, self.group)
        spare = self.path.with_suffix(".tmp")
        try:
            spare.write_text(json.dumps(asdict(claim)))
            spare.replace(self.path)
        except OSError as error:
            self._cannot(error)

    def withdraw(self) -> None:
        """Remove this server's claim (it stops)."""
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    def _read(self, path: Path) -> Claim | None:
        try:
            return Claim(**json.loads(path.read_text()))
        except FileNotFoundError:  # removed since listed: its server stopped
            return None
        except (OSError, ValueError, TypeError) as error:
            event(log, "memory claim unreadable", level=logging.WARNING, file=str(path), error=str(error))
            return None

    def _cannot(self, error: Exception) -> None:
        if not self._warned:
            self._warned = True
            event(
                log,
                "memory claims unusable",
                level=logging.WARNING,
                folder=str(self.folder),
                error=f"{type(error).__name__}: {error}",
                then="the budget does not count other gemps servers' claims on this host, nor they this one's",
                fix="--memory-claims-dir: a folder this user may write (on tmpfs), or off",
            )
