"""gemps.pytorch.LocalSteps (issue 59, item 1): the user's own AdamW, with its betas, weight decay
and parameter groups as written, takes local steps; every `steps` steps their update is committed
and the server's θ loaded; against a real server."""

from __future__ import annotations

import itertools
import logging
import threading
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

import gemps
from gemps.pytorch import LocalSteps, RemoteOptimizer, batches
from gemps_worker.datasets import load_digits
from gemps_worker.held_out import evaluate
from gemps_worker.nanogpt import decay_groups
from tests.digits_steps import layer_of, linear, train_steps
from tests.helpers import InProcessServer
from tests.integration.conftest import StartServer


def test_the_users_adamw_groups_step_locally_and_their_update_is_committed_every_window(
    start_server: StartServer,
) -> None:
    # downpour applies an update as given: the central θ is exactly θ0 + the window's update
    server = start_server(rule="downpour")
    model = linear()
    weight0, bias0 = layer_of(model).weight.detach().clone(), layer_of(model).bias.detach().clone()
    inner = torch.optim.AdamW(decay_groups(model, 0.5), lr=0.1, betas=(0.9, 0.95))
    with LocalSteps(model, inner, server.target, steps=4, look_ahead=0) as optimizer:
        assert optimizer.param_groups is inner.param_groups  # a scheduler on either moves the same lr
        for step in range(1, 9):
            optimizer.zero_grad()
            (model(torch.zeros(2, 1, 8, 8)) * 0).sum().backward()  # zero gradients: only the decay moves θ
            optimizer.step(loss=1.0)
            assert server.server.state.core.version == step // 4  # a commit after the 4th and the 8th
        central = server.server.state.core.theta_copy()
        shrink = (1 - 0.1 * 0.5) ** 8  # AdamW's decoupled decay, lr x weight_decay a step, 8 steps
        np.testing.assert_allclose(central[:640], (weight0 * shrink).reshape(-1).numpy(), rtol=1e-5)
        np.testing.assert_allclose(central[640:], bias0.numpy(), rtol=1e-6)  # the no-decay group: untouched
        torch.testing.assert_close(layer_of(model).weight.detach().reshape(-1), torch.from_numpy(central[:640].copy()))
        optimizer.zero_grad()
        (model(torch.zeros(2, 1, 8, 8)) * 0).sum().backward()
        optimizer.step()  # one step of an unfinished window: close() commits it
    assert server.server.state.core.version == 3
    assert len(inner.state) == 2 and all(s["step"] == 9 for s in inner.state.values())  # Adam's state carried over


def test_local_adamw_learns_digits_through_gem(start_server: StartServer) -> None:
    server = start_server(rule="gem")
    data = load_digits()
    x, y = torch.from_numpy(data.train_x), torch.from_numpy(data.train_y)
    model = linear()
    inner = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.01)
    with LocalSteps(model, inner, server.target, steps=4, look_ahead=0) as optimizer:
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=200)  # the inner lr is the user's
        train_steps(model, optimizer, x, y, 200, after_step=scheduler.step)
        assert optimizer.last_result is not None and optimizer.last_result.version == 50
    assert evaluate(model, data.test_x, data.test_y)[1] > 0.9


def test_a_state_dict_loaded_into_it_keeps_the_users_groups_and_state(server: InProcessServer) -> None:
    """accelerate loads a state dict into each optimizer it prepares (Hugging Face's Trainer, and
    any resume): the user's AdamW still holds the groups a scheduler moves and the moments."""
    model = linear()
    inner = torch.optim.AdamW(model.parameters(), lr=0.1)
    with LocalSteps(model, inner, server.target, steps=4, look_ahead=0) as optimizer:
        optimizer.zero_grad()
        model(torch.zeros(2, 1, 8, 8)).sum().backward()
        optimizer.step()
        optimizer.load_state_dict(optimizer.state_dict())
        assert optimizer.param_groups is inner.param_groups and optimizer.state is inner.state
        torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5)  # sets lr 0.05 at once
        assert [group["lr"] for group in inner.param_groups] == [0.05]
        assert len(inner.state) == 2 and all(s["step"] == 1 for s in inner.state.values())  # Adam's moments kept


