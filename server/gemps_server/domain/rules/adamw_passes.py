"""The adamw rule's arithmetic over θ-sized vectors (rules/adamw.py): an AdamW step's float32
coefficients, the step in numpy (the reference csrc/adamw.c's passes are held to, bit for bit:
tests/unit/test_adamw_kernel.py), and the bound that lets the compiled passes write in place.

In place, as GEM's compiled kernel (overflow.py): a pass writes the round's sum, the moments and θ
where they lie only when a bound shows that no value it computes can come near float32's largest,
so a commit it would refuse never reaches it; otherwise into spares, checked, swapped in.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from gemps_server.domain.rules.overflow import ROUNDING, SAFE_MAGNITUDE
from gemps_server.native import max_abs


class Coefficients(NamedTuple):
    """An AdamW step's float32 scalars, computed once for both kernels (csrc/adamw.c takes them in this order)."""

    divisor: np.float32  # the round's gradients: mean = sum / divisor
    beta1: np.float32
    rest1: np.float32  # 1 - beta1
    beta2: np.float32
    rest2: np.float32  # 1 - beta2
    bias2_root: np.float32  # sqrt(1 - beta2^t)
    epsilon: np.float32
    step_size: np.float32  # lr / (1 - beta1^t)


def coefficients(
    divisor: int, learning_rate: float, steps: int, betas: tuple[float, float], epsilon: float
) -> Coefficients:
    """The float32 scalars of AdamW step `steps` on a sum of `divisor` gradients."""
    beta1, beta2 = betas
    return Coefficients(
        divisor=np.float32(divisor),
        beta1=np.float32(beta1),
        rest1=np.float32(1 - beta1),
        beta2=np.float32(beta2),
        rest2=np.float32(1 - beta2),
        bias2_root=np.float32(math.sqrt(1 - beta2**steps)),
        epsilon=np.float32(epsilon),
        step_size=np.float32(learning_rate / (1 - beta1**steps)),
    )


def numpy_step(
    gradient: np.ndarray,
    moments: tuple[np.ndarray, np.ndarray],
    theta: np.ndarray,
    outputs: tuple[np.ndarray, np.ndarray, np.ndarray],
    c: Coefficients,
    decay: np.float32,
    decayed: Sequence[tuple[int, int]] | None,
) -> tuple[float, float, float]:
    """The step on the mean `gradient` / divisor in numpy: the new moments and θ into `outputs`
    (θ times `decay` within the `decayed` ranges, None: all of it), and their peaks."""
    first, second, updated = outputs
    with np.errstate(over="ignore", invalid="ignore"):  # an overflow is refused by the caller
        mean = gradient / c.divisor
        np.multiply(moments[0], c.beta1, out=first)
        first += c.rest1 * mean
        np.multiply(moments[1], c.beta2, out=second)
        second += c.rest2 * mean * mean
        # torch.optim.AdamW's order: decay, then m̂'s step over √û + ε
        denominator = np.sqrt(second) / c.bias2_root
        denominator += c.epsilon
        if decayed is None:
            np.multiply(theta, decay, out=updated)
        else:
            np.copyto(updated, theta)
            for low, high in decayed:
                updated[low:high] *= decay
        updated -= c.step_size * first / denominator
    return max_abs(first), max_abs(second), max_abs(updated)


def sum_in_place(sum_peak: float, payload_peak: float) -> bool:
    """Whether the round's sum (max |G| <= `sum_peak`) may take a gradient (max |g| <= `payload_peak`) in place."""
    return (sum_peak + payload_peak) * ROUNDING < SAFE_MAGNITUDE  # False for a NaN


def step_in_place(
    sum_peak: float,
    payload_peak: float,
    moment_peaks: tuple[float, float],
    theta_peak: float,
    c: Coefficients,
    decay: float,
) -> bool:
    """Whether the step may write the moments and θ in place: |mean| <= (|G| + |g|) / k,
    |m'| <= |m| + |mean|, |v'| <= |v| + |mean|², |θ'| <= |θ|·|decay| + step·|m'| / ε (the
    denominator is at least ε), each below SAFE_MAGNITUDE with room for float32's rounding."""
    mean = (sum_peak + payload_peak) / float(c.divisor)
    first = moment_peaks[0] + mean
    second = moment_peaks[1] + mean * mean
    theta = theta_peak * abs(decay) + float(c.step_size) * first / float(c.epsilon)
    return all(bound * ROUNDING < SAFE_MAGNITUDE for bound in (sum_peak + payload_peak, first, second, theta))
