"""Byte strings and connections of the data-plane protocol's tests (tests/unit/test_data_plane_protocol*.py):
one worker's frames with a known ticket and nonces, and server connections walked to each state
of the handshake, each step asserted on the way."""

from __future__ import annotations

import numpy as np

from gemps_proto import proofs
from gemps_proto.data_plane_events import (
    Answer,
    AttachRequested,
    ChallengeReceived,
    CommitHeader,
    HelloReceived,
    Reply,
    ServerEvent,
)
from gemps_proto.data_plane_frames import MAGIC, PREAMBLE, REPLY, SHARED, VERSION, Op, frame_start
from gemps_proto.data_plane_protocol import (
    ServerConnection,
    State,
)
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
