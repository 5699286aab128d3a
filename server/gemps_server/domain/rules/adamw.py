"""AdamW on the server, a round of gradients at a time, with backup workers: DDP-AdamW's
computation, asynchronous only in that no round waits for its slowest workers.

Synchronous stochastic optimisation with backup workers (Chen, Pan, Monga, Bengio and Jozefowicz
2016, "Revisiting Distributed Synchronous SGD", Algorithm 1-2): N workers compute gradients on
the same θ; a round closes at the first K of them, and one optimizer step is taken on their
mean; the N - K slowest gradients of the round, computed on a θ the round has since moved, are
dropped. With K = N (no backups) and workers that wait for each round, this is exactly data
parallel training at a global batch of N x b; AdamW (Loshchilov and Hutter 2019) is the step,
as torch.optim.AdamW computes it.

Each commit, in FIFO order, at central version v (`version` counts commits, as every rule's;
r0 is the version at which θ last moved, k the gradients buffered since):

    base_version < r0:  dropped: computed on a θ this round has moved away from (π = 0)
    else:               G ← G + g ;  k ← k + 1
    if k ≥ K:           t ← t + 1 ;  ḡ = G / k
                        m ← β1·m + (1 - β1)·ḡ ;  u ← β2·u + (1 - β2)·ḡ²
                        θ ← θ·(1 - η(v)·λ) - η(v)/(1 - β1^t) · m / (√u / √(1 - β2^t) + ε)
                        (ḡ first scaled to L2 norm c where it is longer, with `gradient_clip` c)
                        G ← 0 ;  k ← 0 ;  r0 ← v + 1

An update commit (local steps) enters as the pseudo-gradient g = -Δ (DiLoCo's sign). With
`outer_rate` r > 0 a round of updates (each worker's window of local AdamW steps from the round's θ)
closes with DiLoCo's outer step instead (Douillard et al. 2023): torch's Nesterov SGD at rate r and
momentum `outer_momentum` on ḡ, its momentum held in m; gradients are then refused. K is
`round_size`, or with 0 (the default) the workers registered less `backup_workers` (at least 1).
The reply to a gradient the round took says how many commits it still needs (ApplyStats.pending):
the SDK then waits for θ to move before it hands θ back, so each worker's next gradient is taken on
the round's θ. A dropped gradient's reply is θ of the round open now, to take the next one on.
η(v) is the config's learning rate and schedule at the closing commit's version: nanoGPT's warm-up
of W steps is (W + 1) x K commits (its rate rises as (s + 1)/(W + 1), the server's as (v + 1)/W').

Weight decay λ applies to the tensors of 2 or more dimensions (nanoGPT's and the Trainer's groups:
no biases, no norms' gains; every parameter with adam_decay_vectors 1, or before the server told the
rule its spec: take_spec).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import numpy as np

from gemps_proto import rule_options
from gemps_proto.ranges import FLOAT32_MAX, INT32_MAX, Range
from gemps_proto.rule_options import RuleOption
from gemps_proto.schema import ParameterSpec, PayloadKind
from gemps_server.domain.rules.base import (
    ApplyStats,
    CommitRule,
    NonFiniteUpdate,
    Schedule,
    StepContext,
    constant_schedule,
)
from gemps_server.domain.rules.overflow import OverflowGuard
from gemps_server.domain.rules.registered import RegisteredWorkers
from gemps_server.native import compiled, max_abs

# torch.optim.AdamW's defaults.
ADAM_BETA1 = RuleOption("adam_beta1", 0.9, Range(0, 1, high_open=True), "beta1: adamw's first-moment decay")
ADAM_BETA2 = RuleOption("adam_beta2", 0.999, Range(0, 1, high_open=True), "beta2: adamw's second-moment decay")
ADAM_EPSILON = RuleOption("adam_epsilon", 1e-8, Range(0, 1, low_open=True), "epsilon: adamw's denominator term")
ADAM_WEIGHT_DECAY = RuleOption(
    "adam_weight_decay", 0.01, Range(0, 1), "lambda: adamw's decoupled weight decay (see adam_decay_vectors)"
)
ROUND_SIZE = RuleOption(
    rule_options.ROUND_SIZE,
    0,
    Range(0, INT32_MAX),
    "K: adamw's commits a round (a step); 0: the workers registered less the backups",
)
ADAM_DECAY_VECTORS = RuleOption(
    "adam_decay_vectors",
    0,
    Range(0, 1),
    "1: adamw's weight decay on every parameter; 0: on tensors of 2 or more dimensions alone (nanoGPT's and "
    "the Trainer's groups: no biases, no norms' gains)",
)
GRADIENT_CLIP = RuleOption(
    "gradient_clip",
    0.0,
    Range(0, FLOAT32_MAX),
    "adamw's bound on the round's mean gradient's L2 norm, as DDP clips after its all-reduce; 0: none",
)
OUTER_RATE = RuleOption(
    rule_options.OUTER_RATE,
    0.0,
    Range(0, FLOAT32_MAX),
    "r: how adamw's round of updates (local steps) moves theta: 0, an AdamW step on their pseudo-gradient -delta; "
    "r > 0, DiLoCo's outer SGD at rate r (with outer_momentum) on it (1, no momentum: the models averaged)",
)
OUTER_MOMENTUM = RuleOption(
    "outer_momentum",
    0.0,
    Range(0, 1, high_open=True),
    "mu: with outer_rate r > 0, Nesterov momentum on the rounds of updates (DiLoCo's outer step, mu 0.9 "
    "and r 0.7 in its paper); 0: none",
)
BACKUP_WORKERS = RuleOption(
    "backup_workers",
    0,
    Range(0, INT32_MAX),
    "adamw's workers a round does not wait for (with round_size 0); their late gradients are dropped",
)

#: what shapes the AdamW step alone, which a round of updates under outer_rate never takes
ADAMW_STEP_OPTIONS = (ADAM_BETA1, ADAM_BETA2, ADAM_EPSILON, ADAM_WEIGHT_DECAY, ADAM_DECAY_VECTORS, GRADIENT_CLIP)

CHUNK = 1 << 20  # values summed at a time in float64 for the clip's norm

#: the rule's state, all of it outliving the workers' registrations (a checkpoint keeps it)
STATE = ("first_moment", "second_moment", "gradient_sum", "steps", "buffered", "round_start")
_VECTORS = STATE[:3]
_COUNTS = STATE[3:]


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


class AdamWRule(RegisteredWorkers, OverflowGuard, CommitRule):
    name = "adamw"
    options = (*ADAMW_STEP_OPTIONS, ROUND_SIZE, BACKUP_WORKERS, OUTER_RATE, OUTER_MOMENTUM)

    def __init__(
        self,
        num_parameters: int,
        *,
        learning_rate: float,
        adam_beta1: float,
        adam_beta2: float,
        adam_epsilon: float,
        adam_weight_decay: float,
        adam_decay_vectors: int,
        gradient_clip: float,
        round_size: int,
        backup_workers: int,
        outer_rate: float,
        outer_momentum: float,
        schedule: Schedule = constant_schedule,
    ) -> None:
        super().__init__(num_parameters, learning_rate=learning_rate, schedule=schedule)
        if round_size and backup_workers:
            raise ValueError(
                f"backup_workers {backup_workers} with round_size {round_size}: a fixed round size already says "
                "how many gradients a step waits for (set one of them)"
            )
        self.beta1, self.beta2, self.epsilon = adam_beta1, adam_beta2, adam_epsilon
        self.weight_decay, self.decay_vectors, self.gradient_clip = adam_weight_decay, adam_decay_vectors, gradient_clip
        self._decayed: list[tuple[int, int]] | None = None  # the ranges of θ decayed; None: all of it
        self._decayed_bounds = np.empty(0, dtype=np.int64)  # the same, flat, for the compiled pass
        # csrc/adamw.c's passes where built; numpy ("numpy": the reference they are held to, bit for bit)
        self.kernel = "compiled" if compiled is not None else "numpy"
        self.round_size, self.backup_workers = round_size, backup_workers
        if outer_momentum and not outer_rate:
            raise ValueError(
                f"outer_momentum {outer_momentum:g} with outer_rate 0: the momentum is that of the outer step on "
                "rounds of updates, which an outer_rate > 0 turns on (0.7 in DiLoCo's paper)"
            )
        self.outer_rate, self.outer_momentum = outer_rate, outer_momentum
        self._vectors = {key: np.zeros(num_parameters, dtype=np.float32) for key in _VECTORS}
        self._steps = 0  # t: AdamW steps taken
        self._buffered = 0  # k: gradients in the round's sum
        self._round_start = 0  # r0: the version at which θ last moved
        # The next moments and sum are written here, and swapped in once they and θ are finite.
        self._spares = {key: np.empty(0, dtype=np.float32) for key in _VECTORS}

    @classmethod
    def idle_options(cls, given: Mapping[str, float]) -> list[str]:
        rate = given.get(OUTER_RATE.name, OUTER_RATE.default)
        idle = [option.name for option in ADAMW_STEP_OPTIONS if option.name in given]
        if not (rate and idle):
            return []
        return [
            f"{', '.join(idle)} with outer_rate {rate:g}: a round of updates then closes with the outer SGD step "
            "(outer_rate, outer_momentum) and no AdamW step uses them: give them to the workers' own AdamW "
            "(LocalSteps), or set outer_rate 0 for an AdamW step on each round"
        ]

    def take_spec(self, spec: Sequence[ParameterSpec], bounds: tuple[int, int]) -> None:
        """The ranges of this θ (the values `bounds` holds of the whole) the decay applies to: every
        parameter's with adam_decay_vectors, else those of tensors of 2 or more dimensions."""
        start, stop = bounds
        ranges: list[tuple[int, int]] = []
        offset = 0
        for parameter in spec:
            low, high = max(offset, start), min(offset + parameter.size, stop)
            if high > low and (self.decay_vectors or len(parameter.shape) >= 2):
                if ranges and ranges[-1][1] == low - start:  # one range for neighbours
                    ranges[-1] = (ranges[-1][0], high - start)
                else:
                    ranges.append((low - start, high - start))
            offset += parameter.size
        self._decayed = ranges
        self._decayed_bounds = np.array(ranges, dtype=np.int64).reshape(-1)

    def refusal(self, kind: PayloadKind) -> str | None:
        if self.outer_rate and kind is PayloadKind.GRADIENT:
            return (
                f"a gradient, where adamw with outer_rate {self.outer_rate:g} averages rounds of updates "
                "(local steps: gemps.pytorch.LocalSteps, gemps worker --mode dynsgd); outer_rate 0 takes gradients"
            )
        return None

    def period(self) -> int:
        """K for the round open now: the option's, or the workers registered less the backups (at least one)."""
        return self.round_size or max(1, self.registered() - self.backup_workers)

    def global_state(self, workers: bool = True) -> dict[str, np.ndarray]:
        counts = (self._steps, self._buffered, self._round_start)
        # float64 holds every count a run reaches exactly (float32 would round past 2**24 versions)
        return {key: vector.copy() for key, vector in self._vectors.items()} | {
            key: np.array(count, dtype=np.float64) for key, count in zip(_COUNTS, counts, strict=True)
        }

    def load_global_state(self, state: dict[str, np.ndarray]) -> None:
        shape = [self.num_parameters]
        fits = set(state) == set(STATE) and all(list(state[key].shape) == shape for key in _VECTORS)
        counts = [float(state[key].reshape(-1)[0]) if fits and state[key].size == 1 else math.nan for key in _COUNTS]
        if not (fits and all(count.is_integer() and count >= 0 for count in counts)):
            raise ValueError(
                f"adamw rule state must be {', '.join(map(repr, _VECTORS))} of shape {shape} and "
                f"{', '.join(map(repr, _COUNTS))}, whole numbers >= 0; got {sorted(state)}"
            )
        for key in _VECTORS:
            np.copyto(self._vectors[key], state[key])
        self._steps, self._buffered, self._round_start = (int(count) for count in counts)

    def step_scaled(
        self, theta: np.ndarray, update: np.ndarray, scale: float, context: StepContext
    ) -> tuple[np.ndarray, ApplyStats]:
        period = self.period()
        if context.version - context.staleness < self._round_start:  # taken on a θ this round moved
            return theta, dataclasses.replace(ApplyStats.constant(0.0), kept_theta=True)
        total = self._spare_of("gradient_sum")
        # an update Δ is the pseudo-gradient -Δ
        if not math.isfinite(self._summed(update, context.kind is not PayloadKind.GRADIENT, total)):
            raise NonFiniteUpdate("the gradient would make adamw's sum of the round overflow to infinity")
        buffered = self._buffered + 1
        if buffered < period:
            self._swap("gradient_sum", total)
            self._buffered = buffered
            stats = ApplyStats.constant(1.0 / period)
            return theta, dataclasses.replace(stats, pending=period - buffered, kept_theta=True)
        if self.outer_rate and context.kind is PayloadKind.UPDATE:
            updated = self._outer_step(theta, total / np.float32(buffered))
        elif self.gradient_clip:  # the mean first, for its norm
            clipped = self._clipped(total / np.float32(buffered))
            updated = self._adamw_step(theta, clipped, 1, self.learning_rate_at(context.version))
        else:
            updated = self._adamw_step(theta, total, buffered, self.learning_rate_at(context.version))
        self._vectors["gradient_sum"].fill(0.0)  # `total`, the spare, is written over next round
        self._steps += 1
        self._buffered, self._round_start = 0, context.version + 1
        return updated, ApplyStats.constant(1.0 / buffered)

    def _outer_step(self, theta: np.ndarray, mean: np.ndarray) -> np.ndarray:
        """θ - r·(ḡ + μ·b) with b ← μ·b + ḡ (torch's Nesterov SGD; μ 0: θ + r·mean Δ), ḡ = `mean`,
        the round's mean pseudo-gradient -Δ. The first moment, which no AdamW step uses under
        outer_rate, is b."""
        updated = self.take_spare(theta)
        velocity = self._spare_of("first_moment")
        with np.errstate(over="ignore", invalid="ignore"):
            np.multiply(self._vectors["first_moment"], np.float32(self.outer_momentum), out=velocity)
            velocity += mean
            np.multiply(velocity, np.float32(self.outer_momentum), out=updated)
            updated += mean
            updated *= np.float32(-self.outer_rate)
            updated += theta
        if not math.isfinite(max_abs(velocity)):
            self.keep_spare(updated)
            raise NonFiniteUpdate("the update would make adamw's outer momentum overflow to infinity")
        updated = self.checked(theta, updated)
        self._swap("first_moment", velocity)
        return updated

    def _summed(self, update: np.ndarray, subtract: bool, out: np.ndarray) -> float:
        """out ← the round's sum + `update` (- with `subtract`); max |out| (NaN: not finite)."""
        total = self._vectors["gradient_sum"]
        if self.kernel == "compiled" and _flat_float32(update):
            assert compiled is not None
            return float(compiled.adamw_sum(total, update.reshape(-1), out, subtract))
        with np.errstate(over="ignore", invalid="ignore"):  # an overflow is refused by the caller
            (np.subtract if subtract else np.add)(total, update, out=out)
        return max_abs(out)

    def _adamw_step(self, theta: np.ndarray, gradient: np.ndarray, divisor: int, learning_rate: float) -> np.ndarray:
        """θ after one AdamW step on the mean gradient `gradient` / `divisor`, with the moments it
        makes swapped in; NonFiniteUpdate with nothing changed when any of them is not finite."""
        first, second = self._spare_of("first_moment"), self._spare_of("second_moment")
        updated = self.take_spare(theta)
        coefficients = self.coefficients(divisor, learning_rate, self._steps + 1)
        decay = np.float32(1 - learning_rate * self.weight_decay)
        moments = self._vectors["first_moment"], self._vectors["second_moment"]
        if self.kernel == "compiled":
            assert compiled is not None
            decay_all, bounds = self._decayed is None, self._decayed_bounds
            peaks = compiled.adamw_step(
                gradient, *moments, theta, first, second, updated, coefficients, decay, decay_all, bounds
            )
        else:
            peaks = self._adamw_numpy(gradient, moments, theta, (first, second, updated), coefficients, decay)
        first_peak, second_peak, theta_peak = peaks
        if not (math.isfinite(first_peak) and math.isfinite(second_peak)):
            self.keep_spare(updated)
            raise NonFiniteUpdate("the gradient would make adamw's moments overflow to infinity")
        updated = self.checked(theta, updated, theta_peak)
        self._swap("first_moment", first)
        self._swap("second_moment", second)
        return updated

    def coefficients(self, divisor: int, learning_rate: float, steps: int) -> Coefficients:
        """The float32 scalars of AdamW step `steps` on a sum of `divisor` gradients."""
        beta1, beta2 = self.beta1, self.beta2
        return Coefficients(
            divisor=np.float32(divisor),
            beta1=np.float32(beta1),
            rest1=np.float32(1 - beta1),
            beta2=np.float32(beta2),
            rest2=np.float32(1 - beta2),
            bias2_root=np.float32(math.sqrt(1 - beta2**steps)),
            epsilon=np.float32(self.epsilon),
            step_size=np.float32(learning_rate / (1 - beta1**steps)),
        )

    def _adamw_numpy(
        self,
        gradient: np.ndarray,
        moments: tuple[np.ndarray, np.ndarray],
        theta: np.ndarray,
        outputs: tuple[np.ndarray, np.ndarray, np.ndarray],
        c: Coefficients,
        decay: np.float32,
    ) -> tuple[float, float, float]:
        """The step in numpy, the reference csrc/adamw.c is held to: the new moments and θ into
        `outputs`, and their peaks."""
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
            self._decay(theta, decay, updated)
            updated -= c.step_size * first / denominator
        return max_abs(first), max_abs(second), max_abs(updated)

    def _decay(self, theta: np.ndarray, factor: np.float32, out: np.ndarray) -> None:
        """out ← θ, times `factor` where the decay applies."""
        if self._decayed is None:
            np.multiply(theta, factor, out=out)
            return
        np.copyto(out, theta)
        for low, high in self._decayed:
            out[low:high] *= factor

    def _clipped(self, mean: np.ndarray) -> np.ndarray:
        """`mean` scaled to the L2 norm `gradient_clip` where it is longer (torch's clip_grad_norm_)."""
        if not self.gradient_clip:
            return mean
        chunks = range(0, mean.size, CHUNK)  # float64 sums without a float64 copy of all P values
        norm = math.sqrt(
            sum(float(np.dot(part, part)) for part in (mean[i : i + CHUNK].astype(np.float64) for i in chunks))
        )
        if norm > self.gradient_clip:
            mean *= np.float32(self.gradient_clip / (norm + 1e-6))
        return mean

    def _spare_of(self, key: str) -> np.ndarray:
        if self._spares[key].shape != self._vectors[key].shape:
            self._spares[key] = np.empty_like(self._vectors[key])
        return self._spares[key]

    def _swap(self, key: str, new: np.ndarray) -> None:
        self._spares[key], self._vectors[key] = self._vectors[key], new


def _flat_float32(values: np.ndarray) -> bool:
    return values.dtype == np.float32 and values.flags.c_contiguous
