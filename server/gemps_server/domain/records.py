"""The domain's records: the central variable at one version (Snapshot), a commit and its
outcome, a registration's registered, the partition of θ a server holds and the image a
checkpoint keeps. Plain data, built by the wire from requests and by the state from its
operations; nothing here knows about gRPC or protobuf messages.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple, TypeVar

import numpy as np

from gemps_proto.gradient_sums import GradientSums
from gemps_proto.schema import Buffers, ParameterSpec, partition_bounds
from gemps_proto.tensor_codec import FLOAT32, EncodedBuffers, EncodedTensor
from gemps_server.domain.ledger import CommitLedger, Receipt
from gemps_server.domain.noise import NoiseEstimator
from gemps_server.domain.rules import ApplyStats, CommitRule
from gemps_server.domain.workers import WorkerRecord

R = TypeVar("R")


class Snapshot:
    """The central variable at one version as wire bytes: one encoding per wire dtype, each made
    the first time a reply asks for it (on the applier, while theta holds this version) and then
    shared by every reply of that version. Read from the event loop; written on the applier.

    The commit core holds the current snapshot weakly (CommitCore.snapshot): its encodings live as
    long as a reply that sends them, so an idle server holds no copy of θ beyond θ itself.

    `buffers` are the model's buffers at this version (never changed in place; empty for a model
    without them), set on the applier with the first encoding or outcome: small, so every reply of
    the version carries them whole."""

    __slots__ = ("__weakref__", "_encodings", "buffers", "version")

    def __init__(
        self, version: int, encodings: Mapping[int, bytes] | None = None, buffers: Buffers | None = None
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
        return (self.version, self._encodings, self.buffers is None) == (
            other.version,
            other._encodings,
            other.buffers is None,
        ) and _same_buffers(self.buffers, other.buffers)

    __hash__ = None  # type: ignore[assignment]  # mutable: its encodings are added to

    def __repr__(self) -> str:
        return f"Snapshot(version={self.version}, encodings={sorted(self._encodings)})"

    def store(self, dtype: int, data: bytes) -> None:
        """Keep `dtype`'s encoding (on the applier, while theta holds this version)."""
        self._encodings[dtype] = data


def _same_buffers(ours: Buffers | None, theirs: Buffers | None) -> bool:
    if ours is None or theirs is None:
        return ours is theirs
    return np.array_equal(ours.floats, theirs.floats) and np.array_equal(ours.integers, theirs.integers)


@dataclass(frozen=True)
class Commit:
    """One worker's commit as the domain sees it (the wire builds it from the request). The kind
    and the reply dtype are the wire's values, checked here in the protocol's order."""

    worker_id: str
    base_version: int
    kind: int  # a PayloadKind
    payload: EncodedTensor
    request_id: str = ""
    sequence: int = 0  # its place among its client's commits (0: unnumbered; see ledger.py)
    reply_dtype: int = FLOAT32  # wire dtype of the snapshot the reply carries
    loss: float | None = None  # the mini-batch's training loss (metrics only)
    num_samples: int | None = None  # the mini-batch's size (metrics only)
    buffer_delta: EncodedBuffers | None = None  # how the worker's buffers changed since it loaded them
    # max |payload| (NaN when a value is not finite) where the wire measured it as the payload
    # arrived (float32 payloads on the data plane): spares the applier a pass over it.
    payload_peak: float | None = None
    # Difference replies (reply_dtype a block code): the copy of θ the client holds (0: none).
    held_copy: int = 0
    # The payload lies in memory its client can still write (its shared memory): the core reads
    # it once, or copies it first (CommitCore._landed).
    payload_volatile: bool = False
    # The payload's buffer is this commit's alone (landed for a journal: CommitCore._landed): the
    # journal's entry holds it as it is, with no copy of its own (commit_frame.frame_of).
    payload_owned: bool = False
    # An update commit's window of its worker's local steps, measured by the worker for the noise
    # scale's estimate (gemps_proto.gradient_sums); None: not measured.
    gradient_sums: GradientSums | None = None
    # Its client holds θ of `base_version` in this server's history (CommitRequest.known_history):
    # a reply whose θ is still that one carries none (CommitOutcome.unchanged).
    base_held: bool = False


