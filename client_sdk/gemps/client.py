"""The synchronous gemps client: register, pull, commit, leave, status.

Every call has a deadline. Retries UNAVAILABLE and DEADLINE_EXCEEDED with exponential backoff
and jitter, re-registers transparently when the server has forgotten this worker (lease expiry,
server restart), never has one commit applied twice (each commit carries a request id that its
retries reuse; the server deduplicates), and raises typed GempsError subclasses instead of raw
grpc errors. TLS (optionally with a client certificate) and a bearer token come from arguments
or from GEMPS_* environment variables, so reference workers in containers need no code.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from typing import TypeVar

import grpc
import numpy as np

from gemps import errors, serde
from gemps.connection import Connection, Pem
from gemps.records import CentralVariable, CommitResult, Evaluation, ParameterSpec, Registration, ServerStatus
from gemps.retry import RetryPolicy
from gemps_proto import serde as shared
from gemps_proto.chunks import DEFAULT_CHUNK_BYTES, PayloadAssembler, data_frames, read_data
from gemps_proto.codec import WIRE_DTYPE_NAMES, decode, expected_nbytes, num_elements, wire_view
from gemps_proto.reasons import Reason
from gemps_proto.schema import PayloadKind, flatten, spec_of
from gemps_proto.v1 import parameter_server_pb2 as pb
from gemps_proto.v1 import parameter_server_pb2_grpc as pb_grpc

log = logging.getLogger("gemps.client")

T = TypeVar("T")
ChunkMessage = TypeVar("ChunkMessage", pb.CommitResponseChunk, pb.PullResponseChunk)

# Failures worth another attempt: the server is down, restarting, paused or overloaded.
RETRIED = (errors.ServerUnavailableError, errors.DeadlineExceededError)
# How soon a disconnected channel tries the server again (gRPC's default grows to 120 s).
RECONNECT_BACKOFF_MS = (200, 2000)  # initial, max

# Payloads past this many bytes go through CommitStream (and θ through PullStream) by default:
# the server holds a few θ-sized buffers for streams however many clients commit at once, where
# every unary commit in flight holds its request and its reply (1M parameters, 100 clients:
# 2.1 GB against 0.9 GB); gRPC Python's synchronous client reads a large unary reply slowly (at
# 10M parameters, half the rate of the same reply in pieces); past 2 GiB one message cannot carry
# it. docs/PERFORMANCE.md has the measurements.
STREAM_THRESHOLD_BYTES = 1 << 20
STREAMING_CHOICES = ("auto", "always", "never")
_METHOD = "/gemps.v1.ParameterServer/"


def _raw(data: bytes) -> bytes:
    return data


class Client:
    """A connection to a gemps server, used by one worker (not thread-safe; one per thread).

    >>> with Client("127.0.0.1:50051") as client:
    ...     client.register({"w": np.zeros((3, 2), np.float32)})
    ...     result = client.commit({"w": np.ones((3, 2), np.float32)}, loss=0.7)
    """

    def __init__(
        self,
        target: str = "127.0.0.1:50051",
        *,
        name: str = "",
        timeout: float = 60.0,
        retry: RetryPolicy | None = None,
        max_message_mb: int = 512,
        token: str | None = None,
        tls: bool | None = None,
        ca_cert: Pem | None = None,
        client_cert: Pem | None = None,
        client_key: Pem | None = None,
        server_name: str | None = None,
        stop: threading.Event | None = None,
        wire_dtype: str = "float32",
        streaming: str = "auto",
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    ) -> None:
        """`timeout` is every call's deadline in seconds. TLS and token arguments left out come
        from GEMPS_* environment variables (see `Connection`); PEM arguments are paths or bytes.
        Setting `stop` (e.g. from a SIGTERM handler) ends a wait to retry with StoppedError.

        `wire_dtype` is how commits and replies travel: "float32", or "bfloat16" (half the
        bytes; values rounded to bfloat16 both ways, the central variable stays float32).
        `streaming` picks Commit or CommitStream: "auto" streams payloads past 1 MiB in pieces
        of `chunk_bytes`; "always"; "never"."""
        if wire_dtype not in WIRE_DTYPE_NAMES:
            raise ValueError(f"wire_dtype must be one of {', '.join(WIRE_DTYPE_NAMES)}, not {wire_dtype!r}")
        if streaming not in STREAMING_CHOICES:
            raise ValueError(f"streaming must be one of {', '.join(STREAMING_CHOICES)}, not {streaming!r}")
        if chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be > 0, not {chunk_bytes}")
        self.wire_dtype = WIRE_DTYPE_NAMES[wire_dtype]
        self.streaming = streaming
        self.chunk_bytes = chunk_bytes
        self.target = target
        self._stop = stop
        self.name = name
        self.timeout = timeout
        self.retry = retry or RetryPolicy()
        self.connection = Connection.resolve(
            token=token,
            tls=tls,
            ca_cert=ca_cert,
            client_cert=client_cert,
            client_key=client_key,
            server_name=server_name,
        )
        limit = min(max_message_mb * 1024 * 1024, 2**31 - 1)
        self._channel = self.connection.channel(
            target,
            options=[
                ("grpc.max_receive_message_length", limit),
                ("grpc.max_send_message_length", limit),
                ("grpc.initial_reconnect_backoff_ms", RECONNECT_BACKOFF_MS[0]),
                ("grpc.max_reconnect_backoff_ms", RECONNECT_BACKOFF_MS[1]),
            ],
        )
        self._metadata = self.connection.metadata
        self._stub = pb_grpc.ParameterServerStub(self._channel)
        # The calls that carry θ send and receive bytes: serde frames and reads θ without copies.
        self._register_raw = self._channel.unary_unary(_METHOD + "Register", _raw, _raw)
        self._pull_raw = self._channel.unary_unary(_METHOD + "Pull", _raw, _raw)
        self._pull_stream = self._channel.unary_stream(_METHOD + "PullStream", _raw, _raw)
        self._commit_raw = self._channel.unary_unary(_METHOD + "Commit", _raw, _raw)
        self._commit_stream = self._channel.stream_stream(_METHOD + "CommitStream", _raw, _raw)
        #: attempts retried after UNAVAILABLE or DEADLINE_EXCEEDED, over this client's life
        self.retries = 0
        self._registered_with: Mapping[str, np.ndarray] | None = None
        self._spec: tuple[ParameterSpec, ...] = ()
        self._buffer_spec: tuple[ParameterSpec, ...] = ()
        self._registered_buffers = np.empty(0, dtype=np.float32)
        self.registration: Registration | None = None
        self.central: CentralVariable | None = None  # the newest central variable received
        # This client's identity, the same at every registration: the server deduplicates its
        # commits by (client_id, request_id), also after it registers again, and keeps one registration of it.
        self.client_id = uuid.uuid4().hex
        # The server's `history` from its last Pull reply: "unchanged" needs version and history.
        self._history = ""

    # -- worker lifecycle ----------------------------------------------------------------------

    def register(
        self, parameters: Mapping[str, np.ndarray], buffers: Mapping[str, np.ndarray] | None = None
    ) -> Registration:
        """Announce this worker with its named initial parameters (in a fixed order), and the
        model's buffers if it has any (state that is not trained, e.g. batch-norm statistics).

        The first worker's values initialise the central variable and buffers; later workers must
        have the same names and shapes, and receive the central ones instead.
        """
        self._registered_with = {k: np.asarray(v, dtype=np.float32) for k, v in parameters.items()}
        self._spec = spec_of(self._registered_with)
        named_buffers = {k: np.asarray(v, dtype=np.float32) for k, v in (buffers or {}).items()}
        self._buffer_spec = spec_of(named_buffers)
        self._registered_buffers = flatten(named_buffers)
        return self._register(flatten(self._registered_with), self._registered_buffers)

    def pull(self) -> CentralVariable:
        """The newest central variable (no payload is sent when ours is already current).

        Works without registering too (an observer such as an evaluator): such a read-only
        pull holds no lease and takes the parameter spec from the server's Status.
        """
        if self.registration is None and not self._spec:
            status = self.status()
            self._spec, self._buffer_spec = status.spec, status.buffer_spec
        known = self.central.version if self.central is not None else -1

        def send() -> tuple[pb.PullResponse, np.ndarray | None]:
            request = serde.pull_request(self._worker_id(), known, self.wire_dtype, self._history)
            if self._streams(expected_nbytes(self.wire_dtype, [self._num_parameters()])):
                return self._call(self._pull_streamed, request)
            return serde.pull_reply(self._call(self._pull_raw, request))

        reply, parameters = send() if self.registration is None else self._with_reregistration(send)
        if reply.history:
            self._history = reply.history
        if parameters is not None:
            self.central = self._central(reply.version, parameters, serde.buffers_from_proto(reply))
        assert self.central is not None
        return self.central

    def commit(
        self,
        payload: np.ndarray | Mapping[str, np.ndarray],
        *,
        kind: str = "gradient",
        loss: float | None = None,
        num_samples: int | None = None,
        base_version: int | None = None,
        buffer_delta: np.ndarray | Mapping[str, np.ndarray] | None = None,
    ) -> CommitResult:
        """Send a gradient (the server applies -eta*g) or an update (applied as given).

        `payload` is a flat float32 vector in spec order or a mapping by parameter name.
        `base_version` defaults to the version of the central variable last received.
        `buffer_delta`, for a model with buffers: how they changed since the central ones were
        last loaded (flat in buffer spec order, or by name); the server adds it to its buffers.
        Returns the new central variable and buffers (one round trip per step).
        """
        self._require_registered()
        assert self.central is not None
        kinds = {k.label: k for k in PayloadKind}
        if kind not in kinds:
            raise ValueError(f"kind must be one of {', '.join(kinds)}, not {kind!r}")
        payload_kind = kinds[kind]
        flat = flatten(payload) if isinstance(payload, Mapping) else np.asarray(payload, dtype=np.float32)
        flat = flat.reshape(-1)
        data = wire_view(flat, self.wire_dtype)  # float32: a view of `flat`, not a copy
        streamed = self._streams(len(data))
        base = self.central.version if base_version is None else base_version
        delta = None
        if buffer_delta is not None:
            delta = flatten(buffer_delta) if isinstance(buffer_delta, Mapping) else np.asarray(buffer_delta, np.float32)
        # Every attempt of this commit (retries, after registering again) carries the same id,
        # so the server applies it at most once.
        request_id = uuid.uuid4().hex

        def send() -> tuple[pb.CommitResponse, np.ndarray]:
            request = serde.commit_request(
                worker_id=self._worker_id(),
                base_version=base,
                kind=payload_kind,
                wire_dtype=self.wire_dtype,
                num_parameters=flat.size,
                data=data,
                loss=loss,
                num_samples=num_samples,
                request_id=request_id,
                streamed=streamed,
                buffer_delta=delta,
            )
            if streamed:
                return self._call(self._commit_streamed, (request, data))
            return serde.commit_reply(self._call(self._commit_raw, request))

        def after_reregistration(registration: Registration) -> None:
            nonlocal base  # the server may have restarted with an older version
            base = min(base, registration.version)

        reply, parameters = self._with_reregistration(send, after_reregistration)
        self.central = self._central(reply.version, parameters, serde.buffers_from_proto(reply))
        return serde.commit_result_from_proto(reply, self.central)

    def _commit_streamed(
        self, call: tuple[bytes, bytes | memoryview], timeout: float, metadata: tuple[tuple[str, str], ...]
    ) -> tuple[pb.CommitResponse, np.ndarray]:
        """One CommitStream attempt: the header, the payload in pieces; the reply likewise."""
        header_frame, data = call
        frames = itertools.chain((header_frame,), data_frames(data, self.chunk_bytes))
        replies = iter(self._commit_stream(frames, timeout=timeout, metadata=metadata))
        header = pb.CommitResponseChunk.FromString(next(replies)).header
        return header, _read_pieces(header.parameters, replies, pb.CommitResponseChunk)

    def _pull_streamed(
        self, request: bytes, timeout: float, metadata: tuple[tuple[str, str], ...]
    ) -> tuple[pb.PullResponse, np.ndarray | None]:
        """One PullStream attempt: the header, then (unless unchanged) θ in pieces."""
        replies = iter(self._pull_stream(request, timeout=timeout, metadata=metadata))
        header = pb.PullResponseChunk.FromString(next(replies)).header
        if header.unchanged:
            return header, None
        return header, _read_pieces(header.parameters, replies, pb.PullResponseChunk)

    def leave(self) -> None:
        """Leave cleanly; the server frees this worker's state and shard."""
        if self.registration is None:
            return
        with contextlib.suppress(errors.WorkerNotFoundError):  # already evicted: nothing to free
            self._call(self._stub.Leave, pb.LeaveRequest(worker_id=self.registration.worker_id))
        self.registration = None

    def report_evaluation(
        self, version: int, loss: float, accuracy: float, num_samples: int, dataset: str = ""
    ) -> None:
        """Report held-out figures of the central variable at `version` (for evaluators)."""
        report = shared.evaluation_to_proto(Evaluation(version, loss, accuracy, num_samples, dataset))
        self._call(self._stub.ReportEvaluation, report)

    def status(self) -> ServerStatus:
        return shared.status_from_proto(self._call(self._stub.Status, pb.StatusRequest()))

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        try:
            self.leave()
        except errors.GempsError as error:
            log.warning("leave failed while closing: %s", error)
        finally:
            self.close()

    @property
    def worker_id(self) -> str | None:
        return self.registration.worker_id if self.registration else None

    @property
    def spec(self) -> tuple[ParameterSpec, ...]:
        return self._spec

    @property
    def buffer_spec(self) -> tuple[ParameterSpec, ...]:
        return self._buffer_spec

    # -- internals -----------------------------------------------------------------------------

    def _central(self, version: int, flat: np.ndarray, buffers: np.ndarray | None) -> CentralVariable:
        """A central variable received; `buffers` None keeps the ones held (replies leave them out
        for a model without buffers)."""
        if buffers is None:
            buffers = self.central.buffers if self.central is not None else self._registered_buffers
        return CentralVariable(version, flat, self._spec, buffers, self._buffer_spec)

    def _register(self, initial: np.ndarray, initial_buffers: np.ndarray) -> Registration:
        def send(
            values: np.ndarray | None, omit_parameters: bool = False
        ) -> tuple[Registration, np.ndarray | None, np.ndarray | None]:
            request = serde.register_request(
                self._spec,
                self.name,
                values,
                omit_parameters=omit_parameters,
                buffer_spec=self._buffer_spec,
                buffers=initial_buffers,
                client_id=self.client_id,
            )
            return serde.register_reply(self._call(self._register_raw, request))

        if initial.nbytes <= STREAM_THRESHOLD_BYTES:
            registration, theta, buffers = send(initial)
        else:
            # Large: without the initial values first. Only the first worker of a server needs to
            # send them; 100 workers registering at once would otherwise send 100 copies of P
            # floats, and receive 100 more: θ comes by PullStream instead, in pieces.
            streamed = self._streams(initial.nbytes)
            try:
                registration, theta, buffers = send(None, omit_parameters=streamed)
            except errors.GempsError as error:
                if error.reason != Reason.NOT_INITIALIZED:
                    raise
                # Ours initialise θ, unless another worker's got there first.
                registration, theta, buffers = send(initial, omit_parameters=streamed)
            if streamed and not registration.initialized_central:  # θ is another worker's: read it
                self.registration = registration
                self.central = None
                self.pull()
                return registration
        self.registration = registration
        # No parameters in the reply: ours initialised the central variable, which equals them.
        flat = initial.reshape(-1) if theta is None else theta
        self.central = CentralVariable(
            registration.version, flat, self._spec, initial_buffers if buffers is None else buffers, self._buffer_spec
        )
        return self.registration

    def _with_reregistration(
        self, call: Callable[[], T], on_reregistered: Callable[[Registration], None] | None = None
    ) -> T:
        """Run `call`; if the server forgot us, register again (once) and repeat it."""
        try:
            return call()
        except errors.GempsError as error:
            if not errors.server_forgot_worker(error):
                raise
            log.warning("server forgot worker %s (%s); registering again", self._worker_id(), error.message)
        # Our newest copy of the central variable re-initialises a server that lost its state.
        initial = self.central.flat if self.central is not None else flatten(self._registered_with or {})
        buffers = self.central.buffers if self.central is not None else self._registered_buffers
        registration = self._register(initial, buffers)
        if on_reregistered is not None:
            on_reregistered(registration)
        return call()

    def _call(self, method: Callable[..., T], request: object) -> T:
        """Call with a deadline, retrying UNAVAILABLE and DEADLINE_EXCEEDED with backoff; raise typed errors."""
        delays = self.retry.delays()
        self._retrying: errors.GempsError | None = None
        while True:
            try:
                return method(request, timeout=self.timeout, metadata=self._metadata)
            except grpc.RpcError as rpc_error:
                error = errors.from_rpc_error(rpc_error)
            if not isinstance(error, RETRIED):
                raise error
            delay = next(delays, None)
            if delay is None:
                raise type(error)(
                    f"{self.target} unreachable after {self.retry.max_attempts} attempts: {error.message}",
                    error.code,
                    error.reason,
                )
            self.retries += 1
            # The first retry of a call is worth a line: the user sees why nothing happens.
            log.log(
                logging.INFO if self._retrying is None else logging.DEBUG, "%s; retrying in %.2fs", error.message, delay
            )
            self._retrying = error
            if self._stop is not None and self._stop.wait(delay):
                raise errors.StoppedError(f"stopped while retrying {self.target}: {error.message}", error.code)
            if self._stop is None:
                time.sleep(delay)

    def _streams(self, nbytes: int) -> bool:
        """Whether θ-sized messages of `nbytes` go in pieces (CommitStream, PullStream)."""
        return self.streaming == "always" or (self.streaming == "auto" and nbytes > STREAM_THRESHOLD_BYTES)

    def _num_parameters(self) -> int:
        return sum(num_elements(entry.shape) for entry in self._spec)

    def _require_registered(self) -> None:
        if self.registration is None:
            raise errors.NotRegisteredError("call register() before pull() or commit()")

    def _worker_id(self) -> str:
        return self.registration.worker_id if self.registration else ""


def _read_pieces(parameters: pb.Tensor, replies: Iterator[bytes], chunk_class: type[ChunkMessage]) -> np.ndarray:
    """A streamed reply's θ: the data pieces after its header, which announced dtype and shape."""
    assembler = PayloadAssembler(expected_nbytes(parameters.dtype, parameters.shape))
    for message in replies:
        piece = read_data(message)
        assembler.add(piece if piece is not None else chunk_class.FromString(message).data)
    return decode(parameters.dtype, tuple(parameters.shape), assembler.result())
