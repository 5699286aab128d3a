"""A backup's side of replication: dial the primary, adopt its image, apply its journal, acknowledge.

Each entry is applied through the applier (one operation at a time, like the primary's) with
`ServerState.replay`, on the follower's own thread while nothing else runs there (as a primary
applies a commit on its data plane's thread), then acknowledged by position. A frame of another
epoch than the primary's this backup dialled ends the stream: a replica never applies anything
from an older primary; so does any frame once --tls-crl revokes the primary's certificate
(handshake.certificate_check).
When the stream ends for any reason the replica (replica.py) decides what next: dial again, or
campaign.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import socket
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from gemps_server.domain import images
from gemps_server.domain.applier import Applier, Timed
from gemps_server.domain.state import ServerState
from gemps_server.logs import event
from gemps_server.replication import entries, frames, image_codec
from gemps_server.replication.forwarder import Peer
from gemps_server.replication.handshake import Handshake, Refused

log = logging.getLogger("gemps.server")
T = TypeVar("T")

#: seconds to connect to the primary
CONNECT_SECONDS = 5.0
#: seconds to hear the first bytes of the primary's seed (it encodes θ and every worker's state)
SEED_SECONDS = 120.0
#: a backup acknowledges the entries it applied once no byte of a next frame has arrived, and at
#: the latest every ACK_EVERY entries or ACK_WITHIN seconds after the first it holds unacknowledged:
#: while entries arrive back to back one acknowledgement answers several (each one costs the primary
#: a read and a hand-over of the commits it releases: issue 80), and none waits past ACK_WITHIN
ACK_EVERY = 16
ACK_WITHIN = 0.005


def split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]") or "127.0.0.1", int(port)


def _on_applier(applier: Applier, operation: Callable[[], T], inline: bool = False) -> T:
    """Run `operation` on the applier and wait for it (the follower is a thread of its own);
    `inline`: on this thread when nothing else is queued or running there (the module's docstring)."""
    finished = threading.Event()
    outcome: list[Timed[T] | None] = [None]
    failure: list[BaseException | None] = [None]

    def deliver(timed: Timed[T] | None, error: BaseException | None) -> None:
        outcome[0], failure[0] = timed, error
        finished.set()

    applier.submit_then(operation, deliver, inline=inline)
    finished.wait()
    if failure[0] is not None:
        raise failure[0]
    assert outcome[0] is not None
    return outcome[0].result


class Follower:
    """Follows the primary at `primary` (its replication address) in `epoch`; `on_end(why)` once the
    stream ends (not when stopped)."""

    def __init__(
        self,
        state: ServerState,
        applier: Applier,
        me: Peer,
        primary: str,
        epoch: int,
        handshake: Handshake,
        primary_name: str,
        on_end: Callable[[str], None],
        adopt_ticket_key: Callable[[bytes], None] | None = None,
    ) -> None:
        self._state, self._applier, self._me = state, applier, me
        self.primary, self.epoch = primary, epoch
        self._handshake, self._primary_name = handshake, primary_name
        self._on_end = on_end
        self._adopt_ticket_key = adopt_ticket_key  # the primary's, from the handshake (data-plane tickets)
        self.applied = 0  # entries applied from this primary
        self.seeded = False
        self.refused = False  # the process at the primary's address answered, refusing (alive, not primary)
        self._stopped = False
        self._sock: socket.socket | None = None
        self._thread = threading.Thread(target=self._run, name="gemps-replication-follow", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def join(self, timeout: float) -> None:
        if self._thread.is_alive():
            self._thread.join(timeout)

    def stop(self) -> None:
        self._stopped = True
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)

    def _run(self) -> None:
        try:
            self._follow()
            why = "the primary ended the stream"
        except (OSError, ValueError, KeyError, TypeError) as error:
            why = f"{type(error).__name__}: {error}"
            self.refused = isinstance(error, Refused)
        if self._sock is not None:
            self._sock.close()
        if not self._stopped:
            event(
                log,
                "replication stream ended",
                level=logging.WARNING,
                primary=self.primary,
                epoch=self.epoch,
                reason=why,
            )
            self._on_end(why)

    def _follow(self) -> None:
        sock = socket.create_connection(split_address(self.primary), timeout=CONNECT_SECONDS)
        self._sock = sock
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        me = self._me
        hello = {"name": me.name, "incarnation": me.incarnation, "address": me.address, "replication": me.replication}
        # Both prove themselves before anything of the state crosses (handshake.py): no token sent.
        deadline = time.monotonic() + CONNECT_SECONDS
        sock, ticket_key = self._handshake.join(sock, hello, self.epoch, self._primary_name, self.primary, deadline)
        self._sock = sock
        revoked = self._handshake.certificate_check(sock, "primary")  # asked at each frame: a beat at least
        sock.settimeout(SEED_SECONDS)  # the primary encodes its image first: no beats meanwhile
        position, unacknowledged, since = 0, 0, 0.0
        while not self._stopped:
            frame = frames.receive(sock)
            if why := revoked():
                raise Refused(why)
            if frame.kind == frames.REFUSED:
                raise ConnectionError(f"refused by the primary: {frame.header.get('reason', '')}")
            if int(frame.header.get("epoch", -1)) != self.epoch:
                raise ConnectionError(
                    f"a frame of epoch {frame.header.get('epoch')} from the primary of epoch {self.epoch}"
                )
            if frame.kind == frames.SEED:
                image = image_codec.decode(frame.blobs)  # streamed as parts: the header, then each tensor
                _on_applier(self._applier, functools.partial(images.adopt, self._state, image))
                del image
                if self._adopt_ticket_key is not None:
                    self._adopt_ticket_key(ticket_key)
                position = int(frame.header["position"])
                self.seeded = True
                sock.settimeout(frames.SILENCE_SECONDS)  # from now on a live primary beats when idle
                event(
                    log,
                    "seeded",
                    primary=self.primary,
                    epoch=self.epoch,
                    position=position,
                    version=self._state.core.version,
                )
            elif frame.kind == frames.BEAT:
                pass  # answered with the position applied so far
            elif frame.kind == frames.ENTRY and self.seeded:
                entry, position, _epoch = entries.decode(frame)
                _on_applier(self._applier, functools.partial(self._state.replay, entry), inline=True)
                self.applied += 1
                unacknowledged, since = unacknowledged + 1, since if unacknowledged else time.monotonic()
                if unacknowledged < ACK_EVERY and time.monotonic() - since < ACK_WITHIN and frames.arrived(sock):
                    continue  # the next entry is here already: one acknowledgement for both
            else:
                raise ConnectionError(f"unexpected replication frame {frame.kind!r}")
            frames.send(sock, frames.Frame(frames.ACK, {"position": position}))
            unacknowledged = 0
