"""Server metrics: GEM's energies against a plain reference, and the exposition's label hygiene."""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gemps_proto.schema import PayloadKind, TrainingConfig
from gemps_proto.status import RecentCommits, WorkerStatus
from gemps_proto.tensor_codec import FLOAT32, INT8_BLOCK
from gemps_server.domain.rules import ApplyStats, create_rule, rule_names
from gemps_server.domain.rules.base import StepContext
from gemps_server.metrics import COMMIT_REJECTION_REASONS, MAX_DATASET_LABEL, ServerMetrics, exposed
from gemps_server.replication.metrics import ReplicationCollector
from gemps_server.replication.status import BACKUP, PRIMARY, BackupLag, ReplicationStatus
from tests.helpers import training

F32 = np.float32
P = 300


def reference_energies(
    theta: np.ndarray, seen: np.ndarray, proxy: np.ndarray, delta: np.ndarray, kappa: float, pi_max: float
) -> tuple[float, float]:
    """DESIGN §1 written out: proxy = mean kappa*|m|, central = mean |theta - s| + pi*|Delta|."""
    movement = np.abs(theta - seen)
    pi = np.clip((F32(kappa) * np.abs(proxy) - movement) / (np.abs(delta) + F32(1e-16)), 0, pi_max)
    return float(np.mean(F32(kappa) * np.abs(proxy))), float(np.mean(movement + pi * np.abs(delta)))


@pytest.mark.parametrize("kappa,pi_max,momentum", [(1.0, 5.0, 0.9), (2.0, 2.0, 0.5)])
def test_gem_energies_match_the_reference(kappa: float, pi_max: float, momentum: float) -> None:
    rng = np.random.default_rng(3)
    rule = create_rule(training("gem", learning_rate=0.05, momentum=momentum, kappa=kappa, pi_max=pi_max), P)
    theta = rng.normal(size=P).astype(F32)
    workers = ["a", "b", "c"]
    proxies = {w: np.zeros(P, F32) for w in workers}
    seen = {w: theta.copy() for w in workers}
    for w in workers:
        rule.add_worker(w, theta)
    for step in range(60):
        w = workers[step % 3 if step % 7 else 0]
        delta = (rng.normal(size=P) * 0.05).astype(F32)
        proxies[w] = F32(momentum) * proxies[w] + delta
        expected = reference_energies(theta, seen[w], proxies[w], delta, kappa, pi_max)
        seen[w] = theta.copy()
        theta, stats = rule.step(theta, delta.copy(), StepContext(w, 0, kind=PayloadKind.UPDATE))
        assert stats.proxy_energy == pytest.approx(expected[0], rel=1e-4)
        assert stats.central_energy == pytest.approx(expected[1], rel=1e-4)


def test_a_first_commit_complies_exactly() -> None:
    # No central movement yet and m = Delta: pi = kappa (below the clamp), so central = proxy.
    rule = create_rule(training("gem", kappa=2.0), 4)
    theta = np.zeros(4, F32)
    rule.add_worker("a", theta)
    theta, stats = rule.step(theta, np.array([0.1, -0.2, 0.3, 0.4], F32), StepContext("a", 0, kind=PayloadKind.UPDATE))
    assert stats.proxy_energy == pytest.approx(2 * 0.25)
    assert stats.central_energy == pytest.approx(stats.proxy_energy)


def test_central_energy_exceeds_the_proxy_when_others_overshot() -> None:
    rule = create_rule(training("gem", momentum=0.0), 3)
    theta = np.zeros(3, F32)
    rule.add_worker("a", theta)
    rule.add_worker("b", theta)
    for _ in range(5):
        theta, _ = rule.step(theta, np.full(3, 1.0, F32), StepContext("a", 0, kind=PayloadKind.UPDATE))
    theta, stats = rule.step(theta, np.full(3, 0.5, F32), StepContext("b", 5, kind=PayloadKind.UPDATE))
    assert stats.fraction_at_zero == 1.0
    assert stats.proxy_energy == pytest.approx(0.5)
    assert stats.central_energy > stats.proxy_energy  # pi = 0: the others' movement alone


@pytest.mark.parametrize("rule_name", [name for name in rule_names() if name != "gem"])
def test_rules_without_a_proxy_report_no_energy(rule_name: str) -> None:
    rule = create_rule(training(rule_name), 3)
    theta = np.zeros(3, F32)
    rule.add_worker("a", theta)
    theta, stats = rule.step(theta, np.ones(3, F32), StepContext("a", 1, kind=PayloadKind.UPDATE))
    assert math.isnan(stats.proxy_energy) and math.isnan(stats.central_energy)
    metrics = ServerMetrics()
    metrics.applied(1, stats, loss=None, num_samples=None, queued_seconds=0.0, apply_seconds=0.0)
    assert "gemps_gem_energy_count" not in generate_latest(metrics.registry).decode()


