"""Issue 37, item 3: a torch LR scheduler on RemoteOptimizer, against a real server.

PyTorch's examples/mnist/main.py, ported as a new user would (the import, the optimizer line and
the data loader changed), raised `KeyError: 'lr'` from inside torch at its unchanged line
`scheduler = StepLR(optimizer, step_size=1, gamma=args.gamma)`. The server owns the schedule:
constructing any torch scheduler now raises a gemps error at that line, naming the `gemps server`
flags that give the same schedule where gemps can express it.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.optim import lr_scheduler
from transformers.optimization import get_scheduler

import gemps
import gemps.pytorch
from gemps.pytorch import RemoteOptimizer, ServerSchedule
from gemps_worker.datasets import load_digits
from tests.helpers import InProcessServer
from tests.integration.conftest import StartServer

MakeScheduler = Callable[[torch.optim.Optimizer], object]


class Net(nn.Module):
    """The MNIST example's network, scaled to 8x8 digits."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, 1)
        self.dropout = nn.Dropout(0.25)
        self.fc1 = nn.Linear(8 * 3 * 3, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = self.fc1(torch.flatten(self.dropout(x), 1))
        return F.log_softmax(x, dim=1)


def test_the_mnist_examples_step_lr_line_reads_a_gemps_error_and_the_rest_trains(
    server: InProcessServer, tmp_path: Path
) -> None:
    torch.manual_seed(1)
    data = load_digits()
    inputs = torch.from_numpy(data.train_x).reshape(-1, 1, 8, 8)
    targets = torch.from_numpy(data.train_y)
    model = Net()
    optimizer = RemoteOptimizer(model, server.target)  # was: optim.Adadelta(model.parameters(), lr=args.lr)
    with pytest.raises(gemps.GempsError) as refused:  # d2dfbb8: KeyError: 'lr' from inside torch
        lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)
    error = refused.value
    assert isinstance(error, gemps.pytorch.ServerOwnsLearningRateError) and isinstance(error, TypeError)
    assert "the gemps server owns the learning rate and its schedule: a torch StepLR cannot drive" in str(error)
    assert "gemps server --learning-rate LR --lr-schedule step --lr-step-size <K> --lr-gamma 0.7" in str(error)
    assert "This server runs: --learning-rate 0.05 --lr-schedule constant." in str(error)
    here = [entry for entry in refused.traceback if entry.path == Path(__file__)]
    assert "lr_scheduler.StepLR(optimizer" in str(here[-1].statement)  # the user's line, then torch's
    # The rest of the example: train() and the saved model, with nothing left over by the refusal.
    model.train()
    for batch in torch.arange(len(targets)).split(64):
        optimizer.zero_grad()
        loss = F.nll_loss(model(inputs[batch]), targets[batch])
        loss.backward()
        optimizer.step()
    assert optimizer.version == len(targets.split(64))
    assert optimizer.state_dict()["param_groups"] == [{"params": [0, 1, 2, 3]}]
    torch.save(model.state_dict(), tmp_path / "mnist_cnn.pt")
    optimizer.close()


