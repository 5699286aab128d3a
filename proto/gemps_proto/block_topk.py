"""Commit payloads as each block's largest values (issue 47): blockwise top-k, shared by the SDK and
the server as block_quantisation's codes are, so both read the same float32 from the same bytes.

Each BLOCK (256) values keep their KEPT (16: 1/16 of them) of largest magnitude, as an index in the
block and an int8 code against the block's float32 scale; the other values read 0. Every block
keeps the same number (the last, short block min(KEPT, its length)), so a payload's size follows
from its value count alone, as every data path needs before it reads a byte. Wire layout
(little-endian), for P values in B = ceil(P / BLOCK) blocks keeping K values in all:

    DTYPE_TOPK_BLOCK   B float32 scales, K uint8 indices (each block's, ascending), K int8 codes
                       value[block * BLOCK + index] = code * scale

A block's scale is its largest kept |value| / 127 (as block_quantisation's int8). Decoding refuses
what no encoder writes before a value is used: a scale not finite or negative, a code of -128, an
index at or past its block's length, indices of a block not strictly ascending (a repeat too).
What a block leaves out, and what its codes round away, the SDK keeps and adds to the next commit
(error feedback): a value left out grows there until it is among its block's largest.
"""

from __future__ import annotations

import numpy as np

from gemps_proto.block_quantisation import BLOCK, INT8_LEVELS, QuantisedPayloadError, blocks

#: values kept per BLOCK: 1/16 of them (with their indices and scales 1.125 bits a value, 28x fewer
#: bytes than float32)
KEPT = 16


def kept(count: int) -> int:
    """How many of `count` values a payload keeps: KEPT per full block, the last one's at most its length."""
    full, rest = divmod(count, BLOCK)
    return full * KEPT + min(KEPT, rest)


def topk_nbytes(count: int) -> int:
    return 4 * blocks(count) + 2 * kept(count)


def _layout(count: int) -> tuple[np.ndarray, np.ndarray]:
    """(each kept value's block, the rank it holds there): where each kept value's index lies."""
    rows, total = blocks(count), kept(count)
    block_of = np.repeat(np.arange(rows), KEPT)[:total]
    return block_of, np.arange(total) - block_of * KEPT


def encode_topk(values: np.ndarray) -> bytes:
    """DTYPE_TOPK_BLOCK bytes of finite float32 values."""
    return topk_with_values(values)[0]


def topk_with_values(values: np.ndarray) -> tuple[bytes, np.ndarray]:
    """encode_topk's bytes, and the float32 values decode_topk reads from them (made from the codes
    in hand, not by parsing the bytes again: the same bits)."""
    flat = np.ascontiguousarray(values, np.float32).reshape(-1)
    count, rows = flat.size, blocks(flat.size)
    magnitude = np.full(rows * BLOCK, -1.0, np.float32)  # padding ranks below every real value
    magnitude[:count] = np.abs(flat)
    grid = magnitude.reshape(rows, BLOCK)
    positions = _largest(grid)[: kept(count)]
    indices = (positions % BLOCK).astype(np.uint8)
    picked = flat[positions]
    block_of, _ = _layout(count)
    peaks = np.zeros(rows * KEPT, np.float32)  # each block's kept magnitudes, a short last one's padded
    peaks[: picked.size] = np.abs(picked)
    peaks = peaks.reshape(rows, KEPT).max(axis=1, initial=np.float32(0))
    scales = (peaks / np.float32(INT8_LEVELS)).astype(np.float32)
    divisor = np.where(scales > 0, scales, np.float32(1))[block_of]
    codes = np.clip(np.rint(picked / divisor), -INT8_LEVELS, INT8_LEVELS).astype(np.int8)
    data = scales.astype("<f4").tobytes() + indices.tobytes() + codes.tobytes()
    return data, _scatter(count, positions, codes, scales[block_of])


def topk_subtracting(values: np.ndarray) -> bytes:
    """encode_topk's bytes of contiguous `values`, which are left holding what the codes lose."""
    data, decoded = topk_with_values(values)
    values -= decoded.reshape(values.shape)
    return data


def _largest(grid: np.ndarray) -> np.ndarray:
    """Positions (row-major, so each block's ascending) of each row's KEPT largest values: those
    above the row's KEPT-th largest, then as many equal to it as are missing, first ones first (a
    block of zeros keeps its first KEPT). A partition and masks: 5x faster than an argpartition."""
    if not grid.size:
        return np.zeros(0, np.int64)
    threshold = np.partition(grid, BLOCK - KEPT, axis=1)[:, BLOCK - KEPT, None]
    above = grid > threshold
    missing = KEPT - above.sum(axis=1, keepdims=True)
    tied = grid == threshold
    crowded = np.flatnonzero(tied.sum(axis=1, keepdims=True) > missing)  # rows with ties to break
    tied[crowded] &= np.cumsum(tied[crowded], axis=1, dtype=np.int16) <= missing[crowded]
    return np.flatnonzero(above | tied)


def _scatter(
    count: int, positions: np.ndarray, codes: np.ndarray, scales: np.ndarray, out: np.ndarray | None = None
) -> np.ndarray:
    values = np.zeros(count, np.float32) if out is None else out
    if out is not None:
        values.fill(0.0)
    values[positions] = codes.astype(np.float32) * scales
    return values


def decode_topk(data: bytes | bytearray | memoryview, count: int, out: np.ndarray | None = None) -> np.ndarray:
    """float32 values of DTYPE_TOPK_BLOCK bytes holding `count` of them (their length checked by the
    caller), into `out` (float32, `count` of them) when given; QuantisedPayloadError for a scale,
    index or code no encoder writes."""
    rows, total = blocks(count), kept(count)
    scales = np.frombuffer(data, dtype="<f4", count=rows)
    if rows and not (np.isfinite(scales).all() and (scales >= 0).all()):
        raise QuantisedPayloadError("a block's scale is not a finite, non-negative number")
    indices = np.frombuffer(data, dtype=np.uint8, count=total, offset=4 * rows).astype(np.int64)
    codes = np.frombuffer(data, dtype=np.int8, count=total, offset=4 * rows + total)
    if total and codes.min() < -INT8_LEVELS:
        raise QuantisedPayloadError(f"a top-k code is -128: codes lie in [-{INT8_LEVELS}, {INT8_LEVELS}]")
    block_of, rank = _layout(count)
    if total and indices[-1] >= count - (rows - 1) * BLOCK:
        raise QuantisedPayloadError(f"an index of the last block is past its {count - (rows - 1) * BLOCK} values")
    if total > 1 and not np.all((np.diff(indices) > 0) | (rank[1:] == 0)):
        raise QuantisedPayloadError("a block's indices are not strictly ascending (one repeats or goes back)")
    return _scatter(count, block_of * BLOCK + indices, codes, scales[block_of], out)
