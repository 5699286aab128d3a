"""The gradient noise scale (domain/noise.py) against a plain reference and against the truth.

Synthetic gradients: a fixed G plus Gaussian noise of per-sample covariance sigma^2 I, so a
commit of batch B is G + N(0, sigma^2/B I), |G|^2 and tr(Sigma) = P sigma^2 are known, and
B_noise = tr(Sigma)/|G|^2.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from gemps_proto.schema import ParameterSpec, PayloadKind, partition_bounds
from gemps_proto.status import MIN_NOISE_WINDOWS, GradientNoise
from gemps_server.domain.errors import InvalidArgument
from gemps_server.domain.noise import (
    EMA_DECAY,
    NOISE_SAMPLE_SIZE,
    NOISE_WINDOW_OFF,
    MovingAverage,
    NoiseEstimator,
)
from gemps_server.domain.records import ALL_OF_THETA, Commit, PartitionOf
from gemps_server.domain.rules import RuleRuntime
from gemps_server.domain.state import ServerState
from gemps_server.domain.workers import WorkerRegistry
from gemps_server.native import (
    WINDOW_ADD,
    WINDOW_LAST,
    WINDOW_START,
    compiled,
    noise_sample,
    noise_window,
    noise_window_size,
)
from tests.helpers import encoded, training

P = 10_007
BATCH = 16
SIGMA2 = 200.0  # per-sample noise variance per parameter: B_noise = P * SIGMA2 / |G|^2 = SIGMA2 with G_j = +-1
# Every kernel path: GEM's compiled pass folds the sums in, the others measure them alone.
OTHER_RULES = ("downpour", "adaptive-staleness", "momentum", "nesterov")
RULES = [("gem", "compiled"), ("gem", "numpy"), *((rule, "auto") for rule in OTHER_RULES)]


def synthetic(rng: np.random.Generator, commits: int, size: int = P) -> tuple[np.ndarray, list[np.ndarray]]:
    truth = rng.choice([-1.0, 1.0], size=size)
    noise = math.sqrt(SIGMA2 / BATCH)
    return truth, [(truth + rng.normal(scale=noise, size=size)).astype(np.float32) for _ in range(commits)]


def reference(gradients: list[np.ndarray], k: int, batch: float) -> tuple[float, float]:
    """McCandlish et al.'s Appendix A estimators, written plainly in float64: (EMA |G|^2, EMA tr(Sigma))."""
    square, trace = MovingAverage(EMA_DECAY), MovingAverage(EMA_DECAY)
    for start in range(0, len(gradients) - k + 1, k):
        window = [g.astype(np.float64) for g in gradients[start : start + k]]
        small_batch, large_batch = batch, k * batch
        small = float(np.mean([g @ g for g in window]))
        mean = np.mean(window, axis=0)
        large = float(mean @ mean)
        square.add((large_batch * large - small_batch * small) / (large_batch - small_batch))
        trace.add((small - large) / (1 / small_batch - 1 / large_batch))
    return square.value, trace.value


def served(
    gradients: list[np.ndarray], rule: str, kernel: str, partition: PartitionOf = ALL_OF_THETA, window: int = 4
) -> GradientNoise:
    """The estimate a server (or one partition of θ) makes of these gradient commits, one worker."""
    size = gradients[0].size
    state = ServerState(
        training(rule, learning_rate=1e-4, batch_size=BATCH),
        WorkerRegistry(max_workers=4, lease_ttl=3600),
        RuleRuntime(gem_kernel=kernel),
        partition=partition,
        noise_window=window,
    )
    worker = state.register("w", [ParameterSpec("w", (size,))], encoded(np.zeros(size, np.float32))).worker
    start, stop = partition.bounds(size)
    for g in gradients:
        state.core.commit_record(
            Commit(worker.worker_id, state.core.version, PayloadKind.GRADIENT, encoded(g[start:stop]))
        )
    return state.core.noise.estimate


@pytest.mark.parametrize(("rule", "kernel"), RULES)
def test_the_estimate_is_the_plain_reference(rule: str, kernel: str) -> None:
    if kernel == "compiled" and compiled is None:
        pytest.skip("the compiled kernel is not built here")
    _, gradients = synthetic(np.random.default_rng(1), 40)
    estimate = served(gradients, rule, kernel)
    square, trace = reference(gradients, 4, BATCH)
    assert estimate.windows == 10 and estimate.window == 4 and estimate.batch_size == BATCH
    # float32 sums in blocks against float64: agreement to float32's precision, relative to |g|^2
    assert estimate.noise_trace == pytest.approx(trace, rel=1e-4)
    assert estimate.gradient_square == pytest.approx(square, abs=1e-4 * float(gradients[0] @ gradients[0]))


