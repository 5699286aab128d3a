"""The commit core: one commit, from its fields to θ moved and the reply written, in one room.

Every commit reaches θ through `CommitCore.commit`, whichever way it came: a gRPC request, a
data-plane frame, or a primary's journal entry replayed on a backup (ServerState.replay). It
takes primitive fields (the worker's slot and id, the request id and sequence, the base version,
the kind, the payload, the reply's dtype and where θ goes) and does, in the protocol's order and
before anything changes: the checks (validation.py), the ledger (a retry answered as the original
was, a late attempt refused), the staleness; then the rule's step, the buffers, the version, the
worker's lease and counts, the ledger's receipt and the journal entry. A refusal (a ServiceError)
leaves everything as it was. `commit_and_reply` adds the reply, written while θ still holds the
commit's version: the one operation the applier runs per commit (DESIGN §1, §3).

The core holds what a commit changes: θ, its version, the rule, the buffers, the ledger, the
journal, the noise estimate and the reply copies. ServerState (state.py) holds the rest of the
domain (registrations, images) and installs what the core serves. Everything here runs on the
applier thread, one call at a time; the event loop only reads `snapshot`, replaced atomically.
"""

from __future__ import annotations

import dataclasses
import weakref

import numpy as np

from gemps_proto.gradient_sums import GradientSums
from gemps_proto.reasons import Reason
from gemps_proto.reply_differences import DIFFERENCE_DTYPES, WHOLE_DTYPE
from gemps_proto.schema import Buffers, ParameterSpec, PayloadKind
from gemps_proto.tensor_codec import CODE_DTYPES, FLOAT32, EncodedBuffers, EncodedTensor, encode, wire_view
from gemps_server.domain import validation
from gemps_server.domain.errors import Aborted, FailedPrecondition, InvalidArgument
from gemps_server.domain.journal import Committed, Journal, NoJournal
from gemps_server.domain.ledger import CommitLedger, Receipt
from gemps_server.domain.noise import NoiseEstimator
from gemps_server.domain.records import Commit, CommitOutcome, R, ReplyWriter, Snapshot
from gemps_server.domain.rules import ApplyStats, CommitRule, NonFiniteUpdate, StepContext
from gemps_server.domain.worker_copies import WorkerCopies
from gemps_server.domain.workers import WorkerRegistry
from gemps_server.native import copy_max_abs, native_commit, setup_core

# What the compiled core (csrc/core.c) makes and passes, defined here in Python.
setup_core(ApplyStats, Receipt, PayloadKind.GRADIENT)


