"""A Hugging Face Trainer on a gemps server: the optimizer passed in is RemoteOptimizer.

    python examples/hf_trainer_gemps.py                      # starts a gemps server here for the run
    python examples/hf_trainer_gemps.py --server HOST:PORT   # joins yours: run several, they share θ

A 2-layer GPT-2 with 32-wide states, built from its config (no download, no tokenizer), learns
synthetic sequences of tokens that count up modulo the vocabulary. Its output head is tied to the
token embedding: that tensor travels once, under both names.

`Trainer(..., optimizers=(optimizer, ServerSchedule(optimizer)))`: the server owns the learning
rate and its schedule, so the Trainer's own schedule is left out. Given `(optimizer, None)`, the
Trainer would build one (a LambdaLR, linear decay by default), which RemoteOptimizer refuses with
an error naming ServerSchedule: a scheduler that sets nothing and whose `get_last_lr()`, what the
Trainer logs as `learning_rate`, is the server's η. The Trainer calls `optimizer.step()` with no
loss; the model returns it (`output.loss`, given labels), and RemoteOptimizer sends that.
TrainingArguments' learning rate, weight decay and schedule do not train (the server's do): gemps
warns of each that differs at the first step, so the learning rate given is the server's.
Each logged step prints its loss and η; the start and the end print the central variable's loss on
held-out sequences.

Needs `pip install "gemps[examples]"` (torch, transformers, accelerate).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from typing import Any

import torch
from local_server import server_address
from torch.utils.data import Dataset
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    PrinterCallback,
    Trainer,
    TrainerCallback,
    TrainerControl,
    TrainerState,
    TrainingArguments,
)

from gemps.pytorch import RemoteOptimizer, ServerSchedule

VOCABULARY = 16
LENGTH = 24


class CountingSequences(Dataset[dict[str, torch.Tensor]]):
    """`size` sequences (start, start+1, ...) modulo the vocabulary, from seeded random starts; the
    labels are the inputs (GPT2LMHeadModel shifts them itself)."""

    def __init__(self, size: int, seed: int) -> None:
        starts = torch.randint(0, VOCABULARY, (size, 1), generator=torch.Generator().manual_seed(seed))
        self.sequences = (starts + torch.arange(LENGTH)) % VOCABULARY

    def __len__(self) -> int:
        return len(self.sequences)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.sequences[index], "labels": self.sequences[index]}


def tiny_gpt2() -> GPT2LMHeadModel:
    """A 2-layer, 32-wide GPT-2 with random weights, from its config alone."""
    config = GPT2Config(
        vocab_size=VOCABULARY, n_positions=LENGTH, n_embd=32, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0
    )
    torch.manual_seed(0)
    return GPT2LMHeadModel(config)


class Progress(TrainerCallback):
    """The Trainer's per-step logs (loss, η) in one line each, with the central version, and the
    held-out loss of the central variable when training starts and ends."""

    def __init__(self, optimizer: RemoteOptimizer, held_out: CountingSequences) -> None:
        self.optimizer = optimizer
        self.held_out = held_out

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._print_held_out(kwargs["model"])

    def on_log(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        logs = kwargs.get("logs") or {}
        if "loss" in logs:
            print(
                f"step {state.global_step}: loss {float(logs['loss']):.4f}, η {logs['learning_rate']:g}, "
                f"version {self.optimizer.version}",
                flush=True,
            )

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._print_held_out(kwargs["model"])

    @torch.no_grad()
    def _print_held_out(self, model: GPT2LMHeadModel) -> None:
        was_training = model.training
        model.eval()
        batch = self.held_out.sequences
        loss = float(model(input_ids=batch, labels=batch).loss)
        model.train(was_training)
        print(f"held-out loss {loss:.4f} at version {self.optimizer.version}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server", help="a gemps server's HOST:PORT (default: start one here)")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps, each one commit")
    parser.add_argument("--batch-size", type=int, default=16, help="sequences per step")
    args = parser.parse_args(argv)
    model = tiny_gpt2()
    with server_address(args.server, rule="gem", learning_rate=0.05) as address, tempfile.TemporaryDirectory() as out:
        optimizer = RemoteOptimizer(model, address, name="hf-trainer")  # registers; the model holds θ
        try:
            trainer = Trainer(
                model=model,
                args=TrainingArguments(
                    output_dir=out,
                    # Not what trains (the server's η is): set to it so that the two agree, else gemps warns.
                    learning_rate=optimizer.remote.config.learning_rate,
                    max_steps=args.steps,
                    per_device_train_batch_size=args.batch_size,
                    logging_steps=1,
                    save_strategy="no",
                    report_to="none",
                    use_cpu=True,
                    disable_tqdm=True,
                    seed=optimizer.remote.registration.shard.index,  # each worker its own batch order
                ),
                train_dataset=CountingSequences(4096, seed=1),
                optimizers=(optimizer, ServerSchedule(optimizer)),
                callbacks=[Progress(optimizer, CountingSequences(64, seed=2))],
            )
            trainer.remove_callback(PrinterCallback)  # its raw log dicts: Progress prints them
            trainer.train()
        finally:
            optimizer.close()  # leave the server cleanly
    return 0


if __name__ == "__main__":
    sys.exit(main())
