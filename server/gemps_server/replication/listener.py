"""A replica's replication listener (DESIGN §3d): its door (door.py) in one thread; behind it each
proven backup's handshake (handshake.py) in a thread of its own, HANDSHAKES_PER_BACKUP at once for
each backup the partition has at most; then the forwarder seeds it. What it turns away is counted
by reason (`gemps_replication_refusals_total`) and said in a WARNING at most once a second of
each kind, with how many were left unsaid.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections.abc import Callable

from gemps_server.logs import Throttle, event
from gemps_server.replication import frames
from gemps_server.replication.door import DESCRIPTORS, DISPLACED, SILENT, UNPROVEN, Door
from gemps_server.replication.follower import CONNECT_SECONDS
from gemps_server.replication.forwarder import Forwarder, Peer
from gemps_server.replication.handshake import Handshake, Refused
from gemps_server.replication.member import Member
from gemps_server.security import Tickets

log = logging.getLogger("gemps.server")

#: proven handshakes under way at once, for each of the partition's backups: a backup dials again
#: once its last connection ended, whose handshake's thread may not have noticed yet
HANDSHAKES_PER_BACKUP = 2
#: how long stopping waits for the door's thread to close the listener (it is woken at once)
STOP_SECONDS = 5.0
#: backlog of connections the kernel queues before the door accepts them: under a flood a backup's
#: admission waits there with its connection, and is read the moment it is accepted
BACKLOG = 256

# The metric's reasons besides the door's own (door.py): a proven peer's.
REPLAYED = "replayed"  # an admission taken before
NOT_PRIMARY = "not_primary"  # proven, but this replica does not lead the epoch it dials
BUSY = "busy"  # proven, past the handshakes a partition's backups need
REFUSED = "refused"  # refused by the handshake (a name, a certificate, no proof) or at the door
HANDSHAKE_FAILED = "handshake_failed"  # a proven peer's handshake broke off or ran out of time
REASONS = (UNPROVEN, SILENT, DISPLACED, REPLAYED, NOT_PRIMARY, BUSY, REFUSED, HANDSHAKE_FAILED, DESCRIPTORS)


class Refusals:
    """Connections turned away, by reason (thread-safe: the door's thread and the handshakes')."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(REASONS, 0)
        self._log = Throttle(interval=1.0)  # an unknown peer's every try must not be a line

    def count(self, reason: str, what: str, **fields: str) -> None:
        with self._lock:
            self._counts[reason] = self._counts.get(reason, 0) + 1
        suppressed = self._log.allow(what)
        if suppressed is not None:
            event(log, what, level=logging.WARNING, reason=reason, suppressed=suppressed or None, **fields)

    def counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)


class Listener:
    """The listener of replica `me`, on `sock`: `refusal(name, epoch)` says why it takes no backup
    of that name dialling that epoch now ('' when it does); `forwarder()` is its forwarder while
    primary; `refusals` counts what it turns away."""

    def __init__(
        self,
        sock: socket.socket,
        handshake: Handshake,
        me: Member,
        tickets: Tickets,
        refusals: Refusals,
        refusal: Callable[[str, object], str],
        forwarder: Callable[[], Forwarder | None],
    ) -> None:
        self._handshake, self._me, self._tickets = handshake, me, tickets
        self._refusal, self._forwarder = refusal, forwarder
        self.refusals = refusals
        self._lock = threading.Lock()
        self._handshakes = 0  # proven handshakes under way
        self.most_handshakes = HANDSHAKES_PER_BACKUP * max(1, handshake.replicas - 1)
        self._door = Door(sock, self._judge, self._enter, self._turned)
        self._thread = threading.Thread(target=self._door.run, name="gemps-replication-door", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Close the door and wait until the listener is closed (its port may be bound again)."""
        self._door.stop()
        if self._thread.is_alive():
            self._thread.join(STOP_SECONDS)

    def _turned(self, reason: str, host: str, why: str) -> None:
        self.refusals.count(reason, "replication connection refused", peer=host, why=why)

    def _judge(self, preamble: bytes, host: str) -> str:
        """The door's verdict on an admission (door.py): the proven name; Refused when none."""
        name, epoch = self._handshake.admission(preamble, self._me.replication, self._me.name)
        why = self._refusal(name, epoch)
        if why:
            raise Refused(why, reason=NOT_PRIMARY)
        with self._lock:
            if self._handshakes >= self.most_handshakes:
                raise Refused(f"{self._handshakes} handshakes of backups under way already: try again", reason=BUSY)
            self._handshakes += 1
        return name

    def _enter(self, sock: socket.socket, host: str, name: str) -> None:
        try:
            threading.Thread(
                target=self._greet, args=(sock, host, name), name="gemps-replication-hello", daemon=True
            ).start()
        except RuntimeError:  # no thread to be had: the backup dials again
            self._ended()
            sock.close()

    def _ended(self) -> None:
        with self._lock:
            self._handshakes -= 1

    def _greet(self, sock: socket.socket, host: str, name: str) -> None:
        """The handshake of a backup whose admission proved `name`, in CONNECT_SECONDS and a
        handshake's bytes at most, before anything is taken for it; then the forwarder seeds it."""
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            forwarder = self._forwarder()
            epoch = forwarder.epoch if forwarder is not None else 0
            deadline = time.monotonic() + CONNECT_SECONDS
            sock, header = self._handshake.admit(
                sock, self._me.name, self._me.replication, epoch, self._tickets.key, deadline, self._refusal_of,
                name,
            )  # fmt: skip
            sock.settimeout(None)
            peer = Peer(
                str(header["name"]), str(header["incarnation"]), str(header["address"]), str(header["replication"])
            )
        except Refused as refused:
            self.refusals.count(REFUSED, "backup refused", peer=host, backup=name, why=str(refused))
            return
        except (OSError, ValueError, KeyError, TypeError) as error:  # ssl.SSLError included
            failure = f"{type(error).__name__}: {error}"
            self.refusals.count(HANDSHAKE_FAILED, "replication hello failed", peer=host, backup=name, error=failure)
            sock.close()  # closed already past the handshake's start
            return
        finally:
            self._ended()
        forwarder = self._forwarder()
        if forwarder is None or forwarder.epoch != int(header["epoch"]):
            sock.close()
            return
        revoked = self._handshake.certificate_check(sock, "backup")  # asked again while it is attached
        refusal = forwarder.attach(peer, sock, revoked)  # one backup per name, R-1 at most (it logs refusals)
        if refusal:
            with contextlib.suppress(OSError):
                frames.send(sock, frames.Frame(frames.REFUSED, {"reason": refusal, "epoch": forwarder.epoch}))
            sock.close()
        else:
            event(log, "backup joining", backup=peer.name, epoch=forwarder.epoch)

    def _refusal_of(self, hello: frames.Frame) -> str:
        return self._refusal(str(hello.header.get("name", "")), hello.header.get("epoch"))


def listen(host: str, port: int) -> socket.socket:
    """The replication listener, bound (port 0: a free one)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(BACKLOG)
    return sock
