"""Each worker's AdamW momentum from the round's move, under rounds of windows (LocalSteps).

Under `gemps server --rule adamw --outer-rate r` every worker's window starts at the round's θ,
but each worker's AdamW keeps the first moment m of its own steps alone, so its next window goes on
along its own last one while θ went along the round's mean of them. After each round
`LocalSteps(..., round_momentum=True)` sets m to what, with the worker's own second moment v,
moves θ along the round's move per local step. AdamW's step is -lr·(m̂/(√v̂ + ε) + λ·θ) (m̂, v̂
the bias-corrected moments, λ the decoupled weight decay), so with d the move per step,
m̂ = -(d/lr + λ·θ)·(√v̂ + ε), and m = m̂·(1 - β1^t).
The move is the round's reply less the window's start: no byte more crosses the wire.
Not before a parameter's v has averaged 1/(1 - β2) steps or 100, the fewer (100 at nanoGPT's β2
0.99 and at torch's default 0.999, 20 at 0.95): until then
√v̂ is a few gradients' and the moments set from it cost (8 workers at a constant rate without a
warm-up: 2.371 against 2.297 without; from step 100 on 2.274). So set, it ended lower than each
worker's own momentum in every setting measured, and `LocalSteps` does it wherever it applies
(docs/RESULTS.md, "The round's move as each worker's momentum").
"""

from __future__ import annotations

import torch

#: The optimizers whose moments the formula above reads (Adam only without its L2 decay).
KINDS = (torch.optim.AdamW, torch.optim.Adam)


def problem(optimizer: torch.optim.Optimizer) -> str | None:
    """Why `optimizer`'s first moment cannot be set from the round's move; None when it can."""
    if not isinstance(optimizer, KINDS):
        return f"it sets the first moment of torch.optim.AdamW (or Adam), not of {type(optimizer).__name__}"
    for group in optimizer.param_groups:
        if group.get("amsgrad"):
            return "it reads AdamW's second moment as it is, which amsgrad=True does not step with"
        if not isinstance(optimizer, torch.optim.AdamW) and group.get("weight_decay"):
            return "Adam's weight decay is L2 decay inside its moments: use torch.optim.AdamW's decoupled one"
    return None


#: the gradients a v̂ averages before the moments are set from it: β2 0.99's horizon
ENOUGH_STEPS = 100


def averaged(steps: float, beta2: float) -> bool:
    """Whether a second moment stepped `steps` times has averaged 1/(1 - β2) of them or
    ENOUGH_STEPS: a longer horizon's bias-corrected v̂ weighs its first steps near equally, so by
    step 100 torch's default β2 0.999 holds as many gradients as β2 0.99's v̂ at its 100th."""
    return steps * (1 - beta2) >= 1 or steps >= ENOUGH_STEPS


def set_from_move(
    optimizer: torch.optim.Optimizer,
    parameters: list[torch.nn.Parameter],
    start: torch.Tensor,
    end: torch.Tensor,
    steps: int,
) -> None:
    """Each parameter's m from θ's move `end - start` (flat vectors in `parameters`' order) over
    `steps` local steps, with its own v and its group's lr, β and decay; a parameter whose v has not
    `averaged` enough steps yet (still a few gradients') is left as it is."""
    decoupled = isinstance(optimizer, torch.optim.AdamW)
    offsets, at = {}, 0
    for parameter in parameters:
        offsets[id(parameter)] = at
        at += parameter.numel()
    with torch.no_grad():
        for group in optimizer.param_groups:
            lr, (beta1, beta2), eps = float(group["lr"]), group["betas"], float(group["eps"])
            decay = float(group["weight_decay"]) if decoupled else 0.0
            for parameter in group["params"]:
                state = optimizer.state.get(parameter)
                if not state or "exp_avg" not in state or lr <= 0:
                    continue
                t = float(state["step"])
                if not averaged(t, beta2):
                    continue
                first, size = offsets[id(parameter)], parameter.numel()
                before = start[first : first + size].view_as(parameter).to(parameter.device)
                per_step = (end[first : first + size].view_as(parameter).to(parameter.device) - before) / steps
                root = (state["exp_avg_sq"] / (1 - beta2**t)).sqrt_().add_(eps)
                m_hat = (per_step / lr + decay * before).mul_(root).neg_()
                state["exp_avg"].copy_(m_hat.mul_(1 - beta1**t))
