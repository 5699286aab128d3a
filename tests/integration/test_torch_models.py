"""Users' own torch models through RemoteOptimizer against a real server: every floating dtype,
sparse gradients, tied weights (registered, exported and loaded strictly), and what a step
without arguments reports."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from gemps_cli.partitions import child_config
from safetensors.torch import load_file
from torch import nn

import gemps
from gemps.errors import InvalidArgumentError
from gemps.pytorch import RemoteOptimizer
from gemps.pytorch import batches as torch_batches
from gemps_server.checkpoint_files import list_checkpoints
from tests.helpers import InProcessServer, gemps_export, replication_secret_file, scrape, server_config, wait_for
from tests.integration.conftest import StartServer


def regression(dtype: torch.dtype) -> tuple[nn.Sequential, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 1)).to(dtype)
    inputs = torch.randn(64, 8, dtype=dtype)
    return model, inputs, inputs.sum(dim=1, keepdim=True) / 4


def train(optimizer: RemoteOptimizer, batch_loss: Callable[[], torch.Tensor], steps: int) -> list[float]:
    """`steps` steps of `batch_loss`'s gradient, each committed with its loss; the losses."""
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = batch_loss()
        loss.backward()
        optimizer.step(loss=loss)
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_a_model_in_any_floating_dtype_trains_and_keeps_its_dtype(
    start_server: StartServer, dtype: torch.dtype
) -> None:
    server = start_server(rule="downpour", learning_rate=0.05)
    model, inputs, targets = regression(dtype)
    with RemoteOptimizer(model, server.target) as optimizer:
        losses = train(optimizer, lambda: F.mse_loss(model(inputs), targets), steps=30)
        assert optimizer.version == 30
    assert losses[-1] < 0.5 * losses[0]
    assert {p.dtype for p in model.parameters()} == {dtype}
    buffers = dict(model.named_buffers())  # buffers too: floating ones in the model's dtype
    assert buffers["1.running_mean"].dtype == dtype and int(buffers["1.num_batches_tracked"]) == 30


class Bag(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 8, sparse=True)
        self.out = nn.Linear(8, 2)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.out(self.emb(tokens).mean(dim=1))
        return logits


def test_a_sparse_embedding_trains(start_server: StartServer) -> None:
    server = start_server(rule="downpour", learning_rate=0.5)
    torch.manual_seed(0)
    model = Bag()
    tokens = torch.randint(0, 50, (32, 5))
    labels = (tokens[:, 0] % 2).long()
    untouched = sorted(set(range(50)) - set(tokens.flatten().tolist()))
    rows_before = model.emb.weight.detach()[untouched].clone()
    with RemoteOptimizer(model, server.target) as optimizer:
        losses = train(optimizer, lambda: F.cross_entropy(model(tokens), labels), steps=40)
        assert model.emb.weight.grad is not None and model.emb.weight.grad.is_sparse
    assert losses[-1] < 0.7 * losses[0]
    torch.testing.assert_close(model.emb.weight.detach()[untouched], rows_before)  # no batch touched them


def test_what_cannot_travel_is_refused_at_the_users_line(server: InProcessServer) -> None:
    model = nn.Linear(2, 2)
    model.weight = nn.Parameter(torch.zeros(2, 2, dtype=torch.complex64))
    with pytest.raises(InvalidArgumentError, match=r"parameter 'weight' \(torch.complex64\) is complex.*view_as_real"):
        RemoteOptimizer(model, server.target)