@pytest.mark.parametrize(("rule", "kernel"), [("gem", "auto"), ("downpour", "auto")])
def test_past_the_sample_size_the_sums_are_a_strided_sample_scaled_up(rule: str, kernel: str) -> None:
    size = 3 * NOISE_SAMPLE_SIZE + 5  # every 4th run of 16 parameters sampled, the last one short
    _, gradients = synthetic(np.random.default_rng(5), 40, size)
    estimate = served(gradients, rule, kernel)
    sample = noise_sample(size, 4)
    assert sample.size == 768 * 16 + 5 and np.array_equal(sample[:20], [*range(16), *range(64, 68)])
    square, trace = reference([g[sample] for g in gradients], 4, BATCH)
    scale = size / sample.size
    assert estimate.noise_trace == pytest.approx(trace * scale, rel=1e-4)
    assert estimate.gradient_square == pytest.approx(square * scale, abs=1e-4 * float(gradients[0] @ gradients[0]))
    assert estimate.scale == pytest.approx(SIGMA2, rel=0.25)  # 10 windows only


def test_the_estimate_converges_to_the_true_noise_scale() -> None:
    """Within 10% of tr(Sigma), |G|^2 and B_noise after 200 windows (the EMA keeps ~40)."""
    truth, gradients = synthetic(np.random.default_rng(2), 800)
    estimate = served(gradients, "gem", "auto")
    assert estimate.noise_trace == pytest.approx(P * SIGMA2, rel=0.1)
    assert estimate.gradient_square == pytest.approx(float(truth @ truth), rel=0.1)
    assert estimate.scale == pytest.approx(SIGMA2, rel=0.1)
    assert estimate.useful_workers == pytest.approx(SIGMA2 / BATCH, rel=0.1)


@pytest.mark.parametrize("count", [2, 3])
def test_partitions_add_up_to_the_whole(count: int) -> None:
    _, gradients = synthetic(np.random.default_rng(3), 40)
    whole = served(gradients, "gem", "auto")
    parts = GradientNoise.combined([served(gradients, "gem", "auto", PartitionOf(i, count)) for i in range(count)])
    assert parts.windows == whole.windows and parts.batch_size == whole.batch_size
    assert parts.noise_trace == pytest.approx(whole.noise_trace, rel=1e-5)
    assert parts.scale == pytest.approx(whole.scale, rel=1e-3)
    assert len(partition_bounds(P, count)) == count


def test_windows_follow_registered_workers_and_update_commits_are_not_measured() -> None:
    estimator = NoiseEstimator(batch_size=BATCH)
    assert estimator.window(PayloadKind.UPDATE, P, registered=8) is None
    assert NoiseEstimator(NOISE_WINDOW_OFF).window(PayloadKind.GRADIENT, P, registered=8) is None
    modes = []
    for _ in range(8):
        window = estimator.window(PayloadKind.GRADIENT, P, registered=8)
        assert window is not None
        modes.append(window.mode)
        window.payload_square = window.window_square = 1.0
        window.applied(window)  # as CommitRule.step does once the commit is applied
    assert modes == [WINDOW_START, *[WINDOW_ADD] * 6, WINDOW_LAST]
    assert estimator.estimate.windows == 1 and estimator.estimate.window == 8
    assert estimator.window(PayloadKind.GRADIENT, P, registered=1) is not None  # one worker: windows of 2
    again = estimator.window(PayloadKind.GRADIENT, P, registered=1)  # the last commit was refused: start over
    assert again is not None and again.mode == WINDOW_START


def test_no_estimate_reads_as_such() -> None:
    assert math.isnan(GradientNoise().scale) and math.isnan(GradientNoise().useful_workers)
    assert "no estimate (no gradient commits" in GradientNoise().describe()
    estimate = GradientNoise(gradient_square=1.0, noise_trace=900.0, batch_size=32, windows=MIN_NOISE_WINDOWS, window=4)
    line = estimate.describe(100)
    assert line == "noise scale ≈ 900 samples: about 28.1 workers of batch 32 pay; 100 registered"
    # Issue 43, item 5: the batch said to be the server's when commits reported none; no estimate
    # from too few windows, nor with no worker registered (the demo's end said "281 workers pay").
    assumed = dataclasses.replace(estimate, batch_size=64, batch_size_assumed=True)
    assert "workers of batch 64 (the server's --batch-size: commits reported no num_samples) pay" in assumed.describe()
    young = dataclasses.replace(estimate, windows=MIN_NOISE_WINDOWS - 1)
    assert math.isnan(young.scale) and math.isnan(young.useful_workers)
    assert young.describe(4) == "noise scale: no estimate (9 of the 10 windows of 4 commits it needs)"
    assert estimate.describe(0) == (
        "noise scale: no estimate (no workers registered; the last, while workers committed: ≈ 900 samples)"
    )


