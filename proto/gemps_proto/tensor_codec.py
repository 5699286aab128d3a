"""The tensor codec: numpy arrays <-> a tensor's raw wire bytes, shared by the server and the SDK.

Tensors travel as raw little-endian bytes. Decoding float32 is zero-copy (`np.frombuffer`), so
the returned array is read-only and aliases the message's bytes. bfloat16 is a wire format
only: it is encoded from float32 (round to nearest even) and decoded back to float32. Commit
payloads may also come in blockwise int8 or int4 codes (block_quantisation.py) or as each block's
largest values (block_topk.py): `decode_payload` reads every payload dtype, `decode` only θ's
(float32, bfloat16).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gemps_proto import vectors
from gemps_proto.vectors import Vector

if TYPE_CHECKING or vectors.HAVE_NUMPY:  # the SDK alone carries float32 only (gemps_proto.vectors)
    import numpy as np
if TYPE_CHECKING:
    from gemps_proto.block_quantisation import BlockCodes

# gemps.v1.DType's values, by number: the codec (and the server's domain, which uses it) knows
# nothing of protobuf messages. tests/unit/test_codec_and_registry.py checks them against the .proto.
UNSPECIFIED = 0
#: the central variable's dtype, and the wire's default
FLOAT32 = 1
BFLOAT16 = 2
#: the model's integer buffers, exactly (never θ's wire dtype: decode_int64 alone reads it)
INT64 = 3
#: commit payloads only: blockwise int8 and int4 codes (block_quantisation.py), each block's
#: largest values (block_topk.py)
INT8_BLOCK = 4
INT4_BLOCK = 5
TOPK_BLOCK = 6
DTYPE_NAMES = {
    UNSPECIFIED: "DTYPE_UNSPECIFIED",
    FLOAT32: "DTYPE_FLOAT32",
    BFLOAT16: "DTYPE_BFLOAT16",
    INT64: "DTYPE_INT64",
    INT8_BLOCK: "DTYPE_INT8_BLOCK",
    INT4_BLOCK: "DTYPE_INT4_BLOCK",
    TOPK_BLOCK: "DTYPE_TOPK_BLOCK",
}
_ITEMSIZES = {FLOAT32: 4, BFLOAT16: 2}  # θ's wire dtypes: bytes per value
_INT64_ITEMSIZE = 8
_BLOCK = 65_536  # elements per block of the bfloat16 encoder: its working set stays in cache
#: wire formats by the names users pass (SDK, CLI flags): DTYPE_BFLOAT16 is "bfloat16"
WIRE_DTYPE_NAMES: dict[str, int] = {DTYPE_NAMES[dtype].removeprefix("DTYPE_").lower(): dtype for dtype in _ITEMSIZES}
#: how commits may be compressed, by the names users pass (`Client(compression=)`, `--compression`)
COMPRESSIONS: dict[str, int] = {"int8": INT8_BLOCK, "int4": INT4_BLOCK, "topk": TOPK_BLOCK}
#: every encoding θ-sized tensors travel in, by dtype: the names above (the wire bytes' metric labels)
ENCODING_NAMES: dict[int, str] = {dtype: name for name, dtype in (*WIRE_DTYPE_NAMES.items(), *COMPRESSIONS.items())}


@dataclass(frozen=True)
class _Codes:
    """A payload encoding's functions (block_quantisation's, block_topk's): its byte count for a value
    count, its decoder (bytes, count -> values), its encoder, its encoder that also gives the
    values the bytes decode to, and its encoder that leaves in the values what the codes lose."""

    nbytes: Callable[[int], int]
    decode: Callable[[bytes | bytearray | memoryview, int, np.ndarray | None], Vector]
    encode: Callable[[Vector], bytes]
    with_values: Callable[[np.ndarray], tuple[bytes, np.ndarray]]
    subtracting: Callable[[np.ndarray], bytes]


#: the commit payloads that are codes, decoded to float32 (decode_payload), never θ's wire dtype
CODE_DTYPES = frozenset({INT8_BLOCK, INT4_BLOCK, TOPK_BLOCK})


@functools.cache
def _codes(dtype: int) -> _Codes:
    """The blockwise codes' functions, imported when first used: they compute with numpy."""
    vectors.require(f"{DTYPE_NAMES[dtype]} payloads")
    from gemps_proto import block_quantisation, block_topk

    return {
        INT8_BLOCK: _Codes(
            block_quantisation.int8_nbytes,
            block_quantisation.decode_int8,
            block_quantisation.encode_int8,
            block_quantisation.int8_with_values,
            block_quantisation.int8_subtracting,
        ),
        INT4_BLOCK: _Codes(
            block_quantisation.int4_nbytes,
            block_quantisation.decode_int4,
            block_quantisation.encode_int4,
            block_quantisation.int4_with_values,
            block_quantisation.int4_subtracting,
        ),
        TOPK_BLOCK: _Codes(
            block_topk.topk_nbytes,
            block_topk.decode_topk,
            block_topk.encode_topk,
            block_topk.topk_with_values,
            block_topk.topk_subtracting,
        ),
    }[dtype]


