"""Difference replies (issue 47, item 3) in the domain and the SDK's copy, against a float64
reference of GEM fed the compressed commits and of the copies the replies move."""

from __future__ import annotations

import dataclasses
import tracemalloc

import numpy as np
import pytest

from gemps import errors
from gemps.grpc_messages import committed_from_proto, reply_values
from gemps.held_copy import HeldCopy
from gemps.transport import Committed
from gemps_proto import block_quantisation, reply_differences
from gemps_proto.reply_differences import advance, copy_values, difference, whole
from gemps_proto.schema import ParameterSpec, PayloadKind
from gemps_proto.tensor_codec import (
    BFLOAT16,
    INT4_BLOCK,
    INT8_BLOCK,
    EncodedTensor,
    TensorDecodeError,
    checked_block_codes,
    decode_payload,
    encode_payload,
    float32_to_bfloat16,
    quantised_with_values,
)
from gemps_proto.v1 import parameter_server_pb2 as pb
from gemps_server.domain import images, validation
from gemps_server.domain.errors import InvalidArgument
from gemps_server.domain.records import Commit, CommitOutcome
from gemps_server.domain.state import ServerState
from gemps_server.domain.workers import WorkerRegistry
from tests.helpers import encoded, training

P = 3 * block_quantisation.BLOCK + 5  # several blocks, the last one short; odd (int4's padding)
SPEC = (ParameterSpec("w", (P,)),)
ETA, MU, KAPPA, PI_MAX = 0.05, 0.9, 1.0, 5.0


def gem_state(workers: int) -> tuple[ServerState, list[str], np.ndarray]:
    theta0 = np.random.default_rng(1).standard_normal(P).astype(np.float32)
    config = training("gem", learning_rate=ETA, momentum=MU, kappa=KAPPA, pi_max=PI_MAX)
    state = ServerState(config, WorkerRegistry(max_workers=8, lease_ttl=3600))
    ids = [state.register(f"w{i}", SPEC, encoded(theta0)).worker.worker_id for i in range(workers)]
    return state, ids, theta0


def reply_of(outcome: CommitOutcome, data: bytes | memoryview) -> Committed:
    """What the SDK makes of the reply the state wrote (the wire's reading, the reply's numbers)."""
    assert outcome.reply is not None
    numbers = pb.CommitResponse(
        version=outcome.snapshot.version, copy=outcome.reply.copy, difference_of=outcome.reply.difference_of
    )
    return committed_from_proto(numbers, reply_values(numbers, EncodedTensor(outcome.reply.dtype, (P,), bytes(data))))


def difference_reply(version: int, data: bytes | bytearray, count: int, copy: int, difference_of: int) -> Committed:
    """A difference reply as the SDK reads it: its code checked, not decoded."""
    code = checked_block_codes(INT8_BLOCK, (count,), data)
    return Committed(version, 0, 0, 0, 0, 0, None, None, 0, copy=copy, difference_of=difference_of, difference=code)


def advanced(bits: np.ndarray, dtype: int, data: bytes | bytearray) -> np.ndarray:
    """The copy `bits` moved (in place) by a difference reply of `data` in `dtype`, as the SDK moves it."""
    out = np.empty(bits.size, np.float32)
    values = advance(bits, checked_block_codes(dtype, (bits.size,), data), out)
    np.testing.assert_array_equal(values, copy_values(bits))  # the moved copy's values, written as it moved
    return bits


def keep_bytes(outcome: CommitOutcome, theta: bytes | memoryview) -> bytes:
    """A reply writer that keeps the reply's θ bytes (a difference's code, or θ whole)."""
    return bytes(theta)


class Float64Gem:
    """GEM (DESIGN §1) in float64 for one server, fed each commit's decoded payload."""

    def __init__(self, theta0: np.ndarray, workers: list[str]) -> None:
        self.theta = theta0.astype(np.float64)
        self.m = {w: np.zeros(P) for w in workers}
        self.s = {w: self.theta.copy() for w in workers}

    def commit(self, worker: str, gradient: np.ndarray) -> None:
        delta = -ETA * gradient.astype(np.float64)
        self.m[worker] = MU * self.m[worker] + delta
        c = np.abs(self.theta - self.s[worker])
        pi = np.clip((KAPPA * np.abs(self.m[worker]) - c) / (np.abs(delta) + 1e-16), 0, PI_MAX)
        self.s[worker] = self.theta.copy()
        self.theta = self.theta + pi * delta


