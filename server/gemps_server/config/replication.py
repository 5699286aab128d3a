"""The replicas of each partition (DESIGN §3d): how many, which one this process is, the etcd
that elects the primary, and the stream the backups receive the journal on."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from gemps_proto.ranges import DEFAULT_TEXT, PORT, RANGE, Range
from gemps_server.config.listen import FOLLOWS_HELP, FOLLOWS_PORT, REPLICATION_PORT_OFFSET

#: bytes a replication secret holds at least (a generated one: 32 random bytes, as hex)
MIN_SECRET_BYTES = 16


@dataclass(frozen=True)
class ReplicationOptions:
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
        default=FOLLOWS_PORT,
        metadata={
            "help": "port a primary's backups dial to receive its journal (replica r of partition i: this + "
            "i * R + r when run here); 0 picks a free one; " + FOLLOWS_HELP.format(offset=REPLICATION_PORT_OFFSET),
            DEFAULT_TEXT: f"--port + {REPLICATION_PORT_OFFSET}",
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
            "long, and stops acknowledging commits before it is. etcd counts whole seconds (a fraction is rounded "
            "up for it); a replica refuses to start where etcd grants no lease this short (its shortest is 1.5 of "
            "its --election-timeout: 2 s at etcd's default; the private etcd's is 1 s)",
            RANGE: Range(1.0, 3600.0, unit="s"),
        },
    )
    replication_secret_file: str = field(
        default="",
        metadata={
            "help": "file holding the secret every replica of the job shares (the same file contents on every "
            "machine): replicas prove they know it to each other without sending it. Default: a key derived from "
            "--auth-token; `gemps server --replicas R` on one machine generates one; a replica started alone "
            "(--replica-index) without it or a token refuses to start"
        },
    )
    replication_secret: str = field(
        default="",
        metadata={
            "help": "the replication secret itself, instead of --replication-secret-file (as GEMPS_REPLICATION_SECRET, "
            "e.g. from a Kubernetes Secret: a flag's value is visible to every local user)"
        },
    )
    replica_timeout: float = field(
        default=5.0,
        metadata={
            "help": "seconds a backup may leave a forwarded commit unapplied before it is dropped from the "
            "in-sync set (commits wait for it until then), and a quarter of it on average while commits wait on it "
            "for most of twice as long; it is re-seeded when it catches up",
            RANGE: Range(0.1, 3600.0, unit="s"),
        },
    )

    min_in_sync: int = field(
        default=0,
        metadata={
            "help": "replicas (the primary one of them) that must hold a commit before it is acknowledged: the "
            "in-sync set never shrinks below it, so a primary whose backups are out of reach waits for one "
            "rather than acknowledge what too few hold. 1 serves on with the primary alone, whose death then "
            "loses what it acknowledged; 0: half the replicas, rounded up (1 of 2, 2 of 3, 3 of 5)",
            DEFAULT_TEXT: "half of --replicas, rounded up",
            RANGE: Range(0, 9),
        },
    )

    def problems(self) -> list[str]:
        """The first problem of the replica options: each check assumes the ones before it passed."""
        return self.replica_role_problems() or self.min_in_sync_problems() or self.job_name_problems()

    def min_in_sync_problems(self) -> list[str]:
        """More replicas asked to hold a commit than there are: none would ever be acknowledged."""
        if self.replicas > 1 and self.min_in_sync > self.replicas:
            count = self.replicas
            return [f"min_in_sync {self.min_in_sync} is more than the {count} replicas: at most {count}"]
        return []

    def replica_role_problems(self) -> list[str]:
        """Whether this process can learn its role: a replica that exists, and etcd to elect the primary."""
        if self.replica_index >= self.replicas:
            return [f"replica_index {self.replica_index} outside -1..{self.replicas - 1}"]
        if self.replicas > 1 and self.replica_index >= 0 and not self.etcd:
            return [
                "a replica of a replicated partition needs etcd to tell it its role: give etcd (e.g. http://etcd:2379)"
            ]
        return []

    def secret_problems(self) -> list[str]:
        """A replication secret given once, long enough (a file's first 4 KiB are read)."""
        if self.replication_secret and self.replication_secret_file:
            return ["give replication_secret or replication_secret_file, not both"]
        if not (self.replication_secret or self.replication_secret_file):
            return []
        secret = self.replication_secret.encode()
        if self.replication_secret_file:
            path = Path(self.replication_secret_file)
            if not path.is_file():
                return [f"replication_secret_file {self.replication_secret_file!r} is not a readable file"]
            with path.open("rb") as file:
                secret = file.read(4096).strip()
        if len(secret) < MIN_SECRET_BYTES:
            return [f"the replication secret must hold at least {MIN_SECRET_BYTES} bytes (e.g. openssl rand -hex 32)"]
        return []

    def job_name_problems(self) -> list[str]:
        """The job's name names keys in etcd, so replicated jobs keep to what a key may hold."""
        if self.replicas > 1 and not self.job.replace("-", "").replace("_", "").isalnum():
            return [f"job {self.job!r}: letters, digits, '-' and '_' only (it names keys in etcd)"]
        return []

    @property
    def in_sync_floor(self) -> int:
        """--min-in-sync as it applies: half the replicas, rounded up, for 0."""
        return self.min_in_sync or (self.replicas + 1) // 2

    @property
    def replica(self) -> int:
        """The replica of its partition this process is (0 without replicas)."""
        return max(self.replica_index, 0)
