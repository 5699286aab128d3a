"""A new user's first hour with the torch SDK (issue 60, items 2 to 4), against a real server:
nanoGPT's model.py and training loop, and Hugging Face's Trainer the SDK guide's way.

- What a torch optimizer takes and gemps does not (parameter groups, `weight_decay=`, `betas=`,
  a loop's `param_group['lr'] = lr`, TrainingArguments' learning rate) is refused or said, naming
  what gemps does instead; weight decay is applied, by the worker.
- nanoGPT's forward returns `(logits, loss)` and its loop calls `scaler.step(optimizer)`: the
  loss reaches the server all the same.
- Clipping before step() does not bound the step GEM applies (π up to π_max rescales it), as the
  SDK guide says; --pi-max 1 does.
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gemps
from gemps.pytorch import RemoteOptimizer, ServerOwnsLearningRateError, ServerSchedule
from gemps_worker.nanogpt import decay_groups
from tests.helpers import InProcessServer, scrape
from tests.integration.conftest import StartServer

SDK_GUIDE = Path(__file__).resolve().parents[2] / "docs" / "guides" / "sdk.md"
VOCABULARY, BLOCK = 11, 8


class TinyGPT(nn.Module):
    """nanoGPT's interface: forward(idx, targets) returns (logits, loss), loss None without targets."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCABULARY, 16)
        self.ln_f = nn.LayerNorm(16)
        self.lm_head = nn.Linear(16, VOCABULARY, bias=False)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        logits = self.lm_head(self.ln_f(self.wte(idx)))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss


def test_nanogpts_parameter_groups_are_refused_naming_the_model_and_weight_decay(server: InProcessServer) -> None:
    model = TinyGPT()
    with pytest.raises(TypeError) as refused:
        RemoteOptimizer(decay_groups(model, 0.1), server.target)  # type: ignore[arg-type]
    message = str(refused.value)
    assert "takes the model itself" in message and "not parameter groups (with weight_decay)" in message
    assert "RemoteOptimizer(model, address, weight_decay=0.1)" in message and "--learning-rate" in message


def test_a_torch_optimizers_arguments_are_refused_naming_where_gemps_sets_them(server: InProcessServer) -> None:
    model = nn.Linear(4, 2)
    with pytest.raises(TypeError, match=r"betas: the server's update rule owns it \(`gemps server --rule`"):
        RemoteOptimizer(model, server.target, betas=(0.9, 0.95))
    with pytest.raises(TypeError, match=r"eps: .*`gemps server --rule adamw --adam-beta1 0\.9 --adam-beta2"):
        RemoteOptimizer(model, server.target, eps=1e-6)
    with pytest.raises(TypeError, match=r"RemoteOptimizer does not take a torch optimizer's momentum: .*--momentum"):
        RemoteOptimizer(model, server.target, momentum=0.9)
    with pytest.raises(TypeError, match=r"colour: not an option of RemoteOptimizer, RemoteModel or gemps\.Client"):
        RemoteOptimizer(model, server.target, colour="blue")
    with pytest.raises(ValueError, match=r"weight_decay must be a finite number >= 0, not -0\.1"):
        RemoteOptimizer(model, server.target, weight_decay=-0.1)


def test_weight_decay_is_applied_by_the_worker_to_the_gradient_it_commits(start_server: StartServer) -> None:
    """torch.optim.SGD(weight_decay=λ)'s step, with a zero loss: θ ← θ - η·λ·θ."""
    server = start_server(rule="downpour", learning_rate=0.5)
    model = nn.Linear(4, 2)
    with RemoteOptimizer(model, server.target, weight_decay=0.1) as optimizer:
        before = torch.nn.utils.parameters_to_vector(model.parameters()).detach().clone()
        assert optimizer.param_groups[0]["weight_decay"] == 0.1  # what is applied, as Lightning logs it
        optimizer.zero_grad()
        (0 * model(torch.ones(3, 4)).sum()).backward()
        optimizer.step()
        after = torch.nn.utils.parameters_to_vector(model.parameters()).detach()
    torch.testing.assert_close(after, before * (1 - 0.5 * 0.1))