class TiedLM(nn.Module):
    """A language model whose output head is its token embedding (`head.weight = emb.weight`)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, 6)
        self.mix = nn.Linear(6, 6)
        self.norm = nn.LayerNorm(6)
        self.head = nn.Linear(6, 20, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.head(self.norm(torch.tanh(self.mix(self.emb(tokens)))))
        return logits


def export(*source: str, out: Path) -> dict[str, torch.Tensor]:
    result = gemps_export(*source, out=out)
    assert result.returncode == 0, result.stderr
    return load_file(str(out))


def test_a_tied_model_exports_under_every_name_and_loads_strictly(start_server: StartServer, tmp_path: Path) -> None:
    directory = tmp_path / "ckpt"
    server = start_server(checkpoint_dir=directory, checkpoint_every=1, checkpoint_interval=0)
    torch.manual_seed(0)
    model = TiedLM()
    tokens = torch.randint(0, 20, (4, 7))
    with RemoteOptimizer(model, server.target) as optimizer:
        names = [entry.name for entry in optimizer.remote.client.spec]
        assert names[0] == "emb.weight=head.weight" and len(names) == 5  # once, under both names
        optimizer.zero_grad()
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, 20), tokens[:, 1:].reshape(-1))
        loss.backward()
        optimizer.step(loss=loss)
        assert model.head.weight is model.emb.weight  # still tied after the load
        with gemps.Client(server.target) as observer:
            pulled = observer.pull().state_dict()
        assert set(pulled) == set(model.state_dict())
        wait_for(lambda: 1 in [v for v, _ in list_checkpoints(directory)], what="the checkpoint at 1")
        exports = {
            "checkpoint": export(str(directory), out=tmp_path / "from-checkpoint.safetensors"),
            "server": export("--server", server.target, out=tmp_path / "from-server.safetensors"),
        }
    for source, state in exports.items():
        fresh = TiedLM()
        fresh.load_state_dict(state, strict=True)  # head.weight is there
        torch.testing.assert_close(fresh.head.weight, model.emb.weight.detach(), msg=source)
        torch.testing.assert_close(state["head.weight"], state["emb.weight"], msg=source)
        for name, value in model.state_dict().items():
            torch.testing.assert_close(state[name], value, msg=f"{source}: {name}")


def test_a_step_without_arguments_reports_its_samples_and_says_once_that_no_loss_went(
    server: InProcessServer, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch_batches, "_warned", threading.Event())
    model, inputs, targets = regression(torch.float32)
    with RemoteOptimizer(model, server.target) as optimizer, caplog.at_level(logging.WARNING, "gemps.pytorch"):
        for batch in (inputs[:32], inputs[:20]):
            optimizer.zero_grad()
            F.mse_loss(model(batch), targets[: len(batch)]).backward()
            with torch.no_grad():
                model(inputs)  # an evaluation between: not part of the gradient, not counted
            optimizer.step()
        for half in (inputs[:16], inputs[16:40]):  # gradient accumulation: both halves count
            F.mse_loss(model(half), targets[: len(half)]).backward()
        optimizer.step()
    metrics = scrape(f"http://127.0.0.1:{server.metrics_port}/metrics")
    assert metrics["gemps_training_samples_total"] == 32 + 20 + 40
    warnings = [record.getMessage() for record in caplog.records if "commits no loss" in record.getMessage()]
    assert len(warnings) == 1 and "optimizer.step(loss=loss)" in warnings[0]


class LossReturning(nn.Module):
    """A model whose forward returns its loss, as a Hugging Face model given `labels` does: in a
    mapping (ModelOutput is one) or as an attribute."""

    def __init__(self, as_mapping: bool) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 1)
        self.as_mapping = as_mapping

    def forward(self, inputs: torch.Tensor, labels: torch.Tensor) -> object:
        predictions = self.linear(inputs)
        loss = F.mse_loss(predictions, labels)
        if self.as_mapping:
            return {"loss": loss, "logits": predictions}
        return type("Output", (), {"loss": loss, "logits": predictions})()


@pytest.mark.parametrize("as_mapping", [True, False], ids=["mapping", "attribute"])
def test_a_step_without_a_loss_sends_the_mean_loss_the_models_forwards_returned(
    server: InProcessServer, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch, as_mapping: bool
) -> None:
    """Hugging Face's Trainer calls optimizer.step() with no loss, and its models return theirs:
    b2d2537 sent none (the server's loss metrics stayed empty under the Trainer) and warned."""
    monkeypatch.setattr(torch_batches, "_warned", threading.Event())
    _, inputs, targets = regression(torch.float32)
    model = LossReturning(as_mapping)
    losses = []
    with RemoteOptimizer(model, server.target) as optimizer, caplog.at_level(logging.WARNING, "gemps.pytorch"):
        for halves in (((0, 16), (16, 32)), ((32, 64),)):  # gradient accumulation: the halves' mean
            optimizer.zero_grad()
            returned = []
            for start, stop in halves:
                output = model(inputs[start:stop], labels=targets[start:stop])
                loss = output["loss"] if isinstance(output, dict) else output.loss
                loss.backward()
                returned.append(float(loss.detach()))
            with torch.no_grad():
                model(inputs, labels=targets)  # an evaluation between: not part of the step's loss
            optimizer.step()
            losses.append(sum(returned) / len(returned))
    metrics = scrape(f"http://127.0.0.1:{server.metrics_port}/metrics")
    assert metrics["gemps_training_loss_count"] == 2
    assert metrics["gemps_training_loss_sum"] == pytest.approx(sum(losses), rel=1e-6)
    assert not [record for record in caplog.records if "commits no loss" in record.getMessage()]


def test_export_takes_the_newest_checkpoint_of_a_replicated_directory(tmp_path: Path) -> None:
    """`gemps server --replicas 2 --checkpoint-dir DIR` writes each replica's checkpoints one level
    deeper (gemps_cli.partitions.child_config); here two servers write exactly there."""
    job = server_config(
        replicas=2,
        checkpoint_dir=str(tmp_path),
        etcd="http://127.0.0.1:2379",  # never reached: only the layout is asked of it
        replication_secret_file=replication_secret_file(),
    )
    folders = [Path(child_config(job, 0, replica=replica).checkpoint_dir) for replica in (0, 1)]
    assert [folder.relative_to(tmp_path) for folder in folders] == [
        Path("partition-0/replica-0"),
        Path("partition-0/replica-1"),
    ]
    torch.manual_seed(0)
    model = TiedLM()
    trained = {}
    for folder, steps in zip(folders, (2, 3), strict=True):  # replica-1 holds the newer state
        with InProcessServer(checkpoint_dir=folder, checkpoint_every=1, checkpoint_interval=0) as server:
            with RemoteOptimizer(model, server.target) as optimizer:
                for _ in range(steps):
                    optimizer.zero_grad()
                    model(torch.arange(10).reshape(2, 5)).pow(2).mean().backward()
                    optimizer.step()
            trained[folder.name] = {name: value.clone() for name, value in model.state_dict().items()}
    result = gemps_export(str(tmp_path), out=tmp_path / "out.safetensors")
    assert result.returncode == 0, result.stderr
    assert "took replica-1's" in result.stdout and "replica-0 at version 2, replica-1 at version 3" in result.stdout
    assert "version 3" in result.stdout
    fresh = TiedLM()
    fresh.load_state_dict(load_file(str(tmp_path / "out.safetensors")), strict=True)
    for name, value in fresh.state_dict().items():
        torch.testing.assert_close(value, trained["replica-1"][name])
