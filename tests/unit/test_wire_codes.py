"""The codec's compiled passes (proto/gemps_proto/csrc/codes.c, gemps_proto.compiled_codes) are its
numpy code, byte for byte and bit for bit: a commit payload decoded and measured (the server's
gemps_server.native.decoded_payload), a refusal worded, a worker's int8 codes with its residual, a
difference reply coded with the server's copy moved, and a client's copy moved by a reply."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from typing import TypeVar

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gemps_proto import block_quantisation, compiled_codes, reply_differences
from gemps_proto.reply_differences import advance, copy_values, difference, whole
from gemps_proto.tensor_codec import (
    INT4_BLOCK,
    INT8_BLOCK,
    EncodedTensor,
    TensorDecodeError,
    checked_block_codes,
    encode_payload,
)
from gemps_server import native
from gemps_server.native import decoded_payload

T = TypeVar("T")

BLOCK = block_quantisation.BLOCK
SIZES = st.sampled_from([1, 2, BLOCK - 1, BLOCK, BLOCK + 1, 3 * BLOCK + 5, 70_001])


def int8_payload(codes: np.ndarray, scales: np.ndarray) -> EncodedTensor:
    """DTYPE_INT8_BLOCK bytes laid out by hand (the scales, then the codes): any scale or code a
    sender could write, not only what the encoder writes."""
    data = scales.astype("<f4").tobytes() + codes.astype(np.int8).tobytes()
    return EncodedTensor(INT8_BLOCK, (codes.size,), data)


def random_payload(size: int, seed: int, scale_kinds: list[float]) -> EncodedTensor:
    rng = np.random.default_rng(seed)
    codes = rng.integers(-127, 128, size, dtype=np.int8)
    scales = (rng.standard_normal(block_quantisation.blocks(size)) ** 2).astype(np.float32)
    for index, scale in enumerate(scale_kinds):  # zeros, -0.0, subnormal, large: where they fall
        scales[index % scales.size] = scale
    return int8_payload(codes, scales)


def by_numpy(call: Callable[[], T]) -> T:
    """`call` with the codec's compiled passes set aside: its numpy code, the reference."""
    compiled, compiled_codes.compiled = compiled_codes.compiled, None
    try:
        return call()
    finally:
        compiled_codes.compiled = compiled


@pytest.fixture(autouse=True)
def compiled_passes() -> Iterator[None]:
    # Optional at install (no compiler: the codec's numpy serves); here, where CI runs, they are there.
    assert compiled_codes.compiled is not None, "gemps_proto._codes was not built: is a C compiler installed?"
    yield


@settings(max_examples=60, deadline=None)
@given(SIZES, st.integers(0, 2**32 - 1), st.lists(st.sampled_from([0.0, -0.0, 1e-45, 3e-39, 2.6e36, 1.0]), max_size=4))
def test_a_decoded_payload_is_the_codecs_values_and_its_peak_their_max_abs(
    size: int, seed: int, scale_kinds: list[float]
) -> None:
    payload = random_payload(size, seed, scale_kinds)
    expected = by_numpy(payload.decode_payload)
    out = np.full(size, np.nan, np.float32)
    values, peak = decoded_payload(payload, out)
    assert values is out and peak is not None  # the compiled pass ran: it measures the peak
    assert out.tobytes() == expected.tobytes()
    assert peak == native.max_abs(expected)