class CommitCore:
    """θ and what moves it: the state every commit reads and writes, and the commit itself."""

    def __init__(
        self, registry: WorkerRegistry, noise: NoiseEstimator, copies: WorkerCopies, *, compiled: bool = True
    ) -> None:
        # The compiled commit core (csrc/core.c) where it was built and is not turned off
        # (--commit-core python: this module alone, the reference it is tested against).
        self.compiled = native_commit if compiled else None
        self.registry = registry
        self.noise = noise  # the gradient noise scale (noise.py)
        self.copies = copies  # what difference-reply workers hold of θ (worker_copies.py)
        self.rule: CommitRule | None = None  # None until θ is initialised
        self.theta = np.empty(0, dtype=np.float32)
        self.version = 0
        self.commits_applied = 0
        self.buffers = Buffers()  # replaced, never changed in place
        self.buffer_spec: tuple[ParameterSpec, ...] = ()  # their names and kinds, in the buffers' order
        self.ledger = CommitLedger(capacity=registry.max_workers)
        self._journal: Journal = NoJournal()
        self._recording = False  # a commit's entry is built only for a journal that records it
        self._latest: weakref.ref[Snapshot] = weakref.ref(Snapshot(0))  # dead at once: see `snapshot`
        # The versions, first to last, that held one θ: commits a rule of rounds took without moving it.
        self._unmoved = (0, -1)
        # The workers whose next commit the open round takes, and the version they were found at.
        self._takers: tuple[int, frozenset[str]] = (-1, frozenset())
        # Where a payload its client can still write is copied before it is read (_landed).
        self._landing = np.empty(0, dtype=np.float32)
        # Where a coded payload (int8, int4, top-k) is decoded: P float32 values each commit, which at
        # 100M parameters were 400 MB of fresh pages to fault in (the rule reads them, keeps none).
        self._decoded = np.empty(0, dtype=np.float32)

    @property
    def journal(self) -> Journal:
        """Where every change is recorded for the replicas (journal.py); none without replicas."""
        return self._journal

    @journal.setter
    def journal(self, journal: Journal) -> None:
        self._journal, self._recording = journal, not isinstance(journal, NoJournal)

    @property
    def recording(self) -> bool:
        """Whether a journal records the commits (the compiled core journals them too)."""
        return self._recording

    # -- reads ---------------------------------------------------------------------------------

    @property
    def initialized(self) -> bool:
        """Whether θ is initialised (a rule holds it)."""
        return self.rule is not None

    @property
    def num_parameters(self) -> int:
        """P: the values of θ held here (0 until it is initialised)."""
        return self.theta.size

    def theta_copy(self) -> np.ndarray:
        """A copy of θ now, the caller's own (θ itself changes with the next commit)."""
        return self.theta.copy()

    @property
    def snapshot(self) -> Snapshot:
        """The current version's snapshot: the one replies are still sending, if any is (so its
        encodings are shared), else a new one without encodings."""
        snapshot = self._latest()
        if snapshot is None or snapshot.version != self.version:
            snapshot = Snapshot(self.version)
            self._latest = weakref.ref(snapshot)
        return snapshot

    def forget_snapshot(self) -> None:
        """No encoding of the θ held until now is served any more (θ was replaced)."""
        self._latest = weakref.ref(Snapshot(0))  # dead at once
        self._unmoved, self._takers = (0, -1), (-1, frozenset())

    def same_theta(self, known_version: int, version: int) -> bool:
        """Whether θ at `known_version` is θ at `version`, the current one: the same version, or
        both within the commits a rule of rounds took since θ last moved (a pull then carries no θ)."""
        first, last = self._unmoved  # one read: the applier replaces the pair, never changes it
        return known_version == version or (last == version and first <= known_version <= version)

    def require_rule(self) -> CommitRule:
        if self.rule is None:
            raise FailedPrecondition(
                "central variable not initialised: no worker has registered yet", Reason.NOT_INITIALIZED
            )
        return self.rule

    def theta_bytes(self, dtype: int) -> bytes | memoryview:
        """θ's bytes in protocol dtype `dtype` now: the snapshot's encoding when there is one, else for float32
        a view of θ itself, valid only until the next operation changes it (use it on the applier,
        within the operation that asked: to frame a reply straight from θ, with no copy of its own)."""
        return self.snapshot.data(dtype) or wire_view(self.theta, dtype)

    def encoded(self, dtype: int) -> Snapshot:
        """The current snapshot, with `dtype`'s encoding produced if it is not there yet."""
        snapshot = self.with_buffers(self.snapshot)
        if snapshot.data(dtype) is None:
            snapshot.store(dtype, encode(self.theta, dtype))
        return snapshot

    def with_buffers(self, snapshot: Snapshot) -> Snapshot:
        """`snapshot` with this version's buffers (on the applier: they change with commits)."""
        if snapshot.buffers is None:
            snapshot.buffers = self.buffers
        return snapshot

    # -- the commit ----------------------------------------------------------------------------

    def commit(
        self,
        slot: int,
        worker_id: str,
        request_id: str,
        sequence: int,
        base_version: int,
        kind: int,
        payload: EncodedTensor,
        reply_dtype: int,
        out: np.ndarray | None = None,
        *,
        loss: float | None = None,
        num_samples: int | None = None,
        buffer_delta: EncodedBuffers | None = None,
        payload_peak: float | None = None,
        payload_volatile: bool = False,
        base_held: bool = False,
        gradient_sums: GradientSums | None = None,
    ) -> CommitOutcome:
        """Apply one commit of the worker registered in `slot` as `worker_id` (DESIGN §1): θ moves
        by the rule's step and the version goes up by one, or a refusal (a ServiceError) leaves
        everything as it was. A retry of a commit already applied changes nothing and answers as
        the original did. `out` (float32, P), as numpy's: it receives θ after the commit too (see
        CommitRule.step). `payload_peak`: max |payload| (NaN: not finite) where the wire measured it.
        `payload_volatile`: the payload lies in memory its client can still write (_landed).
        `base_held`: its client holds θ of `base_version` (Commit.base_held): when θ after the
        commit is still that θ, the outcome says `unchanged` and `out` is left as it was.
        `gradient_sums`: an update commit's worker-measured noise sums (Commit.gradient_sums)."""
        rule = self.require_rule()
        validation.check_reply_dtype(reply_dtype, commit=True)
        validation.check_request_id(request_id)
        worker = self.registry.in_slot(slot, worker_id)
        # By the worker's client, not by request id alone: two clients may count their ids alike.
        # A retry from a client that registered again (lease expiry, server restart) is found too.
        receipt = self.ledger.lookup(worker.scope, request_id)
        if receipt is not None:
            self.registry.touch(worker_id, committed=True)
            if out is not None:  # the rule does not run: θ is copied as it is
                np.copyto(out, self.theta)
            # Answered once everything journalled so far is replicated: the original may not be yet.
            whole = reply_dtype not in DIFFERENCE_DTYPES  # else its reply encodes what it sends
            snapshot = self.encoded(reply_dtype) if whole else self.with_buffers(self.snapshot)
            last, epoch = self.journal.last, self.journal.epoch
            return CommitOutcome(snapshot, receipt.staleness, receipt.stats, duplicate=True, position=last, epoch=epoch)
        applied = self.ledger.superseded(worker.scope, sequence)
        if applied is not None:  # an old attempt, delivered after later commits of its client
            raise Aborted(
                f"commit {sequence} of this client arrived after its commit {applied} was applied: "
                "a late attempt, refused; nothing changed",
                Reason.SUPERSEDED,
            )
        if payload_volatile:
            payload, payload_peak = self._landed(rule, payload)
        room = None
        if payload.dtype in CODE_DTYPES:
            if self._decoded.size != self.theta.size:
                self._decoded = np.empty(self.theta.size, dtype=np.float32)
            room = self._decoded
        kind_of, values, peak = validation.validated_payload(
            kind, payload, base_version, self.theta.size, self.version, payload_peak, room
        )
        refusal = rule.refusal(kind_of)
        if refusal is not None:
            raise FailedPrecondition(f"commit refused, nothing changed: {refusal}", Reason.BAD_KIND)
        buffers = validation.buffers_after(self.buffers, buffer_delta, self.buffer_spec)  # checked before θ moves
        validation.check_gradient_sums(kind_of, gradient_sums)
        staleness = self.version - base_version
        window = self.noise.window(kind_of, self.theta.size, len(self.registry), num_samples)
        # θ now is the θ its client holds: if the rule keeps it, the reply need not carry it.
        held = base_held and reply_dtype not in DIFFERENCE_DTYPES and self.same_theta(base_version, self.version)
        try:  # the rule writes into spare buffers and swaps them in only if every value is finite
            live = self.live_workers(worker.scope) if rule.counts_live_workers else None
            context = StepContext(worker_id, staleness, self.version, kind_of, peak, out, window, held, live)
            self.theta, stats = rule.step(self.theta, values, context)
        except NonFiniteUpdate as error:
            raise InvalidArgument(f"commit refused, nothing changed: {error}", Reason.NON_FINITE) from None
        self.buffers = buffers
        self.commits_applied += 1
        self.registry.committed(worker, staleness, loss, num_samples, stats)  # lease, counts, rate, pi
        if gradient_sums is not None:
            self.noise.reported(gradient_sums)
        self.version += 1  # its snapshot is encoded when a reply asks (encoded(), theta_bytes())
        if stats.kept_theta:  # θ did not move: this version holds the previous one's θ
            first, last = self._unmoved
            self._unmoved = (first if last == self.version - 1 else self.version - 1, self.version)
        self.ledger.record(worker.scope, request_id, Receipt(self.version, staleness, stats, sequence))
        if stats.kept_theta:  # a round took it, or dropped it
            self.check_round()
        position = 0
        if self._recording:
            commit = Commit(
                worker_id, base_version, kind, payload, request_id, sequence, reply_dtype, loss, num_samples,
                buffer_delta, payload_peak, payload_owned=payload_volatile,  # landed, into its own buffer
                gradient_sums=gradient_sums,
            )  # fmt: skip
            position = self.journalled(commit)
        return self.applied_outcome(staleness, stats, position, unchanged=held and stats.kept_theta)

    def live_workers(self, committing: str) -> int:
        """The registered workers still committing: the scope `committing` now, those not committed
        since they registered, and those whose last commit produced one of the last 2N versions (N
        the workers registered; in rounds every live worker commits once a round). One that died
        without leaving (SIGKILL, a lost node) stays registered for its lease: a round sized by the
        workers then no longer waits for it after 2N commits (DESIGN §1, `adamw`). One registered
        again (after a restart, whose checkpoint kept its client's last receipt) counts until its
        first commit here. From the registry and the ledger alone, which a backup replays and
        adopts as they are: the same count on every replica."""
        window = 2 * len(self.registry)
        return sum(
            1
            for worker in self.registry.records()
            if not worker.commits
            or (scope := worker.scope) == committing
            or (last := self.ledger.last_version(scope)) is None
            or self.version - last < window
        )

    def round_takers(self) -> frozenset[str]:
        """The workers whose next commit the round open now takes rather than others', as
        `check_round` found them, θ unmoved since: a pull's unchanged reply tells each
        (PullResponse.round_takes_next), and the service answers the held pulls."""
        at, takers = self._takers  # one read: the applier replaces the pair
        return takers if takers and self.same_theta(at, self.version) else frozenset()

    def check_round(self) -> None:
        """Once workers joined or left, and after each commit that kept θ (on the applier): which
        workers waiting for θ to move the round open now takes the next commit of
        (CommitRule.round_takers: workers left after the others committed to it, or it needs more
        than one gradient of each worker still committing); `round_takers` until θ moves."""
        takers = self.rule.round_takers(self.live_workers("")) if self.rule is not None else frozenset()
        self._takers = (self.version, takers)

    def journalled(self, commit: Commit) -> int:
        """Record applied `commit` in the journal (the compiled core's commits too): its position."""
        return self.journal.append(Committed(commit))

    def applied_outcome(
        self, staleness: int, stats: ApplyStats, position: int = 0, *, unchanged: bool = False
    ) -> CommitOutcome:
        """An applied commit's outcome: this version's snapshot, its figures, its journal position
        (the compiled core's too), and whether its reply carries no θ (`unchanged`)."""
        snapshot = self.with_buffers(self.snapshot)
        epoch = self.journal.epoch
        return CommitOutcome(snapshot, staleness, stats, position=position, epoch=epoch, unchanged=unchanged)

    def commit_and_reply(
        self, commit: Commit, reply: ReplyWriter[R], out: np.ndarray | None = None
    ) -> tuple[CommitOutcome, R]:
        """`commit`, then its `reply` written while θ still holds the commit's version, from θ's
        bytes in the commit's reply dtype (a view of θ itself where no encoding is shared): the
        one operation the applier runs per commit, so no other commit moves θ in between. With
        `out` (float32, P: where the reply is read from) the rule writes θ there as it computes
        it, and the reply is written from those bytes. The compiled core runs the common case
        (csrc/core.c: GEM's exact state, in place), else this code does."""
        if self.compiled is not None:
            done: tuple[CommitOutcome, R] | None = self.compiled(self, commit, reply, out)
            if done is not None:  # None: it changed nothing, and leaves the commit to the code below
                return done
        outcome = self.commit_record(commit, out)
        if outcome.unchanged:  # its client holds this θ: the reply carries none
            return outcome, reply(outcome, b"")
        if commit.reply_dtype in DIFFERENCE_DTYPES:  # a difference from the worker's copy, or θ whole
            outcome, data = self.copies.reply(
                outcome, commit.worker_id, commit.held_copy, commit.reply_dtype, self.theta, self._whole_copy
            )
            return outcome, reply(outcome, data)
        return outcome, reply(outcome, self.theta_bytes(commit.reply_dtype) if out is None else out.data)

    def replay(self, commit: Commit) -> None:
        """Apply a primary's journalled `commit` here, a backup (ServerState.replay): through the
        compiled core where it takes it, as on the primary, with no reply; else `commit_record`."""
        if self.compiled is None or self.compiled(self, commit, None, None) is None:
            self.commit_record(commit)

    def commit_record(self, commit: Commit, out: np.ndarray | None = None) -> CommitOutcome:
        """`commit` as the wire and the journal hold it: its worker's slot looked up, then `commit()`."""
        return self.commit(
            self.registry.slot_of(commit.worker_id),
            commit.worker_id,
            commit.request_id,
            commit.sequence,
            commit.base_version,
            commit.kind,
            commit.payload,
            commit.reply_dtype,
            out,
            loss=commit.loss,
            num_samples=commit.num_samples,
            buffer_delta=commit.buffer_delta,
            payload_peak=commit.payload_peak,
            payload_volatile=commit.payload_volatile,
            base_held=commit.base_held,
            gradient_sums=commit.gradient_sums,
        )

    def landed(self, commit: Commit) -> Commit:
        """`commit` with its payload copied out of its client's memory, as `commit` copies it for a
        journal (_landed): what the compiled core applies and journals while a journal records."""
        payload, peak = self._landed(self.require_rule(), commit.payload)
        owned = self._recording  # landed into a buffer of its own, which the journal keeps
        return dataclasses.replace(
            commit, payload=payload, payload_peak=peak, payload_volatile=False, payload_owned=owned
        )

    def _landed(self, rule: CommitRule, payload: EncodedTensor) -> tuple[EncodedTensor, float | None]:
        """A payload in memory its client can still write (its shared memory), and its peak: read
        where it lies when the rule holds what it reads of it to the peak checked first
        (CommitRule.holds_payload: one pass fewer over P values, and no copy), else copied here
        first, so the checks, the rule and the journal (a backup replays the same bytes) see bytes
        the client cannot change any more. For a journal, into a buffer of the commit's own: its entry
        keeps it (the one copy of the payload the primary makes: commit_frame.frame_of)."""
        if payload.dtype == FLOAT32 and rule.holds_payload and not self._recording:
            return payload, None  # measured by the checks; the rule reads each value once
        size = memoryview(payload.data).nbytes
        if self._recording:
            landing = np.empty(size // 4, np.float32) if payload.dtype == FLOAT32 else np.empty(size, np.uint8)
        else:
            if self._landing.nbytes < size:
                self._landing = np.empty(-(-size // 4), dtype=np.float32)
            landing = self._landing[: size // 4] if payload.dtype == FLOAT32 else self._landing.view(np.uint8)[:size]
        if payload.dtype == FLOAT32:
            peak: float | None = copy_max_abs(np.frombuffer(payload.data, np.float32), landing)
        else:
            landing[:] = np.frombuffer(payload.data, np.uint8)
            peak = None
        return EncodedTensor(payload.dtype, payload.shape, landing.data.cast("B")), peak

    def _whole_copy(self) -> bytes:
        """θ's bfloat16 bytes at this version, shared by the replies that start a copy."""
        return self.encoded(WHOLE_DTYPE).data(WHOLE_DTYPE) or b""
