"""The data-plane protocol core driven with byte strings, both roles, no socket (DESIGN §3c).

Every frame type, every refusal the core makes, lying and truncated lengths, bad preambles,
pipelined requests and a small frame split at every byte boundary; the handshake in which each end
proves it holds the ticket without sending it, and every way a proof can be wrong. The socket suites
(tests/integration/test_data_plane*.py) keep testing the loop and the kernel around it.
"""

from __future__ import annotations

import struct

import numpy as np
import pytest

from gemps_proto import proofs
from gemps_proto.data_plane_events import (
    NEED_DATA,
    Answer,
    Attach,
    AttachRequested,
    Challenge,
    ChallengeReceived,
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
    ServerProven,
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
ADDRESS = proofs.address(7000)
CLIENT_NONCE, SERVER_NONCE = b"c" * 32, b"s" * 32
PAYLOAD = np.arange(4, dtype=np.float32).tobytes()
MAX_HEADER = 1 << 16


def challenge_frame(worker_id: str = WORKER, nonce: bytes = CLIENT_NONCE) -> bytes:
    return frame_start(Op.CHALLENGE, pb.DataPlaneChallenge(worker_id=worker_id, nonce=nonce).SerializeToString())


def hello_frame(worker_id: str = WORKER, ticket: bytes = TICKET) -> bytes:
    """The HELLO that answers the server's answer of `answered()` (made with `ticket`)."""
    proof = proofs.client_proof(ticket, CLIENT_NONCE, SERVER_NONCE)
    return frame_start(Op.HELLO, pb.DataPlaneHello(worker_id=worker_id, proof=proof).SerializeToString())


def answer_frame(ticket: bytes = TICKET, address: str = ADDRESS, nonce: bytes = SERVER_NONCE) -> bytes:
    """The server's answer to the client's CHALLENGE of CLIENT_NONCE."""
    proof = proofs.server_proof(ticket, CLIENT_NONCE, nonce, address)
    return frame_start(Op.CHALLENGE | REPLY, pb.DataPlaneAnswer(nonce=nonce, proof=proof).SerializeToString())


def answered() -> ServerConnection:
    """A server connection that answered a CHALLENGE (with TICKET): a HELLO next."""
    server = ServerConnection(MAX_HEADER)
    assert server.receive_data(challenge_frame()) == [ChallengeReceived(WORKER)]
    assert server.send(Answer(TICKET, ADDRESS, SERVER_NONCE)) == answer_frame()
    assert server.state is State.PROVING
    return server


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
    server = answered()
    assert server.receive_data(hello_frame()) == [HelloReceived(WORKER)]
    assert server.send(Reply(), WORKER) == frame_start(Op.HELLO | REPLY, b"")
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
    frame = challenge_frame()
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
    assert server.next_event() == ChallengeReceived(WORKER)
    assert not len(server.read_view())  # until the CHALLENGE is answered


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
    whole = challenge_frame() + hello_frame() + pull_frame()
    for cut in range(len(whole) + 1):
        server = ServerConnection(MAX_HEADER)
        events = server.receive_data(whole[:cut]) + server.receive_data(whole[cut:])
        assert events == [ChallengeReceived(WORKER)], cut  # the rest waits for the answer
        server.send(Answer(TICKET, ADDRESS, SERVER_NONCE))
        assert server.receive_data(b"") == [HelloReceived(WORKER)], cut
        server.send(Reply(), WORKER)
        pulled = server.receive_data(b"")
        assert len(pulled) == 1 and isinstance(pulled[0], PullRequested), cut


def test_an_error_after_a_request_read_whole_leaves_the_connection_usable() -> None:
    server = proven()
    received_commit(server, commit_frame())
    assert server.send(ErrorReply(b"e")) == frame_start(Op.ERROR, b"e") and server.state is State.IDLE
    assert isinstance(server.receive_data(pull_frame())[0], PullRequested)


@pytest.mark.parametrize("when", ["challenge", "commit header", "attach"])
def test_an_error_before_a_frame_was_read_whole_closes(when: str) -> None:
    server = ServerConnection(MAX_HEADER) if when == "challenge" else proven()
    frame = {
        "challenge": challenge_frame(),
        "commit header": commit_frame(),
        "attach": frame_start(Op.ATTACH, pb.DataPlaneAttach(bytes=16).SerializeToString()),
    }[when]
    assert server.receive_data(frame)
    server.send(ErrorReply(b"refused"))  # an unknown worker, a payload of the wrong size, no descriptor
    assert server.state is State.CLOSED and server.receive_data(pull_frame()) == []


def refusal(server: ServerConnection, data: bytes) -> ProtocolError:
    events = server.receive_data(data)
    assert len(events) == 1 and isinstance(events[0], ProtocolError), events
    assert server.state is State.CLOSED and not len(server.read_view())  # nothing more is read
    return events[0]


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"XXXX" + challenge_frame()[4:], "not a gemps data-plane frame"),
        (raw(Op.HELLO, version=1), "data-plane version 1; this end speaks 2 (client and server differ"),
        (raw(Op.CHALLENGE, flags=0x4), "unknown flags 0x4"),
        (raw(0x33), "unknown op 0x33"),
        (commit_frame(), "the first frame must be a CHALLENGE"),
        (hello_frame(), "the first frame must be a CHALLENGE"),
        (raw(Op.CHALLENGE, b"x", payload_bytes=1), "the first frame must be a CHALLENGE"),
        (raw(Op.CHALLENGE, b"x", flags=SHARED), "the first frame must be a CHALLENGE"),
        (PREAMBLE.pack(MAGIC, VERSION, Op.CHALLENGE, 0, MAX_HELLO_BYTES + 1, 0), "the first frame must be a CHALLENGE"),
        (raw(Op.CHALLENGE, b"\xff\xff"), "not a valid gemps.v1.DataPlaneChallenge"),
        (challenge_frame(nonce=b"short"), "with a 32-byte nonce"),
    ],
)
def test_a_bad_first_frame_is_refused_as_a_bad_hello(data: bytes, message: str) -> None:
    error = refusal(ServerConnection(MAX_HEADER), data)
    assert message in error.message and (error.reason, error.refusal, error.op) == (Reason.MALFORMED, "bad_hello", 0)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (challenge_frame(), "a HELLO must follow"),
        (commit_frame(), "a HELLO must follow"),
        (raw(Op.HELLO, b"x", payload_bytes=1), "a HELLO must follow"),
        (raw(Op.HELLO, b"\xff\xff"), "not a valid gemps.v1.DataPlaneHello"),
    ],
)
def test_after_the_answer_only_a_hello_is_read(data: bytes, message: str) -> None:
    error = refusal(answered(), data)
    assert message in error.message and (error.reason, error.refusal) == (Reason.MALFORMED, "bad_hello")


