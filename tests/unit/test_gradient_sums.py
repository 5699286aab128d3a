"""Update commits' gradient sums (gemps_proto.gradient_sums): the server folds a worker's window of
local steps into the noise scale as it folds k gradient commits, refuses sums no gradients have,
or sent with a gradient commit, before θ moves, and a journal's frame carries them to a backup."""

from __future__ import annotations

import math

import numpy as np
import pytest

from gemps_proto.gradient_sums import GradientSums, per_partition
from gemps_proto.reasons import Reason
from gemps_proto.schema import ParameterSpec, PayloadKind
from gemps_server.commit_frame import commit_from_proto, commit_to_proto
from gemps_server.domain.errors import InvalidArgument
from gemps_server.domain.noise import EMA_DECAY, NOISE_WINDOW_OFF, MovingAverage
from gemps_server.domain.records import Commit
from gemps_server.domain.rules import RuleRuntime
from gemps_server.domain.state import ServerState
from gemps_server.domain.workers import WorkerRegistry
from tests.helpers import encoded, training
from tests.unit.test_noise import BATCH, SIGMA2, P, synthetic

K = 8  # local steps a window


def windows_of(gradients: list[np.ndarray], samples: int) -> list[GradientSums]:
    """What a worker sends for these consecutive local steps, a window of K at a time: the plain
    float64 sums of each window's |g_i|^2 and of its steps' second differences (from the run's third)."""
    values = [g.astype(np.float64) for g in gradients]
    sent = []
    for start in range(0, len(values), K):
        differences = [values[i - 2] - 2 * values[i - 1] + values[i] for i in range(max(start, 2), start + K)]
        square_sum = float(sum(g @ g for g in values[start : start + K]))
        sent.append(GradientSums(square_sum, float(sum(d @ d for d in differences)), K, len(differences), samples))
    return sent


def reference(sums: list[GradientSums], batch: float) -> tuple[float, float]:
    """(EMA |G|^2, EMA tr(Σ)) written plainly: N = Σ|d|^2 / 6n, |G|^2 = mean |g|^2 - N, tr(Σ) = N·B."""
    square, trace = MovingAverage(EMA_DECAY), MovingAverage(EMA_DECAY)
    for window in sums:
        noise = window.difference_square / (6 * window.differences)
        square.add(window.square_sum / window.steps - noise)
        trace.add(noise * batch)
    return square.value, trace.value


def downpour(noise_window: int = 0, size: int = P) -> tuple[ServerState, str]:
    state = ServerState(
        training("downpour", learning_rate=1.0, batch_size=BATCH),
        WorkerRegistry(max_workers=4, lease_ttl=3600),
        RuleRuntime(gem_kernel="auto"),
        noise_window=noise_window,
    )
    worker = state.register("w", [ParameterSpec("w", (size,))], encoded(np.zeros(size, np.float32))).worker
    return state, worker.worker_id


def update(state: ServerState, worker: str, sums: GradientSums | None, kind: PayloadKind = PayloadKind.UPDATE) -> None:
    payload = encoded(np.full(state.core.theta.size, 1e-3, np.float32))
    state.core.commit_record(Commit(worker, state.core.version, kind, payload, gradient_sums=sums))


def test_an_update_commits_sums_are_the_plain_reference_of_its_local_steps() -> None:
    _, gradients = synthetic(np.random.default_rng(7), 80)
    sums = windows_of(gradients, K * BATCH)
    state, worker = downpour()
    assert state.core.noise.estimate.windows == 0
    for window in sums:  # one update commit a window of K local steps, each at BATCH samples
        update(state, worker, window)
    square, trace = reference(sums, BATCH)
    estimate = state.core.noise.estimate
    assert estimate.windows == 10 and estimate.window == K and estimate.batch_size == BATCH
    assert not estimate.batch_size_assumed
    assert estimate.noise_trace == pytest.approx(trace, rel=1e-12)
    assert estimate.gradient_square == pytest.approx(square, rel=1e-12)
    assert estimate.scale == pytest.approx(SIGMA2, rel=0.3)  # the truth, from 10 windows only


def plain_two_batch_reading(gradients: list[np.ndarray]) -> float:
    """B_noise from windows of K consecutive gradients, |mean g|^2 against mean |g|^2 (the server's
    estimate for gradient commits, McCandlish's Appendix A), averaged as the server averages."""
    square, trace = MovingAverage(EMA_DECAY), MovingAverage(EMA_DECAY)
    for start in range(0, len(gradients), K):
        window = gradients[start : start + K]
        small = float(np.mean([g @ g for g in window]))
        mean = np.mean(window, axis=0)
        large = float(mean @ mean)
        square.add((K * large - small) / (K - 1))
        trace.add((small - large) * K * BATCH / (K - 1))
    return trace.value / square.value


