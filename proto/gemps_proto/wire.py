"""Protobuf's wire format, by hand, for the few places where copying θ matters (hand-written).

The format is stable and documented (protobuf.dev/programming-guides/encoding): a message is a
sequence of fields, each a tag (field number << 3 | wire type) and a value; length-delimited
values (bytes, strings, sub-messages) are a varint length and that many bytes. Framing a large
`bytes` field here costs one copy of it, where building a message and serialising it costs
several; reading one gives a memoryview of the received bytes instead of a copy. Everything not
framed exactly as expected is left to protobuf itself (the readers return None).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

VARINT = 0
FIXED64 = 1
LENGTH_DELIMITED = 2
FIXED32 = 5
_MAX_VARINT_BYTES = 10


class WireError(ValueError):
    """Bytes that are not well-formed protobuf (the caller leaves them to protobuf's own parser)."""


def varint(value: int) -> bytes:
    """The varint encoding of a non-negative integer (negative int64 values take 10 bytes)."""
    if value < 0:
        value += 1 << 64
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def tag(field_number: int, wire_type: int) -> bytes:
    return varint(field_number << 3 | wire_type)


def length_prefix(field_number: int, length: int) -> bytes:
    """The tag and length of a length-delimited field; its `length` bytes follow."""
    return tag(field_number, LENGTH_DELIMITED) + varint(length)


def read_varint(data: bytes | memoryview, position: int) -> tuple[int, int]:
    """The varint at `position` and the position after it; WireError if it is truncated or too long."""
    value, shift = 0, 0
    for index in range(position, min(position + _MAX_VARINT_BYTES, len(data))):
        byte = data[index]
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, index + 1
        shift += 7
    raise WireError("truncated or overlong varint")


@dataclass(frozen=True)
class Field:
    """One field of a message: where it starts, where its value starts, where it ends."""

    number: int
    wire_type: int
    start: int
    value_start: int
    end: int


def fields(data: bytes | memoryview) -> Iterator[Field]:
    """The fields of a serialized message, in order; WireError on anything malformed."""
    position, size = 0, len(data)
    while position < size:
        key, value_start = read_varint(data, position)
        number, wire_type = key >> 3, key & 7
        if number == 0:
            raise WireError("field number 0")
        if wire_type == VARINT:
            _, end = read_varint(data, value_start)
        elif wire_type == LENGTH_DELIMITED:
            length, value_start = read_varint(data, value_start)
            end = value_start + length
        elif wire_type == FIXED64:
            end = value_start + 8
        elif wire_type == FIXED32:
            end = value_start + 4
        else:  # groups: not in proto3
            raise WireError(f"wire type {wire_type}")
        if end > size:
            raise WireError("truncated field")
        yield Field(number, wire_type, position, value_start, end)
        position = end


def tensor_field(field_number: int, dtype: int, shape: Sequence[int], data_length: int) -> bytes:
    """Everything of a gemps.v1.Tensor field (dtype = 1, shape = 2 packed, data = 3) but its data
    bytes, which follow it: `tensor_field(...) + data` is the serialized field."""
    inner = b""
    if dtype:
        inner += tag(1, VARINT) + varint(dtype)
    if shape:
        packed = b"".join(varint(d) for d in shape)
        inner += length_prefix(2, len(packed)) + packed
    if data_length:
        inner += length_prefix(3, data_length)
    return length_prefix(field_number, len(inner) + data_length) + inner


@dataclass(frozen=True)
class SplitTensor:
    """A message with one Tensor field taken apart: the message without that field, the Tensor
    without its data, and the data as a view of the received bytes (no copy)."""

    rest: bytes
    tensor: bytes
    data: memoryview


def split_tensor_field(message: bytes, field_number: int) -> SplitTensor | None:
    """`message`'s Tensor field `field_number` taken apart without copying its data; None when the
    message is not framed the plain way (the field twice, its data twice) or not well-formed."""
    view = memoryview(message)
    try:
        found = [f for f in fields(view) if f.number == field_number]
        if len(found) != 1 or found[0].wire_type != LENGTH_DELIMITED:
            return None
        field = found[0]
        tensor = view[field.value_start : field.end]
        data_fields = [f for f in fields(tensor) if f.number == 3]
    except WireError:
        return None
    if len(data_fields) > 1 or (data_fields and data_fields[0].wire_type != LENGTH_DELIMITED):
        return None
    rest = bytes(view[: field.start]) + bytes(view[field.end :])
    if not data_fields:
        return SplitTensor(rest, bytes(tensor), view[0:0])
    data = data_fields[0]
    return SplitTensor(
        rest,
        bytes(tensor[: data.start]) + bytes(tensor[data.end :]),
        tensor[data.value_start : data.end],
    )
