"""The data-plane protocol core driven with byte strings, both roles, no socket (DESIGN §3c).

Every frame type, every refusal the core makes, lying and truncated lengths, bad preambles,
pipelined requests and a small frame split at every byte boundary. The socket suites
(tests/integration/test_data_plane*.py) keep testing the loop and the kernel around it.
"""

from __future__ import annotations

import struct

import numpy as np
import pytest

from gemps_proto.data_plane_events import (
    NEED_DATA,
    Attach,
    AttachRequested,
    CommitHeader,
    ErrorReply,
    Hello,
    HelloReceived,
    PayloadComplete,
    ProtocolError,
    PullRequested,
    Refused,
    Reply,
    ReplyReceived,
    Request,
    ServerEvent,
)
from gemps_proto.data_plane_frames import MAGIC, PREAMBLE, REPLY, SHARED, VERSION, Op, frame_start, read_preamble
from gemps_proto.data_plane_protocol import (
    MAX_HELLO_BYTES,
    ClientConnection,
    ServerConnection,
    State,
    advance,
)
from gemps_proto.reasons import Reason
from gemps_proto.v1 import parameter_server_pb2 as pb

WORKER = "w1"
TICKET = b"t" * 32
PAYLOAD = np.arange(4, dtype=np.float32).tobytes()
MAX_HEADER = 1 << 16


def hello_frame(worker_id: str = WORKER) -> bytes:
    return frame_start(Op.HELLO, pb.DataPlaneHello(worker_id=worker_id, ticket=TICKET).SerializeToString())


def commit_header(worker_id: str = WORKER, data: bytes = b"") -> bytes:
    request = pb.CommitRequest(worker_id=worker_id, base_version=1, request_id="r1")
    request.payload.CopyFrom(pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[4], data=data))
    return request.SerializeToString()


def commit_frame(flags: int = 0) -> bytes:
    return frame_start(Op.COMMIT, commit_header(), len(PAYLOAD), flags) + (b"" if flags & SHARED else PAYLOAD)


def pull_frame(flags: int = 0) -> bytes:
    return frame_start(Op.PULL, pb.PullRequest(worker_id=WORKER, known_version=-1).SerializeToString(), 0, flags)


def raw(op: int, header: bytes = b"", payload_bytes: int = 0, flags: int = 0, version: int = VERSION) -> bytes:
    return PREAMBLE.pack(MAGIC, version, op, flags, len(header), payload_bytes) + header


def proven() -> ServerConnection:
    """A server connection past an accepted HELLO."""
    server = ServerConnection(MAX_HEADER)
    assert server.receive_data(hello_frame()) == [HelloReceived(WORKER, TICKET)]
    server.send(Reply(), WORKER)
    return server


def attached() -> ServerConnection:
    server = proven()
    assert server.receive_data(frame_start(Op.ATTACH, pb.DataPlaneAttach(bytes=16).SerializeToString())) == [
        AttachRequested(16)
    ]
    server.send(Reply())
    return server


def received_commit(server: ServerConnection, data: bytes) -> list[ServerEvent]:
    """Feed `data`; after a CommitHeader, give a buffer for the payload and feed on."""
    events = server.receive_data(data)
    if events and isinstance(events[-1], CommitHeader):
        payload = bytearray(events[-1].payload_bytes)
        server.payload_into(memoryview(payload))
        events += server.receive_data(b"")
        assert bytes(payload) == PAYLOAD
    return events


# -- the server's role ---------------------------------------------------------------------------


def test_a_hello_then_a_commit_its_payload_read_into_the_callers_buffer() -> None:
    server = proven()
    events = server.receive_data(commit_frame())
    assert len(events) == 1 and isinstance(events[0], CommitHeader)
    assert (events[0].request.worker_id, events[0].payload_bytes, events[0].shared) == (WORKER, 16, False)
    assert server.next_event() is NEED_DATA and server.state is State.PAYLOAD
    payload = np.zeros(4, np.float32)
    server.payload_into(payload.data.cast("B"))
    assert server.receive_data(b"") == [PayloadComplete()]
    np.testing.assert_array_equal(payload, np.arange(4, dtype=np.float32))
    reply = server.send(Reply(b"head", 16))
    assert reply == frame_start(Op.COMMIT | REPLY, b"head", 16)
    assert server.state is State.IDLE  # type: ignore[comparison-overlap]  # send() moved it