def test_a_gradient_that_moves_with_the_workers_steps_is_not_read_as_noise() -> None:
    """The worker's AdamW steps move θ and its gradient with it: here the true gradient turns half
    a circle every window, and each batch's noise is twice its signal (B_noise two batches, as on
    the character GPT). Consecutive steps' plain two-batch estimate reads the turn as noise; the
    second differences leave it out (a turn of ω a step leaves (2 - 2 cos ω)^2 |G|^2 of it)."""
    rng = np.random.default_rng(11)
    a = rng.choice([-1.0, 1.0], size=P)
    b = a * rng.choice([-1.0, 1.0], size=P)  # about orthogonal to a, as long
    turn = math.pi / K
    gradients = [
        math.cos(turn * i) * a + math.sin(turn * i) * b + rng.normal(scale=math.sqrt(2.0), size=P) for i in range(400)
    ]
    state, worker = downpour()
    for window in windows_of(gradients, K * BATCH):
        update(state, worker, window)
    truth = 2.0 * BATCH  # tr(Σ) = 2·P·BATCH, |G|^2 = P
    assert state.core.noise.estimate.scale == pytest.approx(truth, rel=0.15)
    assert plain_two_batch_reading(gradients) > 2 * truth


def test_sums_without_samples_take_the_servers_batch_size_and_say_so() -> None:
    state, worker = downpour()
    update(state, worker, GradientSums(square_sum=40.0, difference_square=12.0, steps=2, differences=1))
    estimate = state.core.noise.estimate
    assert estimate.batch_size == BATCH and estimate.batch_size_assumed
    # N = 12 / 6 = 2 a batch; |G|^2 = 40 / 2 - 2
    assert estimate.gradient_square == pytest.approx(18.0)
    assert estimate.noise_trace == pytest.approx(2.0 * BATCH)


def test_with_the_estimate_off_sums_are_taken_and_not_measured() -> None:
    state, worker = downpour(NOISE_WINDOW_OFF)
    update(state, worker, GradientSums(40.0, 12.0, 2, 1, 2 * BATCH))
    assert state.core.version == 1 and state.core.noise.estimate.windows == 0


@pytest.mark.parametrize(
    ("sums", "kind", "said"),
    [
        (GradientSums(40.0, 12.0, 2, 1), PayloadKind.GRADIENT, "measures gradient commits itself"),
        (GradientSums(4.0, 4.0, 0, 1), PayloadKind.UPDATE, "steps is 0"),
        (GradientSums(4.0, 4.0, 2, 0), PayloadKind.UPDATE, "differences is 0: one to steps (2)"),
        (GradientSums(4.0, 4.0, 2, 3), PayloadKind.UPDATE, "differences is 3: one to steps (2)"),
        (GradientSums(math.nan, 4.0, 2, 1), PayloadKind.UPDATE, "square_sum must be a finite number >= 0, not nan"),
        (GradientSums(4.0, -1.0, 2, 1), PayloadKind.UPDATE, "difference_square must be a finite number >= 0"),
        (GradientSums(4.0, math.inf, 2, 1), PayloadKind.UPDATE, "difference_square must be a finite number >= 0"),
    ],
)
def test_sums_no_local_steps_have_are_refused_and_nothing_changes(
    sums: GradientSums, kind: PayloadKind, said: str
) -> None:
    state, worker = downpour()
    theta = state.core.theta_copy()
    with pytest.raises(InvalidArgument, match="commit refused, nothing changed") as refused:
        update(state, worker, sums, kind)
    assert refused.value.reason is Reason.BAD_GRADIENT_SUMS and said in str(refused.value)
    assert state.core.version == 0 and state.core.commits_applied == 0
    np.testing.assert_array_equal(state.core.theta_copy(), theta)
    assert state.core.noise.estimate.windows == 0
    update(state, worker, GradientSums(8.0, 6.0, 2, 1))  # the same worker's next, well-formed: taken
    assert state.core.version == 1 and state.core.noise.estimate.windows == 1


def test_a_journals_frame_carries_the_sums_to_a_backup() -> None:
    sums = GradientSums(12.5, 20.0, 3, 2, 96)
    commit = Commit("w", 4, PayloadKind.UPDATE, encoded(np.ones(8, np.float32)), gradient_sums=sums)
    request = commit_to_proto(commit)
    assert commit_from_proto(request, commit.payload).gradient_sums == sums
    plain = Commit("w", 4, PayloadKind.UPDATE, encoded(np.ones(8, np.float32)))
    assert commit_from_proto(commit_to_proto(plain), plain.payload).gradient_sums is None


def test_a_client_gives_one_sum_per_partition() -> None:
    sums = GradientSums(1.0, 1.0, 2, 1)
    assert per_partition(None, 3) == [None, None, None]
    assert per_partition([sums, sums], 2) == [sums, sums]
    with pytest.raises(ValueError, match="1 given for 2 partition"):
        per_partition([sums], 2)
