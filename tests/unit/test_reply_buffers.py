"""A connection's reply buffers: written again only once nothing made from them is alive."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch

from gemps.reply_buffers import KEPT, SMALLEST_KEPT, ReplyBuffers

SIZE = 4 * SMALLEST_KEPT


def address(view: memoryview) -> int:
    return int(np.frombuffer(view, np.uint8).ctypes.data)


def test_a_buffer_nothing_holds_is_taken_again() -> None:
    buffers = ReplyBuffers()
    first = address(buffers.take(SIZE))
    assert address(buffers.take(SIZE)) == first
    assert address(buffers.take(SIZE // 2)) == first  # a smaller reply fits in it


HOLDERS: dict[str, Callable[[memoryview], object]] = {
    "the view": lambda view: view,
    "a read-only view": memoryview.toreadonly,
    "float32 values, as a decoder aliases them": lambda view: np.frombuffer(view.toreadonly(), np.float32),
    "a slice of them": lambda view: np.frombuffer(view, np.float32)[3:].reshape(-1, 1),
    "a tensor on them": lambda view: torch.from_numpy(np.frombuffer(view, np.float32)),
}


@pytest.mark.parametrize("made", HOLDERS.values(), ids=HOLDERS.keys())
def test_a_buffer_held_in_any_form_is_never_written_again(made: Callable[[memoryview], object]) -> None:
    buffers = ReplyBuffers()
    view = buffers.take(SIZE)
    view[:] = b"\x01" * SIZE
    first = address(view)
    holder = made(view)
    del view
    for _ in range(3):
        other = buffers.take(SIZE)
        assert address(other) != first
        other[:] = b"\x02" * SIZE
        del other
    assert np.asarray(holder).tobytes().count(1) in {SIZE, SIZE - 12}  # untouched
    del holder
    assert address(buffers.take(SIZE)) == first  # let go: taken again


def test_two_alternate_when_the_caller_holds_its_last_reply() -> None:
    buffers = ReplyBuffers()
    held = buffers.take(SIZE)  # the caller keeps its last θ until the next lands
    addresses = set()
    for _ in range(6):
        new = buffers.take(SIZE)
        assert address(new) != address(held)
        addresses.add(address(new))
        held = new
    assert len(addresses) == KEPT


def test_at_most_two_are_kept_and_small_replies_are_not() -> None:
    buffers = ReplyBuffers()
    held = [buffers.take(SIZE) for _ in range(5)]  # all held: five new buffers
    assert len({address(view) for view in held}) == 5
    assert len(buffers._kept) == KEPT
    small = buffers.take(SMALLEST_KEPT - 1)
    assert len(buffers._kept) == KEPT and all(address(small) != address(view) for view in held)
