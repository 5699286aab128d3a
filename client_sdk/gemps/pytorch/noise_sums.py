"""The worker's half of the noise scale for update commits: LocalSteps' gradients summed over
windows of its own local steps (gemps_proto.gradient_sums says what the server makes of them).

Each local step's gradient, as the optimizer is about to read it (after any clipping the loop
did), is read on a strided sample of θ: at most SAMPLE_SIZE values of each partition's slice, every
stride-th, gathered from the parameters on their own devices into one vector. Over a window of at
least `window` local steps the per-value sums of g_i^2 and of the second differences'
(g_{i-2} - 2 g_{i-1} + g_i)^2 accumulate on the device (float64; nothing is copied to the host per
step); the last two gradients carry over to the next window, so every step after a run's second
has its difference. The commit that ends the window reads the sums, scales each partition's from
its sample to its slice, and sends one GradientSums per partition with the window's samples.
Cost: seven vectors of the sample's size, made once and written in place (a step makes no new
tensor: at a small model the sample is all of θ), one gather a parameter and four small passes a
step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from gemps.records import GradientSums

if TYPE_CHECKING:
    from gemps.pytorch.remote import RemoteModel

#: values of each partition's slice read a step, at most (the server's own sample is as large)
SAMPLE_SIZE = 16_384
#: local steps per window: a commit carries sums every this many (LocalSteps' `noise_window` default)
DEFAULT_WINDOW = 8


def check_window(window: int) -> None:
    """ValueError unless `window` is 0 (not measured) or a count of local steps."""
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        raise ValueError(f"noise_window must be 0 (not measured) or a count of local steps >= 1, not {window!r}")


def sums_of(remote: RemoteModel, window: int) -> NoiseSums | None:
    """The sums of `remote`'s trained parameters' gradients over windows of `window` local steps,
    on each partition's slice of θ; None with `window` 0, and in a process group (its gradient is
    every rank's batches', not this process's)."""
    if window == 0 or remote.samples_seen is None:
        return None
    layout = remote.client.layout
    size = sum(parameter.numel() for parameter in remote.trained)
    bounds = [(0, size)] if layout is None else [(part.start, part.stop) for part in layout.partitions]
    return NoiseSums(remote.trained, bounds, window)


class NoiseSums:
    """A window's sums of `parameters`' gradients on the sample of each partition [start, stop)."""

    def __init__(self, parameters: Sequence[torch.Tensor], bounds: Sequence[tuple[int, int]], window: int) -> None:
        self.window = window
        # every stride-th value of each slice, in θ order, so each partition's are one run of the sample
        sampled = [np.arange(start, stop, max(1, -(-(stop - start) // SAMPLE_SIZE))) for start, stop in bounds]
        positions = np.concatenate(sampled) if sampled else np.zeros(0, dtype=np.int64)
        counts = [part.size for part in sampled]
        self._segments = np.cumsum([0, *counts])  # partition r's values: [segments[r], segments[r + 1])
        self._scales = [(stop - start) / max(count, 1) for (start, stop), count in zip(bounds, counts, strict=True)]
        self._device = parameters[0].device if parameters else torch.device("cpu")
        self._gathered = torch.zeros(positions.size, dtype=torch.float32, device=self._device)
        # a parameter, its sampled flat indices, and where they go in the sample
        self._picks: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        offset = taken = 0
        for parameter in parameters:
            inside = positions[(positions >= offset) & (positions < offset + parameter.numel())] - offset
            if inside.size:
                into = self._gathered[taken : taken + inside.size]
                self._picks.append((parameter, torch.from_numpy(inside).to(parameter.device), into))
                taken += inside.size
            offset += parameter.numel()
        self._sample = torch.zeros(positions.size, dtype=torch.float64, device=self._device)
        self._squares = torch.zeros_like(self._sample)  # Σ g_i^2, per value
        self._differences = torch.zeros_like(self._sample)  # Σ (g_{i-2} - 2 g_{i-1} + g_i)^2, per value
        self._before = [torch.zeros_like(self._sample) for _ in range(2)]  # g_{i-2}, g_{i-1}
        self._difference = torch.zeros_like(self._sample)
        self._seen = 0  # gradients of the run so far (a difference needs two before it)
        self._steps = self._counted = 0  # the window's steps, and its second differences
        self._mark = 0  # samples seen when the window started

    def step(self) -> None:
        """Add this local step's gradients (a parameter without one: zeros) to the window."""
        with torch.no_grad():
            for parameter, index, into in self._picks:
                grad = parameter.grad
                if grad is None:
                    into.zero_()
                    continue
                flat = (grad.to_dense() if grad.is_sparse else grad).reshape(-1)
                if flat.dtype == into.dtype and flat.device == into.device:
                    torch.index_select(flat, 0, index, out=into)
                else:  # a parameter of another dtype or on another device: through a copy of its sample
                    into.copy_(flat.index_select(0, index))
            sample, (earlier, last) = self._sample, self._before
            sample.copy_(self._gathered)
            self._squares.addcmul_(sample, sample)
            if self._seen >= 2:
                torch.add(earlier, last, alpha=-2.0, out=self._difference)
                self._difference.add_(sample)
                self._differences.addcmul_(self._difference, self._difference)
                self._counted += 1
            earlier.copy_(sample)  # the oldest's room takes this one: (g_{i-1}, g_i) for the next step
            self._before = [last, earlier]
        self._seen += 1
        self._steps += 1

    def start(self, samples_seen: int) -> None:
        """The window starts with the samples counted so far (LocalSteps' first window)."""
        self._mark = samples_seen

    def take(self, samples_seen: int) -> list[GradientSums] | None:
        """At a commit: the window's sums, one per partition, once it holds `window` steps (else
        None and the window goes on); the next window starts. `samples_seen`: the model's count."""
        if self._steps < self.window or self._counted == 0:
            return None
        samples, self._mark = samples_seen - self._mark, samples_seen
        squares, differences = self._squares.cpu().numpy(), self._differences.cpu().numpy()
        taken = [
            GradientSums(
                square_sum=float(squares[low:high].sum() * scale),
                difference_square=float(differences[low:high].sum() * scale),
                steps=self._steps,
                differences=self._counted,
                samples=max(samples, 0),
            )
            for low, high, scale in zip(self._segments[:-1], self._segments[1:], self._scales, strict=True)
        ]
        self._squares.zero_()
        self._differences.zero_()
        self._steps = self._counted = 0
        return taken
