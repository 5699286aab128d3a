"""RPCs and traffic, per plane and method: handling time, bytes in and out, and the data plane's
connections and the guards that close them.

What every request records (its handling time, its bytes, θ's bytes by encoding) is accumulators
(accumulators.py); the data plane's guards and connections, per connection, prometheus_client's."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from gemps_proto.tensor_codec import ENCODING_NAMES
from gemps_proto.v1 import parameter_server_pb2 as pb
from gemps_server.metrics.accumulators import CounterFamily, HistogramFamily
from gemps_server.metrics.buckets import DURATION_BUCKETS

RPC_METHODS = tuple(method.name for method in pb.DESCRIPTOR.services_by_name["ParameterServer"].methods)
# Which door a request came through (DESIGN §3c): every gRPC method, and the data plane's two calls.
PLANES = ("grpc", "data")
DATA_PLANE_METHODS = ("Commit", "Pull")
PLANE_METHODS = tuple(("grpc", method) for method in RPC_METHODS) + tuple(("data", m) for m in DATA_PLANE_METHODS)
# θ-sized tensors' directions, and their encodings: the wire's, then "other" for a dtype of none.
DIRECTIONS = ("received", "sent")
ENCODINGS = (*ENCODING_NAMES.values(), "other")
# Why the data plane closed a connection before or between requests (its requests' own refusals
# count like gRPC's: gemps_commits_total, the rejected log line).
DATA_PLANE_REFUSALS = (
    "bad_frame",  # not a frame of this protocol (magic, version, op, flags, lengths)
    "bad_hello",  # a first frame that is not a well-formed HELLO
    "unauthenticated",  # a ticket that is not the worker's registration's, or another worker's request
    "unknown_worker",  # a HELLO for a worker not registered
    "not_primary",  # a HELLO at a replica that is not its partition's primary (the worker tries another)
    "handshake_timeout",  # TLS handshake and HELLO not done within --data-plane-hello-timeout
    "unproven_limit",  # closed without a HELLO for a newcomer, past --max-unproven-data-connections
    "tls",  # a TLS handshake that failed (no or a wrong client certificate, not TLS at all)
    "revoked_certificate",  # a TLS handshake with a client certificate that --tls-crl revokes
    "handshake_limit",  # a TLS handshake past --max-handshakes-per-source or --handshake-rate-per-source
    "idle_timeout",  # no request for --connection-idle-timeout
    "stream_timeout",  # a frame, or a reply, stalled for --stream-idle-timeout
    "too_many_connections",  # past --max-data-connections
    "refused_unread",  # a request refused before its payload was read: the connection is closed
    "slow_upload",  # a payload too slow for the fast lane, and no slow-upload buffer free (refused unread)
    "bad_attach",  # shared memory refused: not one sealed memfd of θ's size, not written by its client, twice
    "shared_memory_limit",  # shared memory refused: past --max-shared-memory (the client uses its socket)
    "descriptors",  # descriptors passed before the HELLO proved a ticket, or more than an ATTACH's one
    "unread_replies",  # a reply unread past its window while more requests came, or no reply budget left
    "internal",  # the server failed on a request (a bug): INTERNAL answered, then closed
)


class TrafficMetrics:
    """Every (plane, method) series exists from the start, looked up once: rpc() and the byte
    counts run on every request."""

    def __init__(self, registry: CollectorRegistry) -> None:
        method_plane = [(method, plane) for plane, method in PLANE_METHODS]
        self.rpc_duration = HistogramFamily(
            registry,
            "gemps_rpc_duration_seconds",
            "Server-side handling time per RPC, by method and plane (grpc, data); a Commit's includes queue "
            "wait and apply.",
            DURATION_BUCKETS,
            ["method", "plane"],
            method_plane,
        )
        self.received = CounterFamily(
            registry,
            "gemps_received_bytes",
            "Request bytes received, by RPC method and plane (grpc: messages; data: frames).",
            ["method", "plane"],
            method_plane,
        )
        self.sent = CounterFamily(
            registry,
            "gemps_sent_bytes",
            "Response bytes sent, by RPC method and plane (grpc: messages; data: frames).",
            ["method", "plane"],
            method_plane,
        )
        # Made from the one list, every (plane, method) is the same child in the three families.
        self._children = {(plane, method): self.rpc_duration.child(method, plane) for plane, method in PLANE_METHODS}
        self.wire_bytes = CounterFamily(
            registry,
            "gemps_wire_bytes",
            "Bytes of theta-sized tensors on the wire, both planes: commit payloads received and theta sent (in "
            "commit replies and pulls), by encoding (float32, bfloat16, int8, int4, topk). Over "
            "gemps_training_samples_total: bytes per training sample.",
            ["direction", "encoding"],
            [(direction, encoding) for direction in DIRECTIONS for encoding in ENCODING_NAMES.values()],
            capacity=len(DIRECTIONS) * len(ENCODINGS),  # "other"'s series appear with its first bytes
        )
        # By (direction, dtype), the wire's dtypes only: a client's unknown dtypes cannot grow it.
        self._encodings = {
            (direction, dtype): self.wire_bytes.child(direction, name)
            for direction in DIRECTIONS
            for dtype, name in ENCODING_NAMES.items()
        }
        self.data_plane_refusals = Counter(
            "gemps_data_plane_refusals",
            "Data-plane connections closed by a guard, by reason (bad frame or hello, ticket, timeouts, "
            "connection limits, a request refused before its payload was read, a slow upload without room, shared "
            "memory refused).",
            ["reason"],
            registry=registry,
        )
        for reason in DATA_PLANE_REFUSALS:
            self.data_plane_refusals.labels(reason)
        self.data_plane_connections = Gauge(
            "gemps_data_plane_connections", "Open data-plane connections.", registry=registry
        )
        self.shared_memory = Gauge(
            "gemps_data_plane_shared_memory_bytes",
            "Bytes of shared memory attached by local data-plane connections (mapped by the server).",
            registry=registry,
        )
        self.shared_memory_limit = Gauge(
            "gemps_data_plane_shared_memory_limit_bytes",
            "What they may attach together (--max-shared-memory; 0 until settled at the first ATTACH when auto).",
            registry=registry,
        )

    def rpc(self, method: str, seconds: float, plane: str = "grpc") -> None:
        self.rpc_duration.observe(seconds, self._children[plane, method])

    def call(self, method: str, seconds: float, received: int, sent: int, plane: str = "grpc") -> None:
        """One call's rpc(), message_received() and message_sent() together (a data-plane request's)."""
        child = self._children[plane, method]
        self.rpc_duration.observe(seconds, child)
        self.received.inc(received, child)
        self.sent.inc(sent, child)

    def message_received(self, method: str, size: int, plane: str = "grpc") -> None:
        self.received.inc(size, self._children[plane, method])

    def message_sent(self, method: str, size: int, plane: str = "grpc") -> None:
        self.sent.inc(size, self._children[plane, method])

    def tensor_bytes(self, direction: str, dtype: int, size: int) -> None:
        """`size` bytes of a theta-sized tensor in `dtype` `direction` ("received" or "sent")."""
        child = self._encodings.get((direction, dtype))
        if child is None:
            if direction not in DIRECTIONS:
                raise ValueError(f"tensor bytes' direction {direction!r}: not one of {DIRECTIONS}")
            child = self.wire_bytes.child(direction, "other")
        self.wire_bytes.inc(size, child)

    def data_plane_refused(self, reason: str) -> None:
        self.data_plane_refusals.labels(reason).inc()
