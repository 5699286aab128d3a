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

What needs the service (a ticket, θ's size, initialisation) or the kernel (descriptors, whether a
socket is local) stays with the caller, which refuses with `send(ErrorReply(...))`: the core
knows whether the frame was read whole, and so whether the connection stays usable.
"""

from __future__ import annotations

import enum
from typing import Final, TypeVar

from google.protobuf.message import DecodeError, Message

from gemps_proto.data_plane_events import (
    NEED_DATA,
    Attach,
    AttachRequested,
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
)
from gemps_proto.data_plane_frames import PREAMBLE, REPLY, SHARED, FrameError, Op, Preamble, frame_start, read_preamble
from gemps_proto.reasons import Reason
from gemps_proto.v1 import parameter_server_pb2 as pb

M = TypeVar("M", bound=Message)

# A HELLO is a worker id and a 32-byte ticket, an ATTACH a size: anything larger is not one.
MAX_HELLO_BYTES = 4096
# Bytes handed to one TLS write: an SSL socket has no sendmsg, and it encrypts (copies) anyway.
TLS_PIECE = 1 << 20
REQUESTS: Final = frozenset({Op.COMMIT, Op.PULL})


def advance(views: list[memoryview], count: int) -> None:
    """Drop `count` sent bytes from the front of `views` (after a partial send)."""
    while views and count >= len(views[0]):
        count -= len(views.pop(0))
    if views and count:
        views[0] = views[0][count:]


class State(enum.Enum):
    HELLO = "hello"  # server: nothing proven yet; client: nothing sent
    IDLE = "idle"  # between requests
    HEADER = "header"  # a frame's header is being read
    PAYLOAD = "payload"  # a payload is being read
    REPLY_DUE = "reply due"  # server: a request read whole; client: a request sent
    CLOSED = "closed"


def parsed(message_class: type[M], data: bytes | bytearray) -> M | None:
    try:
        return message_class.FromString(bytes(data))
    except DecodeError:
        return None


class _Reader:
    """What both roles share: a preamble, then a header, then a payload, read into the right buffer."""

    def __init__(self) -> None:
        self.state = State.HELLO
        self.frame: Preamble | None = None  # the frame being read or answered
        self.shared = False  # shared memory is attached
        self._preamble = bytearray(PREAMBLE.size)
        self._header = bytearray()
        self._view = memoryview(self._preamble)  # where the next bytes go
        self._filled = 0
        self._reading_preamble = True
        self._pending: list[ServerEvent | ClientEvent] = []
        self._extra = bytearray()  # receive_data's bytes past what the protocol asked for

    def read_view(self) -> memoryview:
        """Where the next bytes go: exactly as many as the protocol needs now (empty: none, until
        an event is handled)."""
        return self._view[self._filled :]

    def received(self, count: int) -> None:
        """`count` bytes were written at the start of `read_view()`."""
        self._filled += count
        if self._filled < len(self._view):
            return
        if self._reading_preamble:
            self._reading_preamble = False
            self._pending.extend(self._on_preamble())
        elif self.state is State.HEADER:
            header = bytes(self._header)
            self._header = bytearray()
            self._pending.extend(self._on_header(header))
        elif self.state is State.PAYLOAD:
            self.payload_landed()

    def next_event(self) -> ServerEvent | ClientEvent | NeedData:
        if not self._pending and self._extra and len(self.read_view()):
            self._feed(b"")
        if self._pending:
            return self._pending.pop(0)
        return NEED_DATA

    def receive_data(self, data: bytes | bytearray | memoryview) -> list[ServerEvent | ClientEvent]:
        """Feed bytes in hand; every event they complete (a payload needs `payload_into` first:
        the bytes after a CommitHeader or ReplyReceived wait for it)."""
        self._feed(data)
        events: list[ServerEvent | ClientEvent] = []
        while (event := self.next_event()) is not NEED_DATA:
            assert not isinstance(event, NeedData)
            events.append(event)
        return events

    def _feed(self, data: bytes | bytearray | memoryview) -> None:
        self._extra += data
        while self._extra and self.state is not State.CLOSED:
            view = self.read_view()
            if not len(view):
                return
            count = min(len(view), len(self._extra))
            view[:count] = self._extra[:count]
            del self._extra[:count]
            self.received(count)

    def payload_into(self, view: memoryview) -> None:
        """The payload announced goes into `view` (its exact size): read_view() is it from now."""
        frame = self.frame
        assert self.state is State.PAYLOAD and frame is not None, self.state
        if len(view) != frame.payload_bytes:
            raise ValueError(f"a view of {len(view)} bytes for a payload of {frame.payload_bytes}")
        self._expect(view.cast("B"))

    def payload_landed(self) -> None:
        """The payload announced is in the caller's memory (read by the caller itself)."""
        assert self.state is State.PAYLOAD, self.state
        self._payload_done()
        self._pending.append(PayloadComplete())

    def _expect(self, view: memoryview) -> None:
        self._view, self._filled = view, 0

    def _read_header(self, size: int) -> list[ServerEvent | ClientEvent]:
        """After the preamble: its header next (an empty one is complete at once)."""
        self.state = State.HEADER
        self._header = bytearray(size)
        self._expect(memoryview(self._header))
        return self._on_header(b"") if not size else []

    def _next_frame(self) -> None:
        self._reading_preamble = True
        self._expect(memoryview(self._preamble))

    def _nothing_to_read(self) -> None:
        self._expect(memoryview(b""))

    def _close(self, error: ProtocolError) -> list[ServerEvent | ClientEvent]:
        self.state = State.CLOSED
        self._nothing_to_read()
        return [error]

    def _on_preamble(self) -> list[ServerEvent | ClientEvent]:
        raise NotImplementedError

    def _on_header(self, header: bytes) -> list[ServerEvent | ClientEvent]:
        raise NotImplementedError

    def _payload_done(self) -> None:
        raise NotImplementedError