class TensorDecodeError(ValueError):
    """A tensor's dtype, shape or byte length is malformed."""


def dtype_name(dtype: int) -> str:
    return DTYPE_NAMES.get(dtype, f"unknown dtype {dtype}")


def itemsize(dtype: int) -> int:
    """Bytes per value of θ's wire dtypes; TensorDecodeError for another."""
    try:
        return _ITEMSIZES[dtype]
    except KeyError:
        supported = ", ".join(dtype_name(d) for d in _ITEMSIZES)
        raise TensorDecodeError(f"unsupported dtype {dtype_name(dtype)}; supported: {supported}") from None


def num_elements(shape: Sequence[int]) -> int:
    return math.prod(shape)


def decode(dtype: int, shape: tuple[int, ...], data: bytes | bytearray | memoryview) -> Vector:
    """float32 values of raw tensor bytes; float32 data is aliased, not copied."""
    width = itemsize(dtype)
    if any(d < 0 for d in shape):
        raise TensorDecodeError(f"negative dimension in shape {list(shape)}")
    expected = num_elements(shape) * width
    if len(data) != expected:
        raise TensorDecodeError(
            f"{len(data)} bytes of data but shape {list(shape)} of {dtype_name(dtype)} needs {expected}"
        )
    if dtype == BFLOAT16:
        vectors.require("bfloat16 on the wire")
        return bfloat16_to_float32(np.frombuffer(data, dtype="<u2")).reshape(shape)
    return vectors.shaped(vectors.float32s(data), shape)


def decode_payload(
    dtype: int, shape: tuple[int, ...], data: bytes | bytearray | memoryview, out: np.ndarray | None = None
) -> Vector:
    """float32 values of a commit payload in any of its dtypes (θ's, or blockwise codes,
    checked: TensorDecodeError for a scale, code or length no encoder writes). Codes are decoded
    into `out` (float32, a value each) when given: float32 and bfloat16 never are."""
    if dtype not in CODE_DTYPES:
        return decode(dtype, shape, data)
    _check_payload_length(dtype, shape, data)
    codes = _codes(dtype)
    from gemps_proto.block_quantisation import QuantisedPayloadError

    try:
        return vectors.shaped(codes.decode(data, num_elements(shape), out), shape)
    except QuantisedPayloadError as error:
        raise TensorDecodeError(f"{dtype_name(dtype)}: {error}") from None


def checked_block_codes(dtype: int, shape: tuple[int, ...], data: bytes | bytearray | memoryview) -> BlockCodes:
    """The scales and codes of blockwise int8 or int4 bytes, checked as decode_payload checks them
    (TensorDecodeError), not decoded: their values are read a run of blocks at a time (BlockCodes)."""
    vectors.require(f"{dtype_name(dtype)} payloads")
    from gemps_proto.block_quantisation import QuantisedPayloadError, int4_codes, int8_codes

    readers = {INT8_BLOCK: int8_codes, INT4_BLOCK: int4_codes}
    if dtype not in readers:
        raise TensorDecodeError(f"{dtype_name(dtype)} where blockwise int8 or int4 codes were expected")
    _check_payload_length(dtype, shape, data)
    try:
        return readers[dtype](data, num_elements(shape))
    except QuantisedPayloadError as error:
        raise TensorDecodeError(f"{dtype_name(dtype)}: {error}") from None


