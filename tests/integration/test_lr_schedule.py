"""The server's learning-rate schedule against real servers: announced to workers, reported in Status
and /metrics as commits are applied, continued across a checkpoint restart, and followed by the
local steps of agn workers."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import gemps
from gemps.pytorch import RemoteModel
from gemps_proto.schedules import learning_rate_at
from gemps_proto.schema import TrainingConfig
from gemps_server.checkpoint_files import list_checkpoints, load
from gemps_worker.modes import AgnMode
from tests.helpers import scrape, training
from tests.integration.conftest import StartServer, StartServerProcess

PARAMS = {"w": np.zeros((2, 2), np.float32)}
ONES = np.ones(4, np.float32)
# eta: 0.5 at versions 0 and 1, 0.25 at 2 and 3, 0.125 at 4 and 5, ...
STEP = {"learning_rate": 0.5, "lr_schedule": "step", "lr_step_size": 2, "lr_gamma": 0.5}
QUICK_RETRY = gemps.RetryPolicy(max_attempts=60, initial_backoff=0.05, max_backoff=0.5)


def metric_eta(metrics_port: int) -> float:
    return scrape(f"http://127.0.0.1:{metrics_port}/metrics")["gemps_learning_rate"]


def test_status_and_metrics_follow_the_schedule_as_commits_are_applied(start_server: StartServer) -> None:
    config = training("downpour", lr_warmup_commits=2, **STEP)
    server = start_server(rule="downpour", lr_warmup_commits=2, **STEP)
    with gemps.Client(server.target) as client:
        registration = client.register(PARAMS)
        assert registration.config == config  # the schedule is announced with the training config
        theta = np.zeros(4, np.float32)
        for version in range(7):
            eta = learning_rate_at(config, version)
            status = client.status()
            assert (status.version, status.learning_rate) == (version, eta)
            assert metric_eta(server.metrics_port) == eta
            result = client.commit(ONES)
            theta -= np.float32(eta) * ONES
            np.testing.assert_allclose(result.parameters.flat, theta, rtol=1e-6)
    assert [learning_rate_at(config, v) for v in range(7)] == [0.25, 0.5, 0.25, 0.25, 0.125, 0.125, 0.0625]


def test_the_schedule_continues_from_the_restored_version_after_a_restart(
    tmp_path: Path, start_server_process: StartServerProcess
) -> None:
    options = {"rule": "downpour", "checkpoint_dir": tmp_path, "checkpoint_interval": 0, **STEP}
    config = training("downpour", **STEP)
    server = start_server_process(**options)
    with gemps.Client(server.target, retry=QUICK_RETRY) as client:
        client.register(PARAMS)
        for _ in range(3):
            last = client.commit(ONES)
    assert server.stop() == 0  # SIGTERM: the final checkpoint, at version 3
    (version, path), *_ = reversed(list_checkpoints(tmp_path))
    assert version == 3
    recorded = load(path).config  # the checkpoint records the schedule with the training config
    assert {key: recorded[key] for key in STEP} == STEP

    # Restarted with the same flags: eta where the schedule left off, not from version 0.
    restarted = start_server_process(port=server.port, **options)
    with gemps.Client(restarted.target, retry=QUICK_RETRY) as client:
        status = client.status()
        assert (status.version, status.config, status.learning_rate) == (3, config, 0.25)
        assert metric_eta(restarted.metrics_port) == 0.25
        client.register(PARAMS)
        result = client.commit(ONES)  # applied at version 3: eta(3) = 0.25
        assert result.version == 4
        np.testing.assert_allclose(result.parameters.flat, last.parameters.flat - 0.25, rtol=1e-6)
        assert client.status().learning_rate == 0.125 == metric_eta(restarted.metrics_port)
    assert restarted.stop() == 0

    # Like every training option, the flags set the schedule; the server warns that they differ
    # from the checkpoint's, and the new schedule starts at the restored version.
    changed = {**options, "lr_schedule": "cosine", "lr_total_commits": 8}
    again = start_server_process(port=server.port, **changed)
    assert "training config differs from the checkpoint's" in again.log()
    assert "lr_schedule=" in again.log() and "lr_total_commits=" in again.log()
    cosine = training("downpour", **{**STEP, "lr_schedule": "cosine", "lr_total_commits": 8})
    with gemps.Client(again.target) as client:
        status = client.status()
        assert (status.version, status.config) == (4, cosine)
        assert status.learning_rate == learning_rate_at(cosine, 4) == pytest.approx(0.25)


def replayed_gradient(at: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The mini-batch gradient of a Linear(4, 3) at parameters `at`, flat."""
    check = torch.nn.Linear(4, 3)
    torch.nn.utils.vector_to_parameters(at, check.parameters())
    torch.nn.functional.cross_entropy(check(x), y).backward()
    return torch.cat([p.grad.reshape(-1) for p in check.parameters() if p.grad is not None])


def test_agn_local_steps_use_eta_at_the_version_last_loaded(start_server: StartServer) -> None:
    server = start_server(rule="downpour", **{**STEP, "lr_step_size": 1})  # eta halves every commit
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    with RemoteModel(model, server.target) as remote:
        config: TrainingConfig = remote.registration.config
        mode = AgnMode(remote, learning_rate=config.learning_rate, local_steps=1)
        for version, eta in enumerate((0.5, 0.25, 0.125)):
            assert remote.version == version and mode.local_learning_rate() == eta
            before = remote.parameters_vector()
            gradient = replayed_gradient(before, x, y)
            committed = mode.on_batch(lambda: torch.nn.functional.cross_entropy(model(x), y), 8)
            assert committed is not None
            expected = (before - eta * gradient).numpy()
            np.testing.assert_allclose(committed.result.parameters.flat, expected, rtol=1e-5, atol=1e-6)