@pytest.mark.parametrize("code", [INT8_BLOCK, INT4_BLOCK])
def test_gem_with_compressed_commits_and_difference_replies_matches_a_float64_reference(code: int) -> None:
    """Four workers train a quadratic from the copies their replies leave them, commits in `code`:
    θ is the float64 reference's (fed the decoded commits) to float32's rounding; each worker's
    copy is the server's record bit for bit; and the copy stays within a code's step of the
    difference it was sent plus bfloat16's rounding of θ, never drifting further."""
    state, workers, theta0 = gem_state(4)
    reference = Float64Gem(theta0, workers)
    target = np.random.default_rng(2).standard_normal(P).astype(np.float32)
    copies = {w: HeldCopy() for w in workers}
    held = {w: theta0.copy() for w in workers}  # what each worker trains from: θ as registered, then its copy
    levels = block_quantisation.INT8_LEVELS if code == INT8_BLOCK else block_quantisation.INT4_LEVELS
    rng = np.random.default_rng(3)
    differences = 0
    for step in range(120):
        worker = workers[rng.integers(len(workers))]
        gradient = (held[worker] - target).astype(np.float32)  # the quadratic's, at the worker's θ
        payload = EncodedTensor(code, (P,), encode_payload(gradient, code))
        kept = state.core.copies.held(worker)
        before = None if kept is None else copy_values(kept[1])  # the server's record before this commit
        commit = Commit(worker, state.core.version, PayloadKind.GRADIENT.value, payload, request_id=f"c{step}",
                        reply_dtype=code, held_copy=copies[worker].number)  # fmt: skip
        outcome, data = state.core.commit_and_reply(commit, keep_bytes)
        reference.commit(worker, payload.decode_payload())
        theta = state.core.theta_copy()
        np.testing.assert_allclose(theta, reference.theta, rtol=1e-4, atol=1e-5, err_msg=f"step {step}")
        reply = reply_of(outcome, data)
        held[worker] = copies[worker].took(reply)
        number, bits = state.core.copies.held(worker)  # type: ignore[misc]
        assert copies[worker].number == number
        np.testing.assert_array_equal(whole(held[worker]), bits)  # the same bits on both ends
        if reply.difference_of:
            differences += 1
            assert before is not None
            sent = np.abs(theta - before)
            step_bound = np.repeat(np.maximum.reduceat(sent, np.arange(0, P, block_quantisation.BLOCK)), 256)[:P]
            bound = step_bound / (2 * levels) * 1.001 + np.abs(theta) * 2.0**-8 + 1e-30
            assert (np.abs(held[worker] - theta) <= bound).all(), f"step {step}"
        else:
            np.testing.assert_array_equal(held[worker], copy_values(whole(theta)))  # θ whole, in bfloat16
    assert differences == 120 - len(workers)  # one whole reply per worker, then differences only
    loss0, loss = np.mean((theta0 - target) ** 2), np.mean((state.core.theta_copy() - target) ** 2)
    assert loss < 0.05 * loss0  # and the copies train: GEM converges from them


def test_a_commit_that_names_another_copy_is_answered_whole_and_starts_a_new_one() -> None:
    """A lost reply: the commit is retried (a duplicate) naming the copy held before it; the state
    moved its record with the reply that was lost, so the retry's reply is θ whole."""
    state, (worker,), _ = gem_state(1)
    gradient = EncodedTensor(INT8_BLOCK, (P,), encode_payload(np.ones(P, np.float32), INT8_BLOCK))
    first = Commit(worker, 0, PayloadKind.GRADIENT.value, gradient, request_id="a", reply_dtype=INT8_BLOCK)
    outcome, _ = state.core.commit_and_reply(first, keep_bytes)
    assert outcome.reply is not None and outcome.reply.dtype == BFLOAT16 and outcome.reply.difference_of == 0
    number = outcome.reply.copy
    second = dataclasses.replace(first, request_id="b", base_version=1, held_copy=number)
    outcome, _ = state.core.commit_and_reply(second, keep_bytes)  # its reply is lost
    assert outcome.reply is not None and outcome.reply.difference_of == number
    outcome, data = state.core.commit_and_reply(second, keep_bytes)  # the retry, naming the copy before
    assert outcome.duplicate and state.core.version == 2
    assert outcome.reply is not None and outcome.reply.dtype == BFLOAT16 and outcome.reply.difference_of == 0
    assert bytes(data) == whole(state.core.theta_copy()).tobytes()


