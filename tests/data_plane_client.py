"""A raw data-plane client for tests (gemps_proto/data_plane_frames.py): a socket, the handshake
(a CHALLENGE, then a HELLO with the proof a ticket makes), then commits and pulls framed by hand,
and whatever the server answers read back as it came; and the server's end of a handshake, for
tests that play the server."""

from __future__ import annotations

import socket
import ssl
from dataclasses import dataclass
from types import TracebackType

import numpy as np
from google.protobuf.message import Message

from gemps_proto import data_plane_frames, proofs
from gemps_proto.data_plane_events import NEED_DATA, Answer, Reply
from gemps_proto.data_plane_frames import REPLY, Op
from gemps_proto.data_plane_protocol import ServerConnection
from gemps_proto.v1 import parameter_server_pb2 as pb


@dataclass
class Frame:
    op: int
    header: bytes
    payload: bytes

    @property
    def error(self) -> pb.DataPlaneError | None:
        return pb.DataPlaneError.FromString(self.header) if self.op == Op.ERROR else None

    def message(self, message_class: type[Message]) -> Message:
        return message_class.FromString(self.header)


class DataPlaneClient:
    def __init__(
        self,
        port: int,
        host: str = "127.0.0.1",
        timeout: float = 10.0,
        tls: ssl.SSLContext | None = None,
        local_socket: str = "",
    ) -> None:
        """To `host`:`port`, or (`local_socket`) to a server's abstract Unix socket of that name."""
        if local_socket:
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.sock.settimeout(timeout)
            self.sock.connect("\0" + local_socket)
            return
        self.sock = socket.create_connection((host, port), timeout=timeout)
        if tls is not None:
            try:
                self.sock = tls.wrap_socket(self.sock, server_hostname=host)
            except OSError:
                self.sock.close()
                raise

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> DataPlaneClient:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # -- frames ----------------------------------------------------------------------------

    def send(
        self,
        op: int,
        header: bytes,
        payload: bytes = b"",
        payload_bytes: int | None = None,
        fds: list[int] | None = None,
        flags: int = 0,
    ) -> None:
        """A frame; `payload_bytes` announces another length than the payload's (to lie); `fds`
        pass descriptors with it (a local socket)."""
        announced = len(payload) if payload_bytes is None else payload_bytes
        data = data_plane_frames.frame_start(op, header, announced, flags) + payload
        if fds:
            sent = socket.send_fds(self.sock, [data], fds)
            if sent < len(data):
                self.sock.sendall(data[sent:])
        else:
            self.sock.sendall(data)

    def receive(self, shared: memoryview | None = None) -> Frame:
        """The next frame; a payload flagged SHARED read from `shared` (the attached memory)."""
        start = self._exactly(data_plane_frames.PREAMBLE.size)
        preamble = data_plane_frames.read_preamble(start)
        header = self._exactly(preamble.header_bytes)
        if preamble.shared:
            assert shared is not None, "a SHARED reply, and no shared memory here"
            return Frame(preamble.op, header, bytes(shared[: preamble.payload_bytes]))
        return Frame(preamble.op, header, self._exactly(preamble.payload_bytes))

    def closed_by_server(self) -> bool:
        """Whether the server closed this connection (EOF or reset), reading anything before it."""
        try:
            while self.sock.recv(65536):
                pass
        except ConnectionResetError:
            pass
        return True

    def _exactly(self, size: int) -> bytes:
        data = bytearray(size)
        view, filled = memoryview(data), 0
        while filled < size:
            count = self.sock.recv_into(view[filled:])
            if count == 0:
                raise ConnectionError(f"closed after {filled} of {size} bytes")
            filled += count
        return bytes(data)

    # -- calls ------------------------------------------------------------------------------

    def challenge(self, worker_id: str) -> tuple[Frame, bytes]:
        """A CHALLENGE: the server's answer (or refusal), and the nonce sent (the HELLO's proof needs it)."""
        nonce = proofs.nonce()
        self.send(Op.CHALLENGE, pb.DataPlaneChallenge(worker_id=worker_id, nonce=nonce).SerializeToString())
        return self.receive(), nonce

    def hello(self, worker_id: str, ticket: bytes) -> Frame:
        """The handshake with `ticket`: the HELLO's reply, or the refusal of the CHALLENGE or the HELLO.
        The server's proof is not checked here (the SDK's DataConnection checks it)."""
        answer, nonce = self.challenge(worker_id)
        if answer.op != Op.CHALLENGE | REPLY:
            return answer
        server_nonce = pb.DataPlaneAnswer.FromString(answer.header).nonce
        proof = proofs.client_proof(ticket, nonce, server_nonce)
        self.send(Op.HELLO, pb.DataPlaneHello(worker_id=worker_id, proof=proof).SerializeToString())
        return self.receive()

    def commit(self, worker_id: str, payload: np.ndarray, base_version: int, request_id: str = "") -> Frame:
        values = np.ascontiguousarray(payload, dtype=np.float32)
        header = commit_header(worker_id, values.size, base_version, request_id)
        self.send(Op.COMMIT, header, values.tobytes())
        return self.receive()

    def attach(self, fds: list[int], size: int) -> Frame:
        """An ATTACH announcing `size` bytes, passing `fds` (one memfd, for a well-behaved client)."""
        self.send(Op.ATTACH, pb.DataPlaneAttach(bytes=size).SerializeToString(), fds=fds)
        return self.receive()

    def pull(
        self,
        worker_id: str,
        known_version: int = -1,
        known_history: str = "",
        reply_dtype: pb.DType = pb.DTYPE_UNSPECIFIED,
    ) -> Frame:
        request = pb.PullRequest(
            worker_id=worker_id, known_version=known_version, known_history=known_history, reply_dtype=reply_dtype
        )
        self.send(Op.PULL, request.SerializeToString())
        return self.receive()


def commit_header(
    worker_id: str,
    size: int,
    base_version: int,
    request_id: str = "",
    kind: int = pb.PAYLOAD_KIND_GRADIENT,
    **fields: object,
) -> bytes:
    """A CommitRequest announcing a float32 payload of `size` values (its data not included)."""
    request = pb.CommitRequest(
        worker_id=worker_id,
        base_version=base_version,
        kind=kind,  # type: ignore[arg-type]
        request_id=request_id,
        payload=pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[size]),
        **fields,  # type: ignore[arg-type]
    )
    return request.SerializeToString()


def answer_handshake(sock: socket.socket, ticket: bytes, address: str) -> None:
    """The server's end of a handshake with `ticket`, as the server's protocol core plays it, at
    `address` (proofs.address: what the client dialed)."""
    protocol = ServerConnection(1 << 16)
    for step in range(2):
        while (event := protocol.next_event()) is NEED_DATA:
            count = sock.recv_into(protocol.read_view())
            assert count, "the client closed in the handshake"
            protocol.received(count)
        worker_id = getattr(event, "worker_id", "")
        sock.sendall(protocol.send(Answer(ticket, address)) if step == 0 else protocol.send(Reply(), worker_id))


def theta_of(frame: Frame) -> np.ndarray:
    """The float32 θ a reply carries."""
    assert frame.op in (Op.COMMIT | REPLY, Op.PULL | REPLY), frame.error
    return np.frombuffer(frame.payload, dtype=np.float32)
