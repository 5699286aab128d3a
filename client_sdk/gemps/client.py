"""The synchronous gemps client: register, pull, commit, leave, status.

θ may be partitioned across several server processes (docs/ARCHITECTURE.md): the client is
given one address, learns the layout from that server's Register (or Status) reply, and then
sends each commit's slices to their partitions concurrently (gRPC futures and streams, no thread
of ours per partition), tracks each partition's version, and assembles θ from the replies.

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
from typing import Any, TypeVar

import grpc
import numpy as np

from gemps import errors, serde
from gemps.connection import Connection, Pem
from gemps.endpoint import Endpoint, resolve_address
from gemps.records import (
    CentralVariable,
    CommitResult,
    Evaluation,
    Layout,
    ParameterSpec,
    Registration,
    ServerStatus,
)
from gemps.retry import RetryPolicy
from gemps_proto import serde as shared
from gemps_proto.codec import WIRE_DTYPE_NAMES, decode, expected_nbytes, num_elements, wire_view
from gemps_proto.framing import DEFAULT_CHUNK_BYTES, PayloadAssembler, data_frames, read_data
from gemps_proto.reasons import Reason
from gemps_proto.schema import PayloadKind, flatten, spec_of
from gemps_proto.v1 import parameter_server_pb2 as pb

log = logging.getLogger("gemps.client")

T = TypeVar("T")
ChunkMessage = TypeVar("ChunkMessage", pb.CommitResponseChunk, pb.PullResponseChunk)

# Failures worth another attempt: the server is down, restarting, paused or overloaded.
RETRIED = (errors.ServerUnavailableError, errors.DeadlineExceededError, errors.ServerBusyError)

# Payloads past this many bytes go through CommitStream (and θ through PullStream) by default:
# the server holds a few θ-sized buffers for streams however many clients commit at once, where
# every unary commit in flight holds its request and its reply (1M parameters, 100 clients:
# 2.1 GB against 0.9 GB); gRPC Python's synchronous client reads a large unary reply slowly (at
# 10M parameters, half the rate of the same reply in pieces); past 2 GiB one message cannot carry
# it. docs/PERFORMANCE.md has the measurements.
STREAM_THRESHOLD_BYTES = 1 << 20
STREAMING_CHOICES = ("auto", "always", "never")
Metadata = tuple[tuple[str, str], ...]
PullReply = tuple[pb.PullResponse, np.ndarray | None]
CommitReply = tuple[pb.CommitResponse, np.ndarray]


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
        of `chunk_bytes`; "always"; "never". With a partitioned server, per partition."""
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
        # This client's identity at every registration: the server deduplicates its commits by
        # (client_id, request_id), also after it registers again, and keeps one registration of it.
        self.client_id = uuid.uuid4().hex
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
        self._max_message_bytes = min(max_message_mb * 1024 * 1024, 2**31 - 1)
        self._metadata: Metadata = self.connection.metadata
        # The server at `target`, then (when θ is partitioned) the others, in θ order.
        self._endpoints = [Endpoint(target, self.connection, self._max_message_bytes)]
        #: attempts retried after UNAVAILABLE or DEADLINE_EXCEEDED, over this client's life
        self.retries = 0
        self._registered_with: Mapping[str, np.ndarray] | None = None
        self._spec: tuple[ParameterSpec, ...] = ()
        self._buffer_spec: tuple[ParameterSpec, ...] = ()
        self._registered_buffers = np.empty(0, dtype=np.float32)
        self._buffers = self._registered_buffers  # the newest central buffers received (partition 0's)
        self.layout: Layout | None = None  # how θ is partitioned; None: one server holds it all
        self.central: CentralVariable | None = None  # the newest central variable received

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
        self._registered_buffers = self._buffers = flatten(named_buffers)
        initial = flatten(self._registered_with)
        for endpoint in self._endpoints:  # the first tells the layout (and adds the others)
            self._register_at(endpoint, initial, self._registered_buffers)
        self.central = self._assemble()
        assert self.registration is not None
        return self.registration

    def pull(self) -> CentralVariable:
        """The newest central variable (no payload is sent when ours is already current).

        Works without registering too (an observer such as an evaluator): such a read-only
        pull holds no lease and takes the parameter spec from the server's Status.
        """
        if self.registration is None and not self._spec:
            status = self.status()
            self._spec, self._buffer_spec = status.spec, status.buffer_spec
            self._adopt(status.layout)
        replies = self._fan_out(self._begin_pull, self._pull_at)
        changed = False
        for endpoint, (reply, parameters) in zip(self._endpoints, replies, strict=True):
            if parameters is not None:
                self._received(endpoint, reply.version, parameters, reply)
                changed = True
        if changed or self.central is None:
            self.central = self._assemble()
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
        `base_version` defaults to the version of the central variable last received (with
        partitions, partition 0's: the others' are taken as many versions behind their own).
        `buffer_delta`, for a model with buffers: how they changed since the central ones were
        last loaded (flat in buffer spec order, or by name); the server adds it to its buffers.
        Returns the new central variable and buffers (one round trip per step). With partitions,
        the slices are applied independently: complete when every partition has applied its own.
        """
        self._require_registered()
        assert self.central is not None
        kinds = {k.label: k for k in PayloadKind}
        if kind not in kinds:
            raise ValueError(f"kind must be one of {', '.join(kinds)}, not {kind!r}")
        payload_kind = kinds[kind]
        flat = flatten(payload) if isinstance(payload, Mapping) else np.asarray(payload, dtype=np.float32)
        flat = flat.reshape(-1)
        if self.layout is not None and flat.size != self.layout.num_parameters:
            raise errors.InvalidArgumentError(
                f"payload has {flat.size} values but the central variable has {self.layout.num_parameters}",
                grpc.StatusCode.INVALID_ARGUMENT,
                Reason.BAD_SHAPE,
            )
        # float32: views of `flat`, not copies. One endpoint: all of `flat` (the server checks its size).
        slices = [flat] if self.layout is None else [flat[e.start : e.stop] for e in self._endpoints]
        data = {id(e): wire_view(part, self.wire_dtype) for e, part in zip(self._endpoints, slices, strict=True)}
        behind = None if base_version is None else self.central.version - base_version
        bases = {id(e): e.version if behind is None else max(0, e.version - behind) for e in self._endpoints}
        delta = None
        if buffer_delta is not None:
            delta = flatten(buffer_delta) if isinstance(buffer_delta, Mapping) else np.asarray(buffer_delta, np.float32)
        # Every attempt of this commit (retries, after registering again) carries the same id,
        # so each server applies it at most once.
        request_id = uuid.uuid4().hex

        def request(endpoint: Endpoint) -> tuple[bytes, bytes | memoryview, bool]:
            payload_bytes = data[id(endpoint)]
            streamed = self._streams(len(payload_bytes))
            header = serde.commit_request(
                worker_id=endpoint.worker_id,
                base_version=bases[id(endpoint)],
                kind=payload_kind,
                wire_dtype=self.wire_dtype,
                num_parameters=len(payload_bytes) // expected_nbytes(self.wire_dtype, [1]),
                data=payload_bytes,
                loss=loss,
                num_samples=num_samples,
                request_id=request_id,
                streamed=streamed,
                buffer_delta=delta if endpoint is self._endpoints[0] else None,
            )
            return header, payload_bytes, streamed

        def begin(endpoint: Endpoint) -> Callable[[], CommitReply]:
            header, payload_bytes, streamed = request(endpoint)
            if streamed:
                replies = self._start_commit_stream(endpoint, header, payload_bytes, self.timeout, self._metadata)
                return lambda: _read_commit_stream(replies)
            future = endpoint.commit.future(header, timeout=self.timeout, metadata=self._metadata)
            return lambda: serde.commit_reply(future.result())

        def blocking(endpoint: Endpoint) -> CommitReply:
            def send() -> CommitReply:
                header, payload_bytes, streamed = request(endpoint)
                if streamed:
                    return self._call(self._commit_streamed_at(endpoint), (header, payload_bytes))
                return serde.commit_reply(self._call(endpoint.commit, header))

            def after_reregistration(registration: Registration) -> None:
                # The server may have restarted with an older version.
                bases[id(endpoint)] = min(bases[id(endpoint)], registration.version)

            return self._with_reregistration(endpoint, send, after_reregistration)

        replies = self._fan_out(begin, blocking)
        for endpoint, (reply, parameters) in zip(self._endpoints, replies, strict=True):
            self._received(endpoint, reply.version, parameters, reply)
        self.central = self._assemble()
        headers = [reply for reply, _ in replies]
        return serde.commit_result_from_proto(headers, [e.size for e in self._endpoints], self.central)

    def leave(self) -> None:
        """Leave cleanly; the server frees this worker's state and shard (each partition's)."""
        for endpoint in self._endpoints:
            if endpoint.registration is None:
                continue
            with contextlib.suppress(errors.WorkerNotFoundError):  # already evicted: nothing to free
                self._call(endpoint.stub.Leave, pb.LeaveRequest(worker_id=endpoint.worker_id))
            endpoint.registration = None

    def report_evaluation(
        self, version: int, loss: float, accuracy: float, num_samples: int, dataset: str = ""
    ) -> None:
        """Report held-out figures of the central variable at `version` (for evaluators; with
        partitions, partition 0's version, to partition 0)."""
        report = shared.evaluation_to_proto(Evaluation(version, loss, accuracy, num_samples, dataset))
        self._call(self._endpoints[0].stub.ReportEvaluation, report)

    def status(self) -> ServerStatus:
        """The server's status (with partitions: partition 0's, whose `layout` lists them all)."""
        return shared.status_from_proto(self._call(self._endpoints[0].stub.Status, pb.StatusRequest()))

    def statuses(self) -> list[ServerStatus]:
        """Every partition's status, in θ order (one item when θ is not partitioned)."""
        first = self.status()
        self._adopt(first.layout)
        rest = [shared.status_from_proto(self._call(e.stub.Status, pb.StatusRequest())) for e in self._endpoints[1:]]
        return [first, *rest]

    def close(self) -> None:
        for endpoint in self._endpoints:
            endpoint.close()

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
    def registration(self) -> Registration | None:
        """This worker's registration (with partitions: partition 0's, which gives the shard)."""
        return self._endpoints[0].registration

    @property
    def worker_id(self) -> str | None:
        return self.registration.worker_id if self.registration else None

    @property
    def spec(self) -> tuple[ParameterSpec, ...]:
        return self._spec

    @property
    def buffer_spec(self) -> tuple[ParameterSpec, ...]:
        return self._buffer_spec

    @property
    def targets(self) -> list[str]:
        """The address of each server this client talks to, in θ order."""
        return [endpoint.target for endpoint in self._endpoints]

    # -- internals -----------------------------------------------------------------------------

    def _adopt(self, layout: Layout | None) -> None:
        """Take the layout a server announced: each endpoint's range, and channels to partitions
        not reached yet (addresses relative to the one this client was given)."""
        if layout is None:
            self._endpoints[0].start, self._endpoints[0].stop = 0, self._num_parameters()
            return
        if self.layout is None:
            for partition in layout.partitions[len(self._endpoints) :]:
                address = resolve_address(partition.address, self.target)
                self._endpoints.append(Endpoint(address, self.connection, self._max_message_bytes))
        elif len(layout.partitions) != len(self._endpoints):
            raise errors.FailedPreconditionError(
                f"{self.target} now has {len(layout.partitions)} partitions, not {len(self._endpoints)}: "
                "a partitioned server cannot change its partition count while clients use it",
                grpc.StatusCode.FAILED_PRECONDITION,
            )
        for endpoint, partition in zip(self._endpoints, layout.partitions, strict=True):
            endpoint.start, endpoint.stop = partition.start, partition.stop
        self.layout = layout

    def _assemble(self) -> CentralVariable:
        """The central variable from the slices held (one server: its θ as received, no copy)."""
        endpoints = self._endpoints
        if len(endpoints) == 1:
            flat = endpoints[0].flat
        else:
            flat = np.concatenate([endpoint.flat for endpoint in endpoints])
            flat.flags.writeable = False  # like a single server's, which is a view of the reply
        versions = tuple(endpoint.version for endpoint in endpoints)
        return CentralVariable(versions[0], flat, self._spec, self._buffers, self._buffer_spec, versions)

    def _received(
        self,
        endpoint: Endpoint,
        version: int,
        flat: np.ndarray,
        reply: pb.RegisterResponse | pb.PullResponse | pb.CommitResponse | None = None,
    ) -> None:
        """A slice of θ (and from partition 0, maybe the buffers) received from `endpoint`."""
        endpoint.version, endpoint.flat = version, flat.reshape(-1)
        if isinstance(reply, pb.PullResponse) and reply.history:
            endpoint.history = reply.history
        buffers = serde.buffers_from_proto(reply) if reply is not None else None
        if buffers is not None:  # replies leave them out for a model without buffers
            self._buffers = buffers

    def _register_at(self, endpoint: Endpoint, initial: np.ndarray, initial_buffers: np.ndarray) -> None:
        """Register with one server: the first with all of θ, the others with their slice (the
        first's reply tells the layout). Sets the endpoint's registration and slice of θ."""
        first = endpoint is self._endpoints[0]
        if not first:
            initial = initial[endpoint.start : endpoint.stop]
        buffer_spec = self._buffer_spec if first else ()

        def send(
            values: np.ndarray | None, omit_parameters: bool = False, streamed: bool = False
        ) -> tuple[Registration, Any, Any]:
            request = serde.register_request(
                self._spec,
                self.name,
                values,
                omit_parameters=omit_parameters,
                buffer_spec=buffer_spec,
                buffers=initial_buffers if first and values is not None else None,  # with θ's, or not at all
                client_id=self.client_id,
                streamed=streamed,
            )
            if not streamed:
                return serde.register_reply(self._call(endpoint.register, request))
            assert values is not None
            data = serde.register_stream_data(values, buffer_spec, initial_buffers if first else None)
            return serde.register_reply(self._call(self._register_streamed_at(endpoint), (request, data)))

        pull_next = False
        nbytes = initial.nbytes + (initial_buffers.nbytes if first else 0)
        if nbytes <= STREAM_THRESHOLD_BYTES:
            registration, theta, buffers = send(initial)
        else:
            # Large: without the initial values first. Only the first worker of a server needs to
            # send them; 100 workers registering at once would otherwise send 100 copies of P
            # floats, and receive 100 more: θ comes by PullStream instead, in pieces.
            streamed = self._streams(nbytes)
            try:
                registration, theta, buffers = send(None, omit_parameters=streamed)
            except errors.GempsError as error:
                if error.reason != Reason.NOT_INITIALIZED:
                    raise
                # Ours initialise θ, unless another worker's got there first; streamed, in
                # pieces: the server accepts messages of --max-message-mb at most.
                registration, theta, buffers = send(initial, omit_parameters=streamed, streamed=streamed)
            pull_next = streamed and not registration.initialized_central  # θ is another worker's
        endpoint.registration = registration
        if first:
            self._adopt(registration.layout)
        if buffers is not None:
            self._buffers = buffers
        if pull_next:
            endpoint.version = -1
            reply, parameters = self._pull_at(endpoint)
            assert parameters is not None
            self._received(endpoint, reply.version, parameters, reply)
            return
        # No parameters in the reply: ours initialised the central variable, which equals them.
        mine = initial if initial.size == endpoint.size else initial[endpoint.start : endpoint.stop]
        self._received(endpoint, registration.version, mine if theta is None else theta)

    def _pull_request(self, endpoint: Endpoint) -> tuple[bytes, bool]:
        """A Pull of one server's slice, and whether it goes by PullStream."""
        request = serde.pull_request(endpoint.worker_id, endpoint.version, self.wire_dtype, endpoint.history)
        return request, self._streams(expected_nbytes(self.wire_dtype, [endpoint.size]))

    def _begin_pull(self, endpoint: Endpoint) -> Callable[[], PullReply]:
        request, streamed = self._pull_request(endpoint)
        if streamed:
            replies = iter(endpoint.pull_stream(request, timeout=self.timeout, metadata=self._metadata))
            return lambda: _read_pull_stream(replies)
        future = endpoint.pull.future(request, timeout=self.timeout, metadata=self._metadata)
        return lambda: serde.pull_reply(future.result())

    def _pull_at(self, endpoint: Endpoint) -> PullReply:
        """Pull one server's slice, with retries (and registering again if it forgot us)."""

        def send() -> PullReply:
            request, streamed = self._pull_request(endpoint)  # after registering again: the new worker id
            if streamed:
                return self._call(self._pull_streamed_at(endpoint), request)
            return serde.pull_reply(self._call(endpoint.pull, request))

        return send() if endpoint.registration is None else self._with_reregistration(endpoint, send)

    def _pull_streamed_at(self, endpoint: Endpoint) -> Callable[[bytes, float, Metadata], PullReply]:
        def attempt(request: bytes, timeout: float, metadata: Metadata) -> PullReply:
            """One PullStream attempt: the header, then (unless unchanged) θ in pieces."""
            return _read_pull_stream(iter(endpoint.pull_stream(request, timeout=timeout, metadata=metadata)))

        return attempt

    def _register_streamed_at(
        self, endpoint: Endpoint
    ) -> Callable[[tuple[bytes, list[bytes | memoryview]], float, Metadata], bytes]:
        def attempt(call: tuple[bytes, list[bytes | memoryview]], timeout: float, metadata: Metadata) -> bytes:
            """One RegisterStream attempt: the header, then the initial values in pieces."""
            header, parts = call
            frames = itertools.chain((header,), *(data_frames(part, self.chunk_bytes) for part in parts))
            return endpoint.register_stream(frames, timeout=timeout, metadata=metadata)

        return attempt

    def _commit_streamed_at(
        self, endpoint: Endpoint
    ) -> Callable[[tuple[bytes, bytes | memoryview], float, Metadata], CommitReply]:
        def attempt(call: tuple[bytes, bytes | memoryview], timeout: float, metadata: Metadata) -> CommitReply:
            """One CommitStream attempt: the header, the payload in pieces; the reply likewise."""
            header, data = call
            return _read_commit_stream(self._start_commit_stream(endpoint, header, data, timeout, metadata))

        return attempt

    def _start_commit_stream(
        self, endpoint: Endpoint, header: bytes, data: bytes | memoryview, timeout: float, metadata: Metadata
    ) -> Iterator[bytes]:
        frames = itertools.chain((header,), data_frames(data, self.chunk_bytes))
        return iter(endpoint.commit_stream(frames, timeout=timeout, metadata=metadata))

    def _fan_out(self, begin: Callable[[Endpoint], Callable[[], T]], blocking: Callable[[Endpoint], T]) -> list[T]:
        """One call per server, concurrently: start them all (gRPC futures and streams run them),
        then wait for each. A call that failed in a way worth retrying is done again with
        `blocking` (backoff, registering again); other failures are raised. One server: `blocking`."""
        if len(self._endpoints) == 1:
            return [blocking(self._endpoints[0])]
        finishers = [begin(endpoint) for endpoint in self._endpoints]
        results = []
        for endpoint, finish in zip(self._endpoints, finishers, strict=True):
            try:
                results.append(finish())
            except grpc.RpcError as rpc_error:
                error = errors.from_rpc_error(rpc_error)
                if not isinstance(error, RETRIED) and not errors.server_forgot_worker(error):
                    raise error from None
                results.append(blocking(endpoint))
        return results

    def _with_reregistration(
        self,
        endpoint: Endpoint,
        call: Callable[[], T],
        on_reregistered: Callable[[Registration], None] | None = None,
    ) -> T:
        """Run `call` against `endpoint`; if that server forgot us, register there again (once)
        and repeat it."""
        try:
            return call()
        except errors.GempsError as error:
            if not errors.server_forgot_worker(error):
                raise
            log.warning(
                "%s forgot worker %s (%s); registering again", endpoint.target, endpoint.worker_id, error.message
            )
        # Our newest copy of the central variable re-initialises a server that lost its state.
        initial = self.central.flat if self.central is not None else flatten(self._registered_with or {})
        self._register_at(endpoint, initial, self._buffers)
        assert endpoint.registration is not None
        if on_reregistered is not None:
            on_reregistered(endpoint.registration)
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


def _read_pull_stream(replies: Iterator[bytes]) -> PullReply:
    header = pb.PullResponseChunk.FromString(next(replies)).header
    if header.unchanged:
        return header, None
    return header, _read_pieces(header.parameters, replies, pb.PullResponseChunk)


def _read_commit_stream(replies: Iterator[bytes]) -> CommitReply:
    header = pb.CommitResponseChunk.FromString(next(replies)).header
    return header, _read_pieces(header.parameters, replies, pb.CommitResponseChunk)


def _read_pieces(parameters: pb.Tensor, replies: Iterator[bytes], chunk_class: type[ChunkMessage]) -> np.ndarray:
    """A streamed reply's θ: the data pieces after its header, which announced dtype and shape."""
    assembler = PayloadAssembler(expected_nbytes(parameters.dtype, parameters.shape))
    for message in replies:
        piece = read_data(message)
        assembler.add(piece if piece is not None else chunk_class.FromString(message).data)
    return decode(parameters.dtype, tuple(parameters.shape), assembler.result())
