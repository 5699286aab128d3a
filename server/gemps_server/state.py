"""The central variable, its version, the commit rule and the registered workers.

Every mutating method here runs on the applier thread, one call at a time, in arrival order
(see applier.py); the event loop only reads `snapshot`, which is replaced atomically.
Every check on a request happens before anything is mutated, so a rejected request never
touches the central variable.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import numpy as np

from gemps_proto.codec import (
    TensorDecodeError,
    all_finite,
    decode,
    dtype_name,
    encode,
    num_elements,
    numpy_dtype,
    tensor_to_array,
)
from gemps_proto.v1 import parameter_server_pb2 as pb
from gemps_server.checkpoint import Checkpoint
from gemps_server.errors import FailedPrecondition, InvalidArgument
from gemps_server.ledger import MAX_REQUEST_ID_LENGTH, CommitLedger, Receipt
from gemps_server.rules import ApplyStats, CommitRule, RuleParams, create_rule
from gemps_server.workers import WorkerRecord, WorkerRegistry

# How many spec differences a FAILED_PRECONDITION message spells out before summarising.
MAX_LISTED_DIFFERENCES = 5


@dataclass(frozen=True)
class ParamSpec:
    name: str
    shape: tuple[int, ...]

    @property
    def size(self) -> int:
        return num_elements(self.shape)

    def describe(self) -> str:
        return f"{self.name!r} {list(self.shape)}"


# Wire formats a reply's parameters may use.
REPLY_DTYPES = (pb.DTYPE_FLOAT32, pb.DTYPE_BFLOAT16)


@dataclass(frozen=True)
class Snapshot:
    """The central variable at one version, encoded for the wire in the formats asked for so
    far (each produced once per version, on the applier, then shared by every reply)."""

    version: int
    encodings: dict[int, bytes]

    def data(self, dtype: int = pb.DTYPE_FLOAT32) -> bytes | None:
        return self.encodings.get(dtype)


@dataclass(frozen=True)
class WirePayload:
    """A commit's payload as it came: dtype and shape from the request, the raw bytes."""

    dtype: int
    shape: tuple[int, ...]
    data: bytes | memoryview

    @classmethod
    def of(cls, tensor: pb.Tensor) -> WirePayload:
        return cls(tensor.dtype, tuple(tensor.shape), tensor.data)


@dataclass(frozen=True)
class Registration:
    worker: WorkerRecord
    snapshot: Snapshot


@dataclass(frozen=True)
class CommitOutcome:
    snapshot: Snapshot
    staleness: int
    stats: ApplyStats
    # A retry of a commit already applied: nothing changed; staleness and stats are the
    # original's, the snapshot is the current central variable.
    duplicate: bool = False


def parse_spec(spec: Sequence[pb.ParameterSpec]) -> list[ParamSpec]:
    """Validate a worker's parameter spec; raises InvalidArgument naming the bad entry."""
    if not spec:
        raise InvalidArgument("parameter spec is empty: send at least one parameter", reason="bad_spec")
    parsed, seen = [], set()
    for index, entry in enumerate(spec):
        if not entry.name:
            raise InvalidArgument(f"parameter {index} has no name", reason="bad_spec")
        if entry.name in seen:
            raise InvalidArgument(f"parameter name {entry.name!r} appears twice", reason="bad_spec")
        if entry.dtype != pb.DTYPE_FLOAT32:
            raise InvalidArgument(
                f"parameter {entry.name!r} has dtype {dtype_name(entry.dtype)}; the central variable is DTYPE_FLOAT32",
                reason="bad_dtype",
            )
        if any(d < 0 for d in entry.shape):
            raise InvalidArgument(f"parameter {entry.name!r} has negative shape {list(entry.shape)}", reason="bad_spec")
        seen.add(entry.name)
        parsed.append(ParamSpec(entry.name, tuple(entry.shape)))
    return parsed


def spec_differences(server: Sequence[ParamSpec], worker: Sequence[ParamSpec]) -> list[str]:
    """Human-readable differences between the server's spec and a worker's, in order."""
    found = []
    if len(server) != len(worker):
        found.append(f"server has {len(server)} parameters, worker sent {len(worker)}")
    for index, (ours, theirs) in enumerate(zip(server, worker, strict=False)):
        if ours != theirs:
            found.append(f"parameter {index}: server has {ours.describe()}, worker sent {theirs.describe()}")
    server_names, worker_names = {s.name for s in server}, {s.name for s in worker}
    if missing := sorted(server_names - worker_names):
        found.append(f"missing from worker: {', '.join(missing)}")
    if extra := sorted(worker_names - server_names):
        found.append(f"unknown to server: {', '.join(extra)}")
    return found


