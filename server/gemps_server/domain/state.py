"""The central variable, its version, the commit rule and the registered workers: the domain.

Every mutating method here runs on the applier thread, one call at a time, in arrival order
(see applier.py); the event loop only reads `snapshot`, which is replaced atomically.
Every check on a request (validation.py) happens before anything is mutated, so a rejected
request never touches the central variable. Nothing here knows about gRPC or protobuf
messages: the wire turns requests into the records (records.py) and outcomes back into replies.
A commit is the commit core's (core.py), which holds θ and what moves it; this holds the rest:
registrations, departures, replay, and what images install. Its images, for checkpoints and
replicas, are taken and installed by images.py.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence

import numpy as np

from gemps_proto.jobs import new_job
from gemps_proto.reasons import Reason
from gemps_proto.schedules import learning_rate_at
from gemps_proto.schema import Buffers, ParameterSpec, TrainingConfig
from gemps_proto.status import RestoredCheckpoint, Rounds
from gemps_proto.tensor_codec import FLOAT32, EncodedBuffers, EncodedTensor
from gemps_server.domain import validation
from gemps_server.domain.core import CommitCore
from gemps_server.domain.errors import FailedPrecondition, Unavailable
from gemps_server.domain.journal import Committed, Departed, Entry, Joined
from gemps_server.domain.noise import NOISE_WINDOW_AUTO, NoiseEstimator
from gemps_server.domain.records import (
    ALL_OF_THETA,
    Admitted,
    Held,
    PartitionOf,
    RegistrationOutcome,
)
from gemps_server.domain.room import capacity, check_room, out_of_memory
from gemps_server.domain.rules import CommitRule, RuleRuntime
from gemps_server.domain.worker_copies import WorkerCopies
from gemps_server.domain.workers import LEASE_EXPIRED, SERVER_FULL, SUPERSEDED, WorkerRecord, WorkerRegistry
from gemps_server.memory_budget import MemoryBudget

# How long the worker told to initialise the central variable has to send its values, while
# the others registering without values are asked to retry: n workers starting at once then
# upload one copy of θ, not n.
INITIALIZER_GRACE_SECONDS = 30.0


class ServerState:
    def __init__(
        self,
        training: TrainingConfig,
        registry: WorkerRegistry,
        rule_runtime: RuleRuntime = RuleRuntime.DEFAULT,
        partition: PartitionOf = ALL_OF_THETA,
        max_parameters: int | None = None,
        noise_window: int = NOISE_WINDOW_AUTO,
        memory: MemoryBudget | None = None,
        compiled_core: bool = True,
    ) -> None:
        self._training = training
        # What the workers' rule state may take (memory_budget.py); no bound unless given.
        self.memory = memory if memory is not None else MemoryBudget(probe=lambda: None)
        self.partition = partition
        self.max_parameters = max_parameters  # None: no limit (ServerConfig.max_parameters)
        self.bounds = (0, 0)  # [start, stop) of θ held here, once initialised
        self.rule_runtime = rule_runtime
        self.new_rule(0)  # fail fast on an unknown rule name or kernel
        self.rule_name = training.rule
        self.registry = registry
        self.spec: tuple[ParameterSpec, ...] = ()
        # Versions count in this process's history: a restarted server may reach the same number
        # with other values (commits lost since its checkpoint), so "unchanged" needs both.
        self.history = uuid.uuid4().hex
        self.job = ""  # the job whose θ this is, fixed when θ is initialised (gemps_proto.jobs)
        self.restored: RestoredCheckpoint | None = None  # the checkpoint restored at start: Status says it
        self._initializer_until = 0.0  # monotonic deadline of the worker asked for initial values
        self._initializer = ""  # its client id ("" when it sent none)
        # θ and what moves it: every commit goes through the core (core.py).
        noise = NoiseEstimator(noise_window, training.batch_size)
        self.core = CommitCore(registry, noise, self._new_copies(), compiled=compiled_core)

    # -- what the state computes from the core (what the core holds is read there: state.core) ---

    @property
    def learning_rate(self) -> float:
        """eta at the current version: what the next gradient commit is scaled by."""
        return learning_rate_at(self._training, self.core.version)

    @property
    def worker_state_bytes(self) -> int:
        """Bytes of rule state one registered worker holds (GEM: m_i and s_i; 0 for the others)."""
        return 0 if self.core.rule is None else self.core.rule.worker_state_bytes(self.core.num_parameters)

    @property
    def rule_state_bytes(self) -> int:
        """Bytes of rule state the registered workers hold (read by Status and metrics, off the applier)."""
        return self.worker_state_bytes * len(self.registry)

    @property
    def shared_rule_state_bytes(self) -> int:
        """Bytes the rule keeps for its workers together (compact GEM's references), outside the budget."""
        return 0 if self.core.rule is None else self.core.rule.shared_state_bytes

    @property
    def gem_state(self) -> str:
        """How the rule's form keeps its workers' state (GEM's --gem-state), else ""."""
        return self.rule_runtime.form(self.rule_name).state_form

    def rounds(self) -> Rounds | None:
        """A rule of rounds' progress (CommitRule.rounds), for Status and the metrics; else None."""
        return None if self.core.rule is None else self.core.rule.rounds()

    def theta_bound(self) -> float | None:
        """The rule's bound on max |θ| (CommitRule.theta_bound: kept for θ itself, not a copy)."""
        return None if self.core.rule is None else self.core.rule.theta_bound(self.core.theta)

    # -- operations run by the applier --------------------------------------------------------

    def register(
        self,
        worker_name: str,
        spec: Sequence[ParameterSpec],
        initial: EncodedTensor | None,
        encode_theta: bool = True,
        buffer_spec: Sequence[ParameterSpec] = (),
        initial_buffers: EncodedBuffers | None = None,
        client_id: str = "",
        job: str = "",
    ) -> RegistrationOutcome:
        """Admit a worker; `encode_theta` False when its reply will not carry θ (it pulls θ apart).
        The first worker's `initial_buffers` become the central buffers. A client holds one
        registration: `client_id`'s previous one, if any, is replaced (a retried Register whose
        reply was lost leaves no orphan holding rule state), its commit receipts carried over.
        `job`: the client's job, if it knows one: refused where θ is another job's (before the spec
        is compared: another job's model is no mismatch of this one's)."""
        validation.check_name("worker_name", worker_name)
        validation.check_client_id(client_id)
        validation.check_job(job)
        validation.check_same_job(self.job, job)
        validation.check_spec(spec, buffer_spec)
        first = self.core.rule is None
        # The worker that initialised theta already holds it: no P-sized encoding for its reply.
        initialized = first and initial is not None
        # Everything a registration allocates (θ for the first, its reply's encoding, the worker's
        # rule state) is allocated before the worker enters the registry; a refusal or a
        # MemoryError on the way leaves the state as it found it: no worker holding a shard
        # without its rule state, no θ without the worker that set it.
        try:
            if first:
                self._initialize(spec, initial, buffer_spec, initial_buffers, client_id, job)
            else:
                validation.check_same_spec((self.spec, self.core.buffer_spec), (spec, buffer_spec))
            encoded = encode_theta and not initialized
            snapshot = self.core.encoded(FLOAT32) if encoded else self.core.with_buffers(self.core.snapshot)
            admitted = self._admit(worker_name, client_id, budgeted=True)
        except MemoryError:
            refusal = out_of_memory(self.worker_state_bytes)  # named before a first θ is forgotten
            self._undo(first)
            raise refusal from None
        except BaseException:
            self._undo(first)
            raise
        first_values = (initial, initial_buffers) if first else (None, None)
        worker, displaced = admitted.worker, admitted.displaced
        displaced_id = displaced.worker_id if displaced is not None else ""
        joined = Joined(
            worker.worker_id, worker_name, client_id, spec, buffer_spec, *first_values, displaced_id,
            self.job if first else "",
        )  # fmt: skip
        self.core.journal.append(joined)
        self.core.check_round()
        return RegistrationOutcome(worker, snapshot, initialized, displaced, admitted.because, admitted.shared_name)

    def leave(self, worker_id: str) -> WorkerRecord:
        worker = self.registry.get(worker_id)
        self._forget(worker_id)
        self.core.journal.append(Departed((worker_id,)))
        self.core.check_round()
        return worker

    def evict_expired(self) -> list[tuple[WorkerRecord, str]]:
        """Forget the workers the registry finds gone (their lease out, or superseded), each with why."""
        registry = self.registry
        gone = dict.fromkeys(registry.superseded(), SUPERSEDED) | dict.fromkeys(registry.expired(), LEASE_EXPIRED)
        evicted = []
        for worker_id, reason in gone.items():
            worker = registry.get(worker_id)
            evicted.append((worker, reason))
            if reason == SUPERSEDED:
                registry.shared_names.superseded(worker.client_id, worker.name)
            self._forget(worker_id)
        if evicted:
            self.core.journal.append(Departed(tuple(worker.worker_id for worker, _ in evicted)))
            self.core.check_round()
        return evicted

    def replay(self, entry: Entry) -> None:
        """Apply a primary's journal entry (on a backup, in the primary's order): the same
        operation through the same code, with what the primary decided (worker ids, evictions)
        taken from the entry instead of decided again."""
        if isinstance(entry, Committed):
            self.core.replay(entry.commit)
            return
        if isinstance(entry, Departed):
            for worker_id in entry.worker_ids:
                self._forget(worker_id)
        else:
            if self.core.rule is None:
                if entry.initial is None:
                    raise ValueError(f"journal: worker {entry.worker_id} joined before θ was initialised")
                self._initialize(
                    entry.spec, entry.initial, entry.buffer_spec, entry.initial_buffers, entry.client_id, entry.job
                )
            self._admit(entry.name, entry.client_id, entry.worker_id, entry.displaced)
        self.core.check_round()  # as the primary did after the join or departure: a promoted backup names the takers

    def install(self, held: Held) -> None:
        """Hold `held` from now on, all of it at once (on the applier: images.py restores and
        adopts through this); no encoding of the θ replaced is served, no initializer is awaited."""
        core = self.core
        core.rule, core.theta, self.spec, core.buffer_spec = held.rule, held.theta, held.spec, held.buffer_spec
        if held.rule is not None:
            held.rule.take_spec(held.spec, held.bounds)
        core.buffers, core.version, core.commits_applied = held.buffers, held.version, held.commits_applied
        self.bounds, core.ledger, core.noise, self.history = held.bounds, held.ledger, held.noise, held.history
        self.job = held.job
        core.forget_snapshot()
        self._initializer_until, self._initializer = 0.0, ""
        core.copies = self._new_copies()  # copies of the θ replaced are no worker's: their next replies are whole
        if held.rule is not None and self.memory.bytes is None:  # restored or adopted θ: its budget now
            self.memory.settle(4 * held.theta.size, self.worker_state_bytes, self.registry.max_workers)

    def new_rule(self, num_parameters: int) -> CommitRule:
        """A fresh rule of this server's training config and kernel, for `num_parameters` values."""
        return self.rule_runtime.create(self._training, num_parameters)

    def _new_copies(self) -> WorkerCopies:
        return WorkerCopies(self.memory, lambda: self.rule_state_bytes)  # within the rule state's budget

    def new_noise(self) -> NoiseEstimator:
        """A fresh noise estimate with this server's window and batch size."""
        return NoiseEstimator(self.core.noise.option, self._training.batch_size)

    # -- checks, readable from the event loop ------------------------------------------------

    def require_initialized(self) -> CommitRule:
        return self.core.require_rule()

    def expected_payload_bytes(self, dtype: int, shape: tuple[int, ...]) -> int:
        """Bytes a payload of this dtype and shape must have; InvalidArgument unless it is flat [P]."""
        self.require_initialized()
        return validation.expected_payload_bytes(dtype, shape, self.core.num_parameters)

    # -- helpers -------------------------------------------------------------------------------

    def _admit(
        self,
        name: str,
        client_id: str,
        worker_id: str = "",
        displaced_id: str | None = None,
        budgeted: bool = False,
    ) -> Admitted:
        """Add a worker (a new id unless `worker_id` is given), replacing its client's previous
        registration, and a silent worker of its name (its process's dead registration:
        WorkerRegistry.silent_namesake), else the idlest when the registry (or, when `budgeted`, the
        memory budget) is full, unless `displaced_id` says which one the primary displaced ("" none).
        Its rule state is allocated first: a refusal or a MemoryError leaves every worker as it was
        (a replica replays unbudgeted: the primary decided)."""
        rule = self.core.rule
        assert rule is not None
        registry = self.registry
        previous = registry.of_client(client_id)
        leaving = [previous.worker_id] if previous is not None else []
        most = registry.max_workers
        room = capacity(most, self.memory, self.worker_state_bytes) if budgeted else most
        shared_name, namesake, because = "", None, ""
        if displaced_id is None:
            full = len(registry) - len(leaving) >= room
            shared_name = registry.shared_names.returned(client_id)  # before its namesakes are timed
            displaced = namesake = registry.silent_namesake(name, excluding=leaving)  # its dead self, restarted
            because = SUPERSEDED
            if displaced is None and full:
                displaced, because = registry.idlest(excluding=leaving), SERVER_FULL
        else:  # a replica replaying its primary's choice, which the primary logged
            displaced = registry.get(displaced_id) if displaced_id else None
        leaving += [displaced.worker_id] if displaced is not None else []
        if budgeted:
            check_room(len(registry) - len(leaving), most, self.memory, self.worker_state_bytes)
        worker_id = worker_id or uuid.uuid4().hex
        rule.add_worker(worker_id, self.core.theta)  # may raise MemoryError: nothing else changed yet
        try:
            for gone in leaving:
                self._forget(gone)
            worker = registry.add(name, client_id, worker_id=worker_id)
        except BaseException:
            rule.remove_worker(worker_id)
            raise
        if namesake is not None:
            registry.shared_names.superseded(namesake.client_id, namesake.name)
        self.core.copies.fit()  # the workers' state comes first: reply copies that no longer fit go
        self.core.ledger.activate(worker.scope)
        return Admitted(worker, displaced, because if displaced is not None else "", shared_name)

    def _undo(self, first: bool) -> None:
        """Forget θ again after the first registration failed part-way: nothing else was held before it."""
        if first:  # as _initialize found it (the initializer's grace period untouched)
            self.core.rule, self.spec, self.core.buffer_spec, self.bounds, self.job = None, (), (), (0, 0), ""
            self.core.theta, self.core.buffers = np.empty(0, dtype=np.float32), Buffers()
            self.core.forget_snapshot()  # no encoding of that θ is served

    def _forget(self, worker_id: str) -> None:
        worker = self.registry.remove(worker_id)
        if worker is not None:
            self.core.ledger.depart(worker.scope)
        if self.core.rule is not None:
            self.core.rule.remove_worker(worker_id)
        self.core.copies.forget(worker_id)

    def release_initializer(self) -> None:
        """End the grace period of the worker asked for initial values (its upload broke off). A
        single float store, so safe from the event loop: at worst one more worker waits a retry."""
        self._initializer_until = 0.0

    def _initialize(
        self,
        spec: Sequence[ParameterSpec],
        initial: EncodedTensor | None,
        buffer_spec: Sequence[ParameterSpec] = (),
        initial_buffers: EncodedBuffers | None = None,
        client_id: str = "",
        job: str = "",
    ) -> None:
        """θ from the first worker's `initial` values, for `job` (a new job unless it names one)."""
        if initial is None:
            now = time.monotonic()
            # The client asked for the values is asked again (its upload may never have reached
            # us: told to wait for itself, it would give up); the others wait for it.
            asked_again = bool(client_id) and client_id == self._initializer
            if now < self._initializer_until and not asked_again:
                raise Unavailable(
                    "the central variable is being initialised by another worker; retry shortly",
                    Reason.INITIALIZING,
                )
            self._initializer_until, self._initializer = now + INITIALIZER_GRACE_SECONDS, client_id
            raise FailedPrecondition(
                "central variable not initialised: the first worker to register must send initial_parameters "
                f"(this one: the others are asked to retry for {INITIALIZER_GRACE_SECONDS:.0f} s)",
                Reason.NOT_INITIALIZED,
            )
        validation.check_size(spec, buffer_spec, self.partition, self.max_parameters)
        values = validation.initial_values(spec, initial, self.partition)
        buffers = validation.initial_buffers(buffer_spec, initial_buffers, self.partition)
        start, stop = self.partition.bounds(sum(s.size for s in spec))
        self.spec = tuple(spec)
        core = self.core
        core.buffer_spec = tuple(buffer_spec)
        core.buffers = buffers
        core.theta = values.copy()
        core.rule = self.new_rule(core.theta.size)
        core.rule.take_spec(self.spec, (start, stop))
        self.bounds = (start, stop)
        self.job = job or new_job()
        core.version = 0
        self.memory.settle(4 * core.theta.size, self.worker_state_bytes, self.registry.max_workers)
