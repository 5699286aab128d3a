"""Where a data-plane connection reads a reply's payload: buffers it keeps, and writes again only
once nothing else holds them.

A reply's θ is handed to the caller, who may keep it, so a buffer is written again only when no
array, memoryview or tensor made from it is alive (its reference count says so). Why keep any: a
new buffer past glibc's mmap threshold (32 MiB at most) is mapped afresh for each reply and every
page of it faulted in as the reply is written, which at GPT-2 small's 124M parameters costs about
as much CPU as the copy itself (docs/PERFORMANCE.md, "A reply into pages kept"). Two are kept: a
client that holds its last θ until the next one lands (the copy a difference reply moves, the
slices a client of rounds keeps for an `unchanged` reply) alternates between them. So a
connection holds at most two buffers of its largest reply, one of them the caller's θ anyway. The
same holds for the copy a difference reply moves (held_copy.py) and for θ assembled from a
partitioned θ's slices (router.py).
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, cast

from gemps_proto import vectors

if TYPE_CHECKING:
    import numpy as np

#: how many buffers a connection keeps
KEPT = 2
#: below this the heap serves a new buffer from pages it has mapped already: nothing to keep
SMALLEST_KEPT = 1 << 20


def _references(kept: list[np.ndarray] | list[bytearray], index: int) -> int:
    """How many references `kept[index]` has, counted as `unheld` counted them."""
    return sys.getrefcount(kept[index])


class ReplyBuffers:
    """The buffers one connection reads its replies into (`take`), reused once unheld."""

    def __init__(self) -> None:
        self._kept: list[np.ndarray] = []  # uint8, oldest first
        # The count of a buffer that only `_kept` holds, measured by the same code that checks one
        # (an interpreter may count the references of a call's arguments differently).
        probe = [bytearray(1)]
        self._unheld = _references(probe, 0)

    def take(self, nbytes: int) -> memoryview:
        """A writable buffer of `nbytes`, aligned for float32 views: a kept one that nothing else
        holds any more, else a new one (kept in place of the oldest)."""
        if nbytes < SMALLEST_KEPT or not vectors.HAVE_NUMPY:
            return vectors.writable_bytes(nbytes)
        for index in range(len(self._kept)):  # no name bound to a buffer while its count is read
            if self._kept[index].nbytes >= nbytes and self.unheld(index):
                return self._kept[index][:nbytes].data
        view = vectors.writable_bytes(nbytes)
        new = cast("np.ndarray", view.obj)  # with numpy, the view's array: kept, its view handed out
        self._kept = [*self._kept[-(KEPT - 1) :], new]  # the oldest let go (an empty list slices empty)
        return view

    def unheld(self, index: int) -> bool:
        """Nothing but this object holds the kept buffer `index` (a view, an array made from it)."""
        return _references(self._kept, index) == self._unheld
