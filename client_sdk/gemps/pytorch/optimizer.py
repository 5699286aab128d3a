"""RemoteOptimizer: a RemoteModel behind torch.optim.Optimizer's interface (gemps.pytorch)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from gemps.client import Client
from gemps.pytorch.refusals import keywords, refuse_not_a_model, refuse_optimizer_options
from gemps.pytorch.remote import RemoteModel
from gemps.pytorch.schedules import ServerOwnedGroup
from gemps.records import CommitResult, TrainingConfig
from gemps_proto.schedules import learning_rate_at


class RemoteOptimizer(torch.optim.Optimizer):
    """A drop-in `torch.optim.Optimizer` that trains `model` on a gemps server: `step()` commits
    the gradients and loads the central variable and buffers the server returns.

    The server owns the learning rate (and its schedule) and the update rule, so the optimizer
    has no hyperparameters of its own: constructing it with `lr=` or with parameter groups, and
    `add_param_group`, are refused rather than silently ignored, and so is setting a group's `lr`.
    A torch LR scheduler reads and sets it: constructing one raises ServerOwnsLearningRateError at
    that line, naming the `gemps server` flags that give its schedule (gemps.pytorch.schedules).
    Reading `param_groups[0]["lr"]` (or `.get("lr")`: what Lightning's LearningRateMonitor logs)
    gives `learning_rate`, the server's η at the version the model holds; `momentum` reads as the
    server applies it, `weight_decay` as the worker does (`weight_decay=`), or the server's rule
    (adamw's --adam-weight-decay): gemps.pytorch.refusals.
    Hugging Face's Trainer takes `optimizers=(optimizer, ServerSchedule(optimizer))`
    (examples/hf_trainer_gemps.py).
    """

    def __init__(self, model: torch.nn.Module, client: Client | str, *, name: str = "", **options: Any) -> None:
        """`options` as RemoteModel takes them: `threads=` for torch's intra-op threads,
        `weight_decay=` (applied by the worker), the others for gemps.Client when `client` is an
        address. A torch optimizer's other arguments (parameter groups, `lr=`, `betas=`, ...) are
        refused naming where gemps sets them (gemps.pytorch.refusals)."""
        refuse_not_a_model(model)
        refuse_optimizer_options(options, keywords(RemoteModel.__init__, Client.__init__))
        self.remote = RemoteModel(model, client, name=name, **options)
        self._bound = False  # torch's __init__ adds the one group through add_param_group
        super().__init__(self.remote.trained, defaults={})
        self._bound = True
        self._guard_groups()

    @property
    def last_result(self) -> CommitResult | None:
        """The last commit's result (`remote.last_result`): with overlap, that of the commit loaded last."""
        return self.remote.last_result

    @property
    def version(self) -> int:
        """Version of the central variable the model now holds."""
        return self.remote.version

    @property
    def learning_rate(self) -> float:
        """η at the version the model holds, from the server's schedule: what a gradient committed
        now is scaled by, unless other workers' commits are applied first."""
        return learning_rate_at(self._config(), self.version)

    def __setstate__(self, state: dict[str, Any]) -> None:
        """torch's load_state_dict sets new groups through here: they refuse `lr` too."""
        super().__setstate__(state)
        self._guard_groups()

    def _guard_groups(self) -> None:
        """The groups, and the defaults (transformers' polynomial schedule reads defaults["lr"] before
        it builds its scheduler: torch's KeyError there, not the refusal that names the flags)."""

        def guarded(group: dict[str, Any]) -> dict[str, Any]:
            return ServerOwnedGroup(group, self._config, lambda: self.learning_rate, self.remote.weight_decay)

        self.param_groups = [guarded(group) for group in self.param_groups]
        self.defaults = guarded(self.defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Refused: the central variable is the model's trained parameters, one group whose update
        the server owns (a group added here would never reach the server)."""
        if self._bound:
            raise ValueError(
                "RemoteOptimizer trains one parameter group, the model's parameters that require grad, and the "
                "gemps server owns its update: add_param_group cannot add another (to train more parameters, "
                "give the model that holds them to RemoteOptimizer; to freeze some, set requires_grad=False)"
            )
        super().add_param_group(param_group)

    def _config(self) -> TrainingConfig:
        return self.remote.config

    def step(  # type: ignore[override]
        self, closure: Callable[[], float | torch.Tensor] | None = None, **commit: Any
    ) -> float | torch.Tensor | None:
        """Commit the current gradients (after `closure()` if given, which recomputes the loss);
        `commit` may carry `loss=` and `num_samples=` for the server's metrics: without them, the
        samples are counted from the model's inputs and a WARNING once says no loss was sent."""
        if len(self.param_groups) != 1 or any(key != "params" for key in self.param_groups[0]):
            raise ValueError("RemoteOptimizer has one parameter group and no per-group settings: the server owns them")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
            commit.setdefault("loss", loss)  # a tensor is detached before float(): torch warns otherwise
        self.remote.step(**commit)
        return loss

    def close(self) -> None:
        """Leave the server (and close the connection if this optimizer opened it)."""
        self.remote.close()

    def __enter__(self) -> RemoteOptimizer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.remote.__exit__(*exc_info)  # on an error, one attempt to leave (Client.__exit__)
