"""LocalSteps: the user's own torch optimizer for local steps, their update committed to gemps
(issue 59, item 1: an Adam-family path).

GEM's proxy is momentum SGD: a gradient committed every step is scaled as momentum SGD's step
would be, so models that need Adam (transformers) train poorly through RemoteOptimizer. Here the
worker keeps the optimizer the user wrote, AdamW with its betas, weight decay and parameter groups
exactly as nanoGPT's `configure_optimizers` builds them, and takes `steps` local steps with it;
then it commits their update, θ_local - θ_start (times `outer_learning_rate`), and loads the θ
the server returns: the server's rule is the outer optimizer (GEM energy-matches the update;
`--rule delayed-nesterov` is DiLoCo's outer Nesterov made asynchronous). The inner optimizer's
state (Adam's moments) carries over from window to window, as DiLoCo's inner optimizer's does.

    optimizer = torch.optim.AdamW(groups, lr=6e-4, betas=(0.9, 0.95), weight_decay=0.1)
    optimizer = LocalSteps(model, optimizer, "ps:50051")  # under --rule downpour: steps=1, look_ahead=1
    for inputs, targets in loader:                # the training loop does not change
        optimizer.zero_grad()
        loss = F.cross_entropy(model(inputs), targets)
        loss.backward()
        optimizer.step(loss=loss.detach())

The defaults are the SDK guide's recipe for the server's rule (window_recipe.py). For several
asynchronous AdamW workers: one local step a
window, each window started where θ is headed while the others commit (`look_ahead=1`:
gemps.pytorch.look_ahead); without the look-ahead their stale steps cost a transformer much of its
loss at equal samples, and longer windows lose more (docs/RESULTS.md, "Adam through asynchrony").
Under rounds of windows (`--rule adamw --outer-rate r`) windows of 8 steps from each round's θ, the
round's move as the optimizer's momentum, and with `planned_steps` β1's ramp. Across slow links
with GEM the recipe is another: `steps=8, look_ahead=0`, an outer
learning rate of 0.35 over Adam at 3e-3 (docs/guides/slow-links.md).

The inner learning rate is the user's: `param_groups` are the inner optimizer's, so a torch LR
scheduler on either moves it. `close()` (the `with` block's end) commits an unfinished window's
steps before leaving: no local work is dropped.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from gemps.client import Client
from gemps.pytorch.job_betas import JobBetas
from gemps.pytorch.look_ahead import LookAhead
from gemps.pytorch.noise_sums import DEFAULT_WINDOW, check_window, sums_of
from gemps.pytorch.remote import RemoteModel
from gemps.pytorch.round_momentum import set_from_move
from gemps.pytorch.values import copy_into
from gemps.pytorch.vector_pool import VectorPool
from gemps.pytorch.window_recipe import check_steps, recipe_ramp, round_momentum_wanted, window_steps
from gemps.records import CommitResult
from gemps_proto.rule_options import ROUND_SIZE

#: where LocalSteps.state_dict keeps the β1 ramp's progress beside the user's optimizer's state
RAMP_KEY = "gemps_beta1_ramp"


class LocalSteps(torch.optim.Optimizer):
    """`optimizer` (over `model`'s trained parameters) for `steps` local steps between commits."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        client: Client | str,
        *,
        steps: int | None = None,
        outer_learning_rate: float = 1.0,
        look_ahead: float = 1.0,
        job_betas: bool = False,
        round_momentum: bool | None = None,
        planned_steps: int | None = None,
        noise_window: int = DEFAULT_WINDOW,
        name: str = "",
        **options: Any,
    ) -> None:
        """What is left out is the SDK guide's recipe for the server's rule (window_recipe.py):
        `steps` None is 1 (a commit a step, the recipe for several asynchronous AdamW workers) or,
        under a server of rounds of windows (`--rule adamw --outer-rate r`), 8.
        `look_ahead`: start each window that share of θ's expected move ahead of the
        reply (gemps.pytorch.look_ahead; 0: at the reply; a worker alone is never ahead).
        Under a server of rounds (`--rule adamw`), where θ does not move while a round is open, no
        window looks ahead. `job_betas`: the optimizer's β1 spans the job's samples, not this
        worker's: raised to the power of the job's commits per this worker's
        (gemps.pytorch.job_betas; with look_ahead). `round_momentum`: under a server of rounds of
        windows (`--rule adamw --outer-rate r`), each round sets the optimizer's first moment from
        the round's move (gemps.pytorch.round_momentum). None (the default): wherever it applies
        (AdamW, or Adam without its L2 decay, under rounds of windows); True: refused, naming why,
        where it cannot; False: never. `planned_steps`: this worker's planned optimizer steps, under
        rounds of windows: β1 rises from the optimizer's to 0.95 over their first quarter, stepped
        with each step (gemps.pytorch.Beta1Ramp; refused where the server takes no windows).
        `noise_window`: local steps per window of the gradient sums sent for the server's noise
        scale (gemps.pytorch.noise_sums; 0: none sent; not measured in a process group).
        `options` as RemoteModel takes them (`threads=`, gemps.Client's when `client` is an address)."""
        if not isinstance(optimizer, torch.optim.Optimizer):
            kind = type(optimizer).__name__
            raise TypeError(f"LocalSteps takes a torch optimizer (torch.optim.AdamW(...)), not {kind}")
        check_steps(steps)  # before registering; None waits for the server's rule
        check_window(noise_window)
        if not (math.isfinite(outer_learning_rate) and outer_learning_rate > 0):
            raise ValueError(f"outer_learning_rate must be a number > 0, not {outer_learning_rate!r}")
        ahead = LookAhead(look_ahead)
        if not isinstance(job_betas, bool):
            raise TypeError(f"job_betas must be True or False, not {job_betas!r}")
        if options.get("overlap"):
            raise ValueError("overlap is for gradients committed every step (RemoteModel, RemoteOptimizer): "
                             "LocalSteps commits once a window, after its local steps")  # fmt: skip
        self.remote = RemoteModel(model, client, name=name, **options)
        try:
            _check_same_parameters(optimizer, self.remote.trained)
            config = self.remote.registration.config
            self.round_momentum = round_momentum_wanted(round_momentum, optimizer, config)
            self.ramp = recipe_ramp(planned_steps, optimizer, config)
        except (ValueError, TypeError):
            self.remote.close()  # refused: not left registered (nor counted among this machine's workers)
            raise
        self.optimizer = optimizer
        self.steps, self.outer_learning_rate = window_steps(steps, config), outer_learning_rate
        self.look_ahead = ahead
        self.job_betas = JobBetas(job_betas, optimizer.param_groups)
        super().__init__(self.remote.trained, defaults={})
        # The user's groups and state are this optimizer's: schedulers, state_dict and logging see them.
        self.param_groups = optimizer.param_groups
        self.state = optimizer.state
        self.defaults = optimizer.defaults
        # The window's start, the update and the replies, written again commit after commit (vector_pool.py).
        self._vectors = VectorPool()
        self._start = self.remote.parameters_vector()
        self._taken = 0  # local steps since the window's start
        self._noise = sums_of(self.remote, noise_window)
        if self._noise is not None:
            self._noise.start(self.remote.samples_seen or 0)
        self._losses: list[float] = []

    @property
    def last_result(self) -> CommitResult | None:
        """The last window's commit result (`remote.last_result`): its version, the staleness it met, π."""
        return self.remote.last_result

    @property
    def version(self) -> int:
        """Version of the central variable the window started from."""
        return self.remote.version

    def state_dict(self) -> dict[str, Any]:
        """The user's optimizer's (its moments, its groups' lr and betas as the user set them): what
        a checkpoint of it holds; with `planned_steps`, the β1 ramp's progress under RAMP_KEY too."""
        state = self.job_betas.users(self.optimizer.state_dict())
        if self.ramp is not None:
            state[RAMP_KEY] = self.ramp.state_dict()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Into the user's optimizer, whose groups and state stay this one's. torch's own would give
        this optimizer new groups apart from the user's: a scheduler would then move an lr nothing
        reads (accelerate loads a state dict into each optimizer it prepares: under Hugging Face's
        Trainer the linear schedule never reached AdamW), and a resumed Adam would start over.
        A saved β1 ramp resumes where it was; without `planned_steps` here, β1 stays as saved."""
        state_dict = dict(state_dict)
        ramp = state_dict.pop(RAMP_KEY, None)
        if ramp is not None and self.ramp is not None:
            self.ramp.load_state_dict(ramp)
        self.optimizer.load_state_dict(state_dict)
        self.param_groups, self.state = self.optimizer.param_groups, self.optimizer.state
        self.job_betas.rebind(self.optimizer.param_groups)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(  # type: ignore[override]
        self, closure: Callable[[], float | torch.Tensor] | None = None, *, loss: float | torch.Tensor | None = None
    ) -> float | torch.Tensor | None:
        """One local step of the inner optimizer (after `closure()` if given, which recomputes the
        loss); the window's update committed after its `steps`-th. `loss=` (or the closure's) goes
        to the server's metrics, averaged over the window."""
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._noise is not None:  # the gradients as the optimizer is about to read them
            self._noise.step()
        self.job_betas.before_step()  # over the β1 a scheduler wrote since the step before
        self.optimizer.step()
        if self.ramp is not None:
            self.ramp.step()
        if loss is not None:
            self._losses.append(float(loss.detach()) if isinstance(loss, torch.Tensor) else float(loss))
        self._taken += 1
        if self._taken >= self.steps:
            self.commit()
        return loss

    def commit(self) -> CommitResult | None:
        """Commit the local steps taken since the window started (none: nothing is sent), load
        the central variable the server returns, and start the next window from it."""
        if self._taken == 0:
            return None
        vectors = self._vectors
        update = self.remote.parameters_vector(out=vectors.take(self._start.numel())).sub_(self._start)  # in place
        if self.outer_learning_rate != 1.0:  # times 1.0 changes no bit: a pass over θ saved
            update.mul_(self.outer_learning_rate)
        loss = sum(self._losses) / len(self._losses) if self._losses else None
        taken, self._taken, self._losses = self._taken, 0, []
        sums = None if self._noise is None else self._noise.take(self.remote.samples_seen or 0)
        result = self.remote.commit_update(update, loss=loss, gradient_sums=sums)
        replied = self.remote.parameters_vector(out=update)  # the update's room: sent, read no more
        self.job_betas.after_commit(result.staleness)
        started, kept = self._start, self.look_ahead.kept
        # Under rounds θ stays where the reply left it until the round this worker's next window
        # joins has closed, the window's commit included: where θ is headed is the reply itself.
        if ROUND_SIZE in self.remote.registration.config.rule_options:
            if self.round_momentum:  # the round has closed: `replied` is its θ
                set_from_move(self.optimizer, self.remote.trained, started, replied, taken)
            self._start = replied
        else:
            self._start = self.look_ahead.start(replied, result.version, result.staleness, vectors)
        if started is not kept:  # the look-ahead's own goes back through it (or holds the new start)
            vectors.give(started)
        if self._start is not replied:
            with torch.no_grad():
                copy_into(self.remote.trained, self._start)
        return result

    def close(self) -> None:
        """Commit an unfinished window's steps, then leave the server."""
        try:
            self.commit()
        finally:
            self.remote.close()

    def __enter__(self) -> LocalSteps:
        return self

    def __exit__(self, *exc_info: object) -> None:
        if exc_info[0] is None:
            self.close()
        else:  # an error is leaving: leave (one attempt) without committing a window that may be half-done
            self.remote.__exit__(*exc_info)


def _check_same_parameters(optimizer: torch.optim.Optimizer, trained: list[torch.nn.Parameter]) -> None:
    """ValueError unless `optimizer` steps exactly the model's trained parameters (the central variable)."""
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    central = {id(p) for p in trained}
    if stepped - central:
        raise ValueError(
            f"the optimizer steps {len(stepped - central)} tensor(s) that are not trained parameters of the model "
            "(the central variable is the model's parameters that require grad): build it from model.parameters()"
        )
    if central - stepped:
        raise ValueError(
            f"{len(central - stepped)} trained parameter(s) of the model are in none of the optimizer's groups: "
            "they would never move locally; add them to a group, or set requires_grad=False to freeze them"
        )
