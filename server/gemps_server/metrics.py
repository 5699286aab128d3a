"""Prometheus metrics of one server instance (its own registry, so several can share a process).

Names follow Prometheus conventions: base units (`_seconds`, `_bytes`, `_ratio`), `_total` on
counters, and no per-worker labels anywhere: label values come from small fixed sets (outcome,
rejection reason, RPC method, phase, ...), so 100 workers cost no more series than one.
docs/OBSERVABILITY.md lists every metric with the dashboard panel that shows it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, Summary
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.process_collector import ProcessCollector

from gemps_proto.reasons import Reason
from gemps_proto.schedules import learning_rate_at
from gemps_proto.schema import TrainingConfig
from gemps_proto.status import PRIMARY, ROLES, GradientNoise, ReplicationStatus
from gemps_proto.v1 import parameter_server_pb2 as pb
from gemps_server.domain.rules import ApplyStats

# Staleness in updates: fine where most commits land (0..16 at 10 workers), up to a few hundred
# (100 workers) and beyond.
STALENESS_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 1024)
# GEM's pi is clamped to [0, pi_max] (default 5); the other rules scale by 1 or 1/(tau+1).
SCALING_BUCKETS = (0.0, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 4.0, 5.0, 10.0)
RATIO_BUCKETS = (0.0, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)
DURATION_BUCKETS = (
    1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3,
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip

# Why a commit can be refused (gemps_proto.reasons). Their series exist from the start at 0, so
# "rejected by reason" panels and rate() show 0 rather than nothing.
COMMIT_REJECTION_REASONS = tuple(reason.value for reason in Reason)
RPC_METHODS = tuple(method.name for method in pb.DESCRIPTOR.services_by_name["ParameterServer"].methods)
# Which door a request came through (DESIGN §3c): every gRPC method, and the data plane's two calls.
PLANES = ("grpc", "data")
DATA_PLANE_METHODS = ("Commit", "Pull")
PLANE_METHODS = tuple(("grpc", method) for method in RPC_METHODS) + tuple(("data", m) for m in DATA_PLANE_METHODS)
# Why the data plane closed a connection before or between requests (its requests' own refusals
# count like gRPC's: gemps_commits_total, the rejected log line).
DATA_PLANE_REFUSALS = (
    "bad_frame",  # not a frame of this protocol (magic, version, op, flags, lengths)
    "bad_hello",  # a first frame that is not a well-formed HELLO
    "unauthenticated",  # a ticket that is not the worker's registration's, or another worker's request
    "unknown_worker",  # a HELLO for a worker not registered
    "handshake_timeout",  # TLS handshake and HELLO not done within --data-plane-hello-timeout
    "unproven_limit",  # closed without a HELLO for a newcomer, past --max-unproven-data-connections
    "tls",  # a TLS handshake that failed (no or a wrong client certificate, not TLS at all)
    "idle_timeout",  # no request for --connection-idle-timeout
    "stream_timeout",  # a frame, or a reply, stalled for --stream-idle-timeout
    "too_many_connections",  # past --max-data-connections
    "refused_unread",  # a request refused before its payload was read: the connection is closed
    "slow_upload",  # a payload too slow for the fast lane, and no slow-upload buffer free (refused unread)
    "bad_attach",  # shared memory refused: not one sealed memfd of θ's size, not local, or twice
)
DEPARTURE_CAUSES = ("left", "evicted")
CHECKPOINT_OUTCOMES = ("written", "failed")
# Requests refused before reaching a handler's logic: no or a wrong token, registration rate, a
# budget of calls in progress (--max-concurrent-rpcs, --max-unauthenticated-rpcs, Watch streams).
REFUSAL_REASONS = tuple(
    reason.value
    for reason in (
        Reason.UNAUTHENTICATED,
        Reason.REGISTRATION_RATE,
        Reason.BUSY,
        Reason.UNAUTHENTICATED_LIMIT,
        Reason.WATCH_LIMIT,
    )
)
# Longest `dataset` label value taken from an evaluator's report.
MAX_DATASET_LABEL = 64
# Distinct `dataset` label values kept; reports naming further datasets go under "other", so a
# client cannot grow the server's series (and memory) without bound.
MAX_DATASET_LABELS = 8


Reading = Callable[[], float]
ReplicationReading = Callable[[], ReplicationStatus | None]


class Labelled:
    """The metrics of `registry` with constant labels added to every sample, e.g. the partition
    of θ a server holds (`partition="1"`): K partitions scraped as one target (gemps server
    --partitions K) or as K pods still give one series per partition."""

    def __init__(self, registry: CollectorRegistry, labels: Mapping[str, str]) -> None:
        self._registry = registry
        self._labels = dict(labels)

    def collect(self) -> Iterator[Metric]:
        for family in self._registry.collect():
            labelled = Metric(family.name, family.documentation, family.type, family.unit)
            labelled.samples = [sample._replace(labels={**sample.labels, **self._labels}) for sample in family.samples]
            yield labelled


def exposed(registry: CollectorRegistry, labels: Mapping[str, str]) -> CollectorRegistry:
    """What to serve on /metrics: `registry` itself, or with `labels` added when there are any."""
    if not labels:
        return registry
    outer = CollectorRegistry(auto_describe=True)
    outer.register(Labelled(registry, labels))
    return outer


class ReplicationCollector:
    """A replica's replication series, built from its status record at each scrape: a backup
    gone from the record is gone from the page (no stale `backup` label), and nothing at all is
    exported while the provider says None (the partition is not replicated). The `backup` label
    takes the names of the partition's R-1 backups: a small set, like the other labels here."""

    def __init__(self, provider: ReplicationReading) -> None:
        self._provider = provider

    def collect(self) -> Iterator[Metric]:
        status = self._provider()
        if status is None:
            return
        yield from _replica_families(status)
        if status.role == PRIMARY:  # what only a primary knows: its backups
            yield from _primary_families(status)
        yield from _replication_counters(status)


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, value=value)


