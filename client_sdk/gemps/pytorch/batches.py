"""What a commit says about its batch when the training loop does not: the samples, read from the
model's inputs, and a warning once when no loss is given.

The SDK guide's loop (docs/guides/sdk.md) calls `optimizer.step()` with no arguments. The server's samples counter
(`gemps_training_samples_total`) and its gradient-noise estimate need each commit's batch size:
a forward pre-hook on the model counts the leading dimension of the first tensor argument of
every forward run with gradients enabled since the last step (several for gradient accumulation;
an evaluation under `torch.no_grad()` is not counted), and the step sends that as `num_samples`
unless the caller gave one. A model whose first argument is not batch-first (an RNN with
`batch_first=False`) needs `num_samples=` given.

The loss is the caller's, except where the model's forward returns it: a Hugging Face model given
`labels` returns an output whose `loss` is the batch's, and Hugging Face's Trainer calls
`optimizer.step()` with no loss; nanoGPT's forward returns `(logits, loss)`, and its loop calls
`scaler.step(optimizer)`, which passes none. A forward hook keeps the mean of the scalar loss of
the training forwards' outputs since the last step (a mapping's "loss", an attribute `loss`, or
the one 0-dimensional floating tensor of a returned tuple: nanoGPT's, or a Hugging Face model's
with return_dict=False), which the step sends when the caller gave none. Otherwise the loss is
not reachable (the optimizer never sees it and gemps does not patch torch), so the first step
without `loss=` logs one WARNING per process naming `optimizer.step(loss=loss)` and
`scaler.step(optimizer, loss=loss)` (the dashboards' loss panel stays empty). An update commit
(LocalSteps' window) carries the losses given to its `step(loss=)`, averaged, else those its
training forwards returned (a Hugging Face model's under the Trainer, which gives `step()` none):
the first committed with neither logs one WARNING per process of its own.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from typing import Any

import torch

log = logging.getLogger("gemps.pytorch")

_warned = threading.Event()  # once per process: every worker's loop would say the same
_warned_window = threading.Event()  # LocalSteps' windows: the same, once per process


class BatchCounter:
    """Counts the samples `model`'s training forwards see between two steps."""

    def __init__(self, model: torch.nn.Module) -> None:
        self._samples = 0
        self.counted = 0  # every sample counted since the model was wrapped (never taken)
        self._losses: torch.Tensor | None = None  # the returned losses' sum since the last take
        self._returned_count = 0
        self._handles = [
            model.register_forward_pre_hook(self._seen, with_kwargs=True),
            model.register_forward_hook(self._returned),
        ]

    def _seen(self, _module: torch.nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> None:
        if not torch.is_grad_enabled():
            return  # evaluation: its samples are not in the gradient
        first = next((value for value in (*args, *kwargs.values()) if isinstance(value, torch.Tensor)), None)
        if first is not None and first.dim() > 0:
            self._samples += int(first.shape[0])
            self.counted += int(first.shape[0])

    def _returned(self, _module: torch.nn.Module, _args: tuple[Any, ...], output: Any) -> None:
        if not torch.is_grad_enabled():
            return
        loss = returned_loss(output)
        if loss is not None:
            loss = loss.detach().reshape(())  # summed on its device: no copy to the host per forward
            self._losses = loss if self._losses is None else self._losses + loss
            self._returned_count += 1

    def take(self) -> int | None:
        """The samples counted since the last take (None when no forward was seen)."""
        samples, self._samples = self._samples, 0
        return samples or None

    def take_loss(self) -> float | None:
        """The mean loss the training forwards returned since the last take (None: none returned one)."""
        losses, count = self._losses, self._returned_count
        self._losses, self._returned_count = None, 0
        return None if losses is None else float(losses) / count

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()


def returned_loss(output: Any) -> torch.Tensor | None:
    """The scalar loss a forward returned, if it did: a mapping's "loss", an attribute `loss`, or
    the only 0-dimensional floating tensor of a tuple or list (nanoGPT's `(logits, loss)`)."""
    if isinstance(output, Mapping):
        loss = output.get("loss")
    elif isinstance(output, tuple | list) and not hasattr(output, "loss"):
        scalars = [v for v in output if isinstance(v, torch.Tensor) and v.dim() == 0 and v.is_floating_point()]
        loss = scalars[0] if len(scalars) == 1 else None  # several: which is the loss cannot be told
    else:
        loss = getattr(output, "loss", None)
    return loss if isinstance(loss, torch.Tensor) and loss.numel() == 1 else None


def _warn_once(said: threading.Event, message: str) -> None:
    """`message` as a WARNING, the first time only in this process (every worker's loop would say it)."""
    if not said.is_set():
        said.set()
        log.warning(message)


def warn_without_loss() -> None:
    """A WARNING, once per process, that commits carry no loss."""
    _warn_once(
        _warned,
        "gemps: this step commits no loss, so the server's loss metrics (gemps_training_loss, the dashboards' "
        "loss panel) stay empty: call optimizer.step(loss=loss) (with a GradScaler: scaler.step(optimizer, "
        "loss=loss); or step(closure) returning it; RemoteModel.step(loss=loss)), or return it from the model's "
        "forward (output.loss, output['loss'], or a scalar tensor in a returned tuple, as nanoGPT's (logits, loss))",
    )


def warn_window_without_loss() -> None:
    """A WARNING, once per process, that an update commit (LocalSteps' window) carries no loss
    (issue 78: under Hugging Face's Trainer every commit carried none, and only `gemps status` said so)."""
    _warn_once(
        _warned_window,
        "gemps: LocalSteps commits a window with no loss, so the server's loss metrics (gemps_training_loss, "
        "the dashboards' loss panel) stay empty and `gemps status` counts commits that carried none: call "
        "optimizer.step(loss=loss.detach()) in your loop (or step(closure) returning it), or return it from "
        "the model's forward (output.loss, output['loss'], or nanoGPT's (logits, loss)), as Hugging Face "
        "models do under the Trainer, which calls step() without it",
    )
