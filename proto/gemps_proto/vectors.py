"""θ's values with or without numpy: the one place the SDK's core meets its array type.

`pip install gemps` is the SDK without numpy (grpcio and protobuf only, docs/guides/install.md).
Then θ, payloads and buffers are the standard library's memoryviews of float32 ("f") or int64 ("q")
values, shaped as numpy's arrays would be: `.shape`, `.tolist()`, and `numpy.asarray(view)` or
`torch.frombuffer(view, dtype=torch.float32)` take them without a copy. Users pass memoryviews,
`array.array`s or (nested) lists. With numpy installed (`gemps[numpy]`; every other extra has it)
they are numpy arrays, as they always were: each function below is numpy's own code then.

What needs arithmetic on every value (compressed commits, bfloat16 on the wire, difference replies,
the torch layer) needs numpy: `require` names the feature and the install line.

Typed for each world, one mypy pass each (`make typecheck`). With numpy (pyproject.toml's
[tool.mypy], HAVE_NUMPY always true) `Vector` is numpy's array, as users with numpy get it. The SDK
alone (tools/mypy-sdk-alone.ini over the SDK and the protocol, HAVE_NUMPY always false) has it a
memoryview and `require` a refusal, so what runs only with numpy is out of that pass's reach and the
rest is checked against memoryviews: the SDK's core touches its values only through these functions
and what memoryviews share with arrays (len, slicing, tobytes, nbytes, itemsize, shape).
tests/integration/test_sdk_without_numpy.py runs that path against a real server.
"""

from __future__ import annotations

import array
import math
import sys
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, NoReturn, TypeAlias

try:
    import numpy as np

    HAVE_NUMPY = True
except ImportError:  # the SDK installed alone
    HAVE_NUMPY = False

if TYPE_CHECKING:
    import numpy as np
    from numpy.typing import ArrayLike as NumpyArrayLike

    if HAVE_NUMPY:
        Vector: TypeAlias = np.ndarray
    else:  # the SDK alone: its values are the standard library's memoryviews
        Vector: TypeAlias = memoryview
    #: what users may pass as values: numpy's array-likes, or memoryviews and array.array's of numbers
    ArrayLike: TypeAlias = NumpyArrayLike | memoryview | array.array[Any]
else:
    Vector: TypeAlias = Any
    ArrayLike: TypeAlias = Any

#: the wire's float32 and int64 values, as the standard library's memoryview formats
FLOAT32_FORMAT = "f"
INT64_FORMAT = "q"
# Buffer formats of numbers (struct's codes), with the byte-order prefixes numpy may add.
_INTEGER_FORMATS = frozenset("bBhHiIlLqQ?")
_FLOAT_FORMATS = frozenset("efd")
_BYTE_ORDER = "@=<"


class Int64RangeError(ValueError):
    """A value an integer buffer's int64 cannot hold (beyond its range, NaN, inf), refused by name
    where numpy's cast would wrap it, make it up, or keep it as a float or an object."""


def _outside_int64(value: object) -> Int64RangeError:
    return Int64RangeError(f"{value} is outside int64's range [-2**63, 2**63 - 1]")


class NumpyRequiredError(ImportError):
    """A feature that computes on every value, asked for where numpy is not installed."""

    def __init__(self, feature: str) -> None:
        super().__init__(
            f"{feature} needs numpy, which is not installed here: pip install 'gemps[numpy]' "
            "(the SDK alone carries θ as float32 memoryviews, docs/guides/install.md)",
            name="numpy",
        )


if TYPE_CHECKING and not HAVE_NUMPY:  # the SDK alone: it always refuses, so what follows it needs numpy

    def require(feature: str) -> NoReturn: ...

else:

    def require(feature: str) -> None:
        """NumpyRequiredError naming `feature` unless numpy is installed."""
        if not HAVE_NUMPY:
            raise NumpyRequiredError(feature)


if not HAVE_NUMPY and sys.byteorder != "little":  # memoryviews are in the host's order, the wire little-endian
    raise NumpyRequiredError("the SDK on a big-endian machine")


