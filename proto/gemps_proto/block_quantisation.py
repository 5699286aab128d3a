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


def _scales(values: np.ndarray, levels: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-block scales (largest |value| / levels) and each value's scale."""
    count = values.size
    if count == 0:
        return np.empty(0, np.float32), np.empty(0, np.float32)
    peaks = np.maximum.reduceat(np.abs(values), np.arange(0, count, BLOCK)).astype(np.float32)
    scales = (peaks / np.float32(levels)).astype(np.float32)
    return scales, np.repeat(scales, BLOCK)[:count]


def _codes(values: np.ndarray, levels: int) -> tuple[np.ndarray, np.ndarray]:
    """(scales, integer codes in [-levels, levels]) of finite float32 values."""
    flat = np.ascontiguousarray(values, np.float32).reshape(-1)
    scales, each = _scales(flat, levels)
    with np.errstate(invalid="ignore", divide="ignore"):
        ratio = np.where(each > 0, flat / np.where(each > 0, each, np.float32(1)), np.float32(0))
    return scales, np.clip(np.rint(ratio), -levels, levels).astype(np.int8)


def encode_int8(values: np.ndarray) -> bytes:
    """DTYPE_INT8_BLOCK bytes of finite float32 values."""
    scales, codes = _codes(values, INT8_LEVELS)
    return scales.astype("<f4").tobytes() + codes.tobytes()


def encode_int4(values: np.ndarray) -> bytes:
    """DTYPE_INT4_BLOCK bytes of finite float32 values."""
    scales, codes = _codes(values, INT4_LEVELS)
    nibbles = (codes.astype(np.uint8) & 0x0F).astype(np.uint8)
    if nibbles.size % 2:
        nibbles = np.append(nibbles, np.uint8(0))
    packed = nibbles[0::2] | (nibbles[1::2] << 4)
    return scales.astype("<f4").tobytes() + packed.astype(np.uint8).tobytes()


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
    values: np.ndarray = codes.astype(np.float32) * np.repeat(scales, BLOCK)[:count]
    return values


def decode_int4(data: bytes | bytearray | memoryview, count: int) -> np.ndarray:
    """float32 values of DTYPE_INT4_BLOCK bytes holding `count` of them (their length checked by
    the caller); QuantisedPayloadError for a scale, code or padding no encoder writes."""
    scales = _checked_scales(data, count)
    packed = np.frombuffer(data, dtype=np.uint8, offset=4 * scales.size)
    nibbles = np.empty(2 * packed.size, np.uint8)
    nibbles[0::2], nibbles[1::2] = packed & 0x0F, packed >> 4
    if count % 2 and nibbles[count] != 0:
        raise QuantisedPayloadError("an odd payload's padding nibble is not 0")
    codes = nibbles[:count].astype(np.int8)
    codes[codes > 7] -= 16  # two's complement of 4 bits
    if count and codes.min() < -INT4_LEVELS:
        raise QuantisedPayloadError(f"an int4 code is -8: codes lie in [-{INT4_LEVELS}, {INT4_LEVELS}]")
    values: np.ndarray = codes.astype(np.float32) * np.repeat(scales, BLOCK)[:count]
    return values
