"""What GEM computes with one worker (DESIGN §1), and the `own_step` option.

With s_i taken before the step (the paper's reference code, the default), c = |theta - s_i|
counts the worker's own previous step, so a lone worker does not move like momentum SGD: its
steps zig-zag and cover about half of momentum SGD's distance. With `own_step="excluded"` (s_i
taken after the step) c counts only the other workers' steps, and a lone worker moves like
momentum SGD. The references below are float64, written from the equations, not from gem.py.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from gemps_proto.schema import ParameterSpec, PayloadKind, TrainingConfig
from gemps_server.config.training import WorkerOptions
from gemps_server.domain.records import Commit
from gemps_server.domain.rules import RuleRuntime
from gemps_server.domain.rules.base import StepContext
from gemps_server.domain.rules.gem import GemRule
from gemps_server.domain.rules.gem_base import GEM_OWN_STEP
from gemps_server.domain.state import ServerState
from gemps_server.domain.workers import WorkerRegistry
from gemps_server.native import compiled
from tests.helpers import encoded, training

ETA, MU, PI_MAX, COMMITS = 0.05, 0.9, 5.0, 12
KERNELS = ["numpy", pytest.param("compiled", marks=pytest.mark.skipif(compiled is None, reason="not built"))]
# The paper's rule, one worker, gradient 1 (Delta = -0.05): the steps |theta_k - theta_{k-1}|.
ONE_WORKER_STEPS = [0.05, 0.045, 0.0905, 0.08145, 0.1233, 0.11097, 0.14988, 0.13489, 0.1714, 0.15426, 0.18883, 0.16995]
MOMENTUM_STEPS = [0.05, 0.095, 0.1355, 0.17195, 0.20476, 0.23428, 0.26085, 0.28477, 0.30629, 0.32566, 0.34309, 0.35879]


def gem_reference(
    gradients: list[np.ndarray], own_step: str = "counted", workers: list[int] | None = None, pi_max: float = PI_MAX
) -> list[np.ndarray]:
    """theta after each commit (theta_0 = 0) under GEM in float64; commit k is worker workers[k]'s."""
    order = workers or [0] * len(gradients)
    theta = np.zeros_like(gradients[0], dtype=np.float64)
    m = {w: np.zeros_like(theta) for w in order}
    s = {w: theta.copy() for w in order}
    thetas = []
    for w, g in zip(order, gradients, strict=True):
        delta = -ETA * g.astype(np.float64)
        m[w] = MU * m[w] + delta
        c = np.abs(theta - s[w])
        pi = np.clip((np.abs(m[w]) - c) / (np.abs(delta) + 1e-16), 0.0, pi_max)
        before = theta.copy()
        theta = theta + pi * delta
        s[w] = before if own_step == "counted" else theta.copy()
        thetas.append(theta)
    return thetas


def momentum_reference(gradients: list[np.ndarray]) -> list[np.ndarray]:
    """theta after each step of momentum SGD (v <- mu v - eta g, theta <- theta + v) in float64."""
    theta, v = np.zeros_like(gradients[0], dtype=np.float64), np.zeros_like(gradients[0], dtype=np.float64)
    thetas = []
    for g in gradients:
        v = MU * v - ETA * g.astype(np.float64)
        theta = theta + v
        thetas.append(theta)
    return thetas


def served(
    config: TrainingConfig, gradients: list[np.ndarray], kernel: str, own_step: str | None = None
) -> list[np.ndarray]:
    """theta after each commit of one worker, through a real ServerState."""
    options: dict[str, Any] = {} if own_step is None else {"gem_own_step": own_step}  # None: the default
    state = ServerState(
        config, WorkerRegistry(max_workers=4, lease_ttl=3600), RuleRuntime(gem_kernel=kernel, **options)
    )
    theta0 = np.zeros(gradients[0].size, np.float32)
    worker = state.register("w", [ParameterSpec("w", theta0.shape)], encoded(theta0)).worker.worker_id
    thetas = []
    for version, g in enumerate(gradients):
        state.core.commit_record(Commit(worker, version, PayloadKind.GRADIENT, encoded(g.astype(np.float32))))
        thetas.append(state.core.theta_copy().astype(np.float64))
    return thetas


def steps_of(thetas: list[np.ndarray]) -> np.ndarray:
    """|theta_k - theta_{k-1}| of the first parameter, theta_0 = 0."""
    first = np.array([0.0] + [t[0] for t in thetas])
    return np.abs(np.diff(first))


def constant(size: int = 3) -> list[np.ndarray]:
    return [np.ones(size) for _ in range(COMMITS)]


