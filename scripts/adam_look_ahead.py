"""DANA's look-ahead for the AdamW replay's `dana:H` (scripts/adam_staleness.py, which imports it
from beside itself): where each worker's window starts, worked out from the workers' AdamW moments."""

from __future__ import annotations

import math

import torch


class DanaLookAhead:
    """dana:H's window starts (DANA-Zero's θ̂ with each worker's AdamW in place of its momentum SGD).

    DANA's master adds every worker's momentum term -ημv^j, the part of its next update known before
    its gradient is. For AdamW that part is its first moment decayed one step further, and over a
    window of H steps (the gradients to come taken as zero, the second moment as it stands):

        u_j = -Σ_{k=1..H} lr·β1^k·m_j/(1 - β1^(t+k)) / (√v_j/√(1 - β2^(t+k)) + ε)

    (t the worker's steps so far, lr the one its schedule sets next; the weight decay's own small
    move is left out). Worker i's window starts at θ + Σ_{j≠i} u_j(H) + u_i(1): the others' windows
    all land before its commit, in turn, and of its own only the first step's momentum is ahead of
    its gradient (Nesterov's; its later steps it takes itself). H = 1: θ + Σ_j u_j, DANA-Zero's θ̂.
    A worker's u_j changes only when its window ends, so each is kept until then."""

    def __init__(self, theta: torch.Tensor, workers: int, window: int) -> None:
        self.window = window
        self.moves = [torch.zeros_like(theta) for _ in range(workers)]

    def start(
        self, theta: torch.Tensor, rank: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer
    ) -> torch.Tensor:
        """Where worker `rank`'s next window starts, its own window just ended at `optimizer`'s state."""
        self.moves[rank] = momentum_move(model, optimizer, self.window)
        own = self.moves[rank] if self.window == 1 else momentum_move(model, optimizer, 1)
        return theta + torch.stack([*(move for j, move in enumerate(self.moves) if j != rank), own]).sum(dim=0)


def momentum_move(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int) -> torch.Tensor:
    """u: what `optimizer` (Adam or AdamW) moves `model`'s parameters over `steps` steps on its first
    moment alone (DanaLookAhead), as one vector in parameters_to_vector's order."""
    group_of = {p: group for group in optimizer.param_groups for p in group["params"]}
    pieces = []
    for p in model.parameters():
        state, group = optimizer.state.get(p, {}), group_of[p]
        move = torch.zeros_like(p)
        if state:  # no step yet: no moment, no move
            (beta1, beta2), done = group["betas"], int(state["step"])
            first, root = state["exp_avg"], state["exp_avg_sq"].sqrt()
            for k in range(1, steps + 1):
                step_size = group["lr"] * beta1**k / (1 - beta1 ** (done + k))
                move -= step_size * first / (root / math.sqrt(1 - beta2 ** (done + k)) + group["eps"])
        pieces.append(move.flatten())
    return torch.cat(pieces)