def test_under_adamw_weight_decay_is_the_servers_and_the_workers_is_refused(
    start_server: StartServer, tmp_path: Path
) -> None:
    """The server's adamw applies AdamW's decoupled decay itself (--adam-weight-decay): a worker's
    `weight_decay=` would add L2 decay to its gradients on top, so it is refused naming the flag;
    the group reads, and the Trainer's arguments are held to, the server's decay (76fbd22 read 0
    and told a Trainer user to give RemoteOptimizer the Trainer's 0.01: decay applied twice)."""
    from transformers import TrainingArguments

    from gemps.pytorch.trainer_arguments import unused

    server = start_server(rule="adamw", learning_rate=1e-3, adam_weight_decay=0.02)
    model = nn.Linear(4, 2)
    with pytest.raises(
        ValueError, match=r"weight_decay=0\.1: the server's rule adamw applies AdamW's decoupled"
    ) as refused:
        RemoteOptimizer(model, server.target, weight_decay=0.1)
    assert "0.02 now (`gemps server --adam-weight-decay`)" in str(refused.value)
    with RemoteOptimizer(model, server.target) as optimizer:
        group = optimizer.param_groups[0]
        assert group["weight_decay"] == group.get("weight_decay") == 0.02
        with pytest.raises(ValueError, match=r"cannot be set here .*--adam-weight-decay"):
            group["weight_decay"] = 0.1
        config = optimizer.remote.config
        held = TrainingArguments(output_dir=str(tmp_path), learning_rate=1e-3, weight_decay=0.02, use_cpu=True)
        assert unused(held, config, 0.0) == []
        other = TrainingArguments(output_dir=str(tmp_path), learning_rate=1e-3, weight_decay=0.01, use_cpu=True)
        (said,) = unused(other, config, 0.0)
        assert said.startswith(
            "weight_decay=0.01: the server's rule adamw applies AdamW's decoupled weight decay, 0.02"
        )


def test_a_weight_decay_refused_after_registering_leaves_the_users_own_client(start_server: StartServer) -> None:
    """The refusal above comes once the worker has registered (the server's rule is in its
    reply): a client the user passed is theirs to keep, but not registered as a worker that will
    never commit (it was counted among the server's workers until its lease ran out)."""
    server = start_server(rule="adamw", learning_rate=1e-3)
    with gemps.Client(server.target) as client, gemps.Client(server.target) as observer:
        with pytest.raises(ValueError, match=r"weight_decay=0\.1: the server's rule adamw"):
            RemoteOptimizer(nn.Linear(4, 2), client, weight_decay=0.1)
        assert observer.status().workers == ()
        with RemoteOptimizer(nn.Linear(4, 2), client) as optimizer:  # the client still serves its user
            assert optimizer.param_groups[0]["weight_decay"] == 0.01
            assert len(observer.status().workers) == 1


def test_a_loops_lr_assignment_names_the_warmup_cosine_and_minimum_flags(server: InProcessServer) -> None:
    """nanoGPT's loop: `for param_group in optimizer.param_groups: param_group['lr'] = lr`."""
    with (
        RemoteOptimizer(nn.Linear(4, 2), server.target) as optimizer,
        pytest.raises(ServerOwnsLearningRateError) as refused,
    ):
        for param_group in optimizer.param_groups:
            param_group["lr"] = 6e-4
    message = str(refused.value)
    for flag in ("--lr-warmup-commits W", "--lr-schedule warmup-cosine", "--lr-total-commits T", "--lr-min MIN"):
        assert flag in message, message


def test_nanogpts_tuple_loss_reaches_the_server_through_a_grad_scaler(
    server: InProcessServer, caplog: pytest.LogCaptureFixture
) -> None:
    """nanoGPT's loop: `logits, loss = model(X, Y)`, `scaler.scale(loss).backward()`,
    `scaler.step(optimizer)`: no loss is passed, the forward returned it."""
    model = TinyGPT()
    scaler = torch.amp.GradScaler("cpu")
    steps = 3
    with caplog.at_level(logging.WARNING, "gemps"), RemoteOptimizer(model, server.target) as optimizer:
        for step in range(steps):
            data = torch.randint(0, VOCABULARY, (4, BLOCK + 1), generator=torch.Generator().manual_seed(step))
            _logits, loss = model(data[:, :-1], data[:, 1:])
            assert loss is not None
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
    metrics = scrape(f"http://127.0.0.1:{server.metrics_port}/metrics")
    assert metrics["gemps_training_loss_count"] == steps
    assert "commits no loss" not in caplog.text


