"""The data-plane protocol without I/O (DESIGN §3c): bytes in, events out, for the server's end and the client's.

The way h11 and hyper-h2 write HTTP: a `ServerConnection` or a `ClientConnection` is told what
arrived and says what it means (`next_event`), and turns what its end says into bytes (`send`);
it owns no socket, no thread and no clock (deadlines and timeouts are the caller's). Frames,
preambles and the SHARED flag are defined once, in gemps_proto/data_plane_frames.py; this module holds
the order they come in and every refusal the protocol itself makes.

Reading never copies a payload: `read_view()` is where the next bytes go, exactly as many as the
protocol needs next (so a caller never reads past a frame, nor a descriptor passed with the next
one), and `received(count)` says they came. Preambles and headers land in the core's buffers; a
payload lands where the caller says (`payload_into`), or the caller reads it itself and says so
(`payload_landed`: the server's upload lanes move a slow payload between buffers mid-way).
`receive_data(bytes)` is the same machine fed from a byte string (tests, and any caller that has
bytes in hand). Sending returns a frame's preamble and header; the caller writes the payload after
it from its own memory (θ's, or the commit's array), or through the attached shared memory.

A connection starts with a handshake in which each end proves it holds the registration's ticket
(gemps_proto/proofs.py): the client's CHALLENGE, the server's answer (checked by the
client's core: `ServerProven`, or a ProtocolError and nothing more sent), the client's HELLO
(checked by the server's core: `HelloReceived`, or a ProtocolError), and its reply. The ticket is
the callers' (the server's service computes it, the client got it at Register); the core keeps
only what the proofs need, and the ticket never goes on the wire.

What needs the service (a ticket, θ's size, initialisation) or the kernel (descriptors, whether a
socket is local) stays with the caller, which refuses with `send(ErrorReply(...))`: the core
knows whether the frame was read whole, and so whether the connection stays usable.
"""

from __future__ import annotations

from typing import Final

from gemps_proto import proofs
from gemps_proto.data_plane_events import (
    Answer,
    Attach,
    AttachRequested,
    Challenge,
    ChallengeReceived,
    ClientEvent,
    CommitHeader,
    ErrorReply,
    Hello,
    HelloReceived,
    NeedData,
    PayloadComplete,
    ProtocolError,
    PullRequested,
    Refused,
    Reply,
    ReplyReceived,
    Request,
    ServerEvent,
    ServerProven,
)
from gemps_proto.data_plane_frames import REPLY, SHARED, FrameError, Op, frame_start, read_preamble
from gemps_proto.data_plane_reader import Reader, State, parsed
from gemps_proto.reasons import Reason
from gemps_proto.v1 import parameter_server_pb2 as pb

__all__ = ["MAX_HELLO_BYTES", "TLS_PIECE", "ClientConnection", "ServerConnection", "State", "advance"]

# A handshake's frame is a worker id and 32-byte nonces and proofs, an ATTACH a size: anything
# larger is not one.
MAX_HELLO_BYTES = 4096
HANDSHAKE: Final = frozenset({Op.CHALLENGE, Op.HELLO})
# Bytes handed to one TLS write: an SSL socket has no sendmsg, and it encrypts (copies) anyway.
TLS_PIECE = 1 << 20
REQUESTS: Final = frozenset({Op.COMMIT, Op.PULL})


def advance(views: list[memoryview], count: int) -> None:
    """Drop `count` sent bytes from the front of `views` (after a partial send)."""
    while views and count >= len(views[0]):
        count -= len(views.pop(0))
    if views and count:
        views[0] = views[0][count:]


