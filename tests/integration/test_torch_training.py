"""Training a torch model through the SDK helper against a real server, on real data."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gemps
from gemps.pytorch import RemoteModel
from gemps_worker.datasets import load_digits
from gemps_worker.evaluation import evaluate
from tests.helpers import InProcessServer
from tests.integration.conftest import StartServer


def test_training_through_the_sdk_lowers_held_out_loss(server: InProcessServer) -> None:
    torch.manual_seed(0)
    data = load_digits()
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
    loss_before, accuracy_before = evaluate(model, data.test_x, data.test_y)
    rng = np.random.default_rng(0)
    x, y = torch.from_numpy(data.train_x), torch.from_numpy(data.train_y)
    with RemoteModel(model, server.target) as remote:
        for _ in range(200):
            batch = torch.from_numpy(rng.choice(len(x), size=64, replace=False))
            remote.zero_grad()
            loss = F.cross_entropy(model(x[batch]), y[batch])
            loss.backward()
            result = remote.step(loss=loss, num_samples=64)
        assert remote.version == result.version == 200
        # After step() the model holds exactly the central variable the server returned.
        local = torch.nn.utils.parameters_to_vector(model.parameters()).detach().numpy()
        np.testing.assert_array_equal(local, result.parameters.flat)
    loss_after, accuracy_after = evaluate(model, data.test_x, data.test_y)
    assert loss_after < 0.3 * loss_before
    assert accuracy_after > 0.85 > accuracy_before


def test_parameters_without_gradients_commit_zeros(start_server: StartServer) -> None:
    server = start_server(rule="downpour")
    first = nn.Linear(3, 2)
    model = nn.Sequential(first, nn.Linear(2, 1))
    first.requires_grad_(False)  # frozen layer: no .grad, must stay where it is
    frozen = first.weight.detach().clone()
    with RemoteModel(model, server.target) as remote:
        out = model(torch.ones(4, 3)).sum()
        out.backward()
        remote.step(loss=out)
    torch.testing.assert_close(first.weight.detach(), frozen)


def test_second_worker_receives_the_central_variable(server: InProcessServer) -> None:
    torch.manual_seed(1)
    first = nn.Linear(4, 2)
    torch.manual_seed(2)
    second = nn.Linear(4, 2)
    assert not torch.equal(first.weight, second.weight)
    with RemoteModel(first, server.target), RemoteModel(second, server.target):
        torch.testing.assert_close(first.weight, second.weight)  # θ came from the first


def test_model_that_does_not_match_is_refused(server: InProcessServer) -> None:
    with RemoteModel(nn.Linear(4, 2), server.target), pytest.raises(gemps.FailedPreconditionError):
        RemoteModel(nn.Linear(4, 3), server.target)
