"""gemps.pytorch.look_ahead: where an asynchronous worker's next window starts, from its replies alone."""

from __future__ import annotations

import math

import pytest
import torch

from gemps.pytorch.look_ahead import LookAhead
from gemps.pytorch.vector_pool import KEPT, VectorPool


def test_the_first_reply_is_where_the_window_starts() -> None:
    reply = torch.tensor([1.0, 2.0])
    assert LookAhead(1.0).start(reply, version=4, staleness=3) is reply  # no pace measured yet


def test_a_window_starts_the_expected_move_ahead_of_the_reply() -> None:
    ahead = LookAhead(1.0)
    ahead.start(torch.tensor([0.0, 0.0]), version=4, staleness=3)
    # θ moved by (4, -8) over 4 commits: 1 and -2 a commit; 3 other commits come before the next one lands
    start = ahead.start(torch.tensor([4.0, -8.0]), version=8, staleness=3)
    torch.testing.assert_close(start, torch.tensor([7.0, -14.0]))


def test_the_share_scales_the_move_and_zero_keeps_the_reply() -> None:
    half, none = LookAhead(0.5), LookAhead(0)
    for ahead in (half, none):
        ahead.start(torch.tensor([0.0]), version=2, staleness=1)
    torch.testing.assert_close(half.start(torch.tensor([2.0]), version=4, staleness=1), torch.tensor([2.5]))
    reply = torch.tensor([2.0])
    assert none.start(reply, version=4, staleness=1) is reply


def test_one_long_wait_does_not_throw_the_window_far_ahead() -> None:
    ahead = LookAhead(1.0)
    ahead.start(torch.tensor([0.0]), version=10, staleness=2)
    # a pause: 100 commits of others before this one landed; the smaller of the last two stalenesses counts
    torch.testing.assert_close(ahead.start(torch.tensor([101.0]), version=111, staleness=100), torch.tensor([103.0]))


def test_alone_or_after_a_restore_the_window_starts_at_the_reply() -> None:
    alone = LookAhead(1.0)
    alone.start(torch.tensor([0.0]), version=1, staleness=0)
    reply = torch.tensor([1.0])
    assert alone.start(reply, version=2, staleness=0) is reply  # no one else moves θ meanwhile
    restored = LookAhead(1.0)
    restored.start(torch.tensor([0.0]), version=50, staleness=3)
    older = torch.tensor([5.0])
    assert restored.start(older, version=40, staleness=3) is older  # a server restored from an older checkpoint
    torch.testing.assert_close(restored.start(torch.tensor([9.0]), version=44, staleness=3), torch.tensor([12.0]))


@pytest.mark.parametrize("share", [-0.5, math.nan, math.inf, True, "1"])
def test_a_share_that_is_not_a_number_at_least_zero_is_refused(share: object) -> None:
    with pytest.raises(ValueError, match="look_ahead must be a number >= 0"):
        LookAhead(share)  # type: ignore[arg-type]


def test_with_a_pool_the_start_is_the_same_bits_computed_in_the_previous_replys_room() -> None:
    """A LocalSteps worker passes its VectorPool: the start is then computed over the reply kept
    before (no θ-sized temporary), to the bit what the plain arithmetic gives."""
    rng = torch.Generator().manual_seed(0)
    replies = [torch.randn(1000, generator=rng) for _ in range(3)]
    plain, pooled, vectors = LookAhead(1.0), LookAhead(1.0), VectorPool()
    for version, reply in zip((3, 7, 12), replies, strict=True):
        expected = plain.start(reply.clone(), version, staleness=2)
        previous = pooled.kept
        start = pooled.start(reply.clone(), version, staleness=2, vectors=vectors)
        assert torch.equal(start, expected)
        if previous is not None:
            assert start is previous  # written over the reply kept before: nothing new
    assert len(vectors) == 0


def test_with_a_pool_a_reply_dropped_goes_back_to_it() -> None:
    ahead, vectors = LookAhead(1.0), VectorPool()
    first = torch.zeros(8)
    ahead.start(first, version=5, staleness=0, vectors=vectors)
    second = torch.ones(8)
    assert ahead.start(second, version=6, staleness=0, vectors=vectors) is second  # alone: no pace to follow
    assert vectors.take(8) is first  # dropped, so the pool's to hand out again


def test_a_pool_keeps_a_vector_once_and_never_a_view() -> None:
    vectors, vector = VectorPool(), torch.empty(16)
    vectors.give(vector)
    vectors.give(vector)  # given twice by two owners: two takes must not both get it
    assert len(vectors) == 1 and vectors.take(16) is vector and vectors.take(16) is not vector
    vectors.give(torch.empty(32)[:16])  # a view: its storage is not the pool's to write
    vectors.give(torch.empty(16, dtype=torch.float64))
    assert len(vectors) == 0
    for _ in range(5):
        vectors.give(torch.empty(16))
    assert len(vectors) == KEPT