def check_reply_dtype(dtype: int) -> pb.DType:
    """The wire format a reply's parameters use (float32 when unspecified); InvalidArgument if unknown."""
    if dtype == pb.DTYPE_UNSPECIFIED:
        return pb.DTYPE_FLOAT32
    if dtype not in REPLY_DTYPES:
        raise InvalidArgument(
            f"reply_dtype {dtype_name(dtype)} is not one of {', '.join(dtype_name(d) for d in REPLY_DTYPES)}",
            reason="bad_dtype",
        )
    return cast(pb.DType, dtype)


class ServerState:
    def __init__(self, rule_name: str, rule_params: RuleParams, registry: WorkerRegistry) -> None:
        create_rule(rule_name, rule_params, 0)  # fail fast on an unknown rule name
        self.rule_name = rule_name
        self.rule_params = rule_params
        self.registry = registry
        self.spec: list[ParamSpec] = []
        self.rule: CommitRule | None = None
        self.snapshot = Snapshot(0, {pb.DTYPE_FLOAT32: b""})
        self.commits_applied = 0
        self.ledger = CommitLedger(capacity=registry.max_workers)
        self._theta = np.empty(0, dtype=np.float32)

    @property
    def initialized(self) -> bool:
        return self.rule is not None

    @property
    def num_parameters(self) -> int:
        return self._theta.size

    @property
    def version(self) -> int:
        return self.snapshot.version

    def theta_copy(self) -> np.ndarray:
        return self._theta.copy()

    # -- operations run by the applier --------------------------------------------------------

    def register(self, worker_name: str, spec: Sequence[ParamSpec], initial: pb.Tensor | None) -> Registration:
        first = self.rule is None
        if first:
            self._initialize(spec, initial)
        elif differences := spec_differences(self.spec, spec):
            shown = differences[:MAX_LISTED_DIFFERENCES]
            more = len(differences) - len(shown)
            raise FailedPrecondition(
                "parameter spec does not match the central variable's: "
                + "; ".join(shown)
                + (f"; and {more} more" if more > 0 else ""),
                reason="spec_mismatch",
            )
        assert self.rule is not None
        worker = self.registry.add(worker_name)
        self.rule.add_worker(worker.worker_id, self._theta)
        # The worker that initialised theta already holds it: no P-sized encoding for its reply.
        return Registration(worker, self.snapshot if initial is not None and first else self.encoded(pb.DTYPE_FLOAT32))

    def commit(
        self,
        worker_id: str,
        base_version: int,
        kind: int,
        payload: WirePayload,
        request_id: str = "",
        reply_dtype: int = pb.DTYPE_FLOAT32,
    ) -> CommitOutcome:
        rule = self.require_initialized()
        reply_dtype = check_reply_dtype(reply_dtype)
        if len(request_id) > MAX_REQUEST_ID_LENGTH:
            raise InvalidArgument(
                f"request_id has {len(request_id)} characters; at most {MAX_REQUEST_ID_LENGTH}",
                reason="bad_request_id",
            )
        receipt = self.ledger.lookup(request_id)
        if receipt is not None:
            # Checked before the worker: the retry may come from the same worker after it
            # registered again (lease expiry, server restart) under a new id.
            if worker_id in self.registry:
                self.registry.touch(worker_id)
            return CommitOutcome(self.encoded(reply_dtype), receipt.staleness, receipt.stats, duplicate=True)
        worker = self.registry.get(worker_id)
        gradient = self._validated_payload(kind, payload, base_version)
        staleness = self.version - base_version
        scale = -self.rule_params.learning_rate if kind == pb.PAYLOAD_KIND_GRADIENT else 1.0
        stats = rule.apply(self._theta, gradient, worker_id, staleness, scale)
        self.commits_applied += 1
        worker.commits += 1
        self.registry.touch(worker_id)
        self.snapshot = Snapshot(self.version + 1, {})
        self.encoded(reply_dtype)
        self.ledger.record(worker_id, request_id, Receipt(self.version, staleness, stats))
        return CommitOutcome(self.snapshot, staleness, stats)

    def encoded(self, dtype: int) -> Snapshot:
        """The current snapshot, with `dtype`'s encoding produced if it is not there yet."""
        snapshot = self.snapshot
        if dtype not in snapshot.encodings:
            values = self._theta
            snapshot.encodings[dtype] = encode(values, dtype)
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

    # -- helpers -------------------------------------------------------------------------------

    def checkpoint(self, config: dict[str, object]) -> Checkpoint:
        """Everything a restarted server needs, consistent at one version (run on the applier:
        the rule's global state and the ledger change with every commit)."""
        rule = self.require_initialized()
        return Checkpoint(
            version=self.snapshot.version,
            commits_applied=self.commits_applied,
            spec=tuple((s.name, s.shape) for s in self.spec),
            theta=self._theta.copy(),
            config=config,
            rule_state=rule.global_state(),
            receipts=self.ledger.entries(),
        )

    def restore(self, checkpoint: Checkpoint) -> list[str]:
        """Serve `checkpoint`'s central variable (before any worker registers); returns warnings.

        Workers are not restored: they register again, with fresh per-worker rule state.
        """
        if self.rule is not None:
            raise RuntimeError("restore() needs a server that is not initialised yet")
        warnings = []
        self.spec = [ParamSpec(name, shape) for name, shape in checkpoint.spec]
        self._theta = np.array(checkpoint.theta, dtype=np.float32, copy=True).reshape(-1)
        rule = create_rule(self.rule_name, self.rule_params, self._theta.size)
        if checkpoint.rule_state:
            if checkpoint.config.get("rule") == self.rule_name:
                try:
                    rule.load_global_state(dict(checkpoint.rule_state))
                except ValueError as error:
                    warnings.append(f"rule state not restored: {error}")
            else:
                warnings.append(
                    f"rule state of {checkpoint.config.get('rule')!r} not restored into rule {self.rule_name!r}"
                )
        self.rule = rule
        self.commits_applied = checkpoint.commits_applied
        self.snapshot = Snapshot(checkpoint.version, {})
        self.ledger.restore(dict(checkpoint.receipts))
        return warnings

    def _forget(self, worker_id: str) -> None:
        self.registry.remove(worker_id)
        self.ledger.forget_worker(worker_id)
        if self.rule is not None:
            self.rule.remove_worker(worker_id)

    def require_initialized(self) -> CommitRule:
        if self.rule is None:
            raise FailedPrecondition(
                "central variable not initialised: no worker has registered yet", reason="not_initialized"
            )
        return self.rule

    def _initialize(self, spec: Sequence[ParamSpec], initial: pb.Tensor | None) -> None:
        if initial is None:
            raise FailedPrecondition(
                "central variable not initialised: the first worker to register must send initial_parameters",
                reason="not_initialized",
            )
        size = sum(s.size for s in spec)
        values = self._decode(initial, "initial_parameters")
        if values.size != size:
            raise InvalidArgument(
                f"initial_parameters has {values.size} values but the spec describes {size}",
                reason="bad_shape",
            )
        if not all_finite(values):
            raise InvalidArgument("initial_parameters contains NaN or Inf", reason="non_finite")
        self.spec = list(spec)
        self._theta = values.reshape(-1).copy()
        self.rule = create_rule(self.rule_name, self.rule_params, size)
        self.snapshot = Snapshot(0, {})

    def expected_payload_bytes(self, dtype: int, shape: tuple[int, ...]) -> int:
        """Bytes a payload of this dtype and shape must have; InvalidArgument unless it is flat [P]."""
        self.require_initialized()
        try:
            itemsize = numpy_dtype(dtype).itemsize
        except TensorDecodeError as error:
            raise InvalidArgument(f"payload: {error}", reason="bad_payload") from None
        self._check_payload_shape(shape)
        return self.num_parameters * itemsize

    def _check_payload_shape(self, shape: tuple[int, ...]) -> None:
        if shape != (self.num_parameters,):
            raise InvalidArgument(
                f"payload shape {list(shape)} does not match the central variable's "
                f"[{self.num_parameters}] (all registered parameters, flattened in spec order)",
                reason="bad_shape",
            )

    def _validated_payload(self, kind: int, payload: WirePayload, base_version: int) -> np.ndarray:
        if kind not in (pb.PAYLOAD_KIND_GRADIENT, pb.PAYLOAD_KIND_UPDATE):
            raise InvalidArgument(
                f"payload kind {kind} is not PAYLOAD_KIND_GRADIENT or PAYLOAD_KIND_UPDATE", reason="bad_kind"
            )
        try:
            values = decode(payload.dtype, payload.shape, payload.data)
        except TensorDecodeError as error:
            raise InvalidArgument(f"payload: {error}", reason="bad_payload") from None
        self._check_payload_shape(values.shape)
        if base_version < 0:
            raise InvalidArgument(f"base_version {base_version} is negative", reason="bad_version")
        if base_version > self.version:
            raise InvalidArgument(
                f"base_version {base_version} is ahead of the server's version {self.version}",
                reason="bad_version",
            )
        if not all_finite(values):
            raise InvalidArgument("payload contains NaN or Inf", reason="non_finite")
        return values

    @staticmethod
    def _decode(tensor: pb.Tensor, field: str) -> np.ndarray:
        try:
            return tensor_to_array(tensor)
        except TensorDecodeError as error:
            raise InvalidArgument(f"{field}: {error}", reason="bad_payload") from None
