"""gemps.pytorch.Beta1Ramp: Adam's β1 raised linearly over a run's first steps, then held."""

from __future__ import annotations

import math

import pytest
import torch

from gemps.pytorch import Beta1Ramp


def two_groups() -> torch.optim.AdamW:
    decayed, kept = torch.nn.Parameter(torch.zeros(2, 2)), torch.nn.Parameter(torch.zeros(2))
    groups = [
        {"params": [decayed], "weight_decay": 0.1},
        {"params": [kept], "weight_decay": 0.0, "betas": (0.8, 0.999)},
    ]
    return torch.optim.AdamW(groups, lr=1e-3, betas=(0.9, 0.99))


def test_beta1_rises_linearly_from_each_groups_own_and_is_then_held() -> None:
    optimizer = two_groups()
    ramp = Beta1Ramp(optimizer, to=0.95, steps=4)
    seen = []
    for _ in range(6):
        optimizer.step()
        ramp.step()
        seen.append([group["betas"] for group in optimizer.param_groups])
    assert seen[0][0] == pytest.approx((0.9 + 0.05 / 4, 0.99)) and seen[0][1] == pytest.approx((0.8 + 0.15 / 4, 0.999))
    assert seen[1][0][0] == pytest.approx(0.925) and seen[1][1][0] == pytest.approx(0.875)
    for after in seen[3:]:  # reached at the 4th step, then held; β2 never moves
        assert after[0] == pytest.approx((0.95, 0.99)) and after[1] == pytest.approx((0.95, 0.999))


def test_adamw_steps_with_the_ramps_beta1() -> None:
    """The moment AdamW keeps is the ramp's β1's: m = β1·m + (1 - β1)·g with the β1 written last."""
    weight = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.AdamW([weight], lr=1e-3, betas=(0.5, 0.99), weight_decay=0.0)
    ramp = Beta1Ramp(optimizer, to=0.9, steps=2)
    moment = 0.0
    for beta1 in (0.5, 0.7, 0.9, 0.9):
        weight.grad = torch.ones(1)
        optimizer.step()
        moment = beta1 * moment + (1 - beta1)
        assert optimizer.state[weight]["exp_avg"].item() == pytest.approx(moment, rel=1e-6)
        ramp.step()


def test_a_saved_ramp_resumes_where_it_was() -> None:
    optimizer = two_groups()
    ramp = Beta1Ramp(optimizer, to=0.95, steps=10)
    for _ in range(3):
        ramp.step()
    saved = ramp.state_dict()
    again = two_groups()
    resumed = Beta1Ramp(again, to=0.5, steps=1)  # replaced by the saved ramp
    resumed.load_state_dict(saved)
    resumed.step()
    ramp.step()
    assert [g["betas"] for g in again.param_groups] == [g["betas"] for g in optimizer.param_groups]
    with pytest.raises(ValueError, match="2 parameter groups, this optimizer 1"):
        Beta1Ramp(torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))]), 0.95, 5).load_state_dict(saved)


@pytest.mark.parametrize(
    ("to", "steps", "words"),
    [
        (1.0, 10, "to=1.0, where β1 lies in \\[0, 1\\)"),
        (-0.1, 10, "to=-0.1"),
        (math.nan, 10, "to=nan"),
        (True, 10, "to=True"),
        (0.95, 0, "steps=0, where the ramp takes at least 1 step"),
        (0.95, 2.5, "steps=2.5"),
    ],
)
def test_a_beta1_outside_zero_to_one_or_a_ramp_of_no_steps_is_refused(to: float, steps: int, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        Beta1Ramp(two_groups(), to, steps)


def test_an_optimizer_without_betas_is_refused_by_name() -> None:
    sgd = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1, momentum=0.9)
    with pytest.raises(TypeError, match=r"group\(s\) \[0\] have no betas .* SGD was given"):
        Beta1Ramp(sgd, 0.95, 10)