@pytest.mark.parametrize(
    ("make", "said"),
    [
        pytest.param(
            lambda o: lr_scheduler.StepLR(o, step_size=30, gamma=0.1),
            "--lr-schedule step --lr-step-size <30*K> --lr-gamma 0.1\n",
            id="StepLR",
        ),
        pytest.param(
            lambda o: lr_scheduler.ExponentialLR(o, gamma=0.95),
            "--lr-schedule step --lr-step-size <K> --lr-gamma 0.95\n",
            id="ExponentialLR",
        ),
        pytest.param(
            lambda o: lr_scheduler.MultiStepLR(o, milestones=[30, 60, 90], gamma=0.1),
            "--lr-schedule step --lr-step-size <30*K> --lr-gamma 0.1\n",
            id="MultiStepLR-every-30",
        ),
        pytest.param(
            lambda o: lr_scheduler.CosineAnnealingLR(o, T_max=50, eta_min=0.001),
            "--lr-schedule cosine --lr-total-commits <50*K> --lr-min 0.001\n",
            id="CosineAnnealingLR",
        ),
        pytest.param(
            lambda o: lr_scheduler.LinearLR(o, start_factor=0.1, total_iters=5),
            "--lr-warmup-commits <5*K>\n",
            id="LinearLR-warm-up",
        ),
        pytest.param(
            lambda o: lr_scheduler.MultiStepLR(o, milestones=[30, 80]),
            "gemps has no schedule like MultiStepLR's (milestones [30, 80]",
            id="MultiStepLR-uneven",
        ),
        pytest.param(
            lambda o: lr_scheduler.LinearLR(o, start_factor=1.0, end_factor=0.1),
            "--lr-schedule warmup-linear --lr-total-commits <5*K> --lr-min <0.1*LR>\n",
            id="LinearLR-decay",
        ),
        pytest.param(
            lambda o: lr_scheduler.LinearLR(o, start_factor=0.5, end_factor=0.1),
            "gemps has no schedule like LinearLR's (a linear ramp from 0.5·lr to 0.1·lr)",
            id="LinearLR-ramp",
        ),
        pytest.param(lambda o: lr_scheduler.ReduceLROnPlateau(o), "no schedule like ReduceLROnPlateau's", id="plateau"),
        pytest.param(
            lambda o: lr_scheduler.OneCycleLR(o, max_lr=0.1, total_steps=100),
            "no schedule like OneCycleLR's",
            id="1cycle",
        ),
    ],
)
def test_each_torch_scheduler_is_refused_with_the_server_flags_of_its_schedule(
    server: InProcessServer, make: MakeScheduler, said: str
) -> None:
    with RemoteOptimizer(nn.Linear(4, 2), server.target) as optimizer:
        with pytest.raises(gemps.pytorch.ServerOwnsLearningRateError) as refused:
            make(optimizer)
        assert said in str(refused.value)
        assert optimizer.param_groups[0].keys() == {"params"}  # nothing left in the group


def test_a_groups_lr_reads_the_servers_eta_and_is_refused_where_it_is_set(start_server: StartServer) -> None:
    """Also without a scheduler: code setting `lr` (a hand-made decay) hears that the server owns it,
    and which schedule it runs; code reading it (a log line, Lightning's LearningRateMonitor, Hugging
    Face Trainer's logs) gets η at the version the model holds (issue 50, item 3: f264f8e raised)."""
    server = start_server(learning_rate=0.1, lr_schedule="step", lr_step_size=2, lr_gamma=0.5)
    model = nn.Linear(4, 2)
    with RemoteOptimizer(model, server.target) as optimizer:
        group = optimizer.param_groups[0]
        runs = "This server runs: --learning-rate 0.1 --lr-schedule step --lr-step-size 2 --lr-gamma 0.5."
        for write in (
            lambda: group.__setitem__("lr", 0.01),
            lambda: group.setdefault("initial_lr", 0.01),
            lambda: group.update(lr=0.01),
        ):
            with pytest.raises(gemps.pytorch.ServerOwnsLearningRateError, match=runs):
                write()
        read = []
        for _ in range(3):
            read.append((group["lr"], group.get("lr")))
            optimizer.zero_grad()
            model(torch.ones(1, 4)).sum().backward()
            optimizer.step()
        read.append((group["lr"], group.get("lr")))
        assert read == [(0.1, 0.1), (0.1, 0.1), (0.05, 0.05), (0.05, 0.05)]
        assert optimizer.learning_rate == optimizer.remote.client.status().learning_rate == 0.1 * 0.5
        assert group.keys() == {"params"}  # nothing stored
        assert optimizer.state_dict()["param_groups"] == [{"params": [0, 1]}]
        # A state dict round trip (torch replaces the groups) keeps them reading η and refusing.
        optimizer.load_state_dict(optimizer.state_dict())
        assert optimizer.param_groups[0]["lr"] == 0.05
        with pytest.raises(gemps.pytorch.ServerOwnsLearningRateError):
            lr_scheduler.StepLR(optimizer, step_size=1)


