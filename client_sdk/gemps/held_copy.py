"""The copy of θ a difference-reply client holds of one server's slice (`Client(reply_compression=)`).

The server keeps the same copy, bit for bit, and numbers it; each commit names the number held,
and the reply is either the quantised difference from that copy or θ whole in bfloat16 starting
a new one (gemps_proto.reply_differences has the arithmetic both ends share). The copy is soft
state: it starts again whole whenever the numbers disagree.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

from gemps import errors
from gemps.reply_buffers import ReplyBuffers
from gemps.transport import Committed
from gemps_proto import vectors
from gemps_proto.reply_differences import advance, copy_values, whole
from gemps_proto.vectors import Vector


class HeldCopy:
    """A slice's copy (bfloat16 bits) and the number the server gave it (0: none held)."""

    def __init__(self) -> None:
        self.number = 0
        self._bits: np.ndarray | None = None
        # Where the copy's float32 values are written for the caller: pages kept, not faulted in
        # afresh each reply (at 100M parameters a new 400 MB array a commit; reply_buffers.py).
        self._values = ReplyBuffers()

    def took(self, committed: Committed) -> Vector:
        """The copy's float32 values once `committed`'s reply moved it: a difference applied to the
        copy it names, or θ whole as the new copy. A difference from a copy this client does not
        hold is refused (GempsError) and the copy forgotten, so the next commit asks for θ whole."""
        vectors.require("reply_compression")  # the client refused it without numpy: numpy's arrays from here
        code = committed.difference
        if committed.difference_of:
            held, bits = self.number, self._bits
            if code is None:
                raise errors.GempsError("the server's reply to a copy of θ carries no difference")
            if committed.difference_of != held or bits is None or bits.size != code.size:
                self.forget()
                raise errors.GempsError(
                    f"the server's commit reply is a difference from copy {committed.difference_of} of θ, "
                    f"but this client holds copy {held or 'none'}: the next commit asks for θ whole"
                )
            try:
                values = advance(bits, code, self._values_for(bits.size))  # the copy moved in place
            except BaseException:  # half moved (memory, an interrupt): the next reply starts it whole
                self.forget()
                raise
            self.number = committed.copy
            return values
        if committed.parameters is None:  # a client of difference replies never says it holds θ
            raise errors.GempsError("the server's reply to a copy of θ carries no values")
        self._bits = whole(committed.parameters.reshape(-1))
        self.number = committed.copy
        return copy_values(self._bits, self._values_for(self._bits.size))

    def _values_for(self, size: int) -> Vector:
        """Where the copy's `size` float32 values are written for the caller (kept pages)."""
        return vectors.float32s(self._values.take(4 * size))

    def forget(self) -> None:
        self.number, self._bits = 0, None