@pytest.mark.parametrize(
    "hello",
    [
        hello_frame(ticket=b"x" * 32),  # another ticket's proof
        hello_frame(worker_id="w2"),  # the right proof, for another worker than the CHALLENGE named
        frame_start(Op.HELLO, pb.DataPlaneHello(worker_id=WORKER, proof=b"").SerializeToString()),  # none
        frame_start(  # the server's own proof sent back (a reflection): the labels differ
            Op.HELLO,
            pb.DataPlaneHello(
                worker_id=WORKER, proof=proofs.server_proof(TICKET, CLIENT_NONCE, SERVER_NONCE, ADDRESS)
            ).SerializeToString(),
        ),
        frame_start(  # a proof for another answer's nonce (a replay of another connection's HELLO)
            Op.HELLO,
            pb.DataPlaneHello(
                worker_id=WORKER, proof=proofs.client_proof(TICKET, CLIENT_NONCE, b"o" * 32)
            ).SerializeToString(),
        ),
    ],
)
def test_a_hello_whose_proof_is_not_the_tickets_is_refused_as_unauthenticated(hello: bytes) -> None:
    error = refusal(answered(), hello)
    assert (error.reason, error.refusal) == (Reason.UNAUTHENTICATED, "unauthenticated")
    assert "register again" in error.message


