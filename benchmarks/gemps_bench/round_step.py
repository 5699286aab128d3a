"""What the `adamw` rule's round costs beyond its commits: the step, measured on the rule alone.

Under a rule of rounds a bench cell's server CPU per commit is its commits' own cost plus the
round's step shared among the round's commits, so a cell at n clients says nothing of a round of
16 until the two are told apart (`gemps plan`, gemps_bench.capacity). The step is the closing
commit's CPU less a joining commit's: the closing commit adds its gradient inside the step's pass
(rules/adamw_passes.py), so the difference is what the round adds once. Measured in this process
on the rule the server runs (nanoGPT's AdamW settings, rounds of 2), after a round of warm-up.
"""

from __future__ import annotations

import statistics
import time

import numpy as np

from gemps_proto.schema import PayloadKind
from gemps_server.domain.rules.adamw import AdamWRule
from gemps_server.domain.rules.base import StepContext

ROUNDS = 3  # measured, after one of warm-up


def round_step_seconds(num_parameters: int, rounds: int = ROUNDS) -> float:
    """CPU seconds the adamw rule's round step costs beyond a commit that joins a round, at this size."""
    rule = AdamWRule(
        num_parameters, learning_rate=1e-3, adam_beta1=0.9, adam_beta2=0.99, adam_epsilon=1e-8,
        adam_weight_decay=0.1, adam_decay_vectors=1, gradient_clip=0.0, round_size=2, backup_workers=0,
        outer_rate=0.0, outer_momentum=0.0,
    )  # fmt: skip
    theta = np.random.default_rng(0).standard_normal(num_parameters, dtype=np.float32)
    gradient = np.random.default_rng(1).standard_normal(num_parameters, dtype=np.float32) * np.float32(1e-3)
    peak = float(np.abs(gradient).max())  # as the commit's checks measure it
    joining: list[float] = []
    closing: list[float] = []
    version = 0
    for round_ in range(rounds + 1):
        for times in (joining, closing):
            context = StepContext("bench", 0, version, PayloadKind.GRADIENT, payload_peak=peak)
            start = time.thread_time()
            theta, _ = rule.step_scaled(theta, gradient, 1.0, context)
            if round_:
                times.append(time.thread_time() - start)
            version += 1
    return max(0.0, statistics.median(closing) - statistics.median(joining))
