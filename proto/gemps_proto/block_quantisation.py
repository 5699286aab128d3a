"""Commit payloads in 8 or 4 bits a value (issue 47): blockwise linear codes with a float32 scale
per BLOCK values, one encoder and one decoder that the SDK and the server share, so both read the
same float32 from the same bytes.

Wire layout (little-endian), for a payload of P values in B = ceil(P / BLOCK) blocks:

    DTYPE_INT8_BLOCK   B float32 scales, then P int8 codes              value = code * scale
    DTYPE_INT4_BLOCK   B float32 scales, then ceil(P / 2) bytes of two  value = code * scale
                       signed 4-bit codes each (value 2j in the low nibble, 2j + 1 in the high one)

A block's scale is its largest |value| / LEVELS (127 or 7), so its largest value is exact and the
others are rounded to the nearest of 2 x LEVELS + 1 levels (half to even). Decoding checks what a
hostile sender could put there before a value is used: every scale finite and not negative, no
code outside [-LEVELS, LEVELS] (-128 and -8 are never written), the padding nibble of an odd P
zero, and the byte count (tensor_codec's expected_nbytes). What the codes lose a worker keeps and
adds to its next commit (the SDK's error feedback), so over commits nothing is lost.
"""

from __future__ import annotations

import numpy as np

#: values per scale: 1.6% of int8's bytes, 3% of int4's
BLOCK = 256
INT8_LEVELS = 127
INT4_LEVELS = 7


class QuantisedPayloadError(ValueError):
    """Bytes that are no valid blockwise-quantised payload (a scale not finite or negative, a code
    out of range, a padding nibble set)."""


def blocks(count: int) -> int:
    return -(-count // BLOCK)


def int8_nbytes(count: int) -> int:
    return 4 * blocks(count) + count


def int4_nbytes(count: int) -> int:
    return 4 * blocks(count) + -(-count // 2)


def _grid(values: np.ndarray) -> np.ndarray:
    """float32 values as rows of BLOCK, the last one padded with zeros (a copy only when padded)."""
    count = values.size
    rows = blocks(count)
    if count != rows * BLOCK:
        values = np.concatenate([values, np.zeros(rows * BLOCK - count, np.float32)])
    return values.reshape(rows, BLOCK)


def _codes(values: np.ndarray, levels: int) -> tuple[np.ndarray, np.ndarray]:
    """(per-block scales: largest |value| / levels, integer codes in [-levels, levels]) of finite
    float32 values, each value divided by its block's scale and rounded half to even."""
    flat = np.ascontiguousarray(values, np.float32).reshape(-1)
    grid = _grid(flat)
    scales = (np.abs(grid).max(axis=1, initial=np.float32(0)) / np.float32(levels)).astype(np.float32)
    ratio = grid / np.where(scales > 0, scales, np.float32(1))[:, None]  # a zero block: zeros / 1
    np.rint(ratio, out=ratio)
    np.clip(ratio, -levels, levels, out=ratio)
    return scales, ratio.astype(np.int8).reshape(-1)[: flat.size]


def _values(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """float32 code x scale for each value (codes of one block share its scale)."""
    count = codes.size
    full = count - count % BLOCK
    values = codes.astype(np.float32)
    rows = full // BLOCK
    values[:full].reshape(rows, BLOCK)[...] *= scales[:rows, None]
    if full < count:  # the last block, short
        values[full:] *= scales[rows]
    return values


# Each byte's two signed 4-bit codes (value 2j in the low nibble, 2j + 1 in the high one), as
# the two bytes of a uint16: one table lookup a byte.
_NIBBLE_PAIRS = np.array([[(b & 0x0F) - 16 * (b & 0x08 > 0), (b >> 4) - 16 * (b >> 7)] for b in range(256)], np.int8)
_NIBBLE_PAIR_WORDS = _NIBBLE_PAIRS.view(np.uint16).reshape(256)


def encode_int8(values: np.ndarray) -> bytes:
    """DTYPE_INT8_BLOCK bytes of finite float32 values."""
    return int8_with_values(values)[0]


def int8_with_values(values: np.ndarray) -> tuple[bytes, np.ndarray]:
    """encode_int8's bytes, and the float32 values decode_int8 reads from them (made from the
    codes in hand, not by parsing the bytes again: the same bits)."""
    scales, codes = _codes(values, INT8_LEVELS)
    return scales.astype("<f4").tobytes() + codes.tobytes(), _values(codes, scales)


def encode_int4(values: np.ndarray) -> bytes:
    """DTYPE_INT4_BLOCK bytes of finite float32 values."""
    return int4_with_values(values)[0]


def int4_with_values(values: np.ndarray) -> tuple[bytes, np.ndarray]:
    """encode_int4's bytes, and the float32 values decode_int4 reads from them (as int8_with_values)."""
    scales, codes = _codes(values, INT4_LEVELS)
    nibbles = (codes.astype(np.uint8) & 0x0F).astype(np.uint8)
    if nibbles.size % 2:
        nibbles = np.append(nibbles, np.uint8(0))
    packed = nibbles[0::2] | (nibbles[1::2] << 4)
    return scales.astype("<f4").tobytes() + packed.astype(np.uint8).tobytes(), _values(codes, scales)


def _checked_scales(data: bytes | bytearray | memoryview, count: int) -> np.ndarray:
    scales = np.frombuffer(data, dtype="<f4", count=blocks(count))
    if scales.size and not (np.isfinite(scales).all() and (scales >= 0).all()):
        raise QuantisedPayloadError("a block's scale is not a finite, non-negative number")
    return scales


def decode_int8(data: bytes | bytearray | memoryview, count: int) -> np.ndarray:
    """float32 values of DTYPE_INT8_BLOCK bytes holding `count` of them (their length checked by
    the caller); QuantisedPayloadError for a scale or code no encoder writes."""
    scales = _checked_scales(data, count)
    codes = np.frombuffer(data, dtype=np.int8, count=count, offset=4 * scales.size)
    if count and codes.min() < -INT8_LEVELS:
        raise QuantisedPayloadError(f"an int8 code is -128: codes lie in [-{INT8_LEVELS}, {INT8_LEVELS}]")
    return _values(codes, scales)


def decode_int4(data: bytes | bytearray | memoryview, count: int) -> np.ndarray:
    """float32 values of DTYPE_INT4_BLOCK bytes holding `count` of them (their length checked by
    the caller); QuantisedPayloadError for a scale, code or padding no encoder writes."""
    scales = _checked_scales(data, count)
    packed = np.frombuffer(data, dtype=np.uint8, offset=4 * scales.size)
    if count % 2 and packed[-1] >> 4 != 0:
        raise QuantisedPayloadError("an odd payload's padding nibble is not 0")
    codes = np.take(_NIBBLE_PAIR_WORDS, packed).view(np.int8)[:count]
    if count and codes.min() < -INT4_LEVELS:
        raise QuantisedPayloadError(f"an int4 code is -8: codes lie in [-{INT4_LEVELS}, {INT4_LEVELS}]")
    return _values(codes, scales)