class ServerConnection(_Reader):
    """The server's end of one connection: a HELLO first, then requests, one at a time, each
    answered (`send(Reply(...))` or `send(ErrorReply(...))`) before the next is read."""

    def __init__(self, max_header_bytes: int) -> None:
        super().__init__()
        self.max_header_bytes = max_header_bytes  # --max-message-mb
        self.worker_id = ""  # the worker the accepted HELLO proved

    def next_event(self) -> ServerEvent | NeedData:
        event = super().next_event()
        assert not isinstance(event, ReplyReceived | Refused)
        return event

    def receive_data(self, data: bytes | bytearray | memoryview) -> list[ServerEvent]:  # type: ignore[override]
        return [event for event in super().receive_data(data) if not isinstance(event, ReplyReceived | Refused)]

    def _on_preamble(self) -> list[ServerEvent | ClientEvent]:
        hello = self.state is State.HELLO
        try:
            frame = read_preamble(self._preamble)
        except FrameError as error:
            return self._close(ProtocolError(str(error), refusal="bad_hello" if hello else "bad_frame"))
        self.frame = frame
        if hello:
            if frame.op != Op.HELLO or frame.payload_bytes or frame.header_bytes > MAX_HELLO_BYTES:
                return self._close(ProtocolError("the first frame must be a HELLO", refusal="bad_hello"))
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
        if frame.op == Op.HELLO:
            hello = parsed(pb.DataPlaneHello, header)
            if hello is None:
                return self._close(ProtocolError("header is not a valid gemps.v1.DataPlaneHello", refusal="bad_hello"))
            self.state = State.REPLY_DUE
            return [HelloReceived(hello.worker_id, hello.ticket)]
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

    def _payload_done(self) -> None:
        self.state = State.REPLY_DUE
        self._nothing_to_read()

    def send(self, message: Reply | ErrorReply, worker_id: str = "") -> bytes:
        """A reply's preamble and header (its payload follows, from the caller's memory, unless
        the request was SHARED: then it is in the shared memory). A Reply to a HELLO accepts
        `worker_id`'s ticket; a Reply to an ATTACH attaches the shared memory."""
        frame = self.frame
        if isinstance(message, ErrorReply):
            # Read whole: usable still. Otherwise (a refusal before, or mid-frame) it closes.
            usable = self.state is State.REPLY_DUE and frame is not None and frame.op in REQUESTS
            self._answered(State.IDLE if usable else State.CLOSED)
            return frame_start(Op.ERROR, message.header)
        if self.state is not State.REPLY_DUE or frame is None:
            raise RuntimeError(f"no request to answer ({self.state.value})")
        if frame.op == Op.HELLO:
            self.worker_id = worker_id
        elif frame.op == Op.ATTACH:
            self.shared = True
        flags = SHARED if frame.shared else 0
        self._answered(State.IDLE)
        return frame_start(frame.op | REPLY, message.header, message.payload_bytes, flags)

    def _answered(self, state: State) -> None:
        self.state = state
        self.frame = None
        if state is State.CLOSED:
            self._nothing_to_read()
        else:
            self._next_frame()


class ClientConnection(_Reader):
    """The client's end of one connection: a HELLO, an ATTACH if it wants shared memory, then one
    request at a time, its reply (and that reply's payload) read before the next is sent."""

    def __init__(self) -> None:
        super().__init__()
        self._sent: Op | None = None  # the request whose reply is awaited
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
        assert isinstance(event, ReplyReceived | Refused | PayloadComplete | ProtocolError | NeedData)
        return event

    def receive_data(self, data: bytes | bytearray | memoryview) -> list[ClientEvent]:  # type: ignore[override]
        return [
            e
            for e in super().receive_data(data)
            if isinstance(e, ReplyReceived | Refused | PayloadComplete | ProtocolError)
        ]

    def send(self, message: Hello | Attach | Request) -> bytes:
        """A request's preamble and header; a Request's payload follows from the caller's memory,
        or (shared memory attached) is written into it: the frame is flagged SHARED."""
        if self.state is State.CLOSED:
            raise RuntimeError("the connection is closed")
        if self._sent is not None:
            raise RuntimeError(f"the reply to op {int(self._sent):#x} is still awaited")
        if isinstance(message, Hello):
            if self.state is not State.HELLO:
                raise RuntimeError("one HELLO per connection")
            op, header, payload_bytes, flags = (
                Op.HELLO,
                pb.DataPlaneHello(worker_id=message.worker_id, ticket=message.ticket).SerializeToString(),
                0,
                0,
            )
        elif self.state is State.HELLO:
            raise RuntimeError("the HELLO goes first")
        elif isinstance(message, Attach):
            if self.shared:
                raise RuntimeError("shared memory is attached already")
            op, header, payload_bytes, flags = (
                Op.ATTACH,
                pb.DataPlaneAttach(bytes=message.size).SerializeToString(),
                0,
                0,
            )
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
            if sent in (Op.HELLO, Op.ATTACH) and frame.payload_bytes:
                article = "a" if sent == Op.HELLO else "an"
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

    def _payload_done(self) -> None:
        self.state = State.IDLE
        self._sent = None
        self.frame = None
        self._nothing_to_read()
