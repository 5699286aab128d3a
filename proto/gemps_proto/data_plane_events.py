"""The data plane's events and messages (DESIGN §3c): what one end hears from the other, and what it says.

The vocabulary of the protocol core (data_plane_protocol.py): a `ServerConnection` turns bytes
into the server's events (a CHALLENGE, a proven HELLO, a commit's header, a pull, an ATTACH, a
payload complete, a protocol error) and its replies into bytes; a `ClientConnection` the same the
other way round.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Final

from gemps_proto.data_plane_frames import Op
from gemps_proto.reasons import Reason
from gemps_proto.v1 import parameter_server_pb2 as pb

# -- events: what the peer said ------------------------------------------------------------------


class NeedData(enum.Enum):
    """`next_event` has nothing until more bytes come (into `read_view()`)."""

    NEED_DATA = enum.auto()


NEED_DATA: Final = NeedData.NEED_DATA


@dataclass(frozen=True)
class ProtocolError:
    """The peer broke the protocol. On the server it is answered (send an ErrorReply of it) and the
    connection closes, counted as `refusal`; `op` is the request's, when the frame was a commit or
    a pull (its per-method counters). On the client the connection is unusable."""

    message: str
    reason: Reason = Reason.MALFORMED
    refusal: str = "bad_frame"
    op: int = 0


@dataclass(frozen=True)
class ChallengeReceived:
    """A CHALLENGE: answer it with `Answer` and the worker's ticket (or refuse it)."""

    worker_id: str


@dataclass(frozen=True)
class HelloReceived:
    """A HELLO whose proof is the ticket's the answer was made with: the worker is proven."""

    worker_id: str


@dataclass(frozen=True)
class CommitHeader:
    """A commit's header; its payload of `payload_bytes` comes next (`payload_into` or
    `payload_landed`), or is in the shared memory already (`shared`: PayloadComplete follows)."""

    request: pb.CommitRequest
    payload_bytes: int
    shared: bool


@dataclass(frozen=True)
class PullRequested:
    request: pb.PullRequest
    shared: bool  # the reply's θ goes into the shared memory


@dataclass(frozen=True)
class AttachRequested:
    """An ATTACH: the memfd is the caller's (it came with the frame, if it did)."""

    size: int


@dataclass(frozen=True)
class ReplyReceived:
    """The reply to the request sent: its header (a message of the request's reply type) and the
    payload bytes that follow on the socket (`payload_into`), or in the shared memory (`shared`)."""

    header: bytes
    payload_bytes: int
    shared: bool


@dataclass(frozen=True)
class Refused:
    """An ERROR frame: what the server refused, as the gRPC path would have said it."""

    error: pb.DataPlaneError


@dataclass(frozen=True)
class PayloadComplete:
    pass


@dataclass(frozen=True)
class ServerProven:
    """The CHALLENGE's answer is the ticket's: send the `Hello` now."""


ServerEvent = (
    ChallengeReceived | HelloReceived | CommitHeader | PullRequested | AttachRequested | PayloadComplete | ProtocolError
)
ClientEvent = ServerProven | ReplyReceived | Refused | PayloadComplete | ProtocolError

# -- what an end says ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Challenge:
    """The client's first frame: the ticket and the address it dialed (proofs.address)
    stay in the core, which checks the server's answer with them; only the worker id and a fresh
    nonce go."""

    worker_id: str
    ticket: bytes
    address: str
    nonce: bytes | None = None  # None: drawn at random (a test may fix it)


@dataclass(frozen=True)
class Hello:
    """The client's proof, sent once the server's is checked (`ServerProven`)."""


@dataclass(frozen=True)
class Answer:
    """The server's answer to a CHALLENGE: its proof made with the worker's `ticket` and the
    `address` the connection came to (proofs.address)."""

    ticket: bytes
    address: str
    nonce: bytes | None = None  # None: drawn at random (a test may fix it)


@dataclass(frozen=True)
class Attach:
    size: int


@dataclass(frozen=True)
class Request:
    """A COMMIT or a PULL; its `payload_bytes` follow (on the socket, or in the shared memory)."""

    op: Op
    header: bytes
    payload_bytes: int = 0


@dataclass(frozen=True)
class Reply:
    """The answer to the request read (a proven HELLO, ATTACH, COMMIT or PULL): SHARED if it was."""

    header: bytes = b""
    payload_bytes: int = 0


@dataclass(frozen=True)
class ErrorReply:
    """An ERROR frame (a serialized DataPlaneError). The connection stays usable only if the
    request was read whole."""

    header: bytes