def test_leaving_registering_again_or_a_new_image_forgets_the_copies() -> None:
    state, (worker, other), _ = gem_state(2)
    for name in (worker, other):
        commit = Commit(name, 0, PayloadKind.UPDATE.value, encoded(np.zeros(P, np.float32)), reply_dtype=INT8_BLOCK)
        state.core.commit_and_reply(commit, keep_bytes)
    assert len(state.core.copies) == 2 and state.core.copies.nbytes == 2 * 2 * P
    state.leave(worker)
    assert state.core.copies.held(worker) is None and state.core.copies.nbytes == 2 * P
    images.adopt(state, images.take(state))  # as a backup takes its primary's image: no copies
    assert len(state.core.copies) == 0 and state.core.copies.nbytes == 0


def test_pulls_take_no_difference_codes() -> None:
    validation.check_reply_dtype(INT8_BLOCK, commit=True)
    with pytest.raises(InvalidArgument, match="a pull's"):
        validation.check_reply_dtype(INT8_BLOCK)


def test_the_sdk_refuses_a_difference_from_a_copy_it_does_not_hold_and_asks_whole_again() -> None:
    copy = HeldCopy()
    theta = np.linspace(-1, 1, P, dtype=np.float32)
    copy.took(Committed(1, 0, 0, 0, 0, 0, copy_values(whole(theta)), None, 0, copy=7))
    data, _ = difference(theta + 0.01, whole(theta), INT8_BLOCK)
    stray = difference_reply(2, data, P, copy=9, difference_of=8)
    with pytest.raises(errors.GempsError, match="difference from copy 8 of θ, but this client holds copy 7"):
        copy.took(stray)
    assert copy.number == 0  # the next commit names no copy: its reply is θ whole


def test_a_copys_values_land_in_kept_pages_and_never_over_a_theta_the_caller_holds() -> None:
    """A worker loads each reply's θ and lets it go: the next reply's values are written into memory
    kept for them, not a new θ-sized array (at 100M parameters, 400 MB of pages faulted in a commit).
    A θ the caller still holds is never written over."""
    # Eight of the chunks `advance` moves the copy by: its temporaries are a chunk's, under half of θ's bytes
    size = 8 * reply_differences.CHUNK_BLOCKS * block_quantisation.BLOCK
    rng = np.random.default_rng(3)
    theta = rng.standard_normal(size).astype(np.float32)
    copy, server_bits = HeldCopy(), whole(theta)
    replies = iter(range(2, 100))

    def next_reply() -> Committed:
        nonlocal server_bits
        number = next(replies)
        theta[:] += rng.standard_normal(size).astype(np.float32) * 1e-2
        data, server_bits = difference(theta, server_bits, INT8_BLOCK)
        return difference_reply(number, data, size, copy=number, difference_of=number - 1)

    held = [copy.took(Committed(1, 0, 0, 0, 0, 0, copy_values(server_bits), None, 0, copy=1))]
    held += [copy.took(next_reply()) for _ in range(3)]  # the caller keeps every θ
    snapshots = [values.copy() for values in held]
    np.testing.assert_array_equal(held[-1], copy_values(server_bits))
    for values, snapshot in zip(held, snapshots, strict=True):
        np.testing.assert_array_equal(values, snapshot)  # none written over by a later reply
    del held
    for _ in range(3):  # now each θ is let go before the next reply
        reply = next_reply()
        tracemalloc.start()
        loaded = copy.took(reply)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        np.testing.assert_array_equal(loaded, copy_values(server_bits))
        assert peak < 2 * size, f"{peak:,} bytes allocated for a reply of {4 * size:,} (θ in float32)"
        del loaded