def test_the_server_draws_a_fresh_nonce_for_each_answer() -> None:
    nonces = set()
    for _ in range(3):
        server = ServerConnection(MAX_HEADER)
        server.receive_data(challenge_frame())
        answer = server.send(Answer(TICKET, ADDRESS))
        nonces.add(pb.DataPlaneAnswer.FromString(answer[PREAMBLE.size :]).nonce)
    assert len(nonces) == 3 and all(len(n) == proofs.NONCE_BYTES for n in nonces)


def test_the_handshake_is_answered_in_order() -> None:
    server = ServerConnection(MAX_HEADER)
    server.receive_data(challenge_frame())
    with pytest.raises(RuntimeError, match="only a CHALLENGE, is answered with an Answer"):
        server.send(Reply())
    server = answered()
    server.receive_data(hello_frame())
    with pytest.raises(RuntimeError, match="only a CHALLENGE, is answered with an Answer"):
        server.send(Answer(TICKET, ADDRESS))
    with pytest.raises(ValueError, match="worker 'w1' was proven, not 'w2'"):
        server.send(Reply(), "w2")


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (raw(Op.HELLO, b""), "op 0x1 is not a request"),
        (raw(Op.COMMIT | REPLY), "op 0x82 is not a request"),
        (raw(Op.ERROR), "op 0x7f is not a request"),
        (raw(Op.PULL, version=0), "data-plane version 0"),
        (challenge_frame(), "op 0x5 is not a request"),
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


def proving() -> ClientConnection:
    """A client connection whose server proved itself: its HELLO next."""
    client = ClientConnection()
    assert client.send(Challenge(WORKER, TICKET, ADDRESS, CLIENT_NONCE)) == challenge_frame()
    assert client.awaited == Op.CHALLENGE
    assert client.receive_data(answer_frame()) == [ServerProven()]
    assert client.state is State.PROVING and not client.awaiting
    return client


def greeted() -> ClientConnection:
    client = proving()
    assert client.send(Hello()) == hello_frame()
    assert client.receive_data(frame_start(Op.HELLO | REPLY, b"")) == [ReplyReceived(b"", 0, False)]
    assert not client.awaiting and client.state is State.IDLE
    return client


@pytest.mark.parametrize(
    "answer",
    [
        answer_frame(ticket=b"x" * 32),  # made up: whoever answered has no ticket
        answer_frame(address=proofs.address(7001)),  # the ticket's, at another address (a relay)
        answer_frame(address=proofs.address(0, "gemps-data-1-ab")),
        frame_start(  # the client's own kind of proof sent back (a reflection): the labels differ
            Op.CHALLENGE | REPLY,
            pb.DataPlaneAnswer(
                nonce=SERVER_NONCE, proof=proofs.client_proof(TICKET, CLIENT_NONCE, SERVER_NONCE)
            ).SerializeToString(),
        ),
        frame_start(Op.CHALLENGE | REPLY, pb.DataPlaneAnswer(nonce=SERVER_NONCE).SerializeToString()),  # no proof
    ],
)
def test_an_answer_that_does_not_prove_the_ticket_ends_the_connection_and_nothing_more_is_sent(
    answer: bytes,
) -> None:
    client = ClientConnection()
    client.send(Challenge(WORKER, TICKET, ADDRESS, CLIENT_NONCE))
    events = client.receive_data(answer)
    assert len(events) == 1 and isinstance(events[0], ProtocolError)
    assert events[0].reason is Reason.UNAUTHENTICATED and "did not prove" in events[0].message
    assert ADDRESS in events[0].message
    assert client.state is State.CLOSED
    for message in (Hello(), Attach(16), Request(Op.COMMIT, b"", 16)):
        with pytest.raises(RuntimeError, match="closed"):
            client.send(message)


@pytest.mark.parametrize(
    ("answer", "message"),
    [
        (frame_start(Op.CHALLENGE | REPLY, b"\xff\xff"), "not a gemps.v1.DataPlaneAnswer"),
        (answer_frame(nonce=b"short"), "not a gemps.v1.DataPlaneAnswer"),
        (frame_start(Op.CHALLENGE | REPLY, b"", 3), "a CHALLENGE reply with 3 bytes of payload"),
        (frame_start(Op.HELLO | REPLY, b""), "op 0x81 in reply to 0x5"),
    ],
)
def test_an_answer_that_breaks_the_protocol(answer: bytes, message: str) -> None:
    client = ClientConnection()
    client.send(Challenge(WORKER, TICKET, ADDRESS, CLIENT_NONCE))
    events = client.receive_data(answer)
    assert len(events) == 1 and isinstance(events[0], ProtocolError) and message in events[0].message
    assert client.state is State.CLOSED