def test_the_caller_may_read_the_payload_itself() -> None:
    server = proven()
    events = server.receive_data(commit_frame()[: -len(PAYLOAD)])
    assert isinstance(events[0], CommitHeader) and not len(server.read_view())  # nothing read past the header
    server.payload_landed()  # the server's upload lanes read it, into buffers of their own
    assert server.next_event() == PayloadComplete() and server.state is State.REPLY_DUE


def test_read_view_asks_for_exactly_the_next_part() -> None:
    server = ServerConnection(MAX_HEADER)
    assert len(server.read_view()) == PREAMBLE.size
    frame = hello_frame()
    server.read_view()[:] = frame[: PREAMBLE.size]
    server.received(PREAMBLE.size)
    assert server.next_event() is NEED_DATA and len(server.read_view()) == len(frame) - PREAMBLE.size
    view = server.read_view()
    view[:3] = frame[PREAMBLE.size : PREAMBLE.size + 3]
    server.received(3)
    assert len(server.read_view()) == len(frame) - PREAMBLE.size - 3  # the rest of the header only
    rest = frame[PREAMBLE.size + 3 :]
    server.read_view()[:] = rest
    server.received(len(rest))
    assert server.next_event() == HelloReceived(WORKER, TICKET)
    assert not len(server.read_view())  # until the HELLO is answered


def test_a_pull_and_its_reply() -> None:
    server = proven()
    events = server.receive_data(pull_frame())
    assert len(events) == 1 and isinstance(events[0], PullRequested) and not events[0].shared
    assert server.send(Reply(b"h", 8)) == frame_start(Op.PULL | REPLY, b"h", 8)


def test_shared_memory_attached_then_frames_flagged_shared_carry_no_payload_bytes() -> None:
    server = attached()
    assert server.shared
    events = server.receive_data(commit_frame(SHARED))
    assert isinstance(events[0], CommitHeader) and events[0].shared and events[1:] == [PayloadComplete()]
    assert server.send(Reply(b"h", 16)) == frame_start(Op.COMMIT | REPLY, b"h", 16, SHARED)
    events = server.receive_data(pull_frame(SHARED))
    assert isinstance(events[0], PullRequested) and events[0].shared
    assert read_preamble(server.send(Reply(b"h", 16))).shared


def test_requests_sent_ahead_are_read_one_at_a_time() -> None:
    """Pipelined bytes wait until the request before them is answered."""
    server = proven()
    events = received_commit(server, commit_frame() + pull_frame() + commit_frame())
    assert [type(e) for e in events] == [CommitHeader, PayloadComplete]
    assert server.next_event() is NEED_DATA
    server.send(Reply())
    assert isinstance(server.next_event(), PullRequested) and server.next_event() is NEED_DATA
    server.send(Reply())
    assert isinstance(server.next_event(), CommitHeader)


@pytest.mark.parametrize("chunk", [1, 2, 3, 7, 20, 21])
def test_a_stream_fed_in_pieces_gives_the_same_events(chunk: int) -> None:
    server = proven()
    data = commit_frame()
    payload = bytearray(len(PAYLOAD))
    events: list[ServerEvent] = []
    for start in range(0, len(data), chunk):
        events += server.receive_data(data[start : start + chunk])
        if server.state is State.PAYLOAD and not len(server.read_view()):
            server.payload_into(memoryview(payload))
            events += server.receive_data(b"")
    assert [type(e) for e in events] == [CommitHeader, PayloadComplete] and bytes(payload) == PAYLOAD


def test_a_small_frame_split_at_every_byte_boundary() -> None:
    whole = hello_frame() + pull_frame()
    for cut in range(len(whole) + 1):
        server = ServerConnection(MAX_HEADER)
        events = server.receive_data(whole[:cut]) + server.receive_data(whole[cut:])
        assert events == [HelloReceived(WORKER, TICKET)], cut
        server.send(Reply(), WORKER)
        pulled = server.receive_data(b"")
        assert len(pulled) == 1 and isinstance(pulled[0], PullRequested), cut


