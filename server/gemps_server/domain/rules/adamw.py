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
`round_size`, or with 0 (the default) the workers registered less `backup_workers` (at least 1), and
never more than the workers still committing: a worker killed without leaving stays registered for
its lease, and no commit of its among the last 2N versions (N registered) leaves it out of K
(CommitCore.live_workers), so the rounds go on without it instead of waiting. After a restore K is
the checkpoint's until as many workers registered again (or one left): the first one back gives a
round as many gradients as the job did, not steps of its own batch alone.
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

import numpy as np

from gemps_proto.schema import ParameterSpec, PayloadKind
from gemps_proto.status import Rounds
from gemps_server.domain.rules.adamw_options import (
    ADAMW_STEP_OPTIONS,
    BACKUP_WORKERS,
    OUTER_MOMENTUM,
    OUTER_RATE,
    ROUND_SIZE,
)
from gemps_server.domain.rules.adamw_passes import (
    Coefficients,
    coefficients,
    numpy_step,
    step_in_place,
    sum_in_place,
)
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

CHUNK = 1 << 20  # values summed at a time in float64 for the clip's norm

#: the rule's state, all of it outliving the workers' registrations (a checkpoint keeps it)
STATE = ("first_moment", "second_moment", "gradient_sum", "steps", "buffered", "round_start")
_VECTORS = STATE[:3]
_COUNTS = STATE[3:]
#: K kept for the workers that register again after a restore (0: none); optional, since
#: checkpoints written before it lack it
KEPT_SIZE = "round_size_kept"


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
        self.counts_live_workers = not round_size  # K follows the workers still committing
        if outer_momentum and not outer_rate:
            raise ValueError(
                f"outer_momentum {outer_momentum:g} with outer_rate 0: the momentum is that of the outer step on "
                "rounds of updates, which an outer_rate > 0 turns on (0.7 in DiLoCo's paper)"
            )
        self.outer_rate, self.outer_momentum = outer_rate, outer_momentum
        self._vectors = {key: np.zeros(num_parameters, dtype=np.float32) for key in _VECTORS}
        self._steps = 0  # t: AdamW steps taken
        self._buffered = 0  # k: gradients in the round's sum
        # The round's gradients by worker: who waits for it, and how many of each it holds (no
        # checkpoint keeps them: after a restore, nobody is told to go on: round_takers).
        self._joined: dict[str, int] = {}
        self._round_start = 0  # r0: the version at which θ last moved
        self._live: int | None = None  # the workers still committing, as last counted (a commit, round_takers)
        self._whole = True  # this server holds all of θ (take_spec): no other partition names takers
        # The next moments and sum are written here, and swapped in once they and θ are finite
        # (out of place: adamw_passes.py); allocated the first time a pass needs them.
        self._spares = {key: np.empty(0, dtype=np.float32) for key in _VECTORS}
        # Bounds on max |G| and on max |m|, max |u| (None: not known, measured when needed).
        self._sum_peak: float | None = 0.0
        self._moment_peaks: tuple[float, float] | None = (0.0, 0.0)

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
        self._whole = start == 0 and stop == offset

    def refusal(self, kind: PayloadKind) -> str | None:
        if self.outer_rate and kind is PayloadKind.GRADIENT:
            return (
                f"a gradient, where adamw with outer_rate {self.outer_rate:g} averages rounds of updates "
                "(local steps: gemps.pytorch.LocalSteps, gemps worker --mode dynsgd); outer_rate 0 takes gradients"
            )
        return None

    def period(self, live: int | None = None) -> int:
        """K for the round open now: the option's, or the workers registered less the backups, and
        never more than the workers still committing (`live`, as StepContext.live_workers counts
        them: one killed without leaving stays registered for its lease), at least one. The backups
        are the slowest, silent ones first: a straggler the backups cover still leaves K as it was."""
        if fixed := self.round_size or self.kept_group():
            return fixed
        registered = self.registered()
        return max(1, min(registered - self.backup_workers, registered if live is None else live))

    def round_takers(self, live_workers: int) -> frozenset[str]:
        """Every worker in the round when it holds every commit it waits for (workers left after
        the others committed to it: the next commit closes it); else as many as it still needs
        beyond one from each live worker not in it yet (K above the workers), those that gave it
        the fewest first, the earliest among equals: one named and still computing stays named,
        and counts, so none is dropped (⌈K / live⌉ each gave K 6 from 4 workers 8 gradients). A
        partition names every worker short of ⌈K / live⌉ still: commits may reach partitions in
        other orders, and a worker waits for every one's word (PullResponse.round_takes_next).
        The core asks after each registration and departure: `rounds()` says this K from then on."""
        live = live_workers if self.counts_live_workers else None
        period, self._live = self.period(live), live
        if self._buffered >= period:
            return frozenset(self._joined)
        if not self._whole:
            share = -(-period // max(1, live_workers))
            return frozenset(worker for worker, count in self._joined.items() if count < share)
        needed = period - self._buffered - max(0, live_workers - len(self._joined))
        if needed <= 0:
            return frozenset()
        fewest = sorted(self._joined, key=self._joined.__getitem__)  # stable: first committed first
        return frozenset(fewest[:needed])

    def rounds(self) -> Rounds:
        return Rounds(self._steps, self.period(self._live), self._buffered)

    def global_state(self, workers: bool = True) -> dict[str, np.ndarray]:
        kept = self.group_to_keep(workers, 0 if self.round_size else self.period(self._live))
        counts = (self._steps, self._buffered, self._round_start, kept)
        # float64 holds every count a run reaches exactly (float32 would round past 2**24 versions)
        return {key: vector.copy() for key, vector in self._vectors.items()} | {
            key: np.array(count, dtype=np.float64) for key, count in zip((*_COUNTS, KEPT_SIZE), counts, strict=True)
        }

    def load_global_state(self, state: dict[str, np.ndarray]) -> None:
        shape = [self.num_parameters]
        kept = np.zeros(1) if KEPT_SIZE not in state else state[KEPT_SIZE]
        fits = set(state) - {KEPT_SIZE} == set(STATE) and all(list(state[key].shape) == shape for key in _VECTORS)
        given = [state[key] for key in _COUNTS] + [kept] if fits else []
        counts = [float(count.reshape(-1)[0]) if count.size == 1 else math.nan for count in given]
        if not (fits and all(count.is_integer() and count >= 0 for count in counts)):
            raise ValueError(
                f"adamw rule state must be {', '.join(map(repr, _VECTORS))} of shape {shape} and "
                f"{', '.join(map(repr, _COUNTS))} (and {KEPT_SIZE!r}), whole numbers >= 0; got {sorted(state)}"
            )
        for key in _VECTORS:
            np.copyto(self._vectors[key], state[key])
        self._steps, self._buffered, self._round_start, kept_size = (int(count) for count in counts)
        self.keep_group(kept_size)
        self._joined = {}
        self._sum_peak, self._moment_peaks = None, None

    @property
    def holds_payload(self) -> bool:
        return self.kernel == "compiled"  # the compiled passes read each value once, held to the peak

    @property
    def shared_state_bytes(self) -> int:
        """Bytes of the moments, the round's sum and the spares the out-of-place passes allocated."""
        return sum(vector.nbytes for vector in (*self._vectors.values(), *self._spares.values()))

    def step_scaled(
        self, theta: np.ndarray, update: np.ndarray, scale: float, context: StepContext
    ) -> tuple[np.ndarray, ApplyStats]:
        period, self._live = self.period(context.live_workers), context.live_workers
        if context.version - context.staleness < self._round_start:  # taken on a θ this round moved
            return theta, dataclasses.replace(ApplyStats.constant(0.0), kept_theta=True)
        subtract = context.kind is not PayloadKind.GRADIENT  # an update Δ is the pseudo-gradient -Δ
        last = _Last(update.reshape(-1), subtract, _bound(context.payload_peak))
        buffered = self._buffered + 1
        if buffered < period:
            self._add(last)
            self._buffered = buffered
            self._joined[context.worker_id] = self._joined.get(context.worker_id, 0) + 1
            stats = ApplyStats.constant(1.0 / period)
            return theta, dataclasses.replace(stats, pending=period - buffered, kept_theta=True)
        learning_rate = self.learning_rate_at(context.version)
        if self.outer_rate and context.kind is PayloadKind.UPDATE:
            updated = self._outer_step(theta, self._summed(last) / np.float32(buffered))
        elif self.gradient_clip:  # the mean first, for its norm
            clipped = self._clipped(self._summed(last) / np.float32(buffered))
            updated = self._adamw_step(theta, clipped, None, 1, learning_rate)
        elif self._compiles(last):  # the last gradient added in the step's pass
            updated = self._adamw_step(theta, self._vectors["gradient_sum"], last, buffered, learning_rate)
        else:
            updated = self._adamw_step(theta, self._summed(last), None, buffered, learning_rate)
        self._vectors["gradient_sum"].fill(0.0)  # a spare written for this step is written over next round
        self._sum_peak = 0.0
        self._steps += 1
        self._buffered, self._round_start, self._joined = 0, context.version + 1, {}
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

    def _add(self, last: _Last) -> None:
        """The round's sum G ← G ± g, in place where the bound allows; NonFiniteUpdate with nothing
        changed where it would overflow."""
        total = self._vectors["gradient_sum"]
        in_place = self._compiles(last) and last.bound >= 0 and sum_in_place(self._sum_bound(), last.bound)
        out = total if in_place else self._spare_of("gradient_sum")
        self._sum_peak = self._sum_into(last, out)
        if out is not total:
            self._swap("gradient_sum", out)

    def _summed(self, last: _Last) -> np.ndarray:
        """G ± g in the sum's spare (G as it was), for a pass that needs the round's whole sum first."""
        out = self._spare_of("gradient_sum")
        self._sum_into(last, out)
        return out

    def _sum_into(self, last: _Last, out: np.ndarray) -> float:
        """out ← G ± g (`out` may be G itself); max |out|; NonFiniteUpdate where it would overflow."""
        total = self._vectors["gradient_sum"]
        if self._compiles(last):
            assert compiled is not None
            peak = float(compiled.adamw_sum(total, last.values, out, last.subtract, last.bound))
        else:
            with np.errstate(over="ignore", invalid="ignore"):  # an overflow is refused below
                (np.subtract if last.subtract else np.add)(total, last.values, out=out)
            peak = max_abs(out)
        if not math.isfinite(peak):
            raise NonFiniteUpdate("the gradient would make adamw's sum of the round overflow to infinity")
        return peak

    def _adamw_step(
        self, theta: np.ndarray, gradient: np.ndarray, last: _Last | None, divisor: int, learning_rate: float
    ) -> np.ndarray:
        """θ after one AdamW step on the mean (`gradient` ± `last`'s) / `divisor`, the moments it
        makes swapped in (or written in place); NonFiniteUpdate with nothing changed when any of
        them would not be finite."""
        c = self.coefficients(divisor, learning_rate, self._steps + 1)
        decay = np.float32(1 - learning_rate * self.weight_decay)
        moments = self._vectors["first_moment"], self._vectors["second_moment"]
        in_place = (
            last is not None
            and last.bound >= 0
            and step_in_place(
                self._sum_bound(), last.bound, self._moment_bounds(), self.peak_of(theta), c, float(decay)
            )
        )
        if in_place:
            first, second, updated = *moments, theta
        else:
            first, second = self._spare_of("first_moment"), self._spare_of("second_moment")
            updated = self.take_spare(theta)
        if self.kernel == "compiled":
            assert compiled is not None
            values, subtract, bound = (last.values, last.subtract, last.bound) if last else (_NONE, False, -1.0)
            ranges = (decay, self._decayed is None, self._decayed_bounds, bound)
            peaks = compiled.adamw_step(gradient, values, subtract, *moments, theta, first, second, updated, c, *ranges)
        else:  # the numpy step takes the round's whole sum (step_scaled adds the last gradient first)
            assert last is None
            peaks = numpy_step(gradient, moments, theta, (first, second, updated), c, decay, self._decayed)
        first_peak, second_peak, theta_peak = peaks
        if in_place:  # finite: the bound showed it
            self._moment_peaks = (first_peak, second_peak)
            self.remember_peak(theta, theta_peak)
            return theta
        if not (math.isfinite(first_peak) and math.isfinite(second_peak)):
            self.keep_spare(updated)
            raise NonFiniteUpdate("the gradient would make adamw's moments overflow to infinity")
        updated = self.checked(theta, updated, theta_peak)
        self._swap("first_moment", first)
        self._swap("second_moment", second)
        self._moment_peaks = (first_peak, second_peak)
        return updated

    def coefficients(self, divisor: int, learning_rate: float, steps: int) -> Coefficients:
        """The float32 scalars of AdamW step `steps` on a sum of `divisor` gradients."""
        return coefficients(divisor, learning_rate, steps, (self.beta1, self.beta2), self.epsilon)

    def _compiles(self, last: _Last) -> bool:
        return self.kernel == "compiled" and _flat_float32(last.values)

    def _sum_bound(self) -> float:
        if self._sum_peak is None:
            self._sum_peak = max_abs(self._vectors["gradient_sum"])
        return self._sum_peak

    def _moment_bounds(self) -> tuple[float, float]:
        if self._moment_peaks is None:
            self._moment_peaks = (max_abs(self._vectors["first_moment"]), max_abs(self._vectors["second_moment"]))
        return self._moment_peaks

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


@dataclasses.dataclass(frozen=True)
class _Last:
    """A round's newest commit: its values, whether they enter as -Δ, and their max |value| as the
    commit's checks measured it (-1: not known; the passes then write no state in place). The
    compiled passes read each value once within that bound: the values may lie in their client's
    shared memory, which it can still write (CommitRule.holds_payload)."""

    values: np.ndarray
    subtract: bool
    bound: float


_NONE = np.empty(0, np.float32)  # no gradient to add in the step's pass


def _bound(peak: float | None) -> float:
    return peak if peak is not None and math.isfinite(peak) else -1.0


def _flat_float32(values: np.ndarray) -> bool:
    return values.dtype == np.float32 and values.flags.c_contiguous
