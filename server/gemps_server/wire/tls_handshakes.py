"""The data plane's TLS handshakes, off its loop's thread (DESIGN §3c; issue 42, item 4).

A handshake's key exchange and signature cost the server much more than they cost a client (a
ClientHello can be replayed for nothing), and the loop's one thread (data_plane_loop.py) serves
every connection's requests, shared-memory ones included: done there, a flood of ClientHellos
took honest commits from 1,218/s to 19/s. Here --tls-handshake-threads threads each drive
handshakes with a selector of their own (a slow peer holds no thread; ssl releases the GIL for the
crypto, so the loop goes on meanwhile), and hand the finished SSLSocket back through `Loop.post`;
the connection's task then goes on to its HELLO.

Bounds, checked at accept before any handshake work (past one, the connection is closed at once
and counted as `handshake_limit`): at most --max-handshakes-per-source under way from one address,
and at most --handshake-cpu-per-source of a core of handshake work from it (the threads' time,
measured: a ClientHello that asks for ffdhe8192 costs the server ~80 ms, a usual one ~1 ms, so a
count of handshakes would not bound the cores). A
connection in handshake is one of the unproven (data_plane.py): --max-unproven-data-connections
bounds them all (the oldest is closed for a newcomer) and its HELLO's deadline, from accept, ends
its handshake too.

While a handshake runs, its connection's task waits (a Handshake wait) holding its place among
the unproven, and can be ended at any time (evicted, timed out, the server stopping). The thread
works on a duplicate of the socket's descriptor: ending the task shuts the socket down, which
ends the thread's handshake, and the thread closes its duplicate; a descriptor is never closed
under a thread that still uses it.
"""

from __future__ import annotations

import collections
import contextlib
import os
import selectors
import socket
import ssl
import threading
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any

from gemps_server.security import presented_by
from gemps_server.token_bucket import TokenBucket
from gemps_server.wire.data_plane_io import PeerClosed, Revoked, Stalled
from gemps_server.wire.data_plane_loop import Handshake, Loop, Task, Wait

# Seconds of handshake work an address is charged for each handshake however little its thread
# worked (the loop's share: accept, hand-over), and how many seconds' worth of
# --handshake-cpu-per-source it may spend at once.
MIN_CHARGE = 0.001
BURST_SECONDS = 5.0
# Addresses whose budgets are kept before full ones are forgotten (a full one is as good as
# none), at most once a second: what a flood from many addresses can make this hold.
BUDGETS_KEPT = 4096
JOIN_SECONDS = 5.0


@dataclass(eq=False)
class _Job:
    """One connection's handshake: `sock` is the thread's duplicate of the task's socket."""

    sock: socket.socket
    source: str
    deadline: float
    task: Task
    wait: Handshake
    thread: _Thread
    tls: ssl.SSLSocket | None = None  # once the thread wrapped `sock` (which it then owns)
    registered: int = 0  # the selector events the thread waits for
    cpu: float = 0.0  # seconds of the thread's time spent on it
    cancelled: bool = False  # the task ended: the thread drops it (its socket is shut down)


Finished = Callable[[_Job, BaseException | None], None]
# Why a handshaken peer is refused, given its certificates (DER, its own first: revocation.presented_by):
# '' when it is not (--tls-crl).
CertificateCheck = Callable[..., str]


class Handshakes:
    """The threads and the bounds; `admit` and `run` on the loop's thread."""

    def __init__(
        self,
        context: ssl.SSLContext,
        loop: Loop,
        threads: int,
        per_source: int,
        cpu: float,
        check: CertificateCheck | None = None,
    ) -> None:
        self._loop = loop
        self._per_source = per_source
        self._cpu = cpu  # seconds of handshake work an address earns a second
        self._under_way: collections.Counter[str] = collections.Counter()  # by address
        self._budgets: dict[str, TokenBucket] = {}  # address -> its seconds of handshake work
        self._prune_at = 0.0
        self._threads = [_Thread(context, self._finished, f"gemps-tls-handshake-{n}", check) for n in range(threads)]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        """End the threads, closing the sockets still in handshake (after the loop closed)."""
        for thread in self._threads:
            thread.stop()

    # -- on the loop's thread --------------------------------------------------------------------

    def admit(self, source: str) -> str | None:
        """None when a handshake from `source` may start now (charged MIN_CHARGE); else why not."""
        if self._under_way[source] >= self._per_source:
            return f"{self._per_source} TLS handshakes from {source} under way (--max-handshakes-per-source)"
        if not self._cpu:
            return None
        if not self._budget(source).allow(MIN_CHARGE):
            return f"TLS handshakes from {source} took more than {self._cpu:g} of a core (--handshake-cpu-per-source)"
        return None

    def _budget(self, source: str) -> TokenBucket:
        """`source`'s seconds of handshake work (forgetting full ones past BUDGETS_KEPT)."""
        budget = self._budgets.get(source)
        if budget is None:
            now = time.monotonic()
            if len(self._budgets) >= BUDGETS_KEPT and now >= self._prune_at:
                self._prune_at = now + 1.0
                for address in [a for a, kept in self._budgets.items() if kept.full()]:
                    del self._budgets[address]
            budget = self._budgets[source] = TokenBucket(self._cpu, self._cpu * BURST_SECONDS)
        return budget

    def run(self, source: str, task: Task, deadline: float) -> Generator[Wait, Any, None]:
        """The handshake of `task`'s connection, admitted from `source`, done on a thread: then the
        channel's socket is the handshaken SSLSocket. PeerClosed if it failed; Stalled past `deadline`."""
        channel = task.channel
        try:
            duplicate = socket.socket(fileno=os.dup(channel.sock.fileno()))
        except OSError as error:  # out of descriptors: no handshake
            raise PeerClosed(str(error)) from None
        thread = min(self._threads, key=lambda t: t.load)
        job = _Job(duplicate, source, deadline, task, Handshake(deadline), thread)
        self._under_way[source] += 1
        thread.load += 1
        thread.submit(job)
        try:
            tls = yield job.wait
        except BaseException:  # failed, timed out, or the task was ended (GeneratorExit)
            job.cancelled = True
            channel.shutdown()  # ends the thread's handshake, if it still runs
            raise
        channel.sock.close()  # the connection lives on in the duplicate
        channel.sock = tls

    def _finished(self, job: _Job, error: BaseException | None) -> None:
        """From a thread: `job` is over; tell its task on the loop's thread."""
        self._loop.post(lambda: self._over(job, error))

    def _over(self, job: _Job, error: BaseException | None) -> None:
        job.thread.load -= 1
        self._under_way[job.source] -= 1
        if not self._under_way[job.source]:
            del self._under_way[job.source]
        if self._cpu and job.cpu > MIN_CHARGE:
            self._budget(job.source).charge(job.cpu - MIN_CHARGE)  # the rest of what its thread spent
        task = job.task
        if task.done or task.waiting is not job.wait:  # ended meanwhile
            if job.tls is not None and error is None:
                job.tls.close()
            return
        task.resume(job.tls if error is None else None, error)


