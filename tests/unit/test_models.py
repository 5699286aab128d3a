from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gemps_worker.models import MODELS, build_model

SHAPES = {
    "mlp": (1, 8, 8),
    "wide-mlp": (1, 8, 8),
    "wider-mlp": (1, 8, 8),
    "widest-mlp": (1, 8, 8),
    "digits-cnn": (1, 8, 8),
    "mnist-cnn": (1, 28, 28),
    "resnet-bn": (1, 8, 8),
}


def train_losses(
    model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int, lr: float, momentum: float = 0.0
) -> list[float]:
    """The cross-entropy before each of `steps` SGD steps on one batch."""
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses


@pytest.mark.parametrize("name", [name for name in MODELS if name in SHAPES])  # char-gpt: test_char_lm.py
def test_model_trains_one_step(name: str) -> None:
    model = build_model(name, SHAPES[name], 10, seed=0)
    x, y = torch.randn(16, *SHAPES[name]), torch.randint(0, 10, (16,))
    losses = train_losses(model, x, y, steps=5, lr=0.1)
    assert model(x).shape == (16, 10)
    assert losses[-1] < losses[0]


def test_every_model_is_tested() -> None:
    assert set(MODELS) == {*SHAPES, "char-gpt"}


def test_seeded_models_are_identical() -> None:
    a, b = build_model("digits-cnn", (1, 8, 8), 10, seed=3), build_model("digits-cnn", (1, 8, 8), 10, seed=3)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


def test_paper_cnn_shape_matches_appendix_a() -> None:
    model = build_model("mnist-cnn", (1, 28, 28), 10)
    assert [tuple(p.shape) for p in model.parameters()][::2] == [
        (10, 1, 5, 5),
        (20, 10, 5, 5),
        (300, 320),
        (200, 300),
        (10, 200),
    ]
    with pytest.raises(ValueError, match="1x28x28"):
        build_model("mnist-cnn", (1, 8, 8), 10)
