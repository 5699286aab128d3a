"""Server configuration: a frozen dataclass composed of the training configuration the server
announces (gemps_proto.schema.TrainingConfig) and the options of this process.

The command line (`gemps server`) sets every field by flag or GEMPS_* environment variable, the
training config's fields included (`--learning-rate`, `GEMPS_LEARNING_RATE`); field metadata
carries their help text and choices.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gemps_proto.schema import TrainingConfig
from gemps_server.domain.rules import rule_names
from gemps_server.domain.rules.gem import GEM_KERNELS
from gemps_server.logs import LOG_FORMATS
from gemps_server.native import compiled

LOG_LEVELS = ("debug", "info", "warning", "error")
DATA_PLANE_MODES = ("on", "off")


def valid_token(token: str) -> bool:
    """A bearer token fits an HTTP/2 header value: visible ASCII, no spaces, not empty."""
    return bool(token) and all(33 <= ord(c) <= 126 for c in token)


@dataclass(frozen=True)
class ServerConfig:
    training: TrainingConfig = field(default_factory=TrainingConfig)
    host: str = field(default="127.0.0.1", metadata={"help": "address to listen on (0.0.0.0 for all)"})
    port: int = field(default=50051, metadata={"help": "gRPC port; 0 picks a free one"})
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
        metadata={"help": "data-plane port (partition i: this + i); 0 picks a free one"},
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
        metadata={"help": "split θ into this many contiguous ranges, each held by its own server process"},
    )
    partition_index: int = field(
        default=-1,
        metadata={
            "help": "serve only this partition (0-based; e.g. a Kubernetes pod's ordinal); "
            "-1: run all of them here, one process each on consecutive ports"
        },
    )
    partition_addresses: str = field(
        default="",
        metadata={
            "help": "how workers reach each partition, announced by partition 0: comma-separated targets "
            "in partition order, or one with {index} (e.g. gemps-server-{index}.gemps-server:50051); "
            "':PORT' means the host workers reached partition 0 at"
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
            "this long without a commit gives its place to a newcomer"
        },
    )
    max_workers: int = field(default=256, metadata={"help": "most workers registered at once"})
    num_shards: int = field(
        default=0,
        metadata={"help": "disjoint data shards; 0: every worker uses all data in its own order"},
    )
    max_message_mb: int = field(
        default=4,
        metadata={
            "help": "largest request message accepted, MiB (the SDK sends larger payloads and initial values "
            "in pieces; replies are not limited by it)"
        },
    )
    max_parameters: int = field(
        default=1 << 28,
        metadata={
            "help": "most values (parameters of this process's range, and buffers) a model may have; a first "
            "worker's larger model is refused RESOURCE_EXHAUSTED before its values are read (default 2**28: 1 GiB "
            "of float32 θ, several times that with the rule's state)"
        },
    )
    max_concurrent_rpcs: int = field(
        default=512,
        metadata={
            "help": "RPCs in progress at once, server-wide; more are refused RESOURCE_EXHAUSTED before their "
            "request is read (the SDK retries them)"
        },
    )
    max_streamed_payloads: int = field(
        default=2,
        metadata={
            "help": "CommitStreams served at once, each in a reused buffer of P values (others wait in flow control)"
        },
    )
    stream_idle_timeout: float = field(
        default=30.0,
        metadata={
            "help": "seconds a CommitStream may wait between its pieces before it is refused (it may hold a buffer); "
            "on the data plane: seconds without a byte in the middle of a frame or of a reply, then it is closed"
        },
    )
    data_plane_buffers: int = field(
        default=4,
        metadata={
            "help": "data-plane requests carrying θ served at once, each in a reused buffer of P values (others "
            "wait, holding nothing)"
        },
    )
    max_data_connections: int = field(
        default=256,
        metadata={"help": "data-plane connections at once (TCP and local together); more are refused on arrival"},
    )
    metrics_port: int = field(default=9109, metadata={"help": "Prometheus /metrics port; -1 disables"})
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
        default=1000, metadata={"help": "checkpoint after this many commits since the last one; 0: not by count"}
    )
    checkpoint_interval: float = field(
        default=60.0, metadata={"help": "checkpoint this often, seconds, when the version moved; 0: not by time"}
    )
    checkpoint_keep: int = field(default=3, metadata={"help": "checkpoints kept; older ones are deleted"})
    shutdown_grace: float = field(
        default=10.0,
        metadata={"help": "seconds in-flight RPCs get to finish on SIGTERM before the final checkpoint"},
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
        default=600, metadata={"help": "Register calls accepted per minute (bursts up to this); 0: no limit"}
    )
    max_connections: int = field(
        default=1000,
        metadata={
            "help": "client connections at once; more are closed on arrival (capped below the open-file "
            "limit, whose soft value is raised to the hard one at start)"
        },
    )
    handshake_timeout: float = field(
        default=5.0,
        metadata={
            "help": "seconds a new connection has to finish its TLS/HTTP/2 handshake (data plane: TLS and HELLO)"
        },
    )
    connection_idle_timeout: float = field(
        default=120.0,
        metadata={
            "help": "seconds a connection (gRPC or data plane) may stay open without a request in flight "
            "(clients reconnect)"
        },
    )
    max_streams_per_connection: int = field(
        default=100,
        metadata={"help": "RPCs at once on one client connection (HTTP/2 streams); more are refused by the transport"},
    )
    max_reply_mb: int = field(
        default=128,
        metadata={
            "help": "MiB of replies carrying the parameters (Register, Pull, Commit, PullStream) held at once "
            "until their clients read them; more wait, holding nothing, before theirs is built"
        },
    )
    max_connection_age: float = field(
        default=300.0,
        metadata={
            "help": "seconds a client connection may live; then it is told to go away (GOAWAY: clients "
            "reconnect) and closed --connection-age-grace seconds later"
        },
    )
    connection_age_grace: float = field(
        default=60.0,
        metadata={
            "help": "seconds RPCs in flight get to finish after GOAWAY; then the connection is closed, "
            "freeing what its client never read"
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
        found += self._security_problems()
        found += self._connection_problems()
        found += self._partition_problems()
        return found

    def _limit_problems(self) -> list[str]:
        found = []
        if not 0 <= self.port <= 65535:
            found.append(f"port {self.port} outside 0..65535")
        if not 0 <= self.data_port <= 65535:
            found.append(f"data_port {self.data_port} outside 0..65535")
        if self.data_plane not in DATA_PLANE_MODES:
            found.append(f"data_plane {self.data_plane!r}: choose on or off")
        if self.shared_memory not in DATA_PLANE_MODES:
            found.append(f"shared_memory {self.shared_memory!r}: choose on or off")
        if not -1 <= self.metrics_port <= 65535:
            found.append(f"metrics_port {self.metrics_port} outside -1..65535")
        if self.lease_ttl <= 0:
            found.append("lease_ttl must be > 0")
        if self.max_workers < 1:
            found.append("max_workers must be >= 1")
        if self.num_shards < 0:
            found.append("num_shards must be >= 0")
        if self.max_streamed_payloads < 1:
            found.append("max_streamed_payloads must be >= 1")
        if self.data_plane_buffers < 1:
            found.append("data_plane_buffers must be >= 1")
        if not self.stream_idle_timeout > 0:
            found.append("stream_idle_timeout must be > 0")
        if self.max_message_mb < 1:
            found.append("max_message_mb must be >= 1")
        if self.max_parameters < 1:
            found.append("max_parameters must be >= 1")
        if self.max_concurrent_rpcs < 1:
            found.append("max_concurrent_rpcs must be >= 1")
        if self.checkpoint_every < 0:
            found.append("checkpoint_every must be >= 0")
        if self.checkpoint_interval < 0:
            found.append("checkpoint_interval must be >= 0")
        if self.checkpoint_keep < 1:
            found.append("checkpoint_keep must be >= 1")
        if self.shutdown_grace < 0:
            found.append("shutdown_grace must be >= 0")
        return found

    def _security_problems(self) -> list[str]:
        found = []
        if bool(self.tls_cert) != bool(self.tls_key):
            found.append("tls_cert and tls_key go together: give both or neither")
        if self.tls_client_ca and not self.tls_cert:
            found.append("tls_client_ca (mutual TLS) needs tls_cert and tls_key")
        if self.auth_token and self.auth_token_file:
            found.append("give auth_token or auth_token_file, not both")
        if self.auth_token and not valid_token(self.auth_token):
            found.append("auth_token must be printable ASCII without spaces")
        for name in ("tls_cert", "tls_key", "tls_client_ca", "auth_token_file"):
            path = getattr(self, name)
            if path and not Path(path).is_file():
                found.append(f"{name} {path!r} is not a readable file")
        return found

    def _connection_problems(self) -> list[str]:
        found = []
        if self.max_registrations_per_minute < 0:
            found.append("max_registrations_per_minute must be >= 0")
        if self.max_connections < 1:
            found.append("max_connections must be >= 1")
        if self.max_data_connections < 1:
            found.append("max_data_connections must be >= 1")
        if not self.handshake_timeout > 0:
            found.append("handshake_timeout must be > 0")
        if not self.connection_idle_timeout > 0:
            found.append("connection_idle_timeout must be > 0")
        if self.max_streams_per_connection < 1:
            found.append("max_streams_per_connection must be >= 1")
        if self.max_reply_mb < 1:
            found.append("max_reply_mb must be >= 1")
        if not self.max_connection_age > 0:
            found.append("max_connection_age must be > 0")
        if not self.connection_age_grace > 0:
            found.append("connection_age_grace must be > 0")
        return found

    def _partition_problems(self) -> list[str]:
        if self.partitions < 1:
            return ["partitions must be >= 1"]
        if not -1 <= self.partition_index < self.partitions:
            return [f"partition_index {self.partition_index} outside -1..{self.partitions - 1}"]
        if self.partition_addresses and "{index}" not in self.partition_addresses:
            listed = len(self.partition_addresses.split(","))
            if listed != self.partitions:
                return [f"partition_addresses lists {listed} addresses for {self.partitions} partitions"]
        if self.partitions > 1 and self.partition_index == 0 and not self.partition_addresses:
            return ["partition 0 of several announces the layout: give partition_addresses"]
        return []

    @property
    def partition(self) -> int:
        """The partition this process serves (0 when θ is not partitioned)."""
        return max(self.partition_index, 0)

    def partition_address_list(self) -> tuple[str, ...]:
        """How workers reach each partition (empty when unknown: only partition 0 must know)."""
        if not self.partition_addresses:
            return ()
        if "{index}" in self.partition_addresses:
            return tuple(self.partition_addresses.replace("{index}", str(i)) for i in range(self.partitions))
        return tuple(address.strip() for address in self.partition_addresses.split(","))

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
        return min(self.max_message_mb * 1024 * 1024, 2**31 - 1)

    def recorded_settings(self) -> dict[str, Any]:
        """The settings a checkpoint records and compares on restore: the training config and
        how the data is sharded."""
        return {**self.training.as_dict(), "num_shards": self.num_shards}