def float32s(data: bytes | bytearray | memoryview) -> Vector:
    """A flat float32 view of little-endian wire bytes (no copy; read-only for bytes)."""
    if HAVE_NUMPY:
        return np.frombuffer(data, dtype="<f4")
    return _cast(memoryview(data), FLOAT32_FORMAT)


def int64s(data: bytes | bytearray | memoryview) -> Vector:
    """A flat int64 view of little-endian wire bytes (no copy)."""
    if HAVE_NUMPY:
        return np.frombuffer(data, dtype="<i8")
    return _cast(memoryview(data), INT64_FORMAT)


def empty_float32() -> Vector:
    if HAVE_NUMPY:
        return np.empty(0, np.float32)
    return memoryview(array.array(FLOAT32_FORMAT))


def empty_int64() -> Vector:
    if HAVE_NUMPY:
        return np.empty(0, np.int64)
    return memoryview(array.array(INT64_FORMAT))


def writable_bytes(nbytes: int) -> memoryview:
    """A new buffer of `nbytes` to receive wire bytes into (not zeroed with numpy: each is written),
    aligned for float32 and int64 views of it."""
    if HAVE_NUMPY:
        return np.empty(nbytes, np.uint8).data
    return memoryview(bytearray(nbytes))


def as_float32(value: Any) -> Vector:
    """An array-like's values as float32, in its shape (no copy when they already are).
    TypeError or ValueError for what is not numbers."""
    if HAVE_NUMPY:
        return np.asarray(value, dtype=np.float32)
    return _converted(value, FLOAT32_FORMAT)


def as_numbers(value: Any) -> Vector:
    """An array-like's values in their own kind: integers (and booleans) as they are, the rest float
    (numpy's own dtype with numpy). Python integers are int64 on both paths, Int64RangeError for one
    it cannot hold (numpy made them objects past 64 bits, floats when uint64's met negative ones).
    Without numpy, TypeError or ValueError for what is not numbers."""
    if HAVE_NUMPY:
        values = np.asarray(value)
        if values.size and values.dtype.kind in "fO":  # Python integers numpy typed as no integer dtype?
            numbers = values.tolist() if values.dtype.kind == "O" else value
            if _only_integers(numbers):
                return np.asarray(as_int64_exactly(numbers))
        return values
    return _converted(value, None)


def is_integral(value: Any) -> bool:
    """Whether an array-like holds integers (or booleans)."""
    if HAVE_NUMPY:
        kind: str = np.asarray(value).dtype.kind
        return kind in "iub"
    return _format(_converted(value, None)) in _INTEGER_FORMATS


def as_int64(value: Any) -> Vector:
    """Values as int64, in their shape: integers as they are, floating ones rounded to the nearest
    (half to even, as numpy's rint); Int64RangeError for a value int64 cannot hold (beyond its
    range, NaN, inf), which numpy's cast would wrap or make up without a word."""
    if not HAVE_NUMPY:
        return as_int64_exactly(value)
    values = np.asarray(value)
    if values.dtype.kind == "O":  # Python integers beyond 64 bits (or mixed with them): checked one by one
        return np.asarray(as_int64_exactly(values.tolist()))
    if values.dtype.kind not in "iub":
        rounded = np.rint(values.astype(np.float64))
        # 2**63 itself is a float64: the range is [-2**63, 2**63).
        held = np.isfinite(rounded) & (rounded >= -(2.0**63)) & (rounded < 2.0**63)
        if not held.all():
            raise _outside_int64(values[~held].flat[0])
        values = rounded
    elif values.dtype == np.uint64 and values.size and values.max() > np.iinfo(np.int64).max:
        raise _outside_int64(int(values.max()))
    return values.astype(np.int64)


def as_int64_exactly(value: Any) -> memoryview:
    """as_int64 by the standard library: each number converted on its own (_int64_of)."""
    return _converted(value, INT64_FORMAT)


def shape(value: Any) -> tuple[int, ...]:
    """An array-like's shape."""
    if HAVE_NUMPY:
        return tuple(int(d) for d in np.shape(value))
    return _dims(_converted(value, None))


def size(value: Any) -> int:
    """How many values an array-like holds."""
    if HAVE_NUMPY:
        if isinstance(value, np.ndarray):  # its own count: np.size's dispatch costs a microsecond per reply
            return value.size
        return int(np.size(value))
    return math.prod(shape(value))