def test_with_look_ahead_a_window_starts_where_theta_is_headed_and_only_its_steps_are_committed(
    start_server: StartServer,
) -> None:
    """Worker A's steps move nothing (zero gradients, plain SGD); another worker commits +1 on every
    parameter twice between A's commits. A's window then starts 2 commits' move past its reply, and
    what A commits is its own steps' update only: θ holds the other's commits and nothing of A's."""
    server = start_server(rule="downpour")
    model, other_model = linear(), linear()
    ones = np.ones(650, dtype=np.float32)
    with (
        gemps.Client(server.target, name="other") as other,
        LocalSteps(model, torch.optim.SGD(model.parameters(), lr=0.1), server.target, steps=1, look_ahead=1.0) as a,
    ):
        theta0 = server.server.state.core.theta_copy()
        other.register({k: v.detach().numpy() for k, v in other_model.named_parameters()})

        def a_step() -> torch.Tensor:
            a.zero_grad()
            (model(torch.zeros(2, 1, 8, 8)) * 0).sum().backward()
            a.step()
            return torch.nn.utils.parameters_to_vector(model.parameters()).detach()

        a_step()  # version 1, no pace yet
        for _ in range(2):  # two rounds: each the other's 2 commits, then A's (staleness 2, reply 3 versions on)
            other.commit(ones, kind="update")
            other.commit(ones, kind="update")
            started = a_step()
        replied = server.server.state.core.theta_copy()
        np.testing.assert_allclose(replied, theta0 + 4, rtol=1e-6)  # the other's 4 commits, none of A's
        # θ moved 2 in 3 versions; A's commits meet 2 others' each: its window starts 4/3 ahead
        np.testing.assert_allclose(started.numpy(), replied + 4 / 3, rtol=1e-5)
        assert a.last_result is not None and (a.last_result.version, a.last_result.staleness) == (7, 2)
        a_step()  # from the look-ahead start: its update is still 0, θ does not jump
        np.testing.assert_allclose(server.server.state.core.theta_copy(), theta0 + 4, rtol=1e-6)


class NewTensorsOfSize(TorchDispatchMode):
    """The torch operations that make a new tensor of `size` values (a fresh storage, not a view or an
    in-place result): at 100M parameters each θ-sized one is 400 MB of pages to fault in."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.size, self.made = size, list[str]()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        held = {t.untyped_storage().data_ptr() for t in tensors}
        for made in pytree.tree_leaves(out):
            fresh = isinstance(made, torch.Tensor) and made.untyped_storage().data_ptr() not in held
            if fresh and made.numel() == self.size:
                self.made.append(str(func))
        return out


def test_a_window_started_ahead_makes_three_theta_sized_tensors_a_commit(start_server: StartServer) -> None:
    """A commit with the look-ahead's arithmetic (another worker moves θ between): θ read before and
    after (two), and the look-ahead's one temporary; the update and the look-ahead are in place."""
    server = start_server(rule="downpour")
    model, other_model = linear(), linear()
    with (
        gemps.Client(server.target, name="other") as other,
        LocalSteps(model, torch.optim.SGD(model.parameters(), lr=0.1), server.target, steps=1, look_ahead=1.0) as a,
    ):
        other.register({k: v.detach().numpy() for k, v in other_model.named_parameters()})
        counted = NewTensorsOfSize(650)
        for round_ in range(3):  # the first reply gives no pace; the later ones start ahead
            other.commit(np.ones(650, dtype=np.float32), kind="update")
            a.zero_grad()
            (model(torch.zeros(2, 1, 8, 8)) * 0).sum().backward()
            if round_ < 2:
                a.step()
                continue
            with counted:
                a.step()
        assert a.last_result is not None and a.last_result.staleness == 1  # the look-ahead's arithmetic ran
        assert len(counted.made) <= 3, counted.made


