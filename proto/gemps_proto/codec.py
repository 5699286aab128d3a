"""Tensor <-> numpy conversion shared by the server and the SDK (hand-written, not generated).

Tensors travel as raw little-endian bytes. Decoding is zero-copy (`np.frombuffer`), so the
returned array is read-only and aliases the message's bytes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from gemps_proto.v1 import parameter_server_pb2 as pb

_NUMPY_DTYPES: dict[int, np.dtype] = {pb.DTYPE_FLOAT32: np.dtype("<f4")}
_WIRE_DTYPES: dict[np.dtype, int] = {np.dtype("<f4"): pb.DTYPE_FLOAT32}


class TensorDecodeError(ValueError):
    """A tensor's dtype, shape or byte length is malformed."""


def dtype_name(dtype: int) -> str:
    try:
        return pb.DType.Name(dtype)
    except ValueError:
        return f"unknown dtype {dtype}"


def numpy_dtype(dtype: int) -> np.dtype:
    try:
        return _NUMPY_DTYPES[dtype]
    except KeyError:
        supported = ", ".join(dtype_name(d) for d in _NUMPY_DTYPES)
        raise TensorDecodeError(f"unsupported dtype {dtype_name(dtype)}; supported: {supported}") from None


def wire_dtype(dtype: np.dtype) -> int:
    try:
        return _WIRE_DTYPES[np.dtype(dtype).newbyteorder("<")]
    except KeyError:
        raise TensorDecodeError(f"unsupported numpy dtype {dtype}; convert to float32") from None


def num_elements(shape: Sequence[int]) -> int:
    return math.prod(shape)


def tensor_to_array(tensor: pb.Tensor) -> np.ndarray:
    """Decode a Tensor without copying; raises TensorDecodeError when it is malformed."""
    dtype = numpy_dtype(tensor.dtype)
    shape = tuple(tensor.shape)
    if any(d < 0 for d in shape):
        raise TensorDecodeError(f"negative dimension in shape {list(shape)}")
    expected = num_elements(shape) * dtype.itemsize
    if len(tensor.data) != expected:
        raise TensorDecodeError(
            f"{len(tensor.data)} bytes of data but shape {list(shape)} of {dtype_name(tensor.dtype)} needs {expected}"
        )
    return np.frombuffer(tensor.data, dtype=dtype).reshape(shape)


def array_to_tensor(array: np.ndarray) -> pb.Tensor:
    """Encode an array (converted to little-endian float32 when needed) as a Tensor."""
    array = np.asarray(array)
    if array.dtype != np.dtype("<f4"):
        array = array.astype("<f4")
    return pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=array.shape, data=array.tobytes())


def bytes_to_tensor(data: bytes, num_parameters: int) -> pb.Tensor:
    """Wrap already-encoded float32 bytes of a flat vector (avoids a second copy)."""
    return pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[num_parameters], data=data)


def all_finite(array: np.ndarray) -> bool:
    """True when no element is NaN or +-Inf.

    One float64 reduction instead of a boolean temporary: NaN and Inf propagate through the
    sum, and float32 values cannot overflow a float64 accumulator.
    """
    return math.isfinite(float(np.add.reduce(array, axis=None, dtype=np.float64)))
