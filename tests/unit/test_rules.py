"""Server-side commit rules equal plain reference implementations over random commit sequences."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from gemps_proto.schema import ParameterSpec, PayloadKind, TrainingConfig
from gemps_server.domain.records import Commit
from gemps_server.domain.rules import create_rule, rule_class, rule_names, with_rule_defaults
from gemps_server.domain.rules.base import StepContext
from gemps_server.domain.state import ServerState
from gemps_server.domain.workers import WorkerRegistry
from tests.helpers import encoded, rule_option, training
from tests.unit.reference_rules import ReferenceServer, WorkerSideGemWorker

P = 257  # odd size: no accidental alignment luck
SPEC = [ParameterSpec("w", (16, 16)), ParameterSpec("b", (1,))]
RTOL, ATOL = 2e-5, 1e-6


def make_state(params: TrainingConfig) -> ServerState:
    return ServerState(params, WorkerRegistry(max_workers=64, lease_ttl=3600))


def random_gradient(rng: np.random.Generator) -> np.ndarray:
    # Mixed scales and exact zeros exercise the clamp at 0, at pi_max and the epsilon.
    g = rng.normal(size=P).astype(np.float32) * rng.choice([0.01, 1.0, 10.0], size=P).astype(np.float32)
    g[rng.random(P) < 0.05] = 0.0
    return g


def run_random_sequence(params: TrainingConfig, seed: int, steps: int = 300) -> None:
    """Interleave registrations, leaves and commits with random staleness; compare every step."""
    rng = np.random.default_rng(seed)
    chooser = random.Random(seed)
    theta0 = rng.normal(size=P).astype(np.float32)
    state = make_state(params)
    options = with_rule_defaults(params).rule_options  # a rule's options (the reference ignores others')
    hyper = (options.get(name, math.nan) for name in ("momentum", "kappa", "pi_max"))
    dn = ("dn_learning_rate", "nesterov_period", "momentum_activation")  # delayed-nesterov's
    # adamw's decay: on the matrix alone (SPEC's w; not its bias), as the server tells the rule
    decayed = np.concatenate([np.full(s.size, len(s.shape) >= 2) for s in SPEC])
    ref = ReferenceServer(
        params.rule,
        theta0,
        params.learning_rate,
        *hyper,
        **{name: options[name] for name in dn if name in options},
        decayed=decayed,
    )
    base_versions: dict[str, int] = {}

    def join() -> None:
        reg = state.register("w", SPEC, encoded(theta0))
        ref.register(reg.worker.worker_id)
        base_versions[reg.worker.worker_id] = reg.snapshot.version

    for _ in range(5):
        join()
    for step in range(steps):
        if step % 60 == 59:  # churn: one leaves, one joins
            leaver = chooser.choice(sorted(base_versions))
            state.leave(leaver)
            ref.leave(leaver)
            del base_versions[leaver]
            join()
        worker = chooser.choice(sorted(base_versions))
        # A worker commits on the version it last received, or an older one it held on to.
        base = max(0, base_versions[worker] - chooser.choice([0, 0, 1, 3]))
        is_gradient = chooser.random() < 0.8
        payload = random_gradient(rng)
        kind = PayloadKind.GRADIENT if is_gradient else PayloadKind.UPDATE
        outcome = state.core.commit_record(Commit(worker, base, kind, encoded(payload)))
        ref.commit(worker, payload, base, is_gradient)
        assert outcome.snapshot.version == ref.version
        assert outcome.staleness == ref.version - 1 - base
        np.testing.assert_allclose(state.core.theta_copy(), ref.theta, rtol=RTOL, atol=ATOL, err_msg=f"step {step}")
        base_versions[worker] = outcome.snapshot.version


@pytest.mark.parametrize("rule", rule_names())
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_rule_matches_reference(rule: str, seed: int) -> None:
    hyper = {"momentum": 0.9, "kappa": 1.0, "pi_max": 5.0}
    taken = {name: value for name, value in hyper.items() if name in rule_class(rule).hyperparameters()}
    run_random_sequence(training(rule, learning_rate=0.05, **taken), seed)


@pytest.mark.parametrize("kappa,pi_max,momentum", [(2.0, 5.0, 0.9), (4.0, 2.0, 0.5), (1.0, 10.0, 0.0)])
def test_gem_matches_reference_for_other_hyperparameters(kappa: float, pi_max: float, momentum: float) -> None:
    run_random_sequence(training("gem", learning_rate=0.1, momentum=momentum, kappa=kappa, pi_max=pi_max), seed=7)


def test_gem_equals_worker_side_reference_code_rearranged() -> None:
    rng = np.random.default_rng(11)
    chooser = random.Random(11)
    params = training("gem", learning_rate=0.05, momentum=0.9, kappa=1.0, pi_max=5.0)
    theta0 = rng.normal(size=P).astype(np.float32)
    state = make_state(params)
    central = theta0.copy()  # the reference code's central node only adds what workers push
    workers: dict[str, WorkerSideGemWorker] = {}
    versions: dict[str, int] = {}
    for _ in range(6):
        reg = state.register("w", SPEC, encoded(theta0))
        workers[reg.worker.worker_id] = WorkerSideGemWorker(central, 0.05, 0.9, 1.0, 5.0)
        versions[reg.worker.worker_id] = reg.snapshot.version
    for _ in range(400):
        worker = chooser.choice(sorted(workers))
        gradient = random_gradient(rng)
        outcome = state.core.commit_record(Commit(worker, versions[worker], PayloadKind.GRADIENT, encoded(gradient)))
        central = central + workers[worker].scaled_update(central, gradient)
        versions[worker] = outcome.snapshot.version
        np.testing.assert_allclose(state.core.theta_copy(), central, rtol=RTOL, atol=ATOL)


def test_gem_first_commit_of_a_worker_is_unscaled() -> None:
    # m = Delta and no central movement yet, so pi = |Delta| / |Delta| = 1 wherever Delta != 0.
    rule = create_rule(training("gem"), 4)
    theta = np.zeros(4, np.float32)
    rule.add_worker("a", theta)
    update = np.array([0.1, -0.2, 0.3, 0.0], np.float32)
    theta, stats = rule.step(theta, update.copy(), StepContext("a", 0, kind=PayloadKind.UPDATE))
    np.testing.assert_allclose(theta, update)
    # The zero entry's pi (0 / eps = 0) says nothing of the commit: the statistics leave it out (issue 47).
    assert stats.fraction_at_zero == 0.0
    assert stats.scaling_mean == pytest.approx(1.0)


def test_gem_scales_down_stale_updates_once_central_moved() -> None:
    # Worker b's proxy energy is small; the central variable moved a lot since it joined: pi -> 0.
    rule = create_rule(training("gem", momentum=0.0), 3)
    theta = np.zeros(3, np.float32)
    rule.add_worker("a", theta)
    rule.add_worker("b", theta)
    for _ in range(5):
        theta, _ = rule.step(theta, np.full(3, 1.0, np.float32), StepContext("a", 0, kind=PayloadKind.UPDATE))
    before = theta.copy()
    theta, stats = rule.step(theta, np.full(3, 0.5, np.float32), StepContext("b", 5, kind=PayloadKind.UPDATE))
    np.testing.assert_array_equal(theta, before)
    assert stats.fraction_at_zero == 1.0 and stats.scaling_mean == 0.0


def test_unknown_rule_lists_valid_names() -> None:
    with pytest.raises(ValueError, match="gem, downpour, adaptive-staleness, momentum"):
        create_rule(training("sync"), 3)


def test_gem_in_blocks_equals_gem_in_one_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    """Block boundaries and the median's strided sample across them change nothing."""
    from gemps_server.domain.rules import base, gem

    monkeypatch.setattr(base, "STATS_SAMPLE_SIZE", 10)  # stride 26 over P=257: samples straddle blocks
    rng = np.random.default_rng(5)
    theta0 = rng.normal(size=P).astype(np.float32)
    results = []
    for block in (37, 10**9):
        monkeypatch.setattr(gem, "BLOCK", block)
        rule = create_rule(training("gem"), P)
        theta = theta0.copy()
        for worker in ("a", "b"):
            rule.add_worker(worker, theta)
        stats = []
        for i in range(20):
            gradient = random_gradient(np.random.default_rng(i))
            theta, commit_stats = rule.step(theta, gradient, StepContext("ab"[i % 2], 0))
            stats.append(commit_stats)
        results.append((theta, stats))
    (blocked, blocked_stats), (whole, whole_stats) = results
    np.testing.assert_array_equal(blocked, whole)
    for ours, reference in zip(blocked_stats, whole_stats, strict=True):
        assert ours.scaling_median == reference.scaling_median
        assert ours.scaling_mean == pytest.approx(reference.scaling_mean, rel=1e-6)
        assert ours.fraction_at_zero == reference.fraction_at_zero
        assert ours.fraction_at_max == reference.fraction_at_max
        assert ours.central_energy == pytest.approx(reference.central_energy, rel=1e-5)