def _check_payload_length(dtype: int, shape: tuple[int, ...], data: bytes | bytearray | memoryview) -> None:
    expected = expected_payload_nbytes(dtype, shape)
    if len(data) != expected:
        raise TensorDecodeError(
            f"{len(data)} bytes of data but shape {list(shape)} of {dtype_name(dtype)} needs {expected}"
        )


def decode_int64(dtype: int, shape: tuple[int, ...], data: bytes | bytearray | memoryview) -> Vector:
    """int64 values of raw tensor bytes (aliased, not copied); TensorDecodeError unless `dtype` is
    INT64 and the bytes fit the shape."""
    if any(d < 0 for d in shape):
        raise TensorDecodeError(f"negative dimension in shape {list(shape)}")
    expected = expected_int64_nbytes(dtype, shape)
    if len(data) != expected:
        raise TensorDecodeError(f"{len(data)} bytes of data but shape {list(shape)} of DTYPE_INT64 needs {expected}")
    return vectors.shaped(vectors.int64s(data), shape)


@dataclass(frozen=True)
class EncodedTensor:
    """A tensor as it came off the wire: its dtype, shape and raw bytes, decoded on demand."""

    dtype: int
    shape: tuple[int, ...]
    data: bytes | bytearray | memoryview

    def decode(self) -> Vector:
        """float32 values (aliasing `data` for float32); raises TensorDecodeError."""
        return decode(self.dtype, self.shape, self.data)

    def decode_payload(self, out: np.ndarray | None = None) -> Vector:
        """A commit payload's float32 values, whatever its dtype, codes into `out` when given
        (decode_payload); raises TensorDecodeError."""
        return decode_payload(self.dtype, self.shape, self.data, out)

    def decode_int64(self) -> Vector:
        """int64 values (aliasing `data`); raises TensorDecodeError unless it is an int64 tensor."""
        return decode_int64(self.dtype, self.shape, self.data)


@dataclass(frozen=True)
class EncodedBuffers:
    """A model's buffers as they came off the wire, by kind (None: that tensor was not sent): the
    floating ones' float32 tensor and the integer ones' int64 tensor (gemps_proto.schema.Buffers)."""

    floats: EncodedTensor | None
    integers: EncodedTensor | None = None


def expected_nbytes(dtype: int, shape: Sequence[int]) -> int:
    """Bytes a tensor of θ's wire dtypes of this shape has; raises TensorDecodeError for another
    dtype (INT64 too: θ-sized buffers are sized by it)."""
    return num_elements(shape) * itemsize(dtype)


def expected_payload_nbytes(dtype: int, shape: Sequence[int]) -> int:
    """Bytes a commit payload of this dtype and shape has (θ's wire dtypes, or blockwise codes);
    raises TensorDecodeError for another dtype."""
    if len(shape) == 1:  # a commit's: asked twice a commit, for θ's few dtypes and one size
        return _flat_payload_nbytes(dtype, shape[0])
    return _payload_nbytes(dtype, shape)


@functools.lru_cache(maxsize=64)  # keys of two ints: bounded whatever the wire sends
def _flat_payload_nbytes(dtype: int, size: int) -> int:
    return _payload_nbytes(dtype, (size,))


def _payload_nbytes(dtype: int, shape: Sequence[int]) -> int:
    if any(d < 0 for d in shape):
        raise TensorDecodeError(f"negative dimension in shape {list(shape)}")
    if dtype in CODE_DTYPES:
        return _codes(dtype).nbytes(num_elements(shape))
    return expected_nbytes(dtype, shape)


def encode_payload(values: Vector, dtype: int) -> bytes:
    """Raw wire bytes of a commit payload's finite float32 values in `dtype` (θ's or blockwise codes)."""
    if dtype in CODE_DTYPES:
        return _codes(dtype).encode(values)
    return encode(values, dtype)


def quantised_with_values(values: np.ndarray, dtype: int) -> tuple[bytes, np.ndarray]:
    """The bytes of finite float32 values in blockwise codes (`dtype` INT8_BLOCK, INT4_BLOCK or TOPK_BLOCK), and
    the values decode_payload reads from those bytes, shaped as `values`, without reading them again."""
    data, decoded = _codes(dtype).with_values(values)
    return data, decoded.reshape(np.shape(values))