def test_an_error_after_a_request_read_whole_leaves_the_connection_usable() -> None:
    server = proven()
    received_commit(server, commit_frame())
    assert server.send(ErrorReply(b"e")) == frame_start(Op.ERROR, b"e") and server.state is State.IDLE
    assert isinstance(server.receive_data(pull_frame())[0], PullRequested)


@pytest.mark.parametrize("when", ["hello", "commit header", "attach"])
def test_an_error_before_a_frame_was_read_whole_closes(when: str) -> None:
    server = ServerConnection(MAX_HEADER) if when == "hello" else proven()
    frame = {
        "hello": hello_frame(),
        "commit header": commit_frame(),
        "attach": frame_start(Op.ATTACH, pb.DataPlaneAttach(bytes=16).SerializeToString()),
    }[when]
    assert server.receive_data(frame)
    server.send(ErrorReply(b"refused"))  # a bad ticket, a payload of the wrong size, no descriptor
    assert server.state is State.CLOSED and server.receive_data(pull_frame()) == []


def refusal(server: ServerConnection, data: bytes) -> ProtocolError:
    events = server.receive_data(data)
    assert len(events) == 1 and isinstance(events[0], ProtocolError), events
    assert server.state is State.CLOSED and not len(server.read_view())  # nothing more is read
    return events[0]


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"XXXX" + hello_frame()[4:], "not a gemps data-plane frame"),
        (raw(Op.HELLO, version=2), "data-plane version 2; this end speaks 1"),
        (raw(Op.HELLO, flags=0x4), "unknown flags 0x4"),
        (raw(0x33), "unknown op 0x33"),
        (commit_frame(), "the first frame must be a HELLO"),
        (raw(Op.HELLO, b"x", payload_bytes=1), "the first frame must be a HELLO"),
        (PREAMBLE.pack(MAGIC, VERSION, Op.HELLO, 0, MAX_HELLO_BYTES + 1, 0), "the first frame must be a HELLO"),
        (raw(Op.HELLO, b"\xff\xff"), "not a valid gemps.v1.DataPlaneHello"),
    ],
)
def test_a_bad_first_frame_is_refused_as_a_bad_hello(data: bytes, message: str) -> None:
    error = refusal(ServerConnection(MAX_HEADER), data)
    assert message in error.message and (error.reason, error.refusal, error.op) == (Reason.MALFORMED, "bad_hello", 0)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (raw(Op.HELLO, b""), "op 0x1 is not a request"),
        (raw(Op.COMMIT | REPLY), "op 0x82 is not a request"),
        (raw(Op.ERROR), "op 0x7f is not a request"),
        (raw(Op.PULL, version=0), "data-plane version 0"),
    ],
)
def test_a_frame_that_is_not_a_request_is_a_bad_frame(data: bytes, message: str) -> None:
    error = refusal(proven(), data)
    assert message in error.message and (error.refusal, error.op) == ("bad_frame", 0)


@pytest.mark.parametrize(
    ("data", "message", "reason"),
    [
        (PREAMBLE.pack(MAGIC, VERSION, Op.COMMIT, 0, MAX_HEADER + 1, 16), "past --max-message-mb", Reason.TOO_LARGE),
        (commit_frame(SHARED), "no shared memory attached", Reason.MALFORMED),
        (raw(Op.PULL, b"", payload_bytes=8), "a pull carries no payload", Reason.BAD_PAYLOAD),
        (raw(Op.COMMIT, b"\xff\xff", 16), "not a valid gemps.v1.CommitRequest", Reason.MALFORMED),
        (raw(Op.PULL, b"\xff\xff"), "not a valid gemps.v1.PullRequest", Reason.MALFORMED),
        (raw(Op.COMMIT, commit_header("w2"), 16), "serves worker 'w1', not 'w2'", Reason.UNAUTHENTICATED),
        (raw(Op.COMMIT, commit_header(data=PAYLOAD), 16), "payload data goes after the header", Reason.BAD_PAYLOAD),
    ],
)
def test_a_request_refused_unread(data: bytes, message: str, reason: Reason) -> None:
    error = refusal(proven(), data)
    assert message in error.message and (error.reason, error.refusal) == (reason, "refused_unread")
    assert error.op == read_preamble(data).op  # counted for its method


