"""How a worker turns mini-batches into commits, each mode as its paper defines it.

- gradient: commit every mini-batch's gradient; the server applies -eta*g (and GEM's pi).
- agn (Accumulated Gradient Normalization; Hermans, Spanakis & Möckel 2017, arXiv:1710.02368,
  its AGN worker algorithm; dist-keras's ADAGWorker): from the central variable θ0 just received,
  take λ local steps to θλ, commit the normalised accumulated update (θλ - θ0)/λ and continue
  from the central variable the reply carries. The server adds it as given (rule downpour).
- dynsgd (Jiang et al., SIGMOD 2017, in the form the AGN paper compares against; dist-keras's
  DynSGDWorker): the same λ local steps, the accumulated update θλ - θ0 committed undivided; the
  server scales it by 1/(τ+1), τ its staleness (rule adaptive-staleness).
- dylu (dynamic local updates, DyLU; Liu, Douillard et al. 2024, arXiv:2401.09135, Eq. 6): the
  same window, committed undivided, of H_i = max(1, floor(v_i / v_max · H)) local steps, v the
  workers' speeds as the server's Status reports them (each one's samples a second over the last
  minute, from the num_samples its commits carry) and H the fastest worker's steps: slower workers
  commit after fewer steps, about as often as the fastest. With rule delayed-nesterov, DN+DyLU.
- easgd (asynchronous EASGD; Zhang, Choromanska & LeCun 2015, Algorithm 1): the worker keeps its
  own variable x. At local step t, with x the variable before the step: when τ divides t, read
  the centre x̃, commit e = alpha(x - x̃) (the server adds it: x̃ ← x̃ + e) and move x ← x - e; then
  x ← x - η g(x), the gradient taken at x before the elastic move. alpha = ηρ, the moving rate.

Local steps use plain SGD (the papers' algorithms), or Adam (the AGN paper's experiments), whose
state carries over from one window to the next as in dist-keras. Their learning rate follows the
server's schedule: scaled by the schedule's factor at the central version the worker last loaded
(gemps_proto.schedules), so they take eta(v) as the server would apply it.
"""

from __future__ import annotations

import collections
import enum
import math
import statistics
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import torch

from gemps.pytorch import RemoteModel
from gemps.pytorch.noise_sums import DEFAULT_WINDOW, sums_of
from gemps.records import CommitResult, GradientSums, ServerStatus
from gemps_proto.schedules import schedule_factor
from gemps_proto.schema import TrainingConfig


class WorkerMode(str, enum.Enum):
    """How a reference worker trains: its own option (`gemps worker --mode`), not the server's."""

    GRADIENT = "gradient"  # commit every mini-batch's gradient
    AGN = "agn"  # accumulated gradient normalization: lambda local steps, commit the mean update
    EASGD = "easgd"  # asynchronous elastic averaging: commit alpha * (x - theta) every period
    DYNSGD = "dynsgd"  # lambda local steps, commit the accumulated update (the server divides by staleness + 1)
    DYLU = "dylu"  # local steps in proportion to this worker's speed, commit the accumulated update


#: the modes by name
MODES = tuple(mode.value for mode in WorkerMode)
#: optimizers for local steps, and the learning rate each uses when none is given (None: the server's eta);
#: "momentum" is SGD with the server's μ (its rule's `momentum` option), its velocity kept across
#: windows (as GEM's proxy is momentum SGD's)
LOCAL_OPTIMIZERS: dict[str, float | None] = {"sgd": None, "momentum": None, "adam": 1e-3}

LossFunction = Callable[[], torch.Tensor]


class Diverged(RuntimeError):
    """The training loss became NaN or infinite: nothing sensible can be committed."""


@dataclass(frozen=True)
class Committed:
    result: CommitResult
    loss: float  # mean training loss over the mini-batches this commit covers
    local_steps: int = 1  # the mini-batches it covers (a window of local steps; dylu's vary)


