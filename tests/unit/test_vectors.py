"""gemps_proto.vectors, tested once for each of its two implementations: numpy's arrays, and the
standard library's memoryviews the SDK uses where numpy is not installed (selected here by turning
HAVE_NUMPY off; tests/integration/test_sdk_without_numpy.py runs the SDK where numpy cannot be
imported at all). Both must give the same values, shapes and wire bytes, and refuse alike."""

from __future__ import annotations

import array
import math
import struct
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from gemps_proto import vectors
from gemps_proto.schema import Buffers, ParameterSpec
from gemps_proto.tensor_codec import INT64

pytestmark = pytest.mark.usefixtures("implementation")


@pytest.fixture(params=["numpy", "memoryview"])
def implementation(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    monkeypatch.setattr(vectors, "HAVE_NUMPY", request.param == "numpy")
    yield str(request.param)


def values_of(vector: Any) -> list[Any]:
    listed: list[Any] = vector.tolist()
    return listed


def test_the_vector_type_is_numpys_or_a_memoryview(implementation: str) -> None:
    kind = np.ndarray if implementation == "numpy" else memoryview
    assert isinstance(vectors.as_float32([1.0, 2.0]), kind)
    assert isinstance(vectors.float32s(b"\0" * 8), kind)


def test_wire_bytes_are_read_without_a_copy_as_little_endian_values() -> None:
    data = bytearray(struct.pack("<3f", 1.5, -2.0, 0.25))
    view = vectors.float32s(data)
    assert values_of(view) == [1.5, -2.0, 0.25]
    data[0:4] = struct.pack("<f", 7.0)
    assert values_of(view)[0] == 7.0  # a view of the bytes, not a copy
    assert values_of(vectors.int64s(struct.pack("<2q", -3, 2**40))) == [-3, 2**40]


@pytest.mark.parametrize(
    ("given", "shape", "expected"),
    [
        ([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], (2, 3), [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]),
        (array.array("d", [0.1, 0.2]), (2,), [np.float32(0.1).item(), np.float32(0.2).item()]),
        (array.array("i", [3, -4]), (2,), [3.0, -4.0]),
        (2.5, (), 2.5),
        ([], (0,), []),
    ],
)
def test_values_become_float32_in_their_shape(given: Any, shape: tuple[int, ...], expected: Any) -> None:
    converted = vectors.as_float32(given)
    assert vectors.shape(converted) == shape and vectors.size(converted) == math.prod(shape)
    assert values_of(converted) == expected


def test_a_memoryview_of_numbers_keeps_its_shape() -> None:
    two_by_two = memoryview(array.array("f", [1, 2, 3, 4])).cast("B").cast("f", [2, 2])
    assert vectors.shape(two_by_two) == (2, 2)
    assert values_of(vectors.as_float32(two_by_two)) == [[1.0, 2.0], [3.0, 4.0]]
    every_other = memoryview(array.array("f", [1, 2, 3, 4]))[::2]  # not in one piece
    assert values_of(vectors.flat(vectors.as_float32(every_other))) == [1.0, 3.0]


def test_integers_are_told_from_floats_and_rounded_half_to_even() -> None:
    assert vectors.is_integral([1, 2]) and vectors.is_integral(array.array("q", [5]))
    assert not vectors.is_integral([1.0, 2]) and not vectors.is_integral(array.array("f", [1]))
    assert values_of(vectors.as_int64([0.5, 1.5, 2.5, -0.5, 3])) == [0, 2, 2, 0, 3]
    assert values_of(vectors.as_int64([2**40, -7])) == [2**40, -7]


UNHOLDABLE = {
    "2**63": [2**63],
    "below -2**63": [-(2**63) - 1],
    "2**64 + 5": [2**64 + 5],
    "uint64's largest": array.array("Q", [2**64 - 1]),
    "uint64's largest (numpy)": np.array([2**64 - 1], np.uint64),
    "NaN": [1.0, math.nan],
    "inf": [-math.inf],
    "1e19": np.array([1e19]),
    "float32 2**63": np.array([2.0**63], np.float32),
}


@pytest.mark.parametrize("given", UNHOLDABLE.values(), ids=UNHOLDABLE.keys())
def test_what_int64_cannot_hold_is_refused_not_wrapped(given: Any) -> None:
    """Issue 61 item 7: numpy's astype stored 2**63 as -2**63, uint64's largest as -1, NaN and inf
    as arbitrary integers."""
    with pytest.raises(ValueError, match="int64"):
        vectors.as_int64(given)


@pytest.mark.parametrize(
    ("given", "value"), [([2**64], 2**64), ([1, 2**63], 2**63), (-(2**64), -(2**64)), ([[0], [2**64 + 5]], 2**64 + 5)]
)
def test_python_integers_are_int64_or_refused_with_its_range(given: Any, value: int) -> None:
    """Issue 77, item 7: numpy made 2**64 an object and [1, 2**63] float64, so an integer buffer
    became a float one; the standard library's path raised a bare OverflowError. Both refuse alike."""
    with pytest.raises(vectors.Int64RangeError, match=rf"^{value} is outside int64's range \[-2\*\*63, 2\*\*63 - 1\]$"):
        vectors.as_numbers(given)
    assert values_of(vectors.as_numbers([1, 2**62])) == [1, 2**62] and vectors.is_integral(vectors.as_numbers([1]))


def test_int64s_own_ends_are_kept_exactly() -> None:
    ends = [2**63 - 1, -(2**63), 0]
    assert values_of(vectors.as_int64(ends)) == ends
    assert values_of(vectors.as_int64(np.array(ends, np.int64))) == ends
    assert values_of(vectors.as_int64([-(2.0**63), 2.0**62])) == [-(2**63), 2**62]


def test_a_buffer_int64_cannot_hold_is_named() -> None:
    spec = (ParameterSpec("bn.num_batches_tracked", (1,), INT64),)
    with pytest.raises(ValueError, match=r"'bn.num_batches_tracked'.*int64"):
        Buffers.of({"bn.num_batches_tracked": [2**63]}, spec)


def test_values_concatenated_into_given_bytes_are_viewed_there() -> None:
    room = memoryview(bytearray(16))
    joined = vectors.concatenate([vectors.as_float32([1.0, 2.0]), vectors.as_float32([[3.0], [4.0]])], into=room)
    assert values_of(joined) == [1.0, 2.0, 3.0, 4.0]
    assert values_of(vectors.float32s(room)) == [1.0, 2.0, 3.0, 4.0]  # written where it was given, not copied


def test_flat_values_are_shaped_concatenated_and_copied() -> None:
    flat = vectors.as_float32([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    assert values_of(vectors.shaped(flat, (2, 3))) == [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]
    assert vectors.size(vectors.shaped(flat[:0], (0, 3))) == 0
    joined = vectors.concatenate([flat[:2], vectors.as_float32([[9.0], [8.0]])])
    assert values_of(joined) == [1.0, 2.0, 9.0, 8.0]
    assert values_of(vectors.concatenate([vectors.as_int64([1]), vectors.as_int64([2**40])], integers=True)) == [
        1,
        2**40,
    ]
    assert vectors.size(vectors.concatenate([])) == 0 and vectors.size(vectors.empty_int64()) == 0
    kept = vectors.copy(flat)
    kept[0] = 42.0
    assert values_of(flat)[0] == 1.0 and values_of(kept)[0] == 42.0


def test_read_only_values_refuse_writes() -> None:
    frozen = vectors.read_only(vectors.copy(vectors.as_float32([1.0, 2.0])))
    with pytest.raises((TypeError, ValueError)):
        frozen[0] = 3.0


@pytest.mark.parametrize(
    ("given", "finite"),
    [
        ([1.0, -2.0, 3.4e38, -3.4e38, 3.4e38], True),  # float32's largest, summed: still finite in doubles
        ([1.0, float("nan")], False),
        ([float("inf"), 1.0], False),
        ([float("-inf"), float("inf")], False),
        ([], True),
    ],
)
def test_finite_values_are_told_from_nan_and_inf(given: list[float], finite: bool) -> None:
    assert vectors.all_finite(vectors.as_float32(given)) is finite


@pytest.mark.parametrize("at", [0, vectors.FINITE_BLOCK - 1, vectors.FINITE_BLOCK, 3 * vectors.FINITE_BLOCK + 6])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_large_vector_is_checked_to_its_last_value(implementation: str, at: int, bad: float) -> None:
    values = vectors.as_float32(array.array("f", [1.0]) * (3 * vectors.FINITE_BLOCK + 8))  # numpy's: block by block
    assert vectors.all_finite(values)
    values[at] = bad
    assert not vectors.all_finite(values)
    if implementation == "numpy":
        assert isinstance(values, np.ndarray)
        assert not vectors.all_finite(values.reshape(-1, 8))  # any shape, one piece
        assert not vectors.all_finite(values[::-1])  # not one piece: checked whole


def test_the_wire_bytes_are_little_endian_float32_and_int64() -> None:
    assert bytes(vectors.little_endian_float32([[1.5, -2.0]])) == struct.pack("<2f", 1.5, -2.0)
    assert bytes(vectors.little_endian_float32(array.array("d", [0.25]))) == struct.pack("<f", 0.25)
    assert vectors.little_endian_int64([3, -1]) == struct.pack("<2q", 3, -1)


@pytest.mark.parametrize("given", [["a", "b"], [[1.0, 2.0], [3.0]], b"\x00\x01", {"w": 1.0}])
def test_what_is_not_numbers_is_refused(given: Any) -> None:
    with pytest.raises((TypeError, ValueError)):
        vectors.as_float32(given)


def test_a_feature_that_needs_numpy_names_itself_and_the_install(implementation: str) -> None:
    if implementation == "numpy":
        vectors.require("compression='int8'")  # nothing to say
        return
    with pytest.raises(vectors.NumpyRequiredError, match=r"compression='int8' needs numpy.*gemps\[numpy\]"):
        vectors.require("compression='int8'")
