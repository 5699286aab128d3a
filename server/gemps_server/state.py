"""The central variable, its version, the commit rule and the registered workers: the domain.

Every mutating method here runs on the applier thread, one call at a time, in arrival order
(see applier.py); the event loop only reads `snapshot`, which is replaced atomically.
Every check on a request happens before anything is mutated, so a rejected request never
touches the central variable. Nothing here knows about gRPC or protobuf messages: serde.py
turns requests into the types below and outcomes back into replies.
"""

from __future__ import annotations

import math
import time
import uuid
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from gemps_proto.codec import (
    FLOAT32,
    WIRE_DTYPE_NAMES,
    EncodedTensor,
    TensorDecodeError,
    dtype_name,
    encode,
    expected_nbytes,
    wire_view,
)
from gemps_proto.reasons import Reason
from gemps_proto.schedules import learning_rate_at
from gemps_proto.schema import ParameterSpec, PayloadKind, TrainingConfig, partition_bounds
from gemps_server.errors import FailedPrecondition, InvalidArgument, ResourceExhausted, Unavailable
from gemps_server.ledger import MAX_CLIENT_ID_LENGTH, MAX_REQUEST_ID_LENGTH, CommitLedger, Receipt, valid_client_id
from gemps_server.native import all_finite, max_abs
from gemps_server.rules import ApplyStats, CommitRule, NonFiniteUpdate, create_rule
from gemps_server.workers import WorkerRecord, WorkerRegistry

# How many spec differences a FAILED_PRECONDITION message spells out before summarising.
MAX_LISTED_DIFFERENCES = 5
# The most characters in a worker's name or an evaluation's dataset label: they are kept in
# memory, logged and sent back in Status (a 50 MiB name would be all three).
MAX_NAME_LENGTH = 256
# The most named tensors in a spec (parameters and buffers together): the largest published
# models have a few thousand; a million-entry spec took the event loop seconds to read.
MAX_SPEC_ENTRIES = 65_536
# How long the worker told to initialise the central variable has to send its values, while
# the others registering without values are asked to retry: n workers starting at once then
# upload one copy of θ, not n.
INITIALIZER_GRACE_SECONDS = 30.0


class Snapshot:
    """The central variable at one version as wire bytes: one encoding per wire dtype, each made
    the first time a reply asks for it (on the applier, while theta holds this version) and then
    shared by every reply of that version. Read from the event loop; written on the applier.

    The state holds the current snapshot weakly (ServerState.snapshot): its encodings live as
    long as a reply that sends them, so an idle server holds no copy of θ beyond θ itself.

    `buffers` are the model's buffers at this version (float32 bytes, empty for a model without
    them), set on the applier with the first encoding or outcome: small, so every reply of the
    version carries them whole."""

    __slots__ = ("__weakref__", "_encodings", "buffers", "version")

    def __init__(
        self, version: int, encodings: Mapping[int, bytes] | None = None, buffers: bytes | None = None
    ) -> None:
        self.version = version
        self._encodings: dict[int, bytes] = dict(encodings or {})
        self.buffers = buffers

    def data(self, dtype: int = FLOAT32) -> bytes | None:
        """The encoding in `dtype`, or None if no reply of this version asked for it yet."""
        return self._encodings.get(dtype)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Snapshot):
            return NotImplemented
        return (self.version, self._encodings, self.buffers) == (other.version, other._encodings, other.buffers)

    __hash__ = None  # type: ignore[assignment]  # mutable: its encodings are added to

    def __repr__(self) -> str:
        return f"Snapshot(version={self.version}, encodings={sorted(self._encodings)})"

    def store(self, dtype: int, data: bytes) -> None:
        """Keep `dtype`'s encoding (on the applier, while theta holds this version)."""
        self._encodings[dtype] = data