def test_compiled_kernel_equals_numpy_pass() -> None:
    """The compiled kernel moves theta, the proxy and s_i exactly as the numpy pass does."""
    from gemps_server import native

    assert native.compiled is not None, "the compiled GEM kernel was not built (pip install needs a C compiler)"
    size = 70_000  # two numpy blocks
    rng = np.random.default_rng(3)
    theta0 = rng.normal(size=size).astype(np.float32)
    results = []
    for kernel in ("numpy", "compiled"):
        rule = create_rule(training("gem", kappa=2.0), size, gem_kernel=kernel)
        theta = theta0.copy()
        rule.add_worker("a", theta)
        rule.add_worker("b", theta)
        stats = []
        for i in range(12):
            theta, commit_stats = rule.step(theta, rng_gradient(i, size), StepContext("ab"[i % 2], 0))
            stats.append(commit_stats)
        results.append((theta, stats))
    np.testing.assert_array_equal(results[0][0], results[1][0])
    for numpy_stats, compiled_stats in zip(results[0][1], results[1][1], strict=True):
        # numpy estimates from a sample of 8,192; compiled sums over all 70,000 (same median sample)
        assert compiled_stats.scaling_median == numpy_stats.scaling_median
        assert compiled_stats.scaling_mean == pytest.approx(numpy_stats.scaling_mean, abs=0.05)
        assert compiled_stats.fraction_at_zero == pytest.approx(numpy_stats.fraction_at_zero, abs=0.02)