@pytest.mark.parametrize("look_ahead", [1.0, 0.0])
def test_once_its_vectors_are_kept_a_window_makes_no_theta_sized_tensor_a_commit(
    start_server: StartServer, look_ahead: float
) -> None:
    """The update, the reply read off the model and the look-ahead's start are written into vectors
    the worker keeps (vector_pool.py): after the first commits none is new (3 a commit before, each
    340 MB of fresh pages at 85M parameters). The windows still start where the arithmetic says."""
    server = start_server(rule="downpour")
    model, other_model = linear(), linear()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with (
        gemps.Client(server.target, name="other") as other,
        LocalSteps(model, optimizer, server.target, steps=1, look_ahead=look_ahead) as a,
    ):
        other.register({k: v.detach().numpy() for k, v in other_model.named_parameters()})
        counted = NewTensorsOfSize(650)
        for round_ in range(5):  # the first reply gives no pace; then the vectors come round again
            other.commit(np.ones(650, dtype=np.float32), kind="update")
            a.zero_grad()
            (model(torch.zeros(2, 1, 8, 8)) * 0).sum().backward()  # no step of A's own: θ is the other's
            if round_ < 3:
                a.step()
                continue
            with counted:
                a.step()
            replied = server.server.state.core.theta_copy()
            started = torch.nn.utils.parameters_to_vector(model.parameters()).detach().numpy()
            # θ moved 1 in 2 versions (the other's +1, then A's zero), and A's commit met 1 other's:
            # A starts half a move ahead, or at the reply
            np.testing.assert_allclose(started, replied + 0.5 * look_ahead, rtol=1e-6)
        assert counted.made == []


def test_a_vector_of_a_parameters_own_storage_is_copied_before_it_is_changed(
    start_server: StartServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """LocalSteps changes in place the vector parameters_vector() gives. Were torch's
    parameters_to_vector to hand back a lone parameter's own storage, the window's start would be
    the model itself and the next update zero: every window after the first lost, silently."""
    server = start_server(rule="downpour")  # an update applied as given
    model = torch.nn.Linear(8, 8, bias=False)
    theta0 = model.weight.detach().reshape(-1).clone()
    monkeypatch.setattr(torch.nn.utils, "parameters_to_vector", lambda parameters: next(iter(parameters)).view(-1))
    with LocalSteps(model, torch.optim.SGD(model.parameters(), lr=0.1), server.target, look_ahead=0) as optimizer:
        for _ in range(2):  # two windows of one step: each moves every weight by -0.1
            model.weight.grad = torch.ones_like(model.weight)
            optimizer.step()
        np.testing.assert_allclose(server.server.state.core.theta_copy(), (theta0 - 0.2).numpy(), atol=1e-6)


def test_with_job_betas_the_workers_beta1_follows_the_jobs_commits_per_its_own(start_server: StartServer) -> None:
    """Another worker commits twice between each of A's: the job takes 3 commits per A's, so A's
    AdamW moves toward β1 = 0.9 ** 3 (β2 as set); a checkpoint of A keeps the user's betas."""
    server = start_server(rule="downpour")
    model, other_model = linear(), linear()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95))
    zeros = np.zeros(650, dtype=np.float32)
    with (
        gemps.Client(server.target, name="other") as other,
        LocalSteps(model, inner, server.target, steps=1, look_ahead=1.0, job_betas=True) as a,
    ):
        other.register({k: v.detach().numpy() for k, v in other_model.named_parameters()})
        betas = []
        for _ in range(12):
            other.commit(zeros, kind="update")
            other.commit(zeros, kind="update")
            a.zero_grad()
            model(torch.zeros(2, 1, 8, 8)).sum().backward()
            a.step()
            betas.append(inner.param_groups[0]["betas"])
        assert a.last_result is not None and a.last_result.staleness == 2
        assert betas[0][0] < 0.9 and all(later[0] < earlier[0] for earlier, later in itertools.pairwise(betas))
        assert betas[-1][0] == pytest.approx(0.9**3, abs=0.01) and betas[-1][1] == 0.95
        assert a.state_dict()["param_groups"][0]["betas"] == (0.9, 0.95)
    with pytest.raises(TypeError, match="job_betas must be True or False, not 'yes'"):
        LocalSteps(model, inner, server.target, job_betas="yes")  # type: ignore[arg-type]