@dataclass(frozen=True)
class Commit:
    """One worker's commit as the domain sees it (serde.py builds it from the request). The kind
    and the reply dtype are the wire's values, checked here in the protocol's order."""

    worker_id: str
    base_version: int
    kind: int  # a PayloadKind
    payload: EncodedTensor
    request_id: str = ""
    reply_dtype: int = FLOAT32  # wire dtype of the snapshot the reply carries
    loss: float | None = None  # the mini-batch's training loss (metrics only)
    num_samples: int | None = None  # the mini-batch's size (metrics only)
    buffer_delta: EncodedTensor | None = None  # how the worker's buffers changed since it loaded them


@dataclass(frozen=True)
class CommitOutcome:
    snapshot: Snapshot
    staleness: int
    stats: ApplyStats
    # A retry of a commit already applied: nothing changed; staleness and stats are the
    # original's, the snapshot is the current central variable.
    duplicate: bool = False


@dataclass(frozen=True)
class Admission:
    """A registration's result: the worker's record and the central variable it starts from."""

    worker: WorkerRecord
    snapshot: Snapshot
    initialized_theta: bool  # this worker's initial parameters became the central variable
    displaced: WorkerRecord | None = None  # an idle worker evicted to make room (workers.idlest)


@dataclass(frozen=True)
class PartitionOf:
    """Which contiguous range of θ a server holds: partition `index` of `count` (0 of 1: all of
    it). The range follows from P alone (gemps_proto.schema.partition_bounds), so it is fixed
    when θ is initialised and every partition computes the same layout."""

    index: int = 0
    count: int = 1

    def bounds(self, num_parameters: int) -> tuple[int, int]:
        """[start, stop) of this partition in a central variable of `num_parameters` values."""
        return partition_bounds(num_parameters, self.count)[self.index]

    def __str__(self) -> str:
        return f"partition {self.index} of {self.count}"


ALL_OF_THETA = PartitionOf()


@dataclass(frozen=True)
class StateImage:
    """Everything a restarted server needs, consistent at one version (see checkpoints.py)."""

    version: int
    commits_applied: int
    spec: tuple[ParameterSpec, ...]
    theta: np.ndarray  # flat float32: the spec's parameters concatenated (a partition: its range)
    rule: str = ""  # the rule whose global state `rule_state` is
    rule_state: Mapping[str, np.ndarray] = field(default_factory=dict)
    receipts: Mapping[str, Receipt] = field(default_factory=dict)
    buffer_spec: tuple[ParameterSpec, ...] = ()
    buffers: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.float32))  # flat, buffer_spec order
    partition: PartitionOf = ALL_OF_THETA

    @property
    def num_parameters(self) -> int:
        return int(self.theta.size)

    @property
    def total_parameters(self) -> int:
        """P of the whole central variable (this image holds `num_parameters` of them)."""
        return sum(entry.size for entry in self.spec)


def check_spec(spec: Sequence[ParameterSpec], buffer_spec: Sequence[ParameterSpec] = ()) -> None:
    """Raises InvalidArgument naming the first bad entry of a worker's parameter (or buffer) spec;
    names are unique across both (they are the keys of one state dict)."""
    if not spec:
        raise InvalidArgument("parameter spec is empty: send at least one parameter", Reason.BAD_SPEC)
    check_spec_length(len(spec) + len(buffer_spec))
    seen = set()
    for what, entries in (("parameter", spec), ("buffer", buffer_spec)):
        for index, entry in enumerate(entries):
            if not entry.name:
                raise InvalidArgument(f"{what} {index} has no name", Reason.BAD_SPEC)
            if entry.name in seen:
                raise InvalidArgument(f"{what} name {entry.name!r} appears twice", Reason.BAD_SPEC)
            if any(d < 0 for d in entry.shape):
                raise InvalidArgument(f"{what} {entry.name!r} has negative shape {list(entry.shape)}", Reason.BAD_SPEC)
            seen.add(entry.name)
    if sum(entry.size for entry in spec) == 0:
        raise InvalidArgument(
            "parameter spec describes no values: every parameter has a 0 in its shape", Reason.BAD_SPEC
        )


def check_spec_length(entries: int) -> None:
    """InvalidArgument for a spec of more than MAX_SPEC_ENTRIES tensors (before it is read)."""
    if entries > MAX_SPEC_ENTRIES:
        raise InvalidArgument(
            f"spec has {entries} entries; at most {MAX_SPEC_ENTRIES} parameters and buffers together", Reason.BAD_SPEC
        )


