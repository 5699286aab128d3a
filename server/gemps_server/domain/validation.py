"""The checks on what workers send, each raising the ServiceError (and Reason) the protocol names.

The state runs them in the protocol's order before it mutates anything, so a rejected request
never touches the central variable; the wire runs the ones a streamed request's header already
allows (its sizes) before a byte of its data is received. Each is a function of what it checks
and the few facts of the state it needs, passed in: nothing here holds state.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from gemps_proto import jobs
from gemps_proto.gradient_sums import GradientSums
from gemps_proto.reasons import Reason
from gemps_proto.reply_differences import DIFFERENCE_DTYPES
from gemps_proto.schema import PULL_WAITS, Buffers, Evaluation, ParameterSpec, PayloadKind, buffer_counts
from gemps_proto.tensor_codec import (
    WIRE_DTYPE_NAMES,
    EncodedBuffers,
    EncodedTensor,
    TensorDecodeError,
    dtype_name,
    expected_payload_nbytes,
)
from gemps_server.domain.errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from gemps_server.domain.ledger import MAX_CLIENT_ID_LENGTH, MAX_REQUEST_ID_LENGTH, valid_client_id
from gemps_server.domain.records import PartitionOf
from gemps_server.native import all_finite, decoded_payload, max_abs

# How many spec differences a FAILED_PRECONDITION message spells out before summarising.
MAX_LISTED_DIFFERENCES = 5
# The most characters in a worker's name or an evaluation's dataset label: they are kept in
# memory, logged and sent back in Status (a 50 MiB name would be all three).
MAX_NAME_LENGTH = 256
# The most named tensors in a spec (parameters and buffers together): the largest published
# models have a few thousand; a million-entry spec took the event loop seconds to read.
MAX_SPEC_ENTRIES = 65_536


# -- names and specs -------------------------------------------------------------------------


def check_name(what: str, value: str) -> None:
    """InvalidArgument for a name or label longer than MAX_NAME_LENGTH characters."""
    if len(value) > MAX_NAME_LENGTH:
        raise InvalidArgument(f"{what} has {len(value)} characters; at most {MAX_NAME_LENGTH}", Reason.TOO_LONG)


def check_client_id(client_id: str) -> None:
    """InvalidArgument unless `client_id` is a valid client id (the ledger's scope)."""
    if not valid_client_id(client_id):
        raise InvalidArgument(
            f"client_id must be at most {MAX_CLIENT_ID_LENGTH} visible ASCII characters", Reason.BAD_CLIENT_ID
        )


def check_job(job: str) -> None:
    """InvalidArgument unless `job` is empty (none said) or a job identity (gemps_proto.jobs)."""
    try:
        jobs.check_job(job)
    except ValueError as error:
        raise InvalidArgument(str(error), Reason.BAD_JOB) from None


def check_same_job(held: str, job: str) -> None:
    """FailedPrecondition (other_job) when a client of job `job` registers where θ is job `held`'s:
    its address belongs to another job now (a reused address, a stale replica list)."""
    if job and held and job != held:
        raise FailedPrecondition(
            f"this server holds job {jobs.describe_job(held)}'s central variable, not job {jobs.describe_job(job)}'s: "
            "the address belongs to another job now",
            Reason.OTHER_JOB,
        )


def check_spec_length(entries: int) -> None:
    """InvalidArgument for a spec of more than MAX_SPEC_ENTRIES tensors (before it is read)."""
    if entries > MAX_SPEC_ENTRIES:
        raise InvalidArgument(
            f"spec has {entries} entries; at most {MAX_SPEC_ENTRIES} parameters and buffers together", Reason.BAD_SPEC
        )


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


def check_same_spec(
    server: tuple[Sequence[ParameterSpec], Sequence[ParameterSpec]],
    worker: tuple[Sequence[ParameterSpec], Sequence[ParameterSpec]],
) -> None:
    """FailedPrecondition spelling out the first differences unless a later worker's (parameter
    spec, buffer spec) match the server's."""
    differences = spec_differences(server[0], worker[0]) + spec_differences(server[1], worker[1], "buffer")
    if differences:
        shown = differences[:MAX_LISTED_DIFFERENCES]
        more = len(differences) - len(shown)
        raise FailedPrecondition(
            "parameter spec does not match the central variable's: "
            + "; ".join(shown)
            + (f"; and {more} more" if more > 0 else ""),
            Reason.SPEC_MISMATCH,
        )


# -- the first worker's upload: sizes ----------------------------------------------------------


def check_size(
    spec: Sequence[ParameterSpec],
    buffer_spec: Sequence[ParameterSpec],
    partition: PartitionOf,
    max_parameters: int | None,
) -> None:
    """ResourceExhausted when this process would hold more than `max_parameters` values of θ (its
    partition's range) and buffers together: the first worker decides θ's size, this bounds it."""
    if max_parameters is None:
        return
    start, stop = partition.bounds(sum(s.size for s in spec))
    held = stop - start + sum(entry.size for entry in buffer_spec)
    if held > max_parameters:
        where = "" if partition.count == 1 else f" ({partition}: {stop - start} of θ's values)"
        raise ResourceExhausted(
            f"the model has {held} values to hold here{where}; this server holds at most "
            f"{max_parameters} (its --max-parameters)",
            Reason.TOO_LARGE,
        )


def initial_range(spec: Sequence[ParameterSpec], count: int, partition: PartitionOf) -> slice:
    """Which of `count` initial values `partition` keeps: its own range when all P came, all of
    them when just that range came; InvalidArgument for any other count."""
    total = sum(s.size for s in spec)
    if total < partition.count:
        raise InvalidArgument(
            f"the model has {total} values, fewer than the {partition.count} partitions of θ it is split into",
            Reason.BAD_SPEC,
        )
    start, stop = partition.bounds(total)
    if count == total:
        return slice(start, stop)  # all of θ sent to one partition: it keeps its range
    if count != stop - start:
        held = "" if partition.count == 1 else f" ({partition}: {stop - start} of them, or all)"
        raise InvalidArgument(
            f"initial_parameters has {count} values but the spec describes {total}{held}", Reason.BAD_SHAPE
        )
    return slice(None)


def check_buffer_count(buffer_spec: Sequence[ParameterSpec], counts: tuple[int, int]) -> None:
    """InvalidArgument unless the (float32, int64) counts of initial buffer values are what
    `buffer_spec` describes."""
    for what, count, size in zip(
        ("initial_buffers", "initial_integer_buffers"), counts, buffer_counts(buffer_spec), strict=True
    ):
        if count != size:
            kind = "float32" if what == "initial_buffers" else "int64"
            raise InvalidArgument(
                f"{what} has {count} values but buffer_spec describes {size} of {kind}", Reason.BAD_SHAPE
            )


def check_upload(
    spec: Sequence[ParameterSpec],
    buffer_spec: Sequence[ParameterSpec],
    counts: tuple[int, tuple[int, int] | None],
    partition: PartitionOf,
    max_parameters: int | None,
) -> None:
    """Everything the first worker's initial values must satisfy that their header already says:
    `counts` of parameter values and of (float32, int64) buffer values (None: no buffers sent)."""
    check_spec(spec, buffer_spec)
    check_size(spec, buffer_spec, partition, max_parameters)
    initial_range(spec, counts[0], partition)
    if counts[1] is not None:
        check_buffer_count(buffer_spec, counts[1])


# -- tensors ---------------------------------------------------------------------------------


def decoded(tensor: EncodedTensor, what: str) -> np.ndarray:
    """`tensor`'s values in θ's wire dtypes; InvalidArgument (BAD_PAYLOAD) naming `what` when they
    do not decode."""
    try:
        return tensor.decode()
    except TensorDecodeError as error:
        raise InvalidArgument(f"{what}: {error}", Reason.BAD_PAYLOAD) from None


def initial_values(spec: Sequence[ParameterSpec], initial: EncodedTensor, partition: PartitionOf) -> np.ndarray:
    """The first worker's initial parameters that `partition` keeps (initial_range), flat and
    finite: a view of the received values."""
    values = decoded(initial, "initial_parameters").reshape(-1)
    values = values[initial_range(spec, values.size, partition)]
    if not all_finite(values):
        raise InvalidArgument("initial_parameters contains NaN or Inf", Reason.NON_FINITE)
    return values


def decoded_int64(tensor: EncodedTensor, what: str) -> np.ndarray:
    """`tensor`'s int64 values; InvalidArgument (BAD_PAYLOAD) naming `what` when they do not decode."""
    try:
        return tensor.decode_int64()
    except TensorDecodeError as error:
        raise InvalidArgument(f"{what}: {error}", Reason.BAD_PAYLOAD) from None


def initial_buffers(
    buffer_spec: Sequence[ParameterSpec], initial: EncodedBuffers | None, partition: PartitionOf
) -> Buffers:
    """The first worker's buffers as new flat arrays (float32, int64), checked against
    `buffer_spec` (only partition 0 holds buffers)."""
    if buffer_spec and partition.index != 0:
        raise InvalidArgument(f"buffers are held by partition 0, not {partition}", Reason.BAD_SPEC)
    size = sum(entry.size for entry in buffer_spec)
    if initial is None:
        if size:
            raise InvalidArgument(
                f"buffer_spec describes {size} values but initial_buffers is missing", Reason.BAD_SHAPE
            )
        return Buffers()
    floats = np.empty(0, np.float32) if initial.floats is None else decoded(initial.floats, "initial_buffers")
    integers = (
        np.empty(0, np.int64)
        if initial.integers is None
        else decoded_int64(initial.integers, "initial_integer_buffers")
    )
    floats, integers = floats.reshape(-1), integers.reshape(-1)
    check_buffer_count(buffer_spec, (floats.size, integers.size))
    if not all_finite(floats):
        raise InvalidArgument("initial_buffers contains NaN or Inf", Reason.NON_FINITE)
    return Buffers(np.array(floats, dtype=np.float32, copy=True), np.array(integers, dtype=np.int64, copy=True))


def buffers_after(buffers: Buffers, delta: EncodedBuffers | None, buffer_spec: Sequence[ParameterSpec]) -> Buffers:
    """The central `buffers` (laid out as `buffer_spec` says) once `delta` is added (DOWNPOUR for
    buffers: see docs): new arrays, checked for shape, finiteness and (integers) int64's range,
    naming the buffer a sum would leave it; `buffers` itself when there is no delta. Integer
    buffers add exactly."""
    if delta is None:
        return buffers
    floats, integers = buffers.floats, buffers.integers
    if delta.floats is not None:
        values = decoded(delta.floats, "buffer_delta")
        _check_delta_shape("buffer_delta", values, floats)
        with np.errstate(over="ignore"):  # an overflow is refused just below
            floats = floats + values
        if not all_finite(floats):
            raise InvalidArgument("buffer_delta contains NaN or Inf, or makes a buffer overflow", Reason.NON_FINITE)
    if delta.integers is not None:
        steps = decoded_int64(delta.integers, "integer_buffer_delta")
        _check_delta_shape("integer_buffer_delta", steps, integers)
        added = integers + steps  # wraps around on overflow: refused just below
        wrapped = (integers ^ added) & (steps ^ added) < 0  # the sign flipped against both addends
        if wrapped.any():
            first = int(np.argmax(wrapped))
            raise InvalidArgument(
                f"integer_buffer_delta makes buffer {_integer_entry(buffer_spec, first)!r} leave int64's range "
                f"[-2**63, 2**63 - 1] ({integers[first]} + {steps[first]}); nothing changed",
                Reason.BAD_PAYLOAD,
            )
        integers = added
    return Buffers(floats, integers)


def _integer_entry(buffer_spec: Sequence[ParameterSpec], index: int) -> str:
    """The name of the integer buffer holding value `index` of the flat integer buffers (which
    the spec's integer entries lay out, in order)."""
    for entry in (entry for entry in buffer_spec if entry.integer):
        if index < entry.size:
            return entry.name
        index -= entry.size
    raise AssertionError(f"{index} values past the integer buffers of {list(buffer_spec)}")


def _check_delta_shape(what: str, values: np.ndarray, central: np.ndarray) -> None:
    if values.shape != central.shape:
        kind = "float32" if central.dtype == np.float32 else "int64"
        raise InvalidArgument(
            f"{what} shape {list(values.shape)} does not match the central {kind} buffers' "
            f"[{central.size}] (the registered {kind} buffers, flattened in buffer spec order)",
            Reason.BAD_SHAPE,
        )


# -- commits ---------------------------------------------------------------------------------


def check_reply_dtype(dtype: int, *, commit: bool = False) -> None:
    """InvalidArgument unless replies can carry the central variable in `dtype`: θ's wire dtypes,
    and for a `commit` the difference codes too (gemps_proto.reply_differences)."""
    allowed = [*WIRE_DTYPE_NAMES.values(), *(sorted(DIFFERENCE_DTYPES) if commit else ())]
    if dtype not in allowed:
        supported = ", ".join(dtype_name(d) for d in allowed)
        what = "a commit's" if commit else "a pull's (difference replies are a commit's)"
        raise InvalidArgument(f"reply_dtype {dtype_name(dtype)} is not one of {what}: {supported}", Reason.BAD_DTYPE)


def check_pull_wait(seconds: float) -> None:
    """InvalidArgument for a pull's wait_seconds outside [0, MAX_PULL_WAIT_SECONDS] or not a number."""
    if not PULL_WAITS.admits(seconds):
        raise InvalidArgument(f"wait_seconds {seconds!r} is not within {PULL_WAITS}", Reason.BAD_WAIT)


def check_request_id(request_id: str) -> None:
    """InvalidArgument for a request id longer than the ledger keeps."""
    if len(request_id) > MAX_REQUEST_ID_LENGTH:
        raise InvalidArgument(
            f"request_id has {len(request_id)} characters; at most {MAX_REQUEST_ID_LENGTH}", Reason.BAD_REQUEST_ID
        )


def payload_kind(value: int) -> PayloadKind:
    """The PayloadKind a commit's wire value names; InvalidArgument (BAD_KIND) for any other."""
    try:
        return PayloadKind(value)
    except ValueError:
        kinds = " or ".join(kind.wire_name for kind in PayloadKind)
        raise InvalidArgument(f"payload kind {value} is not {kinds}", Reason.BAD_KIND) from None


def check_payload_shape(shape: tuple[int, ...], num_parameters: int) -> None:
    """InvalidArgument unless a payload is flat [P], P the parameters held here."""
    if shape != (num_parameters,):
        raise InvalidArgument(
            f"payload shape {list(shape)} does not match the central variable's "
            f"[{num_parameters}] (all registered parameters, flattened in spec order)",
            Reason.BAD_SHAPE,
        )


def expected_payload_bytes(dtype: int, shape: tuple[int, ...], num_parameters: int) -> int:
    """Bytes a payload of this dtype and shape must have; InvalidArgument unless it is flat [P]."""
    try:
        size = expected_payload_nbytes(dtype, shape)
    except TensorDecodeError as error:
        raise InvalidArgument(f"payload: {error}", Reason.BAD_PAYLOAD) from None
    check_payload_shape(shape, num_parameters)
    return size


def validated_payload(
    kind: int,
    payload: EncodedTensor,
    base_version: int,
    num_parameters: int,
    version: int,
    payload_peak: float | None = None,
    out: np.ndarray | None = None,
) -> tuple[PayloadKind, np.ndarray, float]:
    """A commit's kind, its values and max |value| (which the rules' overflow bounds use), checked
    in the protocol's order against P and the server's `version`; `payload_peak` where the wire
    measured it (NaN: a value is not finite), else measured here. A coded payload's values are
    decoded into `out` (float32, P of them) when given and of its size."""
    kind_of = payload_kind(kind)
    fits = out is not None and all(d >= 0 for d in payload.shape) and math.prod(payload.shape) == out.size
    try:  # in any of a payload's dtypes, blockwise codes included (into `out`, when it fits)
        values, decoded_peak = decoded_payload(payload, out if fits else None)
    except TensorDecodeError as error:
        raise InvalidArgument(f"payload: {error}", Reason.BAD_PAYLOAD) from None
    check_payload_shape(values.shape, num_parameters)
    if base_version < 0:
        raise InvalidArgument(f"base_version {base_version} is negative", Reason.BAD_VERSION)
    if base_version > version:
        raise InvalidArgument(
            f"base_version {base_version} is ahead of the server's version {version}", Reason.BAD_VERSION
        )
    # NaN when a value is not finite: one pass for both (made by the wire or the decoder, where one did)
    peak = payload_peak if payload_peak is not None else decoded_peak if decoded_peak is not None else max_abs(values)
    if not math.isfinite(peak):
        raise InvalidArgument("payload contains NaN or Inf", Reason.NON_FINITE)
    return kind_of, values, peak


def check_gradient_sums(kind: PayloadKind, sums: GradientSums | None) -> None:
    """InvalidArgument (BAD_GRADIENT_SUMS) for sums no window of local steps has, or sent with a
    gradient commit (the server measures those itself: domain/noise.py)."""
    if sums is None:
        return
    problem = "the server measures gradient commits itself" if kind is PayloadKind.GRADIENT else sums.problem()
    if problem:
        raise InvalidArgument(f"commit refused, nothing changed: {problem}", Reason.BAD_GRADIENT_SUMS)


def check_evaluation(report: Evaluation, current_version: int) -> None:
    """InvalidArgument for a held-out evaluation the server cannot have produced: BAD_EVALUATION for
    figures out of range, BAD_VERSION for a version ahead of the server's (as a commit's base: the
    server's history went back under the evaluator, a restore from a checkpoint, and it evaluates
    θ again)."""
    check_name("dataset", report.dataset)
    if not (math.isfinite(report.loss) and report.loss >= 0):
        raise InvalidArgument(f"held-out loss {report.loss} must be finite and >= 0", Reason.BAD_EVALUATION)
    if not 0.0 <= report.accuracy <= 1.0:
        raise InvalidArgument(f"accuracy {report.accuracy} outside [0, 1]", Reason.BAD_EVALUATION)
    if report.version > current_version:
        raise InvalidArgument(
            f"evaluated version {report.version} is ahead of the server's version {current_version}",
            Reason.BAD_VERSION,
        )
