"""The server's compiled int8 codes (csrc/wire_codes.c, through gemps_server.coded_payloads) are the
shared codec's numpy, byte for byte and bit for bit: a commit payload decoded and measured, a
refusal worded, a difference reply coded with the worker's copy moved."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gemps_proto import block_quantisation, reply_differences
from gemps_proto.reply_differences import copy_values, difference, whole
from gemps_proto.tensor_codec import INT4_BLOCK, INT8_BLOCK, EncodedTensor, TensorDecodeError, encode_payload
from gemps_server import native
from gemps_server.coded_payloads import decoded_payload, moved_copy_difference

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


def test_the_compiled_codes_are_built() -> None:
    # Optional at install (no compiler: the codec's numpy serves); here, where CI runs, they are there.
    assert native.compiled is not None and hasattr(native.compiled, "wire_decode_int8")


@settings(max_examples=60, deadline=None)
@given(SIZES, st.integers(0, 2**32 - 1), st.lists(st.sampled_from([0.0, -0.0, 1e-45, 3e-39, 2.6e36, 1.0]), max_size=4))
def test_a_decoded_payload_is_the_codecs_values_and_its_peak_their_max_abs(
    size: int, seed: int, scale_kinds: list[float]
) -> None:
    payload = random_payload(size, seed, scale_kinds)
    expected = payload.decode_payload()
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
        payload.decode_payload(np.empty(size, np.float32))
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
        expected_data, expected_bits = difference(theta, bits, INT8_BLOCK)
        moved = bits.copy()
        data, after = moved_copy_difference(theta, moved, INT8_BLOCK)
    assert after is moved  # in place
    assert bytes(data) == bytes(expected_data)
    assert after.tobytes() == expected_bits.tobytes()


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


def test_a_difference_of_chunks_is_coded_whole() -> None:
    """More than one of the codec's chunks (CHUNK_BLOCKS blocks): the same bytes and bits."""
    theta, bits = copies_of(2 * reply_differences.CHUNK_BLOCKS * BLOCK + 3, 5, 1e-2, 0.5)
    assert_difference_is_the_codecs(theta, bits)
