"""What clients may hold of the server at once, and for how long: requests and streams on gRPC,
buffers and connections on the data plane, connections and health watches on the gRPC port."""

from __future__ import annotations

from dataclasses import dataclass, field

from gemps_proto.ranges import (
    BUFFERS,
    COUNT,
    COUNT_OR_ZERO,
    GRPC_SECONDS,
    INT32_MAX,
    INT64_MAX,
    MEBIBYTES_OR_ZERO,
    RANGE,
    SECONDS,
    THREADS,
    Range,
)

MIB = 1 << 20


# The largest model a server takes by default: 1 GiB of float32 θ.
DEFAULT_MAX_PARAMETERS = 1 << 28


@dataclass(frozen=True)
class RequestLimits:
    """Requests on the gRPC port: their size, how many at once, and how slowly a stream may arrive."""

    max_message_mb: int = field(
        default=4,
        metadata={
            "help": "largest request message accepted, MiB (the SDK sends larger payloads and initial values "
            "in pieces; replies are not limited by it)",
            RANGE: Range(1, INT32_MAX // MIB, unit="MiB"),
        },
    )
    max_parameters: int = field(
        default=DEFAULT_MAX_PARAMETERS,
        metadata={
            "help": "most values (parameters of this process's range, and buffers) a model may have; a first "
            "worker's larger model is refused RESOURCE_EXHAUSTED before its values are read (default 2**28: 1 GiB "
            "of float32 θ, several times that with the rule's state)",
            RANGE: Range(1, INT64_MAX // 4),  # their bytes, 4 each, are counted in int64
        },
    )
    max_concurrent_rpcs: int = field(
        default=512,
        metadata={
            "help": "RPCs in progress at once, server-wide; more are refused RESOURCE_EXHAUSTED before their "
            "request is read (the SDK retries them); calls that need no token (health checks) never count "
            "here: --max-unauthenticated-rpcs",
            RANGE: COUNT,
        },
    )
    max_streamed_payloads: int = field(
        default=2,
        metadata={
            "help": "CommitStreams served at once, each in a reused buffer of P values (others wait in flow "
            "control, in arrival order)",
            RANGE: BUFFERS,
        },
    )
    stream_idle_timeout: float = field(
        default=30.0,
        metadata={
            "help": "seconds a CommitStream or RegisterStream may wait between its pieces before it is refused (it "
            "may hold a buffer or the upload); on the data plane: seconds without a byte in the middle of a frame "
            "or of a reply, then it is closed",
            RANGE: SECONDS,
        },
    )

    @property
    def max_message_bytes(self) -> int:
        return min(self.max_message_mb * MIB, INT32_MAX)


@dataclass(frozen=True)
class DataPlaneLimits:
    """The data plane's buffers and connections, and the slowest rate any streamed transfer (on
    either plane) may move at."""

    data_plane_buffers: int = field(
        default=4,
        metadata={
            "help": "data-plane requests carrying θ served at once, each in a reused buffer of P values (others "
            "wait, holding nothing)",
            RANGE: BUFFERS,
        },
    )
    slow_upload_buffers: int = field(
        default=4,
        metadata={
            "help": "data-plane commit payloads read at once on the slow lane, each in a reused buffer of P values "
            "of its own: a payload slower than a quarter of the rate the server sees others arrive at moves there "
            "(then its worker's next ones start there, waiting holding nothing) and gives its --data-plane-buffers "
            "buffer back; with none free it is refused DEADLINE_EXCEEDED (stream_idle; the SDK retries)",
            RANGE: BUFFERS,
        },
    )
    min_stream_rate_mb: float = field(
        default=1.0,
        metadata={
            "help": "the slowest, in MiB/s on average, that a streamed payload or initial values (gRPC) and a "
            "data-plane payload or reply may move: each gets --stream-idle-timeout plus its bytes at this "
            "rate, so a client trickling bytes just often enough to beat the idle timeout is still cut off",
            RANGE: Range(0, 1 << 20, low_open=True, unit="MiB/s"),
        },
    )
    max_data_connections: int = field(
        default=256,
        metadata={
            "help": "data-plane connections at once (TCP and local together); more are refused on arrival",
            RANGE: COUNT,
        },
    )
    max_unproven_data_connections: int = field(
        default=32,
        metadata={
            "help": "data-plane connections at once that have not yet proved a ticket with their HELLO (TLS "
            "handshake included; at most --max-data-connections): past it, and when every place is taken, the "
            "oldest of them is closed for the newcomer, so connections that send nothing cannot keep workers out",
            RANGE: COUNT,
        },
    )
    data_plane_refusals_per_second: float = field(
        default=1000.0,
        metadata={
            "help": "data-plane connections per second, per listener (TCP, local socket), that may end without "
            "proving a ticket (refused, evicted, timed out; bursts of 2 seconds' worth): past it the listener "
            "accepts nothing until its budget refills, and those connecting wait in the kernel's queue (workers "
            "already connected are not touched); 0: no limit",
            RANGE: Range(0, 1e6, unit="per second"),
        },
    )
    data_plane_hello_timeout: float = field(
        default=2.0,
        metadata={
            "help": "seconds a data-plane connection has from accept to its HELLO answered (TLS handshake "
            "included); then it is closed",
            RANGE: SECONDS,
        },
    )
    max_shared_memory: int = field(
        default=0,
        metadata={
            "help": "MiB of shared memory the local data-plane connections may attach, all together (θ's float32 "
            "size each, mapped by the server: its RSS); past it an ATTACH is refused RESOURCE_EXHAUSTED "
            "(shared_memory_limit) and that client sends θ on its socket. 0: a θ for each of --max-workers, at "
            "most half of what the server may still use when the first is attached (--memory-budget-mb when set, "
            "else the tightest of RLIMIT_AS, its cgroup's limit and available memory). Within it, a worker's "
            "connections have at most 2 attached at once",
            RANGE: MEBIBYTES_OR_ZERO,
        },
    )
    tls_handshake_threads: int = field(
        default=2,
        metadata={
            "help": "threads that do the data plane's TLS handshakes, off the thread that serves every connection "
            "(so at most this many cores of handshake work at once)",
            RANGE: THREADS,
        },
    )
    max_handshakes_per_source: int = field(
        default=8,
        metadata={
            "help": "data-plane TLS handshakes under way at once from one address (waiting for a thread or for "
            "the peer); more are closed at once, before any handshake work",
            RANGE: COUNT,
        },
    )
    handshake_cpu_per_source: float = field(
        default=0.05,
        metadata={
            "help": "share of one core that data-plane TLS handshakes from one address may take on average "
            "(their threads' time measured, at least 1 ms each; bursts up to 5 seconds' worth): past it, that "
            "address's connections are closed at once, before any handshake work; 0: no limit",
            RANGE: Range(0, 1024, unit="cores"),
        },
    )

    @property
    def min_stream_bytes_per_second(self) -> float:
        """--min-stream-rate-mb in bytes: the floor every streamed transfer is held to, on both planes."""
        return self.min_stream_rate_mb * MIB


@dataclass(frozen=True)
class ConnectionLimits:
    """Client connections to the gRPC port (how many, how long, how many streams each), the
    registrations they may make, the replies they may leave unread, and the health checks and
    Watch streams, which need no token."""

    max_registrations_per_minute: int = field(
        default=600,
        metadata={
            "help": "Register calls accepted per minute (bursts up to this); 0: no limit",
            RANGE: COUNT_OR_ZERO,
        },
    )
    max_connections: int = field(
        default=1000,
        metadata={
            "help": "client connections at once; more are closed on arrival (capped below the open-file "
            "limit, whose soft value is raised to the hard one at start)",
            RANGE: COUNT,
        },
    )
    handshake_timeout: float = field(
        default=5.0,
        metadata={
            "help": "seconds a new gRPC connection has to finish its TLS/HTTP/2 handshake (data plane: "
            "--data-plane-hello-timeout)",
            RANGE: GRPC_SECONDS,
        },
    )
    connection_idle_timeout: float = field(
        default=120.0,
        metadata={
            "help": "seconds a connection (gRPC or data plane) may stay open without a request in flight "
            "(clients reconnect)",
            RANGE: GRPC_SECONDS,
        },
    )
    max_streams_per_connection: int = field(
        default=100,
        metadata={
            "help": "RPCs at once on one client connection (HTTP/2 streams); more are refused by the transport",
            RANGE: COUNT,
        },
    )
    max_reply_mb: int = field(
        default=128,
        metadata={
            "help": "MiB of replies carrying the parameters (Register, Pull, Commit, PullStream) held at once "
            "until their clients read them; more wait, holding nothing, before theirs is built (gRPC and the "
            "data plane each have a budget of this size)",
            RANGE: Range(1, INT32_MAX, unit="MiB"),
        },
    )
    max_connection_age: float = field(
        default=300.0,
        metadata={
            "help": "seconds a client connection may live; then it is told to go away (GOAWAY: clients "
            "reconnect) and closed --connection-age-grace seconds later",
            RANGE: GRPC_SECONDS,
        },
    )
    connection_age_grace: float = field(
        default=60.0,
        metadata={
            "help": "seconds RPCs in flight get to finish after GOAWAY; then the connection is closed, "
            "freeing what its client never read",
            RANGE: GRPC_SECONDS,
        },
    )
    max_unauthenticated_rpcs: int = field(
        default=32,
        metadata={
            "help": "calls that need no token (health checks and Health.Watch streams) in progress at once; more "
            "are refused RESOURCE_EXHAUSTED before their request is read. They never count in "
            "--max-concurrent-rpcs, so probes cannot take what workers need",
            RANGE: COUNT,
        },
    )
    max_watches: int = field(
        default=16,
        metadata={
            "help": "Health.Watch streams open at once (they count in --max-unauthenticated-rpcs too, and must "
            "leave room there for health checks); more are refused RESOURCE_EXHAUSTED",
            RANGE: COUNT,
        },
    )
    max_watches_per_connection: int = field(
        default=2,
        metadata={"help": "Health.Watch streams open at once on one client connection", RANGE: COUNT},
    )

    def problems(self) -> list[str]:
        """Watch streams that would crowd out health checks (the ranges: ServerConfig)."""
        found = []
        if self.max_watches >= self.max_unauthenticated_rpcs:
            found.append(
                f"max_watches ({self.max_watches}) must be below max_unauthenticated_rpcs "
                f"({self.max_unauthenticated_rpcs}): Watch streams would leave no room for health checks"
            )
        if self.max_watches_per_connection > self.max_watches:
            found.append(f"max_watches_per_connection must be at most max_watches ({self.max_watches})")
        return found