@dataclass(frozen=True)
class LocalTraining:
    """How modes that train locally do it: their windows, EASGD's moving rate, the optimizer."""

    agn_steps: int = 4  # lambda
    dynsgd_steps: int = 10  # lambda
    easgd_alpha: float = 0.5
    easgd_period: int = 4  # tau
    optimizer: str = "sgd"
    learning_rate: float = 0.0  # 0: the optimizer's default (sgd: the server's eta)
    # agn, dynsgd and dylu: what the accumulated update θλ - θ0 is multiplied by before it is
    # committed (an outer learning rate, as DiLoCo's); 0: the mode's own (agn 1/λ, dynsgd and dylu 1).
    outer_learning_rate: float = 0.0
    dylu_steps: int = 10  # H: the fastest worker's local steps per commit


def server_momentum(config: TrainingConfig) -> float:
    """The server's mu (its rule's `momentum` option), for local steps of the momentum optimizer;
    ValueError when the rule has none."""
    if "momentum" not in config.rule_options:
        raise ValueError(
            f"local optimizer 'momentum' takes the server's mu, and rule {config.rule!r} has none: "
            "run the server with a rule that takes --momentum, or choose another --local-optimizer"
        )
    return config.rule_options["momentum"]


class TrainingMode(ABC):
    sends_updates = True  # its commits are updates: it measures the noise scale's sums itself

    def __init__(self, remote: RemoteModel, learning_rate: float, optimizer: str = "sgd") -> None:
        if optimizer not in LOCAL_OPTIMIZERS:
            raise ValueError(f"unknown local optimizer {optimizer!r}; choose from {', '.join(LOCAL_OPTIMIZERS)}")
        self.remote = remote
        self.learning_rate = learning_rate  # at factor 1 of the server's schedule
        # Plain SGD is written out in _local_step: constructing any torch.optim optimizer first
        # imports torch._dynamo (1.2 s here), long enough for a short lease to expire before a
        # new worker's first commit.
        self.adam = torch.optim.Adam(remote.trained, lr=learning_rate) if optimizer == "adam" else None
        self.momentum = server_momentum(remote.registration.config) if optimizer == "momentum" else 0.0
        self._velocity: dict[int, torch.Tensor] = {}  # by parameter index, for "momentum"
        # The noise scale's sums of the local steps' gradients, sent with update commits (the
        # server cannot measure an update): the samples they trained on, counted as they go.
        self._noise = sums_of(remote, DEFAULT_WINDOW) if self.sends_updates else None
        self._trained_samples = 0

    def _measured(self, batch_size: int) -> None:
        """This local step's gradients (just computed) into the noise scale's window."""
        if self._noise is not None:
            self._noise.step()
        self._trained_samples += batch_size

    def _sums(self) -> list[GradientSums] | None:
        """The noise scale's sums for the update commit about to go: once a window is full."""
        return None if self._noise is None else self._noise.take(self._trained_samples)

    def local_learning_rate(self) -> float:
        """eta for a local step: the learning rate scaled by the server's schedule at the central
        version last loaded."""
        return self.learning_rate * schedule_factor(self.remote.registration.config, self.remote.version)

    @abstractmethod
    def on_batch(self, loss_of_batch: LossFunction, batch_size: int) -> Committed | None:
        """Train on one mini-batch; return what was committed, if this batch ended a commit."""

    def finish(self) -> Committed | None:
        """Training ends: what a commit still in flight did (overlap), once applied; else None."""
        return None

    def _backward(self, loss_of_batch: LossFunction) -> float:
        self.remote.zero_grad()
        loss = loss_of_batch()
        value = float(loss.detach())
        if not math.isfinite(value):
            raise Diverged(f"training loss is {value}")
        loss.backward()  # type: ignore[no-untyped-call]
        return value

    @torch.no_grad()
    def _local_step(self) -> None:
        """One step of the local optimizer with the gradients just computed."""
        eta = self.local_learning_rate()
        if self.adam is None:
            for index, p in enumerate(self.remote.trained):
                if p.grad is None:
                    continue
                step = p.grad
                if self.momentum:  # v <- mu v + g; p <- p - eta v
                    step = self._velocity.setdefault(index, torch.zeros_like(p)).mul_(self.momentum).add_(p.grad)
                p.add_(step, alpha=-eta)
            return
        for group in self.adam.param_groups:
            group["lr"] = eta
        self.adam.step()


