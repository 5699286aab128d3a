"""A PyTorch Lightning module trained on a gemps server: `configure_optimizers` returns RemoteOptimizer.

    python examples/lightning_gemps.py                      # starts a gemps server here for the run
    python examples/lightning_gemps.py --server HOST:PORT   # joins yours: run several, they share θ

A small MLP, built from its config, learns scikit-learn's bundled handwritten digits (no download),
on the shard of them the server assigns this worker. Lightning calls `optimizer.step(closure)`: the
closure runs `training_step` and the backward pass, and RemoteOptimizer commits the gradient with
the closure's loss (the server's loss metrics get it) and loads the θ the server returns. Lightning's
LearningRateMonitor logs the server's η, momentum and weight decay (the optimizer's group reads
them from the server, which owns them: the module configures no LR scheduler). Each step prints
its loss, η and the central version; the start and the end print the central variable's loss on
held-out digits.

Needs `pip install "gemps[examples]"` (torch, scikit-learn, lightning).
"""

from __future__ import annotations

import argparse
import itertools
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import LearningRateMonitor
from lightning.pytorch.loggers import CSVLogger
from local_server import server_address
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from gemps.pytorch import RemoteOptimizer


@dataclass
class MLPConfig:
    """The model, as its config says: 64 pixels in, `hidden` units per hidden layer, 10 digits out."""

    hidden: int = 32
    layers: int = 1
    inputs: int = 64
    classes: int = 10


class DigitsClassifier(L.LightningModule):
    """An MLP on digits whose optimizer is the gemps server's: it trains the central variable."""

    def __init__(self, config: MLPConfig, server: str, batch_size: int = 64) -> None:
        super().__init__()
        self.save_hyperparameters({"config": asdict(config), "batch_size": batch_size})
        widths = [config.inputs] + [config.hidden] * config.layers
        hidden = [layer for a, b in itertools.pairwise(widths) for layer in (nn.Linear(a, b), nn.ReLU())]
        self.net = nn.Sequential(*hidden, nn.Linear(widths[-1], config.classes))
        self.server = server
        self.batch_size = batch_size
        self.remote: RemoteOptimizer | None = None

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        output: torch.Tensor = self.net(inputs)
        return output

    def training_step(self, batch: list[torch.Tensor], batch_index: int) -> torch.Tensor:
        inputs, targets = batch
        loss = F.cross_entropy(self(inputs), targets)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> RemoteOptimizer:
        # Registers this module's parameters with the server and loads its θ: every worker starts there.
        self.remote = RemoteOptimizer(self, self.server, name="lightning")
        return self.remote

    def train_dataloader(self) -> DataLoader[tuple[torch.Tensor, ...]]:
        # Lightning asks for the data after configure_optimizers: the server's shard is known.
        assert self.remote is not None
        # Its shard of a `--num-shards` server; with none (count 0), all of them in an order of its own.
        index, count = self.remote.remote.registration.shard
        inputs, targets = digits("train")
        if count:
            inputs, targets = inputs[index::count], targets[index::count]
        order = torch.Generator().manual_seed(index)
        return DataLoader(TensorDataset(inputs, targets), batch_size=self.batch_size, shuffle=True, generator=order)


class Progress(L.Callback):
    """One line per optimizer step (its loss, the server's η, the central version the model holds),
    and the held-out loss of the central variable when training starts and ends."""

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        print_held_out(module)

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, outputs: Any, *_: Any) -> None:
        assert isinstance(module, DigitsClassifier) and module.remote is not None
        loss = float(outputs["loss"])
        print(
            f"step {trainer.global_step}: loss {loss:.4f}, η {module.remote.param_groups[0]['lr']:g}, "
            f"version {module.remote.version}",
            flush=True,
        )

    def on_train_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        print_held_out(module)


def digits(split: str) -> tuple[torch.Tensor, torch.Tensor]:
    """scikit-learn's 1,797 digits as float pixels in [0, 1] and labels; the last 297 held out."""
    data = load_digits()
    inputs = torch.tensor(data.data / 16.0, dtype=torch.float32)
    targets = torch.tensor(data.target, dtype=torch.long)
    part = slice(None, 1500) if split == "train" else slice(1500, None)
    return inputs[part], targets[part]


@torch.no_grad()
def print_held_out(module: L.LightningModule) -> None:
    assert isinstance(module, DigitsClassifier) and module.remote is not None
    inputs, targets = digits("test")
    loss = float(F.cross_entropy(module(inputs), targets))
    print(f"held-out loss {loss:.4f} at version {module.remote.version}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server", help="a gemps server's HOST:PORT (default: start one here)")
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps, each one commit")
    parser.add_argument("--hidden", type=int, default=32, help="hidden units (the model's config)")
    parser.add_argument("--out", type=Path, help="Lightning's logs and checkpoint (default: a temporary folder)")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    module = DigitsClassifier(MLPConfig(hidden=args.hidden), server="")
    with (
        server_address(args.server, rule="gem", learning_rate=0.5) as address,
        tempfile.TemporaryDirectory() as scratch,
    ):
        module.server = address
        out = args.out or Path(scratch)
        trainer = L.Trainer(
            max_steps=args.steps,
            accelerator="cpu",
            devices=1,
            logger=CSVLogger(out),
            callbacks=[
                LearningRateMonitor(logging_interval="step", log_momentum=True, log_weight_decay=True),
                Progress(),
            ],
            log_every_n_steps=1,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=out,
        )
        try:
            trainer.fit(module)
        finally:
            if module.remote is not None:
                module.remote.close()  # leave the server cleanly
    return 0


if __name__ == "__main__":
    sys.exit(main())