@pytest.mark.parametrize("stride", [1, 7])
@pytest.mark.parametrize("mode", [WINDOW_START, WINDOW_ADD, WINDOW_LAST])
def test_the_compiled_window_pass_is_numpys(mode: int, stride: int) -> None:
    rng = np.random.default_rng(4)
    update = rng.normal(size=5_000).astype(np.float32)  # 313 runs of 16, the last of 8: 45 sampled at stride 7
    window = rng.normal(size=noise_window_size(5_000, stride)).astype(np.float32)
    expected_window = window.copy()
    expected = noise_window(update.astype(np.float64), expected_window, stride, mode)  # float64: numpy's path
    found = noise_window(update, window, stride, mode)
    np.testing.assert_allclose(found, expected, rtol=1e-5)
    np.testing.assert_allclose(window, expected_window, rtol=1e-6)


@pytest.mark.parametrize("stride", [1, 7])
@pytest.mark.parametrize("mode", [WINDOW_START, WINDOW_ADD, WINDOW_LAST])
def test_a_window_measured_within_a_bound_reads_what_a_rule_held(mode: int, stride: int) -> None:
    """A payload its client may still write (a rule that holds_payload): the window reads each value
    it samples within the peak the commit's checks measured, a NaN as its negative, so what the
    client wrote after the check moves the estimate no further than that peak (on either pass)."""
    rng = np.random.default_rng(5)
    update = rng.normal(size=5_000).astype(np.float32)
    bound = float(np.abs(update).max())
    update[::3], update[1::5], update[2::7] = 3e38, np.nan, -np.inf  # written after the check
    window = rng.normal(size=noise_window_size(5_000, stride)).astype(np.float32)
    held = np.clip(np.nan_to_num(update, nan=-bound), -bound, bound).astype(np.float64)
    expected_window = window.copy()
    expected = noise_window(held, expected_window, stride, mode)  # numpy's path, on the held values
    numpy_window = window.copy()
    numpy_found = noise_window(update.astype(np.float64), numpy_window, stride, mode, bound)
    found = noise_window(update, window, stride, mode, bound)
    for measured, written in ((found, window), (numpy_found, numpy_window)):
        assert all(math.isfinite(value) for value in measured)
        np.testing.assert_allclose(measured, expected, rtol=1e-5)
        np.testing.assert_allclose(written, expected_window, rtol=1e-6)


@pytest.mark.parametrize("rule", ["gem", "downpour"])
def test_a_refused_commit_is_not_measured_and_its_window_starts_again(rule: str) -> None:
    state = ServerState(
        training(rule, learning_rate=1.0, batch_size=BATCH),
        WorkerRegistry(max_workers=4, lease_ttl=3600),
        RuleRuntime(gem_kernel="auto"),
        noise_window=2,
    )
    big = np.full(4, 3e38, np.float32)
    worker = state.register("w", [ParameterSpec("w", (4,))], encoded(big)).worker.worker_id

    def commit(gradient: np.ndarray) -> None:
        state.core.commit_record(Commit(worker, state.core.version, PayloadKind.GRADIENT, encoded(gradient)))

    commit(np.zeros(4, np.float32))  # the window's first commit
    with pytest.raises(InvalidArgument):  # θ - g would overflow: refused, nothing changed
        commit(-big)
    assert state.core.noise.estimate.windows == 0
    commit(np.ones(4, np.float32))  # starts the window again (the refused one may have moved its sum)
    commit(np.ones(4, np.float32) * 3)
    assert state.core.noise.estimate.windows == 1
    # One window of g = 1 and 3 at B = BATCH: |G_s|^2 = (4 + 36)/2 = 20, |G_b|^2 = 16 (k = 2).
    assert state.core.noise.estimate.gradient_square == pytest.approx(2 * 16 - 20)
    assert state.core.noise.estimate.noise_trace == pytest.approx((20 - 16) * 2 * BATCH)
