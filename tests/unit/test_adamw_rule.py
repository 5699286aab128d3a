"""The adamw rule (rules/adamw.py): torch.optim.AdamW's step on the mean of a round's gradients,
backup workers whose late gradients are dropped, the commits a round still needs, its state kept
whole by a checkpoint and by a refused commit."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from gemps_proto.schema import ParameterSpec, PayloadKind
from gemps_proto.status import Rounds
from gemps_server.domain.records import Commit
from gemps_server.domain.rules import CommitRule, NonFiniteUpdate, create_rule, training_problems
from gemps_server.domain.rules.adamw import AdamWRule
from gemps_server.domain.rules.base import ApplyStats, StepContext
from gemps_server.domain.state import ServerState
from gemps_server.domain.workers import WorkerRegistry
from tests.helpers import encoded, training

P = 301


def made(workers: int = 4, **options: float) -> AdamWRule:
    rule = create_rule(training("adamw", learning_rate=3e-3, **options), P)
    assert isinstance(rule, AdamWRule)
    for index in range(workers):
        rule.add_worker(f"w{index}", np.zeros(P, np.float32))
    return rule


def gradients(rng: np.random.Generator, count: int) -> list[np.ndarray]:
    return [(rng.normal(size=P) * rng.choice([1e-3, 1.0, 30.0], size=P)).astype(np.float32) for _ in range(count)]


def run_round(rule: CommitRule, theta: np.ndarray, grads: list[np.ndarray], version: int) -> tuple[np.ndarray, int]:
    """Each gradient in turn, all taken on the round's θ (staleness: the commits since it began)."""
    for index, gradient in enumerate(grads):
        theta, stats = rule.step(theta, gradient, StepContext(f"w{index}", staleness=index, version=version))
        version += 1
        assert stats.pending == len(grads) - 1 - index and stats.kept_theta == (index < len(grads) - 1)
    return theta, version


