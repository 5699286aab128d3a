"""RemoteModel: a torch model kept on the central variable (what travels, and how: the package's
docstring, gemps.pytorch), and load_central. RemoteOptimizer, its torch.optim face: optimizer.py."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

from gemps.client import Client
from gemps.errors import GempsError, PartiallyAppliedError
from gemps.pytorch.batches import BatchCounter, warn_window_without_loss, warn_without_loss
from gemps.pytorch.groups import AUTO as GROUP_AUTO
from gemps.pytorch.groups import GroupLeaderError, GroupWorker, Outcome, process_group_of
from gemps.pytorch.overlap import InFlight, InFlightCommitError, Staging, copies_done
from gemps.pytorch.refusals import check_weight_decay, refuse_weight_decay_twice
from gemps.pytorch.threads import AUTO, ThreadKeeper, Threads, requested
from gemps.pytorch.values import (
    buffer_values,
    check_trainable,
    copy_into,
    gather_gradients,
    gather_values,
    host_array,
    host_tensor,
    load_buffers,
    persistent_buffers,
    trained_parameters,
    wire_dtype,
)
from gemps.pytorch.wrappers import unwrapped
from gemps.records import Buffers, CentralVariable, CommitResult, GradientSums, Registration, TrainingConfig

log = logging.getLogger("gemps.pytorch")

Called = tuple[Outcome | None, BaseException | None]  # what the leader's call made: outcome, failure


@torch.no_grad()
def load_central(model: torch.nn.Module, central: CentralVariable) -> None:
    """Copy a central variable (its parameters and buffers) into `model`, in place on the model's
    devices and in its dtypes."""
    model = unwrapped(model)
    copy_into([p for _, p in trained_parameters(model)], host_tensor(central.flat))
    load_buffers(persistent_buffers(model), central)


class RemoteModel:
    """Binds a torch model to a gemps server: registers it and keeps it on the central variable."""

    def __init__(
        self,
        model: torch.nn.Module,
        client: Client | str,
        *,
        name: str = "",
        threads: Threads = AUTO,
        process_group: object = GROUP_AUTO,
        weight_decay: float = 0.0,
        overlap: bool = False,
        **client_options: Any,
    ) -> None:
        """`threads` sets torch's intra-op threads so that the workers on this machine do not
        oversubscribe it (gemps.pytorch.threads: "auto", a number, or None to leave them);
        `process_group` whose ranks are one gemps worker (gemps.pytorch.groups: "auto", the DDP
        wrapper's group or the initialised default one; a ProcessGroup; None: this process alone);
        `weight_decay` λ adds λ·θ to each trained parameter's gradient before `step` commits it
        (torch.optim.SGD's weight_decay, on the worker: the server applies none, and its η, schedule
        and GEM's π scale it with the gradient; refused under a rule that applies AdamW's own, adamw);
        `overlap` keeps one commit in flight while the next step computes (gemps.pytorch.overlap:
        `step()` then returns the result of the commit before, None at the first, and `flush()`
        waits for the last);
        `client_options` go to gemps.Client when `client` is an address (wire_dtype="bfloat16", ...)."""
        self.model = model
        self.weight_decay = check_weight_decay(weight_decay)
        inner = unwrapped(model)  # named without torch.compile's or DDP's prefixes (gemps.pytorch.wrappers)
        named = trained_parameters(inner)
        self._parameters = [p for _, p in named]
        if not self._parameters:
            raise ValueError("the model has no parameters to train (none requires grad)")
        check_trainable(named)
        wanted = requested(threads)  # a bad `threads` refused before anything is bound
        self._buffers = persistent_buffers(inner)
        group = process_group_of(model, process_group)
        self._group = None if group is None else GroupWorker(group)
        self._client: Client | None = None  # the group's other ranks have none: its leader talks for them
        if self._group is None or self._group.leads:
            self._client = Client(client, name=name, **client_options) if isinstance(client, str) else client
        self._owns_client = isinstance(client, str)
        size = sum(p.numel() for p in self._parameters)
        # Staging between torch and the wire, reused every step: pinned when a parameter lives on
        # a GPU, so that copies to and from it are asynchronous DMA.
        self._gpus = sorted({p.device for p in self._parameters if p.device.type == "cuda"}, key=str)
        self._grad = torch.zeros(size, dtype=torch.float32, pin_memory=bool(self._gpus))
        self._central = torch.zeros(size, dtype=torch.float32, pin_memory=True) if self._gpus else None
        self._loads_done: list[torch.cuda.Event] = []  # the last load's copies out of `_central`
        self._loaded_buffers = Buffers()  # the buffers as last loaded or sent
        self._threads = ThreadKeeper(wanted)
        self._batches = BatchCounter(model)  # the wrapper's forward: the one the user calls
        self._version = 0
        self._registered: Registration | None = None  # as the server last registered this worker
        # With overlap: the commit in flight (on the leader), and on every rank whether one is
        self.overlap = overlap
        self._in_flight: InFlight[Called] | None = InFlight() if overlap else None
        self._staging = Staging(self._grad) if overlap else None
        self._launched = False
        self._steps = 0  # step() calls so far: an overlapped commit's error names its step
        self._flying: tuple[int, int] = (0, 0)  # the step whose commit is in flight, its base version
        # The last commit's result, of gradients or of an update (its version, staleness, π): None before one
        self.last_result: CommitResult | None = None
        try:
            self._exchange(
                lambda: self.client.register(
                    {n: host_array(p) for n, p in named}, {n: host_array(b, wire_dtype(b)) for n, b in self._buffers}
                ),
                load=True,
            )
            assert self._registered is not None
            refuse_weight_decay_twice(self._registered.config, self.weight_decay)
        except BaseException:
            self._unbind()
            raise
        assert self._registered is not None
        self.registration: Registration = self._registered

    @property
    def client(self) -> Client:
        """The gemps Client this model commits through (on the leader of a process group only)."""
        if self._client is None:
            assert self._group is not None
            raise GroupLeaderError(
                f"rank {self._group.rank} does not talk to the gemps server: its process group is one gemps "
                "worker, whose group rank 0 has the client"
            )
        return self._client

    @property
    def version(self) -> int:
        """Version of the central variable the model holds."""
        return self._version

    @property
    def config(self) -> TrainingConfig:
        """The server's training config as it last registered this worker (a restarted server may
        run another), on every rank of a process group."""
        assert self._registered is not None
        return self._registered.config

    @property
    def trained(self) -> list[torch.nn.Parameter]:
        """The parameters that make up the central variable, in its order."""
        return self._parameters

    def zero_grad(self) -> None:
        """Clear the model's gradients (set to None), as `torch.optim.Optimizer.zero_grad` does."""
        self.model.zero_grad(set_to_none=True)

    def step(self, loss: float | torch.Tensor | None = None, num_samples: int | None = None) -> CommitResult | None:
        """Commit the model's current gradients; load the central variable the server returns; its
        result. With `overlap`: send them once the commit in flight was loaded, and return that
        one's result (None at the first step).

        Without `num_samples`, the samples of the model's training forwards since the last step
        (gemps.pytorch.batches); without `loss`, the mean loss those forwards returned (a Hugging Face
        model's `output.loss`), or when they returned none a WARNING once that the server's loss
        metrics stay empty."""
        self._steps += 1
        seen, returned = self._batches.take(), self._batches.take_loss()
        if self._group is not None:  # the group's gradient is every rank's batches'
            seen = self._group.samples(seen)
        num_samples = seen if num_samples is None else num_samples
        loss = returned if loss is None else loss  # a Hugging Face model's output.loss, say
        if loss is None and self._client is not None:
            warn_without_loss()
        self._threads.check()
        loss_value = float(loss.detach()) if isinstance(loss, torch.Tensor) else loss
        if self._staging is not None:
            return self._overlapped(self._staging.next(), loss_value, num_samples)

        def commit() -> CommitResult:
            gather_gradients(self._parameters, self._grad)
            if self.weight_decay:  # torch.optim.SGD's: g + λ·θ, θ as the model holds it
                self._grad.add_(self.parameters_vector(), alpha=self.weight_decay)
            for gpu in self._gpus:  # the gradients' copies into pinned memory are done before it is sent
                torch.cuda.synchronize(gpu)
            return self.client.commit(
                self._grad.numpy(), loss=loss_value, num_samples=num_samples, buffer_delta=self._buffer_delta()
            )

        result = self._exchange(commit, load=True).result
        assert isinstance(result, CommitResult)
        return result

    def _overlapped(self, grad: torch.Tensor, loss: float | None, num_samples: int | None) -> CommitResult | None:
        """This step's commit sent on the commit thread once the one in flight was loaded; the
        result of that one (None: there was none). When that one failed, this step's gradients
        are sent all the same and its error (InFlightCommitError) says so."""
        delta: Buffers | None = None
        ready = copies_done([])
        if self._client is not None:  # what this step sends, taken before the reply's θ and buffers load
            gather_gradients(self._parameters, grad)
            if self.weight_decay:
                grad.add_(self.parameters_vector(), alpha=self.weight_decay)
            delta = self._buffer_delta()
            ready = copies_done(self._gpus)
        base = self._version  # the θ these gradients were computed at, one reply older than the next

        def commit() -> CommitResult:
            ready()  # the gradients' copies into pinned memory, on the commit thread
            return self.client.commit(
                grad.numpy(), loss=loss, num_samples=num_samples, base_version=base, buffer_delta=delta
            )

        try:
            previous = self._take_in_flight(sent=(self._steps, base))
        except InFlightCommitError:
            self._launch(commit, base)  # gathered, their buffers' change counted sent: not lost with the failure
            raise
        except Exception as error:  # local (the devices, the process group), not the commit's: nothing is sent
            error.add_note(f"gemps: step {self._steps}'s gradients (overlap) were not sent")
            raise
        self._launch(commit, base)
        return previous

    def _launch(self, commit: Callable[[], CommitResult], base: int) -> None:
        """`commit` on the commit thread (the leader's; every rank counts it in flight)."""
        if self._in_flight is not None and self._client is not None:
            self._in_flight.submit(lambda: self._called(commit))
        self._launched, self._flying = True, (self._steps, base)

    @property
    def in_flight(self) -> bool:
        """Whether a commit is in flight (overlap): sent, its reply not loaded yet."""
        return self._launched

    def flush(self) -> CommitResult | None:
        """Wait for the commit in flight (overlap) and load the central variable its reply carries;
        its result, or None when none is in flight. Its error, if it failed, is raised here (an
        InFlightCommitError naming its step)."""
        return self._take_in_flight(sent=None)

    def _take_in_flight(self, sent: tuple[int, int] | None) -> CommitResult | None:
        """flush(); `sent`: the step (and its base version) whose gradients will be sent after
        it, which a failure's error names."""
        if not self._launched:
            return None
        self._launched = False
        taken = self._in_flight.take() if self._in_flight is not None and self._client is not None else None
        outcome, failure = taken if taken is not None else (None, None)
        try:
            result = self._settled(outcome, failure, load=True).result
        except GempsError as error:  # the commit's own (on other ranks: the leader's, as GroupLeaderError)
            raise InFlightCommitError.of(error, *self._flying, sent) from error
        assert isinstance(result, CommitResult)
        return result

    def commit_update(
        self,
        update: torch.Tensor,
        loss: float | None = None,
        *,
        load: bool = True,
        num_samples: int | None = None,
        gradient_sums: Sequence[GradientSums] | None = None,
    ) -> CommitResult:
        """Commit a flat update (applied as given, e.g. accumulated local steps).

        With `load` (the default) the model then holds the returned central variable; without,
        the model keeps its own values (elastic averaging keeps a local variable). `num_samples`:
        the samples the update was trained on, for the server's metrics and Status; without it,
        those of the model's training forwards since the last commit. `loss`: without it, the mean
        of the losses those forwards returned (a Hugging Face model's `output.loss`: under the
        Trainer, which calls `step()` without one); with neither, one WARNING per process.
        `gradient_sums`: the noise scale's, one per partition (Client.commit; gemps.pytorch.noise_sums).
        """
        seen = self._batches.take()
        returned = self._batches.take_loss()
        loss = returned if loss is None else loss  # the caller's first: LocalSteps averages step(loss=)
        if loss is None and self._client is not None:  # a group's other ranks send nothing
            warn_window_without_loss()
        if self._group is not None:
            seen = self._group.samples(seen)
        num_samples = seen if num_samples is None else num_samples
        update_values = host_array(update).reshape(-1)
        result = self._exchange(
            lambda: self.client.commit(
                update_values,
                kind="update",
                loss=loss,
                num_samples=num_samples,
                buffer_delta=self._buffer_delta(),
                gradient_sums=gradient_sums,
            ),
            load=load,
        ).result
        assert isinstance(result, CommitResult)
        return result

    @property
    def samples_seen(self) -> int | None:
        """Samples the model's training forwards saw since it was wrapped; None in a process group
        (its gradient is every rank's batches')."""
        return self._batches.counted if self._group is None else None

    def parameters_vector(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """The model's parameters as one flat float32 CPU vector, in spec order: a copy, the caller's
        to change (written into `out`, float32 on the CPU with P values, when given)."""
        if out is None:
            out = torch.empty(sum(p.numel() for p in self._parameters), dtype=torch.float32)
        return gather_values(self._parameters, out)

    def pull(self) -> int:
        """Load the newest central variable into the model; returns its version."""
        self._exchange(lambda: self.client.pull(), load=True)
        return self.version

    def close(self) -> None:
        """Wait for a commit in flight, leave the server (and close the connection if this helper
        opened it); the commit's error, if it failed, is raised once the rest is done."""
        self._close(on_error=False)

    def _close(self, *, on_error: bool) -> None:
        """Flush, leave and close. `on_error`: the block ends on an error, which a failure here does
        not replace, and the leave is one attempt (Client.__exit__), not the patience's retries."""
        failure: BaseException | None = None
        try:
            self.flush()
        except Exception as error:  # raised below, once the worker has left
            failure = error
        if self._in_flight is not None:
            self._in_flight.close()
        try:
            if self._client is None:
                pass  # a process group's other rank: its leader leaves for the group
            elif self._owns_client and on_error:
                self._client.close()  # one attempt to leave (Client.__exit__ on an error)
            elif self._owns_client:
                self._client.__exit__(None, None, None)
            elif not on_error:  # on an error, the user's own client leaves as its own block says
                self._client.leave()
        finally:
            self._batches.close()
            self._threads.close()
        if failure is not None and not on_error:
            raise failure
        if failure is not None:  # not raised over the error leaving the block, but not kept silent either
            log.warning("the commit in flight failed as the block was left on an error: %s", failure)

    def _unbind(self) -> None:
        """Undo what binding did, when registering failed or what it replied was refused: a client
        opened here is closed (it leaves), the user's own leaves if it registered here (one attempt:
        its lease ends it otherwise) and stays theirs."""
        self._batches.close()
        self._threads.close()
        if self._client is None:
            return
        if self._owns_client:
            self._client.close()
        elif self._registered is not None:
            with contextlib.suppress(Exception):  # the refusal being raised is what the user needs
                self._client.leave()

    def __enter__(self) -> RemoteModel:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._close(on_error=exc_info[0] is not None)

    def _buffer_delta(self) -> Buffers | None:
        """How the buffers changed since last loaded or sent; None when they did not (or there are none)."""
        if not self._buffers:
            return None
        current, loaded = buffer_values(self._buffers), self._loaded_buffers
        delta = Buffers(current.floats - loaded.floats, current.integers - loaded.integers)
        self._loaded_buffers = current  # sent: not to be counted again if the reply is not loaded
        return delta if delta.floats.any() or delta.integers.any() else None

    def _exchange(self, call: Callable[[], Any], *, load: bool) -> Outcome:
        """`call` to the server on this process (the leader of its group), what it replied shared with
        the group's other ranks (which do not call), and loaded into the model on every rank when
        `load`; a failure raised on every rank, after loading what a partly applied commit left.
        A commit in flight (overlap) is waited for first."""
        self.flush()
        return self._settled(*self._called(call), load=load)

    def _called(self, call: Callable[[], Any]) -> Called:
        """`call` on the leader: its outcome and failure (caught, to be raised by `_settled`)."""
        if self._client is None:
            return None, None
        try:
            returned = call()
            central = self._client.central  # registered: what the server holds
            if isinstance(returned, CommitResult | CentralVariable):
                central = returned.parameters if isinstance(returned, CommitResult) else returned
            return Outcome(self._client.registration, central, returned), None
        except PartiallyAppliedError as partial:  # what the partitions that applied it replied
            return Outcome(self._client.registration, partial.central, error=str(partial)), partial
        except BaseException as error:
            return Outcome(self._client.registration, error=f"{type(error).__name__}: {error}"), error

    def _settled(self, outcome: Outcome | None, failure: BaseException | None, *, load: bool) -> Outcome:
        if self._group is not None:
            outcome = self._group.share(outcome)
        assert outcome is not None
        self._registered = outcome.registration or self._registered
        if outcome.central is not None and load:
            self._load(outcome.central)
        if failure is not None:
            raise failure
        if outcome.error:
            raise GroupLeaderError(f"the gemps worker's leader (group rank 0) failed: {outcome.error}")
        if isinstance(outcome.result, CommitResult):
            self.last_result = outcome.result
        return outcome

    @torch.no_grad()
    def _load(self, central: CentralVariable) -> None:
        """θ and the buffers into the model, in place (parameters keep their device, storage and
        dtype). On a GPU through the pinned staging vector, whose previous copies must be done
        before it is written again."""
        if self._central is None:
            copy_into(self._parameters, host_tensor(central.flat))  # CPU: straight from the reply
        else:
            for done in self._loads_done:
                done.synchronize()
            self._central.numpy()[:] = central.flat
            copy_into(self._parameters, self._central)
            self._loads_done = [torch.cuda.Event() for _ in self._gpus]  # type: ignore[no-untyped-call]
            for gpu, done in zip(self._gpus, self._loads_done, strict=True):
                done.record(torch.cuda.current_stream(gpu))
        if self._buffers:
            load_buffers(self._buffers, central)  # listed once: state_dict() per step is not free
            self._loaded_buffers = buffer_values(self._buffers)
        self._version = central.version
