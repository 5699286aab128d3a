"""The replication listener's door (DESIGN §3d; issue 77, item 8): what a peer must show before
a replica gives it a thread, and what a peer that shows nothing can hold.

A backup's first bytes, in clear and before TLS, are its admission (handshake.py: `knock`): the
key's MAC of the epoch it dials, its replica index and a nonce, a fixed PREAMBLE size. The door
reads them in one thread for every connection: a connection whose opening bytes are anything
else (a hello without the proof, a ClientHello, a frame prefix) is refused at once, as is one
whose admission proves nothing; only a proven one is handed on (`enter`: its handshake's thread).

Before that, a connection holds a descriptor and what it sent of an admission (PREAMBLE's 82
bytes at most), no thread, for PREAMBLE_SECONDS at most, on one of PLACES places,
PLACES_PER_ADDRESS from one address. A newcomer always gets a place: past its address's share
the oldest of that address's is closed for it, past all of them the oldest of the address holding
most (unless what that one has sent by now decides it: an admission that arrived is judged).
The bounds used to be places for handshakes, 2 per address, each a thread for 5 s: hellos from
the backup's own address took both places as fast as they were freed, and a backup whose
hello came a few milliseconds after its connection was displaced before it was read, at every
dial. Now a hello without the proof leaves at once, so a flood of them holds no place at all; a
backup's admission comes within a round trip of its connection (under a flood it is there when the
connection is accepted: it waited in the kernel's queue), and only as many silent connections from
its own address, opened in that time, as its address's share can push it out.
"""

from __future__ import annotations

import contextlib
import logging
import selectors
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from gemps_server.descriptors import EXHAUSTED
from gemps_server.replication import frames
from gemps_server.replication.handshake import Refused

log = logging.getLogger("gemps.server")

#: connections waiting for their admission at once: in all, and from one address
PLACES = 128
PLACES_PER_ADDRESS = 64
#: how long a connection may take to send its admission (a backup sends it as it connects)
PREAMBLE_SECONDS = 2.0
#: connections accepted before those waiting are looked at again
ACCEPT_BATCH = 64
#: a refused peer's bytes read before its connection is closed: closing over unread bytes sends a
#: reset, and the refusal would be lost to it
DRAIN_BYTES = 4096
#: how long the door waits when no descriptor is free and none is held to give back
EXHAUSTED_PAUSE = 0.05

#: why a connection was turned away (the metric's reasons; handshake failures are the replica's)
DISPLACED = "displaced"  # waiting for its admission, closed for a newcomer past the places
SILENT = "silent"  # no admission within PREAMBLE_SECONDS, or closed before sending one
UNPROVEN = "unproven"  # opening bytes that are no admission, or one that proves no replica of the job
DESCRIPTORS = "descriptors"  # an accept that failed for want of a descriptor


@dataclass(eq=False)
class _Waiting:
    """An accepted connection whose admission has not arrived yet, and what of it has."""

    sock: socket.socket
    host: str
    deadline: float
    head: bytearray = field(default_factory=bytearray)  # read, not peeked: a partial one is not ready again


#: the replica's verdict on an admission: what `enter` is handed (the proven name); Refused when none
Judge = Callable[[bytes, str], str]
#: a connection turned away: (reason, the peer's address, why), for the metric and the throttled log
Turned = Callable[[str, str, str], None]