def samples(metrics: ServerMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = generate_latest(metrics.registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_applied_commit_updates_every_per_commit_series() -> None:
    metrics = ServerMetrics()
    stats = ApplyStats.of(np.array([0.0, 0.0, 1.0, 5.0], F32), 5.0, proxy_energy=0.2, central_energy=0.3)
    metrics.applied(7, stats, loss=0.25, num_samples=64, queued_seconds=0.001, apply_seconds=0.002)
    metrics.applied(1, stats, loss=float("nan"), num_samples=None, queued_seconds=0.001, apply_seconds=0.002)
    got = samples(metrics)
    assert got[("gemps_commits_total", (("outcome", "applied"), ("reason", "")))] == 2
    assert got[("gemps_commit_staleness_sum", ())] == 8
    assert got[("gemps_training_loss_count", ())] == 1  # the NaN loss is not averaged in
    assert got[("gemps_training_samples_total", ())] == 64
    assert got[("gemps_commit_clamped_ratio_sum", (("bound", "zero"),))] == pytest.approx(2 * 0.5)
    assert got[("gemps_commit_clamped_ratio_sum", (("bound", "max"),))] == pytest.approx(2 * 0.25)
    assert got[("gemps_commit_median_scaling_factor_sum", ())] == pytest.approx(2 * 0.5)
    assert got[("gemps_gem_energy_sum", (("side", "central"),))] == pytest.approx(0.6)
    assert got[("gemps_commit_duration_seconds_count", (("phase", "apply"),))] == 2


def test_series_exist_before_anything_happens_so_rates_read_zero() -> None:
    got = samples(ServerMetrics())
    for reason in COMMIT_REJECTION_REASONS:
        assert got[("gemps_commits_total", (("outcome", "rejected"), ("reason", reason)))] == 0
    assert got[("gemps_departures_total", (("cause", "evicted"),))] == 0
    assert got[("gemps_received_bytes_total", (("method", "Commit"), ("plane", "grpc")))] == 0
    assert got[("gemps_received_bytes_total", (("method", "Commit"), ("plane", "data")))] == 0
    assert got[("gemps_data_plane_refusals_total", (("reason", "bad_hello"),))] == 0
    # ... but no held-out figure until an evaluator reports one (0 would read as a perfect loss).
    assert not any(name.startswith("gemps_heldout") for name, _ in got)


def test_wire_bytes_are_counted_by_direction_and_encoding() -> None:
    metrics = ServerMetrics()
    metrics.tensor_bytes("received", INT8_BLOCK, 1040)
    metrics.tensor_bytes("sent", FLOAT32, 4096)
    got = samples(metrics)
    assert got[("gemps_wire_bytes_total", (("direction", "received"), ("encoding", "int8")))] == 1040
    assert got[("gemps_wire_bytes_total", (("direction", "sent"), ("encoding", "float32")))] == 4096
    assert got[("gemps_wire_bytes_total", (("direction", "received"), ("encoding", "int4")))] == 0


def test_labels_come_from_small_fixed_sets() -> None:
    metrics = ServerMetrics()
    metrics.describe_server(TrainingConfig())
    metrics.rpc("Pull", 0.001)
    metrics.evaluated("x" * 500, 1, 0.5, 0.5)
    # role: 3 values; backup: R-1 names
    ReplicationCollector(metrics.registry, Holder(primary(BackupLag("r1", True, 0, 0.0))))
    allowed = {"outcome", "reason", "phase", "bound", "side", "method", "plane", "cause", "dataset", "le", "quantile"}
    allowed |= {"role", "backup", "direction", "encoding"}  # gemps_wire_bytes: 2 x 4 series
    info = set(TrainingConfig().as_dict())  # one label per field of the training config
    build = {"version", "protocol", "oldest_protocol"}  # gemps_build_info: one series, set at start
    for (name, labels), _ in samples(metrics).items():
        keys = {key for key, _ in labels}
        extra = {"gemps_server_info": info, "gemps_build_info": build}.get(name, set())
        assert keys <= allowed | extra, name
        assert all(len(value) <= MAX_DATASET_LABEL for _, value in labels), name


# -- replication (server/gemps_server/replication/status.py's record, built by hand) -------------


def primary(*backups: BackupLag, replicas: int = 3) -> ReplicationStatus:
    return ReplicationStatus(
        "r0", PRIMARY, epoch=4, replicas=replicas, backups=backups, forwarded=120, applied=7, failovers=2
    )


class Holder:
    """The provider the replication code hands the metrics: its current record, read at scrape."""

    def __init__(self, status: ReplicationStatus | None) -> None:
        self.status = status
        self.asked = 0

    def __call__(self) -> ReplicationStatus | None:
        self.asked += 1
        return self.status


def replication_samples(metrics: ServerMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    replication = ("gemps_replica", "gemps_replicas", "gemps_replication", "gemps_partition_under", "gemps_failovers")
    return {key: value for key, value in samples(metrics).items() if key[0].startswith(replication)}


def test_a_primary_exports_its_role_epoch_backups_and_counts() -> None:
    metrics = ServerMetrics()
    ReplicationCollector(
        metrics.registry, Holder(primary(BackupLag("r1", True, 0, 0.0), BackupLag("r2", False, 40, 2.5)))
    )
    got = replication_samples(metrics)
    assert got == {
        ("gemps_replica_role", (("role", "primary"),)): 1,
        ("gemps_replica_role", (("role", "backup"),)): 0,
        ("gemps_replica_role", (("role", "candidate"),)): 0,
        ("gemps_replica_epoch", ()): 4,
        ("gemps_replicas_configured", ()): 3,
        ("gemps_replicas_live", ()): 2,  # itself and r1: r2 is out of the in-sync set
        ("gemps_partition_under_replicated", ()): 1,
        ("gemps_replication_waiting_for_replicas", ()): 0,
        ("gemps_replication_lag_commits", (("backup", "r1"),)): 0,
        ("gemps_replication_lag_commits", (("backup", "r2"),)): 40,
        ("gemps_replication_lag_seconds", (("backup", "r1"),)): 0.0,
        ("gemps_replication_lag_seconds", (("backup", "r2"),)): 2.5,
        ("gemps_replication_in_sync", (("backup", "r1"),)): 1,
        ("gemps_replication_in_sync", (("backup", "r2"),)): 0,
        ("gemps_replication_forwarded_total", ()): 120,
        ("gemps_replication_applied_total", ()): 7,
        ("gemps_failovers_total", ()): 2,
    }


def test_the_series_follow_the_record_at_each_scrape_and_a_gone_backup_leaves_no_label() -> None:
    holder = Holder(primary(BackupLag("r1", True, 0, 0.0), BackupLag("r2", True, 3, 0.1)))
    metrics = ServerMetrics()
    ReplicationCollector(metrics.registry, holder)
    assert ("gemps_replication_lag_commits", (("backup", "r2"),)) in replication_samples(metrics)
    holder.status = primary(BackupLag("r1", True, 5, 0.2), BackupLag("r3", False, 9, 1.0))
    got = replication_samples(metrics)
    backups = {dict(labels)["backup"] for name, labels in got if name.startswith("gemps_replication_") and labels}
    assert backups == {"r1", "r3"}  # r2 is gone from every labelled series
    assert got[("gemps_replication_lag_commits", (("backup", "r1"),))] == 5
    assert got[("gemps_partition_under_replicated", ())] == 1


def test_a_backup_exports_its_role_and_epoch_but_no_primary_figures() -> None:
    metrics = ServerMetrics()
    ReplicationCollector(
        metrics.registry, Holder(ReplicationStatus("r1", BACKUP, epoch=4, replicas=3, primary="ps-0:50051", applied=9))
    )
    got = replication_samples(metrics)
    assert got[("gemps_replica_role", (("role", "backup"),))] == 1
    assert got[("gemps_replica_role", (("role", "primary"),))] == 0
    assert got[("gemps_replication_applied_total", ())] == 9
    # live and under-replicated are the primary's to say: a backup's 0 would read as a dead partition
    assert not {"gemps_replicas_live", "gemps_partition_under_replicated"} & {name for name, _ in got}
    assert not any(name.startswith(("gemps_replication_lag", "gemps_replication_in_sync")) for name, _ in got)


def test_nothing_is_exported_while_not_replicated() -> None:
    holder = Holder(None)
    metrics = ServerMetrics()
    ReplicationCollector(metrics.registry, holder)
    assert replication_samples(metrics) == {}
    assert holder.asked == 1  # asked at the scrape, not cached at registration
    assert replication_samples(ServerMetrics()) == {}  # nor without a provider


def test_replication_series_carry_the_partition_label_when_exposed_with_one() -> None:
    metrics = ServerMetrics()
    ReplicationCollector(metrics.registry, Holder(primary(BackupLag("r1", True, 0, 0.0))))
    text = generate_latest(exposed(metrics.registry, {"partition": "1"})).decode()
    assert 'gemps_replication_lag_commits{backup="r1",partition="1"} 0.0' in text
    assert 'gemps_replica_role{partition="1",role="primary"} 1.0' in text


def test_the_straggler_gauges_name_the_top_five_of_each_ranking_whatever_the_workers() -> None:
    """Issue 50, item 5: the most-damped and slowest workers by rank, 5 series a family for 40
    workers (bounded cardinality); one that never committed is the slowest, not the most damped."""

    def worker(index: int, scaling: float, commits: int) -> WorkerStatus:
        recent = RecentCommits(seconds=60.0, commits=commits, staleness=float(index), scaling_mean=scaling)
        return WorkerStatus(f"w{index}", index, commits, 0.0, 0.0, recent)

    workers = [worker(i, 1.0 + i / 100, 600 + i) for i in range(40)]
    workers += [worker(40, 0.02, 12), worker(41, 0.0, 0)]
    metrics = ServerMetrics()
    metrics.observe(version=int, parameters=int, rule_state_bytes=int, active_workers=int, queue_depth=int)
    assert "gemps_damped_worker_scaling{" not in generate_latest(metrics.registry).decode()  # none registered
    metrics.observe(
        version=int, parameters=int, rule_state_bytes=int, active_workers=int, queue_depth=int, workers=lambda: workers
    )
    series = {
        (family.name, sample.labels["rank"]): (sample.labels["worker"], sample.value)
        for family in metrics.registry.collect()
        for sample in family.samples
        if "rank" in sample.labels
    }
    damped = [series[("gemps_damped_worker_scaling", str(rank))] for rank in range(1, 6)]
    assert damped == [("w40", 0.02), ("w0", 1.0), ("w1", 1.01), ("w2", 1.02), ("w3", 1.03)]
    assert series[("gemps_damped_worker_staleness", "1")] == ("w40", 40.0)
    slowest = [series[("gemps_slowest_worker_commits_per_second", str(rank))] for rank in range(1, 6)]
    assert slowest == [
        ("w41", 0.0),
        ("w40", 0.2),
        ("w0", 10.0),
        ("w1", pytest.approx(601 / 60)),
        ("w2", pytest.approx(602 / 60)),
    ]
    assert len(series) == 5 * 5  # five families of five ranks


# -- the page as docs/OBSERVABILITY.md documents it (names, types, labels) -----------------------

OBSERVABILITY = Path(__file__).resolve().parents[2] / "docs" / "OBSERVABILITY.md"


def documented_metrics() -> dict[str, tuple[str, set[str]]]:
    """The Metrics table: each name it lists, with its row's type and label names."""
    section = OBSERVABILITY.read_text().split("\n## Metrics\n", 1)[1].split("\n## ", 1)[0]
    documented = {}
    for line in section.splitlines():
        if not line.startswith("| `"):
            continue
        cells = re.split(r"(?<!\\)\|", line)  # `\|G\|²` is one cell's text
        labels = set(re.findall(r"`([a-z_]+)`", cells[3]))
        for name in re.findall(r"`([a-z_*]+)`", cells[1]):
            documented[name] = (cells[2].strip(), labels)
    return documented


def busy_registry() -> CollectorRegistry:
    """A server's registry once every concern has had an event: every family and label is on it."""
    metrics = ServerMetrics()
    metrics.describe_server(TrainingConfig())
    metrics.observe(version=int, parameters=int, rule_state_bytes=int, active_workers=int, queue_depth=int)
    stats = ApplyStats.of(np.array([0.0, 1.0], F32), 5.0, proxy_energy=0.1, central_energy=0.2)
    metrics.applied(2, stats, loss=0.5, num_samples=64, queued_seconds=1e-4, apply_seconds=2e-4)
    metrics.evaluated("digits", 3, 0.4, 0.9)
    ReplicationCollector(metrics.registry, Holder(primary(BackupLag("r1", True, 0, 0.0))))
    return metrics.registry


def test_every_family_on_the_page_is_documented_with_its_type_and_labels() -> None:
    documented = documented_metrics()
    families = list(busy_registry().collect())
    assert len(families) > 40
    for family in families:
        if family.name.startswith("process_"):
            assert "process_*" in documented
            continue
        # As the page names them: counters with `_total`, the info metric with `_info` (a gauge there).
        name = family.name + {"counter": "_total", "info": "_info"}.get(family.type, "")
        assert name in documented, name
        kind, labels = documented[name]
        assert kind == {"info": "gauge (info)"}.get(family.type, family.type), name
        exposed_labels = {key for sample in family.samples for key in sample.labels} - {"le", "quantile"}
        assert exposed_labels <= labels, name
