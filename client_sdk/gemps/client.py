"""The synchronous gemps client: register, pull, commit, leave, status.

The client composes a partition router (`gemps.router`: one session per server process, θ
assembled from their slices) and a transport per server process: gRPC (`gemps.grpc_transport`),
with commits and pulls on the server's data plane by default (`gemps.data_plane_transport`). θ may
be partitioned across several server processes (docs/ARCHITECTURE.md): the client is given one
address and learns the rest from that server.

Every call has a deadline, its `timeout`, which bounds the whole call: its attempts, the waits
between them, registering again and the data plane's fallbacks. Retries UNAVAILABLE and
DEADLINE_EXCEEDED with exponential backoff and jitter, re-registers transparently when the server
has forgotten this worker (lease expiry, server restart), never has one commit applied twice (each
commit carries a request id that its retries reuse; the server deduplicates), and raises typed
GempsError subclasses instead of raw grpc errors. TLS (optionally with a client certificate) and a
bearer token come from arguments or GEMPS_* environment variables: reference workers in containers
need no code.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from gemps import at_exit, errors, named_payloads
from gemps.channel_security import ChannelSecurity, Pem
from gemps.compression import Compressor
from gemps.data_plane_transport import DataPlaneTransport
from gemps.grpc_transport import GrpcTransport
from gemps.metrics import client_metrics
from gemps.records import (
    Buffers,
    CentralVariable,
    CommitResult,
    Evaluation,
    GradientNoise,
    GradientSums,
    Layout,
    ParameterSpec,
    Registration,
    ServerStatus,
)
from gemps.resolver import Target, as_resolver
from gemps.retry import NO_RETRY, Retrier, RetryPolicy, resolve_patience
from gemps.rounds import RoundWaits, check_pull_wait, longest_hold, waits_for_round
from gemps.router import PartitionRouter
from gemps.serialised import serialised
from gemps.stop_grace import StopGrace
from gemps.transport import Transport, call_deadline, refuse_non_finite
from gemps.wire_options import check_wire_options, resolve_plane, resolve_shared_memory
from gemps_proto import vectors
from gemps_proto.grpc_framing import DEFAULT_CHUNK_BYTES
from gemps_proto.jobs import check_job
from gemps_proto.reasons import Reason
from gemps_proto.reply_differences import REPLY_COMPRESSIONS
from gemps_proto.schema import PayloadKind, buffer_numbers, buffer_spec_of, flatten, spec_of
from gemps_proto.tensor_codec import WIRE_DTYPE_NAMES
from gemps_proto.vectors import ArrayLike

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

log = logging.getLogger("gemps.client")

PAYLOAD_KINDS = {kind.label: kind for kind in PayloadKind}
# An attempt's bound when the call's `timeout` is the default (that call's bound until issue 43).
ATTEMPT_SECONDS = 60.0


class Client:
    """A connection to a gemps server, for one worker; safe to share between threads.

    Its calls are serialised (`gemps.serialised`): one runs at a time, the others wait for it, so
    every answer is its own call's and a commit reported refused was not applied, on every plane.
    Serialised rather than refused from a second thread: a trainer's loader or evaluator thread
    may pull or read the status beside its committing thread, and one call's round trip at a time
    is what one worker's connection carries anyway (for overlapping I/O: `gemps.aio`).

    >>> with Client("127.0.0.1:50051") as client:
    ...     client.register({"w": np.zeros((3, 2), np.float32)})
    ...     result = client.commit({"w": np.ones((3, 2), np.float32)}, loss=0.7)
    """

    def __init__(
        self,
        target: Target = "127.0.0.1:50051",
        *,
        name: str = "",
        timeout: float | None = None,
        attempt_timeout: float | None = None,
        retry: RetryPolicy | None = None,
        patience: float | None = None,
        max_message_mb: int = 512,
        token: str | None = None,
        tls: bool | None = None,
        ca_cert: Pem | None = None,
        client_cert: Pem | None = None,
        client_key: Pem | None = None,
        server_name: str | None = None,
        stop: threading.Event | None = None,
        wire_dtype: str = "float32",
        compression: str | None = None,
        reply_compression: str | None = None,
        streaming: str = "auto",
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        plane: str | None = None,
        shared_memory: bool | None = None,
        connect: Callable[[str], Transport] | None = None,
        metrics_registry: CollectorRegistry | None = None,
        job: str = "",
    ) -> None:
        """`patience` is how long, in seconds, a call goes on retrying a server that does not answer
        (down, restarting, failing over, busy) before it raises the last failure, naming this option
        (default: GEMPS_PATIENCE, else 300 s, which outlasts a server's restart). `timeout` bounds each
        call as a whole, in seconds (default: `patience` + 60): its attempts, the waits to retry them,
        registering again and falling back to gRPC all count, and so does waiting for another thread's
        call of this client; once it is spent the call raises DeadlineExceededError (with the last
        failure's message), whatever `retry` or `patience` would still allow. `attempt_timeout` bounds
        each attempt within it (None: the whole `timeout` when given, else 60), so that an attempt a
        server leaves unanswered (a paused process) is retried while the call has time left. `retry`
        spaces the retries (and may cap their number). TLS and token arguments left out come from
        GEMPS_* environment variables (see `ChannelSecurity`); PEM arguments are paths or bytes.
        Setting `stop` (e.g. from a SIGTERM handler) ends a wait to retry with StoppedError, and a call
        still in flight 10 s later too (gemps.stop_grace: a server that hangs).

        `wire_dtype` is how commits and replies travel: "float32", or "bfloat16" (half the bytes;
        values rounded to bfloat16 both ways, the central variable stays float32). `compression` sends
        commits in fewer bytes: "int8" (a quarter of float32's) or "int4" (an eighth), a scale per 256
        values, or "topk" (each 256 values' 16 largest in int8: a 28th); what the codes round away or
        leave out is added to the next commit (error feedback, gemps.compression). None: commits in
        `wire_dtype`. `reply_compression` has commit replies send only what changed: "int8" or "int4"
        codes of the difference between θ and the copy of θ this client holds, which both ends keep in
        bfloat16 values and move alike (gemps_proto.reply_differences); θ whole in bfloat16 on the
        first commit and after a lost reply, a new registration or a failover. What commits return is
        then that copy. Registrations and pulls still carry θ whole. None: replies in `wire_dtype`.
        `streaming` picks Commit or CommitStream: "auto" streams payloads past 1 MiB in pieces
        of `chunk_bytes`; "always"; "never". With a partitioned server, per partition.

        `plane` is how commits and pulls travel (DESIGN §3c): "auto" (the default, or
        GEMPS_PLANE) on the data plane a server offers at Register when its port can be reached,
        else gRPC; "data" only the data plane (raise when a server offers none or it cannot be
        reached); "grpc" only gRPC. Register, Status and Leave always go by gRPC. On the server's
        host the data plane goes through its local socket and shared memory, so θ crosses no
        socket; `shared_memory` False (or GEMPS_SHARED_MEMORY=off) keeps it on TCP.

        `target` is where the server is: "host:port" (the simple default), or, for a server that
        can move to another machine, a callable returning that or a `gemps.resolver.Resolver`, asked
        again when it stops answering (other partitions are found again through partition 0's layout).

        `connect` opens the transport to the server process at an address (default: `plane`'s).

        `metrics_registry`, a prometheus_client CollectorRegistry: the client's own metrics go
        there (commit latency, θ's bytes sent and received, retries: gemps.metrics).

        `job` names the job this worker trains (1-64 of [A-Za-z0-9_-]; the same for all its
        workers): a server whose θ is another job's refuses it from the first registration on, and
        the first worker's names a new θ. "" (the default): the job most of a replica list holds,
        else the first server's to register this client (gemps.job_vote; DESIGN §3d)."""
        check_wire_options(wire_dtype, streaming, chunk_bytes, compression, reply_compression)
        self.plane = resolve_plane(plane)
        self.shared_memory = resolve_shared_memory(shared_memory)
        self.wire_dtype = WIRE_DTYPE_NAMES[wire_dtype]
        self.streaming = streaming
        self.chunk_bytes = chunk_bytes
        resolver = as_resolver(target)
        self.name = name
        # This client's identity at every registration: the server deduplicates its commits by
        # (client_id, request_id), also after it registers again, and keeps one registration of it.
        self.client_id = uuid.uuid4().hex
        self.patience = resolve_patience(patience)
        if (timeout is not None and timeout <= 0) or (attempt_timeout is not None and attempt_timeout <= 0):
            raise ValueError(f"timeout and attempt_timeout must be > 0, not {timeout} and {attempt_timeout}")
        self.timeout = self.patience + ATTEMPT_SECONDS if timeout is None else timeout
        self.attempt_timeout = min(self.timeout, attempt_timeout or (ATTEMPT_SECONDS if timeout is None else timeout))
        self.retry = retry or RetryPolicy()
        self.security = ChannelSecurity.resolve(
            token=token,
            tls=tls,
            ca_cert=ca_cert,
            client_cert=client_cert,
            client_key=client_key,
            server_name=server_name,
        )
        self._calls = threading.RLock()  # held by each call (gemps.serialised)
        self._rounds = RoundWaits(hold=longest_hold(self.attempt_timeout))
        self._max_message_bytes = min(max_message_mb * 1024 * 1024, 2**31 - 1)
        self._retrier = Retrier("", self.retry, stop, self.patience)
        self._metrics = client_metrics(
            metrics_registry, self.wire_dtype, lambda: self._retrier.retries, lambda: self.shared_memory_fallbacks
        )
        connect = self._metrics.metered(connect or self._connect)  # θ's bytes counted, with metrics
        self._router = PartitionRouter(
            resolver,
            connect,
            self._retrier,
            worker_name=name,
            client_id=self.client_id,
            compressor=None if compression is None else Compressor(compression),
            reply_code=0 if reply_compression is None else REPLY_COMPRESSIONS[reply_compression],
            job=check_job(job),
        )
        self._retrier.target = self._router.target
        self._stop_grace = StopGrace(stop, self._router.interrupt, self._calls)

    def _connect(self, address: str) -> Transport:
        """The transport to one server process: gRPC, and its data plane unless plane="grpc"."""
        grpc = self._connect_grpc(address)
        if self.plane == "grpc":
            return grpc
        return DataPlaneTransport(grpc, self.security, mode=self.plane, shared_memory=self.shared_memory)

    def _connect_grpc(self, address: str) -> GrpcTransport:
        return GrpcTransport(
            address,
            self.security,
            max_message_bytes=self._max_message_bytes,
            timeout=self.attempt_timeout,  # and what is left of the call's `timeout` (gemps.transport)
            wire_dtype=self.wire_dtype,
            streaming=self.streaming,
            chunk_bytes=self.chunk_bytes,
        )

    # -- worker lifecycle ----------------------------------------------------------------------

    @serialised
    def register(
        self, parameters: Mapping[str, ArrayLike], buffers: Mapping[str, ArrayLike] | None = None
    ) -> Registration:
        """Announce this worker with its named initial parameters (in a fixed order), and the
        model's buffers if it has any (state that is not trained, e.g. batch-norm statistics).

        The first worker's values initialise the central variable and buffers; later workers must
        have the same names, shapes and buffer kinds, and receive the central ones instead. Integer
        buffers (batch norm's `num_batches_tracked`) are kept and carried as int64, exactly (a value
        int64 cannot hold: Int64RangeError, a ValueError naming the buffer, before anything is
        sent); the others as float32. A later worker listing the same entries in another order is refused
        (FailedPreconditionError naming the central variable's order): its flat payloads would
        be laid out in the other.
        """
        named = {k: vectors.as_float32(v) for k, v in parameters.items()}
        named_buffers = {k: buffer_numbers(k, v) for k, v in (buffers or {}).items()}
        spec, buffer_spec = spec_of(named), buffer_spec_of(named_buffers)
        try:
            self._router.register(spec, flatten(named), buffer_spec, Buffers.of(named_buffers, buffer_spec))
        except errors.FailedPreconditionError as refused:
            if refused.reason != Reason.SPEC_MISMATCH:
                raise
            server = self._router.status()
            raise named_payloads.explained(refused, (spec, buffer_spec), (server.spec, server.buffer_spec)) from None
        assert self.registration is not None
        at_exit.arm(self)  # leave at exit if the program does not (gemps.at_exit)
        if self.registration.shard.shared_with:  # more workers than shards: said in the worker's own log too
            log.warning("%s: %s", self.target, self.registration.shard.describe())
        return self.registration

    @serialised
    def pull(self, *, wait: float = 0.0) -> CentralVariable:
        """The newest central variable (no payload is sent when ours is already current).

        Works without registering too (an observer such as an evaluator): such a read-only
        pull holds no lease and takes the parameter spec from the server's Status.

        `wait`: seconds (at most 10, below `attempt_timeout`) the server may hold its reply while
        our θ is current, answering once a commit moves θ; 0: at once, as an older server does.
        """
        check_pull_wait(wait, self.attempt_timeout)
        return self._router.pull(wait)

    @waits_for_round  # outside the commit's deadline: each of the round's pulls has its own
    @serialised
    def commit(
        self,
        payload: ArrayLike | Mapping[str, ArrayLike],
        *,
        kind: str = "gradient",
        loss: float | None = None,
        num_samples: int | None = None,
        base_version: int | None = None,
        buffer_delta: ArrayLike | Mapping[str, ArrayLike] | Buffers | None = None,
        gradient_sums: Sequence[GradientSums] | None = None,
    ) -> CommitResult:
        """Send a gradient (the server applies -eta*g) or an update (applied as given).

        `payload` is a flat float32 vector in spec order or a mapping by parameter name, in any
        order (a missing or unknown name, or a shape other than the spec's, raises
        NamedPayloadError before anything is sent; likewise a `buffer_delta` by name).
        `base_version` defaults to the version of the central variable last received (with
        partitions, partition 0's: the others' are taken as many versions behind their own).
        `buffer_delta`, for a model with buffers: how they changed since the central ones were
        last loaded (flat in buffer spec order, by name, or as Buffers by kind: integer buffers'
        changes are rounded to int64); the server adds it to its buffers. `gradient_sums`, with an
        update: one per partition of θ, for the noise scale (gemps_proto.gradient_sums; LocalSteps').
        Returns the new central variable and buffers (one round trip per step; under a rule that
        moves θ a round of commits at a time, `adamw`, once the round closed: gemps.rounds). With partitions,
        the slices are applied independently: complete when every partition has applied its own;
        when one refuses after another applied, PartiallyAppliedError says which did, and θ holds
        their replies. A payload or delta with NaN or Inf is refused here (InvalidArgumentError,
        reason NON_FINITE) before any server sees it.
        """
        if self.registration is None:
            raise errors.NotRegisteredError("call register() before pull() or commit()")
        if kind not in PAYLOAD_KINDS:
            raise ValueError(f"kind must be one of {', '.join(PAYLOAD_KINDS)}, not {kind!r}")
        flat = named_payloads.payload_vector(payload, self.spec)  # its values are checked as it is sent (router)
        started = time.monotonic()  # its latency, when the client has metrics
        try:
            return self._router.commit(
                flat, kind=PAYLOAD_KINDS[kind], loss=loss, num_samples=num_samples, base_version=base_version,
                buffer_delta=None if buffer_delta is None else self._buffer_delta(buffer_delta),
                gradient_sums=gradient_sums,
            )  # fmt: skip
        finally:
            self._metrics.commit_took(time.monotonic() - started)

    @serialised
    def leave(self) -> None:
        """Leave cleanly; the server frees this worker's state and shard (each partition's)."""
        self._router.leave()
        at_exit.disarm(self)

    def leave_at_exit(self) -> None:
        """Leave, one attempt per server: the interpreter is exiting, or the client closing, and
        the program did not leave (gemps.at_exit bounds the wait at exit)."""
        self._retrier.policy = NO_RETRY  # before the lock: a call that holds it stops retrying
        try:
            with self._calls:
                self._router.leave()
        except errors.GempsError as error:
            log.info("leaving failed (the server evicts this worker when its lease expires): %s", error)

    @serialised
    def report_evaluation(
        self, version: int, loss: float, accuracy: float, num_samples: int, dataset: str = ""
    ) -> None:
        """Report held-out figures of the central variable at `version` (for evaluators; with
        partitions, partition 0's version, to partition 0)."""
        self._router.report_evaluation(Evaluation(version, loss, accuracy, num_samples, dataset))

    @serialised
    def status(self) -> ServerStatus:
        """The server's status (with partitions: partition 0's, whose `layout` lists them all)."""
        return self._router.status()

    @serialised
    def statuses(self) -> list[ServerStatus]:
        """Every partition's status, in θ order (one item when θ is not partitioned)."""
        return self._router.statuses()

    def gradient_noise(self, statuses: Sequence[ServerStatus] | None = None) -> GradientNoise:
        """The server's gradient noise scale estimate for the whole of θ (`.scale`, `.useful_workers`,
        `.describe()`): each partition's sums added (GradientNoise.combined), from `statuses` when
        given (every partition's, as `statuses()` returns them), else asked for."""
        parts = self.statuses() if statuses is None else statuses
        return GradientNoise.combined([status.gradient_noise for status in parts])

    @serialised
    def close(self) -> None:
        """Leave, if still registered, then close the connections: the server frees this worker's
        state and data shard at once. One attempt per server within at_exit's deadline (2 s), as at
        exit: a server that is gone does not hold the close up (its lease frees the place);
        `leave()` first retries within the call's timeout."""
        at_exit.disarm(self)
        if self.registration is not None:
            with call_deadline(at_exit.EXIT_DEADLINE_SECONDS):
                self.leave_at_exit()
        self._stop_grace.close()
        self._router.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        """Leave (retried as any call), then close; a block ending on an error only closes (2 s at most)."""
        try:
            if exc_info[0] is None:
                self.leave()
        except errors.GempsError as error:
            log.warning("leave failed while closing: %s", error)
        finally:
            self.close()

    def _buffer_delta(self, delta: ArrayLike | Mapping[str, ArrayLike] | Buffers) -> Buffers:
        """The delta by kind, as the buffer spec splits it (gemps.named_payloads: refused before
        anything is sent when it does not fit the spec)."""
        by_kind = named_payloads.buffer_delta(delta, self.buffer_spec)
        refuse_non_finite("buffer_delta", by_kind.floats)
        return by_kind

    # -- what the client holds -------------------------------------------------------------------

    @property
    def registration(self) -> Registration | None:
        """This worker's registration (with partitions: partition 0's, which gives the shard)."""
        return self._router.registration

    @property
    def worker_id(self) -> str | None:
        """The id the server gave this worker at registration; None before it registers."""
        return self.registration.worker_id if self.registration else None

    @property
    def spec(self) -> tuple[ParameterSpec, ...]:
        """The parameters' names, shapes and order: the layout of every flat payload and reply."""
        return self._router.spec

    @property
    def buffer_spec(self) -> tuple[ParameterSpec, ...]:
        """The buffers' names, shapes and kinds (float32 or int64), in order; empty without buffers."""
        return self._router.buffer_spec

    @property
    def target(self) -> str:
        """Where partition 0 (or the only server) is reached now."""
        return self._router.target

    @property
    def targets(self) -> list[str]:
        """The address of each server this client talks to, in θ order."""
        return self._router.targets

    @property
    def layout(self) -> Layout | None:
        """How θ is partitioned; None: one server holds it all."""
        return self._router.layout

    @property
    def central(self) -> CentralVariable | None:
        """The newest central variable received."""
        return self._router.central

    @property
    def planes(self) -> list[str]:
        """How each server's commits and pulls travel now, in θ order: "data" or "grpc" ("" for a
        transport that does not say)."""
        return [getattr(session.transport, "plane", "") for session in self._router.sessions]

    @property
    def shared_memory_fallbacks(self) -> int:
        """Connections made without shared memory where it had been used or was wanted, over this
        client's life (each said at WARNING with its reason)."""
        return sum(getattr(session.transport, "shared_memory_fallbacks", 0) for session in self._router.sessions)

    @property
    def retries(self) -> int:
        """Attempts retried after UNAVAILABLE, DEADLINE_EXCEEDED or a busy server, over this client's life."""
        return self._retrier.retries
