"""The commit-rule interface: how a worker's commit moves the central variable.

A rule owns its hyperparameters (Flower's strategy style). Every rule takes the learning rate:
it turns a gradient g applied at central version v into the update Delta = -eta(v) * g, eta
following the config's learning-rate schedule (gemps_proto.schedules, which every rule takes as
`schedule`); an update commit is taken as Delta itself. A rule's own knobs are its `options`
(gemps_proto.rule_options.RuleOption: name, default, range, help), each a keyword-only
parameter of its constructor of the same name: `from_config` hands it the config's values
(TrainingConfig.rule_options) or the defaults, and refuses a value for an option it does not take.
Declaring one is all a new knob needs: the flags, the wire, checkpoints, Status and the info
metric take it from the declaration.

A commit of finite values can still overflow float32 (3e38 times pi_max): a rule refuses it
with NonFiniteUpdate and leaves theta and every worker's and its own state exactly as they were.
How the rules here make sure of that (in place when a bound allows, else out of place into
spare buffers) is overflow.py's, which a new rule may use or not.
"""

from __future__ import annotations

import inspect
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, ClassVar

import numpy as np

from gemps_proto.rule_options import RuleOption, option_problems
from gemps_proto.schedules import is_constant, schedule_factor
from gemps_proto.schema import ParameterSpec, PayloadKind, TrainingConfig
from gemps_proto.status import Rounds
from gemps_server.native import noise_window

#: eta's factor at a central version (eta(v) = learning_rate * schedule(v))
Schedule = Callable[[int], float]

# Commit statistics (pi's mean, median, clamped fractions; GEM's energies) come from an evenly
# strided sample of at most this many parameters: exact for smaller models, an estimate past it.
# Exact figures would cost reductions over all P on every commit, in the applier's critical path.
STATS_SAMPLE_SIZE = 8_192


def median(values: np.ndarray) -> float:
    """np.median's value (the mean of the two middle ones for an even count), by a partial sort:
    half np.median's time, which checks for NaN and handles axes the statistics do not need."""
    middle = values.size // 2
    if values.size % 2:
        return float(np.partition(values, middle)[middle])
    ordered = np.partition(values, (middle - 1, middle))
    return (float(ordered[middle - 1]) + float(ordered[middle])) / 2


def constant_schedule(version: int) -> float:
    """The constant schedule: eta = learning_rate at every version."""
    return 1.0