def flat(values: Vector) -> Vector:
    """A one-dimensional view of values laid out in one piece (a copy when they are not)."""
    if HAVE_NUMPY:
        return values.reshape(-1)
    return _flat(values)


def shaped(values: Vector, new_shape: Sequence[int]) -> Vector:
    """A view of flat values in `new_shape` (no copy)."""
    if HAVE_NUMPY:
        return values.reshape(new_shape)
    return _shaped(values, new_shape)


def concatenate(parts: Sequence[Vector], integers: bool = False, into: memoryview | None = None) -> Vector:
    """Flat values one after another, as one new flat vector of float32 (int64 with `integers`);
    float32 values written into `into` (writable bytes of their size) and viewed there, when given."""
    if HAVE_NUMPY:
        if not parts:
            return empty_int64() if integers else empty_float32()
        flat = [part.reshape(-1) for part in parts]
        return np.concatenate(flat) if into is None else np.concatenate(flat, out=np.frombuffer(into, dtype="<f4"))
    code = INT64_FORMAT if integers else FLOAT32_FORMAT
    joined = bytearray().join([_flat(part) for part in parts])  # one copy
    if into is not None:
        into[:] = joined  # a second, which only a client without numpy makes
    return _cast(memoryview(joined if into is None else into), code)


def copy(values: Vector) -> Vector:
    """A copy of the values, in their shape and kind."""
    if HAVE_NUMPY:
        return np.array(values)
    return _shaped(_cast(memoryview(bytearray(_flat(values))), _format(values)), _dims(values))


def read_only(values: Vector) -> Vector:
    """`values`, no longer writable (a read-only view without numpy)."""
    if HAVE_NUMPY:
        values.flags.writeable = False
        return values
    return values.toreadonly()


#: values a check of finiteness reads at a time: its mask stays in cache, and none of θ's size is
#: made (a byte a value, whose pages a 124M-parameter worker faulted in at every commit)
FINITE_BLOCK = 1 << 18


def all_finite(values: Vector) -> bool:
    """True when no value is NaN or +-Inf. Without numpy: their sum is finite exactly then (float32
    values summed as doubles cannot overflow: 3.4e38 times any count that fits in memory is below
    1.8e308, and Inf - Inf is NaN)."""
    if HAVE_NUMPY:
        if values.size <= FINITE_BLOCK or not values.flags.c_contiguous:
            return bool(np.isfinite(values).all())
        flat, mask = values.reshape(-1), np.empty(FINITE_BLOCK, np.bool_)
        for start in range(0, flat.size, FINITE_BLOCK):
            block = flat[start : start + FINITE_BLOCK]
            if not np.isfinite(block, out=mask[: block.size]).all():
                return False
        return True
    return math.isfinite(sum(_flat(values)))


def little_endian_float32(values: ArrayLike) -> bytes | memoryview:
    """The wire bytes of float32 values: a view of them (no copy) when they already are little-endian
    float32 in one piece, else a copy. The caller keeps `values` unchanged while the view is in use."""
    if HAVE_NUMPY:
        values = np.asarray(values)
        if values.dtype == np.dtype("<f4") and values.flags.c_contiguous:
            return values.reshape(-1).data.cast("B")
        return np.ascontiguousarray(values, dtype="<f4").tobytes()
    return _cast(_flat(_converted(values, FLOAT32_FORMAT)), "B")


def little_endian_int64(values: ArrayLike) -> bytes:
    """The wire bytes of int64 values (a copy)."""
    if HAVE_NUMPY:
        return np.ascontiguousarray(values, dtype="<i8").tobytes()
    return _flat(_converted(values, INT64_FORMAT)).tobytes()


# -- without numpy ---------------------------------------------------------------------------------


def _format(view: memoryview) -> str:
    return view.format.lstrip(_BYTE_ORDER)


def _dims(view: memoryview) -> tuple[int, ...]:
    """A memoryview's shape (typeshed allows None: CPython gives () for a single value)."""
    return view.shape or ()


