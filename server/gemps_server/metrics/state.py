"""The server's live state: its workers (registrations, departures, leases) and the central
variable θ (version, eta at that version, size, the rule's memory, the applier's queue)."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge

from gemps_proto.schedules import learning_rate_at
from gemps_proto.schema import TrainingConfig

DEPARTURE_CAUSES = ("left", "evicted")

Reading = Callable[[], float]


class StateMetrics:
    """Counters of worker churn, and gauges read from the live state at each scrape."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registrations = Counter("gemps_registrations", "Workers that registered.", registry=registry)
        self.departures = Counter(
            "gemps_departures",
            "Workers gone, by cause (left, or evicted after lease expiry).",
            ["cause"],
            registry=registry,
        )
        for cause in DEPARTURE_CAUSES:
            self.departures.labels(cause)
        self.shared_shards = Counter(
            "gemps_shared_shard_registrations",
            "Registrations given a data shard another registered worker holds (more workers than --num-shards): "
            "the two read the same batches.",
            registry=registry,
        )
        self.active_workers = Gauge("gemps_active_workers", "Registered workers holding a lease.", registry=registry)
        self.version = Gauge("gemps_central_version", "Commits applied to the central variable.", registry=registry)
        self.learning_rate = Gauge(
            "gemps_learning_rate",
            "eta at the current central version, from the learning-rate schedule: what the next gradient "
            "commit is scaled by.",
            registry=registry,
        )
        self.training = TrainingConfig()  # the announced config (describe_server), for eta's schedule
        self.parameters = Gauge(
            "gemps_parameters", "Parameters in the central variable (0 until set).", registry=registry
        )
        self.rule_state = Gauge(
            "gemps_rule_state_bytes",
            "Memory the commit rule keeps for the registered workers (GEM: 8 bytes per worker per parameter, "
            "--gem-state compact about 2).",
            registry=registry,
        )
        self.shared_rule_state = Gauge(
            "gemps_rule_shared_state_bytes",
            "Memory the commit rule keeps for its workers together, whatever their number (--gem-state compact: "
            "two copies of the central variable its workers' states point into; 0 otherwise).",
            registry=registry,
        )
        self.reply_copies = Gauge(
            "gemps_reply_copy_bytes",
            "Memory the server keeps of the copies of the central variable that difference-reply workers hold "
            "(Client(reply_compression=...): 2 bytes per parameter per such worker).",
            registry=registry,
        )
        self.reply_copies_unkept = Gauge(
            "gemps_reply_copies_unkept",
            "Commit replies sent whole without keeping the worker's copy since the server started: the memory "
            "budget (--memory-budget-mb) had no room for it beside the workers' rule state.",
            registry=registry,
        )
        self.queue_depth = Gauge("gemps_queue_depth", "Operations waiting for the applier.", registry=registry)

    def observe(
        self,
        version: Reading,
        parameters: Reading,
        rule_state: Reading,
        active_workers: Reading,
        queue: Reading,
        shared_rule_state: Reading = float,
        reply_copies: Reading = float,
        reply_copies_unkept: Reading = float,
    ) -> None:
        """Read the live state when scraped, so the gauges never go stale (eta: the announced
        training config's schedule at the live version)."""
        self.version.set_function(version)
        self.learning_rate.set_function(lambda: learning_rate_at(self.training, int(version())))
        self.parameters.set_function(parameters)
        self.rule_state.set_function(rule_state)
        self.shared_rule_state.set_function(shared_rule_state)
        self.reply_copies.set_function(reply_copies)
        self.reply_copies_unkept.set_function(reply_copies_unkept)
        self.active_workers.set_function(active_workers)
        self.queue_depth.set_function(queue)

    def registered(self) -> None:
        self.registrations.inc()

    def shared_shard(self) -> None:
        self.shared_shards.inc()

    def departed(self, cause: str, count: int = 1) -> None:
        if count:
            self.departures.labels(cause).inc(count)