def sample_stride(size: int) -> int:
    """Stride of the statistics' sample: at most STATS_SAMPLE_SIZE of `size` parameters."""
    return max(1, -(-size // STATS_SAMPLE_SIZE))


@dataclass(frozen=True)
class ApplyStats:
    """How one commit was scaled (GEM's pi per parameter; a constant for the other rules).

    The energies are GEM's two sides of its compliance condition, averaged over parameters
    (NaN for rules without a proxy): `proxy_energy` = mean kappa*|m_i|, the target a single
    momentum-SGD worker sets; `central_energy` = mean (|theta - s_i| + pi*|Delta|), the central
    variable's movement over worker i's round trip: what the other workers moved it since i's
    last commit plus what this commit adds. GEM picks pi so the two are equal wherever pi is not
    clamped; central above proxy means the others already spent more than the proxy's energy.
    A rule that moves theta a round of commits at a time (adamw) says too: `pending`, the commits
    the round this commit joined still needs before theta moves (0 when this commit moved it, joined
    no round, or the rule moves theta at every commit), and `kept_theta`, theta as it was before.
    """

    scaling_mean: float
    scaling_median: float
    fraction_at_zero: float
    fraction_at_max: float
    proxy_energy: float = math.nan
    central_energy: float = math.nan
    pending: int = 0
    kept_theta: bool = False

    @classmethod
    def constant(cls, scale: float, scale_max: float = float("inf")) -> ApplyStats:
        return cls(scale, scale, float(scale == 0.0), float(scale >= scale_max))

    @classmethod
    def of(
        cls,
        scaling: np.ndarray,
        scale_max: float,
        proxy_energy: float = math.nan,
        central_energy: float = math.nan,
        delta: np.ndarray | None = None,
    ) -> ApplyStats:
        """Statistics of a per-parameter `scaling`; given the commit's `delta`, over the parameters
        it moves (delta != 0) alone, as the compiled passes count them: where delta = 0, GEM's pi
        reads 0 or pi_max and says nothing of the commit (a top-k payload's zeros)."""
        moving = None if delta is None else delta != 0
        count = scaling.size if moving is None else np.count_nonzero(moving)
        if count == 0:
            return cls.constant(0.0) if scaling.size == 0 else cls(0.0, 0.0, 0.0, 0.0, proxy_energy, central_energy)
        stride = sample_stride(scaling.size)
        if moving is None or count == scaling.size:  # a dense commit: no copies of pi (P values)
            moved, sample = scaling, scaling[::stride]
        else:
            moved, sample = scaling[moving], scaling[::stride][moving[::stride]]
        mean = float(moved.mean(dtype=np.float64))
        return cls(
            scaling_mean=mean,
            scaling_median=median(sample) if sample.size else mean,
            fraction_at_zero=np.count_nonzero(moved <= 0.0) / count,
            fraction_at_max=np.count_nonzero(moved >= scale_max) / count,
            proxy_energy=proxy_energy,
            central_energy=central_energy,
        )


@dataclass
class NoiseWindow:
    """One gradient commit's share of the noise scale's estimate (domain/noise.py): the window's
    running sum of gradients over the sampled parameters (float32; every `stride`-th run of them,
    native.noise_sample), how this commit moves it (native.WINDOW_*), and what was measured as the
    rule applied it: |g|^2 and |window sum after it|^2 over those parameters (NaN until then).
    `step` hands it to `applied` once the commit is applied and measured (not when refused)."""

    total: np.ndarray
    stride: int
    mode: int
    applied: Callable[[NoiseWindow], None]
    payload_square: float = math.nan
    window_square: float = math.nan

    def measure(self, payload: np.ndarray, bound: float = -1.0) -> None:
        """The sums in a pass of their own (for rules whose pass does not fold them in); `bound` >= 0:
        each value read within it, as a rule that `holds_payload` read it (native.noise_window)."""
        self.payload_square, self.window_square = noise_window(payload, self.total, self.stride, self.mode, bound)


@dataclass(frozen=True, slots=True)
class StepContext:
    """A commit's step besides θ and its payload: whose commit, computed `staleness` commits ago,
    applied at central version `version` (the one before it), a gradient or an update, and what
    the caller has ready for the rule: the payload's peak (max |payload|, where the wire measured
    it), `out` (a float32 array of P that receives the new θ too) and the noise scale's `window`.
    `out_if_moved`: `out` need receive θ only when the step moves it (a rule of rounds may keep θ):
    the reply then carries none, its client holding θ as it is. `live_workers`: for a rule that
    `counts_live_workers`, the registered workers that committed lately (CommitCore.live_workers);
    None where it is not counted."""

    worker_id: str
    staleness: int = 0
    version: int = 0
    kind: PayloadKind = PayloadKind.GRADIENT
    payload_peak: float | None = None
    out: np.ndarray | None = None
    window: NoiseWindow | None = None
    out_if_moved: bool = False
    live_workers: int | None = None


class NonFiniteUpdate(ValueError):
    """The commit would make the central variable or the rule's state NaN or infinite (finite
    inputs can overflow float32): the rule refused it and changed nothing."""


class CommitRule(ABC):
    """Applies worker commits to the central variable, one at a time, in FIFO order.

    The applier calls every method from one thread, never concurrently. `step`, the one way to
    apply a commit, returns the central variable after the commit's Delta as a new array, and
    takes the old one over (as a spare buffer, or as GEM's s_i): the caller drops it (and keeps
    the returned one, which may be the same array moved in place). A rule implements
    `step_scaled`, which `step` calls with the learning rate applied. The payload may be read-only (it aliases
    the request's bytes) and is never written.
    """

    name: ClassVar[str]
    #: the rule's own options, each a keyword-only constructor parameter of its name
    options: ClassVar[tuple[RuleOption, ...]] = ()
    #: float32 vectors of P parameters kept per registered worker (for memory accounting).
    vectors_per_worker: ClassVar[int] = 0
    #: whether the compiled commit core (csrc/core.c) runs this rule's commits itself: GEM's exact state
    native_step = False
    #: how this form keeps its workers' state, where the rule has several (GEM's `--gem-state`)
    state_form: ClassVar[str] = ""
    #: whether its steps need StepContext.live_workers (a group of commits as large as the live workers)
    counts_live_workers = False

    def __init__(self, num_parameters: int, *, learning_rate: float, schedule: Schedule = constant_schedule) -> None:
        self.num_parameters = num_parameters
        self.learning_rate = learning_rate
        self.schedule = schedule

    @classmethod
    def hyperparameters(cls) -> tuple[str, ...]:
        """What this rule takes of the training config: the learning rate, then its options."""
        return ("learning_rate", *(option.name for option in cls.options))

    @classmethod
    def undeclared_options(cls) -> list[str]:
        """Declared options that are no keyword-only parameter of the constructor (which must take
        each; the registry refuses a rule with any)."""
        parameters = inspect.signature(cls.__init__).parameters
        keyword = inspect.Parameter.KEYWORD_ONLY
        return [o.name for o in cls.options if o.name not in parameters or parameters[o.name].kind is not keyword]

    @classmethod
    def from_config(cls, config: TrainingConfig, num_parameters: int, **run_options: Any) -> CommitRule:
        """The rule with the learning rate and its schedule from `config`, and its options' values
        there (the defaults of those not set); ValueError naming an option of `config` it does not
        take or a value outside its range. `run_options` (how the server runs it: GEM's kernel) it
        does not take are ignored."""
        problems = option_problems(cls.name, cls.options, config.rule_options)
        if problems:
            raise ValueError("; ".join(problems))
        accepted = inspect.signature(cls.__init__).parameters
        chosen: dict[str, Any] = {o.name: o.kind(config.rule_options.get(o.name, o.default)) for o in cls.options}
        # The constant schedule as itself: the factor is asked on every commit (three calls fewer).
        chosen["schedule"] = constant_schedule if is_constant(config) else partial(schedule_factor, config)
        chosen.update({key: value for key, value in run_options.items() if key in accepted})
        return cls(num_parameters, learning_rate=config.learning_rate, **chosen)

    @classmethod
    def idle_options(cls, given: Mapping[str, float]) -> list[str]:
        """Why options among `given` (those the user set, each in range) would go unused by this
        rule as `given` configures it: the server refuses them at start-up (training_problems), so
        nothing set is silently ignored. None, the default: every option it takes is used."""
        return []

    @classmethod
    def form(cls, settings: Mapping[str, Any]) -> type[CommitRule]:
        """The class that runs this rule under the server's `settings` (its options by name: how a
        rule runs, not what it computes), for a rule of several forms; ValueError for a setting it
        reads that names none. The rule itself by default."""
        return cls

    @classmethod
    def run_options(cls, settings: Mapping[str, Any]) -> dict[str, Any]:
        """The constructor options this rule takes from the server's `settings`: none by default."""
        return {}

    def add_worker(self, worker_id: str, theta: np.ndarray) -> None:  # noqa: B027 (optional hook)
        """A worker registered while the central variable is `theta`."""

    def take_spec(self, spec: Sequence[ParameterSpec], bounds: tuple[int, int]) -> None:  # noqa: B027 (optional hook)
        """The model's parameters, and the values of them this θ holds (`bounds`: a partition's
        start and stop in the whole; (0, P) unpartitioned), once the server knows them."""

    def refusal(self, kind: PayloadKind) -> str | None:
        """Why this rule, as configured, takes no commit of `kind` (the server refuses it, nothing
        changed); None, the default: it takes both kinds."""
        return None

    def remove_worker(self, worker_id: str) -> None:  # noqa: B027 (optional hook)
        """A worker left or was evicted: free its state."""

    def round_takers(self, live_workers: int) -> frozenset[str]:
        """A rule of rounds: the workers waiting for the round open now whose next commit, on the
        θ they hold, it takes rather than others' (`live_workers` still committing, as
        StepContext.live_workers counts them). None, the default: θ moves at every commit."""
        return frozenset()

    def rounds(self) -> Rounds | None:
        """A rule of rounds: the rounds it closed and the open one's size and commits, for Status
        (read from the event loop: a figure stale by a commit is fine there). None, the default."""
        return None

    @classmethod
    def worker_state_bytes(cls, num_parameters: int) -> int:
        """Bytes of state one registered worker holds for a model of `num_parameters` (memory accounting)."""
        return cls.vectors_per_worker * 4 * num_parameters

    @property
    def shared_state_bytes(self) -> int:
        """Bytes of state the rule keeps for its registered workers together (besides each one's): none by default."""
        return 0

    def global_state(self, workers: bool = True) -> dict[str, np.ndarray]:
        """Copies of the rule's state shared by all workers; `workers` False: only what outlives the
        workers' registrations (a checkpoint's). None by default."""
        return {}

    def load_global_state(self, state: dict[str, np.ndarray]) -> None:
        """Restore what `global_state` returned (from a checkpoint); raises ValueError if it does not fit."""
        if state:
            raise ValueError(f"rule {self.name!r} keeps no global state, got {sorted(state)}")

    def worker_state(self, worker_id: str) -> dict[str, np.ndarray]:
        """Copies of the rule's state for one registered worker, by name (scalars as 0-d arrays),
        for a replica to take over; none by default."""
        return {}

    def load_worker_state(self, worker_id: str, state: dict[str, np.ndarray]) -> None:
        """Replace the state `add_worker` gave `worker_id` by what `worker_state` returned (on a
        replica); raises ValueError if it does not fit."""
        if state:
            raise ValueError(f"rule {self.name!r} keeps no per-worker state, got {sorted(state)}")

    def theta_bound(self, theta: np.ndarray) -> float | None:
        """The bound on max |theta| the rule keeps for `theta` (the array it returned last), which
        decides how its next pass runs; None when it keeps none (a replica copies it: theta_bound)."""
        return None

    def load_theta_bound(self, theta: np.ndarray, bound: float) -> None:  # noqa: B027 (optional hook)
        """Keep `bound` for `theta` as if the rule had returned it (what `theta_bound` gave on a replica)."""

    def learning_rate_at(self, version: int) -> float:
        """eta at central version `version`: learning_rate times the schedule's factor."""
        return self.learning_rate * self.schedule(version)

    def step(self, theta: np.ndarray, payload: np.ndarray, context: StepContext) -> tuple[np.ndarray, ApplyStats]:
        """theta after this commit (`context`: whose, how stale, at which version; a gradient g
        moves theta by -eta(version)*g), with how it was scaled: a new array, or `theta` moved in
        place when no value can overflow. The rule may keep `theta`: the caller uses only the array
        returned. Raises NonFiniteUpdate, with nothing changed, when theta or the rule's state would
        not be finite. `context.out`: as numpy's `out=`, a float32 array of P that receives the new
        theta; the rule's own array is still the one returned (the rule keeps it, and `out` may be
        memory another process reads). A rule that `writes_out` fills it as it computes theta, with
        no pass of its own; for the others this copies it (contents undefined after
        NonFiniteUpdate). `context.window`: the noise scale's sums to measure for this commit, in
        the rule's pass where it `folds_noise`, else in a pass of their own once the commit is
        applied; then handed back."""
        scale = -self.learning_rate_at(context.version) if context.kind is PayloadKind.GRADIENT else 1.0
        updated, stats = self.step_scaled(theta, payload, scale, context)
        if context.out is not None and not self.writes_out and not (stats.kept_theta and context.out_if_moved):
            np.copyto(context.out, updated)
        window = context.window
        if window is not None:
            if not self.folds_noise:  # a payload the rule held to its peak is measured so too
                peak = context.payload_peak
                window.measure(payload, peak if self.holds_payload and peak is not None and peak >= 0 else -1.0)
            window.applied(window)
        return updated, stats

    @property
    def writes_out(self) -> bool:
        """Whether step_scaled fills `out` itself as it computes theta (else `step` copies it there)."""
        return False

    @property
    def holds_payload(self) -> bool:
        """Whether step reads each payload value once and holds it within the `payload_peak` it is
        given (so a payload in memory its sender may still write can be passed as it is, with the
        peak measured on the way in): else the caller copies such a payload first."""
        return False

    @property
    def folds_noise(self) -> bool:
        """Whether step_scaled measures the noise `window` in the rule's own pass (else `step` does, after)."""
        return False

    @abstractmethod
    def step_scaled(
        self, theta: np.ndarray, update: np.ndarray, scale: float, context: StepContext
    ) -> tuple[np.ndarray, ApplyStats]:
        """`step`'s work with Delta = scale * update, the one method a rule implements
        (`context.payload_peak` is max |update|); `context.out` is for rules that `writes_out`,
        `context.window` for rules that `folds_noise` (the others leave them: `step` copies theta
        to `out` and measures the window)."""