def test_a_difference_reply_is_read_into_the_copy_with_no_float32_array_of_thetas_size() -> None:
    """From the reply's bytes to the copy's values, as the SDK reads a reply: the code is checked,
    then read a chunk at a time as the copy moves. It was decoded whole first, a float32 array of θ's
    size a reply (at 85M parameters, 340 MB whose pages were faulted in on every other commit)."""
    size = 8 * reply_differences.CHUNK_BLOCKS * block_quantisation.BLOCK
    rng = np.random.default_rng(4)
    theta = rng.standard_normal(size).astype(np.float32)
    copy, server_bits = HeldCopy(), whole(theta)
    copy.took(Committed(1, 0, 0, 0, 0, 0, copy_values(server_bits), None, 0, copy=1))
    for number in range(2, 6):  # the first two fill the kept pages; each θ let go before the next reply
        theta += rng.standard_normal(size).astype(np.float32) * np.float32(1e-2)
        data, server_bits = difference(theta, server_bits, INT8_BLOCK)
        numbers = pb.CommitResponse(version=number, copy=number, difference_of=number - 1)
        tracemalloc.start()
        loaded = copy.took(
            committed_from_proto(numbers, reply_values(numbers, EncodedTensor(INT8_BLOCK, (size,), data)))
        )
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        np.testing.assert_array_equal(loaded, copy_values(server_bits))
        if number > 3:
            assert peak < 2 * size, f"{peak:,} bytes allocated reading a reply of θ's {4 * size:,} in float32"
        del loaded


def test_both_ends_advance_a_copy_to_the_same_bits() -> None:
    rng = np.random.default_rng(0)
    bits = whole(rng.standard_normal(P).astype(np.float32))
    for code in (INT8_BLOCK, INT4_BLOCK):
        theta = copy_values(bits) + rng.standard_normal(P).astype(np.float32) * 1e-2
        data, server = difference(theta, bits, code)
        np.testing.assert_array_equal(advanced(bits.copy(), code, data), server)


def test_the_sdk_refuses_a_reply_whose_encoding_and_numbers_disagree() -> None:
    """A code where θ whole was due, θ where a difference was, or a code no encoder writes."""
    code = EncodedTensor(INT8_BLOCK, (P,), encode_payload(np.ones(P, np.float32), INT8_BLOCK))
    with pytest.raises(TensorDecodeError, match="DTYPE_INT8_BLOCK that says it is θ whole"):
        reply_values(pb.CommitResponse(copy=3), code)
    bf16 = EncodedTensor(BFLOAT16, (P,), whole(np.ones(P, np.float32)).tobytes())
    with pytest.raises(TensorDecodeError, match="a difference from copy 2"):
        reply_values(pb.CommitResponse(copy=3, difference_of=2), bf16)
    hostile = bytearray(code.data)
    hostile[:4] = np.float32(np.inf).tobytes()  # the first block's scale
    with pytest.raises(TensorDecodeError, match="scale"):
        reply_values(pb.CommitResponse(copy=3, difference_of=2), EncodedTensor(INT8_BLOCK, (P,), bytes(hostile)))
    checked = reply_values(pb.CommitResponse(copy=3, difference_of=2), code)
    assert not isinstance(checked, np.ndarray)  # the code, read as the copy moves
    np.testing.assert_array_equal(checked.values(), np.ones(P))


def test_a_copy_is_kept_only_where_the_memory_budget_leaves_room_beside_the_rule_state() -> None:
    """The workers' rule state comes first: with no room left for a copy the reply is θ whole,
    numbered 0, nothing is kept and it is counted; once a worker leaves, the next copy is kept."""
    state, (worker, other), _ = gem_state(2)
    state.memory.bytes = state.rule_state_bytes + 2 * P  # room for one copy
    commits = {
        name: Commit(name, 0, PayloadKind.UPDATE.value, encoded(np.zeros(P, np.float32)), reply_dtype=INT8_BLOCK)
        for name in (worker, other)
    }
    first, _ = state.core.commit_and_reply(commits[worker], keep_bytes)
    assert first.reply is not None and first.reply.copy != 0 and state.core.copies.nbytes == 2 * P
    second, data = state.core.commit_and_reply(commits[other], keep_bytes)
    assert second.reply is not None and (second.reply.dtype, second.reply.copy) == (BFLOAT16, 0)
    assert bytes(data) == whole(state.core.theta_copy()).tobytes()  # θ whole all the same
    assert state.core.copies.held(other) is None and state.core.copies.unkept == 1
    state.leave(worker)  # its rule state and its copy go
    third, _ = state.core.commit_and_reply(dataclasses.replace(commits[other], base_version=2), keep_bytes)
    assert third.reply is not None and third.reply.copy != 0 and state.core.copies.held(other) is not None


