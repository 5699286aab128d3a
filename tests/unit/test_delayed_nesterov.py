"""delayed-nesterov (Liu et al. 2024, Algorithm 3) against the paper's equations written by hand in
its own notation (pseudo-gradients g = -Δ, θ ← θ - ε·(…)), on tiny vectors over several cycles."""

from __future__ import annotations

import re

import numpy as np
import pytest

from gemps_proto.schema import PayloadKind
from gemps_server.domain import images
from gemps_server.domain.rules import create_rule
from gemps_server.domain.rules.base import CommitRule, NonFiniteUpdate, StepContext
from gemps_server.domain.rules.delayed_nesterov import KEPT_PERIOD, DelayedNesterovRule
from gemps_server.replication import image_codec
from tests.helpers import training
from tests.unit.test_adamw_restart import join, restarted, server_state

F32 = np.float32


class PaperDelayedNesterov:
    """Algorithm 3 as the paper writes it, in float64: the server receives pseudo-gradients g_t."""

    def __init__(self, theta: list[float], epsilon: float, beta: float, period: int, activation: float) -> None:
        self.theta = np.array(theta, np.float64)
        self.epsilon, self.beta, self.period, self.activation = epsilon, beta, period, activation
        self.m = np.zeros_like(self.theta)
        self.buffer = np.zeros_like(self.theta)  # the paper's Δ: the pseudo-gradients since the last momentum step
        self.k = 0  # those received since: the paper's t mod N while N is constant

    def receive(self, g: np.ndarray, period: int | None = None) -> None:
        n = period or self.period
        c = min(self.activation, 1 / n)
        self.buffer = self.buffer + g
        self.k += 1
        if self.k >= n:  # (t + 1) mod N = 0
            self.k = 0
            self.m = self.beta * self.m + self.buffer / n
            self.theta = self.theta - self.epsilon * ((1 - c * n + c) * self.beta * self.m + g / n)
            self.buffer = np.zeros_like(self.buffer)
        else:
            self.theta = self.theta - self.epsilon * (c * self.beta * self.m + g / n)


def made(**options: float) -> CommitRule:
    return create_rule(training("delayed-nesterov", **options), 3)


def commit(rule: CommitRule, theta: np.ndarray, update: list[float], worker: str = "a") -> np.ndarray:
    """The worker's accumulated local update Δ = θ_local - θ_pulled, committed as an update."""
    new, _ = rule.step(theta, np.array(update, F32), StepContext(worker, 0, kind=PayloadKind.UPDATE))
    return new


UPDATES = [[0.1, -0.2, 0.4], [0.3, 0.0, -0.1], [-0.2, 0.5, 0.2], [0.05, 0.1, -0.3], [0.4, -0.4, 0.0], [0.2, 0.2, 0.2]]
UPDATES += [[-0.1, 0.3, 0.1]]


@pytest.mark.parametrize("activation", [0.0, 0.25])
def test_the_momentum_steps_every_nth_commit_as_algorithm_3_writes_it(activation: float) -> None:
    rule = made(dn_learning_rate=0.7, momentum=0.5, nesterov_period=3, momentum_activation=activation)
    paper = PaperDelayedNesterov([1.0, 2.0, -1.0], 0.7, 0.5, 3, activation)
    theta = paper.theta.astype(F32)
    for worker in "ab":
        rule.add_worker(worker, theta)
    for index, update in enumerate(UPDATES):  # 7 commits: two whole cycles of 3 and one more
        theta = commit(rule, theta, update, "ab"[index % 2])
        paper.receive(-np.array(update, np.float64))
        np.testing.assert_allclose(theta, paper.theta, rtol=1e-6, atol=1e-6, err_msg=f"commit {index}")
    assert rule.global_state()["buffered"] == 1  # the 7th commit opened a third cycle