@pytest.mark.parametrize("kappa,momentum", [(1.0, 0.9), (2.5, 0.0)])
def test_compiled_statistics_are_exact_and_match_numpy_below_the_sample_size(kappa: float, momentum: float) -> None:
    size = 5_000  # under STATS_SAMPLE_SIZE: numpy's statistics are exact too
    rng = np.random.default_rng(9)
    theta0 = rng.normal(size=size).astype(np.float32)
    per_kernel = []
    for kernel in ("numpy", "compiled"):
        rule = create_rule(training("gem", kappa=kappa, momentum=momentum), size, gem_kernel=kernel)
        theta = theta0.copy()
        rule.add_worker("a", theta)
        rule.add_worker("b", theta)
        stats = []
        for i in range(8):
            theta, commit_stats = rule.step(theta, rng_gradient(i, size), StepContext("ab"[i % 2], 1))
            stats.append(commit_stats)
        per_kernel.append(stats)
    for numpy_stats, compiled_stats in zip(*per_kernel, strict=True):
        assert compiled_stats.scaling_median == numpy_stats.scaling_median
        assert compiled_stats.fraction_at_zero == numpy_stats.fraction_at_zero
        assert compiled_stats.fraction_at_max == numpy_stats.fraction_at_max
        assert compiled_stats.scaling_mean == pytest.approx(numpy_stats.scaling_mean, rel=1e-6)
        assert compiled_stats.proxy_energy == pytest.approx(numpy_stats.proxy_energy, rel=1e-6)
        assert compiled_stats.central_energy == pytest.approx(numpy_stats.central_energy, rel=1e-5)


def gem_pi_reference(
    config: TrainingConfig, state: dict[str, np.ndarray], theta: np.ndarray, delta: np.ndarray
) -> np.ndarray:
    """GEM's pi in float64 (DESIGN §1) from a worker's m_i and s_i before its commit of `delta`."""
    mu, kappa, pi_max = (rule_option(config, name) for name in ("momentum", "kappa", "pi_max"))
    velocity = mu * state["proxy"].astype(np.float64) + delta
    movement = np.abs(theta.astype(np.float64) - state["last_seen_theta"])
    pi: np.ndarray = np.clip((kappa * np.abs(velocity) - movement) / (np.abs(delta) + 1e-16), 0.0, pi_max)
    return pi


