"""8-bit codes for float32 vectors, per block of BLOCK values: compact GEM's m_i and s_i (gem_compact.py).

A block keeps a scale (float32: its peak max |x|, or a bound on it) and one byte per value: the
sign, then x / scale rounded to a float of 4 exponent bits and 3 mantissa bits (an "e4m3" code
relative to the scale, like the 8-bit floats of recent accelerators). Its relative error is at
most 2**-4 over 17 binades below the scale (below 2**-14 of it the step is a constant 2**-17 of
the scale, as a float's subnormals), where a linear int8 code loses small values to its one step
of peak/127: GEM reads |m_i| and |theta - s_i| per parameter and compares them with |Delta| of
the same parameter, so small values need their relative precision as much as large ones
(DESIGN §1a measures both). A scale above the peak costs nothing but range at the bottom.

Encoding is defined on float32's bits, so the numpy code here and the compiled kernel
(csrc/compact_gem.c) give the same byte for every value:
    y   = x * (1 / d)              d = the block's scale, or 1 when it is 0 (1 / d rounded first)
    a   = bits(y) & 0x7fffffff
    mag = rint(|y| * 2**17)                          where a < bits(2**-14)  (0..8)
          (a + 0x7ffff + ((a >> 20) & 1)) >> 20) - 896    elsewhere (round to 3 mantissa bits, half to even)
    code = min(mag, 120) | sign(y) << 7      (120 is 1.0, the scale itself: a value past it saturates)
and decoding is DECODE[code] * scale, both rounded to float32.
"""

from __future__ import annotations

import numpy as np

#: values per block, which share a float32 scale (1/8 of a byte per value): a value's error is
#: bounded by its own size and its block's peak, so a few values spiking (a worker's outliers, or an
#: attacker's) cost precision to their 31 neighbours alone, not to thousands (DESIGN §1a). Divides
#: the compiled pass's chunk (csrc/compact_codes.h CODE_CHUNK).
BLOCK = 32
#: the largest magnitude code: 1.0 (the block's peak); codes above it never come out of encode
LARGEST_CODE = 120
_SMALL = np.uint32(0x38800000)  # bits of 2**-14: below it, the linear ("subnormal") step
_SUBNORMAL_SCALE = np.float32(2.0**17)


def _decode_table() -> np.ndarray:
    magnitudes = np.arange(128)
    exponent, mantissa = magnitudes >> 3, magnitudes & 7
    values = np.where(exponent == 0, mantissa * 2.0**-17, (8 + mantissa) * np.exp2(exponent - 18.0))
    return np.concatenate([values, -values]).astype(np.float32)


#: code -> its value relative to the block's peak
DECODE = _decode_table()


def blocks(size: int) -> int:
    """How many blocks (peaks) `size` values take."""
    return -(-size // BLOCK)


def _starts(size: int) -> np.ndarray:
    return np.arange(0, size, BLOCK)


def _per_value(per_block: np.ndarray, size: int) -> np.ndarray:
    """Each block's number repeated over its values (the last block may be short)."""
    return np.repeat(per_block, BLOCK)[:size]


def peaks(values: np.ndarray) -> np.ndarray:
    """max |x| per block (NaN or inf where a value is not finite)."""
    if values.size == 0:
        return np.empty(0, np.float32)
    return np.maximum.reduceat(np.abs(values), _starts(values.size)).astype(np.float32)


def encode(values: np.ndarray, codes: np.ndarray, scales: np.ndarray) -> None:
    """Codes of float32 `values` into uint8 `codes` (same size) against their blocks' peaks, which
    go to float32 `scales`; the caller has checked that every value is finite."""
    scales[:] = peaks(values)
    encode_against(values, scales, codes)


def encode_against(values: np.ndarray, scales: np.ndarray, codes: np.ndarray) -> None:
    """Codes of finite float32 `values` against the blocks' given `scales` into uint8 `codes`."""
    size = values.size
    reciprocal = _per_value(np.float32(1) / np.where(scales > 0, scales, np.float32(1)), size)
    with np.errstate(invalid="ignore", over="ignore"):
        ratio = np.multiply(values, reciprocal, dtype=np.float32)
    bits = ratio.view(np.uint32)
    size_bits = bits & np.uint32(0x7FFFFFFF)
    small = np.rint(np.abs(ratio) * _SUBNORMAL_SCALE).astype(np.uint32)
    with np.errstate(over="ignore"):  # the small values' large-branch figure wraps; where() drops it
        large = ((size_bits + np.uint32(0x7FFFF) + ((size_bits >> 20) & np.uint32(1))) >> 20) - np.uint32(896)
    magnitude = np.minimum(np.where(size_bits < _SMALL, small, large), np.uint32(LARGEST_CODE))
    codes[:] = (magnitude | ((bits >> 24) & np.uint32(0x80))).astype(np.uint8)


def decode(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """The float32 values `codes` and their blocks' `scales` stand for."""
    decoded: np.ndarray = DECODE[codes] * _per_value(scales, codes.size)
    return decoded


def valid_codes(codes: np.ndarray) -> bool:
    """Whether every code is one `encode` gives (magnitude at most LARGEST_CODE)."""
    return bool(np.all((codes & 0x7F) <= LARGEST_CODE)) if codes.size else True
