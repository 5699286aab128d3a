"""Commit replies that send only what changed (issue 47, item 3): the arithmetic the SDK and the
server share, so the client's copy of θ and the server's record of it stay the same bits.

A client that asks for difference replies (a commit's reply_dtype DTYPE_INT8_BLOCK or
DTYPE_INT4_BLOCK) holds a *copy* of θ whose values are bfloat16 numbers, and the server keeps the
same copy for that worker. A reply is then

    code = Q(θ - copy)                      blockwise int8 or int4 (block_quantisation.py)
    copy <- bfloat16(copy + decode(code))   on both sides, from the same bytes, by `advance`

so the copy never drifts from the server's record (both sides run the same float32 add and the
same rounding), and what a reply's code rounds away is in the next reply's difference (the copy
tracks θ, it does not accumulate error). The copy is not s_i (GEM's θ before the worker's own
commit): it is what the worker trains from, and GEM's state is left as it is.

When the numbers differ (the client holds none yet, a reply was lost and the commit retried, the
worker registered again, another primary took over) the reply is θ whole in bfloat16, and its
values are the new copy: `whole`. Each copy has a number the server chose; the client sends it
back with its next commit (held_copy), and a difference reply names the copy it applies to.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

from gemps_proto.tensor_codec import (
    BFLOAT16,
    INT4_BLOCK,
    INT8_BLOCK,
    bfloat16_to_float32,
    float32_to_bfloat16,
    quantised_with_values,
)

#: the reply dtypes that ask for a difference from the copy, by the names users pass
REPLY_COMPRESSIONS: dict[str, int] = {"int8": INT8_BLOCK, "int4": INT4_BLOCK}
DIFFERENCE_DTYPES = frozenset(REPLY_COMPRESSIONS.values())
#: the dtype of a reply that starts a new copy: θ whole, its values the copy's
WHOLE_DTYPE = BFLOAT16


def copy_values(bits: np.ndarray) -> np.ndarray:
    """A copy's float32 values (exact: bfloat16 is float32's upper half)."""
    return bfloat16_to_float32(bits)


def whole(theta: np.ndarray) -> np.ndarray:
    """The copy (bfloat16 bits) a whole reply of `theta` starts."""
    return float32_to_bfloat16(theta)


def difference(theta: np.ndarray, bits: np.ndarray, dtype: int) -> tuple[bytes, np.ndarray]:
    """The reply's code of θ - copy in `dtype`, and the copy after it: what `advance` makes of the
    code's decoded values on the client, the very same bits."""
    held = copy_values(bits)
    data, step = quantised_with_values(theta - held, dtype)
    return data, _advanced(held, step)


def advance(bits: np.ndarray, step: np.ndarray) -> np.ndarray:
    """The copy after a difference reply whose code decoded to `step` (decode_payload: checked)."""
    return _advanced(copy_values(bits), step)


def _advanced(held: np.ndarray, step: np.ndarray) -> np.ndarray:
    return float32_to_bfloat16(held + step.reshape(held.shape))