class GradientMode(TrainingMode):
    sends_updates = False  # gradients: the server measures them
    _in_flight_loss = 0.0  # with overlap: the loss of the commit in flight

    def on_batch(self, loss_of_batch: LossFunction, batch_size: int) -> Committed | None:
        loss = self._backward(loss_of_batch)
        result = self.remote.step(loss=loss, num_samples=batch_size)
        if not self.remote.overlap:
            assert result is not None
            return Committed(result, loss)
        # with overlap the result is the commit before's (none at the first step), and so its loss
        previous, self._in_flight_loss = self._in_flight_loss, loss
        return None if result is None else Committed(result, previous)

    def finish(self) -> Committed | None:
        result = self.remote.flush()
        return None if result is None else Committed(result, self._in_flight_loss)


class AccumulatedMode(TrainingMode):
    """λ local steps from the central variable, then commit (θλ - θ0) x `outer` and continue from
    the central variable the reply carries: AGN (outer 1/λ) and DynSGD (outer 1); GEM with local
    steps is either with an outer learning rate of the user's (GEM(aΔ) = a GEM(Δ): a scales what
    GEM makes of the update)."""

    name = "accumulated"

    def __init__(
        self, remote: RemoteModel, learning_rate: float, local_steps: int, outer: float, optimizer: str = "sgd"
    ) -> None:
        super().__init__(remote, learning_rate, optimizer)
        if local_steps < 1:
            raise ValueError(f"{self.name} needs at least one local step")
        if not (math.isfinite(outer) and outer > 0):
            raise ValueError(f"{self.name}'s outer learning rate must be a number > 0, not {outer}")
        self.local_steps = local_steps
        self.outer = outer
        self._start: torch.Tensor | None = None
        self._losses: list[float] = []
        self._samples = 0  # trained on in this window (its commit's num_samples)

    def on_batch(self, loss_of_batch: LossFunction, batch_size: int) -> Committed | None:
        if self._start is None:
            self._start = self.remote.parameters_vector()
        self._losses.append(self._backward(loss_of_batch))
        self._samples += batch_size
        self._measured(batch_size)
        self._local_step()
        if len(self._losses) < self.local_steps:
            return None
        update = (self.remote.parameters_vector() - self._start) * self.outer
        steps, loss = len(self._losses), sum(self._losses) / len(self._losses)
        samples, self._start, self._losses, self._samples = self._samples, None, [], 0
        sent = time.monotonic()
        result = self.remote.commit_update(update, loss=loss, num_samples=samples, gradient_sums=self._sums())
        self.committed(result, time.monotonic() - sent)
        return Committed(result, loss, steps)

    def committed(self, result: CommitResult, seconds: float) -> None:
        """A window's update was applied, its commit taking `seconds` (the model holds the central
        variable of `result`)."""


class AgnMode(AccumulatedMode):
    name = "agn"

    def __init__(
        self, remote: RemoteModel, learning_rate: float, local_steps: int, optimizer: str = "sgd", outer: float = 0.0
    ) -> None:
        super().__init__(remote, learning_rate, local_steps, outer or 1 / max(local_steps, 1), optimizer)


class DynSgdMode(AccumulatedMode):
    name = "dynsgd"

    def __init__(
        self, remote: RemoteModel, learning_rate: float, local_steps: int, optimizer: str = "sgd", outer: float = 0.0
    ) -> None:
        super().__init__(remote, learning_rate, local_steps, outer or 1.0, optimizer)


def worker_speeds(status: ServerStatus, round_trip: float = 0.0) -> dict[int, float]:
    """Each registered worker's speed by its shard, for those whose commits in Status's last minute
    reported samples: its samples over the seconds it spent training, the span less `round_trip`
    seconds for each commit (the asking worker's own, taken to be everyone's). Without that a worker
    of few local steps, whose commits' round trips take a larger share of its time, would read
    slower still and take fewer steps again, down to one, when each step is short beside a commit."""
    speeds = {}
    for worker in status.workers:
        recent = worker.recent
        training = recent.seconds - recent.commits * round_trip
        if recent.samples > 0 and training > 0:
            speeds[worker.shard] = recent.samples / training
    return speeds


def dynamic_local_steps(most: int, speed: float, fastest: float) -> int:
    """DyLU's H_i = floor(v_i / v_max · H), at least one step (a commit needs one)."""
    return max(1, min(most, math.floor(speed / fastest * most)))