def _cast(view: memoryview, code: str, dims: Sequence[int] | None = None) -> memoryview:
    """`view`'s bytes as values of `code` (flat, or in `dims`): memoryview casts only through bytes."""
    # typeshed's overloads take each code as a literal; ours is a buffer's own format, or ours
    cast: Callable[..., memoryview] = view.cast("B").cast
    return cast(code) if dims is None else cast(code, list(dims))


def _flat(view: memoryview) -> memoryview:
    if not view.c_contiguous:
        view = _cast(memoryview(view.tobytes()), _format(view), _dims(view))
    return view if view.ndim == 1 else _cast(view, _format(view))


def _shaped(view: memoryview, new_shape: Sequence[int]) -> memoryview:
    if 0 in new_shape:  # memoryviews have no empty dimensions: an empty one-dimensional view
        return view[:0]
    return _cast(view, _format(view), new_shape)


def _converted(value: Any, code: str | None) -> memoryview:
    """`value` (a buffer, a number or nested sequences of numbers) as a memoryview of `code`'s values
    in its shape; `code` None: int64 for integers, else float32."""
    if isinstance(value, bytes | bytearray):  # as numpy: text, not numbers (a memoryview of them is bytes' values)
        raise TypeError("bytes are not numbers: pass memoryview(data).cast('f') for float32 values")
    if isinstance(value, memoryview) or _has_buffer(value):
        view = memoryview(value)
        own = _format(view)
        if own not in _INTEGER_FORMATS | _FLOAT_FORMATS:
            raise TypeError(f"a buffer of format {view.format!r}, not numbers")
        wanted = code or (INT64_FORMAT if own in _INTEGER_FORMATS else FLOAT32_FORMAT)
        if own == wanted and view.c_contiguous:
            return view
        numbers: Iterable[Any] = _flat(_cast(view, own) if view.c_contiguous else _whole(view, own)).tolist()
        return _shaped_numbers(numbers, wanted, _dims(view))
    dims, numbers_list = _nested(value)
    if code is None:
        code = INT64_FORMAT if all(isinstance(n, int) for n in numbers_list) else FLOAT32_FORMAT
    return _shaped_numbers(numbers_list, code, dims)


def _whole(view: memoryview, own: str) -> memoryview:
    return _cast(memoryview(view.tobytes()), own)


def _shaped_numbers(numbers: Iterable[Any], code: str, dims: Sequence[int]) -> memoryview:
    if code == INT64_FORMAT:
        numbers = [_int64_of(number) for number in numbers]
    values = memoryview(array.array(code, numbers))
    return _shaped(values, dims) if len(dims) != 1 else values


def _int64_of(number: Any) -> int:
    """A number as int64 holds it: an integer as it is, a float rounded half to even (as numpy's
    rint); Int64RangeError for one outside int64's range, NaN or inf (array's own check would raise
    a bare OverflowError, round() a ValueError of its own)."""
    whole = number if isinstance(number, int) else round(number) if math.isfinite(number) else None
    if whole is None or not -(2**63) <= whole < 2**63:
        raise _outside_int64(number)
    return int(whole)


def _only_integers(value: Any) -> bool:
    """Whether a number or nested sequences of numbers hold Python integers (booleans too) alone."""
    if isinstance(value, int):
        return True
    if isinstance(value, str | bytes) or not isinstance(value, Sequence):
        return False
    return all(_only_integers(item) for item in value)


def _has_buffer(value: object) -> bool:
    try:
        memoryview(value)  # type: ignore[arg-type]
    except TypeError:
        return False
    return True


def _nested(value: Any) -> tuple[tuple[int, ...], list[Any]]:
    """The shape and the values, in order, of a number or nested sequences of numbers; ValueError
    for ragged ones, TypeError for anything else."""
    if isinstance(value, bool | int | float):
        return (), [value]
    if isinstance(value, str | bytes) or not isinstance(value, Sequence):
        raise TypeError(f"{type(value).__name__} is not a number or a sequence of numbers")
    parts = [_nested(item) for item in value]
    inner = {dims for dims, _ in parts}
    if len(inner) > 1:
        raise ValueError(f"ragged nested sequences (shapes {sorted(inner)})")
    dims = inner.pop() if inner else ()
    return (len(parts), *dims), [number for _, numbers in parts for number in numbers]
