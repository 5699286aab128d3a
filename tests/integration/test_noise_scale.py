"""The gradient noise scale on real servers: its gauges exist and are finite after gradient
commits on every route (data plane through shared memory, over TCP, gRPC), with θ whole and
partitioned, and the SDK's estimate of the whole θ adds up the partitions' (tests/unit/test_noise.py
checks the numbers against a plain reference)."""

from __future__ import annotations

import math
import re
import subprocess
import sys

import numpy as np
import pytest

import gemps
from tests.helpers import scrape, start_partitions
from tests.integration.conftest import StartServer

pytestmark = pytest.mark.usefixtures("plane")

P = 1_001
BATCH = 8
COMMITS = 24
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
    assert before.windows == 0 and math.isnan(before.scale)
    assert noise.windows == COMMITS // 4 and noise.window == 4 and noise.batch_size == BATCH
    assert noise.scale > 0 and noise.useful_workers == pytest.approx(noise.scale / BATCH)
    # Each partition's Status holds its slice's sums; the whole is their sum (true B_noise = 4*BATCH here).
    assert noise.noise_trace == pytest.approx(sum(s.gradient_noise.noise_trace for s in statuses))
    assert noise.scale == pytest.approx(4.0 * BATCH, rel=0.5)
    for server in servers:
        metrics = scrape(f"http://127.0.0.1:{server.metrics_port}/metrics")
        for gauge in GAUGES:
            assert math.isfinite(metrics[gauge]), gauge
        assert metrics["gemps_gradient_noise_batch_size"] == BATCH
    if plane == "grpc":  # `gemps status` (gRPC whatever the route): the whole θ's line
        status = subprocess.run(
            [sys.executable, "-m", "gemps_cli", "status", "--server", servers[0].target],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert status.returncode == 0, status.stderr
        pay = rf"about [0-9.]+ workers of batch {BATCH} pay; 0 registered"  # the client has left
        line = rf"noise scale     ≈ {noise.scale:.3g} samples: {pay}"
        assert re.search(line, status.stdout), status.stdout