def test_an_optimizer_of_other_tensors_or_missing_some_is_refused(server: InProcessServer) -> None:
    model = linear()
    with pytest.raises(ValueError, match="not trained parameters of the model"):
        LocalSteps(model, torch.optim.AdamW([torch.nn.Parameter(torch.zeros(3))]), server.target)
    with pytest.raises(ValueError, match="in none of the optimizer's groups"):
        LocalSteps(model, torch.optim.AdamW([layer_of(model).weight]), server.target)
    with pytest.raises(ValueError, match="steps must be a whole number"):
        LocalSteps(model, torch.optim.AdamW(model.parameters()), server.target, steps=0)
    with pytest.raises(ValueError, match="LocalSteps commits once a window"):
        LocalSteps(model, torch.optim.AdamW(model.parameters()), server.target, overlap=True)
    with pytest.raises(ValueError, match="look_ahead must be a number >= 0"):
        LocalSteps(model, torch.optim.AdamW(model.parameters()), server.target, look_ahead=-1)
    with pytest.raises(TypeError, match="LocalSteps takes a torch optimizer"):
        LocalSteps(model, "adamw", server.target)  # type: ignore[arg-type]
    with gemps.Client(server.target) as observer:
        assert observer.status().active_workers == 0  # a refused optimizer left no worker registered


def test_remote_optimizer_refusing_adam_settings_points_to_local_steps(server: InProcessServer) -> None:
    with pytest.raises(TypeError, match=r"gemps.pytorch.LocalSteps\(model, torch.optim.AdamW"):
        RemoteOptimizer(linear(), server.target, betas=(0.9, 0.95))


def test_the_defaults_are_the_guides_recipe_one_step_a_window_started_ahead(start_server: StartServer) -> None:
    """Issue 78: the defaults were 8 steps and no look-ahead, where the guide recommends 1 and 1
    for several asynchronous AdamW workers: a user who took the defaults ran another recipe."""
    server = start_server(rule="downpour")
    model = linear()
    with LocalSteps(model, torch.optim.AdamW(model.parameters(), lr=1e-3), server.target) as optimizer:
        assert (optimizer.steps, optimizer.look_ahead.share) == (1, 1.0)
        for step in range(1, 4):
            optimizer.zero_grad()
            model(torch.zeros(2, 1, 8, 8)).sum().backward()
            optimizer.step(loss=1.0)
            assert server.server.state.core.version == step  # every local step is its window: committed at once


def test_an_update_commits_result_and_its_staleness_are_the_remote_models_last_result(
    start_server: StartServer,
) -> None:
    """Issue 78: `optimizer.remote.last_result` (what RemoteOptimizer's step sets) said nothing of
    LocalSteps' commits: their staleness was not exposed where a gradient commit's is."""
    server = start_server(rule="downpour")
    model = linear()
    zeros = np.zeros(650, dtype=np.float32)
    with (
        gemps.Client(server.target, name="other") as other,
        LocalSteps(model, torch.optim.AdamW(model.parameters()), server.target, steps=1) as optimizer,
    ):
        other.register({k: v.detach().numpy() for k, v in linear().named_parameters()})
        assert optimizer.remote.last_result is None  # nothing committed yet
        for _ in range(2):
            other.commit(zeros, kind="update")
            other.commit(zeros, kind="update")
            optimizer.zero_grad()
            model(torch.zeros(2, 1, 8, 8)).sum().backward()
            optimizer.step(loss=1.0)
        result = optimizer.remote.last_result
        assert result is not None and (result.version, result.staleness) == (6, 2)  # the other's 2 commits met
        assert optimizer.last_result is result
    remote = RemoteOptimizer(linear(), server.target)
    with remote:
        remote.step()  # a gradient commit's result is there too
        assert remote.remote.last_result is not None and remote.remote.last_result.version == 7
        assert remote.last_result is remote.remote.last_result


