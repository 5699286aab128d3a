"""Whose certificate a data-plane connection answers for, with --tls-crl (issue 77, item 6).

On the TCP port it is the certificate the peer presented in the connection's TLS handshake. The
local socket (an abstract Unix socket: DESIGN §3c) has no TLS: a connection there proves its
worker's ticket, which Register issued over the gRPC port's mutual TLS, so it answers for the
certificate that registered the worker (kept here when Register answers). Either is checked at the
HELLO and again before each request: a connection open before a revocation is refused at its next
request, within a look at the list (revocation.RECHECK_SECONDS), and closed.

A worker this process did not register (it registered with another replica of its partition,
before a failover) has no certificate here: the local socket refuses it (UNAUTHENTICATED), and the
SDK goes on over the TCP port, whose TLS shows its certificate. The certificates of the last
`kept` registrations are kept; an older one's worker meets the same refusal on a new local
connection (an open one holds its certificates).
"""

from __future__ import annotations

import collections
import logging
import socket
import ssl
import threading
from typing import TYPE_CHECKING

from gemps_proto.reasons import Reason
from gemps_server.domain.errors import Unauthenticated
from gemps_server.logs import Throttle, event
from gemps_server.security import presented_by

if TYPE_CHECKING:
    from gemps_server.revocation import Revocations

log = logging.getLogger("gemps.server")
#: seconds between two log lines of one kind of refusal
REFUSAL_LOG_SECONDS = 10.0


class WorkerCertificates:
    """The certificates each of the last `kept` registrations was made with, by worker id."""

    def __init__(self, revocations: Revocations, kept: int) -> None:
        self.revocations = revocations
        self._kept = kept
        self._log = Throttle(interval=REFUSAL_LOG_SECONDS)
        self._lock = threading.Lock()  # Register on the event loop; the data plane on its own thread
        self._by_worker: collections.OrderedDict[str, tuple[bytes, ...]] = collections.OrderedDict()

    def registered(self, worker_id: str, certificates: tuple[bytes, ...]) -> None:
        with self._lock:
            self._by_worker[worker_id] = certificates
            self._by_worker.move_to_end(worker_id)
            while len(self._by_worker) > self._kept:
                self._by_worker.popitem(last=False)

    def of_connection(self, worker_id: str, sock: socket.socket) -> ConnectionCertificates:
        """What a data-plane connection whose HELLO proved `worker_id`'s ticket answers for."""
        if isinstance(sock, ssl.SSLSocket):  # TCP: the peer's own
            return ConnectionCertificates(self, worker_id, presented_by(sock))
        with self._lock:
            return ConnectionCertificates(self, worker_id, self._by_worker.get(worker_id))

    def refused(self, refusal: Unauthenticated) -> Unauthenticated:
        """`refusal`, said in the log (a line every few seconds of each reason at most)."""
        suppressed = self._log.allow(refusal.reason.value)
        if suppressed is not None:
            event(log, "data-plane connection refused", level=logging.WARNING, reason=refusal.reason.value,
                  detail=refusal.message, suppressed=suppressed or None)  # fmt: skip
        return refusal


class ConnectionCertificates:
    """One connection's certificates (None: its worker registered elsewhere)."""

    def __init__(self, known: WorkerCertificates, worker_id: str, certificates: tuple[bytes, ...] | None) -> None:
        self._known = known
        self._worker_id = worker_id
        self._certificates = certificates

    def refusal(self) -> Unauthenticated | None:
        """Why this connection may serve no more requests (None while it may)."""
        if self._certificates is None:
            return self._known.refused(
                Unauthenticated(
                    f"worker {self._worker_id[:64]} did not register at this server, so its certificate is not "
                    "known here: with --tls-crl the local socket takes only workers registered here; use the "
                    "TCP port (its TLS shows the certificate)",
                    Reason.UNAUTHENTICATED,
                )
            )
        why = self._known.revocations.refusal(*self._certificates)
        return self._known.refused(Unauthenticated(why, Reason.REVOKED_CERTIFICATE)) if why else None
