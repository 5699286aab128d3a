"""Torch helper: `loss.backward(); sync.step()` sends the gradients and loads the central variable.

    sync = RemoteModel(model, "127.0.0.1:50051")
    for inputs, targets in loader:
        sync.zero_grad()
        loss = F.cross_entropy(model(inputs), targets)
        loss.backward()
        sync.step(loss=loss.item(), num_samples=len(targets))
    sync.close()

Works with any torch.nn.Module: every parameter (in `named_parameters()` order) is part of the
central variable; a parameter without a gradient this step contributes zeros. Buffers such as
batch-norm running statistics stay local to each worker.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from gemps.client import Client
from gemps.records import CentralVariable, CommitResult, Registration


class RemoteModel:
    """Binds a torch model to a gemps server: registers it and keeps it on the central variable."""

    def __init__(self, model: torch.nn.Module, client: Client | str, *, name: str = "", **client_options: Any) -> None:
        """`client_options` go to gemps.Client when `client` is an address (wire_dtype="bfloat16", ...)."""
        self.model = model
        self.client = Client(client, name=name, **client_options) if isinstance(client, str) else client
        self._owns_client = isinstance(client, str)
        self._parameters = [p for _, p in model.named_parameters()]
        if not self._parameters:
            raise ValueError("the model has no parameters to train")
        size = sum(p.numel() for p in self._parameters)
        # Staging buffers between torch (any device) and the wire; reused every step.
        self._grad = torch.zeros(size, dtype=torch.float32)
        self._central = torch.zeros(size, dtype=torch.float32)
        try:
            self.registration: Registration = self.client.register(
                {n: p.detach().cpu().numpy() for n, p in model.named_parameters()}
            )
        except BaseException:
            if self._owns_client:
                self.client.close()
            raise
        assert self.client.central is not None
        self._load(self.client.central)

    @property
    def version(self) -> int:
        assert self.client.central is not None
        return self.client.central.version

    def zero_grad(self) -> None:
        self.model.zero_grad(set_to_none=True)

    def step(self, loss: float | torch.Tensor | None = None, num_samples: int | None = None) -> CommitResult:
        """Commit the model's current gradients; load the central variable the server returns."""
        offset = 0
        for p in self._parameters:
            n = p.numel()
            if p.grad is None:
                self._grad[offset : offset + n].zero_()
            else:
                self._grad[offset : offset + n].copy_(p.grad.detach().reshape(-1))
            offset += n
        loss_value = float(loss.detach()) if isinstance(loss, torch.Tensor) else loss
        result = self.client.commit(self._grad.numpy(), loss=loss_value, num_samples=num_samples)
        self._load(result.parameters)
        return result

    def commit_update(self, update: torch.Tensor, loss: float | None = None, *, load: bool = True) -> CommitResult:
        """Commit a flat update (applied as given, e.g. accumulated local steps).

        With `load` (the default) the model then holds the returned central variable; without,
        the model keeps its own values (elastic averaging keeps a local variable).
        """
        result = self.client.commit(update.detach().cpu().numpy().astype(np.float32), kind="update", loss=loss)
        if load:
            self._load(result.parameters)
        return result

    def parameters_vector(self) -> torch.Tensor:
        """The model's parameters as one flat float32 CPU vector (a copy), in spec order."""
        return torch.nn.utils.parameters_to_vector(self._parameters).detach().to("cpu", torch.float32).clone()

    def pull(self) -> int:
        """Load the newest central variable into the model; returns its version."""
        central = self.client.pull()
        self._load(central)
        return central.version

    def close(self) -> None:
        """Leave the server (and close the connection if this helper opened it)."""
        if self._owns_client:
            self.client.__exit__(None, None, None)
        else:
            self.client.leave()

    def __enter__(self) -> RemoteModel:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _load(self, central: CentralVariable) -> None:
        self._central.numpy()[:] = central.flat
        torch.nn.utils.vector_to_parameters(self._central, self._parameters)