def test_between_momentum_steps_theta_takes_plain_outer_sgd_steps_and_a_cycle_nesterovs_mean() -> None:
    """Written out for N = 2, β = 0.5, ε = 1, c = 0: commits 1 and 3 add Δ/2; commits 2 and 4
    also apply β·m, m the momentum fed the mean of the cycle's two updates."""
    rule = made(dn_learning_rate=1.0, momentum=0.5, nesterov_period=2)
    theta = np.zeros(3, F32)
    rule.add_worker("a", theta)
    d1, d2, d3, d4 = (np.array(u, np.float64) for u in UPDATES[:4])
    theta = commit(rule, theta, UPDATES[0])
    np.testing.assert_allclose(theta, d1 / 2, atol=1e-7)  # no momentum yet: a plain step
    theta = commit(rule, theta, UPDATES[1])
    m1 = (d1 + d2) / 2
    np.testing.assert_allclose(theta, d1 / 2 + d2 / 2 + 0.5 * m1, atol=1e-7)  # Nesterov on the mean
    theta = commit(rule, theta, UPDATES[2])
    np.testing.assert_allclose(theta, d1 / 2 + d2 / 2 + 0.5 * m1 + d3 / 2, atol=1e-7)  # m is not reapplied
    theta = commit(rule, theta, UPDATES[3])
    m2 = 0.5 * m1 + (d3 + d4) / 2
    np.testing.assert_allclose(theta, d1 / 2 + d2 / 2 + 0.5 * m1 + d3 / 2 + d4 / 2 + 0.5 * m2, atol=1e-7)


def test_n_defaults_to_the_workers_registered_at_each_commit() -> None:
    rule = made(dn_learning_rate=0.7, momentum=0.9)
    paper = PaperDelayedNesterov([0.0, 0.0, 0.0], 0.7, 0.9, 2, 0.0)
    theta = paper.theta.astype(F32)
    rule.add_worker("a", theta)
    rule.add_worker("b", theta)
    assert isinstance(rule, DelayedNesterovRule) and rule.period() == 2
    for update in UPDATES[:4]:  # two cycles of two workers
        theta = commit(rule, theta, update)
        paper.receive(-np.array(update, np.float64))
    rule.add_worker("c", theta)  # cycles of three from here on
    for update in UPDATES[4:7]:
        theta = commit(rule, theta, update, "c")
        paper.receive(-np.array(update, np.float64), period=3)
    np.testing.assert_allclose(theta, paper.theta, rtol=1e-6, atol=1e-6)
    assert rule.global_state()["buffered"] == 0  # the third of three closed the cycle
    rule.remove_worker("c")
    assert rule.period() == 2


def test_a_gradient_commit_enters_as_minus_eta_g() -> None:
    rule = create_rule(training("delayed-nesterov", learning_rate=0.1, dn_learning_rate=1.0, momentum=0.0), 3)
    theta = np.zeros(3, F32)
    rule.add_worker("a", theta)
    theta, stats = rule.step(theta, np.array([1.0, -2.0, 0.5], F32), StepContext("a", 0))
    np.testing.assert_allclose(theta, [-0.1, 0.2, -0.05], rtol=1e-6)
    assert stats.scaling_mean == 1.0  # ε/N


def test_a_restore_keeps_the_jobs_n_for_the_first_worker_back_as_algorithm_3_goes_on() -> None:
    """N from three registrations; a checkpoint (no workers), a restore, one worker back: its
    commits go on as Algorithm 3 with the job's N = 3 (not cycles of one, a momentum step at each
    commit) until as many registered again; a departure has N follow the workers at once."""
    options = {"dn_learning_rate": 0.7, "momentum": 0.5}
    first, second, third = made(**options), made(**options), made(**options)
    paper = PaperDelayedNesterov([1.0, 2.0, -1.0], 0.7, 0.5, 3, 0.0)
    theta = paper.theta.astype(F32)
    for worker in "abc":
        first.add_worker(worker, theta)
    for update in UPDATES[:4]:  # a cycle and one commit of the next
        theta = commit(first, theta, update)
        paper.receive(-np.array(update, np.float64))
    saved = first.global_state(workers=False)
    assert saved[KEPT_PERIOD] == 3
    for rule in (second, third):  # as a checkpoint file gives it back: the counts of shape [1]
        rule.load_global_state({key: value.reshape(-1).copy() for key, value in saved.items()})
    second.add_worker("a", theta)
    for index, update in enumerate(UPDATES[4:]):  # the open cycle closes at the second of these
        theta = commit(second, theta, update)
        paper.receive(-np.array(update, np.float64))
        np.testing.assert_allclose(theta, paper.theta, rtol=1e-6, atol=1e-6, err_msg=f"commit {index}")
    assert isinstance(second, DelayedNesterovRule) and isinstance(third, DelayedNesterovRule)
    second.add_worker("b", theta)
    assert second.period() == 3
    second.add_worker("c", theta)
    second.add_worker("d", theta)  # the job's three are back: N follows the registrations
    assert second.period() == 4 and second.global_state()[KEPT_PERIOD] == 0
    third.add_worker("a", theta)
    third.add_worker("b", theta)
    third.remove_worker("b")  # the job shrank
    assert third.period() == 1


