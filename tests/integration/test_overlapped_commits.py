"""RemoteModel(..., overlap=True) and `gemps worker --overlap` (issue 59, item 3): one commit in
flight while the next gradient is computed, against a real server. Each step returns the commit
before it; the server counts one more step of staleness; an error of a commit in flight is raised
by the next step, nothing applied twice; close() waits for the last commit."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import gemps
from gemps.pytorch import InFlightCommitError, RemoteModel, RemoteOptimizer
from gemps_worker.datasets import load_digits
from gemps_worker.held_out import evaluate
from gemps_worker.training import StepRecord, WorkerHooks, WorkerOptions, run_worker
from tests.digits_steps import layer_of, linear, train_steps
from tests.helpers import InProcessServer
from tests.integration.conftest import StartServer


def backward(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    return loss


def test_each_step_returns_the_commit_before_it_and_close_waits_for_the_last(server: InProcessServer) -> None:
    data = load_digits()
    x, y = torch.from_numpy(data.train_x[:256]), torch.from_numpy(data.train_y[:256])
    model = linear()
    results = []
    with RemoteModel(model, server.target, overlap=True) as remote:
        for step in range(1, 31):
            returned = remote.step(loss=backward(model, x, y), num_samples=256)
            if step == 1:
                assert returned is None  # nothing was in flight before it
            else:
                assert returned is not None and returned.version == step - 1
                results.append(returned)
        last = remote.flush()
        assert last is not None and last.version == 30 == remote.version
        assert remote.flush() is None  # nothing in flight any more
        local = torch.nn.utils.parameters_to_vector(model.parameters()).detach().numpy()
        np.testing.assert_array_equal(local, last.parameters.flat)  # the model holds the last reply's θ
        remote.step(loss=backward(model, x, y), num_samples=256)  # in flight when the model closes
    assert server.server.state.core.version == 31  # close() waited for it: acknowledged, applied once
    # commit t was computed at θ of version t-2: the server counts the step it waited in flight
    assert results[0].staleness == 0 and {r.staleness for r in results[1:]} == {1}


def test_overlapped_training_learns_as_the_waiting_worker_does(start_server: StartServer) -> None:
    data = load_digits()
    x, y = torch.from_numpy(data.train_x), torch.from_numpy(data.train_y)
    accuracy = {}
    for overlap in (False, True):
        server = start_server(rule="gem", learning_rate=0.1)
        model = linear()
        with RemoteOptimizer(model, server.target, overlap=overlap) as optimizer:
            train_steps(model, optimizer, x, y, 150)
        assert server.server.state.core.version == 150
        accuracy[overlap] = evaluate(model, data.test_x, data.test_y)[1]
    assert accuracy[True] > 0.85 and abs(accuracy[True] - accuracy[False]) < 0.03, accuracy


def test_an_error_of_the_commit_in_flight_is_raised_by_the_next_step(server: InProcessServer) -> None:
    model = linear()
    x, y = torch.randn(8, 64), torch.zeros(8, dtype=torch.long)
    with RemoteModel(model, server.target, overlap=True) as remote:
        remote.step(loss=backward(model, x, y), num_samples=8)
        backward(model, x, y)
        layer_of(model).weight.grad[0, 0] = float("nan")  # type: ignore[index]  # refused by the client, on the commit thread
        remote.step(num_samples=8, loss=1.0)  # returns the first commit's result; the NaN one is in flight
        with pytest.raises(gemps.InvalidArgumentError, match=r"NaN|non-finite|finite"):
            remote.step(loss=backward(model, x, y), num_samples=8)  # sent all the same, after the refusal
        remote.step(loss=backward(model, x, y), num_samples=8)  # the worker goes on
        # the refused commit touched nothing
        assert remote.flush() is not None and server.server.state.core.version == 3


def test_the_step_that_raises_a_refusal_in_flight_still_sends_its_gradients_and_says_so(
    server: InProcessServer,
) -> None:
    """Issue 77 item 3: step 3 raises step 2's refusal after it gathered its own gradients (and
    counted its buffers sent): they are sent all the same, and the error names both steps."""
    model = linear()
    x, y = torch.randn(8, 64), torch.zeros(8, dtype=torch.long)
    with RemoteModel(model, server.target, overlap=True) as remote:
        remote.step(loss=backward(model, x, y), num_samples=8)  # step 1, at version 0
        backward(model, x, y)
        layer_of(model).weight.grad[0, 0] = float("nan")  # type: ignore[index]
        first = remote.step(num_samples=8, loss=1.0)  # step 2, computed at version 0: refused in flight
        assert first is not None and first.version == 1 == remote.version
        with pytest.raises(gemps.InvalidArgumentError) as raised:  # the refusal's class, as before
            remote.step(loss=backward(model, x, y), num_samples=8)  # step 3, computed at version 1
        error = raised.value
        assert error.reason == gemps.Reason.NON_FINITE and "NaN" in str(error)
        assert "step 2's commit (its gradients computed at version 0) failed" in str(error)
        assert "step 3's gradients (computed at version 1) were sent after it all the same" in str(error)
        assert isinstance(error, InFlightCommitError) and (error.step, error.base_version, error.sent_step) == (2, 0, 3)
        assert remote.in_flight  # step 3's commit, not dropped
        third = remote.flush()
        assert third is not None and third.version == 2 == server.server.state.core.version == remote.version
        assert third.staleness == 0  # computed at version 1, applied on it: steps 1 and 3 applied, once each
        backward(model, x, y)
        layer_of(model).weight.grad[0, 0] = float("nan")  # type: ignore[index]
        remote.step(num_samples=8, loss=1.0)  # step 4, refused in flight
        with pytest.raises(InFlightCommitError, match=r"step 4's commit .* failed: .*NaN.*; no later step's gradients"):
            remote.flush()
    assert server.server.state.core.version == 2


def test_the_worker_refuses_overlap_where_its_mode_commits_local_steps() -> None:
    assert any("overlap" in p for p in WorkerOptions(overlap=True, mode="agn").problems())
    assert not WorkerOptions(overlap=True).problems()


def test_the_reference_worker_overlaps_sends_max_steps_and_reports_the_last(server: InProcessServer) -> None:
    records: list[StepRecord] = []
    options = WorkerOptions(server=server.target, overlap=True, max_steps=12, epochs=5, metrics_port=-1)
    summary = run_worker(options, hooks=WorkerHooks(on_step=records.append))
    # --max-steps counts the commit in flight: 12 sent, the last reported once flushed
    assert server.server.state.core.version == summary.steps == len(records) == 12
    assert [r.version for r in records] == list(range(1, 13)) and summary.final_version == 12
    assert records[0].staleness == 0 and all(r.staleness == 1 for r in records[1:])  # one worker, one step late
