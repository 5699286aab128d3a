"""The wire's int8 block codes on the server, compiled where built (csrc/wire_codes.c), the shared
codec's numpy elsewhere (gemps_proto.block_quantisation, reply_differences).

The numpy code is the reference the compiled passes are held to, bit for bit and byte for byte
(tests/unit/test_wire_codes.py), and stays the one place a refusal is worded: a payload the compiled
pass refuses is decoded by the codec again, which raises its error. At 85M parameters the codec's
passes were most of a server's commit with int8 both ways (docs/PERFORMANCE.md, "The wire's int8
codes compiled on the server"): the decode's int8 x float32 multiply through numpy's casting loop, and the
difference reply's dozen passes over chunks of θ.
"""

from __future__ import annotations

import numpy as np

from gemps_proto.block_quantisation import BLOCK, blocks, int8_nbytes
from gemps_proto.reply_differences import difference
from gemps_proto.tensor_codec import INT8_BLOCK, EncodedTensor
from gemps_proto.vectors import Vector
from gemps_server.native import compiled


def decoded_payload(payload: EncodedTensor, out: np.ndarray | None = None) -> tuple[Vector, float | None]:
    """A commit payload's values, as `payload.decode_payload(out)` (TensorDecodeError where they do
    not decode), and their max |value| where it was measured on the way (else None): int8 codes of
    a flat payload are checked, decoded into `out` and measured in one compiled pass, each byte read
    once (a payload its sender can still write cannot pass a check with one byte and be used with
    another)."""
    if (
        compiled is not None
        and out is not None
        and payload.dtype == INT8_BLOCK
        and payload.shape == (out.size,)
        and out.dtype == np.float32
        and out.flags.c_contiguous
        and memoryview(payload.data).nbytes == int8_nbytes(out.size)
    ):
        peak: float = compiled.wire_decode_int8(payload.data, out)
        if peak >= 0.0:  # else refused (-1.0 a scale, -2.0 a code): the codec words why
            return out, peak
    return payload.decode_payload(out), None


def moved_copy_difference(theta: np.ndarray, bits: np.ndarray, dtype: int) -> tuple[bytearray, np.ndarray]:
    """`difference(theta, bits, dtype, in_place=True)`: a difference reply's code of θ - copy, and
    the copy `bits` moved in place. int8 in one compiled pass; a block whose difference is not
    finite (θ and the copy near float32's largest) and every block after it by the codec."""
    values, held = theta.reshape(-1), bits.reshape(-1)
    if compiled is None or dtype != INT8_BLOCK or theta.dtype != np.float32 or not values.flags.c_contiguous:
        return difference(theta, bits, dtype, in_place=True)
    count = values.size
    data = bytearray(int8_nbytes(count))  # the scales, then the codes
    coded = compiled.wire_difference_int8(values, held, data)
    total = blocks(count)
    if coded < total:
        start = coded * BLOCK
        rest, _ = difference(values[start:], held[start:], dtype, in_place=True)
        rest_blocks = total - coded
        data[4 * coded : 4 * total] = rest[: 4 * rest_blocks]
        data[4 * total + start :] = rest[4 * rest_blocks :]
    return data, bits
