"""Server metrics: GEM's energies against a plain reference, and the exposition's label hygiene."""

from __future__ import annotations

import math

import numpy as np
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gemps_proto.schema import PayloadKind, TrainingConfig
from gemps_server.domain.rules import ApplyStats, create_rule, rule_names
from gemps_server.metrics import COMMIT_REJECTION_REASONS, MAX_DATASET_LABEL, ServerMetrics
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
        theta, stats = rule.step(theta, delta.copy(), PayloadKind.UPDATE, w, staleness=0)
        assert stats.proxy_energy == pytest.approx(expected[0], rel=1e-4)
        assert stats.central_energy == pytest.approx(expected[1], rel=1e-4)


def test_a_first_commit_complies_exactly() -> None:
    # No central movement yet and m = Delta: pi = kappa (below the clamp), so central = proxy.
    rule = create_rule(training("gem", kappa=2.0), 4)
    theta = np.zeros(4, F32)
    rule.add_worker("a", theta)
    theta, stats = rule.step(theta, np.array([0.1, -0.2, 0.3, 0.4], F32), PayloadKind.UPDATE, "a", staleness=0)
    assert stats.proxy_energy == pytest.approx(2 * 0.25)
    assert stats.central_energy == pytest.approx(stats.proxy_energy)


def test_central_energy_exceeds_the_proxy_when_others_overshot() -> None:
    rule = create_rule(training("gem", momentum=0.0), 3)
    theta = np.zeros(3, F32)
    rule.add_worker("a", theta)
    rule.add_worker("b", theta)
    for _ in range(5):
        theta, _ = rule.step(theta, np.full(3, 1.0, F32), PayloadKind.UPDATE, "a", staleness=0)
    theta, stats = rule.step(theta, np.full(3, 0.5, F32), PayloadKind.UPDATE, "b", staleness=5)
    assert stats.fraction_at_zero == 1.0
    assert stats.proxy_energy == pytest.approx(0.5)
    assert stats.central_energy > stats.proxy_energy  # pi = 0: the others' movement alone


@pytest.mark.parametrize("rule_name", [name for name in rule_names() if name != "gem"])
def test_rules_without_a_proxy_report_no_energy(rule_name: str) -> None:
    rule = create_rule(training(rule_name), 3)
    theta = np.zeros(3, F32)
    rule.add_worker("a", theta)
    theta, stats = rule.step(theta, np.ones(3, F32), PayloadKind.UPDATE, "a", staleness=1)
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


def test_labels_come_from_small_fixed_sets() -> None:
    metrics = ServerMetrics()
    metrics.describe_server(TrainingConfig())
    metrics.rpc("Pull", 0.001)
    metrics.evaluated("x" * 500, 1, 0.5, 0.5)
    allowed = {"outcome", "reason", "phase", "bound", "side", "method", "plane", "cause", "dataset", "le", "quantile"}
    info = set(TrainingConfig().as_dict())  # one label per field of the training config
    for (name, labels), _ in samples(metrics).items():
        keys = {key for key, _ in labels}
        assert keys <= (allowed | info if name == "gemps_server_info" else allowed), name
        assert all(len(value) <= MAX_DATASET_LABEL for _, value in labels), name