class Door:
    """One thread (`run`) between the listener and the handshakes; `stop` from any thread."""

    def __init__(
        self,
        listener: socket.socket,
        judge: Judge,
        enter: Callable[[socket.socket, str, str], None],
        turned: Turned,
        places: int = PLACES,
        per_address: int = PLACES_PER_ADDRESS,
        seconds: float = PREAMBLE_SECONDS,
    ) -> None:
        self._listener = listener
        self._judge, self._enter, self._turned = judge, enter, turned
        self.places, self.per_address, self.seconds = places, per_address, seconds
        listener.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._wake, self._woken = socket.socketpair()
        self._selector.register(listener, selectors.EVENT_READ, None)
        self._selector.register(self._woken, selectors.EVENT_READ, None)
        self._waiting: dict[socket.socket, _Waiting] = {}  # oldest first: each waits as long
        self._by_address: dict[str, dict[socket.socket, _Waiting]] = {}
        self._stopped = threading.Event()

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def stop(self) -> None:
        """Close the door: `run` returns, closing the listener and every waiting connection."""
        self._stopped.set()
        with contextlib.suppress(OSError):
            self._wake.send(b"\0")

    def run(self) -> None:
        try:
            while not self._stopped.is_set():
                oldest = next(iter(self._waiting.values()), None)
                timeout = None if oldest is None else max(0.0, oldest.deadline - time.monotonic())
                for key, _ in self._selector.select(timeout):
                    try:
                        if key.fileobj is self._listener:
                            self._accept()
                        elif isinstance(key.data, _Waiting) and key.data.sock in self._waiting:
                            self._examine(key.data)
                    except Exception:  # a bug must not close the door on every backup for good
                        log.exception("replication listener: a connection could not be examined")
                self._expire()
        finally:
            for waiting in list(self._waiting.values()):
                self._forget(waiting)
                waiting.sock.close()
            self._selector.close()
            for sock in (self._listener, self._wake, self._woken):
                sock.close()

    # -- arrivals ------------------------------------------------------------------------------------

    def _accept(self) -> None:
        for _ in range(ACCEPT_BATCH):
            try:
                sock, address = self._listener.accept()
            except BlockingIOError:
                return
            except OSError as error:
                if error.errno not in EXHAUSTED:
                    return  # a connection gone before it was taken, say: the next wake takes the next
                self._turned(DESCRIPTORS, "", f"{type(error).__name__}: {error}")
                if not self._give_back_oldest():
                    time.sleep(EXHAUSTED_PAUSE)  # the connection waits in the kernel's queue
                return
            sock.setblocking(False)
            self._examine(_Waiting(sock, str(address[0]), time.monotonic() + self.seconds), arrived=True)

    def _give_back_oldest(self) -> bool:
        oldest = next(iter(self._waiting.values()), None)
        if oldest is not None:
            self._turn_away(oldest, DISPLACED, "a descriptor was needed for a newer connection")
        return oldest is not None

    def _examine(self, waiting: _Waiting, arrived: bool = False) -> None:
        """Decide on `waiting` if its opening bytes allow (else it waits: a place is found for a
        connection that has just `arrived`)."""
        try:
            data = waiting.sock.recv(frames.PREAMBLE.size - len(waiting.head))
        except BlockingIOError:
            data = None
        except OSError:
            data = b""
        if data == b"":
            self._turn_away(waiting, SILENT, "closed before its admission", answer=False)
            return
        waiting.head += data or b""
        head = bytes(waiting.head)
        if len(head) < frames.PREAMBLE.size and _may_become_preamble(head):
            if arrived:
                self._wait(waiting)
        elif not head.startswith(frames.PREAMBLE_MAGIC):
            self._turn_away(
                waiting,
                UNPROVEN,
                "no admission: the replication listener takes gemps replicas of this version, which open with one",
            )
        else:
            self._admit(waiting, head)

    def _admit(self, waiting: _Waiting, preamble: bytes) -> None:
        self._forget(waiting)
        sock = waiting.sock
        try:
            name = self._judge(preamble, waiting.host)
        except Refused as refused:
            self._turn_away(waiting, refused.reason, str(refused))
            return
        with contextlib.suppress(OSError):  # a peer gone meanwhile: its handshake fails at once
            sock.send(frames.DOOR_OPEN)  # 12 bytes into an empty buffer: never short
        sock.setblocking(True)
        self._enter(sock, waiting.host, name)

    # -- places ----------------------------------------------------------------------------------------

    def _wait(self, waiting: _Waiting) -> None:
        self._make_room(waiting.host)
        self._waiting[waiting.sock] = waiting
        self._by_address.setdefault(waiting.host, {})[waiting.sock] = waiting
        self._selector.register(waiting.sock, selectors.EVENT_READ, waiting)

    def _make_room(self, host: str) -> None:
        """Free a place for a newcomer from `host`, if it needs one: past its address's share the
        oldest of that address's, past all of them the oldest of the fullest address's. What the
        one to go has sent by now is read first: an admission that has arrived is judged, never
        displaced (a batch of accepts from the backup's own address would push it out unread)."""
        while True:
            mine = self._by_address.get(host, {})
            if len(mine) >= self.per_address:
                oldest, why = next(iter(mine.values())), "its address's places were taken by newer ones"
            elif len(self._waiting) >= self.places:
                fullest = max(self._by_address.values(), key=len)
                oldest, why = next(iter(fullest.values())), "every place was taken by newer connections"
            else:
                return
            self._examine(oldest)
            if oldest.sock in self._waiting:  # nothing that decides it: it goes
                self._turn_away(oldest, DISPLACED, why)

    def _forget(self, waiting: _Waiting) -> None:
        if self._waiting.pop(waiting.sock, None) is None:
            return
        self._selector.unregister(waiting.sock)
        mine = self._by_address[waiting.host]
        del mine[waiting.sock]
        if not mine:
            del self._by_address[waiting.host]

    def _expire(self) -> None:
        now = time.monotonic()
        while self._waiting:
            oldest = next(iter(self._waiting.values()))
            if oldest.deadline > now:
                return
            self._turn_away(oldest, SILENT, f"no admission within {self.seconds:g} s")

    def _turn_away(self, waiting: _Waiting, reason: str, why: str, answer: bool = True) -> None:
        """Close `waiting`, telling the peer `why` in a REFUSED frame (in clear) when `answer`."""
        self._forget(waiting)
        self._turned(reason, waiting.host, why)  # counted before the peer can read the refusal
        sock = waiting.sock
        with contextlib.suppress(OSError):
            if answer:
                sock.send(frames.encoded(frames.Frame(frames.REFUSED, {"reason": why})))
            for _ in range(2):  # what it sent, so that the close is a FIN, not a reset
                if not sock.recv(DRAIN_BYTES):
                    break
        sock.close()


def _may_become_preamble(head: bytes) -> bool:
    """Whether `head`, shorter than an admission, is the start of one."""
    magic = frames.PREAMBLE_MAGIC
    return head[: len(magic)] == magic[: len(head)]