def test_add_param_group_is_refused_at_the_call(server: InProcessServer) -> None:
    """f264f8e accepted it, and the next step() failed with a message about groups."""
    model = nn.Linear(4, 2)
    with RemoteOptimizer(model, server.target) as optimizer:
        with pytest.raises(ValueError, match=r"RemoteOptimizer trains one parameter group.*add_param_group cannot"):
            optimizer.add_param_group({"params": [nn.Parameter(torch.zeros(3))]})
        assert len(optimizer.param_groups) == 1
        optimizer.zero_grad()
        model(torch.ones(1, 4)).sum().backward()
        optimizer.step()  # still one group: steps as before
        assert optimizer.version == 1


def test_a_closures_loss_is_committed_detached_without_torchs_warning(server: InProcessServer) -> None:
    """f264f8e called float() on the closure's loss, which requires grad: torch warned."""
    model = nn.Linear(4, 1)

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss: torch.Tensor = model(torch.ones(2, 4)).pow(2).mean()
        loss.backward()
        return loss

    with RemoteOptimizer(model, server.target) as optimizer:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            returned = optimizer.step(closure)
        assert isinstance(returned, torch.Tensor) and returned.requires_grad  # as torch's optimizers return it
        assert optimizer.version == 1


def test_hugging_faces_own_schedule_is_refused_naming_server_schedule_which_reads_the_servers_eta(
    start_server: StartServer,
) -> None:
    """Hugging Face's Trainer given `optimizers=(optimizer, None)` builds its own schedule with
    transformers' get_scheduler (TrainingArguments.lr_scheduler_type): b2d2537 refused it saying
    "Remove the scheduler", which a Trainer user cannot, and had no scheduler to give it instead.
    ServerSchedule sets nothing and reads the server's η, as the Trainer's logs take it."""
    server = start_server(learning_rate=0.1, lr_schedule="step", lr_step_size=2, lr_gamma=0.5)
    model = nn.Linear(4, 2)
    with RemoteOptimizer(model, server.target) as optimizer:
        for kind, same in [
            ("linear", "--lr-warmup-commits <3*K> --lr-schedule warmup-linear --lr-total-commits <10*K>\n"),
            ("constant", "--lr-schedule constant\n"),
            ("cosine", "--lr-warmup-commits <3*K> --lr-schedule warmup-cosine --lr-total-commits <10*K>\n"),
            ("polynomial", "gemps has none like this one"),
        ]:
            with pytest.raises(gemps.pytorch.ServerOwnsLearningRateError) as refused:
                get_scheduler(kind, optimizer, num_warmup_steps=3, num_training_steps=10)
            assert "Trainer(..., optimizers=(optimizer, gemps.pytorch.ServerSchedule(optimizer)))" in str(refused.value)
            assert same in str(refused.value), kind
        with pytest.raises(gemps.pytorch.ServerOwnsLearningRateError) as refused:
            get_scheduler("linear", optimizer, num_warmup_steps=0, num_training_steps=10)
        assert "--lr-schedule warmup-linear --lr-total-commits <10*K>\n" in str(refused.value)
        assert "warm-up" not in str(refused.value).split("where K")[1].split(".")[0]  # no warm-up: no caveat on it
        schedule = ServerSchedule(optimizer)
        read = []
        for _ in range(3):
            read.append(schedule.get_last_lr())
            optimizer.zero_grad()
            model(torch.ones(1, 4)).sum().backward()
            optimizer.step()
            schedule.step()
        read.append(schedule.get_last_lr())
        assert read == [[0.1], [0.1], [0.05], [0.05]]
        assert optimizer.param_groups[0].keys() == {"params"}  # nothing set
        assert schedule.state_dict() == {"last_epoch": 3}
        schedule.load_state_dict({"last_epoch": 7})
        assert schedule.last_epoch == 7
        with pytest.raises(TypeError, match=r"ServerSchedule.step\(\) takes no epoch"):
            schedule.step(5)
    with pytest.raises(
        TypeError, match="ServerSchedule reads the learning rate of a gemps RemoteOptimizer's server; SGD"
    ):
        ServerSchedule(torch.optim.SGD(model.parameters(), lr=0.1))