def _replica_families(status: ReplicationStatus) -> Iterator[Metric]:
    # Every role's series, 1 for the current one: a role change flips values, series never vanish.
    role = GaugeMetricFamily(
        "gemps_replica_role",
        "This replica's role: 1 for the current one (primary, backup, candidate).",
        labels=["role"],
    )
    for name in ROLES:
        role.add_metric([name], float(status.role == name))
    yield role
    yield _gauge(
        "gemps_replica_epoch", "The primary's epoch this replica holds or follows (0: none known).", status.epoch
    )
    yield _gauge("gemps_replicas_configured", "Replicas the partition is meant to have (R).", status.replicas)


def _primary_families(status: ReplicationStatus) -> Iterator[Metric]:
    yield _gauge(
        "gemps_replicas_live",
        "Replicas acknowledging commits, as the primary counts them: itself and its in-sync backups.",
        status.live,
    )
    yield _gauge(
        "gemps_partition_under_replicated",
        "1 while fewer replicas acknowledge commits than configured (live < R), as the primary sees it.",
        float(status.under_replicated),
    )
    lag_commits = GaugeMetricFamily(
        "gemps_replication_lag_commits",
        "Journal entries forwarded or queued that a backup has not acknowledged.",
        labels=["backup"],
    )
    lag_seconds = GaugeMetricFamily(
        "gemps_replication_lag_seconds",
        "Age of the oldest journal entry a backup has not acknowledged (0 when none).",
        labels=["backup"],
    )
    in_sync = GaugeMetricFamily(
        "gemps_replication_in_sync", "1 while a backup is in the in-sync set (commits wait for it).", labels=["backup"]
    )
    for backup in status.backups:
        lag_commits.add_metric([backup.name], backup.lag_commits)
        lag_seconds.add_metric([backup.name], backup.lag_seconds)
        in_sync.add_metric([backup.name], float(backup.in_sync))
    yield from (lag_commits, lag_seconds, in_sync)