class _Thread:
    """A thread that drives the handshakes handed to it, each as far as its peer's bytes allow."""

    def __init__(self, context: ssl.SSLContext, finished: Finished, name: str, check: CertificateCheck | None) -> None:
        self._context = context
        self._check = check
        self._finished = finished
        self._selector = selectors.DefaultSelector()
        self._wake_reader, self._wake_writer = socket.socketpair()
        self._wake_reader.setblocking(False)
        self._wake_writer.setblocking(False)
        self._selector.register(self._wake_reader, selectors.EVENT_READ, None)
        self._incoming: collections.deque[_Job] = collections.deque()
        self._jobs: set[_Job] = set()  # this thread's, under way
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.load = 0  # jobs handed over and not over yet (the loop's thread counts them)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopping = True
        if self._thread.ident is None:  # never started: its `finally` never runs
            self._selector.close()
            self._wake_reader.close()
            self._wake_writer.close()
            return
        self._wake()
        self._thread.join(JOIN_SECONDS)

    def submit(self, job: _Job) -> None:
        self._incoming.append(job)
        self._wake()

    def _wake(self) -> None:
        with contextlib.suppress(OSError):  # full: a wake-up is pending anyway
            self._wake_writer.send(b"\0")

    # -- on the thread -----------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stopping:
                # idle, it sleeps until handed a job; else it wakes by the next deadline
                nearest = min((job.deadline for job in self._jobs), default=None)
                timeout = None if nearest is None else max(0.0, nearest - time.monotonic())
                for key, _events in self._selector.select(timeout):
                    if key.data is None:
                        with contextlib.suppress(BlockingIOError):
                            while self._wake_reader.recv(4096):
                                pass
                    else:
                        self._step(key.data)
                while self._incoming:
                    self._begin(self._incoming.popleft())
                now = time.monotonic()
                for job in [j for j in self._jobs if j.deadline <= now or j.cancelled]:
                    self._end(job, Stalled() if job.deadline <= now else PeerClosed("ended"))
        finally:
            for job in [*self._jobs, *self._incoming]:
                _close(job)
            self._selector.close()
            self._wake_reader.close()
            self._wake_writer.close()

    def _begin(self, job: _Job) -> None:
        if job.cancelled:
            _close(job)
            self._finished(job, PeerClosed("ended"))
            return
        self._jobs.add(job)
        self._step(job)

    def _step(self, job: _Job) -> None:
        """Take the handshake as far as it goes now; its thread time counted before it is over
        (the loop charges its address then)."""
        started = time.thread_time()
        events = 0
        error: BaseException | None = None
        try:
            if job.tls is None:
                job.sock.setblocking(False)  # the descriptor's flag is shared: already so, but say it
                job.tls = self._context.wrap_socket(job.sock, server_side=True, do_handshake_on_connect=False)
            job.tls.do_handshake()
            refusal = self._check(*presented_by(job.tls)) if self._check is not None else ""
            if refusal:
                error = Revoked(refusal)
        except ssl.SSLWantReadError:
            events = selectors.EVENT_READ
        except ssl.SSLWantWriteError:
            events = selectors.EVENT_WRITE
        except (ssl.SSLError, OSError) as failed:  # no or a wrong certificate, not TLS, the peer gone
            error = PeerClosed(str(failed))
        job.cpu += time.thread_time() - started
        if events:
            self._watch(job, events)
        else:
            self._end(job, error)

    def _watch(self, job: _Job, events: int) -> None:
        assert job.tls is not None
        if job.registered == events:
            return
        if job.registered:
            self._selector.modify(job.tls, events, job)
        else:
            self._selector.register(job.tls, events, job)
        job.registered = events

    def _end(self, job: _Job, error: BaseException | None) -> None:
        if job.registered:
            self._selector.unregister(job.tls)  # type: ignore[arg-type]  # registered: wrapped
            job.registered = 0
        self._jobs.discard(job)
        if error is not None:
            _close(job)
        self._finished(job, error)


def _close(job: _Job) -> None:
    with contextlib.suppress(OSError):
        (job.tls or job.sock).close()