@pytest.mark.parametrize(("rule", "momentum"), [("gem", 0.8), ("momentum", 0.8), ("downpour", 0.0)])
def test_momentum_and_weight_decay_read_as_the_server_applies_them_and_refuse_a_write(
    start_server: StartServer, rule: str, momentum: float
) -> None:
    """Lightning's LearningRateMonitor(log_weight_decay=True) reads `group["weight_decay"]`: b2d2537
    raised KeyError from inside Lightning; with log_momentum=True it read `group.get("momentum", 0)`,
    0 whatever the server's μ. They read what the server applies: its rule's μ, and no weight decay.
    (Downpour takes no μ: the server refuses one given for it.)"""
    server = start_server(rule=rule, **({"momentum": 0.8} if rule != "downpour" else {}))
    with RemoteOptimizer(nn.Linear(4, 2), server.target) as optimizer:
        group = optimizer.param_groups[0]
        assert (group["momentum"], group.get("momentum", 0), group["weight_decay"]) == (momentum, momentum, 0.0)
        with pytest.raises(ValueError, match=r"group 'momentum' reads what the server applies .*--momentum"):
            group["momentum"] = 0.5
        with pytest.raises(ValueError, match="the server applies no weight decay"):
            group.setdefault("weight_decay", 1e-4)
        with pytest.raises(KeyError):
            group["nesterov"]
        assert group.keys() == {"params"}


def test_the_flags_named_for_the_trainers_linear_schedule_give_it_from_the_warmups_end(
    start_server: StartServer,
) -> None:
    """The Trainer's default schedule (transformers' linear, W = 2 and T = 6 of its steps), refused
    on RemoteOptimizer with the flags of the server's `warmup-linear`; a server started with them
    (K = 1: one worker) applies, step by step from the warm-up's end, the rate HF's would have set,
    read back by ServerSchedule and seen in θ's moves."""
    warmup, total, top = 2, 6, 0.1
    model = nn.Linear(1, 1, bias=False)
    reference = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=top)
    hugging_face = get_scheduler("linear", reference, num_warmup_steps=warmup, num_training_steps=total)
    expected = []
    for _ in range(total + 2):
        expected.append(reference.param_groups[0]["lr"])
        reference.step()
        hugging_face.step()
    server = start_server(
        rule="downpour",
        learning_rate=top,
        lr_schedule="warmup-linear",
        lr_warmup_commits=warmup,
        lr_total_commits=total,
    )
    with RemoteOptimizer(model, server.target) as optimizer:
        with pytest.raises(gemps.pytorch.ServerOwnsLearningRateError) as refused:
            get_scheduler("linear", optimizer, num_warmup_steps=warmup, num_training_steps=total)
        named = f"--lr-warmup-commits <{warmup}*K> --lr-schedule warmup-linear --lr-total-commits <{total}*K>"
        assert named in str(refused.value)
        schedule = ServerSchedule(optimizer)
        rates, moves = [], []
        for _ in range(total + 2):
            rates.append(schedule.get_last_lr()[0])
            before = model.weight.item()
            optimizer.zero_grad()
            model(torch.ones(1, 1)).sum().backward()  # the gradient is 1
            optimizer.step()
            schedule.step()
            moves.append(before - model.weight.item())
    assert rates[warmup:] == pytest.approx(expected[warmup:])
    assert rates[:warmup] == pytest.approx([top * (v + 1) / warmup for v in range(warmup)])
    assert moves == pytest.approx(rates, abs=1e-6)
