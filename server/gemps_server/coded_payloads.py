"""A commit's int8 payload on the server: checked, decoded and measured in one compiled pass where
the codec's passes are built (gemps_proto.compiled_codes), the shared codec elsewhere.

The server needs the payload's max |value| for its rules' overflow bounds: the compiled decoder
takes it on the way (a block's max |code| times its scale), where the codec's decode would leave
it to one more pass over the values. A payload the compiled pass refuses is decoded by the codec
again, which words the refusal, so the errors are the codec's, word for word.
"""

from __future__ import annotations

import numpy as np

from gemps_proto import compiled_codes
from gemps_proto.block_quantisation import int8_nbytes
from gemps_proto.tensor_codec import INT8_BLOCK, EncodedTensor
from gemps_proto.vectors import Vector


def decoded_payload(payload: EncodedTensor, out: np.ndarray | None = None) -> tuple[Vector, float | None]:
    """A commit payload's values, as `payload.decode_payload(out)` (TensorDecodeError where they do
    not decode), and their max |value| where it was measured on the way (else None): int8 codes of
    a flat payload are checked, decoded into `out` and measured in one compiled pass, each byte read
    once (a payload its sender can still write cannot pass a check with one byte and be used with
    another)."""
    compiled = compiled_codes.compiled
    if (
        compiled is not None
        and out is not None
        and payload.dtype == INT8_BLOCK
        and payload.shape == (out.size,)
        and out.dtype == np.float32
        and out.flags.c_contiguous
        and memoryview(payload.data).nbytes == int8_nbytes(out.size)
    ):
        peak: float = compiled.decode_int8(payload.data, out)
        if peak >= 0.0:  # else refused (-1.0 a scale, -2.0 a code): the codec words why
            return out, peak
    return payload.decode_payload(out), None