def test_a_backup_seeded_while_n_is_kept_holds_it_as_its_primary_does() -> None:
    """Through a checkpoint file and a replica image, as a server and its backup carry them."""
    primary = restarted("abc", rule="delayed-nesterov")
    join(primary, "a")
    backup = server_state("delayed-nesterov")
    images.adopt(backup, image_codec.decode(image_codec.encode(images.take(primary))))
    rules = [state.core.rule for state in (primary, backup)]
    assert all(isinstance(rule, DelayedNesterovRule) and rule.period() == 3 for rule in rules)
    for state in (primary, backup):
        join(state, "b")
        join(state, "c")
        join(state, "d")
    assert all(isinstance(rule, DelayedNesterovRule) and rule.period() == 4 for rule in rules)


def test_the_state_round_trips_through_global_state_mid_cycle() -> None:
    options = {"dn_learning_rate": 0.7, "momentum": 0.9, "nesterov_period": 3}
    first, second = made(**options), made(**options)
    theta = np.array([1.0, 2.0, 3.0], F32)
    for rule in (first, second):
        rule.add_worker("a", theta)
    for update in UPDATES[:4]:  # a cycle and one commit of the next: every part of the state is set
        theta = commit(first, theta, update)
    saved = first.global_state(workers=False)
    assert set(saved) == {"momentum", "buffer", "buffered", KEPT_PERIOD} and saved["buffered"] == 1
    assert saved[KEPT_PERIOD] == 0  # N is the option's: nothing kept for the workers
    assert np.abs(saved["momentum"]).max() > 0 and np.abs(saved["buffer"]).max() > 0
    # As a checkpoint file gives it back: the count of shape [1].
    second.load_global_state({key: value.reshape(-1).copy() for key, value in saved.items()})
    theta_second = theta.copy()
    for update in UPDATES[4:]:
        theta = commit(first, theta, update)
        theta_second = commit(second, theta_second, update)
        np.testing.assert_array_equal(theta, theta_second)


def test_a_state_that_does_not_fit_is_refused_by_name() -> None:
    rule = made()
    good = rule.global_state()
    for bad in (
        {"velocity": good["momentum"]},
        {**good, "buffer": np.zeros(4, F32)},
        {**good, "buffered": np.array(1.5, F32)},
        {**good, "buffered": np.array(-1.0, F32)},
        {**good, KEPT_PERIOD: np.array(2.5)},
    ):
        with pytest.raises(ValueError, match="delayed-nesterov rule state must be 'momentum' and 'buffer'"):
            rule.load_global_state(bad)


def test_an_overflowing_commit_is_refused_and_changes_nothing() -> None:
    rule = made(nesterov_period=2)
    theta = np.ones(3, F32)
    rule.add_worker("a", theta)
    theta = commit(rule, theta, [3e38, 3e38, 3e38])  # finite: buffered, θ moves by 0.7·Δ/2
    kept, theta_kept = rule.global_state(), theta.copy()
    with pytest.raises(NonFiniteUpdate):  # the buffer, 6e38, would not be finite
        commit(rule, theta, [3e38, 3e38, 3e38])
    for key, value in rule.global_state().items():
        np.testing.assert_array_equal(value, kept[key])
    np.testing.assert_array_equal(theta, theta_kept)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            {"nesterov_period": 4, "momentum_activation": 0.5},
            "momentum_activation 0.5 is above 1/nesterov_period (1/4)",
        ),
        ({"nesterov_period": -1}, "nesterov_period -1 is outside [0, 2147483647]"),
        ({"nesterov_period": 2.5}, "nesterov_period 2.5 is not a whole number"),
        ({"dn_learning_rate": 0.0}, "dn_learning_rate 0.0 is outside (0, "),
        ({"momentum": 1.0}, "momentum 1.0 is outside [0, 1)"),
        ({"momentum_activation": 1.5}, "momentum_activation 1.5 is outside [0, 1]"),
    ],
)
def test_bad_options_are_refused_with_their_names(options: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        create_rule(training("delayed-nesterov", **options), 3)
