"""ServerMetrics: one server instance's registry and the concerns whose families it holds."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from prometheus_client import CollectorRegistry

from gemps_proto.reasons import Reason
from gemps_proto.schema import TrainingConfig
from gemps_proto.status import GradientNoise, Rounds, WorkerStatus
from gemps_server.domain.rules import ApplyStats
from gemps_server.metrics.commits import CommitMetrics
from gemps_server.metrics.evaluation import EvaluationMetrics
from gemps_server.metrics.info import ServerInfo
from gemps_server.metrics.noise import NoiseMetrics
from gemps_server.metrics.reliability import ReliabilityMetrics
from gemps_server.metrics.rounds import RoundsCollector
from gemps_server.metrics.scaling import ScalingMetrics
from gemps_server.metrics.state import Reading, StateMetrics
from gemps_server.metrics.stragglers import StragglerCollector
from gemps_server.metrics.traffic import TrafficMetrics


class ServerMetrics:
    """A thin composite: each concern declares its families in the one registry (in this order on
    the page) and counts its events; the methods here are the events the server's parts report.
    Replication's series register themselves (gemps_server.replication.metrics).

    A caller on the hot path may record without these methods: the per-commit families are
    attributes of their concern (e.g. `commits.staleness`, `traffic.rpc_duration`), each with
    `child(*label_values)` (resolve once) and `inc`/`observe`/`set`, and `values()`, the calling
    thread's float64 array that compiled code adds into (layout: metrics/accumulators.py)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.info = ServerInfo(self.registry)
        self.commits = CommitMetrics(self.registry)
        self.scaling = ScalingMetrics(self.registry)
        self.traffic = TrafficMetrics(self.registry)
        self.state = StateMetrics(self.registry)
        self.stragglers = StragglerCollector(self.registry)
        self.rounds = RoundsCollector(self.registry)
        self.noise = NoiseMetrics(self.registry)
        self.reliability = ReliabilityMetrics(self.registry)
        self.evaluation = EvaluationMetrics(self.registry)
        # Set by their owners directly: the data plane counts its connections, a restore its version.
        self.data_plane_connections = self.traffic.data_plane_connections
        self.checkpoint_version = self.reliability.checkpoint_version

    # -- wiring ----------------------------------------------------------------------------------

    def describe_server(self, training: TrainingConfig) -> None:
        """The training config as the info metric's labels, one per field (and eta's schedule)."""
        self.state.training = training
        self.info.describe(training)

    def observe(
        self,
        *,
        version: Reading,
        parameters: Reading,
        rule_state_bytes: Reading,
        active_workers: Reading,
        queue_depth: Reading,
        shared_rule_state_bytes: Reading = float,
        reply_copy_bytes: Reading = float,
        reply_copies_unkept: Reading = float,
        gradient_noise: Callable[[], GradientNoise] = GradientNoise,
        workers: Callable[[], Sequence[WorkerStatus]] = tuple,
        rounds: Callable[[], Rounds | None] = lambda: None,
    ) -> None:
        """Gauges that read the live state when scraped, so they can never go stale (eta: the
        described training config's schedule at the live version; the stragglers: `workers`; a
        rule of rounds' progress: `rounds`)."""
        state = (version, parameters, rule_state_bytes, active_workers, queue_depth)
        self.state.observe(*state, shared_rule_state_bytes, reply_copy_bytes, reply_copies_unkept)
        self.noise.observe(gradient_noise, active_workers)
        self.stragglers.observe(workers)
        self.rounds.observe(rounds)

    # -- events ----------------------------------------------------------------------------------

    def applier_ran(self, run_seconds: float, cpu_seconds: float = 0.0) -> None:
        """Called on the applier's thread after every operation it ran (commit or not)."""
        self.commits.applier_ran(run_seconds, cpu_seconds)

    def applied(
        self,
        staleness: int,
        stats: ApplyStats,
        loss: float | None,
        num_samples: int | None,
        queued_seconds: float,
        apply_seconds: float,
    ) -> None:
        self.commits.applied(staleness, loss, num_samples, queued_seconds, apply_seconds)
        self.scaling.applied(stats)

    def rejected(self, reason: Reason) -> None:
        self.commits.rejected(reason)

    def rpc(self, method: str, seconds: float, plane: str = "grpc") -> None:
        self.traffic.rpc(method, seconds, plane)

    def message_received(self, method: str, size: int, plane: str = "grpc") -> None:
        self.traffic.message_received(method, size, plane)

    def message_sent(self, method: str, size: int, plane: str = "grpc") -> None:
        self.traffic.message_sent(method, size, plane)

    def data_plane_refused(self, reason: str) -> None:
        self.traffic.data_plane_refused(reason)

    def tensor_bytes(self, direction: str, dtype: int, size: int) -> None:
        self.traffic.tensor_bytes(direction, dtype, size)

    def registered(self) -> None:
        self.state.registered()

    def shared_shard(self) -> None:
        self.state.shared_shard()

    def departed(self, cause: str, count: int = 1) -> None:
        self.state.departed(cause, count)

    def duplicate(self) -> None:
        self.reliability.duplicate()

    def checkpointed(self, version: int, size: int, seconds: float) -> None:
        self.reliability.checkpointed(version, size, seconds)

    def checkpoint_failed(self) -> None:
        self.reliability.checkpoint_failed()

    def refusal(self, reason: Reason) -> None:
        self.reliability.refusal(reason)

    def evaluated(self, dataset: str, version: int, loss: float, accuracy: float) -> None:
        self.evaluation.evaluated(dataset, version, loss, accuracy)
