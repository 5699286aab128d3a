"""The gradient noise scale on real servers: its gauges exist and are finite after gradient
commits on every route (data plane through shared memory, over TCP, gRPC), with θ whole and
partitioned, and the SDK's estimate of the whole θ adds up the partitions' (tests/unit/test_noise.py
checks the numbers against a plain reference)."""

from __future__ import annotations

import math
import subprocess
import sys

import numpy as np
import pytest

import gemps
from gemps_proto.status import MIN_NOISE_WINDOWS
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
