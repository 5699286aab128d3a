"""The data-plane protocol core driven with byte strings, the client's role and both ends
together, no socket (DESIGN §3c): the server's answer that must prove the ticket, replies that
break the protocol, shared memory, the order a client says things in; the frame preamble and the
proofs' bindings. The server's role: test_data_plane_protocol.py.
"""

from __future__ import annotations

import struct

import numpy as np
import pytest

from gemps_proto import proofs
from gemps_proto.data_plane_events import (
    Answer,
    Attach,
    Challenge,
    ChallengeReceived,
    CommitHeader,
    Hello,
    HelloReceived,
    PayloadComplete,
    ProtocolError,
    Refused,
    Reply,
    ReplyReceived,
    Request,
    ServerProven,
)
from gemps_proto.data_plane_frames import PREAMBLE, REPLY, SHARED, Op, frame_start, read_preamble
from gemps_proto.data_plane_protocol import (
    ClientConnection,
    ServerConnection,
    State,
    advance,
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
    answer_frame,
    challenge_frame,
    commit_header,
    hello_frame,
    received_commit,
)

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
