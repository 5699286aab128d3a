"""LocalSteps' half of the noise scale for update commits (gemps.pytorch.noise_sums): a window's
sums of the local steps' gradients and of their second differences on each partition's slice,
exact on a slice of at most SAMPLE_SIZE values and a strided sample scaled to the slice past it,
against plain float64 sums."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gemps.pytorch.noise_sums import SAMPLE_SIZE, NoiseSums, check_window


def parameters(*shapes: tuple[int, ...]) -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.zeros(shape)) for shape in shapes]


def step(sums: NoiseSums, trained: list[torch.nn.Parameter], flat: np.ndarray) -> None:
    """One local step whose gradients, laid flat in θ order, are `flat`."""
    offset = 0
    for parameter in trained:
        size = parameter.numel()
        parameter.grad = torch.from_numpy(flat[offset : offset + size].reshape(parameter.shape).astype(np.float32))
        offset += size
    sums.step()


def second_differences(gradients: list[np.ndarray]) -> list[np.ndarray]:
    return [a - 2 * b + c for a, b, c in zip(gradients, gradients[1:], gradients[2:], strict=False)]


def test_each_partitions_sums_are_its_slices_plain_sums() -> None:
    trained = parameters((10, 7), (5,))  # 75 values; partition 1 starts inside the first tensor
    bounds = [(0, 40), (40, 75)]
    sums = NoiseSums(trained, bounds, window=3)
    sums.start(10)
    rng = np.random.default_rng(0)
    gradients = [rng.normal(size=75).astype(np.float32).astype(np.float64) for _ in range(6)]
    for gradient in gradients[:2]:
        step(sums, trained, gradient)
    assert sums.take(50) is None  # 2 of 3 steps: the window goes on
    step(sums, trained, gradients[2])
    first = sums.take(106)
    for gradient in gradients[3:]:
        step(sums, trained, gradient)
    second = sums.take(202)
    assert first is not None and second is not None and len(first) == len(second) == 2
    # The first window's one difference is its own steps'; the next window's reach back into it.
    for window, taken, steps, differences, samples in [
        (gradients[:3], first, 3, 1, 96),
        (gradients[1:], second, 3, 3, 96),
    ]:
        for (start, stop), part in zip(bounds, taken, strict=True):
            own = [g[start:stop] for g in window[-3:]]
            assert part.square_sum == pytest.approx(sum(g @ g for g in own), rel=1e-6)
            expected = sum(d @ d for d in second_differences([g[start:stop] for g in window]))
            assert part.difference_square == pytest.approx(expected, rel=1e-6)
            assert (part.steps, part.differences, part.samples) == (steps, differences, samples)
            assert part.problem() == ""


def test_a_gradient_that_drifts_linearly_has_no_second_difference() -> None:
    """The worker's own steps move θ, and its gradient with it: a steady drift is not noise."""
    trained = parameters((50,))
    sums = NoiseSums(trained, [(0, 50)], window=8)
    start, drift = np.linspace(-1.0, 1.0, 50), np.linspace(0.5, -0.2, 50)
    for index in range(8):
        step(sums, trained, (start + index * drift).astype(np.float32))
    taken = sums.take(0)
    assert taken is not None and taken[0].differences == 6
    assert taken[0].difference_square < 1e-9 * taken[0].square_sum and taken[0].noise < 1e-9


def test_past_the_sample_size_every_stride_th_value_is_read_and_scaled_to_the_slice() -> None:
    size = 2 * SAMPLE_SIZE + 3  # a stride of 3: ceil(size / SAMPLE_SIZE)
    trained = parameters((size,))
    sums = NoiseSums(trained, [(0, size)], window=3)
    rng = np.random.default_rng(1)
    gradients = [rng.normal(size=size).astype(np.float32) for _ in range(3)]
    for gradient in gradients:
        step(sums, trained, gradient)
    taken = sums.take(0)
    assert taken is not None
    sampled = [g[::3].astype(np.float64) for g in gradients]
    scale = size / sampled[0].size
    (difference,) = second_differences(sampled)
    assert taken[0].square_sum == pytest.approx(scale * sum(g @ g for g in sampled), rel=1e-12)
    assert taken[0].difference_square == pytest.approx(scale * (difference @ difference), rel=1e-12)
    assert taken[0].square_sum == pytest.approx(sum(float(g.astype(np.float64) @ g) for g in gradients), rel=0.05)


def test_a_parameter_without_a_gradient_counts_as_zeros() -> None:
    trained = parameters((3,), (2,))
    sums = NoiseSums(trained, [(0, 5)], window=3)
    for value in (1.0, 3.0, 2.0):
        trained[0].grad = torch.full((3,), value)
        trained[1].grad = None  # unused this step
        sums.step()
    taken = sums.take(0)
    assert taken is not None and taken[0].square_sum == 3 * (1 + 9 + 4)
    assert taken[0].difference_square == 3 * (1 - 6 + 2) ** 2


@pytest.mark.parametrize("window", [-2, True, 2.5])
def test_a_window_that_is_not_a_count_of_steps_is_refused(window: object) -> None:
    with pytest.raises(ValueError, match="noise_window must be 0"):
        check_window(window)  # type: ignore[arg-type]
    for allowed in (0, 1, 8):
        check_window(allowed)