@pytest.mark.parametrize(
    "data",
    [
        raw(Op.ATTACH, b"x", payload_bytes=1),
        raw(Op.ATTACH, b"x", flags=SHARED),
        PREAMBLE.pack(MAGIC, VERSION, Op.ATTACH, 0, MAX_HELLO_BYTES + 1, 0),
        raw(Op.ATTACH, b"\xff\xff"),
    ],
)
def test_a_bad_attach_is_refused(data: bytes) -> None:
    assert refusal(proven(), data).refusal == "bad_attach"


def test_a_second_attach_is_refused() -> None:
    error = refusal(attached(), frame_start(Op.ATTACH, pb.DataPlaneAttach(bytes=16).SerializeToString()))
    assert (error.message, error.refusal) == ("shared memory is attached already", "bad_attach")


def test_lying_lengths_wait_for_bytes_that_never_come_or_misread_what_follows() -> None:
    """A header or payload length past what is sent: no event, the caller's stall timeout ends
    it. A header length short of the header: the rest is read as the next preamble."""
    server = proven()
    header = pb.PullRequest(worker_id=WORKER).SerializeToString()
    assert server.receive_data(raw(Op.PULL, header)[:-1]) == [] and server.state is State.HEADER
    server = proven()
    events = server.receive_data(frame_start(Op.COMMIT, commit_header(), 1 << 20) + PAYLOAD)
    payload = bytearray(1 << 20)
    server.payload_into(memoryview(payload))
    assert isinstance(events[0], CommitHeader) and server.receive_data(b"") == [] and server.state is State.PAYLOAD
    server = proven()
    short = PREAMBLE.pack(MAGIC, VERSION, Op.PULL, 0, 2, 0) + header
    events = server.receive_data(short)
    assert isinstance(events[-1], ProtocolError) and server.state is State.CLOSED


def test_answers_only_what_was_asked() -> None:
    with pytest.raises(RuntimeError, match="no request to answer"):
        ServerConnection(MAX_HEADER).send(Reply())
    server = proven()
    server.receive_data(commit_frame()[: -len(PAYLOAD)])
    with pytest.raises(ValueError, match="a view of 3 bytes for a payload of 16"):
        server.payload_into(memoryview(bytearray(3)))


def test_a_stall_mid_frame_is_answered_and_closes() -> None:
    server = proven()
    server.receive_data(commit_frame()[:25])
    assert read_preamble(server.send(ErrorReply(b"stalled"))).op == Op.ERROR and server.state is State.CLOSED


# -- the client's role ---------------------------------------------------------------------------


def greeted() -> ClientConnection:
    client = ClientConnection()
    assert client.send(Hello(WORKER, TICKET)) == hello_frame()
    assert client.receive_data(frame_start(Op.HELLO | REPLY, b"")) == [ReplyReceived(b"", 0, False)]
    assert not client.awaiting and client.state is State.IDLE
    return client


def test_a_commit_and_its_reply_theta_read_into_the_callers_array() -> None:
    client = greeted()
    start = client.send(Request(Op.COMMIT, b"head", 16))
    assert start == frame_start(Op.COMMIT, b"head", 16) and client.awaited == Op.COMMIT
    theta = np.zeros(4, np.float32)
    events = client.receive_data(frame_start(Op.COMMIT | REPLY, b"reply", 16) + PAYLOAD[:5])
    assert events == [ReplyReceived(b"reply", 16, False)] and client.awaiting
    client.payload_into(theta.data.cast("B"))
    assert client.receive_data(PAYLOAD[5:]) == [PayloadComplete()] and not client.awaiting
    np.testing.assert_array_equal(theta, np.arange(4, dtype=np.float32))


def test_a_refusal_is_an_event_and_the_connection_is_done() -> None:
    client = greeted()
    client.send(Request(Op.PULL, b""))
    error = pb.DataPlaneError(code=5, message="unknown worker", reason="unknown_worker")
    assert client.receive_data(frame_start(Op.ERROR, error.SerializeToString())) == [Refused(error)]
    assert client.state is State.CLOSED
    with pytest.raises(RuntimeError, match="closed"):
        client.send(Request(Op.PULL, b""))


