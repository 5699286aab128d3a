"""Commit replies that send only what changed (issue 47, item 3): the arithmetic the SDK and the
server share, so the client's copy of θ and the server's record of it stay the same bits.

A client that asks for difference replies (a commit's reply_dtype DTYPE_INT8_BLOCK or
DTYPE_INT4_BLOCK) holds a *copy* of θ whose values are bfloat16 numbers, and the server keeps the
same copy for that worker. A reply is then

    code = Q(θ - copy)                      blockwise int8 or int4 (block_quantisation.py)
    copy <- bfloat16(copy + decode(code))   on both sides, from the same bytes (`advance` on the client)

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

    from gemps_proto.block_quantisation import BlockCodes

from gemps_proto import compiled_codes
from gemps_proto.tensor_codec import (
    BFLOAT16,
    INT4_BLOCK,
    INT8_BLOCK,
    bfloat16_to_float32,
    expected_payload_nbytes,
    float32_to_bfloat16,
    quantised_with_values,
)

#: blocks of codes a difference reply's arithmetic takes at a time (1M values: 4 MiB per float32
#: temporary; an even count of values, as int4's bytes hold two codes)
CHUNK_BLOCKS = 4096

#: the reply dtypes that ask for a difference from the copy, by the names users pass
REPLY_COMPRESSIONS: dict[str, int] = {"int8": INT8_BLOCK, "int4": INT4_BLOCK}
DIFFERENCE_DTYPES = frozenset(REPLY_COMPRESSIONS.values())
#: the dtype of a reply that starts a new copy: θ whole, its values the copy's
WHOLE_DTYPE = BFLOAT16


def copy_values(bits: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """A copy's float32 values (exact: bfloat16 is float32's upper half), in `out` when given."""
    return bfloat16_to_float32(bits, out)


def whole(theta: np.ndarray) -> np.ndarray:
    """The copy (bfloat16 bits) a whole reply of `theta` starts."""
    return float32_to_bfloat16(theta)


def difference(
    theta: np.ndarray, bits: np.ndarray, dtype: int, *, in_place: bool = False
) -> tuple[bytearray, np.ndarray]:
    """The reply's code of θ - copy in `dtype`, and the copy after it: what `advance` makes of the
    code's decoded values on the client, the very same bits. `in_place`: the copy after is `bits`
    itself, moved (the server's own record, which it replaces anyway: no 2 bytes a value more, nor
    their pages faulted in); else a new array and `bits` as it was.

    CHUNK_BLOCKS blocks at a time, so that its float32 temporaries (the copy's values, the difference,
    the quantiser's, the step) are each a chunk's, not θ's: they are not in the memory budget.
    The codes are blockwise (a scale per BLOCK values, each value coded alone) and the rest is
    elementwise, so whole blocks at a time give the same bytes and bits as θ at once."""
    if dtype not in DIFFERENCE_DTYPES:
        raise ValueError(f"a difference reply is in int8 or int4 block codes, not dtype {dtype}")
    compiled, values = compiled_codes.compiled, theta.reshape(-1)
    if compiled is None or dtype != INT8_BLOCK or str(theta.dtype) != "float32" or not values.flags.c_contiguous:
        return _difference(theta, bits, dtype, in_place=in_place)
    from gemps_proto.block_quantisation import BLOCK, blocks, int8_nbytes, splice_int8

    after = bits if in_place else bits.copy()
    held = after.reshape(-1)
    data = bytearray(int8_nbytes(values.size))
    coded = compiled.difference_int8(values, held, data)  # up to a block whose difference is not finite
    if coded < blocks(values.size):
        rest, _ = _difference(values[coded * BLOCK :], held[coded * BLOCK :], dtype, in_place=True)
        splice_int8(data, values.size, coded, rest)
    return data, after


def _difference(theta: np.ndarray, bits: np.ndarray, dtype: int, *, in_place: bool) -> tuple[bytearray, np.ndarray]:
    from gemps_proto.block_quantisation import BLOCK, blocks

    values, held_bits = theta.reshape(-1), bits.reshape(-1)
    count, chunk = values.size, CHUNK_BLOCKS * BLOCK
    scales_end = 4 * blocks(count)
    data = bytearray(expected_payload_nbytes(dtype, (count,)))  # B scales, then the codes (block_quantisation.py)
    after = held_bits if in_place else held_bits.copy()  # each chunk read, then written over (numpy: the caller's)
    for start in range(0, count, chunk):
        stop = min(start + chunk, count)
        held = copy_values(held_bits[start:stop])
        part, step = quantised_with_values(values[start:stop] - held, dtype)
        head, codes_at = 4 * blocks(stop - start), scales_end + (start if dtype == INT8_BLOCK else start // 2)
        data[4 * (start // BLOCK) : 4 * (start // BLOCK) + head] = part[:head]
        data[codes_at : codes_at + len(part) - head] = part[head:]
        after[start:stop] = _advanced(held, step)
    return data, after.reshape(bits.shape)


def advance(bits: np.ndarray, code: BlockCodes, out: np.ndarray) -> np.ndarray:
    """The copy after a difference reply whose code is `code` (checked: tensor_codec's
    checked_block_codes): `bits` moved in place, and the new copy's float32 values written into
    `out` (P float32), which is returned. CHUNK_BLOCKS blocks at a time, the code read as it goes,
    so that no temporary is θ's size: neither the difference's values (a new 400 MB array at 100M
    parameters, its pages faulted in each reply) nor a second pass for the values (elementwise and
    blockwise: the same bits as decoding the code whole, then moving the copy, then reading it)."""
    from gemps_proto.block_quantisation import BLOCK

    held_bits, values = bits.reshape(-1), out.reshape(-1)
    compiled = compiled_codes.compiled
    if compiled is not None and held_bits.flags.c_contiguous and values.flags.c_contiguous:
        compiled.advance(held_bits, code.scales, code.codes, values)  # the arithmetic below, in one pass
        return out
    chunk = CHUNK_BLOCKS * BLOCK
    for start in range(0, held_bits.size, chunk):
        stop = min(start + chunk, held_bits.size)
        held = copy_values(held_bits[start:stop], values[start:stop])  # `out` as the sum's room
        held += code.values(start, stop)  # the same float32 add as the server's (_advanced)
        moved = float32_to_bfloat16(held)
        held_bits[start:stop] = moved
        copy_values(moved, held)
    return out


def _advanced(held: np.ndarray, step: np.ndarray) -> np.ndarray:
    return float32_to_bfloat16(held + step.reshape(held.shape))
