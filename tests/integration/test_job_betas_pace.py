"""LocalSteps(job_betas=True) against a real server where its pace was lost (issue 77, item 4): a
torch scheduler that writes betas every step (OneCycleLR's cycle_momentum), and a server restarted
from an older checkpoint, after which one commit's staleness counted the commits of another history."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import gemps
from gemps.pytorch import LocalSteps
from tests.digits_steps import linear
from tests.helpers import InProcessServer, free_port

ZEROS = np.zeros(650, dtype=np.float32)  # an update of the digits Linear that moves nothing


def local_step(model: torch.nn.Module, optimizer: LocalSteps) -> None:
    optimizer.zero_grad()
    model(torch.zeros(2, 1, 8, 8)).sum().backward()
    optimizer.step()


def test_the_beta1_a_scheduler_writes_each_step_is_raised_to_the_jobs_pace(start_server: Any) -> None:
    """OneCycleLR(cycle_momentum=True) writes β1 after each step; job_betas raised β1 only after a
    commit, so the scheduler's write always came between the two and AdamW stepped at the
    scheduler's β1 as though job_betas were off. Each inner step now raises the β1 written last."""
    server = start_server(rule="downpour")
    model = linear()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95))
    stepped_at: list[tuple[float, float]] = []  # the betas AdamW takes each step with
    inner.register_step_pre_hook(lambda optimizer, *_: stepped_at.append(optimizer.param_groups[0]["betas"]))
    written: list[tuple[float, float]] = []  # the betas the scheduler wrote after each step
    with (
        gemps.Client(server.target, name="other") as other,
        LocalSteps(model, inner, server.target, steps=1, look_ahead=0, job_betas=True) as optimizer,
    ):
        other.register({name: p.detach().numpy() for name, p in linear().named_parameters()})
        scheduler = torch.optim.lr_scheduler.OneCycleLR(
            optimizer, max_lr=1e-3, total_steps=40, cycle_momentum=True, base_momentum=0.8, max_momentum=0.95
        )
        for _ in range(30):
            other.commit(ZEROS, kind="update")  # one of the other's commits per this worker's: 2 a commit
            local_step(model, optimizer)
            scheduler.step()
            written.append(inner.param_groups[0]["betas"])
        assert optimizer.last_result is not None and optimizer.last_result.staleness == 1
        assert optimizer.job_betas.per_own_commit == pytest.approx(2, abs=0.01)
        assert len({beta1 for beta1, _ in written}) > 20  # the scheduler moved β1 at every step
        for wrote, took in zip(written[-11:-1], stepped_at[-10:], strict=True):  # each written before a step
            assert took[0] == pytest.approx(wrote[0] ** 2, abs=0.01) and took[1] == 0.95
        assert optimizer.state_dict()["param_groups"][0]["betas"] == written[-1]  # a checkpoint keeps the user's


def test_a_restart_from_an_older_checkpoint_leaves_the_pace_and_staleness_as_they_were(tmp_path: Path) -> None:
    """The tester's β1 0.066 where 0.81 was expected: the worker, forgotten by a server restarted
    from an older checkpoint, registered again once that server's new history had passed the
    version its window started from in the old one, and its commit kept that old base version: it
    met 96 commits of another history, and β1 = 0.9 ** (2 + 0.25 * (96 + 1 - 2)) = 0.066."""
    port, current, older = free_port(), tmp_path / "current", tmp_path / "older"

    def serve(checkpoints: Path) -> InProcessServer:
        return InProcessServer(rule="downpour", port=port, checkpoint_dir=checkpoints).start()

    server = serve(current)
    model = linear()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95))
    retry = gemps.RetryPolicy(max_attempts=60, initial_backoff=0.05, max_backoff=0.5)
    with (
        gemps.Client(server.target, name="other", retry=retry) as other,
        LocalSteps(model, inner, server.target, steps=1, look_ahead=0, job_betas=True, retry=retry) as optimizer,
    ):
        other.register({name: p.detach().numpy() for name, p in linear().named_parameters()})

        def rounds(count: int) -> None:
            for _ in range(count):
                other.commit(ZEROS, kind="update")
                local_step(model, optimizer)

        rounds(5)
        server.stop()  # its final checkpoint, version 10: the older one
        shutil.copytree(current, older)
        server = serve(current)
        rounds(50)  # version 110 in this history; the job's pace settles at 2 commits per this worker's
        assert optimizer.last_result is not None and optimizer.last_result.version == 110
        assert inner.param_groups[0]["betas"][0] == pytest.approx(0.81, abs=0.005)
        server.stop()
        server = serve(older)  # back to version 10, in a new history
        for _ in range(196):  # the other worker, back first, takes it past 110: to 206
            other.commit(ZEROS, kind="update")
        local_step(model, optimizer)  # this worker registers again at 206 and commits
        assert optimizer.last_result is not None and optimizer.last_result.version == 207
        assert optimizer.last_result.staleness == 0  # as registered: not 206 - 110, of two histories
        assert inner.param_groups[0]["betas"][0] > 0.8  # 0.9 ** 1.75 = 0.83; it was 0.066
    server.stop()
