"""Learning-rate schedules: eta at given versions, their validation, and the rules applying -eta(v)*g."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

from gemps_proto.schedules import SCHEDULES, learning_rate_at
from gemps_proto.schema import ParameterSpec, PayloadKind, TrainingConfig
from gemps_server.domain.records import Commit
from gemps_server.domain.rules import create_rule, rule_names
from gemps_server.domain.rules.base import StepContext, constant_schedule
from gemps_server.domain.state import ServerState
from gemps_server.domain.workers import WorkerRegistry
from gemps_server.metrics import ServerMetrics
from tests.helpers import encoded, rule_option, training

F32 = np.float32


def etas(config: TrainingConfig, versions: range) -> list[float]:
    return [learning_rate_at(config, v) for v in versions]


def test_constant_schedule_is_the_learning_rate_at_every_version() -> None:
    config = training(learning_rate=0.05)
    assert config.lr_schedule == "constant" and config.lr_warmup_commits == 0
    assert etas(config, range(0, 100_000, 997)) == [0.05] * len(range(0, 100_000, 997))


def test_step_schedule_multiplies_by_gamma_every_step_size_versions() -> None:
    config = training(learning_rate=0.1, lr_schedule="step", lr_step_size=3, lr_gamma=0.5)
    assert etas(config, range(8)) == pytest.approx([0.1, 0.1, 0.1, 0.05, 0.05, 0.05, 0.025, 0.025])


def test_cosine_schedule_reaches_lr_min_after_total_commits_and_stays() -> None:
    config = training(learning_rate=1.0, lr_schedule="cosine", lr_total_commits=4, lr_min=0.1)
    half_way = 0.1 + 0.9 * (1 + math.cos(math.pi / 4)) / 2
    expected = [1.0, half_way, 0.55, 0.1 + 0.9 * (1 + math.cos(3 * math.pi / 4)) / 2, 0.1, 0.1, 0.1]
    assert etas(config, range(7)) == pytest.approx(expected)
    assert learning_rate_at(config, 10**9) == pytest.approx(0.1)


def test_warmup_rises_linearly_to_the_learning_rate() -> None:
    config = training(learning_rate=0.4, lr_warmup_commits=4)
    assert etas(config, range(7)) == pytest.approx([0.1, 0.2, 0.3, 0.4, 0.4, 0.4, 0.4])


def test_warmup_multiplies_the_decay_counted_from_version_zero() -> None:
    config = training(learning_rate=1.0, lr_schedule="cosine", lr_warmup_commits=2, lr_total_commits=4)
    cosine = [(1 + math.cos(math.pi * v / 4)) / 2 for v in range(5)]
    assert etas(config, range(5)) == pytest.approx([0.5 * cosine[0], *cosine[1:]])
    stepped = training(learning_rate=0.8, lr_schedule="step", lr_warmup_commits=4, lr_step_size=2, lr_gamma=0.5)
    assert etas(stepped, range(5)) == pytest.approx([0.2, 0.4, 0.3, 0.4, 0.2])


def test_warmup_cosine_is_nanogpts_get_lr_its_cosine_counted_from_the_warmups_end() -> None:
    """nanoGPT's train.py get_lr(it) (warmup_iters W, lr_decay_iters T), but for its warm-up of
    (it + 1)/(W + 1), which here is (v + 1)/W, every schedule's."""
    warmup, total, top, bottom = 10, 200, 3e-3, 3e-4
    config = training(learning_rate=top, lr_schedule="warmup-cosine", lr_warmup_commits=warmup,
                      lr_total_commits=total, lr_min=bottom)  # fmt: skip

    def get_lr(it: int) -> float:
        if it < warmup:
            return top * (it + 1) / warmup
        if it > total:
            return bottom
        ratio = (it - warmup) / (total - warmup)
        return bottom + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (top - bottom)

    assert etas(config, range(0, 260, 3)) == pytest.approx([get_lr(v) for v in range(0, 260, 3)])
    assert learning_rate_at(config, warmup) == pytest.approx(top)  # the cosine starts at the warm-up's end
    (problem,) = training(lr_schedule="warmup-cosine", lr_warmup_commits=50, lr_total_commits=50).problems()
    assert "lr_total_commits (50) must be above lr_warmup_commits (50)" in problem