@pytest.mark.parametrize("kernel", ["compiled", "numpy"])
def test_pi_statistics_count_only_the_parameters_a_commit_moves(kernel: str) -> None:
    """Where a commit's Delta is 0, GEM's pi reads 0 or pi_max (0 / eps) whatever the commit: pi's mean,
    median and shares count the parameters it moves alone (issue 47, item 4: a top-k payload is mostly
    zeros), and equal GEM's pi computed in float64 from the worker's state over those parameters."""
    size = 5_000  # under STATS_SAMPLE_SIZE: every parameter is in the median's sample
    config = training("gem")
    rng = np.random.default_rng(5)
    theta = rng.normal(size=size).astype(np.float32)
    rule = create_rule(config, size, gem_kernel=kernel)
    for worker in "ab":
        rule.add_worker(worker, theta)
    moving = rng.random(size) < 0.1
    shares = []
    for i in range(8):
        worker = "ab"[i % 2]
        update = np.where(moving, rng.normal(size=size) * 0.1, 0.0).astype(np.float32)
        state = {name: np.array(value, copy=True) for name, value in rule.worker_state(worker).items()}
        pi = gem_pi_reference(config, state, theta, update.astype(np.float64))[moving]
        theta, stats = rule.step(theta, update, StepContext(worker, 1, kind=PayloadKind.UPDATE))
        assert stats.scaling_mean == pytest.approx(pi.mean(), rel=1e-4)
        assert stats.scaling_median == pytest.approx(np.median(pi), rel=1e-4, abs=1e-6)
        assert stats.fraction_at_zero == pytest.approx(np.mean(pi <= 0), abs=2 / pi.size)
        assert stats.fraction_at_max == pytest.approx(np.mean(pi >= rule_option(config, "pi_max")), abs=2 / pi.size)
        shares.append((stats.fraction_at_zero, stats.fraction_at_max))
    assert max(zero for zero, _ in shares) > 0  # the reference was checked where pi clips too
    _, nothing = rule.step(theta, np.zeros(size, np.float32), StepContext("a", 1, kind=PayloadKind.UPDATE))
    assert (nothing.scaling_mean, nothing.scaling_median, nothing.fraction_at_zero, nothing.fraction_at_max) == (
        0.0, 0.0, 0.0, 0.0,
    )  # fmt: skip


def rng_gradient(seed: int, size: int) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=size).astype(np.float32)


def test_unknown_gem_kernel_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown gem kernel 'cuda'"):
        create_rule(training("gem"), 4, gem_kernel="cuda")


@pytest.mark.parametrize("rule_name", rule_names())
@pytest.mark.parametrize("kernel", ["compiled", "numpy"])
def test_out_gets_the_new_theta_whichever_rule_writes_it(rule_name: str, kernel: str) -> None:
    """step(out=...) leaves theta as without it, and `out` holds the new theta: written by
    the compiled GEM pass as it goes (in place and out of place), copied by the other rules."""
    size = 3000
    rng = np.random.default_rng(7)
    theta0 = rng.normal(size=size).astype(np.float32)
    plain, writing = (create_rule(training(rule_name), size, gem_kernel=kernel) for _ in range(2))
    theta_plain, theta_written = theta0.copy(), theta0.copy()
    for rule, theta in ((plain, theta_plain), (writing, theta_written)):
        rule.add_worker("a", theta)
    out = np.full(size, np.nan, np.float32)
    for step in range(6):
        # one out-of-place pass (loose bound); adamw refuses a gradient whose square overflows its moments
        payload = rng_gradient(step, size) * ((1e15 if rule_name == "adamw" else 1e30) if step == 3 else 1)
        theta_plain, _ = plain.step(theta_plain, payload, StepContext("a", 0, version=step))
        theta_written, _ = writing.step(theta_written, payload, StepContext("a", 0, version=step, out=out))
        np.testing.assert_array_equal(theta_written, theta_plain)
        np.testing.assert_array_equal(out, theta_plain)
    assert writing.writes_out == (rule_name == "gem" and kernel == "compiled")
