"""The held-out evaluator (`gemps evaluate`, and the Ray job's evaluator actor) across a server that
restarts from an older checkpoint while it evaluates.

The evaluator pulls θ, evaluates it, then reports the figures. A server that crashed in between
restarts from its newest checkpoint, behind the θ being evaluated, and refuses the report as ahead
of its version. The evaluator took that refusal as fatal: its loop ended, and a Ray job ran on
without figures (seen in test_ray_node_loss: "evaluated version 123 is ahead of the server's
version 94", then "evaluator failed"). Now the refusal says the server's history went back (reason
`bad_version`, as for a commit's base), and the evaluator evaluates θ as the server has it now.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import gemps
from gemps.pytorch import trained_parameters
from gemps_server.checkpoint_files import list_checkpoints
from gemps_worker import evaluation_loop
from gemps_worker.cluster import ServerProcess
from gemps_worker.datasets import load_dataset
from gemps_worker.evaluation_loop import EvaluatorOptions, run_evaluator
from gemps_worker.held_out import evaluate
from gemps_worker.models import build_model
from tests.helpers import free_port, wait_for

CHECKPOINT_EVERY = 5
QUICK_RETRY = gemps.RetryPolicy(max_attempts=200, initial_backoff=0.05, max_backoff=0.2)


def test_a_server_restored_behind_the_theta_being_evaluated_is_evaluated_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    data = load_dataset("digits")
    model = build_model("digits-cnn", data.input_shape, data.num_classes)
    initial = {name: p.detach().numpy().copy() for name, p in trained_parameters(model)}
    size = sum(values.size for values in initial.values())
    options: dict[str, Any] = {
        "rule": "downpour", "checkpoint_dir": tmp_path, "checkpoint_every": CHECKPOINT_EVERY, "checkpoint_interval": 0,
    }  # fmt: skip
    server = ServerProcess(port=free_port(), **options).start()
    restarted: list[ServerProcess] = []
    try:
        with gemps.Client(server.target, retry=QUICK_RETRY) as worker:
            worker.register(initial)
            # A checkpoint at version 5, then two commits more (the next is due at 10): a restart
            # goes back to 5.
            for _ in range(CHECKPOINT_EVERY):
                worker.commit(np.full(size, 1e-3, np.float32))
            wait_for(lambda: list_checkpoints(tmp_path), what="the checkpoint at version 5")
            for _ in range(2):
                ahead = worker.commit(np.full(size, 1e-3, np.float32)).version
        checkpointed = list_checkpoints(tmp_path)[-1][0]
        assert (checkpointed, ahead) == (CHECKPOINT_EVERY, CHECKPOINT_EVERY + 2)

        def crash_while_evaluating(model: torch.nn.Module, x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
            """The server SIGKILLed and started again on its port while the first θ is evaluated."""
            if not restarted:
                server.kill()
                restarted.append(ServerProcess(port=server.port, **options).start())
            return evaluate(model, x, y)

        monkeypatch.setattr(evaluation_loop, "evaluate", crash_while_evaluating)
        seen: list[int] = []
        results = run_evaluator(
            EvaluatorOptions(server=server.target, interval=0.05, max_evaluations=1),
            on_result=lambda result: seen.append(result.version),
            retry=QUICK_RETRY,
        )
        assert restarted, "the evaluator never evaluated"
        # The restarted server holds the checkpoint, behind the θ first evaluated; the evaluator
        # dropped that θ's figures and reported the restored θ's.
        with gemps.Client(restarted[0].target) as reader:
            status = reader.status()
        assert status.version == checkpointed < ahead
        assert [result.version for result in results] == seen == [checkpointed]
        assert status.last_evaluation is not None and status.last_evaluation.version == checkpointed
        assert f"version {ahead} is gone from the server" in caplog.text
    finally:
        for process in (server, *restarted):
            process.close()