class ServerConnection(Reader):
    """The server's end of one connection: the handshake (a CHALLENGE answered with `Answer`, then
    a HELLO whose proof the core checks), then requests, one at a time, each answered
    (`send(Reply(...))` or `send(ErrorReply(...))`) before the next is read."""

    def __init__(self, max_header_bytes: int) -> None:
        super().__init__()
        self.max_header_bytes = max_header_bytes  # --max-message-mb
        self.worker_id = ""  # the worker the accepted HELLO proved
        self._challenge = pb.DataPlaneChallenge()  # the CHALLENGE answered
        self._expected = b""  # the client's proof that would match the answer

    def next_event(self) -> ServerEvent | NeedData:
        event = super().next_event()
        assert not isinstance(event, ServerProven | ReplyReceived | Refused)
        return event

    def receive_data(self, data: bytes | bytearray | memoryview) -> list[ServerEvent]:  # type: ignore[override]
        return [e for e in super().receive_data(data) if not isinstance(e, ServerProven | ReplyReceived | Refused)]

    def _on_preamble(self) -> list[ServerEvent | ClientEvent]:
        handshake = self.state in (State.HELLO, State.PROVING)
        try:
            frame = read_preamble(self._preamble)
        except FrameError as error:
            return self._close(ProtocolError(str(error), refusal="bad_hello" if handshake else "bad_frame"))
        self.frame = frame
        if handshake:
            expected = Op.CHALLENGE if self.state is State.HELLO else Op.HELLO
            if frame.op != expected or frame.payload_bytes or frame.flags or frame.header_bytes > MAX_HELLO_BYTES:
                what = "the first frame must be a CHALLENGE" if expected == Op.CHALLENGE else "a HELLO must follow"
                return self._close(ProtocolError(what, refusal="bad_hello"))
        elif frame.op == Op.ATTACH:
            if frame.header_bytes > MAX_HELLO_BYTES or frame.payload_bytes or frame.shared:
                return self._close(
                    ProtocolError("an ATTACH is a small header and one descriptor", refusal="bad_attach")
                )
        elif frame.op not in REQUESTS:
            return self._close(ProtocolError(f"op {frame.op:#x} is not a request"))
        elif frame.header_bytes > self.max_header_bytes:
            return self._refuse_unread(
                f"header of {frame.header_bytes} bytes is past --max-message-mb", Reason.TOO_LARGE
            )
        elif frame.shared and not self.shared:
            return self._refuse_unread("a SHARED frame, and no shared memory attached")
        elif frame.op == Op.PULL and frame.payload_bytes:
            return self._refuse_unread("a pull carries no payload", Reason.BAD_PAYLOAD)
        return self._read_header(frame.header_bytes)

    def _refuse_unread(self, message: str, reason: Reason = Reason.MALFORMED) -> list[ServerEvent | ClientEvent]:
        """A request refused before its payload was read: the connection closes after the answer."""
        assert self.frame is not None
        return self._close(ProtocolError(message, reason, "refused_unread", self.frame.op))

    def _on_header(self, header: bytes) -> list[ServerEvent | ClientEvent]:
        frame = self.frame
        assert frame is not None
        self._nothing_to_read()
        if frame.op in HANDSHAKE:
            return self._on_handshake(frame.op, header)
        if frame.op == Op.ATTACH:
            attach = parsed(pb.DataPlaneAttach, header)
            if self.shared:
                return self._close(ProtocolError("shared memory is attached already", refusal="bad_attach"))
            if attach is None:
                return self._close(
                    ProtocolError("header is not a valid gemps.v1.DataPlaneAttach", refusal="bad_attach")
                )
            self.state = State.REPLY_DUE
            return [AttachRequested(attach.bytes)]
        message_class: type[pb.CommitRequest | pb.PullRequest] = (
            pb.CommitRequest if frame.op == Op.COMMIT else pb.PullRequest
        )
        request = parsed(message_class, header)
        if request is None:
            return self._refuse_unread(f"header is not a valid {message_class.DESCRIPTOR.full_name}")
        if request.worker_id != self.worker_id:
            return self._close(
                ProtocolError(
                    f"this connection serves worker {self.worker_id!r}, not {request.worker_id!r}",
                    Reason.UNAUTHENTICATED,
                    "refused_unread",
                    frame.op,
                )
            )
        if isinstance(request, pb.PullRequest):
            self.state = State.REPLY_DUE
            return [PullRequested(request, frame.shared)]
        if request.payload.data:
            return self._refuse_unread("payload data goes after the header, not in it", Reason.BAD_PAYLOAD)
        self.state = State.PAYLOAD
        event = CommitHeader(request, frame.payload_bytes, frame.shared)
        if frame.shared or not frame.payload_bytes:  # nothing on the socket
            self._payload_done()
            return [event, PayloadComplete()]
        return [event]

    def _on_handshake(self, op: int, header: bytes) -> list[ServerEvent | ClientEvent]:
        """A CHALLENGE (a worker id and the client's nonce), or the HELLO after its answer: proven
        when its proof is the one the answer's ticket makes (compared in constant time)."""
        if op == Op.CHALLENGE:
            challenge = parsed(pb.DataPlaneChallenge, header)
            if challenge is None or len(challenge.nonce) != proofs.NONCE_BYTES:
                what = f"header is not a valid gemps.v1.DataPlaneChallenge with a {proofs.NONCE_BYTES}-byte nonce"
                return self._close(ProtocolError(what, refusal="bad_hello"))
            self._challenge, self.state = challenge, State.REPLY_DUE
            return [ChallengeReceived(challenge.worker_id)]
        hello = parsed(pb.DataPlaneHello, header)
        if hello is None:
            return self._close(ProtocolError("header is not a valid gemps.v1.DataPlaneHello", refusal="bad_hello"))
        if hello.worker_id != self._challenge.worker_id or not proofs.matches(hello.proof, self._expected):
            message = "the HELLO's proof is not made with this worker's data-plane ticket: register again"
            return self._close(ProtocolError(message, Reason.UNAUTHENTICATED, "unauthenticated"))
        self.state = State.REPLY_DUE
        return [HelloReceived(hello.worker_id)]

    def _payload_done(self) -> None:
        self.state = State.REPLY_DUE
        self._nothing_to_read()

    def send(self, message: Answer | Reply | ErrorReply, worker_id: str = "") -> bytes:
        """A reply's preamble and header (its payload follows, from the caller's memory, unless
        the request was SHARED: then it is in the shared memory). An Answer answers a CHALLENGE
        with the worker's ticket; a Reply to a proven HELLO binds the connection to `worker_id`
        (the worker proven); a Reply to an ATTACH attaches the shared memory."""
        frame = self.frame
        if isinstance(message, ErrorReply):
            # Read whole: usable still. Otherwise (a refusal before, or mid-frame) it closes.
            usable = self.state is State.REPLY_DUE and frame is not None and frame.op in REQUESTS
            self._answered(State.IDLE if usable else State.CLOSED)
            return frame_start(Op.ERROR, message.header)
        if self.state is not State.REPLY_DUE or frame is None:
            raise RuntimeError(f"no request to answer ({self.state.value})")
        if (frame.op == Op.CHALLENGE) != isinstance(message, Answer):
            raise RuntimeError("a CHALLENGE, and only a CHALLENGE, is answered with an Answer")
        if isinstance(message, Answer):
            return self._answer(message)
        if frame.op == Op.HELLO:
            if worker_id != self._challenge.worker_id:
                raise ValueError(f"worker {self._challenge.worker_id!r} was proven, not {worker_id!r}")
            self.worker_id = worker_id
        elif frame.op == Op.ATTACH:
            self.shared = True
        flags = SHARED if frame.shared else 0
        self._answered(State.IDLE)
        return frame_start(frame.op | REPLY, message.header, message.payload_bytes, flags)

    def _answer(self, answer: Answer) -> bytes:
        """The server's proof, with a nonce of its own; the client's proof that answers it is kept."""
        client_nonce, server_nonce = self._challenge.nonce, answer.nonce or proofs.nonce()
        proof = proofs.server_proof(answer.ticket, client_nonce, server_nonce, answer.address)
        self._expected = proofs.client_proof(answer.ticket, client_nonce, server_nonce)
        self._answered(State.PROVING)
        return frame_start(
            Op.CHALLENGE | REPLY, pb.DataPlaneAnswer(nonce=server_nonce, proof=proof).SerializeToString()
        )

    def _answered(self, state: State) -> None:
        self.state = state
        self.frame = None
        if state is State.CLOSED:
            self._nothing_to_read()
        else:
            self._next_frame()