def test_a_step_without_a_loss_says_how_to_pass_one_through_a_grad_scaler(
    server: InProcessServer, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gemps.pytorch import batches

    monkeypatch.setattr(batches, "_warned", type(batches._warned)())  # this process may have warned already
    model = nn.Linear(4, 2)
    with caplog.at_level(logging.WARNING, "gemps"), RemoteOptimizer(model, server.target) as optimizer:
        model(torch.ones(2, 4)).sum().backward()
        optimizer.step()
    assert "scaler.step(optimizer, loss=loss)" in caplog.text and "(logits, loss)" in caplog.text


def test_the_trainers_learning_rate_it_ignores_is_said(
    start_server: StartServer, caplog: pytest.LogCaptureFixture
) -> None:
    """`TrainingArguments(learning_rate=5e-5)` given optimizers=(RemoteOptimizer, ServerSchedule):
    the Trainer trains at the server's η, and gemps says so at the first step."""
    from transformers import Trainer, TrainingArguments

    class Regression(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(4, 1)

        def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"loss": F.mse_loss(self.linear(x).squeeze(-1), labels)}

    rows = [{"x": torch.ones(4) * i, "labels": torch.tensor(float(i))} for i in range(8)]
    server = start_server(rule="gem", learning_rate=0.05)
    model = Regression()
    with tempfile.TemporaryDirectory() as out, RemoteOptimizer(model, server.target) as optimizer:
        arguments = TrainingArguments(
            output_dir=out,
            learning_rate=5e-5,
            weight_decay=0.01,
            max_steps=2,
            per_device_train_batch_size=4,
            report_to="none",
            use_cpu=True,
            save_strategy="no",
            disable_tqdm=True,
        )
        trainer = Trainer(
            model=model, args=arguments, train_dataset=rows, optimizers=(optimizer, ServerSchedule(optimizer))
        )
        with caplog.at_level(logging.WARNING, "gemps"):
            trainer.train()
    said = [record.getMessage() for record in caplog.records if "TrainingArguments" in record.getMessage()]
    assert len(said) == 1, caplog.text
    assert "learning_rate=5e-05: the gemps server's is 0.05" in said[0]
    assert "weight_decay=0.01: RemoteOptimizer(model, address, weight_decay=...) applies it" in said[0]
    with gemps.Client(server.target) as observer:
        assert observer.status().version == 2


def largest_step(server: InProcessServer, clip: float) -> float:
    """The largest step (its norm over η) the server applied to a worker's gradients clipped to
    norm `clip` before each step(), over steps of one batch (GEM's momentum builds up: π > 1)."""
    torch.manual_seed(0)
    model = nn.Linear(8, 8)
    inputs = torch.randn(16, 8)
    steps = []
    with RemoteOptimizer(model, server.target) as optimizer:
        for _ in range(6):
            optimizer.zero_grad()
            model(inputs).pow(2).mean().backward()
            assert float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)) > clip  # it clips
            before = torch.nn.utils.parameters_to_vector(model.parameters()).detach().clone()
            optimizer.step()
            after = torch.nn.utils.parameters_to_vector(model.parameters()).detach()
            steps.append(float((after - before).norm()) / server.config.training.learning_rate)
    return max(steps)


def test_clipping_before_step_does_not_bound_gems_step_and_the_guide_says_what_does(
    start_server: StartServer,
) -> None:
    guide = SDK_GUIDE.read_text()
    assert "clip_grad_norm_" in guide and "--pi-max 1" in guide, "the SDK guide's clipping section"
    assert largest_step(start_server(rule="gem", learning_rate=0.01), clip=0.1) > 0.1 * 1.5  # π > 1 grew it
    assert largest_step(start_server(rule="gem", learning_rate=0.01, pi_max=1.0), clip=0.1) <= 0.1 * (1 + 1e-4)
