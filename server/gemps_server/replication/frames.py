"""The replication stream's frames: a JSON header and a body of raw byte blobs, on a TCP socket
(inside TLS when the job runs TLS).

    frame = length of header (u32 LE) | length of body (u64 LE) | header (JSON, UTF-8) | body

The header says what the frame is (`kind`) and the lengths of the blobs the body holds, in order
(a commit's payload, a seed's image): bytes are sent as they are, never inside JSON. Blocking
sockets, one reader and one writer thread per peer (a primary's entries also written without
waiting by the thread that appends them: `send_some`): a replication stream is one connection per
backup, not thousands of clients (the data plane's single-threaded loop answers that problem).
"""

from __future__ import annotations

import json
import select
import socket
import ssl
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

_PREFIX = struct.Struct("<IQ")
MAX_HEADER_BYTES = 1 << 20
# What one frame's body may hold: a seed carries θ and every worker's rule state.
MAX_BODY_BYTES = 1 << 40
#: what a frame from a peer not yet known may hold (a hello: a header, no body); read before the
#: token is checked, so it is all an unknown peer can make a replica hold (DESIGN §3b)
HELLO_HEADER_BYTES = 4096
#: buffers one sendmsg takes at most (IOV_MAX: a seed is sent as one buffer per tensor)
MAX_BUFFERS = 1024

#: backup -> primary: who it is (name, incarnation, the epoch it expects, a nonce); then the
#: handshake (handshake.py): the primary's CHALLENGE, the backup's PROOF, the primary's WELCOME
HELLO = "hello"
CHALLENGE = "challenge"
PROOF = "proof"
WELCOME = "welcome"
#: primary -> backup: the whole state at a journal position (one blob: the image)
SEED = "seed"
#: primary -> backup: one journal entry
ENTRY = "entry"
#: backup -> primary: every entry up to `position` applied
ACK = "ack"
#: primary -> backup: nothing to forward for a while; the backup answers with an ack (both know
#: the stream is alive: a cut cable shows as silence, not as an error)
BEAT = "beat"
#: either way: why the stream ends
REFUSED = "refused"
#: how often a primary beats on an idle stream, and how long a backup waits for a frame before it
#: takes the stream for dead
BEAT_SECONDS = 0.5
SILENCE_SECONDS = 4 * BEAT_SECONDS

#: backup -> primary, before anything else (and before TLS, in clear): its admission at the
#: listener's door (door.py, handshake.py): a magic, the epoch it dials, its replica index, a nonce
#: and the job's key's MAC of them (gemps_proto.proofs.replica_admission); no name, no frame
PREAMBLE = struct.Struct("<8sQH32s32s")
PREAMBLE_MAGIC = b"gemps\x00r2"
#: primary -> backup: the door opened (the handshake follows, in TLS when the job runs it); else a
#: REFUSED frame. Read as a frame's prefix it would claim a header past MAX_HEADER_BYTES: no frame
DOOR_OPEN = b"gemps-open\x00\x00"


class StreamClosed(ConnectionError):
    """The peer closed the stream, or sent something that is not a frame."""


Blob = bytes | bytearray | memoryview


@dataclass(frozen=True)
class Frame:
    kind: str
    header: dict[str, Any] = field(default_factory=dict)
    blobs: Sequence[Blob] = ()

    def encode(self) -> list[Blob]:
        """The frame's bytes as buffers for one sendmsg (the blobs are not copied)."""
        header = dict(self.header, kind=self.kind, blobs=[memoryview(blob).nbytes for blob in self.blobs])
        raw = json.dumps(header, separators=(",", ":")).encode()
        return [started(raw, sum(header["blobs"])), *self.blobs]


def started(header: bytes, body_bytes: int) -> bytes:
    """A frame's start: its prefix and its JSON `header` (the header's `blobs` add up to `body_bytes`)."""
    return _PREFIX.pack(len(header), body_bytes) + header


#: an SSL socket has no sendmsg: buffers up to this size are joined into one write (one record)
_JOIN_BYTES = 1 << 16


def buffers(frame: Frame) -> list[memoryview]:
    """`frame`'s bytes as byte views for `send_buffers`/`send_some` (encoded once, sent to every backup)."""
    return [memoryview(buffer).cast("B") for buffer in frame.encode()]


def send(sock: socket.socket, frame: Frame) -> None:
    send_buffers(sock, buffers(frame))


