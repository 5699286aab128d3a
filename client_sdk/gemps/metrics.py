"""The client's own Prometheus metrics, opt-in: `Client(..., metrics_registry=registry)`.

A worker that serves its own /metrics adds the SDK's view of the server to it: how long each
commit took from the client's side (retries, re-registration and every partition included), the
bytes of θ's values it sent and received per call, and the attempts it retried. They go into the
user's `prometheus_client.CollectorRegistry`; prometheus_client is imported here only, when a
registry is given, so a client without metrics needs none installed.

    registry = CollectorRegistry()
    client = gemps.Client("ps:50051", metrics_registry=registry)
    prometheus_client.start_http_server(9100, registry=registry)

The bytes are θ's values as the wire carries them (`wire_dtype`'s width: 4 bytes a value for
float32, 2 for bfloat16; a commit in `compression` codes, or a reply in `reply_compression` codes
or whole in bfloat16, at its codes' bytes), counted at the transport seam for each attempt a server answered (a
commit retried after a lost reply counts twice: its payload went out twice; an attempt that
failed is not counted, whether or not its bytes left); the messages' framing is not counted. On
the server's host the data plane moves them through shared memory, not a socket: counted alike. One registry holds one
client's metrics (a second client registering the same names there is refused, naming them):
give each client its own registry, or one process one client, as a worker is.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from gemps.records import Evaluation, Registration, ServerStatus
from gemps.transport import CommitCall, Committed, Deferred, Enrolment, Pending, PullCall, Pulled, Registered, Transport
from gemps_proto import vectors
from gemps_proto.tensor_codec import BFLOAT16, expected_payload_nbytes, itemsize

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

#: the calls whose bytes are counted (the `call` label)
CALLS = ("register", "pull", "commit")
#: commit latency buckets, seconds: a local data-plane commit of a small model to a slow restart
COMMIT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class NoMetrics:
    """What a client without a metrics registry counts: nothing."""

    def commit_took(self, seconds: float) -> None:
        """A commit call ended after `seconds`."""

    def metered(self, connect: Callable[[str], Transport]) -> Callable[[str], Transport]:
        """`connect` as it is: no transport is counted."""
        return connect


class ClientMetrics(NoMetrics):
    """The SDK's series in `registry`: commit latency, θ's bytes per call, retries (read from
    `retries` when scraped). ImportError naming the extra when prometheus_client is missing;
    ValueError naming the series when the registry holds them already (another client's)."""

    def __init__(
        self,
        registry: CollectorRegistry,
        wire_dtype: int,
        retries: Callable[[], int],
        shared_memory_fallbacks: Callable[[], int] = lambda: 0,
    ) -> None:
        try:
            from prometheus_client import Counter, Histogram
            from prometheus_client.core import CounterMetricFamily
            from prometheus_client.registry import Collector
        except ImportError as missing:  # the SDK installs without it
            raise ImportError(
                f"Client(metrics_registry=...) needs prometheus_client, not installed here: "
                f"pip install 'gemps[metrics]' ({missing})"
            ) from None
        self.width = itemsize(wire_dtype)

        class Retries(Collector):
            def collect(self) -> Iterator[Any]:
                what = "Attempts of this client's calls retried (server down, busy, failing over)."
                yield CounterMetricFamily("gemps_client_retries", what, value=retries())
                what = "Connections made without shared memory where it had been used or wanted (each a WARNING)."
                yield CounterMetricFamily("gemps_client_shared_memory_fallbacks", what, value=shared_memory_fallbacks())

        try:
            self.commit_seconds = Histogram(
                "gemps_client_commit_duration_seconds",
                "A commit call from the client's side, from the call to its reply (or error): its attempts, "
                "retry waits, registering again and every partition included.",
                buckets=COMMIT_BUCKETS,
                registry=registry,
            )
            self.sent = Counter(
                "gemps_client_sent_bytes",
                "Bytes of θ's values this client sent, by call, as the wire carried them (answered attempts).",
                ["call"],
                registry=registry,
            )
            self.received = Counter(
                "gemps_client_received_bytes",
                "Bytes of θ's values this client received, by call, as the wire carried them.",
                ["call"],
                registry=registry,
            )
            registry.register(Retries())
        except ValueError as taken:  # prometheus_client: "Duplicated timeseries in CollectorRegistry"
            raise ValueError(
                f"this registry holds another gemps client's metrics ({taken}): give each Client its own registry"
            ) from None
        for call in CALLS:
            self.sent.labels(call)
            self.received.labels(call)

    def commit_took(self, seconds: float) -> None:
        self.commit_seconds.observe(seconds)

    def metered(self, connect: Callable[[str], Transport]) -> Callable[[str], Transport]:
        """`connect`, each transport it opens counting the bytes of θ's values that cross it."""
        return lambda address: MeteredTransport(connect(address), self)

    def values_sent(self, call: str, count: int) -> None:
        self.sent.labels(call).inc(count * self.width)

    def values_received(self, call: str, count: int) -> None:
        self.received.labels(call).inc(count * self.width)

    def committed(self, call: CommitCall, committed: Committed) -> None:
        """A commit's bytes each way: its payload's (codes when compressed), and its reply's (a
        difference's codes, or θ whole: bfloat16 to a difference-reply client)."""
        size = vectors.size(call.payload)
        sent = size * self.width if call.encoded is None else expected_payload_nbytes(call.encoded[0], [size])
        self.sent.labels("commit").inc(sent)
        reply = 0 if committed.parameters is None else vectors.size(committed.parameters)
        if committed.difference is not None:
            reply = committed.difference.size
        if not call.reply_code:
            self.values_received("commit", reply)
            return
        code = call.reply_code if committed.difference_of else BFLOAT16
        self.received.labels("commit").inc(expected_payload_nbytes(code, [reply]))


def client_metrics(
    registry: CollectorRegistry | None, wire_dtype: int, retries: Callable[[], int], fallbacks: Callable[[], int]
) -> NoMetrics:
    """A client's metrics: into `registry` when given, else none."""
    return NoMetrics() if registry is None else ClientMetrics(registry, wire_dtype, retries, fallbacks)


class MeteredTransport:
    """A transport (gemps.transport) whose calls count θ's values sent and received, once an
    attempt is answered (one that failed may or may not have sent its bytes: it is not counted)."""

    def __init__(self, transport: Transport, metrics: ClientMetrics) -> None:
        self.transport = transport
        self.metrics = metrics

    def __getattr__(self, name: str) -> Any:
        """What the transport counted says of itself (`plane`, `shared`, ...), as it says it."""
        return getattr(self.transport, name)

    @property
    def target(self) -> str:
        return self.transport.target

    def register(self, enrolment: Enrolment, known_history: str) -> Registered:
        registered = self.transport.register(enrolment, known_history)
        self.metrics.values_sent("register", vectors.size(enrolment.values))
        if registered.parameters is not None:
            self.metrics.values_received("register", vectors.size(registered.parameters))
        return registered

    def pull(self, call: PullCall) -> Pulled:
        return self._pulled(self.transport.pull(call))

    def start_pull(self, call: PullCall) -> Pending[Pulled]:
        pending = self.transport.start_pull(call)
        return Deferred(lambda: self._pulled(pending.result()))

    def commit(self, call: CommitCall) -> Committed:
        return self._committed(call, self.transport.commit(call))

    def start_commit(self, call: CommitCall) -> Pending[Committed]:
        pending = self.transport.start_commit(call)
        return Deferred(lambda: self._committed(call, pending.result()))

    def leave(self, worker_id: str) -> None:
        self.transport.leave(worker_id)

    def status(self) -> ServerStatus:
        return self.transport.status()

    def report_evaluation(self, evaluation: Evaluation) -> None:
        self.transport.report_evaluation(evaluation)

    def resume(self, registration: Registration) -> None:
        self.transport.resume(registration)

    def interrupt(self) -> None:
        self.transport.interrupt()

    def close(self) -> None:
        self.transport.close()

    def _pulled(self, pulled: Pulled) -> Pulled:
        if pulled.parameters is not None:  # None: unchanged, nothing sent
            self.metrics.values_received("pull", vectors.size(pulled.parameters))
        return pulled

    def _committed(self, call: CommitCall, committed: Committed) -> Committed:
        self.metrics.committed(call, committed)
        return committed
