"""Server configuration: a frozen dataclass composed of the training configuration the server
announces (gemps_proto.schema.TrainingConfig) and the options of this process.

The command line (`gemps server`) sets every field by flag or GEMPS_* environment variable, the
training config's fields included (`--learning-rate`, `GEMPS_LEARNING_RATE`); field metadata
carries their help text, choices and ranges (gemps_proto.ranges): every value is checked at
start against what the types it meets can hold, and refused with one line naming it.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gemps_proto.ranges import (
    BUFFERS,
    COUNT,
    COUNT_OR_ZERO,
    GRPC_SECONDS,
    INT32_MAX,
    INT64_MAX,
    PORT,
    RANGE,
    SECONDS,
    SECONDS_OR_ZERO,
    UINT32_MAX,
    Range,
    out_of_range,
)
from gemps_proto.schema import TrainingConfig
from gemps_server import partition_addresses
from gemps_server.config_checks import partition_problems, replica_problems, security_problems, valid_token
from gemps_server.domain.noise import NOISE_WINDOW_AUTO, NOISE_WINDOW_HELP, NOISE_WINDOWS
from gemps_server.domain.rules import rule_names
from gemps_server.domain.rules.gem import GEM_KERNELS
from gemps_server.logs import LOG_FORMATS
from gemps_server.native import compiled

LOG_LEVELS = ("debug", "info", "warning", "error")
DATA_PLANE_MODES = ("on", "off")
MIB = 1 << 20


@dataclass(frozen=True)
class ServerConfig:
    training: TrainingConfig = field(default_factory=TrainingConfig)
    host: str = field(default="127.0.0.1", metadata={"help": "address to listen on (0.0.0.0 for all)"})
    port: int = field(default=50051, metadata={"help": "gRPC port; 0 picks a free one", RANGE: PORT})
    data_plane: str = field(
        default="on",
        metadata={
            "help": "offer the data plane (commits and pulls with θ's raw bytes on --data-port, announced at "
            "Register); off: gRPC only",
            "choices": DATA_PLANE_MODES,
        },
    )
    data_port: int = field(
        default=51051,
        metadata={"help": "data-plane port (partition i: this + i); 0 picks a free one", RANGE: PORT},
    )
    shared_memory: str = field(
        default="on",
        metadata={
            "help": "offer clients on this host the data plane on a Unix socket, where they may attach shared "
            "memory: θ then crosses no socket (Linux; clients elsewhere use --data-port); off: TCP only",
            "choices": DATA_PLANE_MODES,
        },
    )
    port_file: str = field(
        default="", metadata={"help": "once serving, write the gRPC port and the metrics port (lines 1, 2) here"}
    )
    # -- partitions of θ (docs/ARCHITECTURE.md, "Partitions") ---------------------------------------
    partitions: int = field(
        default=1,
        metadata={
            "help": "split θ into this many contiguous ranges, each held by its own server process",
            RANGE: Range(1, 65535),
        },
    )
    partition_index: int = field(
        default=-1,
        metadata={
            "help": "serve only this partition (0-based; e.g. a Kubernetes pod's ordinal); "
            "-1: run all of them here, one process each on consecutive ports",
            RANGE: Range(-1, 65534),
        },
    )
    partition_addresses: str = field(
        default="",
        metadata={
            "help": "how workers reach each partition, announced by partition 0: comma-separated targets "
            "in partition order, or one with {index} (e.g. gemps-server-{index}.gemps-server:50051); "
            "':PORT' means the host workers reached partition 0 at; @PATH: a file holding either, read "
            "again when it changes (a launcher rewrites it when a partition moves to another machine)"
        },
    )
    # -- replicas of each partition (DESIGN §3d) ------------------------------------
    replicas: int = field(
        default=1,
        metadata={
            "help": "replicas of each partition: a primary and R-1 backups, each a process of its own, that apply "
            "every commit in the same order; a commit is acknowledged once every in-sync replica applied it. "
            "Needs etcd (--etcd; on one machine without it, a private etcd is started)",
            RANGE: Range(1, 9),
        },
    )
    replica_index: int = field(
        default=-1,
        metadata={
            "help": "serve only this replica of the partition (0-based; a pod's or container's ordinal); -1: run "
            "all of them here",
            RANGE: Range(-1, 8),
        },
    )
    etcd: str = field(
        default="",
        metadata={"help": "etcd endpoints deciding each partition's primary (e.g. http://etcd:2379, comma-separated)"},
    )
    job: str = field(
        default="gemps",
        metadata={"help": "the job's name: its keys in etcd are under /gemps/JOB/ (a new job: a new name)"},
    )
    replication_port: int = field(
        default=52051,
        metadata={
            "help": "port a primary's backups dial to receive its journal (replica r of partition i: this + "
            "i * R + r when run here); 0 picks a free one",
            RANGE: PORT,
        },
    )
    advertise_host: str = field(
        default="",
        metadata={
            "help": "the host other replicas and workers reach this process at (default: --host, or this "
            "machine's name when --host listens on every address)"
        },
    )
    replica_lease: float = field(
        default=3.0,
        metadata={
            "help": "seconds a primary's etcd lease lasts: a dead or cut-off primary is replaced after about this "
            "long, and stops acknowledging commits before it is",
            RANGE: Range(1.0, 3600.0, unit="s"),
        },
    )
    replica_timeout: float = field(
        default=5.0,
        metadata={
            "help": "seconds a backup may leave a forwarded commit unapplied before it is dropped from the "
            "in-sync set (commits wait for it until then); it is re-seeded when it catches up",
            RANGE: Range(0.1, 3600.0, unit="s"),
        },
    )
    gem_kernel: str = field(
        default="auto",
        metadata={
            "help": "GEM's update: compiled (one C pass, exact statistics), numpy (blocked); auto: compiled if built",
            "choices": GEM_KERNELS,
        },
    )
    lease_ttl: float = field(
        default=60.0,
        metadata={
            "help": "seconds without a commit or pull before a worker is evicted; on a full server, a worker "
            "this long without a commit gives its place to a newcomer",
            RANGE: SECONDS,
        },
    )
    max_workers: int = field(
        default=256, metadata={"help": "most workers registered at once", RANGE: Range(1, UINT32_MAX)}
    )
    noise_window: int = field(default=NOISE_WINDOW_AUTO, metadata={"help": NOISE_WINDOW_HELP, RANGE: NOISE_WINDOWS})
    num_shards: int = field(
        default=0,
        metadata={
            "help": "disjoint data shards; 0: every worker uses all data in its own order",
            RANGE: Range(0, UINT32_MAX),
        },
    )
    max_message_mb: int = field(
        default=4,
        metadata={
            "help": "largest request message accepted, MiB (the SDK sends larger payloads and initial values "
            "in pieces; replies are not limited by it)",
            RANGE: Range(1, INT32_MAX // MIB, unit="MiB"),
        },
    )
    max_parameters: int = field(
        default=1 << 28,
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
    data_plane_hello_timeout: float = field(
        default=2.0,
        metadata={
            "help": "seconds a data-plane connection has from accept to its HELLO answered (TLS handshake "
            "included); then it is closed",
            RANGE: SECONDS,
        },
    )
    metrics_port: int = field(
        default=9109, metadata={"help": "Prometheus /metrics port; -1 disables", RANGE: Range(-1, 65535)}
    )
    metrics_host: str = field(default="", metadata={"help": "metrics address (default: same as --host)"})
    log_level: str = field(default="info", metadata={"help": "log level", "choices": LOG_LEVELS})
    log_format: str = field(
        default="text",
        metadata={"help": "log lines: text (key=value fields) or json (one object per line)", "choices": LOG_FORMATS},
    )
    # -- checkpoints and shutdown ----------------------------------------------------------------
    checkpoint_dir: str = field(
        default="",
        metadata={"help": "write checkpoints here and restore the latest on start; empty: no checkpoints"},
    )
    checkpoint_every: int = field(
        default=1000,
        metadata={
            "help": "checkpoint after this many commits since the last one; 0: not by count",
            RANGE: Range(0, INT64_MAX),
        },
    )
    checkpoint_interval: float = field(
        default=60.0,
        metadata={
            "help": "checkpoint this often, seconds, when the version moved; 0: not by time",
            RANGE: SECONDS_OR_ZERO,
        },
    )
    checkpoint_keep: int = field(default=3, metadata={"help": "checkpoints kept; older ones are deleted", RANGE: COUNT})
    shutdown_grace: float = field(
        default=10.0,
        metadata={
            "help": "seconds in-flight RPCs get to finish on SIGTERM before the final checkpoint",
            RANGE: SECONDS_OR_ZERO,
        },
    )
    # -- security and limits -----------------------------------------------------------------------
    tls_cert: str = field(default="", metadata={"help": "PEM certificate chain: serve TLS (needs --tls-key)"})
    tls_key: str = field(default="", metadata={"help": "PEM private key of --tls-cert"})
    tls_client_ca: str = field(
        default="", metadata={"help": "PEM CA bundle: require client certificates it signed (mutual TLS)"}
    )
    auth_token: str = field(
        default="", metadata={"help": "require 'authorization: Bearer TOKEN' on every RPC except health checks"}
    )
    auth_token_file: str = field(default="", metadata={"help": "read the bearer token from this file instead"})
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
            "until their clients read them; more wait, holding nothing, before theirs is built",
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
    supervisor_pid: int = field(
        default=0,
        metadata={
            "help": "shut down when the process with this id stops being this one's parent (gemps server "
            "--partitions K sets it for its partitions, which then die with it); 0: none",
            RANGE: Range(0, INT32_MAX),
        },
    )

    def __post_init__(self) -> None:
        problems = self.problems()
        if problems:
            raise ValueError("invalid server configuration: " + "; ".join(problems))

    def problems(self) -> list[str]:
        found = []
        if self.training.rule not in rule_names():
            found.append(f"unknown rule {self.training.rule!r} (choose from {', '.join(rule_names())})")
        found += self.training.problems()
        if self.gem_kernel not in GEM_KERNELS:
            found.append(f"unknown gem_kernel {self.gem_kernel!r} (choose from {', '.join(GEM_KERNELS)})")
        elif self.gem_kernel == "compiled" and compiled is None:
            found.append("gem_kernel 'compiled' is not built here (no C compiler at install?): use auto or numpy")
        if self.log_level not in LOG_LEVELS:
            found.append(f"unknown log_level {self.log_level!r} (choose from {', '.join(LOG_LEVELS)})")
        if self.log_format not in LOG_FORMATS:
            found.append(f"unknown log_format {self.log_format!r} (choose from {', '.join(LOG_FORMATS)})")
        found += self._limit_problems()
        found += security_problems(self)
        found += partition_problems(self)
        found += replica_problems(self)
        return found

    def _limit_problems(self) -> list[str]:
        found = out_of_range(self)
        if self.data_plane not in DATA_PLANE_MODES:
            found.append(f"data_plane {self.data_plane!r}: choose on or off")
        if self.shared_memory not in DATA_PLANE_MODES:
            found.append(f"shared_memory {self.shared_memory!r}: choose on or off")
        if self.max_watches >= self.max_unauthenticated_rpcs:
            found.append(
                f"max_watches ({self.max_watches}) must be below max_unauthenticated_rpcs "
                f"({self.max_unauthenticated_rpcs}): Watch streams would leave no room for health checks"
            )
        if self.max_watches_per_connection > self.max_watches:
            found.append(f"max_watches_per_connection must be at most max_watches ({self.max_watches})")
        return found

    @property
    def replica(self) -> int:
        """The replica of its partition this process is (0 without replicas)."""
        return max(self.replica_index, 0)

    @property
    def partition(self) -> int:
        """The partition this process serves (0 when θ is not partitioned)."""
        return max(self.partition_index, 0)

    def partition_address_list(self) -> tuple[str, ...]:
        """How workers reach each partition now (empty when unknown: only partition 0 must know)."""
        return partition_addresses.PartitionAddresses(self.partition_addresses, self.partitions).current()

    @property
    def data_plane_on(self) -> bool:
        return self.data_plane == "on"

    @property
    def shared_memory_on(self) -> bool:
        """Same-host clients get a Unix socket with shared memory (Linux only: memfd and seals)."""
        return self.data_plane_on and self.shared_memory == "on" and sys.platform == "linux"

    @property
    def tls(self) -> bool:
        return bool(self.tls_cert)

    def token(self) -> str:
        """The bearer token clients must send ('' when auth is off); reads auth_token_file."""
        if not self.auth_token_file:
            return self.auth_token
        token = Path(self.auth_token_file).read_text().strip()
        if not valid_token(token):
            raise ValueError(f"auth_token_file {self.auth_token_file}: the token must be visible ASCII, no spaces")
        return token

    @property
    def max_message_bytes(self) -> int:
        return min(self.max_message_mb * MIB, INT32_MAX)

    @property
    def min_stream_bytes_per_second(self) -> float:
        """--min-stream-rate-mb in bytes: the floor every streamed transfer is held to, on both planes."""
        return self.min_stream_rate_mb * MIB

    def recorded_settings(self) -> dict[str, Any]:
        """The settings a checkpoint records and compares on restore: the training config and
        how the data is sharded."""
        return {**self.training.as_dict(), "num_shards": self.num_shards}