class ClientConnection(Reader):
    """The client's end of one connection: the handshake (a CHALLENGE, its answer checked by the
    core, a HELLO), an ATTACH if it wants shared memory, then one request at a time, its reply (and
    that reply's payload) read before the next is sent."""

    def __init__(self) -> None:
        super().__init__()
        self._sent: Op | None = None  # the request whose reply is awaited
        self._challenge = Challenge("", b"", "")  # what the handshake proves with
        self._proof = b""  # the HELLO's proof, once the server proved itself
        self._nothing_to_read()

    @property
    def awaited(self) -> Op | None:
        """The request whose reply (or that reply's payload) is to be read next."""
        return self._sent

    @property
    def awaiting(self) -> bool:
        """A request was sent and its reply (or that reply's payload) not read yet."""
        return self._sent is not None

    def next_event(self) -> ClientEvent | NeedData:
        event = super().next_event()
        assert isinstance(event, ServerProven | ReplyReceived | Refused | PayloadComplete | ProtocolError | NeedData)
        return event

    def receive_data(self, data: bytes | bytearray | memoryview) -> list[ClientEvent]:  # type: ignore[override]
        return [
            e
            for e in super().receive_data(data)
            if isinstance(e, ServerProven | ReplyReceived | Refused | PayloadComplete | ProtocolError)
        ]

    def send(self, message: Challenge | Hello | Attach | Request) -> bytes:
        """A request's preamble and header; a Request's payload follows from the caller's memory,
        or (shared memory attached) is written into it: the frame is flagged SHARED."""
        if self.state is State.CLOSED:
            raise RuntimeError("the connection is closed")
        if self._sent is not None:
            raise RuntimeError(f"the reply to op {int(self._sent):#x} is still awaited")
        op, payload_bytes, flags = Op.CHALLENGE, 0, 0
        if isinstance(message, Challenge):
            if self.state is not State.HELLO:
                raise RuntimeError("one CHALLENGE per connection")
            self._challenge = Challenge(
                message.worker_id, message.ticket, message.address, message.nonce or proofs.nonce()
            )
            header = pb.DataPlaneChallenge(worker_id=message.worker_id, nonce=self._challenge.nonce).SerializeToString()
        elif isinstance(message, Hello):
            if self.state is not State.PROVING:
                raise RuntimeError("the HELLO goes once the server proved itself")
            op, header = (
                Op.HELLO,
                pb.DataPlaneHello(worker_id=self._challenge.worker_id, proof=self._proof).SerializeToString(),
            )
        elif self.state in (State.HELLO, State.PROVING):
            raise RuntimeError("the handshake goes first")
        elif isinstance(message, Attach):
            if self.shared:
                raise RuntimeError("shared memory is attached already")
            op, header = Op.ATTACH, pb.DataPlaneAttach(bytes=message.size).SerializeToString()
        else:
            if message.op not in REQUESTS:
                raise ValueError(f"op {int(message.op):#x} is not a request")
            op, header, payload_bytes = message.op, message.header, message.payload_bytes
            flags = SHARED if self.shared else 0
        self._sent = op
        self.state = State.REPLY_DUE
        self._next_frame()
        return frame_start(op, header, payload_bytes, flags)

    def _on_preamble(self) -> list[ServerEvent | ClientEvent]:
        try:
            frame = read_preamble(self._preamble)
        except FrameError as error:
            return self._close(ProtocolError(str(error)))
        self.frame = frame
        sent = self._sent
        assert sent is not None
        if frame.op != Op.ERROR:
            if frame.op != sent | REPLY:
                return self._close(ProtocolError(f"op {frame.op:#x} in reply to {int(sent):#x}"))
            if frame.shared != self.shared:
                return self._close(
                    ProtocolError("a reply through shared memory on a connection without, or not through it with")
                )
            if sent not in REQUESTS and frame.payload_bytes:
                article = "an" if sent == Op.ATTACH else "a"
                return self._close(
                    ProtocolError(f"{article} {sent.name} reply with {frame.payload_bytes} bytes of payload")
                )
        return self._read_header(frame.header_bytes)

    def _on_header(self, header: bytes) -> list[ServerEvent | ClientEvent]:
        frame, sent = self.frame, self._sent
        assert frame is not None and sent is not None
        self._nothing_to_read()
        if frame.op == Op.ERROR:
            error = parsed(pb.DataPlaneError, header)
            if error is None:
                return self._close(ProtocolError("a reply header that is not a gemps.v1.DataPlaneError"))
            # Closed: after a refusal the server may close it (a request refused unread).
            self.state = State.CLOSED
            self._sent = None
            return [Refused(error)]
        if sent == Op.CHALLENGE:
            return self._check_answer(header)
        if sent == Op.HELLO:
            self.state = State.IDLE
        elif sent == Op.ATTACH:
            self.shared = True
        event = ReplyReceived(header, frame.payload_bytes, frame.shared)
        if frame.shared or not frame.payload_bytes:
            self._payload_done()
        else:
            self.state = State.PAYLOAD
        return [event]

    def _check_answer(self, header: bytes) -> list[ServerEvent | ClientEvent]:
        """The server's answer: proven if its proof is the ticket's (compared in constant time).
        Otherwise the connection closes: whoever answered gets no proof, memory or request."""
        answer, challenge = parsed(pb.DataPlaneAnswer, header), self._challenge
        assert challenge.nonce is not None
        if answer is None or len(answer.nonce) != proofs.NONCE_BYTES:
            return self._close(ProtocolError("a CHALLENGE's answer that is not a gemps.v1.DataPlaneAnswer"))
        expected = proofs.server_proof(challenge.ticket, challenge.nonce, answer.nonce, challenge.address)
        if not proofs.matches(answer.proof, expected):
            message = (
                f"the peer did not prove it holds this registration's ticket as the server at {challenge.address}"
                " (an impostor on a dead server's address?)"
            )
            return self._close(ProtocolError(message, Reason.UNAUTHENTICATED, "server_not_proven"))
        self._proof = proofs.client_proof(challenge.ticket, challenge.nonce, answer.nonce)
        self.state, self._sent, self.frame = State.PROVING, None, None
        return [ServerProven()]

    def _payload_done(self) -> None:
        self.state = State.IDLE
        self._sent = None
        self.frame = None
        self._nothing_to_read()
