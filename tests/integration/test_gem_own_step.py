"""`gemps server --gem-own-step` over gRPC: one worker's steps as DESIGN §1 states them.

The default (`counted`, the paper's reference code) zig-zags; `excluded` (unclamped) is momentum SGD.
"""

from __future__ import annotations

import numpy as np
import pytest

import gemps
from tests.integration.conftest import StartServer
from tests.unit.test_gem_one_worker import MOMENTUM_STEPS, ONE_WORKER_STEPS

COMMITS = 6


def one_worker_steps(start_server: StartServer, **options: object) -> np.ndarray:
    """|theta_k - theta_{k-1}| of one worker committing a gradient of ones (eta 0.05, mu 0.9)."""
    server = start_server(rule="gem", learning_rate=0.05, momentum=0.9, **options)
    with gemps.Client(server.target, name="lone") as client:
        client.register({"w": np.zeros(4, np.float32)})
        thetas = [np.zeros(4)] + [client.commit(np.ones(4, np.float32)).parameters.flat for _ in range(COMMITS)]
    return np.abs(np.diff(np.array(thetas, np.float64)[:, 0]))


@pytest.mark.parametrize(
    "options,expected",
    [
        ({}, ONE_WORKER_STEPS),
        ({"gem_own_step": "counted"}, ONE_WORKER_STEPS),
        ({"gem_own_step": "excluded", "pi_max": 1000.0}, MOMENTUM_STEPS),
    ],
)
def test_one_worker_steps_follow_the_chosen_rule(
    start_server: StartServer, options: dict[str, object], expected: list[float]
) -> None:
    np.testing.assert_allclose(one_worker_steps(start_server, **options), expected[:COMMITS], rtol=1e-4)