@pytest.mark.parametrize("betas,decay", [((0.9, 0.999), 0.01), ((0.5, 0.99), 0.1)])
def test_a_round_is_one_torch_adamw_step_on_the_mean_gradient(betas: tuple[float, float], decay: float) -> None:
    rule = made(adam_beta1=betas[0], adam_beta2=betas[1], adam_weight_decay=decay)
    rng = np.random.default_rng(0)
    theta = rng.normal(size=P).astype(np.float32)
    reference = torch.tensor(theta.copy(), requires_grad=True)
    optimizer = torch.optim.AdamW([reference], lr=3e-3, betas=betas, weight_decay=decay)
    version = 0
    for _ in range(40):
        grads = gradients(rng, 4)
        theta, version = run_round(rule, theta, grads, version)
        reference.grad = torch.from_numpy(np.mean(grads, axis=0))
        optimizer.step()
    np.testing.assert_allclose(theta, reference.detach().numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("bounds", [(0, 230), (50, 201)])  # the whole, or a partition's slice of it
def test_the_decay_spares_biases_and_gains_as_nanogpts_groups_do(bounds: tuple[int, int]) -> None:
    spec = [
        ParameterSpec("w", (10, 10)),
        ParameterSpec("b", (10,)),
        ParameterSpec("v", (5, 20)),
        ParameterSpec("g", (20,)),
    ]
    start, stop = bounds
    rule = create_rule(training("adamw", learning_rate=1e-2, adam_weight_decay=0.5), stop - start)
    rule.add_worker("w0", np.zeros(1, np.float32))
    rule.take_spec(spec, bounds)
    rng = np.random.default_rng(7)
    whole = rng.normal(size=230).astype(np.float32)
    values = torch.tensor(whole.copy())
    matrices = [p for p in torch.split(values, [100, 10, 100, 20]) for p in [p.clone().requires_grad_()]]
    groups = [
        {"params": [matrices[0], matrices[2]], "weight_decay": 0.5},
        {"params": [matrices[1], matrices[3]], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=1e-2)
    theta = whole[start:stop].copy()
    for version in range(5):
        gradient = rng.normal(size=230).astype(np.float32)
        theta, _ = rule.step(theta, gradient[start:stop], StepContext("w0", version=version))
        for tensor, part in zip(matrices, torch.split(torch.from_numpy(gradient), [100, 10, 100, 20]), strict=True):
            tensor.grad = part.clone()
        optimizer.step()
    expected = torch.cat([tensor.detach() for tensor in matrices]).numpy()[start:stop]
    np.testing.assert_allclose(theta, expected, rtol=1e-5, atol=1e-6)
    for decay_vectors, kept in ((1, np.float32(1 - 1e-2 * 0.5)), (0, np.float32(1.0))):  # a zero gradient: decay alone
        vectors = create_rule(
            training("adamw", learning_rate=1e-2, adam_weight_decay=0.5, adam_decay_vectors=decay_vectors), 4
        )
        vectors.add_worker("w0", np.zeros(1, np.float32))
        vectors.take_spec([ParameterSpec("b", (4,))], (0, 4))
        moved, _ = vectors.step(np.ones(4, np.float32), np.zeros(4, np.float32), StepContext("w0"))
        np.testing.assert_array_equal(moved, np.full(4, kept))


def test_the_rounds_mean_gradient_is_clipped_as_ddp_clips_it_after_the_all_reduce() -> None:
    rule = made(gradient_clip=1.0)
    rng = np.random.default_rng(6)
    theta = rng.normal(size=P).astype(np.float32)
    reference = torch.tensor(theta.copy(), requires_grad=True)
    optimizer = torch.optim.AdamW([reference], lr=3e-3)
    version, norms = 0, []
    for scale in (0.001, 10.0, 0.5, 100.0):  # some rounds' means shorter than the bound, some longer
        grads = [g * np.float32(scale / 30) for g in gradients(rng, 4)]
        theta, version = run_round(rule, theta, grads, version)
        reference.grad = torch.from_numpy(np.mean(grads, axis=0))
        norms.append(float(torch.nn.utils.clip_grad_norm_([reference], 1.0)))
        optimizer.step()
    assert min(norms) < 1.0 < max(norms), norms
    np.testing.assert_allclose(theta, reference.detach().numpy(), rtol=1e-5, atol=1e-6)


def test_a_backup_workers_gradient_taken_before_the_round_closed_is_dropped() -> None:
    rule = made(workers=4, backup_workers=1)  # a round: the first 3 of 4
    rng = np.random.default_rng(1)
    theta = rng.normal(size=P).astype(np.float32)
    theta, version = run_round(rule, theta, gradients(rng, 3), 0)  # closes at the third: θ moved
    before = theta.copy()
    # The fourth worker's gradient, taken on the θ of version 0, arrives after the round closed.
    late, stats = rule.step(theta, gradients(rng, 1)[0], StepContext("w3", staleness=version, version=version))
    np.testing.assert_array_equal(late, before)
    # Dropped: nothing to wait for (its θ is the open round's), and θ as it was.
    assert (stats.scaling_mean, stats.fraction_at_zero, stats.pending, stats.kept_theta) == (0.0, 1.0, 0, True)
    # It changed nothing: the next round is the same as on a rule that never saw it.
    twin = made(workers=4, backup_workers=1)
    twin.load_global_state(rule.global_state())
    grads = gradients(rng, 3)
    theta, _ = run_round(rule, late, grads, version + 1)
    again, _ = run_round(twin, before.copy(), grads, version + 1)
    np.testing.assert_array_equal(theta, again)


def test_the_round_is_the_workers_registered_less_the_backups_or_the_fixed_size() -> None:
    rule = made(workers=5, backup_workers=2)
    assert rule.period() == 3
    rule.remove_worker("w0")
    assert rule.period() == 2
    assert made(workers=5, round_size=7).period() == 7
    assert made(workers=2, backup_workers=4).period() == 1  # never less than one
    with pytest.raises(ValueError, match="backup_workers 1 with round_size 4"):
        made(round_size=4, backup_workers=1)


def test_an_update_commit_enters_as_the_pseudo_gradient_minus_delta() -> None:
    by_update, by_gradient = made(workers=1), made(workers=1)
    rng = np.random.default_rng(2)
    theta = rng.normal(size=P).astype(np.float32)
    delta = gradients(rng, 1)[0]
    moved, _ = by_update.step(theta.copy(), delta, StepContext("w0", kind=PayloadKind.UPDATE))
    expected, _ = by_gradient.step(theta.copy(), -delta, StepContext("w0"))
    np.testing.assert_array_equal(moved, expected)


@pytest.mark.parametrize("rate,momentum", [(1.0, 0.0), (0.7, 0.0), (0.7, 0.9)])
def test_with_an_outer_rate_a_round_of_updates_is_diloco_s_outer_step(rate: float, momentum: float) -> None:
    """A round of update commits (local AdamW windows) closes with torch's Nesterov SGD step on
    their mean pseudo-gradient -Δ (DiLoCo's outer step; momentum 0 and rate 1: the workers' models
    averaged), against torch in float64; no AdamW step is taken."""
    rule = made(outer_rate=rate, outer_momentum=momentum)
    rng = np.random.default_rng(4)
    theta = rng.normal(size=P).astype(np.float32)
    reference = torch.tensor(theta.astype(np.float64), requires_grad=True)
    outer = torch.optim.SGD([reference], lr=rate, momentum=momentum, nesterov=momentum > 0)
    version = 0
    for _ in range(5):
        deltas = gradients(rng, 4)
        for index, delta in enumerate(deltas):
            context = StepContext(f"w{index}", staleness=index, version=version, kind=PayloadKind.UPDATE)
            theta, stats = rule.step(theta, delta, context)
            version += 1
            assert stats.pending == 3 - index
        reference.grad = torch.from_numpy(-np.mean(np.asarray(deltas, np.float64), axis=0))
        outer.step()
    np.testing.assert_allclose(theta, reference.detach().numpy(), rtol=1e-5, atol=1e-4)
    assert not rule.global_state()["second_moment"].any()  # no AdamW step was taken


def test_an_outer_momentum_without_an_outer_rate_is_refused() -> None:
    with pytest.raises(ValueError, match=re.escape("outer_momentum 0.9 with outer_rate 0")):
        made(outer_momentum=0.9)


@pytest.mark.parametrize(
    "option,value",
    [("adam_beta1", 0.5), ("adam_beta2", 0.99), ("adam_epsilon", 1e-6), ("adam_weight_decay", 0.1),
     ("adam_decay_vectors", 1), ("gradient_clip", 1.0)],
)  # fmt: skip
def test_an_adamw_step_option_given_with_an_outer_rate_is_refused_naming_it(option: str, value: float) -> None:
    """Under outer_rate no AdamW step is taken: an option of that step, set, would be accepted and
    unused; the server's checks refuse it, naming it and the outer rate. Set without an outer rate,
    or left at its default under one, it is taken."""
    assert training_problems(training("adamw", **{option: value})) == []
    assert training_problems(training("adamw", outer_rate=0.7)) == []
    (problem,) = training_problems(training("adamw", outer_rate=0.7, **{option: value}))
    assert problem.startswith(f"{option} with outer_rate 0.7: "), problem


def test_with_an_outer_rate_a_gradient_is_refused_naming_why() -> None:
    assert made().refusal(PayloadKind.GRADIENT) is None
    averaging = made(outer_rate=1.0)
    assert averaging.refusal(PayloadKind.UPDATE) is None
    assert "outer_rate 1" in (averaging.refusal(PayloadKind.GRADIENT) or "")


def test_a_checkpointed_state_mid_round_continues_as_the_rule_would_have() -> None:
    rule = made()
    rng = np.random.default_rng(3)
    theta = rng.normal(size=P).astype(np.float32)
    theta, version = run_round(rule, theta, gradients(rng, 4), 0)
    theta, _ = rule.step(theta, gradients(rng, 1)[0], StepContext("w0", version=version))  # one of the next round
    restored = made()
    restored.load_global_state({key: value.copy() for key, value in rule.global_state(workers=False).items()})
    grads = gradients(rng, 3)
    ends = []
    for each in (rule, restored):
        current = theta.copy()
        for index, gradient in enumerate(grads, start=1):
            current, _ = each.step(
                current, gradient, StepContext(f"w{index}", staleness=index, version=version + index)
            )
        ends.append(current)
    np.testing.assert_array_equal(ends[0], ends[1])
    assert not np.array_equal(ends[0], theta)  # the round closed
    with pytest.raises(ValueError, match="adamw rule state must be"):
        restored.load_global_state({"first_moment": np.zeros(P, np.float32)})


def test_a_gradient_that_would_overflow_the_moments_is_refused_with_nothing_changed() -> None:
    rule, twin = made(workers=1), made(workers=1)
    rng = np.random.default_rng(4)
    theta = rng.normal(size=P).astype(np.float32)
    theta, _ = rule.step(theta, gradients(rng, 1)[0], StepContext("w0"))
    twin.load_global_state(rule.global_state())
    held = theta.copy()
    with pytest.raises(NonFiniteUpdate, match="moments"):
        rule.step(theta, np.full(P, 1e30, np.float32), StepContext("w0", version=1))  # its square: infinite
    np.testing.assert_array_equal(theta, held)
    gradient = gradients(rng, 1)[0]
    after, _ = rule.step(theta, gradient, StepContext("w0", version=1))
    expected, _ = twin.step(held.copy(), gradient, StepContext("w0", version=1))
    np.testing.assert_array_equal(after, expected)


def test_the_versions_of_an_open_round_hold_one_theta_so_a_pull_of_it_carries_none() -> None:
    state = ServerState(training("adamw", learning_rate=3e-3), WorkerRegistry(max_workers=8, lease_ttl=3600))
    spec = [ParameterSpec("w", (P,))]
    workers = [
        state.register(f"w{index}", spec, encoded(np.ones(P, np.float32))).worker.worker_id for index in range(3)
    ]
    core, rng = state.core, np.random.default_rng(5)

    def commit(worker: str, base: int) -> ApplyStats:
        return core.commit_record(Commit(worker, base, PayloadKind.GRADIENT, encoded(gradients(rng, 1)[0]))).stats

    assert [commit(worker, 0).pending for worker in workers] == [2, 1, 0]  # the third closed round 1 at version 3
    assert not core.same_theta(2, 3) and core.same_theta(3, 3)
    held = state.core.theta_copy()
    assert commit(workers[0], 3).pending == 2 and commit(workers[1], 0).pending == 0  # the second: dropped
    assert commit(workers[1], 4).pending == 1
    np.testing.assert_array_equal(state.core.theta_copy(), held)
    # Versions 3 to 6 hold one θ: a caller holding any of them has the current one.
    assert [core.same_theta(known, 6) for known in range(2, 8)] == [False, True, True, True, True, False]
    assert commit(workers[2], 5).pending == 0  # closes round 2: θ moved at version 7
    assert not core.same_theta(6, 7) and core.same_theta(7, 7)
    assert not np.array_equal(state.core.theta_copy(), held)


def test_a_worker_silent_for_two_rounds_of_commits_no_longer_sizes_the_round() -> None:
    """A worker killed without leaving stays registered for its lease (60 s here by default). Its
    rounds are sized by the workers still committing: once 2N commits came without one of its,
    they close on the live workers' gradients alone; a worker not committed yet is counted."""
    state = ServerState(training("adamw", learning_rate=3e-3), WorkerRegistry(max_workers=8, lease_ttl=3600))
    spec = [ParameterSpec("w", (P,))]

    def joined(name: str) -> str:
        return state.register(name, spec, encoded(np.ones(P, np.float32)), client_id=name * 8).worker.worker_id

    a, b, ghost = (joined(name) for name in "abc")
    core, rng, sent = state.core, np.random.default_rng(7), iter(range(1, 1000))

    def commit(worker: str) -> int:
        commit = Commit(worker, core.version, PayloadKind.GRADIENT, encoded(gradients(rng, 1)[0]), f"r{next(sent)}")
        return core.commit_record(commit).stats.pending

    assert [commit(worker) for worker in (a, b, ghost)] == [2, 1, 0]  # round 1: the three of them
    restarted = joined("d")  # the ghost's process, started again: a new registration
    sizes = []
    for _ in range(5):  # each round: the three live ones, then (as the SDK does after waiting) a again
        pending = [commit(worker) for worker in (a, b, restarted)]
        sizes.append(pending[0] + 1)
        while pending[-1]:
            pending.append(commit(a))
    # The ghost counted while its last commit is among the last 2N = 8 versions; then no longer.
    assert sizes == [4, 4, 3, 3, 3]
    assert len(state.registry) == 4  # still registered: only the round's size changed


def test_a_departure_that_leaves_the_round_all_it_waits_for_has_it_take_their_next_commits() -> None:
    """Three workers, two committed to the round (K 3): the third leaving makes K 2, which the round
    holds, and nobody commits while the two wait for θ. The core names them (CommitCore.round_takers,
    what their held pulls are answered with) until the next commit closes the round; a dropped
    commit in between moves no θ and leaves them named; a registration that raises K again does not."""
    state = ServerState(training("adamw", learning_rate=3e-3), WorkerRegistry(max_workers=8, lease_ttl=3600))
    spec = [ParameterSpec("w", (P,))]

    def joined(name: str) -> str:
        return state.register(name, spec, encoded(np.ones(P, np.float32)), client_id=name * 8).worker.worker_id

    a, b, leaving = (joined(name) for name in "abc")
    core, rng = state.core, np.random.default_rng(11)

    def commit(worker: str, base: int) -> ApplyStats:
        return core.commit_record(Commit(worker, base, PayloadKind.GRADIENT, encoded(gradients(rng, 1)[0]))).stats

    assert core.round_takers() == set()  # no commit in the round
    assert [commit(worker, 0).pending for worker in (a, b)] == [2, 1]
    assert core.round_takers() == set()  # it waits for the third
    state.leave(leaving)
    assert core.round_takers() == {a, b} and core.version == 2
    late = joined("d")  # K 3 again: the newcomer's commit is awaited
    assert core.round_takers() == set()
    state.leave(late)
    assert core.round_takers() == {a, b}
    held = core.theta_copy()
    assert commit(a, 0).pending == 0  # on the round's θ: the third gradient of a round of 2 closes it
    assert not np.array_equal(core.theta_copy(), held) and core.round_takers() == set()
    assert commit(a, 3).pending == 1  # round 2 (from version 3): a, then b leaves: K 1, which it holds
    assert core.round_takers() == set()
    state.leave(b)
    assert core.round_takers() == {a}
    held = core.theta_copy()
    assert commit(a, 0).pending == 0 and core.round_takers() == {a}  # taken before round 2 began: dropped
    np.testing.assert_array_equal(core.theta_copy(), held)
    assert commit(a, 4).pending == 0 and core.round_takers() == set()  # closes it
    assert not np.array_equal(core.theta_copy(), held)
    state.leave(a)  # a round with nothing in it takes nothing
    assert core.round_takers() == set()


def test_a_round_size_above_the_workers_takes_the_next_commits_of_those_short_of_their_share() -> None:
    """round_size 4, two workers: a round needs two gradients of each, and the SDK waits for θ after
    each commit. The core names as many workers as the round still needs, those that gave it the
    fewest first: their next commits go to it (none can overfill it, so none is dropped), the
    others wait."""
    state = ServerState(
        training("adamw", learning_rate=3e-3, round_size=4), WorkerRegistry(max_workers=8, lease_ttl=3600)
    )
    spec = [ParameterSpec("w", (P,))]
    a, b = (
        state.register(name, spec, encoded(np.ones(P, np.float32)), client_id=name * 8).worker.worker_id
        for name in "ab"
    )
    core, rng = state.core, np.random.default_rng(13)
    takers = []
    for round_start in (0, 4):
        for worker in (a, b, a, b):
            commit = Commit(worker, round_start, PayloadKind.GRADIENT, encoded(gradients(rng, 1)[0]))
            core.commit_record(commit)
            takers.append(core.round_takers())
    assert takers == [{a}, {a, b}, {b}, set()] * 2 and core.version == 8


def test_the_rounds_progress_is_the_steps_taken_and_the_open_rounds_size_and_commits() -> None:
    """What Status and the metrics show (CommitRule.rounds): rounds closed, K as the last commit
    counted it (the registered less the backups; a registration moves it at once), the commits held."""
    state = ServerState(
        training("adamw", learning_rate=3e-3, backup_workers=1), WorkerRegistry(max_workers=8, lease_ttl=3600)
    )
    spec = [ParameterSpec("w", (P,))]
    assert state.rounds() is None  # no θ, no rule yet
    a, b, c = (
        state.register(name, spec, encoded(np.ones(P, np.float32)), client_id=name * 8).worker.worker_id
        for name in "abc"
    )
    core, rng, seen = state.core, np.random.default_rng(17), []
    for worker in (a, b, c, a, b):  # K 2: c's gradient comes after the first round closed, dropped
        base = 0 if worker == c else core.version
        core.commit_record(Commit(worker, base, PayloadKind.GRADIENT, encoded(gradients(rng, 1)[0])))
        seen.append(state.rounds())
    assert [(r.closed, r.size, r.held) for r in seen if r is not None] == [
        (0, 2, 1),
        (1, 2, 0),
        (1, 2, 0),
        (1, 2, 1),
        (2, 2, 0),
    ]
    state.register("d", spec, None, client_id="d" * 8)
    assert state.rounds() == Rounds(closed=2, size=3, held=0)  # K follows the registration
    gem = ServerState(training("gem", learning_rate=0.1), WorkerRegistry(8, 60.0))
    gem.register("g", spec, encoded(np.ones(P, np.float32)))
    assert gem.rounds() is None  # a rule whose every commit moves θ
