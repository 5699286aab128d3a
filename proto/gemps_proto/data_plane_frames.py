"""The data plane's frames, defined once (DESIGN §3c): the 20-byte preamble, the ops and the SHARED flag.

gRPC stays the control plane (Register, Leave, Status, health) and a complete data path; the data
plane is a second door for the two calls that carry θ. A connection starts with a handshake in
which each end proves it holds the ticket of one registration (RegisterResponse.data_plane)
without sending it (a CHALLENGE and its answer, then a HELLO and its reply:
gemps_proto/proofs.py), then alternates one request and its reply. Every frame is

    preamble (20 bytes, PREAMBLE)   magic, version, op, flags, header length, payload length
    header                          a gemps.v1 message, serialized: the request or the reply
                                    without its tensor's data (the tensor's dtype and shape are
                                    announced in it), a handshake's message, or a DataPlaneError
    payload                         the tensor's raw little-endian bytes (θ, or a commit's payload)

so the receiver knows every size before it reads a byte of it, reads the payload straight into
the buffer it will use, and the sender writes θ from its own memory. Requests and replies are the
gRPC path's messages: the same fields, the same checks, the same reasons.

On the same host (DataPlane.local_socket, a Unix socket) a client may ATTACH shared memory once
after its HELLO: one memfd, passed with the frame. From then on a frame flagged SHARED carries no
payload bytes on the socket: its `payload bytes` are at the start of that memory (a request's
payload written there by the client, a reply's θ by the server), so θ crosses no socket at all.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

MAGIC = b"GMDP"
# 2: the handshake proves the server too (CHALLENGE); in 1 the HELLO carried the ticket itself.
VERSION = 2
#: magic, version, op, flags, header bytes, payload bytes
PREAMBLE = struct.Struct("<4sBBHIQ")
REPLY = 0x80  # a reply's op is its request's | REPLY
SHARED = 0x1  # flag: the payload is in the attached shared memory, not on the socket
FLAGS = SHARED  # every flag defined


class Op(enum.IntEnum):
    """What a frame is. A reply carries its request's op with the REPLY bit; ERROR answers any."""

    CHALLENGE = 5  # first: DataPlaneChallenge; reply: DataPlaneAnswer (the server's proof)
    HELLO = 1  # second, once the answer is proven: DataPlaneHello (the client's proof); reply: empty
    COMMIT = 2  # header: CommitRequest (payload announced); reply: CommitResponse (parameters announced)
    PULL = 3  # header: PullRequest; reply: PullResponse (parameters announced unless unchanged)
    ATTACH = 4  # header: DataPlaneAttach, with one memfd (local connections only); reply: empty header
    ERROR = 0x7F  # header: DataPlaneError; sent for a refused request (the connection stays usable
    # unless the frame could not be read whole: then the server closes it after the error)


_OPS = frozenset(int(op) for op in Op)


class FrameError(ValueError):
    """Bytes that are not a data-plane frame of this version."""


@dataclass(frozen=True)
class Preamble:
    op: int  # an Op, or an Op | REPLY
    header_bytes: int
    payload_bytes: int
    flags: int = 0

    def pack(self) -> bytes:
        return PREAMBLE.pack(MAGIC, VERSION, self.op, self.flags, self.header_bytes, self.payload_bytes)

    @property
    def shared(self) -> bool:
        """The payload is in the attached shared memory."""
        return bool(self.flags & SHARED)


def frame_start(op: int, header: bytes, payload_bytes: int = 0, flags: int = 0) -> bytes:
    """A frame's preamble and header; its `payload_bytes` of payload follow (on the socket, or
    in shared memory when `flags` has SHARED)."""
    return Preamble(op, len(header), payload_bytes, flags).pack() + header


def read_preamble(data: bytes | bytearray | memoryview) -> Preamble:
    """The preamble at the start of `data` (at least PREAMBLE.size bytes); FrameError if it is not one."""
    magic, version, op, flags, header_bytes, payload_bytes = PREAMBLE.unpack_from(data)
    if magic != MAGIC:
        raise FrameError(f"not a gemps data-plane frame (magic {bytes(magic)!r})")
    if version != VERSION:
        raise FrameError(
            f"data-plane version {version}; this end speaks {VERSION} (client and server differ: upgrade the older)"
        )
    if flags & ~FLAGS:
        raise FrameError(f"unknown flags {flags:#x}")
    if op & ~REPLY not in _OPS:
        raise FrameError(f"unknown op {op:#x}")
    return Preamble(op, header_bytes, payload_bytes, flags)
