"""Blockwise int8/int4 commit payloads (gemps_proto.block_quantisation, issue 47): the codes'
bounds, their layout, what a hostile sender can put in them, the client's error feedback, and GEM
with compressed updates against its plain float64 reference."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from gemps.compression import Compressor
from gemps_proto import block_quantisation as bq
from gemps_proto import tensor_codec
from gemps_proto.schema import ParameterSpec
from gemps_proto.tensor_codec import (
    COMPRESSIONS,
    FLOAT32,
    INT4_BLOCK,
    INT8_BLOCK,
    TOPK_BLOCK,
    EncodedTensor,
    TensorDecodeError,
    decode_payload,
    encode_payload,
    expected_payload_nbytes,
    quantised_subtracting,
    quantised_with_values,
)
from gemps_server.domain.errors import InvalidArgument
from gemps_server.domain.records import Commit
from gemps_server.domain.state import ServerState
from gemps_server.domain.workers import WorkerRegistry
from tests.helpers import encoded, rule_option, training
from tests.unit.reference_rules import ReferenceServer

LEVELS = {INT8_BLOCK: bq.INT8_LEVELS, INT4_BLOCK: bq.INT4_LEVELS}
FINITE = arrays(
    np.float32,
    st.integers(0, 3 * bq.BLOCK + 7),
    elements=st.floats(-(2.0**100), 2.0**100, width=32, allow_nan=False, allow_infinity=False, allow_subnormal=False),
)


@settings(max_examples=200, deadline=None)
@given(values=FINITE, dtype=st.sampled_from([INT8_BLOCK, INT4_BLOCK]))
def test_each_value_comes_back_within_half_a_step_of_its_block(values: np.ndarray, dtype: int) -> None:
    data = encode_payload(values, dtype)
    assert len(data) == expected_payload_nbytes(dtype, values.shape)
    back = decode_payload(dtype, values.shape, data)
    assert back.dtype == np.float32 and back.shape == values.shape
    for start in range(0, values.size, bq.BLOCK):
        block, returned = values[start : start + bq.BLOCK].astype(np.float64), back[start : start + bq.BLOCK]
        step = np.abs(block).max() / LEVELS[dtype]
        assert np.all(np.abs(returned - block) <= step / 2 * (1 + 1e-5) + 1e-38)
        assert np.all(np.sign(returned)[returned != 0] == np.sign(block)[returned != 0])
    assert encode_payload(values, dtype) == data  # the same bytes again: a retry resends them


def test_the_layout_is_scales_then_codes() -> None:
    values = np.zeros(2 * bq.BLOCK + 1, np.float32)
    values[3], values[bq.BLOCK + 1], values[-1] = 127.0, -2.0, 7.0
    int8 = encode_payload(values, INT8_BLOCK)
    scales = np.array([127.0, 2.0, 7.0], np.float32) / np.float32(127)
    assert np.frombuffer(int8[:12], "<f4").tolist() == scales.tolist()
    codes = np.frombuffer(int8[12:], np.int8)
    assert (codes[3], codes[bq.BLOCK + 1], codes[-1]) == (127, -127, 127) and np.count_nonzero(codes) == 3
    int4 = encode_payload(values, INT4_BLOCK)
    assert len(int4) == 12 + (values.size + 1) // 2
    packed = np.frombuffer(int4[12:], np.uint8)
    assert packed[1] == 0x70  # value 3: the high nibble of byte 1, +7
    assert packed[-1] == 0x07  # the last value, +7, in a low nibble; the padding nibble 0
    assert [bq.int8_nbytes(n) for n in (0, 1, 256, 257)] == [0, 5, 260, 265]
    assert [bq.int4_nbytes(n) for n in (0, 1, 256, 257)] == [0, 5, 132, 137]
    assert COMPRESSIONS == {"int8": INT8_BLOCK, "int4": INT4_BLOCK, "topk": TOPK_BLOCK}


@pytest.mark.parametrize("dtype", [INT8_BLOCK, INT4_BLOCK])
def test_bytes_no_encoder_writes_are_refused_naming_why(dtype: int) -> None:
    size = bq.BLOCK + 3
    good = bytearray(encode_payload(np.linspace(-1, 1, size, dtype=np.float32), dtype))
    decode_payload(dtype, (size,), good)
    cases = {"not a finite": (0, np.float32(np.inf)), "non-negative": (4, np.float32(-0.5))}
    for message, (offset, scale) in cases.items():
        bad = bytearray(good)
        bad[offset : offset + 4] = scale.tobytes()
        with pytest.raises(TensorDecodeError, match=message):
            decode_payload(dtype, (size,), bad)
    bad = bytearray(good)
    if dtype == INT8_BLOCK:
        bad[8] = 0x80
        match = "-128"
    else:
        bad[8] = 0x08
        match = "-8"
    with pytest.raises(TensorDecodeError, match=match):
        decode_payload(dtype, (size,), bad)
    for length in (len(good) - 1, len(good) + 1):
        with pytest.raises(TensorDecodeError, match="bytes of data"):
            decode_payload(dtype, (size,), bytes(good[:length]) + b"\0" * max(0, length - len(good)))
    if dtype == INT4_BLOCK:
        bad = bytearray(good)
        bad[-1] |= 0x10
        with pytest.raises(TensorDecodeError, match="padding"):
            decode_payload(dtype, (size,), bad)


def test_the_client_keeps_what_the_codes_round_away_and_adds_it_to_the_next_commit() -> None:
    compressor = Compressor("int4")
    rng = np.random.default_rng(1)
    sent, received = np.zeros(500, np.float64), np.zeros(500, np.float64)
    for _ in range(30):
        update = rng.standard_normal(500).astype(np.float32)
        data, left = compressor.encode(0, update)
        again, _ = compressor.encode(0, update)
        assert data == again  # until applied, encoding again gives the same bytes
        compressor.applied(0, left)
        sent += update
        received += decode_payload(INT4_BLOCK, (500,), data)
    residual = compressor.residual(0)
    assert residual is not None
    np.testing.assert_allclose(received, sent - residual, atol=1e-4)
    assert np.abs(residual).max() < 0.5  # half a step: every block's peak / 14 at most
    compressor.reset()
    assert compressor.residual(0) is None


def test_gem_with_compressed_updates_is_gem_on_what_they_decode_to() -> None:
    """The server decodes a compressed payload and applies its rule to it: the plain reference of
    DESIGN §1 fed the decoded values gives the same theta."""
    size = 300
    rng = np.random.default_rng(2)
    theta0 = rng.standard_normal(size).astype(np.float32)
    config = training("gem", learning_rate=0.05)
    state = ServerState(config, WorkerRegistry(max_workers=4, lease_ttl=3600))
    hyper = (rule_option(config, name) for name in ("momentum", "kappa", "pi_max"))
    reference = ReferenceServer("gem", theta0, 0.05, *hyper)
    spec = [ParameterSpec("w", (size,))]
    workers = []
    for _ in range(3):
        worker = state.register("w", spec, encoded(theta0)).worker.worker_id
        reference.register(worker)
        workers.append(worker)
    for step in range(12):
        worker, dtype = workers[step % 3], (INT8_BLOCK, INT4_BLOCK, TOPK_BLOCK)[step // 3 % 3]
        gradient = rng.standard_normal(size).astype(np.float32)
        data = encode_payload(gradient, dtype)
        state.core.commit_record(Commit(worker, state.core.version, 1, EncodedTensor(dtype, (size,), data)))
        reference.commit(worker, decode_payload(dtype, (size,), data), reference.version)
    np.testing.assert_allclose(state.core.theta_copy(), reference.theta, rtol=2e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [INT8_BLOCK, INT4_BLOCK, TOPK_BLOCK])
@pytest.mark.parametrize("count", [0, 1, 255, 256, 257, 3 * bq.BLOCK + 5])
def test_the_values_in_hand_are_what_decoding_the_bytes_reads(dtype: int, count: int) -> None:
    """quantised_with_values (the SDK's residual, the server's difference reply) spares the second
    read of the bytes: the same bytes as encode_payload, the same bits as decode_payload."""
    rng = np.random.default_rng(count)
    values = (rng.standard_normal(count) * rng.choice([0.0, 1e-30, 1e-3, 1.0, 1e30], count)).astype(np.float32)
    data, decoded = quantised_with_values(values, dtype)
    assert data == encode_payload(values, dtype)
    assert decoded.tobytes() == decode_payload(dtype, (count,), data).tobytes()


@pytest.mark.parametrize("dtype", [INT8_BLOCK, INT4_BLOCK, TOPK_BLOCK])
@pytest.mark.parametrize("count", [0, 1, 257, 2 * bq.CHUNK + bq.BLOCK + 77])
def test_coded_in_place_the_values_keep_exactly_what_the_codes_lose(dtype: int, count: int) -> None:
    """quantised_subtracting (the SDK's error feedback) gives quantised_with_values' bytes and leaves
    in the values, bit for bit, their difference from what the bytes decode to, across chunks."""
    rng = np.random.default_rng(count)
    values = (rng.standard_normal(count) * rng.choice([0.0, 1e-30, 1e-3, 1.0, 1e30], count)).astype(np.float32)
    data, decoded = quantised_with_values(values, dtype)
    left = values.copy()
    assert quantised_subtracting(left, dtype) == data
    assert left.tobytes() == (values - decoded).tobytes()
    with pytest.raises(ValueError, match="contiguous float32 only"):
        quantised_subtracting(values[::2].copy().astype(np.float64), dtype)


def test_a_commits_codes_hold_no_array_of_the_decoded_values() -> None:
    """A worker's error feedback at 100M: the sum of its update and residual becomes the next
    residual in place; beside it only the bytes (a byte a value, twice while copied out) and a
    chunk's temporaries, where it held the decoded values too (4 bytes a value)."""
    count = 4_000_000
    rng = np.random.default_rng(2)
    compressor = Compressor("int8")
    data, left = compressor.encode(0, rng.standard_normal(count).astype(np.float32))
    compressor.applied(0, left)
    update = rng.standard_normal(count).astype(np.float32)
    tracemalloc.start()
    try:
        data, left = compressor.encode(0, update)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak <= left.nbytes + 2 * len(data) + 0.5 * count, f"{peak / count:.1f} bytes a value at the peak"


@pytest.mark.parametrize("dtype", [INT8_BLOCK, INT4_BLOCK])
def test_chunk_by_chunk_the_codes_are_the_whole_payloads_at_once(dtype: int) -> None:
    """The encoder codes CHUNK values at a time (no payload-sized temporary): across several
    chunks, a zero block and a short last block, every scale and code is what the definition
    gives for the whole payload at once (a float64 reference: largest |value| / levels, rounded
    half to even)."""
    count = 3 * bq.CHUNK + bq.BLOCK + 77
    rng = np.random.default_rng(7)
    values = (rng.standard_normal(count) * rng.choice([1e-3, 1.0, 1e3], count)).astype(np.float32)
    values[bq.CHUNK - bq.BLOCK : bq.CHUNK] = 0.0  # a zero block at a chunk's end
    levels = LEVELS[dtype]
    padded = np.concatenate([values, np.zeros(-count % bq.BLOCK, np.float32)]).reshape(-1, bq.BLOCK)
    scales = (np.abs(padded).max(axis=1) / np.float32(levels)).astype(np.float32)
    codes = np.clip(np.rint(padded / np.where(scales > 0, scales, 1)[:, None]), -levels, levels).reshape(-1)[:count]
    data = encode_payload(values, dtype)
    assert np.frombuffer(data, "<f4", count=scales.size).tobytes() == scales.tobytes()
    expected = codes.astype(np.int8).astype(np.float32) * np.repeat(scales, bq.BLOCK)[:count]  # code 0 is +0
    assert decode_payload(dtype, (count,), data).tobytes() == expected.tobytes()


def test_coding_a_payload_holds_little_beyond_its_bytes_and_their_values() -> None:
    """A worker's peak memory for a large model is bounded by what the codes must hold: the bytes
    and the values they decode to (the residual's), and at most 1.5 bytes a value beside them."""
    count = 4_000_000
    values = np.random.default_rng(1).standard_normal(count).astype(np.float32)
    tracemalloc.start()
    try:
        data, decoded = quantised_with_values(values, INT8_BLOCK)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    kept = len(data) + decoded.nbytes  # 1 and 4 bytes a value
    assert peak <= kept + 1.5 * count, f"{peak / count:.1f} bytes a value at the peak, {kept / count:.1f} kept"


def test_payload_sizes_asked_per_commit_are_remembered_for_few_keys_and_shapes_unremembered() -> None:
    """expected_payload_nbytes remembers flat sizes (asked twice a commit) under keys of two ints,
    at most 64 of them whatever sizes the wire announces, and answers as it computes them: a
    negative size, an unknown dtype or a shape of several dimensions refused or counted each time."""
    for size in range(1, 1_000):
        assert expected_payload_nbytes(FLOAT32, [size]) == 4 * size
        assert expected_payload_nbytes(FLOAT32, (size,)) == 4 * size
    assert tensor_codec._flat_payload_nbytes.cache_info().currsize <= 64
    assert expected_payload_nbytes(FLOAT32, (3, 5)) == 60
    for _ in range(2):
        with pytest.raises(TensorDecodeError, match="negative"):
            expected_payload_nbytes(FLOAT32, [-1])
        with pytest.raises(TensorDecodeError, match="unsupported dtype"):
            expected_payload_nbytes(999, [5])


@pytest.mark.parametrize("rule", ["downpour", "gem"])
def test_the_server_decodes_a_coded_commit_into_memory_it_keeps(rule: str) -> None:
    """Each coded commit's values were a new float32 array of θ's size (at 100M parameters 400 MB of
    fresh pages a commit); now the core decodes them into memory it keeps, from the second commit on.
    A payload of another size is refused as before, θ untouched, the kept memory unread."""
    size = 1 << 20
    state = ServerState(training(rule, learning_rate=0.05), WorkerRegistry(max_workers=4, lease_ttl=3600))
    worker = state.register("w", [ParameterSpec("w", (size,))], encoded(np.zeros(size, np.float32))).worker.worker_id
    kind = 2 if rule == "downpour" else 1  # an update, as LocalSteps sends; a gradient
    rng = np.random.default_rng(0)
    for step in range(3):
        data = encode_payload(rng.standard_normal(size).astype(np.float32) * np.float32(1e-3), INT8_BLOCK)
        before = state.core.theta_copy()
        tracemalloc.start()
        state.core.commit_record(Commit(worker, state.core.version, kind, EncodedTensor(INT8_BLOCK, (size,), data)))
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert not np.array_equal(state.core.theta_copy(), before)
        if step:
            assert peak < size, f"{peak / size:.2f} bytes a value held applying a coded commit"
    theta = state.core.theta_copy()
    longer = encode_payload(np.ones(size + 1, np.float32), INT8_BLOCK)
    with pytest.raises(InvalidArgument, match=r"payload shape \[1048577\] does not match"):
        state.core.commit_record(
            Commit(worker, state.core.version, kind, EncodedTensor(INT8_BLOCK, (size + 1,), longer))
        )
    np.testing.assert_array_equal(state.core.theta_copy(), theta)