@pytest.mark.parametrize(
    ("reply", "message"),
    [
        (frame_start(Op.PULL | REPLY, b""), "op 0x83 in reply to 0x2"),
        (frame_start(Op.COMMIT, b""), "op 0x2 in reply to 0x2"),
        (frame_start(Op.COMMIT | REPLY, b"", 16, SHARED), "a reply through shared memory on a connection without"),
        (b"HTTP/1.1 400 Bad Request\r\n\r\n", "not a gemps data-plane frame"),
        (frame_start(Op.ERROR, b"\xff\xff"), "not a gemps.v1.DataPlaneError"),
    ],
)
def test_a_reply_that_breaks_the_protocol(reply: bytes, message: str) -> None:
    client = greeted()
    client.send(Request(Op.COMMIT, b"", 16))
    events = client.receive_data(reply)
    assert len(events) == 1 and isinstance(events[0], ProtocolError) and message in events[0].message
    assert client.state is State.CLOSED


def test_a_hello_or_attach_reply_carries_no_payload() -> None:
    client = ClientConnection()
    client.send(Hello(WORKER, TICKET))
    events = client.receive_data(frame_start(Op.HELLO | REPLY, b"", 3))
    assert isinstance(events[0], ProtocolError) and events[0].message == "a HELLO reply with 3 bytes of payload"
    client = greeted()
    client.send(Attach(16))
    events = client.receive_data(frame_start(Op.ATTACH | REPLY, b"", 3))
    assert isinstance(events[0], ProtocolError) and events[0].message == "an ATTACH reply with 3 bytes of payload"


def test_once_attached_requests_and_replies_go_through_shared_memory() -> None:
    client = greeted()
    assert read_preamble(client.send(Attach(16))).op == Op.ATTACH
    client.receive_data(frame_start(Op.ATTACH | REPLY, b""))
    assert client.shared
    assert client.send(Request(Op.COMMIT, b"h", 16)) == frame_start(Op.COMMIT, b"h", 16, SHARED)
    assert client.receive_data(frame_start(Op.COMMIT | REPLY, b"r", 16, SHARED)) == [ReplyReceived(b"r", 16, True)]
    assert not client.awaiting  # θ is in the shared memory: nothing more on the socket


def test_the_client_says_things_in_order() -> None:
    client = ClientConnection()
    with pytest.raises(RuntimeError, match="the HELLO goes first"):
        client.send(Request(Op.PULL, b""))
    client = greeted()
    client.send(Request(Op.PULL, b""))
    with pytest.raises(RuntimeError, match="still awaited"):
        client.send(Request(Op.PULL, b""))
    with pytest.raises(ValueError, match="not a request"):
        greeted().send(Request(Op.ERROR, b""))


# -- both ends together ------------------------------------------------------------------------


def test_both_roles_talk_to_each_other() -> None:
    client, server = ClientConnection(), ServerConnection(MAX_HEADER)
    (hello,) = server.receive_data(client.send(Hello(WORKER, TICKET)))
    assert hello == HelloReceived(WORKER, TICKET)
    assert client.receive_data(server.send(Reply(), WORKER)) == [ReplyReceived(b"", 0, False)]
    events = received_commit(server, client.send(Request(Op.COMMIT, commit_header(), 16)) + PAYLOAD)
    assert [type(e) for e in events] == [CommitHeader, PayloadComplete]
    reply = client.receive_data(server.send(Reply(b"r", 16)) + PAYLOAD)
    assert reply == [ReplyReceived(b"r", 16, False)]
    theta = bytearray(16)
    client.payload_into(memoryview(theta))
    assert client.receive_data(b"") == [PayloadComplete()] and bytes(theta) == PAYLOAD


def test_advance_drops_sent_bytes_across_pieces() -> None:
    views = [memoryview(b"abc"), memoryview(b"defg")]
    advance(views, 4)
    assert [bytes(v) for v in views] == [b"efg"]
    advance(views, 3)
    assert views == []


def test_the_preamble_is_twenty_little_endian_bytes() -> None:
    assert PREAMBLE.size == 20 and struct.calcsize("<4sBBHIQ") == 20
    assert (
        frame_start(Op.PULL, b"hh", 7, SHARED)
        == b"GMDP\x01\x03\x01\x00\x02\x00\x00\x00" + (7).to_bytes(8, "little") + b"hh"
    )
