"""The data-plane protocol core driven with byte strings, the server's role, no socket (DESIGN §3c).

Every frame type, every refusal the core makes, lying and truncated lengths, bad preambles,
pipelined requests and a small frame split at every byte boundary; the handshake in which the
client proves it holds the ticket without sending it, and every way its proof can be wrong. The
client's role and both ends together: test_data_plane_protocol_client.py. The socket suites
(tests/integration/test_data_plane*.py) keep testing the loop and the kernel around it.
"""

from __future__ import annotations

import numpy as np
import pytest

from gemps_proto import proofs
from gemps_proto.data_plane_events import (
    NEED_DATA,
    Answer,
    ChallengeReceived,
    CommitHeader,
    ErrorReply,
    HelloReceived,
    PayloadComplete,
    ProtocolError,
    PullRequested,
    Reply,
    ServerEvent,
)
from gemps_proto.data_plane_frames import MAGIC, PREAMBLE, REPLY, SHARED, VERSION, Op, frame_start, read_preamble
from gemps_proto.data_plane_protocol import (
    MAX_HELLO_BYTES,
    ServerConnection,
    State,
)
from gemps_proto.reasons import Reason
from gemps_proto.v1 import parameter_server_pb2 as pb
from tests.data_plane_bytes import (
    ADDRESS,
    CLIENT_NONCE,
    MAX_HEADER,
    PAYLOAD,
    SERVER_NONCE,
    TICKET,
    WORKER,
    answered,
    attached,
    challenge_frame,
    commit_frame,
    commit_header,
    hello_frame,
    proven,
    pull_frame,
    raw,
    received_commit,
)

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