@pytest.mark.parametrize(
    ("scale", "code", "words"),
    [
        (np.nan, 0, "scale is not a finite"),
        (np.inf, 0, "scale is not a finite"),
        (-1.0, 0, "scale is not a finite"),
        (0.5, -128, "code is -128"),
        (np.nan, -128, "scale is not a finite"),  # both: the codec's order (scales first)
    ],
)
@pytest.mark.parametrize("where", [0, BLOCK + 3, 3 * BLOCK + 4])
def test_a_refused_payload_is_refused_in_the_codecs_words(scale: float, code: int, words: str, where: int) -> None:
    size = 3 * BLOCK + 5
    codes, scales = np.ones(size, np.int8), np.ones(block_quantisation.blocks(size), np.float32)
    scales[where // BLOCK], codes[where] = scale, code
    payload = int8_payload(codes, scales)
    with pytest.raises(TensorDecodeError) as reference:
        by_numpy(lambda: payload.decode_payload(np.empty(size, np.float32)))
    with pytest.raises(TensorDecodeError, match=words) as compiled:
        decoded_payload(payload, np.empty(size, np.float32))
    assert str(compiled.value) == str(reference.value)


def test_payloads_the_compiled_pass_does_not_take_are_the_codecs() -> None:
    """int4, float32, no room to decode into, a room of another size: the codec, and no peak."""
    values = np.linspace(-1, 1, 3 * BLOCK + 5, dtype=np.float32)
    for dtype, out in [(INT4_BLOCK, np.empty(values.size, np.float32)), (INT8_BLOCK, None)]:
        payload = EncodedTensor(dtype, (values.size,), encode_payload(values, dtype))
        decoded, peak = decoded_payload(payload, out)
        assert peak is None and decoded.tobytes() == payload.decode_payload().tobytes()
    short = EncodedTensor(INT8_BLOCK, (values.size,), encode_payload(values, INT8_BLOCK)[:-1])
    with pytest.raises(TensorDecodeError, match="bytes of data"):
        decoded_payload(short, np.empty(values.size, np.float32))


def copies_of(size: int, seed: int, spread: float, offset: float) -> tuple[np.ndarray, np.ndarray]:
    """θ and a worker's copy of it (bfloat16 bits) that lags by about `spread`, around `offset`."""
    rng = np.random.default_rng(seed)
    theta = (rng.standard_normal(size) * spread + offset).astype(np.float32)
    held = theta + (rng.standard_normal(size) * spread).astype(np.float32)
    held[: min(size, BLOCK)] = theta[: min(size, BLOCK)]  # a block the copy already holds: zeros / 1
    return theta, whole(held)


def assert_difference_is_the_codecs(theta: np.ndarray, bits: np.ndarray) -> None:
    with warnings.catch_warnings():  # the codec's cast of a non-finite block's NaN, both sides alike
        warnings.simplefilter("ignore", RuntimeWarning)
        expected_data, expected_bits = by_numpy(lambda: difference(theta, bits, INT8_BLOCK))
        moved = bits.copy()
        data, after = difference(theta, moved, INT8_BLOCK, in_place=True)
        new_data, new_bits = difference(theta, bits.copy(), INT8_BLOCK)  # a new copy, `bits` as it was
    assert after is moved  # in place
    assert bytes(data) == bytes(expected_data) == bytes(new_data)
    assert after.tobytes() == expected_bits.tobytes() == new_bits.tobytes()


@settings(max_examples=60, deadline=None)
@given(SIZES, st.integers(0, 2**32 - 1), st.sampled_from([1e-3, 1.0, 1e30]), st.sampled_from([0.0, 3.3e38, -3.39e38]))
def test_a_difference_reply_is_the_codecs_bytes_and_moves_the_copy_to_the_same_bits(
    size: int, seed: int, spread: float, offset: float
) -> None:
    theta, bits = copies_of(size, seed, spread, offset)
    assert_difference_is_the_codecs(np.clip(theta, -3.4e38, 3.4e38), bits)


def test_a_block_whose_difference_is_not_finite_is_coded_by_the_codec_with_every_block_after_it() -> None:
    size = 5 * BLOCK + 7
    theta, bits = copies_of(size, 11, 1e-2, 0.0)
    theta[2 * BLOCK + 9] = np.float32(3.4e38)  # its copy about 0: a finite difference
    bits[3 * BLOCK + 1] = whole(np.array([-3.38e38], np.float32))[0]
    theta[3 * BLOCK + 1] = np.float32(3.4e38)  # θ - copy overflows: this block and after, the codec
    assert np.isfinite(theta).all() and np.isfinite(copy_values(bits)).all()
    assert_difference_is_the_codecs(theta, bits)


def test_signed_zeros_keep_the_codecs_signs() -> None:
    """A value that codes to 0 from below: its code is 0, not -0, so the step it leaves and the copy
    it moves keep numpy's signs (a compiler had taken the ratio, -0, for the code's float)."""
    theta, bits = np.zeros(BLOCK, np.float32), np.zeros(BLOCK, np.uint16)
    theta[0], theta[1:4] = 1.0, np.float32(-1e-30)  # ratios of -0: codes of 0
    bits[1:3] = whole(np.array([-0.0], np.float32))[0]  # copies of -0 and +0 under them
    theta[5], theta[6] = -0.0, 0.0
    assert_difference_is_the_codecs(theta, bits)
    residual, expected_residual = theta.copy(), theta.copy()
    assert block_quantisation.int8_subtracting(residual) == by_numpy(
        lambda: block_quantisation.int8_subtracting(expected_residual)
    )
    assert residual.tobytes() == expected_residual.tobytes()


def test_a_difference_of_chunks_is_coded_whole() -> None:
    """More than one of the codec's chunks (CHUNK_BLOCKS blocks): the same bytes and bits."""
    theta, bits = copies_of(2 * reply_differences.CHUNK_BLOCKS * BLOCK + 3, 5, 1e-2, 0.5)
    assert_difference_is_the_codecs(theta, bits)


@settings(max_examples=60, deadline=None)
@given(SIZES, st.integers(0, 2**32 - 1), st.sampled_from([1e-30, 1e-3, 1.0, 1e37]))
def test_a_workers_codes_and_residual_are_the_codecs(size: int, seed: int, spread: float) -> None:
    values = (np.random.default_rng(seed).standard_normal(size) * spread).astype(np.float32)
    values[: min(size, 3)] = 0.0  # a block of zeros in part
    expected_residual = values.copy()
    expected = by_numpy(lambda: block_quantisation.int8_subtracting(expected_residual))
    residual = values.copy()
    assert block_quantisation.int8_subtracting(residual) == expected
    assert residual.tobytes() == expected_residual.tobytes()


def test_a_block_with_a_value_not_finite_is_coded_by_the_numpy_code_with_every_block_after_it() -> None:
    values = np.random.default_rng(2).standard_normal(4 * BLOCK + 9).astype(np.float32)
    values[2 * BLOCK + 5] = np.inf  # no caller codes one (the SDK refuses it first): as numpy codes it
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        expected_residual = values.copy()
        expected = by_numpy(lambda: block_quantisation.int8_subtracting(expected_residual))
        residual = values.copy()
        assert block_quantisation.int8_subtracting(residual) == expected
    assert residual.tobytes() == expected_residual.tobytes()


@settings(max_examples=60, deadline=None)
@given(SIZES, st.integers(0, 2**32 - 1), st.sampled_from([INT8_BLOCK, INT4_BLOCK]), st.sampled_from([1e-3, 3e38]))
def test_a_copy_moved_by_a_reply_is_the_codecs(size: int, seed: int, dtype: int, spread: float) -> None:
    """int8's codes and int4's (unpacked, a code a value), into the copy's kept values, and near
    bfloat16's largest, where a moved copy saturates rather than rounds to inf."""
    rng = np.random.default_rng(seed)
    bits = whole(np.clip(rng.standard_normal(size) * spread, -3.39e38, 3.39e38).astype(np.float32))
    step = np.clip(rng.standard_normal(size) * spread, -3.39e38, 3.39e38).astype(np.float32)
    code = checked_block_codes(dtype, (size,), encode_payload(step, dtype))
    expected_bits, expected = bits.copy(), np.empty(size, np.float32)
    with warnings.catch_warnings():  # numpy's sum past float32's largest, before the saturation
        warnings.simplefilter("ignore", RuntimeWarning)
        by_numpy(lambda: advance(expected_bits, code, expected))
    moved, out = bits.copy(), np.full(size, np.nan, np.float32)
    assert advance(moved, code, out) is out
    assert moved.tobytes() == expected_bits.tobytes() and out.tobytes() == expected.tobytes()