def test_a_registration_drops_the_copies_renewed_longest_ago_that_no_longer_fit() -> None:
    """Issue 77, item 7: copies kept while there was room stayed when a later worker's rule state
    took it (1.12x the budget at 5 workers). Now the registration drops the copies renewed longest
    ago until the rest fit; those workers' next replies are θ whole."""
    state, workers, _ = gem_state(3)
    state.memory.bytes = state.rule_state_bytes // 3 * 4 + 2 * 2 * P  # a fourth worker's state, and 2 copies
    for version, worker in enumerate([*workers, workers[0]]):  # the first renews its copy last
        commit = Commit(
            worker, version, PayloadKind.UPDATE.value, encoded(np.zeros(P, np.float32)), reply_dtype=INT8_BLOCK
        )
        state.core.commit_and_reply(commit, keep_bytes)
    assert len(state.core.copies) == 3 and state.rule_state_bytes + state.core.copies.nbytes <= state.memory.bytes
    state.register("w3", SPEC, None)
    assert state.rule_state_bytes + state.core.copies.nbytes <= state.memory.bytes
    assert [worker for worker in workers if state.core.copies.held(worker) is not None] == [workers[0], workers[2]]


# -- θ beyond bfloat16's range (issue 61, item 10) ---------------------------------------------------

BEYOND = np.array([3.4e38, -3.4e38, 3.3961e38, np.finfo(np.float32).max, 1.0, -2.5], np.float32)


def test_a_finite_theta_beyond_bfloat16s_range_is_carried_as_its_largest_value_not_inf() -> None:
    """bfloat16's largest finite value is 3.3895e38; float32's finite values above it rounded to inf
    (whole replies, pulls in bfloat16, and the copies difference replies keep)."""
    carried = copy_values(whole(BEYOND))
    assert np.isfinite(carried).all(), carried
    largest = float(copy_values(np.array([0x7F7F], np.uint16))[0])
    np.testing.assert_array_equal(carried[:4], [largest, -largest, largest, largest])
    np.testing.assert_array_equal(carried[4:], [1.0, -2.5])
    decoded = decode_payload(BFLOAT16, BEYOND.shape, encode_payload(BEYOND, BFLOAT16))
    assert np.isfinite(decoded).all()


@pytest.mark.parametrize("dtype", [INT8_BLOCK, INT4_BLOCK])
def test_a_difference_reply_near_float32s_largest_keeps_the_copy_finite(dtype: int) -> None:
    theta = np.full(P, 3.0e38, np.float32)
    bits = whole(theta)
    theta[::3] = np.float32(3.4e38)  # θ moves past bfloat16's largest value
    data, after = difference(theta, bits, dtype)
    assert np.isfinite(copy_values(after)).all()
    np.testing.assert_array_equal(advanced(bits, dtype, data), after)


# -- a difference reply's transients (issue 61, item 9) -----------------------------------------------


