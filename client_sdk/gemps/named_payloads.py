"""Named arrays matched by name to the registered spec, before anything is sent.

A commit's payload or buffer delta may be given by name (a dict of arrays, in any order). The
flat vector the wire carries is laid out in the spec's order, so a mapping is put in that order by
its names, never by its own: a mapping in another order than the registration's must not apply
one parameter's values to another. A missing or unknown name (with the spec's closest name when
one looks misspelled) or a shape other than the spec's is refused with NamedPayloadError
(INVALID_ARGUMENT) naming every offending entry, so nothing partial reaches a server.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Mapping, Sequence
from typing import Any

from gemps.errors import FailedPreconditionError, InvalidArgumentError, NamedPayloadError
from gemps_proto import vectors
from gemps_proto.reasons import Reason
from gemps_proto.schema import Buffers, ParameterSpec, buffer_counts, buffer_numbers
from gemps_proto.vectors import ArrayLike, Vector

# How many offending entries a message spells out before summarising (a model has thousands).
MAX_LISTED = 8


def payload_vector(payload: ArrayLike | Mapping[str, Any], spec: Sequence[ParameterSpec]) -> Vector:
    """A commit's payload as one float32 vector in spec order: a mapping by name (flat_by_name),
    an array as it is (its size is checked where θ's layout is known)."""
    if isinstance(payload, Mapping):
        return flat_by_name("payload", payload, spec)
    return vectors.flat(_array("payload", "", payload, float32=True))


def buffer_delta(delta: ArrayLike | Mapping[str, Any] | Buffers, spec: Sequence[ParameterSpec]) -> Buffers:
    """A commit's buffer delta by kind, as `spec` splits it: Buffers of the spec's counts, a
    mapping by name (buffers_by_name), or one flat array of every entry in spec order; else
    InvalidArgumentError."""
    if isinstance(delta, Buffers):
        return checked_buffers("buffer_delta", delta, spec)
    if isinstance(delta, Mapping):
        return buffers_by_name("buffer_delta", delta, spec)
    try:
        return Buffers.of(delta, spec)
    except vectors.Int64RangeError:
        raise  # a value beyond int64, not a shape that does not fit
    except ValueError as error:
        raise InvalidArgumentError(
            f"buffer_delta shape {list(vectors.shape(delta))} does not fit the buffer spec "
            f"({sum(entry.size for entry in spec)} values: {error})",
            InvalidArgumentError.code,
            Reason.BAD_SHAPE,
        ) from None


def flat_by_name(what: str, values: Mapping[str, Any], spec: Sequence[ParameterSpec]) -> Vector:
    """One float32 vector of `values` in `spec`'s order, each entry of its spec shape; else
    NamedPayloadError naming what differs (`what` says whose values: "payload")."""
    return vectors.concatenate(_matched(what, "parameter", values, spec, float32=True))


def buffers_by_name(what: str, values: Mapping[str, Any], spec: Sequence[ParameterSpec]) -> Buffers:
    """Named buffer values split by kind in `spec`'s order (integer entries rounded to int64);
    NamedPayloadError as flat_by_name."""
    arrays = _matched(what, "buffer", values, spec, float32=False)
    return Buffers.of({entry.name: array for entry, array in zip(spec, arrays, strict=True)}, spec)


def checked_buffers(what: str, buffers: Buffers, spec: Sequence[ParameterSpec]) -> Buffers:
    """`buffers` when each kind holds as many values as `spec` describes; else InvalidArgumentError."""
    expected = buffer_counts(spec)
    given = (vectors.size(buffers.floats), vectors.size(buffers.integers))
    if given != expected:
        raise InvalidArgumentError(
            f"{what} has {given[0]} float32 and {given[1]} int64 values; the buffer spec has "
            f"{expected[0]} and {expected[1]}",
            InvalidArgumentError.code,
            Reason.BAD_SHAPE,
        )
    return buffers


def explained(
    refused: FailedPreconditionError,
    worker: tuple[Sequence[ParameterSpec], Sequence[ParameterSpec]],
    server: tuple[Sequence[ParameterSpec], Sequence[ParameterSpec]],
) -> FailedPreconditionError:
    """The server's spec-mismatch refusal of a registration, saying so when the worker's
    (parameter spec, buffer spec) has the server's entries in another order: taking the server's
    order instead would lay a flat payload (RemoteModel's gradients) out in the wrong one."""
    hints = [
        f"the worker lists the same {what}s in another order; register them in the central variable's: "
        + _listed([entry.name for entry in theirs], ", ")
        for what, mine, theirs in (("parameter", worker[0], server[0]), ("buffer", worker[1], server[1]))
        if list(mine) != list(theirs) and sorted(mine, key=_name) == sorted(theirs, key=_name)
    ]
    if not hints:
        return refused
    return FailedPreconditionError(f"{refused.message} ({'; '.join(hints)})", refused.code, refused.reason)


def _name(entry: ParameterSpec) -> str:
    return entry.name


def _matched(
    what: str, noun: str, values: Mapping[str, Any], spec: Sequence[ParameterSpec], *, float32: bool
) -> list[Vector]:
    """`values` as arrays in `spec`'s order, after checking names, then shapes."""
    expected = {entry.name: entry for entry in spec}
    missing = [entry.name for entry in spec if entry.name not in values]
    unknown = [name for name in values if name not in expected]
    if missing or unknown:
        problems = [f"missing {noun} {expected[name].describe()}" for name in missing]
        problems += [f"no {noun} named {name}{_did_you_mean(name, missing or list(expected))}" for name in unknown]
        raise NamedPayloadError(
            f"{what} does not name the registered {noun}s: {_listed(problems)}", missing=missing, unknown=unknown
        )
    arrays = [_array(what, entry.name, values[entry.name], float32=float32) for entry in spec]
    given = [tuple(array.shape or ()) for array in arrays]  # a memoryview's shape may be None, says typeshed
    shapes = {
        entry.name: (entry.shape, shape) for entry, shape in zip(spec, given, strict=True) if shape != entry.shape
    }
    if shapes:
        problems = [
            f"{name!r} has {math.prod(given)} values of shape {list(given)}, registered {list(wanted)}"
            for name, (wanted, given) in shapes.items()
        ]
        raise NamedPayloadError(f"{what} does not have the registered shapes: {_listed(problems)}", shapes=shapes)
    return arrays


def _array(what: str, name: str, value: Any, *, float32: bool) -> Vector:
    """`value` as float32 values (`float32`), else in its own kind; InvalidArgumentError for what is
    not numbers ("payload" itself when `name` is empty)."""
    whose = f"{what} {name!r}" if name else what
    try:
        array = vectors.as_float32(value) if float32 else buffer_numbers(name, value)
    except vectors.Int64RangeError:
        raise  # an integer buffer's value beyond int64, named with its buffer
    except (TypeError, ValueError) as error:
        raise InvalidArgumentError(
            f"{whose} is not an array of numbers: {error}", InvalidArgumentError.code, Reason.BAD_DTYPE
        ) from None
    dtype = getattr(array, "dtype", None)  # memoryviews have none: numbers by construction
    if getattr(dtype, "kind", "f") not in "biuf":
        raise InvalidArgumentError(
            f"{whose} has dtype {dtype}, not numbers", InvalidArgumentError.code, Reason.BAD_DTYPE
        )
    return array


def _did_you_mean(name: object, candidates: Sequence[str]) -> str:
    """A hint naming the candidate closest to a misspelled name ("" when none is close)."""
    if not isinstance(name, str):
        return ""
    close = difflib.get_close_matches(name, candidates, n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _listed(problems: Sequence[str], separator: str = "; ") -> str:
    shown = problems[:MAX_LISTED]
    more = len(problems) - len(shown)
    return separator.join(shown) + (f"{separator}and {more} more" if more > 0 else "")