def check_name(what: str, value: str) -> None:
    """InvalidArgument for a name or label longer than MAX_NAME_LENGTH characters."""
    if len(value) > MAX_NAME_LENGTH:
        raise InvalidArgument(f"{what} has {len(value)} characters; at most {MAX_NAME_LENGTH}", Reason.TOO_LONG)


def spec_differences(
    server: Sequence[ParameterSpec], worker: Sequence[ParameterSpec], what: str = "parameter"
) -> list[str]:
    """Human-readable differences between the server's spec and a worker's, in order."""
    found = []
    if len(server) != len(worker):
        found.append(f"server has {len(server)} {what}s, worker sent {len(worker)}")
    for index, (ours, theirs) in enumerate(zip(server, worker, strict=False)):
        if ours != theirs:
            found.append(f"{what} {index}: server has {ours.describe()}, worker sent {theirs.describe()}")
    server_names, worker_names = {s.name for s in server}, {s.name for s in worker}
    if missing := sorted(server_names - worker_names):
        found.append(f"missing from worker: {', '.join(missing)}")
    if extra := sorted(worker_names - server_names):
        found.append(f"unknown to server: {', '.join(extra)}")
    return found


def check_reply_dtype(dtype: int) -> None:
    """InvalidArgument unless replies can carry the central variable in `dtype`."""
    if dtype not in WIRE_DTYPE_NAMES.values():
        supported = ", ".join(dtype_name(d) for d in WIRE_DTYPE_NAMES.values())
        raise InvalidArgument(f"reply_dtype {dtype_name(dtype)} is not one of {supported}", Reason.BAD_DTYPE)


def _payload_kind(value: int) -> PayloadKind:
    try:
        return PayloadKind(value)
    except ValueError:
        kinds = " or ".join(kind.wire_name for kind in PayloadKind)
        raise InvalidArgument(f"payload kind {value} is not {kinds}", Reason.BAD_KIND) from None


def _decoded(tensor: EncodedTensor, what: str) -> np.ndarray:
    try:
        return tensor.decode()
    except TensorDecodeError as error:
        raise InvalidArgument(f"{what}: {error}", Reason.BAD_PAYLOAD) from None