@pytest.mark.parametrize("dtype", [INT8_BLOCK, INT4_BLOCK])
def test_a_difference_taken_a_chunk_at_a_time_is_the_same_bytes_and_bits_as_at_once(
    dtype: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its float32 temporaries were θ-sized, several at once, and out of the memory budget (12-24 %
    over it in the issue's probe); now a chunk of whole blocks at a time. The codes are blockwise,
    so chunks change nothing: the bytes and the copy are those of the arithmetic on θ at once, for
    an odd count (int4's padding nibble), a short last block and a short last chunk."""
    monkeypatch.setattr(reply_differences, "CHUNK_BLOCKS", 3)
    rng = np.random.default_rng(5)
    count = 10 * 256 + 77
    bits = whole(rng.standard_normal(count).astype(np.float32))
    theta = copy_values(bits) + rng.standard_normal(count).astype(np.float32) * 1e-2
    theta[: 2 * 256] = 0.0  # whole blocks of zeros (a zero scale) in the first chunk
    theta[700] = np.float32(3.4e38)  # past bfloat16's largest, in the second chunk
    held = copy_values(bits)
    expected, step = quantised_with_values(theta - held, dtype)
    data, after = difference(theta, bits, dtype)
    assert data == expected
    np.testing.assert_array_equal(after, float32_to_bfloat16(held + step))
    np.testing.assert_array_equal(advanced(bits.copy(), dtype, data), after)
    theta_2d, bits_2d = theta[: 8 * 256].reshape(8, 256), bits[: 8 * 256].reshape(8, 256)
    data_2d, after_2d = difference(theta_2d, bits_2d, dtype)  # a shaped θ: the copy keeps its shape
    assert after_2d.shape == (8, 256) and data_2d == difference(theta[: 8 * 256], bits[: 8 * 256], dtype)[0]
    with pytest.raises(ValueError, match="int8 or int4 block codes"):
        difference(theta, bits, BFLOAT16)


def test_a_coded_commit_answered_with_a_difference_holds_little_beyond_the_replys_bytes() -> None:
    """The server's side of a window's commit with int8 both ways: the payload decoded into memory
    the core keeps, the worker's copy moved in place, the reply's code handed on without a copy of
    its bytes: the code's byte a value, beside a chunk's temporaries (1.2 bytes a value here). It
    held 3.6 (θ's values decoded, the new copy, the code twice)."""
    size = 16 * reply_differences.CHUNK_BLOCKS * block_quantisation.BLOCK  # the chunks' ~20 MB: 1.2 a value
    config = training("downpour", learning_rate=ETA)
    state = ServerState(config, WorkerRegistry(max_workers=4, lease_ttl=3600))
    spec = (ParameterSpec("w", (size,)),)
    worker = state.register("w", spec, encoded(np.zeros(size, np.float32))).worker.worker_id
    copy, rng = HeldCopy(), np.random.default_rng(8)
    for step in range(4):
        update = rng.standard_normal(size).astype(np.float32) * np.float32(1e-2)
        payload = EncodedTensor(INT8_BLOCK, (size,), encode_payload(update, INT8_BLOCK))
        commit = Commit(worker, state.core.version, PayloadKind.UPDATE.value, payload, request_id=f"c{step}",
                        reply_dtype=INT8_BLOCK, held_copy=copy.number)  # fmt: skip
        tracemalloc.start()
        outcome, data = state.core.commit_and_reply(commit, keep_bytes)
        peak = tracemalloc.get_traced_memory()[1] - len(data)  # keep_bytes' own copy of the reply aside
        tracemalloc.stop()
        numbers = pb.CommitResponse(version=outcome.snapshot.version, copy=outcome.reply.copy,  # type: ignore[union-attr]
                                    difference_of=outcome.reply.difference_of)  # type: ignore[union-attr]  # fmt: skip
        dtype = outcome.reply.dtype  # type: ignore[union-attr]
        copy.took(committed_from_proto(numbers, reply_values(numbers, EncodedTensor(dtype, (size,), data))))
        if step >= 2:  # a difference (the first reply is θ whole), the decoding memory kept
            assert numbers.difference_of
            assert peak < 3 * size, f"{peak / size:.2f} bytes a value held by the server's side of a commit"


def test_a_difference_replys_arithmetic_holds_a_chunk_not_several_thetas() -> None:
    """Beyond its results (the code and the new copy), it held 3.0 θ-sized float32 temporaries at
    its peak (tracemalloc sees numpy's); now a chunk's (4 MiB each) and the reply's bytes: 0.6 θ here."""
    count = 8 << 20
    rng = np.random.default_rng(6)
    theta = rng.standard_normal(count).astype(np.float32)
    bits = whole(theta + np.float32(0.01))
    tracemalloc.start()
    try:
        data, after = difference(theta, bits, INT8_BLOCK)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak - len(data) - after.nbytes < theta.nbytes, f"{(peak - len(data) - after.nbytes) / theta.nbytes:.2f} θ"


def test_a_difference_reply_moves_the_copy_in_place_without_a_temporary_of_its_size() -> None:
    """The SDK's copy after a difference reply: the same bits as the whole arithmetic at once, made
    in the copy's own memory a chunk at a time (at 8M values the whole arithmetic's temporaries
    were 10 bytes a value: a worker held 37 bytes a parameter at its peak with int8 both ways)."""
    count = 8 * block_quantisation.BLOCK * reply_differences.CHUNK_BLOCKS + 5
    rng = np.random.default_rng(3)
    bits = whole(rng.standard_normal(count).astype(np.float32))
    code = checked_block_codes(
        INT8_BLOCK, (count,), encode_payload(rng.standard_normal(count).astype(np.float32) * 1e-2, INT8_BLOCK)
    )
    expected = float32_to_bfloat16(copy_values(bits) + code.values())
    out, before = np.empty(count, np.float32), bits.__array_interface__["data"][0]
    tracemalloc.start()
    try:
        values = advance(bits, code, out)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak <= 2 * count, f"{peak / count:.1f} bytes a value beside the copy and the code"
    assert bits.__array_interface__["data"][0] == before and bits.tobytes() == expected.tobytes()
    assert values is out and out.tobytes() == copy_values(expected).tobytes()
