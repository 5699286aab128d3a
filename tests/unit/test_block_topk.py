"""Blockwise top-k commit payloads (gemps_proto.block_topk, issue 47): what each block keeps, the
layout, what a hostile sender can put there, and the client's error feedback sending, over
commits, every value a block left out."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from gemps.compression import Compressor
from gemps_proto import block_quantisation as bq
from gemps_proto import block_topk as topk
from gemps_proto.tensor_codec import (
    TOPK_BLOCK,
    TensorDecodeError,
    decode_payload,
    encode_payload,
    expected_payload_nbytes,
)

FINITE = arrays(
    np.float32,
    st.integers(0, 3 * bq.BLOCK + 7),
    elements=st.floats(-(2.0**100), 2.0**100, width=32, allow_nan=False, allow_infinity=False, allow_subnormal=False),
)


@settings(max_examples=200, deadline=None)
@given(values=FINITE)
def test_each_block_keeps_its_largest_values_within_half_a_step(values: np.ndarray) -> None:
    data = encode_payload(values, TOPK_BLOCK)
    assert len(data) == expected_payload_nbytes(TOPK_BLOCK, values.shape) == topk.topk_nbytes(values.size)
    back = decode_payload(TOPK_BLOCK, values.shape, data)
    assert back.dtype == np.float32 and back.shape == values.shape
    for start in range(0, values.size, bq.BLOCK):
        block, returned = np.abs(values[start : start + bq.BLOCK]).astype(np.float64), back[start : start + bq.BLOCK]
        order = np.argsort(-block, kind="stable")
        kept = order[: min(topk.KEPT, block.size)]
        left_out = np.setdiff1d(np.arange(block.size), kept)
        assert np.count_nonzero(returned[left_out]) == 0
        kept_values = values[start : start + bq.BLOCK].astype(np.float64)[np.nonzero(returned)]
        if left_out.size and kept_values.size:  # every value kept is at least as large as every one left out
            assert np.abs(kept_values).min() >= block[left_out].max()
        step = block.max(initial=0.0) / bq.INT8_LEVELS
        error = np.abs(returned - values[start : start + bq.BLOCK].astype(np.float64))[kept]
        assert np.all(error <= step / 2 * (1 + 1e-5) + 1e-38)
    assert encode_payload(values, TOPK_BLOCK) == data  # the same bytes again: a retry resends them


def test_the_layout_is_scales_then_indices_then_codes() -> None:
    values = np.zeros(bq.BLOCK + 3, np.float32)
    values[np.arange(0, 2 * topk.KEPT, 2)] = np.arange(1, topk.KEPT + 1)  # the block's 16 largest
    values[1] = 0.5  # left out: 16 values are larger
    values[bq.BLOCK + 2], values[bq.BLOCK] = -4.0, 2.0
    data = encode_payload(values, TOPK_BLOCK)
    assert topk.kept(values.size) == topk.KEPT + 3
    assert len(data) == 2 * 4 + 2 * (topk.KEPT + 3)
    assert np.frombuffer(data[:8], "<f4").tolist() == [np.float32(topk.KEPT / 127), np.float32(4 / 127)]
    indices = np.frombuffer(data[8 : 8 + topk.KEPT + 3], np.uint8)
    assert indices.tolist() == [*range(0, 2 * topk.KEPT, 2), 0, 1, 2]
    codes = np.frombuffer(data[8 + topk.KEPT + 3 :], np.int8)
    assert codes[topk.KEPT - 1] == 127 and codes[-3:].tolist() == [64, 0, -127]
    assert [topk.topk_nbytes(n) for n in (0, 1, 16, 256, 257)] == [0, 6, 36, 36, 42]


def test_a_block_of_ties_keeps_its_first_values() -> None:
    values = np.ones(bq.BLOCK, np.float32)
    back = decode_payload(TOPK_BLOCK, values.shape, encode_payload(values, TOPK_BLOCK))
    assert np.flatnonzero(back).tolist() == list(range(topk.KEPT))


def test_bytes_no_encoder_writes_are_refused_naming_why() -> None:
    size = 2 * bq.BLOCK + 5
    good = encode_payload(np.random.default_rng(0).standard_normal(size).astype(np.float32), TOPK_BLOCK)
    decode_payload(TOPK_BLOCK, (size,), good)
    scales, kept = 4 * 3, topk.kept(size)

    def changed(offset: int, value: bytes) -> bytes:
        bad = bytearray(good)
        bad[offset : offset + len(value)] = value
        return bytes(bad)

    cases = {
        "not a finite": changed(0, np.float32(np.nan).tobytes()),
        "non-negative": changed(4, np.float32(-0.5).tobytes()),
        "-128": changed(scales + kept + 1, b"\x80"),
        "past its 5 values": changed(scales + kept - 1, b"\x05"),
        "not strictly ascending": changed(scales + 1, good[scales : scales + 1]),  # a repeat
        "strictly ascending": changed(scales + topk.KEPT + 3, b"\x00"),  # back below the one before
        "bytes of data": good[:-1],
    }
    for message, bad in cases.items():
        with pytest.raises(TensorDecodeError, match=message):
            decode_payload(TOPK_BLOCK, (size,), bad)
    # The good payload decoded although a block's first index lies below the previous block's last.
    assert good[scales + topk.KEPT] < good[scales + topk.KEPT - 1]


def test_error_feedback_sends_every_value_a_block_left_out() -> None:
    """A constant update: each commit sends each block's 16 largest sums; the rest wait in the
    residual, growing, until they are among the largest. After enough commits every value has been
    sent, and what arrived is the updates' sum less the residual."""
    compressor = Compressor("topk")
    rng = np.random.default_rng(3)
    update = rng.uniform(0.5, 1.0, 2 * bq.BLOCK).astype(np.float32)
    received = np.zeros(update.size, np.float64)
    commits = 3 * bq.BLOCK // topk.KEPT
    for _ in range(commits):
        data, left = compressor.encode(0, update)
        compressor.applied(0, left)
        received += decode_payload(TOPK_BLOCK, update.shape, data)
    residual = compressor.residual(0)
    assert residual is not None
    assert np.all(received > 0)  # every value was sent at least once
    np.testing.assert_allclose(received, commits * update.astype(np.float64) - residual, rtol=1e-5, atol=1e-3)
    # Error feedback keeps the residual bounded: no value waits much longer than BLOCK / KEPT commits.
    assert np.abs(residual).max() < 2 * bq.BLOCK / topk.KEPT