def send_buffers(sock: socket.socket, views: list[memoryview]) -> None:
    """Write `views` whole (blocking; within the socket's send timeout)."""
    if isinstance(sock, ssl.SSLSocket):
        if sum(view.nbytes for view in views) <= _JOIN_BYTES:
            views = [memoryview(b"".join(views))]
        for view in views:
            sock.sendall(view)
        return
    while views:
        views = _past(views, sock.sendmsg(views[:MAX_BUFFERS]))


def send_some(sock: socket.socket, views: list[memoryview]) -> list[memoryview]:
    """Write what plain `sock` takes now, without waiting: what is left of `views` ([]: all sent)."""
    while views:
        try:
            views = _past(views, sock.sendmsg(views[:MAX_BUFFERS], [], socket.MSG_DONTWAIT))
        except BlockingIOError:  # full: nothing taken
            break
    return views


def _past(views: list[memoryview], sent: int) -> list[memoryview]:
    """What is left of `views` once their first `sent` bytes were written."""
    done = 0
    while done < len(views) and sent >= views[done].nbytes:
        sent -= views[done].nbytes
        done += 1
    rest = views[done:]
    if rest and sent:
        rest[0] = rest[0][sent:]
    return rest


def arrived(sock: socket.socket) -> bool:
    """Whether bytes of a next frame are on `sock` already (asked without waiting)."""
    if isinstance(sock, ssl.SSLSocket) and sock.pending():
        return True
    return bool(select.select([sock], [], [], 0)[0])


def encoded(frame: Frame) -> bytes:
    """`frame`'s bytes in one buffer (a small frame, sent without blocking: door.py)."""
    return b"".join(bytes(buffer) for buffer in frame.encode())


def door_answer(sock: socket.socket, deadline: float) -> Frame | None:
    """What the primary's door answered an admission: None when it opened, else its frame (a
    REFUSED one, from a gemps replica), by `deadline`."""
    prefix = bytes(_read(sock, _PREFIX.size, deadline))
    if prefix == DOOR_OPEN:
        return None
    return _rest(sock, prefix, HELLO_HEADER_BYTES, 0, deadline)


def receive(
    sock: socket.socket,
    *,
    max_header: int = MAX_HEADER_BYTES,
    max_body: int = MAX_BODY_BYTES,
    deadline: float | None = None,
) -> Frame:
    """The next frame; StreamClosed at the end of the stream, on a malformed frame or one past the
    bounds (checked before anything past the prefix is read). `deadline` (time.monotonic()): the
    whole frame must have arrived by then (socket.timeout otherwise), however slowly it trickles."""
    return _rest(sock, _read(sock, _PREFIX.size, deadline), max_header, max_body, deadline)


def _rest(
    sock: socket.socket, prefix: bytes | bytearray, max_header: int, max_body: int, deadline: float | None
) -> Frame:
    """The frame whose prefix was read."""
    header_bytes, body_bytes = _PREFIX.unpack(prefix)
    if header_bytes > max_header or body_bytes > max_body:
        raise StreamClosed(
            f"replication frame of {header_bytes} + {body_bytes} bytes (at most {max_header} + {max_body} here): "
            "not from a gemps replica"
        )
    try:
        header = json.loads(_read(sock, header_bytes, deadline))
        kind, lengths = header.pop("kind"), header.pop("blobs")
    except (ValueError, KeyError, TypeError) as error:
        raise StreamClosed(f"malformed replication frame header: {error}") from None
    if (
        not isinstance(lengths, list)
        or any(not isinstance(n, int) or n < 0 for n in lengths)
        or sum(lengths) != body_bytes
    ):
        raise StreamClosed("replication frame: blob lengths do not add up to its body")
    body = memoryview(_read(sock, body_bytes, deadline))
    blobs, start = [], 0
    for length in lengths:
        blobs.append(body[start : start + length])
        start += length
    return Frame(str(kind), header, blobs)


def _read(sock: socket.socket, count: int, deadline: float | None = None) -> bytearray:
    data = bytearray(count)
    view, done = memoryview(data), 0
    while done < count:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"replication frame: {done} of {count} bytes by its deadline")
            sock.settimeout(left)
        got = sock.recv_into(view[done:], count - done)
        if not got:
            raise StreamClosed("the replication stream's peer closed it")
        done += got
    return data