def test_a_refused_challenge_is_a_refusal() -> None:
    client = ClientConnection()
    client.send(Challenge(WORKER, TICKET, ADDRESS))
    error = pb.DataPlaneError(code=5, message="unknown worker", reason="unknown_worker")
    assert client.receive_data(frame_start(Op.ERROR, error.SerializeToString())) == [Refused(error)]
    assert client.state is State.CLOSED


def test_the_ticket_never_crosses_the_wire_and_each_connection_draws_its_nonce() -> None:
    ticket = bytes(range(32))
    client, server = ClientConnection(), ServerConnection(MAX_HEADER)
    sent = client.send(Challenge(WORKER, ticket, ADDRESS))
    assert server.receive_data(sent) == [ChallengeReceived(WORKER)]
    answer = server.send(Answer(ticket, ADDRESS))
    assert client.receive_data(answer) == [ServerProven()]
    hello = client.send(Hello())
    sent += hello
    assert server.receive_data(hello) == [HelloReceived(WORKER)]
    assert ticket not in sent + answer
    other = ClientConnection().send(Challenge(WORKER, ticket, ADDRESS))
    assert other != sent[: len(other)]  # another nonce


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
    client = proving()
    client.send(Hello())
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
    with pytest.raises(RuntimeError, match="the handshake goes first"):
        client.send(Request(Op.PULL, b""))
    with pytest.raises(RuntimeError, match="once the server proved itself"):
        client.send(Hello())
    client.send(Challenge(WORKER, TICKET, ADDRESS))
    with pytest.raises(RuntimeError, match="still awaited"):
        client.send(Hello())
    client = proving()
    with pytest.raises(RuntimeError, match="the handshake goes first"):
        client.send(Attach(16))
    with pytest.raises(RuntimeError, match="one CHALLENGE per connection"):
        client.send(Challenge(WORKER, TICKET, ADDRESS))
    client = greeted()
    client.send(Request(Op.PULL, b""))
    with pytest.raises(RuntimeError, match="still awaited"):
        client.send(Request(Op.PULL, b""))
    with pytest.raises(ValueError, match="not a request"):
        greeted().send(Request(Op.ERROR, b""))


# -- both ends together ------------------------------------------------------------------------


def test_both_roles_talk_to_each_other() -> None:
    client, server = ClientConnection(), ServerConnection(MAX_HEADER)
    assert server.receive_data(client.send(Challenge(WORKER, TICKET, ADDRESS))) == [ChallengeReceived(WORKER)]
    assert client.receive_data(server.send(Answer(TICKET, ADDRESS))) == [ServerProven()]
    (hello,) = server.receive_data(client.send(Hello()))
    assert hello == HelloReceived(WORKER)
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
        == b"GMDP\x02\x03\x01\x00\x02\x00\x00\x00" + (7).to_bytes(8, "little") + b"hh"
    )


def test_the_proofs_bind_their_direction_nonces_and_address() -> None:
    base = proofs.server_proof(TICKET, CLIENT_NONCE, SERVER_NONCE, ADDRESS)
    assert len(base) == proofs.PROOF_BYTES
    others = {
        proofs.client_proof(TICKET, CLIENT_NONCE, SERVER_NONCE),
        proofs.server_proof(b"x" * 32, CLIENT_NONCE, SERVER_NONCE, ADDRESS),
        proofs.server_proof(TICKET, SERVER_NONCE, CLIENT_NONCE, ADDRESS),
        proofs.server_proof(TICKET, CLIENT_NONCE, SERVER_NONCE, proofs.address(7001)),
        proofs.server_proof(TICKET, CLIENT_NONCE + b"s", SERVER_NONCE[1:], ADDRESS),  # parts keep their bounds
    }
    assert base not in others and len(others) == 5
    assert proofs.address(7000) == "tcp:7000" and proofs.address(7000, "gemps-data-1") == "local:gemps-data-1"