def test_the_first_window_committed_without_a_loss_is_said_once(
    start_server: StartServer, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 78: Hugging Face's Trainer calls `step()` without the loss, so every commit carried
    none, silently (only `gemps status` counted them). One WARNING per process says how to pass it."""
    monkeypatch.setattr(batches, "_warned_window", threading.Event())  # this process may have warned already
    server = start_server(rule="downpour")
    caplog.set_level(logging.WARNING, logger="gemps.pytorch")

    def window_of(optimizer: LocalSteps, model: torch.nn.Module, loss: float | None) -> None:
        optimizer.zero_grad()
        model(torch.zeros(2, 1, 8, 8)).sum().backward()
        optimizer.step(loss=loss)

    model = linear()
    with LocalSteps(model, torch.optim.AdamW(model.parameters()), server.target, steps=1) as optimizer:
        window_of(optimizer, model, 1.0)
        assert not [record for record in caplog.records if record.name == "gemps.pytorch"]  # a loss: nothing said
        window_of(optimizer, model, None)
        window_of(optimizer, model, None)
    second = linear()
    with LocalSteps(second, torch.optim.AdamW(second.parameters()), server.target, steps=1) as optimizer:
        window_of(optimizer, second, None)
    said = [record for record in caplog.records if record.name == "gemps.pytorch"]
    assert len(said) == 1 and said[0].levelno == logging.WARNING, [record.getMessage() for record in said]
    message = said[0].getMessage()
    assert "optimizer.step(loss=loss.detach())" in message and "Trainer" in message
    with gemps.Client(server.target) as observer:
        assert observer.status().version == 4  # the windows were committed all the same


class ReturnsItsLoss(torch.nn.Module):
    """A model whose forward returns {"logits", "loss"}, as a Hugging Face model given labels does."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = linear()

    def forward(self, inputs: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.layer(inputs)
        return {"logits": logits, "loss": torch.nn.functional.cross_entropy(logits, labels)}


def test_a_window_without_step_loss_commits_the_loss_its_forwards_returned(
    start_server: StartServer, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 78: under Hugging Face's Trainer `step()` gets no loss, and every commit carried none;
    the model's forward returns it (`output.loss`), so the window's commit carries their mean."""
    monkeypatch.setattr(batches, "_warned_window", threading.Event())
    server = start_server(rule="downpour")
    caplog.set_level(logging.WARNING, logger="gemps.pytorch")
    model = ReturnsItsLoss()
    inputs, labels = torch.zeros(4, 1, 8, 8), torch.tensor([0, 1, 2, 3])
    returned: list[float] = []
    with LocalSteps(model, torch.optim.AdamW(model.parameters()), server.target, steps=2) as optimizer:
        for _ in range(4):
            optimizer.zero_grad()
            loss = model(inputs, labels)["loss"]
            loss.backward()
            returned.append(float(loss.detach()))
            optimizer.step()  # as the Trainer calls it: no loss
        with gemps.Client(server.target) as observer:
            (worker,) = observer.status().workers
    assert worker.recent.commits == 2 and worker.recent.loss_commits == 2, worker.recent
    assert worker.recent.loss == pytest.approx(np.mean(returned), rel=1e-5)
    assert not [record for record in caplog.records if record.name == "gemps.pytorch"]  # nothing to say
