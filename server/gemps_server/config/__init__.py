"""Server configuration: a frozen dataclass composed of option groups, one per concern, each a
frozen dataclass in a module of this package with its checks beside it.

The command line (`gemps server`) sets every field by flag or GEMPS_* environment variable, the
training config's fields included (`--learning-rate`, `GEMPS_LEARNING_RATE`) and the options its
rules declare (`--momentum`, `GEMPS_MOMENTUM`: gemps_proto.rule_options); field metadata
carries their help text, choices and ranges (gemps_proto.ranges): every value is checked at
start against what the types it meets can hold, and refused with one line naming it.

ServerConfig inherits its groups, so its attributes stay flat (`config.replica_lease`,
`dataclasses.replace(config, port=0)`, one flag per field) and code that reads one concern can take
that group as its parameter's type (a function of `ReplicationOptions` accepts a ServerConfig).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gemps_proto.ranges import INT32_MAX, RANGE, Range, out_of_range
from gemps_server.config.checkpoints import CheckpointOptions
from gemps_server.config.coordination import CoordinationOptions
from gemps_server.config.limits import ConnectionLimits, DataPlaneLimits, RequestLimits
from gemps_server.config.listen import ListenOptions
from gemps_server.config.observability import ObservabilityOptions
from gemps_server.config.partitions import PartitionOptions
from gemps_server.config.replication import ReplicationOptions
from gemps_server.config.security import SecurityOptions
from gemps_server.config.training import TrainingOptions, WorkerOptions
from gemps_server.domain.rules import with_rule_defaults

__all__ = [
    "CheckpointOptions",
    "ConnectionLimits",
    "CoordinationOptions",
    "DataPlaneLimits",
    "ListenOptions",
    "ObservabilityOptions",
    "PartitionOptions",
    "ReplicationOptions",
    "RequestLimits",
    "SecurityOptions",
    "ServerConfig",
    "TrainingOptions",
    "WorkerOptions",
]


# The bases are listed last group first: a dataclass takes its bases' fields from the last base to
# the first, and this field order is the order of the flags in `gemps server --help`.
@dataclass(frozen=True)
class ServerConfig(
    ConnectionLimits,
    SecurityOptions,
    CheckpointOptions,
    ObservabilityOptions,
    DataPlaneLimits,
    RequestLimits,
    WorkerOptions,
    CoordinationOptions,
    ReplicationOptions,
    PartitionOptions,
    ListenOptions,
    TrainingOptions,
):
    supervisor_pid: int = field(
        default=0,
        metadata={
            "help": "shut down when the process with this id stops being this one's parent (gemps server "
            "--partitions K sets it for its partitions, which then die with it); 0: none",
            RANGE: Range(0, INT32_MAX),
        },
    )

    def __post_init__(self) -> None:
        # Ports left at their default follow --port (config/listen.py); replace() keeps them as set here.
        for name, port in self.followed_ports(self.replication_port, self.metrics_port).items():
            object.__setattr__(self, name, port)
        problems = self.problems()
        if problems:
            raise ValueError("invalid server configuration: " + "; ".join(problems))
        # The config announced, checkpointed and shown carries every option of the rule.
        object.__setattr__(self, "training", with_rule_defaults(self.training))

    def problems(self) -> list[str]:
        """Every group's problems and those of groups together, in the order they have always been
        reported: unknown choices, values outside their ranges, then what the values mean together."""
        found = TrainingOptions.problems(self) + WorkerOptions.problems(self) + ObservabilityOptions.problems(self)
        found += out_of_range(self)
        found += ListenOptions.problems(self) + ConnectionLimits.problems(self) + SecurityOptions.problems(self)
        found += PartitionOptions.problems(self) or self._partition_port_problems()
        # One problem of the replicas at a time, as ReplicationOptions reports them: its credential and TLS
        # count only once this replica's role is sound.
        found += (
            self.replica_role_problems()
            or self.min_in_sync_problems()
            or self._replica_trust_problems()
            or self.job_name_problems()
        )
        found += CoordinationOptions.problems(self) or self.endpoint_problems(self.etcd, self.replicas > 1)
        return found

    def _partition_port_problems(self) -> list[str]:
        """Partition i run here listens on each port + i: the last one must still be a port."""
        if self.partitions <= 1 or self.partition_index != -1:
            return []
        return [
            f"{name} {port} + {self.partitions - 1} (the last partition's) is past 65535"
            for name, port in (("port", self.port), ("data_port", self.data_port))
            if port + self.partitions - 1 > 65535 and port > 0
        ]

    def _replica_trust_problems(self) -> list[str]:
        """What replicas prove themselves to each other with (replication/handshake.py): a secret
        every replica started alone must be given, and with TLS the CA their certificates chain to."""
        if self.replicas <= 1:
            return []
        secret = self.secret_problems()
        if secret:
            return secret
        credential = self.replication_secret_file or self.replication_secret or self.auth_token or self.auth_token_file
        if self.replica_index >= 0 and not credential:
            return [
                f"replica {self.replica_index} started alone has no credential to prove itself to the other "
                "replicas with: give --replication-secret-file (the same secret for every replica of the job; or "
                "GEMPS_REPLICATION_SECRET) or --auth-token/--auth-token-file"
            ]
        if self.tls and not self.tls_client_ca:
            return [
                "replicas with TLS need --tls-client-ca: the CA that signed every replica's --tls-cert (replicas "
                "present it to each other, as client and as server, on the replication stream)"
            ]
        return []

    def recorded_settings(self) -> dict[str, Any]:
        """The settings a checkpoint records and compares on restore: the training config (its
        rule's options by their own names, as checkpoints from before rule_options recorded
        momentum, kappa and pi_max: either compares with the other) and how the data is sharded."""
        return {**self.training.as_dict(), "num_shards": self.num_shards}