def quantised_subtracting(values: np.ndarray, dtype: int) -> bytes:
    """quantised_with_values' bytes of contiguous float32 `values` (the caller's to change), which
    are left holding what the codes lose: the values less what decode_payload reads, the same bits
    as that difference, without a temporary of their size (a worker's error feedback at 100M)."""
    if not (values.flags.c_contiguous and values.dtype == np.float32):
        raise ValueError("quantised_subtracting changes its values in place: contiguous float32 only")
    return _codes(dtype).subtracting(values)


def expected_int64_nbytes(dtype: int, shape: Sequence[int]) -> int:
    """Bytes an integer-buffer tensor of this shape has; raises TensorDecodeError unless it is INT64."""
    if dtype != INT64:
        raise TensorDecodeError(f"dtype {dtype_name(dtype)} where DTYPE_INT64 was expected")
    return num_elements(shape) * _INT64_ITEMSIZE


#: positive float32 values from these bits on round to bfloat16's inf (its largest is 3.3895e38); a
#: negative one rounds to -inf's bits, 0xFF80, the largest a finite negative value can round to
_OVERFLOWS = 0x7F7F8000
_NEGATIVE_INF = 0xFF80


def float32_to_bfloat16(values: np.ndarray) -> np.ndarray:
    """bfloat16 bits (uint16) of float32 values, rounded to nearest even (values must be finite);
    the finite values beyond bfloat16's largest (3.3895e38) saturate to it rather than round to inf.

    Block by block, so the five integer operations run on cached data and need no P-sized temporaries.
    """
    bits = np.ascontiguousarray(values, dtype="<f4").reshape(-1).view("<u4")
    out = np.empty(bits.size, dtype="<u2")
    scratch = np.empty(min(bits.size, _BLOCK), dtype="<u4")
    for start in range(0, bits.size, _BLOCK):
        block = bits[start : start + _BLOCK]
        rounding = scratch[: block.size]
        # Beyond bfloat16's largest, found by two reductions, no pass that writes: as int32 the
        # positive values' bits order as their magnitudes (the negative ones are below 0).
        saturate = block.view("<i4").max() >= _OVERFLOWS
        np.right_shift(block, 16, out=rounding)
        rounding &= 1
        rounding += 0x7FFF
        rounding += block  # cannot overflow for finite values: the largest is 0x7F7FFFFF + 0x8000
        rounding >>= 16
        if saturate or rounding.max() >= _NEGATIVE_INF:  # ±inf from a finite value: ±largest instead (rare)
            rounding[(rounding & 0x7FFF) == 0x7F80] -= 1
        out[start : start + block.size] = rounding
    return out.reshape(np.shape(values))


def bfloat16_to_float32(bits: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """float32 values of bfloat16 bits (exact: bfloat16 is float32's upper half), written into `out`
    (uint32 or float32, of `bits`' size) when given."""
    words = np.empty(bits.shape, dtype="<u4") if out is None else out.view("<u4").reshape(bits.shape)
    np.left_shift(bits, 16, out=words, dtype="<u4")
    return words.view("<f4")


def encode(values: Vector, dtype: int = FLOAT32) -> bytes:
    """Raw wire bytes of float32 values in `dtype`."""
    if dtype == BFLOAT16:
        vectors.require("bfloat16 on the wire")
        return float32_to_bfloat16(values).tobytes()
    itemsize(dtype)  # raises for an unknown dtype
    return bytes(vectors.little_endian_float32(values))


def wire_view(values: Vector, dtype: int = FLOAT32) -> bytes | memoryview:
    """The wire bytes of float32 values in `dtype`: a view of `values` itself (no copy) when they
    already are little-endian float32 in one piece, else encode()'s copy. The caller keeps
    `values` unchanged while the view is in use."""
    if dtype == FLOAT32:
        return vectors.little_endian_float32(values)
    return encode(values, dtype)


def all_finite(values: Vector) -> bool:
    """True when no element is NaN or +-Inf (np.isfinite: as fast as a float32 sum here, and exact)."""
    return vectors.all_finite(values)