def _replication_counters(status: ReplicationStatus) -> Iterator[Metric]:
    # Counts over the process's life, as the record keeps them: counters (a restart resets them).
    yield CounterMetricFamily(
        "gemps_replication_forwarded", "Journal entries this replica forwarded to backups.", value=status.forwarded
    )
    yield CounterMetricFamily(
        "gemps_replication_applied", "Journal entries this replica applied from a primary.", value=status.applied
    )
    yield CounterMetricFamily("gemps_failovers", "Times this replica became primary.", value=status.failovers)


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        ProcessCollector(registry=r)  # process_cpu_seconds_total, process_resident_memory_bytes, ...
        self.info = Info("gemps_server", "The training config the server announces.", registry=r)

        # -- commits ------------------------------------------------------------------------
        self.commits = Counter(
            "gemps_commits",
            "Commits by outcome (applied/rejected) and rejection reason.",
            ["outcome", "reason"],
            registry=r,
        )
        # The hot path's labelled series, looked up once (labels() costs microseconds a call).
        self._applied = self.commits.labels("applied", "")
        for reason in COMMIT_REJECTION_REASONS:
            self.commits.labels("rejected", reason)
        self.staleness = Histogram(
            "gemps_commit_staleness",
            "Staleness tau of applied commits: commits applied since the one the worker computed on.",
            buckets=STALENESS_BUCKETS,
            registry=r,
        )
        self.samples = Counter(
            "gemps_training_samples", "Training samples behind applied commits, as workers report them.", registry=r
        )
        self.training_loss = Summary(
            "gemps_training_loss",
            "Training (mini-batch) loss workers report with their commits.",
            registry=r,
        )
        self.commit_duration = Histogram(
            "gemps_commit_duration_seconds",
            "Applied commits by phase: queue_wait (FIFO queue before the applier) and apply (the rule).",
            ["phase"],
            buckets=DURATION_BUCKETS,
            registry=r,
        )
        self._queue_wait = self.commit_duration.labels("queue_wait")
        self._apply = self.commit_duration.labels("apply")
        self.applier_busy = Counter(
            "gemps_applier_busy_seconds",
            "Time the single applier thread spent running operations (rate: its utilisation, 0..1).",
            registry=r,
        )

        # -- the commit rule's scaling (GEM's pi; constant for the other rules) ---------------
        self.scaling = Histogram(
            "gemps_scaling_factor",
            "Mean per-parameter scaling (GEM's pi) of each applied commit.",
            buckets=SCALING_BUCKETS,
            registry=r,
        )
        self.scaling_median_per_commit = Histogram(
            "gemps_commit_median_scaling_factor",
            "Median per-parameter scaling (GEM's pi) of each applied commit.",
            buckets=SCALING_BUCKETS,
            registry=r,
        )
        self.clamped = Histogram(
            "gemps_commit_clamped_ratio",
            "Fraction of parameters whose scaling sits at a bound (zero: pi=0, max: pi=pi_max), per commit.",
            ["bound"],
            buckets=RATIO_BUCKETS,
            registry=r,
        )
        self._at_zero = self.clamped.labels("zero")
        self._at_max = self.clamped.labels("max")
        self.scaling_median = Gauge(
            "gemps_scaling_factor_median", "Median per-parameter scaling of the last commit.", registry=r
        )
        self.scaling_at_zero = Gauge(
            "gemps_scaling_factor_at_zero_ratio",
            "Fraction of parameters scaled by 0 in the last commit.",
            registry=r,
        )
        self.scaling_at_max = Gauge(
            "gemps_scaling_factor_at_max_ratio",
            "Fraction of parameters clamped at pi_max in the last commit.",
            registry=r,
        )
        self.energy = Summary(
            "gemps_gem_energy",
            "GEM's compliance condition per commit, averaged over parameters: side=proxy is kappa*|m_i|, "
            "side=central is |theta - s_i| + pi*|Delta| (the central variable's movement over the "
            "worker's round trip).",
            ["side"],
            registry=r,
        )

        # -- RPCs and traffic -----------------------------------------------------------------
        self.rpc_duration = Histogram(
            "gemps_rpc_duration_seconds",
            "Server-side handling time per RPC, by method and plane (grpc, data); a Commit's includes queue "
            "wait and apply.",
            ["method", "plane"],
            buckets=DURATION_BUCKETS,
            registry=r,
        )
        self.received = Counter(
            "gemps_received_bytes",
            "Request bytes received, by RPC method and plane (grpc: messages; data: frames).",
            ["method", "plane"],
            registry=r,
        )
        self.sent = Counter(
            "gemps_sent_bytes",
            "Response bytes sent, by RPC method and plane (grpc: messages; data: frames).",
            ["method", "plane"],
            registry=r,
        )
        self._rpc_duration = {(p, m): self.rpc_duration.labels(m, p) for p, m in PLANE_METHODS}
        self._received = {(p, m): self.received.labels(m, p) for p, m in PLANE_METHODS}
        self._sent = {(p, m): self.sent.labels(m, p) for p, m in PLANE_METHODS}
        self.data_plane_refusals = Counter(
            "gemps_data_plane_refusals",
            "Data-plane connections closed by a guard, by reason (bad frame or hello, ticket, timeouts, "
            "connection limits, a request refused before its payload was read, a slow upload without room).",
            ["reason"],
            registry=r,
        )
        for reason in DATA_PLANE_REFUSALS:
            self.data_plane_refusals.labels(reason)
        self.data_plane_connections = Gauge("gemps_data_plane_connections", "Open data-plane connections.", registry=r)

        # -- workers and the central variable -------------------------------------------------
        self.registrations = Counter("gemps_registrations", "Workers that registered.", registry=r)
        self.departures = Counter(
            "gemps_departures", "Workers gone, by cause (left, or evicted after lease expiry).", ["cause"], registry=r
        )
        for cause in DEPARTURE_CAUSES:
            self.departures.labels(cause)
        self.active_workers = Gauge("gemps_active_workers", "Registered workers holding a lease.", registry=r)
        self.version = Gauge("gemps_central_version", "Commits applied to the central variable.", registry=r)
        self.learning_rate = Gauge(
            "gemps_learning_rate",
            "eta at the current central version, from the learning-rate schedule: what the next gradient "
            "commit is scaled by.",
            registry=r,
        )
        self._training = TrainingConfig()  # the announced config (describe_server), for eta's schedule
        self.parameters = Gauge("gemps_parameters", "Parameters in the central variable (0 until set).", registry=r)
        self.rule_state = Gauge(
            "gemps_rule_state_bytes", "Memory the commit rule keeps (GEM: 2 vectors per active worker).", registry=r
        )
        self.queue_depth = Gauge("gemps_queue_depth", "Operations waiting for the applier.", registry=r)

        # -- the gradient noise scale (domain/noise.py), for the values this server holds -------
        # With partitions each one's are its slice's: the whole model's B_noise is
        # sum(gemps_gradient_noise_trace) / sum(gemps_gradient_square) over partitions.
        self.noise_scale = Gauge(
            "gemps_gradient_noise_scale",
            "Gradient noise scale B_noise = tr(Sigma)/|G|^2 in samples, from gradient commits (NaN until "
            "estimated): about the critical batch size.",
            registry=r,
        )
        self.useful_workers = Gauge(
            "gemps_useful_workers",
            "B_noise / gemps_gradient_noise_batch_size: how many workers of that batch size pay (NaN until estimated).",
            registry=r,
        )
        self.noise_batch_size = Gauge(
            "gemps_gradient_noise_batch_size",
            "Samples per commit the noise scale assumes (the workers' reported num_samples, else the batch size).",
            registry=r,
        )
        self.gradient_square = Gauge(
            "gemps_gradient_square",
            "Moving average of the |G|^2 estimates (the noise scale's denominator).",
            registry=r,
        )
        self.noise_trace = Gauge(
            "gemps_gradient_noise_trace",
            "Moving average of the tr(Sigma) estimates (the noise scale's numerator).",
            registry=r,
        )

        # -- reliability and security ----------------------------------------------------------
        self.duplicates = Counter(
            "gemps_duplicate_commits",
            "Retried commits recognised by request id and answered without applying them again.",
            registry=r,
        )
        self.checkpoints = Counter(
            "gemps_checkpoints", "Checkpoint writes by outcome (written, failed).", ["outcome"], registry=r
        )
        for outcome in CHECKPOINT_OUTCOMES:
            self.checkpoints.labels(outcome)
        self.checkpoint_duration = Histogram(
            "gemps_checkpoint_duration_seconds",
            "Time to write one checkpoint (serialise, fsync, rename).",
            buckets=DURATION_BUCKETS,
            registry=r,
        )
        self.checkpoint_version = Gauge(
            "gemps_checkpoint_version", "Central version of the newest checkpoint written or restored.", registry=r
        )
        self.checkpoint_bytes = Gauge("gemps_checkpoint_bytes", "Size of the newest checkpoint written.", registry=r)
        self.refused = Counter(
            "gemps_refused_requests",
            "Requests refused by a guard: reason=unauthenticated (bad or no token), registration_rate, busy "
            "(--max-concurrent-rpcs), unauthenticated_limit (--max-unauthenticated-rpcs), watch_limit.",
            ["reason"],
            registry=r,
        )
        for reason in REFUSAL_REASONS:
            self.refused.labels(reason)

        # -- the evaluator's held-out figures (series appear with the first report) -------------
        self.held_out_loss = Gauge(
            "gemps_heldout_loss", "Evaluator's held-out loss of the central variable.", ["dataset"], registry=r
        )
        self.held_out_accuracy = Gauge(
            "gemps_heldout_accuracy_ratio",
            "Evaluator's held-out accuracy (0..1) of the central variable.",
            ["dataset"],
            registry=r,
        )
        self._datasets: set[str] = set()
        self.evaluated_version = Gauge(
            "gemps_heldout_evaluated_version",
            "Central version the last evaluation measured.",
            ["dataset"],
            registry=r,
        )

    # -- wiring ----------------------------------------------------------------------------------

    def describe_server(self, training: TrainingConfig) -> None:
        """The training config as the info metric's labels, one per field."""
        self._training = training
        values = training.as_dict().items()
        self.info.info({key: f"{value:g}" if isinstance(value, float) else str(value) for key, value in values})

    def observe(
        self,
        *,
        version: Reading,
        parameters: Reading,
        rule_state_bytes: Reading,
        active_workers: Reading,
        queue_depth: Reading,
        gradient_noise: Callable[[], GradientNoise] = GradientNoise,
    ) -> None:
        """Gauges that read the live state when scraped, so they can never go stale (eta: the
        described training config's schedule at the live version)."""
        self.version.set_function(version)
        self.learning_rate.set_function(lambda: learning_rate_at(self._training, int(version())))
        self.parameters.set_function(parameters)
        self.rule_state.set_function(rule_state_bytes)
        self.active_workers.set_function(active_workers)
        self.queue_depth.set_function(queue_depth)
        self.noise_scale.set_function(lambda: gradient_noise().scale)
        self.useful_workers.set_function(lambda: gradient_noise().useful_workers)
        self.noise_batch_size.set_function(lambda: gradient_noise().batch_size)
        self.gradient_square.set_function(lambda: gradient_noise().gradient_square)
        self.noise_trace.set_function(lambda: gradient_noise().noise_trace)

    def replication(self, provider: ReplicationReading) -> None:
        """Export this replica's replication series (ReplicationCollector), read from `provider` at
        each scrape; call once, when the partition is replicated."""
        self.registry.register(ReplicationCollector(provider))

    # -- events ----------------------------------------------------------------------------------

    def applier_ran(self, run_seconds: float) -> None:
        """Called on the applier's thread after every operation it ran (commit or not)."""
        self.applier_busy.inc(run_seconds)

    def applied(
        self,
        staleness: int,
        stats: ApplyStats,
        loss: float | None,
        num_samples: int | None,
        queued_seconds: float,
        apply_seconds: float,
    ) -> None:
        self._applied.inc()
        self.staleness.observe(staleness)
        self._queue_wait.observe(queued_seconds)
        self._apply.observe(apply_seconds)
        self.scaling.observe(stats.scaling_mean)
        self.scaling_median_per_commit.observe(stats.scaling_median)
        self._at_zero.observe(stats.fraction_at_zero)
        self._at_max.observe(stats.fraction_at_max)
        self.scaling_median.set(stats.scaling_median)
        self.scaling_at_zero.set(stats.fraction_at_zero)
        self.scaling_at_max.set(stats.fraction_at_max)
        if math.isfinite(stats.proxy_energy) and math.isfinite(stats.central_energy):
            self.energy.labels("proxy").observe(stats.proxy_energy)  # series only for rules with energies
            self.energy.labels("central").observe(stats.central_energy)
        if loss is not None and math.isfinite(loss):
            self.training_loss.observe(loss)
        if num_samples:
            self.samples.inc(num_samples)

    def rejected(self, reason: Reason) -> None:
        self.commits.labels("rejected", reason.value).inc()

    def rpc(self, method: str, seconds: float, plane: str = "grpc") -> None:
        self._rpc_duration[plane, method].observe(seconds)

    def message_received(self, method: str, size: int, plane: str = "grpc") -> None:
        self._received[plane, method].inc(size)

    def message_sent(self, method: str, size: int, plane: str = "grpc") -> None:
        self._sent[plane, method].inc(size)

    def data_plane_refused(self, reason: str) -> None:
        self.data_plane_refusals.labels(reason).inc()

    def registered(self) -> None:
        self.registrations.inc()

    def departed(self, cause: str, count: int = 1) -> None:
        if count:
            self.departures.labels(cause).inc(count)

    def duplicate(self) -> None:
        self.duplicates.inc()

    def checkpointed(self, version: int, size: int, seconds: float) -> None:
        self.checkpoints.labels("written").inc()
        self.checkpoint_duration.observe(seconds)
        self.checkpoint_version.set(version)
        self.checkpoint_bytes.set(size)

    def checkpoint_failed(self) -> None:
        self.checkpoints.labels("failed").inc()

    def refusal(self, reason: Reason) -> None:
        self.refused.labels(reason.value).inc()

    def evaluated(self, dataset: str, version: int, loss: float, accuracy: float) -> None:
        label = (dataset or "unknown")[:MAX_DATASET_LABEL]
        if label not in self._datasets:
            if len(self._datasets) >= MAX_DATASET_LABELS:
                label = "other"
            self._datasets.add(label)
        self.evaluated_version.labels(label).set(version)
        self.held_out_loss.labels(label).set(loss)
        self.held_out_accuracy.labels(label).set(accuracy)
