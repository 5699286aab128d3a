"""The gradient noise scale on real servers: its gauges exist and are finite after gradient
commits on every route (data plane through shared memory, over TCP, gRPC), with θ whole and
partitioned, and the SDK's estimate of the whole θ adds up the partitions' (tests/unit/test_noise.py
checks the numbers against a plain reference); LocalSteps' update commits give one too, from the
sums its workers send (tests/unit/test_gradient_sums.py, test_noise_sums.py check those numbers)."""

from __future__ import annotations

import math
import subprocess
import sys

import numpy as np
import pytest
import torch

import gemps
from gemps.pytorch import LocalSteps
from gemps_proto.status import MIN_NOISE_WINDOWS
from gemps_worker.datasets import load_digits
from tests.digits_steps import linear, train_steps
from tests.helpers import scrape, start_partitions
from tests.integration.conftest import StartServer

pytestmark = pytest.mark.usefixtures("plane")

P = 1_001
BATCH = 8
COMMITS = 4 * MIN_NOISE_WINDOWS + 4  # windows of 4: past the minimum before there is an estimate
GAUGES = (
    "gemps_gradient_noise_scale",
    "gemps_useful_workers",
    "gemps_gradient_noise_batch_size",
    "gemps_gradient_square",
    "gemps_gradient_noise_trace",
)


@pytest.mark.parametrize("partitions", [1, 2])
def test_noise_gauges_are_finite_after_gradient_commits(start_server: StartServer, partitions: int, plane: str) -> None:
    servers = start_partitions(start_server, partitions, rule="gem", learning_rate=1e-3, noise_window=4)
    rng = np.random.default_rng(0)
    with gemps.Client(servers[0].target) as client:
        client.register({"w": np.zeros(P, np.float32)})
        before = client.gradient_noise()
        for _ in range(COMMITS):  # a fixed G = 1 plus noise: |G|^2's estimate stays well above 0
            client.commit((1.0 + rng.normal(scale=2.0, size=P)).astype(np.float32), num_samples=BATCH)
        statuses = client.statuses()
        noise = client.gradient_noise(statuses)
        scraped = [scrape(f"http://127.0.0.1:{server.metrics_port}/metrics") for server in servers]  # registered
    assert before.windows == 0 and math.isnan(before.scale)
    assert noise.windows == COMMITS // 4 and noise.window == 4 and noise.batch_size == BATCH
    assert noise.scale > 0 and noise.useful_workers == pytest.approx(noise.scale / BATCH)
    # Each partition's Status holds its slice's sums; the whole is their sum (true B_noise = 4*BATCH here).
    assert noise.noise_trace == pytest.approx(sum(s.gradient_noise.noise_trace for s in statuses))
    assert noise.scale == pytest.approx(4.0 * BATCH, rel=0.5)
    for server, metrics in zip(servers, scraped, strict=True):
        for gauge in GAUGES:
            assert math.isfinite(metrics[gauge]), gauge
        assert metrics["gemps_gradient_noise_batch_size"] == BATCH
        after = scrape(f"http://127.0.0.1:{server.metrics_port}/metrics")  # the client left: no estimate
        assert all(math.isnan(after[gauge]) for gauge in GAUGES)
    if plane == "grpc":  # `gemps status` (gRPC whatever the route): the whole θ's line
        status = subprocess.run(
            [sys.executable, "-m", "gemps_cli", "status", "--server", servers[0].target],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert status.returncode == 0, status.stderr
        # The client has left: no estimate with no worker registered (issue 43), the last one said.
        line = "noise scale     no estimate (no workers registered; the last, while workers committed: ≈ "
        assert f"{line}{noise.scale:.3g} samples)" in status.stdout, status.stdout


@pytest.mark.parametrize("partitions", [1, 2])
def test_local_steps_update_commits_give_the_estimate_from_their_workers_sums(
    start_server: StartServer, partitions: int
) -> None:
    """Issue 78, item 5: an AdamW worker's update commits (LocalSteps' recipe, a window a step)
    carry its gradients' sums over windows of 4 local steps, so the noise scale has an estimate on
    every route; before, update commits were not measured and there was none."""
    servers = start_partitions(start_server, partitions, rule="downpour", learning_rate=1.0)
    data = load_digits()
    x, y = torch.from_numpy(data.train_x), torch.from_numpy(data.train_y)
    model = linear()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with LocalSteps(model, inner, servers[0].target, look_ahead=0, noise_window=4) as optimizer:
        train_steps(model, optimizer, x, y, 4 * MIN_NOISE_WINDOWS + 2)  # batches of 64
        statuses = optimizer.remote.client.statuses()
        noise = optimizer.remote.client.gradient_noise(statuses)
    assert sum(status.commits_applied for status in statuses) == partitions * (4 * MIN_NOISE_WINDOWS + 2)
    assert noise.windows == MIN_NOISE_WINDOWS and noise.window == 4
    assert noise.batch_size == 64 and not noise.batch_size_assumed  # the samples its forwards saw
    assert all(status.gradient_noise.windows == MIN_NOISE_WINDOWS for status in statuses)  # each its slice
    assert noise.gradient_square > 0 and noise.scale > 0 and math.isfinite(noise.useful_workers)


def test_sums_the_server_refuses_change_nothing_and_say_why(start_server: StartServer) -> None:
    server = start_server(rule="downpour")
    with gemps.Client(server.target) as client:
        client.register({"w": np.zeros(4, np.float32)})
        ones = np.ones(4, np.float32)
        with pytest.raises(ValueError, match="2 given for 1 partition"):  # refused before anything is sent
            client.commit(ones, kind="update", gradient_sums=[gemps.GradientSums(1.0, 1.0, 2, 1)] * 2)
        for kind, sums, said in [
            ("gradient", gemps.GradientSums(1.0, 1.0, 2, 1), "measures gradient commits itself"),
            ("update", gemps.GradientSums(1.0, 1.0, 2, 3), r"differences is 3: one to steps \(2\)"),
        ]:
            with pytest.raises(gemps.InvalidArgumentError, match=said) as refused:
                client.commit(ones, kind=kind, gradient_sums=[sums])
            assert refused.value.reason == "bad_gradient_sums"
        assert client.pull().version == 0 and server.server.state.core.noise.estimate.windows == 0
        client.commit(ones, kind="update", gradient_sums=[gemps.GradientSums(10.0, 6.0, 2, 1, 16)])
        noise = client.status().gradient_noise
        assert noise.windows == 1 and noise.batch_size == 8 and noise.gradient_square == pytest.approx(4.0)