def test_warmup_linear_is_hugging_faces_linear_schedule_from_the_warmups_end() -> None:
    """transformers' get_linear_schedule_with_warmup (the Trainer's default schedule), stepped as
    the Trainer steps it: the same rate at every step from the warm-up's end, 0 from T on; in the
    warm-up HF's step v gets v/W of the rate, the server's version v (v + 1)/W, every schedule's."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    warmup, total, top = 10, 200, 3e-3
    optimizer = torch.optim.AdamW([torch.zeros(1, requires_grad=True)], lr=top)
    scheduler = transformers.get_linear_schedule_with_warmup(optimizer, warmup, total)
    hugging_face = []
    for _ in range(260):
        hugging_face.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    config = training(learning_rate=top, lr_schedule="warmup-linear", lr_warmup_commits=warmup, lr_total_commits=total)
    assert etas(config, range(warmup, 260)) == pytest.approx(hugging_face[warmup:], abs=1e-12)
    assert etas(config, range(warmup)) == pytest.approx([top * (v + 1) / warmup for v in range(warmup)])
    assert learning_rate_at(config, total) == learning_rate_at(config, 10**9) == 0.0
    floored = training(learning_rate=1.0, lr_schedule="warmup-linear", lr_warmup_commits=2, lr_total_commits=6,
                       lr_min=0.2)  # fmt: skip
    assert etas(floored, range(8)) == pytest.approx([0.5, 1.0, 1.0, 0.8, 0.6, 0.4, 0.2, 0.2])
    (problem,) = training(lr_schedule="warmup-linear", lr_warmup_commits=50, lr_total_commits=50).problems()
    assert (
        "warmup-linear decays after the warm-up: lr_total_commits (50) must be above lr_warmup_commits (50)" in problem
    )


def test_the_factors_are_torch_schedulers_closed_forms() -> None:
    torch = pytest.importorskip("torch")
    schedulers = torch.optim.lr_scheduler

    def torch_etas(make: Any, steps: int) -> list[float]:
        optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.3)
        scheduler = make(optimizer)
        found = []
        for _ in range(steps):
            found.append(optimizer.param_groups[0]["lr"])
            optimizer.step()
            scheduler.step()
        return found

    warmup = training(learning_rate=0.3, lr_warmup_commits=5)
    assert etas(warmup, range(9)) == pytest.approx(
        torch_etas(lambda o: schedulers.LinearLR(o, start_factor=1 / 5, total_iters=4), 9)
    )
    step = training(learning_rate=0.3, lr_schedule="step", lr_step_size=3, lr_gamma=0.2)
    assert etas(step, range(10)) == pytest.approx(torch_etas(lambda o: schedulers.StepLR(o, 3, gamma=0.2), 10))
    cosine = training(learning_rate=0.3, lr_schedule="cosine", lr_total_commits=7, lr_min=0.01)
    assert etas(cosine, range(8)) == pytest.approx(
        torch_etas(lambda o: schedulers.CosineAnnealingLR(o, T_max=7, eta_min=0.01), 8)
    )


def test_an_empty_schedule_name_is_constant_and_an_unknown_one_is_refused() -> None:
    # "" is what a TrainingConfig message without the field decodes to.
    assert learning_rate_at(training(learning_rate=0.2, lr_schedule=""), 5000) == 0.2
    with pytest.raises(ValueError, match="unknown lr_schedule 'linear'"):
        learning_rate_at(training(lr_schedule="linear"), 1)


@pytest.mark.parametrize(
    "changes,field",
    [
        ({"lr_schedule": "exponential"}, "lr_schedule"),
        ({"lr_warmup_commits": -1}, "lr_warmup_commits"),
        ({"lr_step_size": 0}, "lr_step_size"),
        ({"lr_gamma": 0.0}, "lr_gamma"),
        ({"lr_gamma": 1.5}, "lr_gamma"),
        ({"lr_gamma": math.nan}, "lr_gamma"),
        ({"lr_total_commits": 0}, "lr_total_commits"),
        ({"lr_min": -0.01}, "lr_min"),
        ({"lr_min": 0.5, "learning_rate": 0.1}, "lr_min"),
    ],
)
def test_invalid_schedule_values_name_the_field(changes: dict[str, Any], field: str) -> None:
    (problem,) = training(**changes).problems()
    assert field in problem


def test_valid_schedules_have_no_problems() -> None:
    assert {"warmup-cosine", "warmup-linear"} <= set(SCHEDULES)
    for name in SCHEDULES:
        assert training(lr_schedule=name, lr_warmup_commits=10, lr_gamma=1.0, lr_min=0.05).problems() == []


SCHEDULED = {"learning_rate": 0.5, "lr_schedule": "step", "lr_step_size": 2, "lr_gamma": 0.5}


@pytest.mark.parametrize("rule", rule_names())
def test_every_rule_scales_a_gradient_by_eta_at_the_version_it_is_applied_at(rule: str) -> None:
    config = training(rule, lr_warmup_commits=3, **SCHEDULED)
    gradient = np.array([0.25, -0.5, 1.0, 0.0], F32)
    for version in (0, 1, 2, 5, 9):
        made = create_rule(config, 4)
        assert made.learning_rate_at(version) == learning_rate_at(config, version)
        theta = np.ones(4, F32)
        made.add_worker("a", theta)
        # A worker's first commit, not stale: every rule applies Delta = -eta*g as it is (GEM's
        # pi is kappa = 1 there, the momentum rule's velocity starts at 0), Nesterov's look-ahead
        # (1 + mu)*Delta, delayed-nesterov's (one worker: a momentum step each commit) eps*(1 + beta)*Delta.
        theta, _ = made.step(theta, gradient, StepContext("a", 0, version=version))
        first = F32(1 + rule_option(config, "momentum")) if rule == "nesterov" else F32(1)
        if rule == "delayed-nesterov":
            first = F32(rule_option(config, "dn_learning_rate") * (1 + rule_option(config, "momentum")))
        eta = learning_rate_at(config, version)
        expected = F32(1.0) - first * F32(eta) * gradient
        if rule == "adamw":  # one worker: a step each commit; AdamW's first moves eta*g/(|g| + eps), after the decay
            decayed = 1.0 - eta * rule_option(config, "adam_weight_decay")
            expected = F32(decayed) - F32(eta) * gradient / (
                np.abs(gradient) + F32(rule_option(config, "adam_epsilon"))
            )
        np.testing.assert_allclose(theta, expected, rtol=1e-6)


def test_updates_are_applied_as_sent_whatever_the_schedule() -> None:
    made = create_rule(training("downpour", **SCHEDULED), 2)
    theta = np.zeros(2, F32)
    made.add_worker("a", theta)
    theta, _ = made.step(theta, np.array([1.0, -2.0], F32), StepContext("a", 0, version=7, kind=PayloadKind.UPDATE))
    np.testing.assert_array_equal(theta, [1.0, -2.0])


def test_the_server_applies_each_commit_with_eta_at_its_version() -> None:
    """downpour, step schedule (eta 0.5 at versions 0 and 1, 0.25 at 2 and 3): by hand, theta after
    four gradient commits of ones from 0 is -(0.5 + 0.5 + 0.25 + 0.25) = -1.5."""
    state = ServerState(training("downpour", **SCHEDULED), WorkerRegistry(max_workers=4, lease_ttl=3600))
    spec = [ParameterSpec("w", (3,))]
    worker = state.register("w", spec, encoded(np.zeros(3, F32))).worker.worker_id
    seen = []
    for version in range(4):
        seen.append(state.learning_rate)
        state.core.commit_record(Commit(worker, version, int(PayloadKind.GRADIENT), encoded(np.ones(3, F32))))
    assert seen == [0.5, 0.5, 0.25, 0.25]
    np.testing.assert_array_equal(state.core.theta_copy(), np.full(3, -1.5, F32))
    assert (state.core.version, state.learning_rate) == (4, 0.125)


def test_the_momentum_rule_keeps_each_gradients_eta_in_its_velocity() -> None:
    made = create_rule(training("momentum", momentum=0.5, **SCHEDULED), 1)
    theta = np.zeros(1, F32)
    made.add_worker("a", theta)
    theta, _ = made.step(theta, np.ones(1, F32), StepContext("a", 0, version=1))  # v = -0.5
    theta, _ = made.step(theta, np.ones(1, F32), StepContext("a", 0, version=2))  # v = -0.25 - 0.25
    np.testing.assert_array_equal(theta, [-1.0])


def test_the_learning_rate_gauge_reads_eta_at_the_live_version() -> None:
    metrics = ServerMetrics()
    config = training(learning_rate=1.0, lr_schedule="cosine", lr_total_commits=10)
    metrics.describe_server(config)
    version = [0]
    metrics.observe(
        version=lambda: version[0],
        parameters=lambda: 1,
        rule_state_bytes=lambda: 0,
        active_workers=lambda: 0,
        queue_depth=lambda: 0,
    )
    for version[0] in (0, 5, 10, 20):
        assert metrics.registry.get_sample_value("gemps_learning_rate") == learning_rate_at(config, version[0])


def test_a_rule_takes_the_constant_schedule_as_itself_and_any_other_from_its_config() -> None:
    """The factor is asked on every commit: a constant schedule without a warm-up is the plain
    function, every other schedule (or a warm-up) the config's, each giving eta as configured."""

    plain = create_rule(training(learning_rate=0.05), 4)
    assert plain.schedule is constant_schedule and plain.learning_rate_at(12_345) == 0.05
    warmed = create_rule(training(learning_rate=0.05, lr_warmup_commits=10), 4)
    assert warmed.schedule is not constant_schedule
    assert [warmed.learning_rate_at(v) for v in (0, 4, 9, 50)] == pytest.approx([0.005, 0.025, 0.05, 0.05])
