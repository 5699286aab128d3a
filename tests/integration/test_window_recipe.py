"""LocalSteps' defaults are the SDK guide's recipe for the server's rule (gemps.pytorch.window_recipe):
a commit every step under asynchronous rules, windows of 8 under rounds of windows, and the β1 ramp
over a quarter of `planned_steps` there; what a user gives is used as given, or refused, naming why."""

from __future__ import annotations

import pytest
import torch

import gemps
from gemps.pytorch import LocalSteps
from gemps.pytorch.local_steps import RAMP_KEY
from tests.integration.conftest import StartServer


def fresh(
    kind: type[torch.optim.SGD | torch.optim.AdamW] = torch.optim.AdamW,
) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Linear(4, 2)
    return model, kind(model.parameters(), lr=0.01)


def step(optimizer: LocalSteps, model: torch.nn.Module, value: float) -> None:
    optimizer.zero_grad()
    model(torch.full((3, 4), value)).square().mean().backward()
    optimizer.step()


def test_steps_left_out_are_the_recipe_of_the_servers_rule(start_server: StartServer) -> None:
    windows = start_server(rule="adamw", outer_rate=1.0)
    downpour = start_server(rule="downpour")
    with LocalSteps(*fresh(), windows.target) as optimizer:
        assert optimizer.steps == 8  # rounds of windows: 8 local steps a commit
    with LocalSteps(*fresh(), downpour.target) as optimizer:
        assert optimizer.steps == 1  # asynchronous workers: a commit every step
    for server in (windows, downpour):
        with LocalSteps(*fresh(), server.target, steps=3) as optimizer:
            assert optimizer.steps == 3  # given: used as given
    with pytest.raises(ValueError, match=r"steps must be a whole number of local steps >= 1 \(or None"):
        LocalSteps(*fresh(), downpour.target, steps=0)


def test_planned_steps_ramp_beta1_over_their_first_quarter_under_rounds_of_windows(start_server: StartServer) -> None:
    """8 planned steps: β1 0.9 rises to 0.95 over 2 (0.925 after the first), then is held, β2 kept;
    a checkpoint carries the ramp's progress into a resumed LocalSteps."""
    server = start_server(rule="adamw", outer_rate=1.0)
    model, adamw = fresh()
    with LocalSteps(model, adamw, server.target, steps=1, planned_steps=8) as optimizer:
        seen = []
        for index in range(4):
            step(optimizer, model, float(index))
            seen.append(adamw.param_groups[0]["betas"])
        assert seen[0] == pytest.approx((0.925, 0.999))
        assert seen[1] == seen[3] == pytest.approx((0.95, 0.999))
        saved = optimizer.state_dict()
    assert saved[RAMP_KEY]["done"] == 4 and saved[RAMP_KEY]["starts"] == [0.9]
    again_model, again = fresh()
    with LocalSteps(again_model, again, server.target, steps=1, planned_steps=40) as resumed:
        resumed.load_state_dict(saved)  # the saved ramp: 2 steps, done; not this one's 10
        step(resumed, again_model, 1.0)
        assert again.param_groups[0]["betas"] == pytest.approx((0.95, 0.999))
    with LocalSteps(*fresh(), server.target) as unplanned:
        assert unplanned.ramp is None  # no planned steps: β1 stays the optimizer's


def test_planned_steps_are_refused_where_they_cannot_apply(start_server: StartServer) -> None:
    windows = start_server(rule="adamw", outer_rate=1.0)
    downpour = start_server(rule="downpour")
    with pytest.raises(ValueError, match=r"planned_steps=100: it ramps β1 for rounds of windows .*rule downpour"):
        LocalSteps(*fresh(), downpour.target, planned_steps=100)
    with pytest.raises(TypeError, match=r"Beta1Ramp: parameter group\(s\) \[0\] have no betas"):
        LocalSteps(*fresh(torch.optim.SGD), windows.target, planned_steps=100, round_momentum=False)
    with pytest.raises(ValueError, match=r"planned_steps must be this worker's planned optimizer steps"):
        LocalSteps(*fresh(), windows.target, planned_steps=0)
    for server in (windows, downpour):  # the refused workers left: none is registered
        with gemps.Client(server.target) as observer:
            assert observer.status().active_workers == 0
