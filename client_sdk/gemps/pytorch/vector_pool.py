"""θ-sized float32 vectors that a window's commit writes again instead of allocating anew.

A `LocalSteps` commit reads θ off the model twice (the update, then the reply loaded) and computes
the next window's start: at 85M parameters each is a 340 MB vector, past glibc's mmap threshold,
so each new one arrived as fresh pages the kernel faulted in and zeroed, a commit's largest system
CPU (docs/PERFORMANCE.md, "A window's commit at GPT-2 small's size"). The vectors' lives are known
to their owners, who give a vector back once nothing reads it any more; `take` hands it out again.
"""

from __future__ import annotations

import torch

#: vectors kept unused at most: a window's commit has one spare between commits (the update's room)
KEPT = 2


class VectorPool:
    """Float32 CPU vectors given back by their owners, taken again for a vector of the same size."""

    def __init__(self) -> None:
        self._free: list[torch.Tensor] = []

    def take(self, size: int) -> torch.Tensor:
        """A float32 CPU vector of `size` values, its contents left as they were: a kept one, else new."""
        for index, vector in enumerate(self._free):
            if vector.numel() == size:
                return self._free.pop(index)
        return torch.empty(size, dtype=torch.float32)

    def give(self, vector: torch.Tensor) -> None:
        """`vector` is no longer read by its owner: the next `take` of its size may write it. Given
        twice, it is kept once (two owners handed one vector are never both given it)."""
        whole = vector.dtype == torch.float32 and vector.device.type == "cpu" and vector.dim() == 1
        if not whole or vector.untyped_storage().nbytes() != 4 * vector.numel():  # a view: not the pool's
            return
        if any(kept is vector for kept in self._free):
            return
        self._free = [*self._free[-(KEPT - 1) :], vector]

    def __len__(self) -> int:
        return len(self._free)