class ServerState:
    def __init__(
        self,
        training: TrainingConfig,
        registry: WorkerRegistry,
        gem_kernel: str = "numpy",
        partition: PartitionOf = ALL_OF_THETA,
        max_parameters: int | None = None,
    ) -> None:
        self._training = training
        self.partition = partition
        self.max_parameters = max_parameters  # None: no limit (ServerConfig.max_parameters)
        self.bounds = (0, 0)  # [start, stop) of θ held here, once initialised
        self._gem_kernel = gem_kernel
        self._new_rule(0)  # fail fast on an unknown rule name or kernel
        self.rule_name = training.rule
        self.registry = registry
        self.spec: tuple[ParameterSpec, ...] = ()
        self.rule: CommitRule | None = None
        self._version = 0
        self._latest: weakref.ref[Snapshot] = weakref.ref(Snapshot(0))  # dead at once: see `snapshot`
        self.commits_applied = 0
        # Versions count in this process's history: a restarted server may reach the same number
        # with other values (commits lost since its checkpoint), so "unchanged" needs both.
        self.history = uuid.uuid4().hex
        self.ledger = CommitLedger(capacity=registry.max_workers)
        self._theta = np.empty(0, dtype=np.float32)
        self.buffer_spec: tuple[ParameterSpec, ...] = ()
        self._buffers = np.empty(0, dtype=np.float32)  # replaced, never changed in place
        self._initializer_until = 0.0  # monotonic deadline of the worker asked for initial values

    @property
    def initialized(self) -> bool:
        return self.rule is not None

    @property
    def num_parameters(self) -> int:
        return self._theta.size

    @property
    def version(self) -> int:
        return self._version

    @property
    def learning_rate(self) -> float:
        """eta at the current version: what the next gradient commit is scaled by."""
        return learning_rate_at(self._training, self._version)

    @property
    def snapshot(self) -> Snapshot:
        """The current version's snapshot: the one replies are still sending, if any is (so its
        encodings are shared), else a new one without encodings."""
        snapshot = self._latest()
        if snapshot is None or snapshot.version != self._version:
            snapshot = Snapshot(self._version)
            self._latest = weakref.ref(snapshot)
        return snapshot

    def theta_copy(self) -> np.ndarray:
        return self._theta.copy()

    # -- operations run by the applier --------------------------------------------------------

    def register(
        self,
        worker_name: str,
        spec: Sequence[ParameterSpec],
        initial: EncodedTensor | None,
        encode_theta: bool = True,
        buffer_spec: Sequence[ParameterSpec] = (),
        initial_buffers: EncodedTensor | None = None,
        client_id: str = "",
    ) -> Admission:
        """Admit a worker; `encode_theta` False when its reply will not carry θ (it pulls θ apart).
        The first worker's `initial_buffers` become the central buffers. A client holds one
        registration: `client_id`'s previous one, if any, is replaced (a retried Register whose
        reply was lost leaves no orphan holding rule state), its commit receipts carried over."""
        check_name("worker_name", worker_name)
        if not valid_client_id(client_id):
            raise InvalidArgument(
                f"client_id must be at most {MAX_CLIENT_ID_LENGTH} visible ASCII characters", Reason.BAD_CLIENT_ID
            )
        check_spec(spec, buffer_spec)
        first = self.rule is None
        if first:
            self._initialize(spec, initial, buffer_spec, initial_buffers)
        elif differences := spec_differences(self.spec, spec) + spec_differences(
            self.buffer_spec, buffer_spec, "buffer"
        ):
            shown = differences[:MAX_LISTED_DIFFERENCES]
            more = len(differences) - len(shown)
            raise FailedPrecondition(
                "parameter spec does not match the central variable's: "
                + "; ".join(shown)
                + (f"; and {more} more" if more > 0 else ""),
                Reason.SPEC_MISMATCH,
            )
        assert self.rule is not None
        if (previous := self.registry.of_client(client_id)) is not None:
            self._forget(previous.worker_id)
        displaced = self.registry.idlest() if self.registry.full else None
        if displaced is not None:
            self._forget(displaced.worker_id)
        worker = self.registry.add(worker_name, client_id)
        self.ledger.activate(worker.scope)
        self.rule.add_worker(worker.worker_id, self._theta)
        # The worker that initialised theta already holds it: no P-sized encoding for its reply.
        initialized = first and initial is not None
        encoded = encode_theta and not initialized
        snapshot = self.encoded(FLOAT32) if encoded else self._with_buffers(self.snapshot)
        return Admission(worker, snapshot, initialized, displaced)

    def commit(self, commit: Commit) -> CommitOutcome:
        rule = self.require_initialized()
        check_reply_dtype(commit.reply_dtype)
        if len(commit.request_id) > MAX_REQUEST_ID_LENGTH:
            raise InvalidArgument(
                f"request_id has {len(commit.request_id)} characters; at most {MAX_REQUEST_ID_LENGTH}",
                Reason.BAD_REQUEST_ID,
            )
        worker = self.registry.get(commit.worker_id)
        # By the worker's client, not by request id alone: two clients may count their ids alike.
        # A retry from a client that registered again (lease expiry, server restart) is found too.
        receipt = self.ledger.lookup(worker.scope, commit.request_id)
        if receipt is not None:
            self.registry.touch(commit.worker_id, committed=True)
            return CommitOutcome(self.encoded(commit.reply_dtype), receipt.staleness, receipt.stats, duplicate=True)
        kind, payload, peak = self._validated_payload(commit)
        buffers = self._buffers_after(commit.buffer_delta)  # checked before θ moves
        staleness = self.version - commit.base_version
        try:  # the rule writes into spare buffers and swaps them in only if every value is finite
            self._theta, stats = rule.step(self._theta, payload, kind, commit.worker_id, staleness, self.version, peak)
        except NonFiniteUpdate as error:
            raise InvalidArgument(f"commit refused, nothing changed: {error}", Reason.NON_FINITE) from None
        self._buffers = buffers
        self.commits_applied += 1
        worker.commits += 1
        self.registry.touch(commit.worker_id, committed=True)
        self._version += 1  # its snapshot is encoded when a reply asks (encoded(), theta_wire())
        self.ledger.record(worker.scope, commit.request_id, Receipt(self.version, staleness, stats))
        return CommitOutcome(self._with_buffers(self.snapshot), staleness, stats)

    def theta_wire(self, dtype: int) -> bytes | memoryview:
        """θ's wire bytes in `dtype` now: the snapshot's encoding when there is one, else for float32
        a view of θ itself, valid only until the next operation changes it (use it on the applier,
        within the operation that asked: to frame a reply straight from θ, with no copy of its own)."""
        return self.snapshot.data(dtype) or wire_view(self._theta, dtype)

    def encoded(self, dtype: int) -> Snapshot:
        """The current snapshot, with `dtype`'s encoding produced if it is not there yet."""
        snapshot = self._with_buffers(self.snapshot)
        if snapshot.data(dtype) is None:
            snapshot.store(dtype, encode(self._theta, dtype))
        return snapshot

    def _with_buffers(self, snapshot: Snapshot) -> Snapshot:
        """`snapshot` with this version's buffers (on the applier: they change with commits)."""
        if snapshot.buffers is None:
            snapshot.buffers = self._buffers.tobytes()
        return snapshot

    def leave(self, worker_id: str) -> WorkerRecord:
        worker = self.registry.get(worker_id)
        self._forget(worker_id)
        return worker

    def evict_expired(self) -> list[WorkerRecord]:
        evicted = []
        for worker_id in self.registry.expired():
            evicted.append(self.registry.get(worker_id))
            self._forget(worker_id)
        return evicted

    def image(self) -> StateImage:
        """Everything a restarted server needs, consistent at one version (run on the applier:
        the rule's global state and the ledger change with every commit)."""
        rule = self.require_initialized()
        return StateImage(
            version=self._version,
            commits_applied=self.commits_applied,
            spec=self.spec,
            theta=self._theta.copy(),
            rule=self.rule_name,
            rule_state=rule.global_state(),
            receipts=self.ledger.entries(),
            buffer_spec=self.buffer_spec,
            buffers=self._buffers,  # never changed in place: no copy needed
            partition=self.partition,
        )

    def restore(self, image: StateImage) -> list[str]:
        """Serve `image`'s central variable (before any worker registers); returns warnings.

        Workers are not restored: they register again, with fresh per-worker rule state.
        """
        if self.rule is not None:
            raise RuntimeError("restore() needs a server that is not initialised yet")
        if image.partition != self.partition:
            raise ValueError(f"the checkpoint holds {image.partition}; this server serves {self.partition}")
        warnings = []
        self.spec = tuple(image.spec)
        self._theta = np.array(image.theta, dtype=np.float32, copy=True).reshape(-1)
        self.buffer_spec = tuple(image.buffer_spec)
        self._buffers = np.array(image.buffers, dtype=np.float32, copy=True).reshape(-1)
        rule = self._new_rule(self._theta.size)
        if image.rule_state:
            if image.rule == self.rule_name:
                try:
                    rule.load_global_state(dict(image.rule_state))
                except ValueError as error:
                    warnings.append(f"rule state not restored: {error}")
            else:
                warnings.append(f"rule state of {image.rule!r} not restored into rule {self.rule_name!r}")
        self.rule = rule
        self.commits_applied = image.commits_applied
        self._version = image.version
        self.bounds = self.partition.bounds(image.total_parameters)
        self.ledger.restore(dict(image.receipts))
        return warnings

    # -- checks, readable from the event loop ------------------------------------------------

    def require_initialized(self) -> CommitRule:
        if self.rule is None:
            raise FailedPrecondition(
                "central variable not initialised: no worker has registered yet", Reason.NOT_INITIALIZED
            )
        return self.rule

    def expected_payload_bytes(self, dtype: int, shape: tuple[int, ...]) -> int:
        """Bytes a payload of this dtype and shape must have; InvalidArgument unless it is flat [P]."""
        self.require_initialized()
        try:
            size = expected_nbytes(dtype, shape)
        except TensorDecodeError as error:
            raise InvalidArgument(f"payload: {error}", Reason.BAD_PAYLOAD) from None
        self._check_payload_shape(shape)
        return size

    # -- helpers -------------------------------------------------------------------------------

    def _new_rule(self, num_parameters: int) -> CommitRule:
        return create_rule(self._training, num_parameters, kernel=self._gem_kernel)

    def _forget(self, worker_id: str) -> None:
        worker = self.registry.remove(worker_id)
        if worker is not None:
            self.ledger.depart(worker.scope)
        if self.rule is not None:
            self.rule.remove_worker(worker_id)

    def _initialize(
        self,
        spec: Sequence[ParameterSpec],
        initial: EncodedTensor | None,
        buffer_spec: Sequence[ParameterSpec] = (),
        initial_buffers: EncodedTensor | None = None,
    ) -> None:
        if initial is None:
            now = time.monotonic()
            if now < self._initializer_until:
                raise Unavailable(
                    "the central variable is being initialised by another worker; retry shortly",
                    Reason.INITIALIZING,
                )
            self._initializer_until = now + INITIALIZER_GRACE_SECONDS
            raise FailedPrecondition(
                "central variable not initialised: the first worker to register must send initial_parameters "
                f"(this one: the others are asked to retry for {INITIALIZER_GRACE_SECONDS:.0f} s)",
                Reason.NOT_INITIALIZED,
            )
        self.check_size(spec, buffer_spec)
        values = _decoded(initial, "initial_parameters").reshape(-1)
        values = values[self.initial_range(spec, values.size)]
        start, stop = self.partition.bounds(sum(s.size for s in spec))
        if not all_finite(values):
            raise InvalidArgument("initial_parameters contains NaN or Inf", Reason.NON_FINITE)
        if buffer_spec and self.partition.index != 0:
            raise InvalidArgument(f"buffers are held by partition 0, not {self.partition}", Reason.BAD_SPEC)
        buffers = self._initial_buffers(buffer_spec, initial_buffers)
        self.spec = tuple(spec)
        self.buffer_spec = tuple(buffer_spec)
        self._buffers = buffers
        self._theta = values.copy()
        self.rule = self._new_rule(self._theta.size)
        self.bounds = (start, stop)
        self._version = 0

    def check_upload(
        self,
        spec: Sequence[ParameterSpec],
        buffer_spec: Sequence[ParameterSpec],
        parameter_count: int,
        buffer_count: int | None,
    ) -> None:
        """Everything the first worker's initial values must satisfy that their header already
        says (their sizes): checked before a streamed upload's data is received."""
        check_spec(spec, buffer_spec)
        self.check_size(spec, buffer_spec)
        self.initial_range(spec, parameter_count)
        if buffer_count is not None:
            self.check_buffer_count(buffer_spec, buffer_count)

    def check_size(self, spec: Sequence[ParameterSpec], buffer_spec: Sequence[ParameterSpec]) -> None:
        """ResourceExhausted when this process would hold more than max_parameters values of θ
        (its range) and buffers together: the first worker decides θ's size, this bounds it."""
        if self.max_parameters is None:
            return
        start, stop = self.partition.bounds(sum(s.size for s in spec))
        held = stop - start + sum(entry.size for entry in buffer_spec)
        if held > self.max_parameters:
            where = "" if self.partition.count == 1 else f" ({self.partition}: {stop - start} of θ's values)"
            raise ResourceExhausted(
                f"the model has {held} values to hold here{where}; this server holds at most "
                f"{self.max_parameters} (its --max-parameters)",
                Reason.TOO_LARGE,
            )

    def initial_range(self, spec: Sequence[ParameterSpec], count: int) -> slice:
        """Which of `count` initial values this partition keeps: its own range when all P came,
        all of them when just that range came; InvalidArgument for any other count. Also checked
        on a streamed upload's header, before any value is received."""
        total = sum(s.size for s in spec)
        if total < self.partition.count:
            raise InvalidArgument(
                f"the model has {total} values, fewer than the {self.partition.count} partitions of θ it is split into",
                Reason.BAD_SPEC,
            )
        start, stop = self.partition.bounds(total)
        if count == total:
            return slice(start, stop)  # all of θ sent to one partition: it keeps its range
        if count != stop - start:
            held = "" if self.partition.count == 1 else f" ({self.partition}: {stop - start} of them, or all)"
            raise InvalidArgument(
                f"initial_parameters has {count} values but the spec describes {total}{held}", Reason.BAD_SHAPE
            )
        return slice(None)

    @staticmethod
    def check_buffer_count(buffer_spec: Sequence[ParameterSpec], count: int) -> None:
        """InvalidArgument unless `count` initial buffer values are what `buffer_spec` describes."""
        size = sum(entry.size for entry in buffer_spec)
        if count != size:
            raise InvalidArgument(
                f"initial_buffers has {count} values but buffer_spec describes {size}", Reason.BAD_SHAPE
            )

    @staticmethod
    def _initial_buffers(buffer_spec: Sequence[ParameterSpec], initial: EncodedTensor | None) -> np.ndarray:
        size = sum(entry.size for entry in buffer_spec)
        if initial is None:
            if size:
                raise InvalidArgument(
                    f"buffer_spec describes {size} values but initial_buffers is missing", Reason.BAD_SHAPE
                )
            return np.empty(0, dtype=np.float32)
        values = _decoded(initial, "initial_buffers").reshape(-1)
        ServerState.check_buffer_count(buffer_spec, values.size)
        if not all_finite(values):
            raise InvalidArgument("initial_buffers contains NaN or Inf", Reason.NON_FINITE)
        return np.array(values, dtype=np.float32, copy=True)

    def _buffers_after(self, delta: EncodedTensor | None) -> np.ndarray:
        """The central buffers once `delta` is added (DOWNPOUR for buffers: see docs); checked, not kept."""
        if delta is None:
            return self._buffers
        values = _decoded(delta, "buffer_delta")
        if values.shape != self._buffers.shape:
            raise InvalidArgument(
                f"buffer_delta shape {list(values.shape)} does not match the central buffers' "
                f"[{self._buffers.size}] (all registered buffers, flattened in buffer spec order)",
                Reason.BAD_SHAPE,
            )
        with np.errstate(over="ignore"):  # an overflow is refused just below
            updated: np.ndarray = self._buffers + values
        if not all_finite(updated):
            raise InvalidArgument("buffer_delta contains NaN or Inf, or makes a buffer overflow", Reason.NON_FINITE)
        return updated

    def _check_payload_shape(self, shape: tuple[int, ...]) -> None:
        if shape != (self.num_parameters,):
            raise InvalidArgument(
                f"payload shape {list(shape)} does not match the central variable's "
                f"[{self.num_parameters}] (all registered parameters, flattened in spec order)",
                Reason.BAD_SHAPE,
            )

    def _validated_payload(self, commit: Commit) -> tuple[PayloadKind, np.ndarray, float]:
        """The kind, the values and max |value| (which GEM's overflow bound uses), checked."""
        kind = _payload_kind(commit.kind)
        values = _decoded(commit.payload, "payload")
        self._check_payload_shape(values.shape)
        if commit.base_version < 0:
            raise InvalidArgument(f"base_version {commit.base_version} is negative", Reason.BAD_VERSION)
        if commit.base_version > self.version:
            raise InvalidArgument(
                f"base_version {commit.base_version} is ahead of the server's version {self.version}",
                Reason.BAD_VERSION,
            )
        peak = max_abs(values)  # NaN when a value is not finite: one pass for both
        if not math.isfinite(peak):
            raise InvalidArgument("payload contains NaN or Inf", Reason.NON_FINITE)
        return kind, values, peak
