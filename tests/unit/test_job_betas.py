"""gemps.pytorch.job_betas: an asynchronous worker's Adam β1 kept to the job's horizon in samples."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from gemps.pytorch.job_betas import JobBetas


def adamw(betas: tuple[float, float] = (0.9, 0.99)) -> torch.optim.AdamW:
    return torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=1e-3, betas=betas)


def test_off_it_leaves_the_users_betas_alone() -> None:
    optimizer = adamw()
    kept = JobBetas(False, optimizer.param_groups)
    kept.after_commit(staleness=3)
    assert optimizer.param_groups[0]["betas"] == (0.9, 0.99)


def test_beta1_spans_the_jobs_commits_per_own_commit_and_beta2_stays() -> None:
    optimizer = adamw()
    kept = JobBetas(True, optimizer.param_groups)
    kept.after_commit(staleness=0)  # alone so far: the user's betas
    assert optimizer.param_groups[0]["betas"] == (0.9, 0.99)
    for _ in range(40):  # 4 workers in turn: each commit meets the 3 others'
        kept.after_commit(staleness=3)
    beta1, beta2 = optimizer.param_groups[0]["betas"]
    assert kept.per_own_commit == pytest.approx(4, abs=1e-3)
    assert beta1 == pytest.approx(0.9**4, abs=1e-3) and beta2 == 0.99
    kept.after_commit(staleness=7)  # one late commit moves the pace a quarter of the way, not all
    assert kept.per_own_commit == pytest.approx(5, abs=1e-3)


def test_a_scheduler_moving_beta1_sets_the_users_value_again() -> None:
    optimizer = adamw()
    kept = JobBetas(True, optimizer.param_groups)
    for _ in range(40):
        kept.after_commit(staleness=1)
    optimizer.param_groups[0]["betas"] = (0.8, 0.99)  # as OneCycleLR's cycle_momentum writes it
    kept.after_commit(staleness=1)
    assert optimizer.param_groups[0]["betas"][0] == pytest.approx(0.8**2, abs=1e-3)


def test_a_checkpoint_keeps_the_users_betas_and_a_reload_does_not_compound_them() -> None:
    optimizer = adamw()
    kept = JobBetas(True, optimizer.param_groups)
    for _ in range(40):
        kept.after_commit(staleness=3)
    saved: dict[str, Any] = kept.users(optimizer.state_dict())
    assert saved["param_groups"][0]["betas"] == (0.9, 0.99)
    assert optimizer.param_groups[0]["betas"][0] == pytest.approx(0.9**4, abs=1e-3)  # in use: untouched
    optimizer.load_state_dict(saved)
    kept.rebind(optimizer.param_groups)
    kept.after_commit(staleness=3)
    assert optimizer.param_groups[0]["betas"][0] == pytest.approx(0.9**4, abs=1e-3)


def test_an_optimizer_without_betas_is_left_as_it_is() -> None:
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1, momentum=0.9)
    kept = JobBetas(True, optimizer.param_groups)
    kept.after_commit(staleness=3)
    assert "betas" not in optimizer.param_groups[0] and optimizer.param_groups[0]["momentum"] == 0.9


def test_the_beta1_a_scheduler_writes_after_a_step_is_raised_before_the_next() -> None:
    optimizer = adamw()
    kept = JobBetas(True, optimizer.param_groups)
    for _ in range(40):
        kept.after_commit(staleness=1)
    for written in (0.85, 0.8):  # OneCycleLR's cycle_momentum, after each step, no commit between
        optimizer.param_groups[0]["betas"] = (written, 0.99)
        kept.before_step()
        assert optimizer.param_groups[0]["betas"][0] == pytest.approx(written**2, abs=1e-3)
    optimizer.param_groups[0]["betas"] = (0.75, 0.99)  # written after the last step: the user's now
    assert kept.users(optimizer.state_dict())["param_groups"][0]["betas"] == (0.75, 0.99)


def test_off_a_checkpoint_keeps_the_betas_a_scheduler_set_last() -> None:
    optimizer = adamw()
    kept = JobBetas(False, optimizer.param_groups)
    optimizer.param_groups[0]["betas"] = (0.8, 0.99)  # a scheduler's
    assert kept.users(optimizer.state_dict())["param_groups"][0]["betas"] == (0.8, 0.99)  # not the first ones
