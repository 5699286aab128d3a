"""gemps.pytorch.round_momentum: each worker's AdamW first moment set from the round's move,
held to a float64 reference of AdamW's step."""

from __future__ import annotations

import pytest
import torch

from gemps.pytorch.round_momentum import problem, set_from_move

STEPS = 8


def stepped_adamw(steps: int = 100) -> tuple[list[torch.nn.Parameter], torch.optim.AdamW]:
    """Three parameters in two groups (decayed, β2 0.99; not, β2 0.95), in another order than the
    model's, the last never stepped; `steps` AdamW steps on seeded gradients (100: past both groups'
    1/(1 - β2), from which their moments are set)."""
    generator = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(3, 2, generator=generator)) for _ in range(2)]
    idle = torch.nn.Parameter(torch.randn(4, generator=generator))
    params.append(idle)
    groups = [
        {"params": [params[1]], "weight_decay": 0.1},
        {"params": [params[0], idle], "weight_decay": 0.0, "betas": (0.8, 0.95)},
    ]
    optimizer = torch.optim.AdamW(groups, lr=3e-3, betas=(0.9, 0.99))
    for _ in range(steps):
        for p in params[:2]:
            p.grad = torch.randn(p.shape, generator=generator)
        optimizer.step()
    return params, optimizer


def test_the_first_moment_steps_along_the_rounds_move_with_the_workers_own_second() -> None:
    """AdamW's step is -lr·(m̂/(√v̂ + ε) + λ·θ): with m set, that is the round's move per local step."""
    params, optimizer = stepped_adamw()
    start = torch.cat([p.detach().reshape(-1) for p in params])
    move = torch.randn(start.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * 1e-3
    end = (start.double() + move).float()
    idle_before = dict(optimizer.state[params[2]])
    set_from_move(optimizer, params, start, end, STEPS)
    at = 0
    for p in params[:2]:
        group = next(g for g in optimizer.param_groups if any(q is p for q in g["params"]))
        state, size = optimizer.state[p], p.numel()
        (beta1, beta2), t, lr = group["betas"], float(state["step"]), group["lr"]
        m_hat = state["exp_avg"].double() / (1 - beta1**t)
        root = (state["exp_avg_sq"].double() / (1 - beta2**t)).sqrt() + group["eps"]
        theta = start[at : at + size].double().view_as(p)
        step = -lr * (m_hat / root + group["weight_decay"] * theta)
        per_step = (end[at : at + size].double() - start[at : at + size].double()).view_as(p) / STEPS
        torch.testing.assert_close(step, per_step, rtol=1e-5, atol=1e-9)
        at += size
    assert optimizer.state.get(params[2], {}) == idle_before  # never stepped: no moments to set


def test_an_optimizer_whose_moments_it_cannot_read_is_named() -> None:
    param = [torch.nn.Parameter(torch.zeros(2))]
    assert problem(torch.optim.AdamW(param)) is None
    assert problem(torch.optim.Adam(param)) is None
    reasons = {
        "SGD": problem(torch.optim.SGD(param, lr=0.1)),
        "amsgrad": problem(torch.optim.AdamW(param, amsgrad=True)),
        "L2": problem(torch.optim.Adam(param, weight_decay=0.01)),
    }
    assert reasons["SGD"] is not None and "not of SGD" in reasons["SGD"]
    assert reasons["amsgrad"] is not None and "amsgrad=True" in reasons["amsgrad"]
    assert reasons["L2"] is not None and "torch.optim.AdamW's decoupled" in reasons["L2"]


@pytest.mark.parametrize("steps", [1, 3])
def test_no_move_leaves_only_the_decay_in_the_moment(steps: int) -> None:
    """θ did not move: m̂/(√v̂ + ε) is -λ·θ, so AdamW's next step would hold θ where its decay pulls."""
    params, optimizer = stepped_adamw()
    start = torch.cat([p.detach().reshape(-1) for p in params])
    set_from_move(optimizer, params, start, start.clone(), steps)
    undecayed = optimizer.state[params[0]]["exp_avg"]
    assert torch.count_nonzero(undecayed) == 0
    assert torch.count_nonzero(optimizer.state[params[1]]["exp_avg"]) > 0


def test_a_second_moment_of_fewer_than_one_over_one_minus_beta2_steps_is_not_read() -> None:
    """Before 1/(1 - β2) steps v̂ is a few gradients' and the moments set from it cost (8 workers at a
    constant rate without a warm-up, docs/results/adam/round_momentum.json): m stays AdamW's own."""
    params, optimizer = stepped_adamw(99)  # past the β2 0.95 group's 20 steps, not the β2 0.99 one's 100
    start = torch.cat([p.detach().reshape(-1) for p in params])
    end = start + 1e-3
    before = [optimizer.state[p]["exp_avg"].clone() for p in params[:2]]
    set_from_move(optimizer, params, start, end, STEPS)
    assert torch.equal(optimizer.state[params[1]]["exp_avg"], before[1])  # β2 0.99, 99 steps: left
    assert not torch.equal(optimizer.state[params[0]]["exp_avg"], before[0])  # β2 0.95: set
    optimizer.step()  # the 100th
    before = [optimizer.state[p]["exp_avg"].clone() for p in params[:2]]
    set_from_move(optimizer, params, start, end, STEPS)
    assert not torch.equal(optimizer.state[params[1]]["exp_avg"], before[1])


def test_a_long_horizon_second_moment_is_read_from_step_100() -> None:
    """At torch's default β2 0.999 v̂ averages its steps near equally long before 1/(1 - β2) = 1000:
    by step 100 it holds as many gradients as β2 0.99's does by its 100th, and a run of a few hundred
    steps a worker would otherwise never have the moments set (docs/RESULTS.md, "At torch's default
    β2")."""
    generator = torch.Generator().manual_seed(1)
    param = torch.nn.Parameter(torch.randn(5, generator=generator))
    optimizer = torch.optim.AdamW([param], lr=3e-3)  # betas (0.9, 0.999)
    for step in range(1, 101):
        param.grad = torch.randn(5, generator=generator)
        optimizer.step()
        start = param.detach().clone()
        before = optimizer.state[param]["exp_avg"].clone()
        set_from_move(optimizer, [param], start, start + 1e-3, STEPS)
        changed = not torch.equal(optimizer.state[param]["exp_avg"], before)
        assert changed == (step >= 100), f"step {step}"
