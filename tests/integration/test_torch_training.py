"""Training a torch model through the SDK helper against a real server, on real data."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gemps
import gemps.pytorch
from gemps.pytorch import RemoteModel
from gemps_worker.datasets import load_digits
from gemps_worker.held_out import evaluate
from tests.helpers import InProcessServer
from tests.integration.conftest import StartServer

pytestmark = pytest.mark.usefixtures("plane")  # over shared memory, the data plane over TCP, and gRPC


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
        assert result is not None and remote.version == result.version == 200
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
    unused = nn.Linear(2, 2)  # trains, but gets no gradient this step: commits zeros
    model.add_module("unused", unused)
    before = unused.weight.detach().clone()
    with RemoteModel(model, server.target) as remote:
        out = model[1](model[0](torch.ones(4, 3))).sum()
        out.backward()
        remote.step(loss=out)
        # Frozen parameters are not part of the central variable: nothing of them on the wire.
        assert [entry.name for entry in remote.client.spec] == ["1.weight", "1.bias", "unused.weight", "unused.bias"]
    torch.testing.assert_close(first.weight.detach(), frozen)
    torch.testing.assert_close(unused.weight.detach(), before)


def batch_norm_model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))


def test_one_workers_batch_norm_statistics_are_the_servers(server: InProcessServer) -> None:
    torch.manual_seed(0)
    model = batch_norm_model()
    inputs = torch.randn(32, 4) * 3 + 1
    with RemoteModel(model, server.target) as remote:
        for _ in range(5):
            remote.zero_grad()
            loss = model(inputs).pow(2).mean()
            loss.backward()
            result = remote.step(loss=loss)
        assert result is not None
        # One worker: the server's buffers are exactly what local training gives (deltas add up).
        local = {name: value.numpy().astype(np.float32) for name, value in model.state_dict().items()}
        for name, value in result.parameters.named_buffers().items():
            np.testing.assert_allclose(value, local[name], rtol=1e-6, atol=1e-6)
        assert result.parameters.named_buffers()["1.num_batches_tracked"] == 5
        assert float(model.state_dict()["1.running_mean"].abs().sum()) > 0  # the statistics moved from their defaults
        # The central state dict loads strictly into a fresh model and evaluates as this one.
        fresh = batch_norm_model()
        fresh.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in result.parameters.state_dict().items()})
        model.eval()
        fresh.eval()
        torch.testing.assert_close(fresh(inputs), model(inputs))
        assert int(fresh.state_dict()["1.num_batches_tracked"]) == 5


def test_num_batches_tracked_counts_past_2_to_the_24(server: InProcessServer) -> None:
    """Issue 28: batch norm's counter travels and is kept as int64, so after 2**24 batches it still
    counts (as float32 it stayed at 16,777,216), in the model and on the server."""
    model = batch_norm_model()
    norm = model[1]
    assert isinstance(norm, nn.BatchNorm1d) and norm.num_batches_tracked is not None
    norm.num_batches_tracked.fill_(2**24)
    with RemoteModel(model, server.target) as remote:
        for _ in range(3):
            remote.zero_grad()
            model(torch.randn(8, 4)).pow(2).mean().backward()
            result = remote.step()
        assert result is not None and int(norm.num_batches_tracked) == 2**24 + 3
        assert int(result.parameters.named_buffers()["1.num_batches_tracked"]) == 2**24 + 3
        assert norm.num_batches_tracked.dtype == torch.int64


def test_two_workers_statistics_add_up(server: InProcessServer) -> None:
    torch.manual_seed(0)
    first, second = batch_norm_model(), batch_norm_model()
    with RemoteModel(first, server.target) as one, RemoteModel(second, server.target) as two:
        for remote, model, shift in ((one, first, 5.0), (two, second, -5.0)):
            remote.zero_grad()
            model(torch.randn(16, 4) + shift).sum().backward()
            remote.step()
        central = two.client.pull().named_buffers()
    assert central["1.num_batches_tracked"] == 2  # both workers' batches counted
    # Each worker now holds the central statistics, which reflect both workers' batches.
    np.testing.assert_array_equal(second.state_dict()["1.running_mean"].numpy(), central["1.running_mean"])


def train_digits(model: nn.Module, step: Callable[[torch.Tensor], None], steps: int = 60) -> None:
    data = load_digits()
    x, y = torch.from_numpy(data.train_x), torch.from_numpy(data.train_y)
    rng = np.random.default_rng(0)
    for _ in range(steps):
        batch = torch.from_numpy(rng.choice(len(x), size=32, replace=False))
        step(F.cross_entropy(model(x[batch]), y[batch]))


def digits_model() -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 10))


def test_the_optimizer_facade_trains_exactly_as_remote_model(start_server: StartServer) -> None:
    """The same model, data and seed through RemoteModel and through the drop-in optimizer, each
    against its own fresh server: bit-identical parameters and buffers, hence the same accuracy."""
    data = load_digits()
    wrapped, dropped_in = digits_model(), digits_model()
    # One thread for both: "auto" follows the gemps workers on this machine (other tests' too), and
    # another thread count sums in another order: not bit-identical.
    with RemoteModel(wrapped, start_server().target, threads=1) as remote:

        def remote_step(loss: torch.Tensor) -> None:
            remote.zero_grad()
            loss.backward()
            remote.step(loss=loss)

        train_digits(wrapped, remote_step)
    with gemps.pytorch.RemoteOptimizer(dropped_in, start_server().target, threads=1) as optimizer:

        def optimizer_step(loss: torch.Tensor) -> None:
            optimizer.zero_grad()
            loss.backward()
            optimizer.step(loss=loss.item())

        train_digits(dropped_in, optimizer_step)
        assert optimizer.version == 60
    for (name, a), (_, b) in zip(wrapped.state_dict().items(), dropped_in.state_dict().items(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
    accuracy = evaluate(wrapped, data.test_x, data.test_y)[1]
    assert accuracy == evaluate(dropped_in, data.test_x, data.test_y)[1] and accuracy > 0.8


def _placement(model: nn.Module) -> list[tuple[torch.device, int, torch.dtype]]:
    return [(p.device, p.data_ptr(), p.dtype) for p in model.parameters()]


def test_loads_copy_into_the_parameters_in_place(start_server: StartServer) -> None:
    """Issue 28: θ is copied into each parameter, which keeps its device, storage (data pointer)
    and dtype across registration, steps, pulls and load_central; vector_to_parameters replaced
    their data with views of a CPU float32 vector (a CUDA model's parameters would move to the CPU).
    A float64 layer shows the dtype; the values are the server's, converted."""
    server = start_server(rule="downpour", learning_rate=0.5)
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2).double())
    before = _placement(model)
    with RemoteModel(model, server.target) as remote:
        assert _placement(model) == before
        for _ in range(3):
            remote.zero_grad()
            model[1](model[0](torch.ones(2, 4)).double()).sum().backward()
            result = remote.step()
            assert result is not None and _placement(model) == before
        assert result is not None
        local = torch.cat([p.detach().reshape(-1).float() for p in model.parameters()]).numpy()
        np.testing.assert_array_equal(local, result.parameters.flat)
        remote.pull()
        gemps.pytorch.load_central(model, result.parameters)
        assert _placement(model) == before
    optimizer = gemps.pytorch.RemoteOptimizer(model, server.target)
    with optimizer:
        optimizer.zero_grad()
        model[1](model[0](torch.ones(2, 4)).double()).sum().backward()
        optimizer.step()
        assert _placement(model) == before


def test_the_optimizer_refuses_what_it_cannot_honour(server: InProcessServer) -> None:
    model = nn.Linear(4, 2)
    with pytest.raises(TypeError, match="takes the model itself"):
        gemps.pytorch.RemoteOptimizer(model.parameters(), server.target)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="owns the learning rate"):
        gemps.pytorch.RemoteOptimizer(model, server.target, lr=0.1)
    with gemps.pytorch.RemoteOptimizer(model, server.target) as optimizer:
        with pytest.raises(gemps.pytorch.ServerOwnsLearningRateError):  # at the line (test_torch_schedulers.py)
            optimizer.param_groups[0]["lr"] = 0.01
        with pytest.raises(ValueError, match="'momentum' reads what the server applies"):  # at the line too
            optimizer.param_groups[0]["momentum"] = 0.9
        optimizer.param_groups[0]["nesterov"] = True  # a setting the server has not: refused at the step
        model(torch.ones(1, 4)).sum().backward()
        with pytest.raises(ValueError, match="the server owns them"):
            optimizer.step()


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