@pytest.mark.parametrize("kernel", KERNELS)
def test_one_worker_gem_zigzags_and_covers_about_half_of_momentum_sgd(kernel: str) -> None:
    gem = served(training("gem", learning_rate=ETA, momentum=MU), constant(), kernel)
    np.testing.assert_allclose(np.array(gem), np.array(gem_reference(constant())), rtol=1e-5)
    steps = steps_of(gem)
    np.testing.assert_allclose(steps, ONE_WORKER_STEPS, rtol=1e-4)
    assert all(steps[k] < steps[k - 1] for k in range(1, COMMITS, 2)), "every second step is shorter"
    momentum = served(training("momentum", learning_rate=ETA, momentum=MU), constant(), kernel)
    np.testing.assert_allclose(np.array(momentum), np.array(momentum_reference(constant())), rtol=1e-5)
    np.testing.assert_allclose(steps_of(momentum), MOMENTUM_STEPS, rtol=1e-4)
    assert abs(gem[-1][0]) / abs(momentum[-1][0]) == pytest.approx(0.531, abs=0.001)


@pytest.mark.parametrize("kernel", KERNELS)
def test_own_step_excluded_makes_one_worker_momentum_sgd_up_to_the_clamp(kernel: str) -> None:
    unclamped = training("gem", learning_rate=ETA, momentum=MU, pi_max=1000.0)
    gem = served(unclamped, constant(), kernel, own_step="excluded")
    np.testing.assert_allclose(np.array(gem), np.array(momentum_reference(constant())), rtol=1e-5)
    # pi_max 5 caps a step at 5 |Delta| = 0.25, below momentum SGD's 0.26 from the 7th step on.
    clamped = steps_of(served(training("gem", learning_rate=ETA, momentum=MU), constant(), kernel, own_step="excluded"))
    np.testing.assert_allclose(clamped, np.minimum(MOMENTUM_STEPS, PI_MAX * ETA), rtol=1e-4)
    # Where the gradient's sign changes, pi*Delta keeps Delta's sign: |step| = |m| (clamped), not m.
    rng = np.random.default_rng(0)
    noisy = [rng.normal(size=64) for _ in range(40)]
    got = served(training("gem", learning_rate=ETA, momentum=MU), noisy, kernel, own_step="excluded")
    np.testing.assert_allclose(np.array(got), np.array(gem_reference(noisy, "excluded")), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("kernel", KERNELS)
def test_own_step_excluded_counts_only_the_other_workers_steps(kernel: str) -> None:
    """Three workers through the rule itself against the float64 reference of either choice."""
    rng = np.random.default_rng(1)
    gradients = [rng.normal(size=100) for _ in range(60)]
    workers = [int(w) for w in rng.integers(0, 3, size=60)]
    for own_step in GEM_OWN_STEP:
        rule = GemRule(100, learning_rate=ETA, momentum=MU, kappa=1.0, pi_max=PI_MAX, kernel=kernel, own_step=own_step)
        theta = np.zeros(100, np.float32)
        for w in range(3):
            rule.add_worker(str(w), theta)
        expected = gem_reference(gradients, own_step, workers)
        for k, (w, g) in enumerate(zip(workers, gradients, strict=True)):
            theta, _ = rule.step_scaled(theta, g.astype(np.float32), -ETA, StepContext(str(w), 0))
            np.testing.assert_allclose(theta, expected[k], rtol=1e-4, atol=1e-6, err_msg=f"{own_step}, commit {k}")


@pytest.mark.parametrize("kernel", KERNELS)
def test_own_step_excluded_holds_out_of_place(kernel: str) -> None:
    """Near float32's largest value the update runs out of place (checked, then swapped in):
    s_i is still the new theta, in a buffer of its own."""
    rule = GemRule(4, learning_rate=ETA, momentum=MU, kappa=1.0, pi_max=PI_MAX, kernel=kernel, own_step="excluded")
    theta = np.array([1e38, 0.0, 0.0, 0.0], np.float32)  # |theta| + |s_i| past the in-place bound
    rule.add_worker("a", theta)
    for _ in range(3):
        theta, _ = rule.step_scaled(theta, np.ones(4, np.float32), -ETA, StepContext("a", 0))
        last_seen = rule.worker_state("a")["last_seen_theta"]
        np.testing.assert_array_equal(last_seen, theta)  # counted would keep the theta before the step
        kept = theta[1]
        theta[1] = 99.0  # s_i is a copy, not theta's buffer
        assert rule.worker_state("a")["last_seen_theta"][1] == last_seen[1] != 99.0
        theta[1] = kept
    np.testing.assert_allclose(theta[1:], -ETA * (1 + 1.9 + 2.71), rtol=1e-5)  # momentum SGD's first 3 steps


def test_an_unknown_own_step_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="unknown gem own_step 'mine'; valid: counted, excluded"):
        GemRule(4, learning_rate=ETA, momentum=MU, kappa=1.0, pi_max=PI_MAX, own_step="mine")
    assert WorkerOptions(gem_own_step="mine").problems() == [
        "unknown gem_own_step 'mine' (choose from counted, excluded)"
    ]
    assert WorkerOptions().gem_own_step == "counted"  # the paper's reference code stays the default
