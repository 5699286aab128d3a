"""The gradient noise scale, estimated from gradient commits (McCandlish et al. 2018, Appendix A).

Each gradient commit is a gradient at a small batch B_s (its num_samples, else the announced
batch size); the mean of a window of k consecutive commits is one at B_b = k*B_s. With
|G_s|^2 the windows' mean of |g|^2 and |G_b|^2 the squared norm of their mean, both unbiased
up to staleness (the k gradients were computed at nearby, not equal, versions of θ):

    |G|^2  ~ (B_b |G_b|^2 - B_s |G_s|^2) / (B_b - B_s) = (k |G_b|^2 - |G_s|^2) / (k - 1)
    tr(Σ)  ~ (|G_s|^2 - |G_b|^2) / (1/B_s - 1/B_b)     = (|G_s|^2 - |G_b|^2) k B_s / (k - 1)

Each window's two estimates are noisy (|G|^2's is often negative early on), so each goes into
its own exponential moving average and B_noise is the ratio of the averages, as the paper does.
Unequal batch sizes in a window take B_s as their harmonic mean, which keeps both unbiased. A
commit that reports no num_samples counts as the server's --batch-size, and the estimate says so
(`batch_size_assumed`): the SDK's drop-in loop once sent none, and the noise scale read in workers
of batch 64 though they trained on 32 (issue 43). GradientNoise.missing says when there is no
estimate to show (fewer than MIN_NOISE_WINDOWS windows, no workers registered).

The sums are measured as the rule applies the commit (CommitRule.step's `window`: in GEM's
compiled pass, else one pass of their own): |g|^2 per commit, and the window's running sum of g,
whose squared norm is read at the window's last commit. Both are taken over an evenly spread
sample of at most NOISE_SAMPLE_SIZE parameters and scaled up to all of them: exact up to that
size, an estimate past it (as the commit statistics are, rules/base.py). The sample is runs of
16 consecutive parameters (one cache line of the payload each), every stride-th run. The
window's sum is a vector of the sample's size held here. Measured at 1M parameters
(docs/PERFORMANCE.md): a sum over all of θ cost a quarter more server CPU per commit (its memory
traffic), the sample 2-4% of the applier's CPU per commit, 1-3% of the server's.

Everything is a sum over parameters, so partitions of θ each estimate their slice and the whole
is the sum (status.GradientNoise.combined). An update commit is several steps' movement, not a
gradient at a batch: the server cannot measure it, so LocalSteps' worker measures its own window of
k local steps (their Σ|g_i|^2 and second differences over this server's slice, whose estimate
leaves out the drift of a θ the worker's steps move: gemps_proto.gradient_sums) and sends the sums
with the commit that follows (`gemps worker`'s local-step modes do the same); `reported` folds them
into the same averages. Updates sent without them are not measured (docs/OBSERVABILITY.md).
Runs on the applier, like CommitCore.commit; `estimate` is replaced whole, for other threads.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from gemps_proto.gradient_sums import GradientSums
from gemps_proto.ranges import UINT32_MAX, Range
from gemps_proto.schema import PayloadKind
from gemps_proto.status import GradientNoise
from gemps_server.domain.rules.base import NoiseWindow
from gemps_server.native import WINDOW_ADD, WINDOW_LAST, WINDOW_START, noise_sample, noise_window_size

#: --noise-window: 0 sizes each window by the workers registered when it starts (at least 2)
NOISE_WINDOW_AUTO = 0
#: --noise-window 1: no estimate (a window of one commit has no large batch to compare with)
NOISE_WINDOW_OFF = 1
#: the values --noise-window may take (a window's size is a uint32 in Status)
NOISE_WINDOWS = Range(0, UINT32_MAX)
NOISE_WINDOW_HELP = (
    "gradient commits per window of the gradient noise scale's estimate (the large batch is their mean; "
    "docs/OBSERVABILITY.md); 0: the workers registered when a window starts, at least 2; 1: no estimate"
)
#: each window's estimates enter their moving averages with weight 1 - this (about 20 windows' memory)
EMA_DECAY = 0.95
#: parameters the sums are taken over, at most: every stride-th run of native.NOISE_RUN, the stride ceil(P / this)
NOISE_SAMPLE_SIZE = 16_384


class MovingAverage:
    """An exponential moving average, bias-corrected (as Adam's) so the first values are not pulled to 0."""

    __slots__ = ("decay", "total", "weight")

    def __init__(self, decay: float = EMA_DECAY) -> None:
        self.decay, self.total, self.weight = decay, 0.0, 0.0

    def add(self, value: float) -> None:
        self.total = self.decay * self.total + (1.0 - self.decay) * value
        self.weight = self.decay * self.weight + (1.0 - self.decay)

    @property
    def value(self) -> float:
        return self.total / self.weight if self.weight > 0.0 else 0.0


@dataclass(frozen=True)
class NoiseImage:
    """A NoiseEstimator's state (its `export`, its `adopt`'s input): the window under way, the
    moving averages as (total, weight) pairs, and the estimate."""

    total: np.ndarray  # float32: the window's running sum over the sampled parameters
    stride: int = 1
    scale: float = 1.0
    size: int = 0
    count: int = 0
    small: float = 0.0
    inverse_batch: float = 0.0
    pending: bool = False
    assumed: int = 0  # commits of the window under way that reported no num_samples
    gradient_square: tuple[float, float] = (0.0, 0.0)
    noise_trace: tuple[float, float] = (0.0, 0.0)
    estimate: GradientNoise = dataclasses.field(default_factory=GradientNoise)


class NoiseEstimator:
    """The noise scale's windows and moving averages for the part of θ this server holds."""

    def __init__(self, window: int = NOISE_WINDOW_AUTO, batch_size: int = 64) -> None:
        self.option = window  # ServerConfig.noise_window
        self.default_batch = batch_size  # TrainingConfig.batch_size: when a commit reports no num_samples
        self._total = np.empty(0, dtype=np.float32)  # the window's running sum of gradients, sampled
        self._stride = 1  # every stride-th parameter is sampled
        self._scale = 1.0  # parameters per sampled one: the sums' factor to all of them
        self._size = 0  # k of the window under way
        self._count = 0  # its commits measured so far
        self._small = 0.0  # their sum of |g|^2
        self._inverse_batch = 0.0  # and of 1/B
        self._assumed = 0  # and how many reported no num_samples (the default batch stood in)
        self._pending = False  # a window handed out, not yet recorded (its commit may be refused)
        self._gradient_square, self._noise_trace = MovingAverage(), MovingAverage()
        self.estimate = GradientNoise(batch_size=float(batch_size), batch_size_assumed=True)

    def window(
        self, kind: PayloadKind, num_parameters: int, registered: int, num_samples: int | None = None
    ) -> NoiseWindow | None:
        """This commit's share of the estimate, for the rule to measure (CommitRule.step), which
        hands it back to `record` once the commit is applied; None when nothing is measured (off,
        an update commit, no parameters). `num_samples`: the commit's batch, if it says."""
        if self.option == NOISE_WINDOW_OFF or kind is not PayloadKind.GRADIENT or num_parameters == 0:
            return None
        if self._pending:  # the last commit was refused after its pass may have moved the sum: start over
            self._count = 0
        if self._count == 0:
            self._size = self.option or max(2, registered)
            self._small = self._inverse_batch = 0.0
            self._assumed = 0
            self._stride = -(-num_parameters // NOISE_SAMPLE_SIZE)  # in runs of NOISE_RUN parameters
            self._scale = num_parameters / noise_sample(num_parameters, self._stride).size
            size = noise_window_size(num_parameters, self._stride)
            if self._total.size != size:
                self._total = np.empty(size, dtype=np.float32)  # written by WINDOW_START before it is read
        self._pending = True
        mode = WINDOW_START if self._count == 0 else WINDOW_LAST if self._count == self._size - 1 else WINDOW_ADD
        return NoiseWindow(self._total, self._stride, mode, lambda measured: self.record(measured, num_samples))

    def record(self, window: NoiseWindow, num_samples: int | None) -> None:
        """The commit `window` was handed for is applied and its sums measured."""
        self._pending = False
        self._small += window.payload_square * self._scale
        self._inverse_batch += 1.0 / (num_samples or self.default_batch)
        self._assumed += not num_samples
        self._count += 1
        if self._count == self._size:
            self._count = 0
            self._close(window.window_square * self._scale)

    def reported(self, sums: GradientSums) -> None:
        """An applied update commit's window of its worker's local steps (checked: GradientSums.problem),
        measured by the worker; into the same averages as the server's own windows."""
        if self.option == NOISE_WINDOW_OFF:
            return
        batch = sums.samples / sums.steps if sums.samples else self.default_batch
        self._average(sums.gradient_square, sums.noise * batch, sums.steps, batch, assumed=not sums.samples)

    def export(self) -> NoiseImage:
        """A copy of the state (for a replica, on the applier)."""
        return NoiseImage(
            total=self._total.copy(),
            stride=self._stride,
            scale=self._scale,
            size=self._size,
            count=self._count,
            small=self._small,
            inverse_batch=self._inverse_batch,
            pending=self._pending,
            assumed=self._assumed,
            gradient_square=(self._gradient_square.total, self._gradient_square.weight),
            noise_trace=(self._noise_trace.total, self._noise_trace.weight),
            estimate=self.estimate,
        )

    def adopt(self, image: NoiseImage, num_parameters: int) -> None:
        """Take `image`'s state, for θ of `num_parameters` values; a ValueError, with nothing
        changed, when a window under way does not fit them."""
        if image.total.dtype != np.float32 or image.total.ndim != 1 or image.stride < 1:
            raise ValueError("the noise window's sum must be flat float32, its stride at least 1")
        if not 0 <= image.count < max(image.size, 1):
            raise ValueError(f"noise window at commit {image.count} of {image.size}")
        if image.count and image.total.size != noise_window_size(num_parameters, image.stride):
            raise ValueError(f"noise window of {image.total.size} values for {num_parameters} parameters")
        self._total = image.total.copy()
        self._stride, self._scale, self._size, self._count = image.stride, image.scale, image.size, image.count
        self._small, self._inverse_batch, self._pending = image.small, image.inverse_batch, image.pending
        self._assumed = image.assumed
        for average, (total, weight) in (
            (self._gradient_square, image.gradient_square),
            (self._noise_trace, image.noise_trace),
        ):
            average.total, average.weight = total, weight
        self.estimate = image.estimate

    def _close(self, window_square: float) -> None:
        k = self._size
        small = self._small / k  # |G_s|^2: the window's mean |g|^2
        large = window_square / (k * k)  # |G_b|^2: the squared norm of its mean gradient
        batch = k / self._inverse_batch  # B_s: the harmonic mean of its batch sizes
        gradient_square = (k * large - small) / (k - 1)
        noise_trace = (small - large) * k * batch / (k - 1)
        self._average(gradient_square, noise_trace, k, batch, self._assumed > 0)

    def _average(self, gradient_square: float, noise_trace: float, k: int, batch: float, assumed: bool) -> None:
        """One window's estimates of |G|^2 and tr(Σ) into the averages (k gradients of `batch` samples)."""
        if not (math.isfinite(gradient_square) and math.isfinite(noise_trace)):
            return  # squares of finite float32 values can overflow: the window is dropped
        self._gradient_square.add(gradient_square)
        self._noise_trace.add(noise_trace)
        self.estimate = GradientNoise(
            gradient_square=self._gradient_square.value,
            noise_trace=self._noise_trace.value,
            batch_size=batch,
            windows=self.estimate.windows + 1,
            window=k,
            batch_size_assumed=assumed,
        )
