"""The records of Status in plain Python (no protobuf): a server's state as humans and tools see it.

Each type here is the typed face of one message of `gemps.v1` (parameter_server.proto), like
gemps_proto.schema's, and tests/unit/test_schema.py pins them together the same way: the server's
status (`ServerStatus`), its registered workers, its gradient noise estimate, and a replica's
replication (its role, epoch and backups), which metrics and `gemps status` show too.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from gemps_proto.schema import DataPlane, Evaluation, Layout, ParameterSpec, TrainingConfig
from gemps_proto.versions import Versions

#: how far back Status's recent commits look (gemps.v1.RecentCommits), seconds
RECENT_SECONDS = 60.0


@dataclass(frozen=True)
class RecentCommits:
    """Commits applied in the last RECENT_SECONDS, or since the worker registered (or the server
    started) when that is later (gemps.v1.RecentCommits): their rate, reported loss and staleness."""

    seconds: float = 0.0  # the span they cover
    commits: int = 0  # applied in it
    samples: int = 0  # their reported num_samples, summed
    loss_commits: int = 0  # those that reported a finite loss
    loss: float = 0.0  # the mean of those losses (0 when none)
    staleness: float = 0.0  # their mean staleness, in commits (0 when none)
    # How the rule scaled them (GEM's pi; 1 for downpour), averaged over the commits (0 when none):
    scaling_mean: float = 0.0  # mean pi: near 0 for a worker GEM damps
    scaling_at_zero: float = 0.0  # fraction of parameters scaled by 0
    scaling_at_max: float = 0.0  # fraction of parameters clamped at pi_max

    @property
    def rate(self) -> float:
        """Commits a second over the span (0 when it is empty)."""
        return self.commits / self.seconds if self.seconds > 0 else 0.0

    def describe_loss(self) -> str:
        """Like "2.31 (mean of 740 commits' reported loss, last 60s)", or why there is none."""
        span = f"last {self.seconds:.3g}s"
        if not self.loss_commits:
            return f"none reported ({self.commits} commits in the {span} carried no loss)"
        return f"{self.loss:.4g} (mean of {self.loss_commits} commits' reported loss, {span})"


@dataclass(frozen=True)
class WorkerStatus:
    """One registered worker as Status lists it (gemps.v1.WorkerStatus): ages, not clock times,
    so that they need no clock shared with the server."""

    name: str
    shard: int  # its data shard's index: distinct among registered workers
    commits: int  # applied, since it registered
    seconds_since_seen: float  # since its last commit or pull: evicted when past the lease
    seconds_since_commit: float  # since its last commit (or its registration)
    recent: RecentCommits = RecentCommits()  # its commits of the last minute: rate, staleness, pi


def most_damped(workers: Sequence[WorkerStatus], count: int) -> tuple[WorkerStatus, ...]:
    """The `count` workers the rule scaled down most over the last minute: the lowest mean pi
    first (the most stale first among equals), among those that committed in it. Under GEM a
    straggler's commits arrive after the others have moved θ past what its momentum asks for,
    and its pi goes to 0."""
    committed = [worker for worker in workers if worker.recent.commits]
    committed.sort(key=lambda w: (w.recent.scaling_mean, -w.recent.staleness, w.name, w.shard))
    return tuple(committed[:count])


def slowest(workers: Sequence[WorkerStatus], count: int) -> tuple[WorkerStatus, ...]:
    """The `count` workers with the fewest commits a second over the last minute (a worker
    registered but silent: 0), the most stale first among equals."""
    ordered = sorted(workers, key=lambda w: (w.recent.rate, -w.recent.staleness, w.name, w.shard))
    return tuple(ordered[:count])


#: windows measured before the noise scale is estimated: each window's two estimates are noisy
#: (|G|^2's is often negative early on), and the moving averages (about 20 windows' memory) of
#: fewer than this many said "281 workers pay" on a data set of 1,438 samples (issue 43)
MIN_NOISE_WINDOWS = 10


@dataclass(frozen=True)
class GradientNoise:
    """The gradient noise scale the server estimates from gradient commits (gemps.v1.GradientNoise;
    McCandlish et al. 2018, Appendix A): exponential moving averages of |G|^2 (the true gradient's
    squared norm) and tr(Sigma) (the per-sample gradient covariance's trace) over windows of
    consecutive commits, for the values this server holds. Both are sums over parameters, so a
    partitioned θ's are the sums of its partitions' (`combined`).

    B_noise = tr(Sigma)/|G|^2 approximates the critical batch size, past which more samples per
    step stop buying fewer steps; `useful_workers` is B_noise in workers of `batch_size`. There is
    no estimate (NaN, "no estimate") before MIN_NOISE_WINDOWS windows, and none while no worker
    is registered (`missing`).
    """

    gradient_square: float = 0.0  # EMA of the |G|^2 estimates
    noise_trace: float = 0.0  # EMA of the tr(Sigma) estimates
    batch_size: float = 0.0  # B_s per commit (samples): the last window's num_samples (harmonic mean)
    windows: int = 0  # windows measured (0: no estimate yet, or no gradient commits)
    window: int = 0  # commits per window now (k)
    batch_size_assumed: bool = False  # some commits of the last window reported no num_samples: --batch-size stood in

    def missing(self, registered: int | None = None) -> str:
        """Why there is no estimate, "" when there is one: no worker `registered` (when said:
        advice on how many workers pay is about a run under way), no gradient commits, fewer than
        MIN_NOISE_WINDOWS windows (the moving averages of a few windows are mostly noise), or a
        |G|^2 estimate that is not positive."""
        if registered == 0:
            return "no workers registered"
        if self.windows == 0:
            return (
                "no gradient commits measured yet, nor update commits with gradient sums "
                "(LocalSteps and gemps worker send them)"
            )
        if self.windows < MIN_NOISE_WINDOWS:
            return f"{self.windows} of the {MIN_NOISE_WINDOWS} windows of {self.window} commits it needs"
        if not self.gradient_square > 0.0:
            return f"|G|^2 estimate not positive after {self.windows} windows"
        return ""

    @property
    def scale(self) -> float:
        """B_noise in samples; NaN while there is no estimate (`missing`, whoever is registered)."""
        return math.nan if self.missing() else self.noise_trace / self.gradient_square

    @property
    def useful_workers(self) -> float:
        """B_noise / batch_size: how many workers of that batch size pay; NaN without an estimate."""
        return self.scale / self.batch_size if self.batch_size > 0 else math.nan

    @classmethod
    def combined(cls, parts: Sequence[GradientNoise]) -> GradientNoise:
        """The whole of θ from its partitions' estimates (in θ order): squared norms and traces add
        over a split vector; the batch size and window are partition 0's, the windows the fewest."""
        if not parts:
            return cls()
        return cls(
            gradient_square=sum(part.gradient_square for part in parts),
            noise_trace=sum(part.noise_trace for part in parts),
            batch_size=parts[0].batch_size,
            windows=min(part.windows for part in parts),
            window=parts[0].window,
            batch_size_assumed=any(part.batch_size_assumed for part in parts),
        )

    def describe(self, registered: int | None = None) -> str:
        """One line for humans: "noise scale ≈ 900 samples: about 28 workers of batch 32 pay; 4
        registered", saying when the batch is the server's --batch-size rather than the commits'; or
        "noise scale: no estimate (why)"."""
        why = self.missing(registered)
        if why:
            last = self.scale  # with no worker registered: what the estimate was while they committed
            before = f"; the last, while workers committed: ≈ {last:.3g} samples" if math.isfinite(last) else ""
            return f"noise scale: no estimate ({why}{before})"
        batch = f"batch {self.batch_size:g}"
        if self.batch_size_assumed:
            batch += " (the server's --batch-size: commits reported no num_samples)"
        line = f"noise scale ≈ {self.scale:.3g} samples: about {self.useful_workers:.3g} workers of {batch} pay"
        return line if registered is None else f"{line}; {registered} registered"


#: a replica's role (gemps.v1.ReplicationStatus.role): serving workers and forwarding, applying
#: what a primary forwards, or looking for one
PRIMARY, BACKUP, CANDIDATE = "primary", "backup", "candidate"
ROLES = (PRIMARY, BACKUP, CANDIDATE)


@dataclass(frozen=True)
class BackupLag:
    """One backup as its primary sees it (gemps.v1.BackupLag)."""

    name: str
    in_sync: bool  # in the acknowledging (in-sync) set: every commit waits for it
    lag_commits: int  # journal entries forwarded or queued that it has not acknowledged
    lag_seconds: float  # age of the oldest entry it has not acknowledged (0 when none)


@dataclass(frozen=True)
class ReplicationStatus:
    """A replica's role and epoch, and, on a primary, its backups (gemps.v1.ReplicationStatus):
    what metrics, Status and `gemps status` show of a replicated partition."""

    name: str  # this replica's name (unique within its partition)
    role: str  # PRIMARY, BACKUP or CANDIDATE
    epoch: int  # the primary's epoch this replica follows or holds (0: none known)
    replicas: int  # R: how many replicas the partition is meant to have
    primary: str = ""  # the worker-facing address of the primary (on a backup; "" when none known)
    backups: tuple[BackupLag, ...] = field(default=())  # on a primary
    forwarded: int = 0  # journal entries forwarded to backups, over this process's life
    applied: int = 0  # journal entries applied from a primary (on a backup), over this process's life
    failovers: int = 0  # times this replica became primary
    unavailable: str = ""  # why the partition has no primary though this replica runs ("": nothing stops one)

    @property
    def live(self) -> int:
        """Replicas acknowledging commits now: the primary and its in-sync backups (a backup: 0)."""
        return 1 + sum(backup.in_sync for backup in self.backups) if self.role == PRIMARY else 0

    @property
    def under_replicated(self) -> bool:
        """A primary with fewer replicas acknowledging commits than configured: its acknowledged
        commits are held on fewer machines than `--replicas` asks for."""
        return self.role == PRIMARY and self.live < self.replicas


@dataclass(frozen=True)
class RestoredCheckpoint:
    """The checkpoint a server restored when it started (gemps.v1.RestoredCheckpoint)."""

    version: int  # the central version it held
    path: str  # the file, as the server names it


@dataclass(frozen=True)
class Rounds:
    """A rule of rounds' progress (adamw; gemps.v1.Rounds): rounds closed, and the open one."""

    closed: int  # rounds closed since θ was initialised: AdamW steps (outer steps on rounds of updates)
    size: int  # K: the commits the open round closes at, as counted at the last commit, registration or departure
    held: int  # the commits the open round holds


@dataclass(frozen=True)
class ServerStatus:
    """The server's state for humans and tools (gemps.v1.StatusResponse)."""

    initialized: bool
    version: int
    active_workers: int
    num_parameters: int
    config: TrainingConfig
    commits_applied: int
    commits_rejected: int
    spec: tuple[ParameterSpec, ...]
    uptime_seconds: float
    last_evaluation: Evaluation | None
    learning_rate: float = 0.0  # eta at `version`, from the schedule
    buffer_spec: tuple[ParameterSpec, ...] = ()  # the model's buffers (not trained), in wire order
    layout: Layout | None = None  # set when θ is partitioned: the figures above are this partition's
    workers: tuple[WorkerStatus, ...] = ()  # the registered workers, by shard
    lease_ttl_seconds: float = 0.0  # a worker unseen this long is evicted (0: not said)
    gradient_noise: GradientNoise = field(default_factory=GradientNoise)  # this partition's sums
    replication: ReplicationStatus | None = None  # set when the partition is replicated: this replica's
    data_plane: DataPlane | None = None  # where this server's data plane listens (no ticket); None: off
    versions: Versions | None = None  # the server's software and protocol versions; None: not said
    memory_budget_bytes: int = 0  # what the rule's per-worker state may take here (0: no budget)
    rule_state_bytes: int = 0  # what the registered workers' rule state takes now
    gem_state: str = ""  # how GEM keeps each worker's state: "exact" or "compact" ("" for the other rules)
    worker_state_bytes: int = 0  # one registered worker's rule state
    shared_rule_state_bytes: int = 0  # what the rule keeps for the workers together (compact GEM's references)
    recent: RecentCommits = RecentCommits()  # commits of the last minute: the rate, training loss, staleness
    restored: RestoredCheckpoint | None = None  # the checkpoint restored at start (None: it started without one)
    job: str = ""  # the job whose θ this server holds ("" until θ is initialised; RegisterResponse.job)
    rounds: Rounds | None = None  # a rule of rounds' (adamw): None for the other rules, and servers before it