@dataclass(frozen=True)
class CommitOutcome:
    snapshot: Snapshot
    staleness: int
    stats: ApplyStats
    # A retry of a commit already applied: nothing changed; staleness and stats are the
    # original's, the snapshot is the current central variable.
    duplicate: bool = False
    # Its place in the journal (a duplicate: the newest entry's): the reply waits until the
    # replicas applied that far (0: no replicas).
    position: int = 0
    epoch: int = 0  # the epoch of the primary that applied it (0: no replicas)
    reply: CopyReply | None = None  # a reply to a client that holds a copy (reply_differences)
    # θ after it is the θ of the commit's base version, which its client holds (Commit.base_held):
    # the reply carries no θ.
    unchanged: bool = False

    def reply_dtype(self, asked: int) -> int:
        """The dtype the reply's θ is in: `asked` (the commit's reply_dtype), unless the reply is
        to a client's copy, which the outcome decided (a difference, or θ whole in bfloat16)."""
        return asked if self.reply is None else self.reply.dtype


@dataclass(frozen=True)
class CopyReply:
    """How a difference-reply client's copy of θ moves (gemps_proto.reply_differences): the reply's
    dtype (a block code: a difference from copy `difference_of`; bfloat16: θ whole), and the
    number of the copy the client holds once it applied it."""

    dtype: int
    copy: int
    difference_of: int = 0  # 0: θ whole


@dataclass(frozen=True)
class RegistrationOutcome:
    """A registration's result: the worker's record and the central variable it starts from."""

    worker: WorkerRecord
    snapshot: Snapshot
    initialized_theta: bool  # this worker's initial parameters became the central variable
    displaced: WorkerRecord | None = None  # its dead namesake, or an idle worker evicted to make room
    displaced_because: str = ""  # why: SUPERSEDED or SERVER_FULL (workers.py); "" when none was
    # Its name, when this client's return found it shared by live processes (domain/namesakes.py): once.
    shared_name: str = ""


class Admitted(NamedTuple):
    """A worker entered in the registry (ServerState._admit), with the one it displaced and why,
    and its name when its client's return found the name shared."""

    worker: WorkerRecord
    displaced: WorkerRecord | None
    because: str
    shared_name: str


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
    """Everything a restarted server needs, consistent at one version (see checkpoint_files.py)."""

    version: int
    commits_applied: int
    spec: tuple[ParameterSpec, ...]
    theta: np.ndarray  # flat float32: the spec's parameters concatenated (a partition: its range)
    rule: str = ""  # the rule whose global state `rule_state` is
    rule_state: Mapping[str, np.ndarray] = field(default_factory=dict)
    receipts: Mapping[str, Receipt] = field(default_factory=dict)
    buffer_spec: tuple[ParameterSpec, ...] = ()
    buffers: Buffers = field(default_factory=Buffers)  # by kind, each flat in buffer_spec order
    partition: PartitionOf = ALL_OF_THETA
    job: str = ""  # the job whose θ this is (ServerState.job; "" in checkpoints from before jobs)

    @property
    def num_parameters(self) -> int:
        return int(self.theta.size)

    @property
    def total_parameters(self) -> int:
        """P of the whole central variable (this image holds `num_parameters` of them)."""
        return sum(entry.size for entry in self.spec)


#: Given a commit's outcome and θ's wire bytes at that commit's version (in the commit's reply
#: dtype), produce its reply. The state calls it at the end of the commit, on the applier, while
#: θ still holds that version: the bytes may be a view of θ itself, valid only during the call.
#: The wire supplies it (a unary reply framed straight from θ, θ placed in the buffer it is sent from).
ReplyWriter = Callable[[CommitOutcome, bytes | memoryview], R]


@dataclass(frozen=True)
class Held:
    """Everything a state holds besides its workers, replaced at once by `ServerState.install`."""

    rule: CommitRule | None  # None: θ not initialised, and then nothing else is held
    theta: np.ndarray  # flat float32, this partition's range
    spec: tuple[ParameterSpec, ...]
    buffer_spec: tuple[ParameterSpec, ...]
    buffers: Buffers
    version: int
    commits_applied: int
    bounds: tuple[int, int]  # [start, stop) of θ held here
    ledger: CommitLedger
    noise: NoiseEstimator
    history: str
    job: str  # "" while θ is not initialised