class DyluMode(AccumulatedMode):
    """Local steps per commit set after each commit from this worker's speed relative to the
    fastest's (dynamic_local_steps), as the server's Status reports them (worker_speeds, less the
    round trips of commits); the accumulated update committed times `outer` (1 by default: the
    server's rule, delayed-nesterov, holds the outer learning rate). Until Status reports this
    worker's speed (before its first commit) it takes H."""

    name = "dylu"

    def __init__(
        self, remote: RemoteModel, learning_rate: float, local_steps: int, optimizer: str = "sgd", outer: float = 0.0
    ) -> None:
        super().__init__(remote, learning_rate, local_steps, outer or 1.0, optimizer)
        self.most_steps = local_steps  # H
        self._round_trips: collections.deque[float] = collections.deque(maxlen=16)  # commit and Status, seconds

    def committed(self, result: CommitResult, seconds: float) -> None:
        asked = time.monotonic()
        status = self.remote.client.status()
        self._round_trips.append(seconds + time.monotonic() - asked)
        speeds = worker_speeds(status, statistics.fmean(self._round_trips))
        own = speeds.get(self.remote.registration.shard.index)
        if own is not None:  # else not measured yet: the steps stay as they were
            self.local_steps = dynamic_local_steps(self.most_steps, own, max(speeds.values()))


class EasgdMode(TrainingMode):
    def __init__(
        self, remote: RemoteModel, learning_rate: float, alpha: float, period: int, optimizer: str = "sgd"
    ) -> None:
        super().__init__(remote, learning_rate, optimizer)
        if not 0 < alpha <= 1 or period < 1:
            raise ValueError("easgd needs 0 < alpha <= 1 and period >= 1")
        self.alpha = alpha
        self.period = period
        self._step = 0  # t: local steps taken
        self._losses: list[float] = []
        self._result: CommitResult | None = None  # the newest commit's, reported with the window's losses

    def on_batch(self, loss_of_batch: LossFunction, batch_size: int) -> Committed | None:
        loss = self._backward(loss_of_batch)  # g(x), at x before any elastic move
        self._losses.append(loss)
        if self._step % self.period == 0:  # the window's sums: of the steps before this one's
            sums = self._sums()
            central = torch.from_numpy(self.remote.client.pull().flat.copy())
            local = self.remote.parameters_vector()
            elastic = self.alpha * (local - central)
            self._result = self.remote.commit_update(elastic, loss=loss, load=False, gradient_sums=sums)
            with torch.no_grad():  # x <- x - e: the local variable is pulled toward the centre
                device = next(self.remote.model.parameters()).device
                torch.nn.utils.vector_to_parameters((local - elastic).to(device), self.remote.trained)
        self._measured(batch_size)
        self._local_step()  # x <- x - eta g(x)
        self._step += 1
        if self._step % self.period != 0 or self._result is None:
            return None
        # A window of τ local steps ends: report it, with the commit that opened it.
        losses, self._losses = self._losses, []
        return Committed(self._result, sum(losses) / len(losses), len(losses))


def create_mode(name: str, remote: RemoteModel, learning_rate: float, local: LocalTraining) -> TrainingMode:
    """The worker mode `name`; `learning_rate` is the server's eta (the default for sgd local steps)."""
    if name == WorkerMode.GRADIENT:
        return GradientMode(remote, learning_rate)
    if local.optimizer not in LOCAL_OPTIMIZERS:
        raise ValueError(f"unknown local optimizer {local.optimizer!r}; choose from {', '.join(LOCAL_OPTIMIZERS)}")
    default = LOCAL_OPTIMIZERS[local.optimizer]
    local_rate = local.learning_rate or (learning_rate if default is None else default)
    if name == WorkerMode.AGN:
        return AgnMode(remote, local_rate, local.agn_steps, local.optimizer, local.outer_learning_rate)
    if name == WorkerMode.DYNSGD:
        return DynSgdMode(remote, local_rate, local.dynsgd_steps, local.optimizer, local.outer_learning_rate)
    if name == WorkerMode.DYLU:
        return DyluMode(remote, local_rate, local.dylu_steps, local.optimizer, local.outer_learning_rate)
    if name == WorkerMode.EASGD:
        return EasgdMode(remote, local_rate, local.easgd_alpha, local.easgd_period, local.optimizer)
    raise ValueError(f"unknown worker mode {name!r}; choose from {', '.join(MODES)}")
