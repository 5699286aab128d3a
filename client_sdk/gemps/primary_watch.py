"""While a call waits on a replicated partition's primary: has another replica taken over?

A primary that stops without dying (SIGSTOP, a long GC pause or swap, a frozen VM) neither answers
nor closes its connections: its kernel still acknowledges what is sent and answers keepalives. Its
backup is primary once the lease runs out (about 2 s), but a worker waiting on the stopped process
waited until its attempt deadline, 60 s by default (issue 61, item 1). A PrimaryWatch asks the
partition's other replicas, once a call has waited `after` seconds and every `every` seconds from
then, whether one of them is primary (Status, which every replica answers). When one is, the call
is interrupted (its transport's blocked read is woken) and fails as unavailable: the session's
retry then goes to that replica (`Replicas.prefer`) with the same request id and number, so a
commit the stopped primary had replicated is answered from the ledger, not applied twice.

The replica the call waits on is asked too: when it says it is primary under a newer epoch than
the one that last acknowledged this session, it lost its lease and won it again while the call
waited (its cable pulled for a few seconds, say). The attempt was made to the old epoch, and its
connection may stay silent for many seconds more after the heal (TCP's retransmission backoff),
so the call is woken the same way and retried on a new connection (the set's next replica first,
which refuses it and names the primary).

A replica is followed only when it proves it is this job's (DESIGN §3d, "One job, one θ"): its
Status names the job this client registered with, and an epoch no older than the one that last
acknowledged this session. Anything else that says it is primary (an address of the list now
another job's primary, a resumed ex-primary that has not yet noticed its lease is gone) is
skipped, with a WARNING naming it once.

One daemon thread per watch, started with the first watched call of a replicated partition; a call
costs two assignments under a lock. A partition that is not replicated is never watched: there is
nowhere to go, and its attempt deadline stays the bound.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

from gemps.records import ServerStatus
from gemps.resolver import Replicas
from gemps.transport import call_deadline
from gemps_proto.jobs import describe_job
from gemps_proto.status import PRIMARY

log = logging.getLogger("gemps.client")

#: a call waits this long on its primary before the other replicas are asked (a commit takes ms)
AFTER_SECONDS = 1.0
#: and they are asked again this often while it waits (each ask bounded by PROBE_SECONDS)
EVERY_SECONDS = 0.5
PROBE_SECONDS = 0.5

# The status of the replica at an address (raises when it cannot say), within PROBE_SECONDS.
Probe = Callable[[str], ServerStatus]


class Interruptible(Protocol):
    """What a watch can wake: the transport a call is blocked in (gemps.transport.Transport)."""

    @property
    def target(self) -> str: ...

    def interrupt(self) -> None: ...


@dataclass
class Watched:
    """One call under watch: `took_over` is the replica found primary instead, once it was."""

    transport: Interruptible
    started: float
    took_over: str = ""


class PrimaryWatch:
    """Watches the calls of one session; `replicas()` says its partition's replica set now (None:
    not replicated, nothing watched)."""

    def __init__(
        self,
        replicas: Callable[[], Replicas | None],
        probe: Probe,
        job: Callable[[], str] = lambda: "",
        after: float = AFTER_SECONDS,
        every: float = EVERY_SECONDS,
    ) -> None:
        self.replicas, self.probe, self.after, self.every = replicas, probe, after, every
        self.job = job  # the session's job ("": not registered yet, any primary will do)
        self._skipped: set[tuple[str, str, int]] = set()  # (address, job, epoch) found not ours: warned
        self.epoch = 0  # of the primary that last acknowledged a commit of this session (0: none yet)
        self._lock = threading.Condition()
        self._call: Watched | None = None
        self._thread: threading.Thread | None = None
        self._closed = False

    @contextlib.contextmanager
    def watching(self, transport: Interruptible) -> Iterator[Watched]:
        """A call to `transport`, watched while it runs (not at all for a partition not replicated)."""
        call = Watched(transport, time.monotonic())
        if self.replicas() is None:
            yield call
            return
        with self._lock:
            self._call = call
            if self._thread is None and not self._closed:
                self._thread = threading.Thread(target=self._run, name="gemps-primary-watch", daemon=True)
                self._thread.start()
            self._lock.notify()
        try:
            yield call
        finally:
            with self._lock:
                self._call = None

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._lock.notify()

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._closed and (self._call is None or self._call.took_over):
                    self._lock.wait()
                if self._closed:
                    return
                call = self._call
                assert call is not None
                waited = time.monotonic() - call.started
                if waited < self.after:
                    self._lock.wait(self.after - waited)
                    continue
            waiting_on = call.transport.target
            found = self._primary_elsewhere(waiting_on) or self._primary_again(waiting_on)
            with self._lock:
                if found and self._call is call:  # still waiting: move it
                    call.took_over = found
                    log.warning(
                        "%s has not answered for %.1f s and %s: following it",
                        waiting_on, time.monotonic() - call.started,
                        f"{found} is its partition's primary now" if found != waiting_on
                        else f"is primary again under a newer epoch than {self.epoch}",
                    )  # fmt: skip
                    call.transport.interrupt()
                elif not found:
                    self._lock.wait(self.every)

    def _primary_elsewhere(self, waiting_on: str) -> str:
        """Another replica of the set that says it is primary ("" if none does); the set prefers it."""
        replicas = self.replicas()
        for address in replicas.addresses if replicas is not None else ():
            if address == waiting_on:
                continue
            try:
                status = self.probe(address)
            except Exception as error:  # down, or not answering either: ask the next one
                log.debug("asked %s whether it is primary: %s", address, error)
                continue
            if self._ours(address, status):
                assert replicas is not None
                replicas.prefer(address)
                return address
        return ""

    def _primary_again(self, waiting_on: str) -> str:
        """`waiting_on` when it says it is primary under a newer epoch than the one that last
        acknowledged this session ("" otherwise, or before any acknowledgement)."""
        if not self.epoch:
            return ""
        try:
            status = self.probe(waiting_on)
        except Exception as error:  # not answering: the call's own deadline and keepalives decide
            log.debug("asked %s whether it is primary again: %s", waiting_on, error)
            return ""
        newer = status.replication is not None and status.replication.epoch > self.epoch
        return waiting_on if newer and self._ours(waiting_on, status) else ""

    def _ours(self, address: str, status: ServerStatus) -> bool:
        """Whether `address` is a primary of this session's job, under the epoch that last
        acknowledged this session or a newer one. One that says it is primary but is not (another
        job's; an older epoch's: it has not noticed that its lease is gone) is warned of once."""
        replication = status.replication
        if replication is None or replication.role != PRIMARY:
            return False
        job = self.job()
        if job and status.job != job:
            why = f"holds job {describe_job(status.job)}'s central variable, not this worker's job {describe_job(job)}"
        elif replication.epoch < self.epoch:
            why = f"under epoch {replication.epoch}, older than epoch {self.epoch} that acknowledged this worker"
        else:
            return True
        if (address, status.job, replication.epoch) not in self._skipped:
            self._skipped.add((address, status.job, replication.epoch))
            log.warning("%s says it is primary but %s: not followed", address, why)
        return False


class StatusOnly(Protocol):
    def status(self) -> ServerStatus: ...

    def close(self) -> None: ...


class ReplicaProbes:
    """A watch's Probe: a transport to each replica asked (`connect`'s, opened once), its status
    within PROBE_SECONDS."""

    def __init__(self, connect: Callable[[str], StatusOnly]) -> None:
        self._connect = connect
        self._open: dict[str, StatusOnly] = {}
        self._lock = threading.Lock()

    def __call__(self, address: str) -> ServerStatus:
        with self._lock:
            transport = self._open.get(address)
            if transport is None:
                transport = self._open[address] = self._connect(address)
        with call_deadline(PROBE_SECONDS):
            return transport.status()

    def close(self) -> None:
        with self._lock:
            opened, self._open = list(self._open.values()), {}
        for transport in opened:
            transport.close()
