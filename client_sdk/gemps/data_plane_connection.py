"""One data-plane connection to one server process (DESIGN §3c): the protocol core's client role on a socket.

A TCP socket (TLS with the gRPC connection's settings when that uses TLS), or on the server's
host its local Unix socket; a handshake in which the server proves it holds one registration's
ticket before this end proves it does (the ticket itself is never sent: whoever took a dead
server's socket name or port gets nothing: ServerNotProven), then strictly one request and its
reply at a time. Frames go out from their own memory (`sendmsg` of the preamble and header,
then the payload's view) and θ comes in with `recv_into` straight into the array the caller keeps.
A local connection may `attach` shared memory (a sealed memfd of θ's float32 size): payloads are
then written into it and θ read out of it, and only headers cross the socket. Every failure is a
typed GempsError and leaves the connection closed: a socket error is ServerUnavailableError
(retried by the session, whose request id makes a commit exactly-once), a timeout
DeadlineExceededError, an ERROR frame the error the gRPC path would have raised.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
import socket
import ssl
import sys
from collections.abc import Callable, Iterator
from typing import NoReturn, TypeVar

from google.protobuf.message import DecodeError, Message

from gemps import errors, patient_writes
from gemps.reply_buffers import ReplyBuffers
from gemps.transport import refuse_non_finite, time_left
from gemps_proto import proofs, vectors
from gemps_proto.data_plane_events import (
    NEED_DATA,
    Attach,
    Challenge,
    ClientEvent,
    Hello,
    NeedData,
    PayloadComplete,
    ProtocolError,
    Refused,
    ReplyReceived,
    Request,
    ServerProven,
)
from gemps_proto.data_plane_frames import Op
from gemps_proto.data_plane_protocol import TLS_PIECE, ClientConnection
from gemps_proto.reasons import Reason
from gemps_proto.tensor_codec import EncodedTensor, TensorDecodeError, expected_payload_nbytes
from gemps_proto.v1 import parameter_server_pb2 as pb

M = TypeVar("M", bound=Message)
#: what a reply's payload is read as (`receive_tensor`): θ's values, or a difference reply's code
Read = TypeVar("Read")
Payload = bytes | memoryview

#: a socket's timeout is set again only when the call's time left differs from it by more than
#: this (each setting is a system call; two a commit, which a commit's own time barely moves)
TIMEOUT_SLACK = 0.05


class Unreachable(Exception):
    """The data port could not be reached: the connection was refused or timed out, or TLS failed."""

    def __init__(self, address: str, why: str) -> None:
        super().__init__(f"{address}: {why}")
        self.address = address
        self.why = why


class ServerNotProven(errors.UnauthenticatedError):
    """What answered at the data plane's address did not prove it holds the registration's ticket:
    not the server that issued it (one that took a dead server's socket name or port?). It was
    sent no ticket, no proof and no memory; not retried there (the SDK uses gRPC instead)."""


def target_host(target: str) -> str:
    """The host of a gRPC target ("host:port", "[v6]:port", "dns:///host:port"), where its data
    plane listens too."""
    for scheme in ("dns:///", "dns:", "ipv4:", "ipv6:"):
        target = target.removeprefix(scheme)
    host, separator, _port = target.rpartition(":")
    host = host if separator else target
    return host.removeprefix("[").removesuffix("]")


#: whether this platform can attach shared memory (memfd, seals, descriptor passing)
SHARED_MEMORY = sys.platform == "linux" and hasattr(os, "memfd_create") and hasattr(fcntl, "F_ADD_SEALS")


#: A server whose machine died (or whose cable was cut) sends nothing, not even a reset: a reply
#: awaited would wait out the call's whole deadline before the client tried another replica. So
#: a silent peer is probed (idle seconds, interval, probes: keepalive), and bytes it leaves
#: unacknowledged UNACKNOWLEDGED_MS fail the connection (TCP_USER_TIMEOUT; gemps.patient_writes
#: for a request the server takes in late).
KEEPALIVE = (2, 1, 3)


def keep_alive(sock: socket.socket) -> None:
    """Fail `sock` within seconds of its peer going silent (Linux; elsewhere the system's default)."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    idle, interval, probes = KEEPALIVE
    options = (("TCP_KEEPIDLE", idle), ("TCP_KEEPINTVL", interval), ("TCP_KEEPCNT", probes))
    for option, value in (*options, ("TCP_USER_TIMEOUT", patient_writes.UNACKNOWLEDGED_MS)):
        if hasattr(socket, option):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)


class DataConnection:
    """An open data-plane connection that a HELLO has bound to one worker's registration."""

    def __init__(self, sock: socket.socket, address: str, proven_address: str) -> None:
        self.sock = sock
        self.address = address
        self.proven_address = proven_address  # what the server's proof must name (proofs.address)
        self.closed = False
        self._protocol = ClientConnection()
        self.local = sock.family == getattr(socket, "AF_UNIX", None)
        self._shared: mmap.mmap | None = None  # the attached shared memory
        self._shared_view = memoryview(b"")  # its bytes (slicing an mmap itself would copy them)
        self._replies = ReplyBuffers()  # where replies' payloads land: pages kept, not faulted in anew

    @property
    def awaiting(self) -> bool:
        """A request was sent and its reply (or that reply's θ) not read yet."""
        return self._protocol.awaiting

    @property
    def shared(self) -> bool:
        """Payloads and θ travel through attached shared memory."""
        return self._shared is not None

    @classmethod
    def open_local(cls, name: str, *, timeout: float) -> DataConnection:
        """Connect to a server's local socket (an abstract Unix socket: on its host and in its
        network namespace only); Unreachable when there is none of that name here."""
        address = f"local socket {name}"
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        try:
            sock.connect("\0" + name)
        except OSError as error:
            sock.close()
            raise Unreachable(address, _why(error)) from None
        return cls(sock, address, proofs.address(0, name))

    def attach(self, size: int) -> None:
        """Attach `size` bytes of shared memory (θ's float32 bytes on this server): a memfd
        allocated here (its pages are this process's, charged to it: the server maps no memory its
        client has not made), sealed against shrinking and growing, mapped here, then passed with
        an ATTACH frame (the server seals it against new writable mappings and hole punching once
        it has mapped it). Its refusal is raised typed (the server closes the connection after it)."""
        fd = os.memfd_create("gemps-data-plane", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, size)
            os.posix_fallocate(fd, 0, size)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
            shared = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            with self._typed():
                socket.send_fds(self.sock, [self._protocol.send(Attach(size))], [fd])
        finally:
            os.close(fd)  # the server has its own copy of the descriptor, and the mapping stays
        try:
            self.receive(Op.ATTACH)
        except BaseException:
            shared.close()
            raise
        self._shared, self._shared_view = shared, memoryview(shared)

    @classmethod
    def open(
        cls, host: str, port: int, *, timeout: float, tls: ssl.SSLContext | None, server_name: str | None = None
    ) -> DataConnection:
        """Connect (and shake hands under TLS); Unreachable when that fails."""
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        try:
            sock = socket.create_connection((host, port), timeout=timeout)
        except OSError as error:
            raise Unreachable(address, _why(error)) from None
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        keep_alive(sock)
        if tls is not None:
            try:
                sock = tls.wrap_socket(sock, server_hostname=server_name or host)
            except OSError as error:  # ssl.SSLError included
                sock.close()
                raise Unreachable(address, f"TLS failed: {_why(error)}") from None
        return cls(sock, address, proofs.address(port))

    def hello(self, worker_id: str, ticket: bytes) -> None:
        """Bind this connection to the registration of `worker_id`: a CHALLENGE, which the server
        answers with its proof, then (that proof checked) this end's in a HELLO; a refusal raised
        typed, an answer that proves nothing as ServerNotProven. No answer at all, or one in another
        protocol, is Unreachable: a port that is not a data plane (whoever took a dead server's port
        since), or TLS refused late (1.3)."""
        try:
            with self._typed():
                self._write([memoryview(self._protocol.send(Challenge(worker_id, ticket, self.proven_address)))])
            self._proven()
            with self._typed():
                self._write([memoryview(self._protocol.send(Hello()))])
            self.receive(Op.HELLO)
        except (errors.ServerUnavailableError, errors.DeadlineExceededError) as error:
            if error.reason:  # the server's own refusal (a replica not primary): as it came
                raise
            raise Unreachable(self.address, f"handshake not answered ({error.message})") from None

    def _proven(self) -> None:
        """The CHALLENGE's answer: the server proved it holds the ticket, or ServerNotProven (the
        connection closed, nothing more sent), or the refusal it sent raised typed."""
        if self._protocol.awaited != Op.CHALLENGE:
            raise RuntimeError("no CHALLENGE's answer is awaited")
        event = self._event(first_answer=True)
        if isinstance(event, Refused):
            self._refused(event)
        assert isinstance(event, ServerProven), event

    # -- frames -------------------------------------------------------------------------------------

    def bound(self, timeout: float | None) -> None:
        """Each wait on the socket within `timeout` (the calls'), or what is left of the call's
        deadline when that is sooner (the Client's `timeout` bounds the whole call), give or take
        TIMEOUT_SLACK; None: as the socket is."""
        if timeout is None:
            return
        try:
            left = time_left(timeout)
        except errors.DeadlineExceededError:
            self.close()  # nothing sent; the next call opens another
            raise
        current = self.sock.gettimeout()
        if current is None or abs(current - left) > TIMEOUT_SLACK:
            self.sock.settimeout(left)

    def send(self, op: int, header: bytes, payload: Payload = b"", *, finite: str | None = None) -> None:
        """A request frame, from the payload's own memory (a view of the caller's array), or
        through the shared memory when attached (copied there: the caller keeps its array).
        `finite` (float32 values, shared memory): the payload's name, its copy checked for NaN
        and Inf before anything is sent (refused as refuse_non_finite refuses it: in cache there,
        where a check of the caller's array read it from memory once more)."""
        data = memoryview(payload).cast("B")
        if self._shared is not None:  # the frame is flagged SHARED: only its start goes
            self._shared_view[: len(data)] = data
            if finite is not None:
                refuse_non_finite(finite, vectors.float32s(self._shared_view[: len(data)]))
        start = memoryview(self._protocol.send(Request(Op(op), header, len(data))))
        with self._typed():
            self._write([start] if self._shared is not None else [start, data])

    def receive(self, op: int) -> tuple[bytes, int]:
        """The reply to the request `op` sent: its header and how many payload bytes follow (read
        them with receive_tensor). An ERROR frame is raised as the GempsError it names."""
        if self._protocol.awaited != op:
            raise RuntimeError(f"no reply to op {op:#x} is awaited")
        event = self._event()
        if isinstance(event, Refused):
            self._refused(event)
        assert isinstance(event, ReplyReceived), event
        return event.header, event.payload_bytes

    def _refused(self, event: Refused) -> NoReturn:
        """An ERROR frame, raised as the GempsError it names. Closed: after a refusal the server may
        close it (a request refused unread), and reconnecting costs one round trip on a rare path."""
        self.close()
        refusal = event.error
        raise errors.from_status_number(refusal.code, refusal.message, refusal.reason)

    def receive_tensor(self, announced: pb.Tensor, payload_bytes: int, decode: Callable[[EncodedTensor], Read]) -> Read:
        """The payload the reply's header announced (θ, or a difference reply's code), read straight
        into a buffer no one else holds (reply_buffers.py), as `decode` reads it (a protocol error
        when it cannot: TensorDecodeError), from read-only bytes."""
        shape = tuple(announced.shape)
        try:
            nbytes = expected_payload_nbytes(announced.dtype, shape)
        except TensorDecodeError as error:
            self.protocol_error(str(error))
        if nbytes != payload_bytes:
            self.protocol_error(f"{payload_bytes} bytes of payload; the header announced {nbytes}")
        data = self._replies.take(nbytes)  # aligned: float32 values alias it
        if self._shared is not None:
            if nbytes > len(self._shared_view):
                self.protocol_error(f"{nbytes} bytes announced, {len(self._shared_view)} shared")
            data[:] = self._shared_view[:nbytes]  # copied out: the memory is the next request's
        else:
            self._protocol.payload_into(data)
            assert isinstance(self._event(), PayloadComplete)
        try:
            return decode(EncodedTensor(announced.dtype, shape, data.toreadonly()))
        except TensorDecodeError as error:
            self.protocol_error(str(error))

    def parse(self, message_class: type[M], header: bytes) -> M:
        try:
            return message_class.FromString(header)
        except DecodeError as error:
            self.protocol_error(f"a reply header that is not a {message_class.DESCRIPTOR.full_name}: {error}")

    def protocol_error(self, what: str) -> NoReturn:
        """The server said something this end does not expect: not retried."""
        self.close()
        raise errors.GempsError(f"data plane of {self.address}: {what}")

    def wake(self) -> None:
        """End a read or write blocked on this connection in another thread (close() alone does
        not wake it); the connection is then closed by its own thread's failure."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.closed = True
        with contextlib.suppress(OSError):
            self.sock.close()
        if self._shared is not None:
            self._shared_view.release()
            with contextlib.suppress(BufferError):  # a view still in use: unmapped when it goes
                self._shared.close()
            self._shared, self._shared_view = None, memoryview(b"")

    # -- internals ----------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _typed(self) -> Iterator[None]:
        """Socket failures as the session's retryable errors, the connection closed (its state is unknown)."""
        try:
            yield
        except OSError as error:  # ConnectionError, ssl.SSLError, a closed socket, a timeout
            self.close()
            if isinstance(error, TimeoutError) and error.errno is None:  # the socket's timeout: the call's time
                # a write's own words (patient_writes: the server took in no more), else a reply awaited
                what = (
                    str(error) if str(error) not in ("", "timed out") else "the server sent nothing within the timeout"
                )
                raise errors.DeadlineExceededError(
                    f"DEADLINE_EXCEEDED: data plane of {self.address}: {what}", errors.DeadlineExceededError.code
                ) from None
            # the kernel's ETIMEDOUT among them: no keepalive answered, or bytes unacknowledged (KEEPALIVE)
            raise errors.ServerUnavailableError(
                f"UNAVAILABLE: data plane of {self.address}: {_why(error)}", errors.ServerUnavailableError.code
            ) from None

    def _event(self, first_answer: bool = False) -> ClientEvent:
        """The protocol's next event, reading what it asks for (exactly: θ straight into the array
        it was told to read it into); a ProtocolError closes the connection, raised typed (as
        Unreachable in the `first_answer` from the port: what listens there is no data plane)."""
        protocol, filled = self._protocol, 0
        with self._typed():
            while (event := protocol.next_event()) is NEED_DATA:
                view = protocol.read_view()
                count = self.sock.recv_into(view)
                if count == 0:
                    raise ConnectionResetError(f"closed by the server after {filled} of {filled + len(view)} bytes")
                filled += count
                protocol.received(count)
        assert not isinstance(event, NeedData)
        if isinstance(event, ProtocolError):
            if event.reason is Reason.UNAUTHENTICATED:  # the server's proof is not the ticket's
                self.close()
                raise ServerNotProven(
                    f"data plane at {self.address}: {event.message}: refused; sent it no ticket, proof or memory",
                    ServerNotProven.code,
                    Reason.UNAUTHENTICATED,
                )
            if first_answer:
                self.close()
                raise Unreachable(self.address, f"it answers in another protocol ({event.message})")
            self.protocol_error(event.message)
        return event

    def _write(self, views: list[memoryview]) -> None:
        """Every byte of `views`, from their own memory: one sendmsg for a header and θ's bytes on
        a plain socket (resumed where a partial one stopped), TLS_PIECE at a time under TLS; to a
        server that takes them in late for as long as the call's time allows (gemps.patient_writes)."""
        sock = self.sock
        if isinstance(sock, ssl.SSLSocket):  # a record written whole or not at all; retried as it was
            patient_writes.write_all(sock, views, lambda pending: sock.send(pending[0][:TLS_PIECE]))
        else:
            patient_writes.write_all(sock, views, sock.sendmsg)


def _why(error: OSError) -> str:
    if error.errno == errno.ETIMEDOUT:
        return "the connection timed out: the server acknowledged nothing for seconds (its machine gone or cut off?)"
    return error.strerror or str(error) or type(error).__name__
