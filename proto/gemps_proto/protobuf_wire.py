"""Protobuf's wire format, by hand, for the few places where copying θ matters (hand-written).

The format is stable and documented (protobuf.dev/programming-guides/encoding): a message is a
sequence of fields, each a tag (field number << 3 | wire type) and a value; length-delimited
values (bytes, strings, sub-messages) are a varint length and that many bytes. Framing a large
`bytes` field here costs one copy of it, where building a message and serialising it costs
several; reading one gives a memoryview of the received bytes instead of a copy. Everything not
framed exactly as expected is left to protobuf itself (the readers return None).
"""

from __future__ import annotations

from collections.abc import Sequence
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
    if 0 <= value < 0x80:
        return _SMALL_VARINTS[value]
    if value < 0:
        value += 1 << 64
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


_SMALL_VARINTS = [bytes((value,)) for value in range(0x80)]


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


# A field, as fields() gives it: (number, wire type, start, value start, end) in the message.
Field = tuple[int, int, int, int, int]


def fields(data: bytes | memoryview) -> list[Field]:
    """The fields of a serialized message, in order; WireError on anything malformed. (Tuples,
    not objects, and the common one-byte varints inline: this runs twice per commit.)"""
    found: list[Field] = []
    position, size = 0, len(data)
    while position < size:
        key = data[position]
        if key < 0x80:
            value_start = position + 1
        else:
            key, value_start = read_varint(data, position)
        number, wire_type = key >> 3, key & 7
        if number == 0:
            raise WireError("field number 0")
        if wire_type == VARINT:
            _, end = read_varint(data, value_start)
        elif wire_type == LENGTH_DELIMITED:
            if value_start < size and data[value_start] < 0x80:
                length, value_start = data[value_start], value_start + 1
            else:
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
        found.append((number, wire_type, position, value_start, end))
        position = end
    return found


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
        found = [f for f in fields(view) if f[0] == field_number]
        if len(found) != 1 or found[0][1] != LENGTH_DELIMITED:
            return None
        _, _, start, value_start, end = found[0]
        tensor = view[value_start:end]
        data_fields = [f for f in fields(tensor) if f[0] == 3]
    except WireError:
        return None
    if len(data_fields) > 1 or (data_fields and data_fields[0][1] != LENGTH_DELIMITED):
        return None
    rest = bytes(view[:start]) + bytes(view[end:])
    if not data_fields:
        return SplitTensor(rest, bytes(tensor), view[0:0])
    _, _, data_start, data_value_start, data_end = data_fields[0]
    return SplitTensor(
        rest,
        bytes(tensor[:data_start]) + bytes(tensor[data_end:]),
        tensor[data_value_start:data_end],
    )
