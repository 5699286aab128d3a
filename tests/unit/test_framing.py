"""The streaming RPCs' data pieces (gemps_proto.grpc_framing) are exactly what protobuf would write and read."""

from __future__ import annotations

import numpy as np
import pytest

from gemps_proto.grpc_framing import PayloadAssembler, data_frames, frame_data, read_data
from gemps_proto.tensor_codec import bfloat16_to_float32, decode, encode, float32_to_bfloat16
from gemps_proto.v1 import parameter_server_pb2 as pb


@pytest.mark.parametrize("size", [0, 1, 127, 128, 300, 16_384, 1 << 20])
def test_framed_piece_equals_protobuf_and_reads_back(size: int) -> None:
    piece = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    framed = frame_data(piece)
    assert framed == pb.CommitChunk(data=piece).SerializeToString()
    assert pb.CommitResponseChunk.FromString(framed).data == piece
    read = read_data(framed)
    assert read is not None and bytes(read) == piece


def test_headers_and_odd_framings_are_left_to_protobuf() -> None:
    header = pb.CommitChunk(header=pb.CommitRequest(worker_id="w")).SerializeToString()
    assert read_data(header) is None
    truncated = frame_data(b"abcdef")[:-1]
    assert read_data(truncated) is None  # length says 6, 5 bytes follow
    two_fields = frame_data(b"ab") + frame_data(b"cd")  # valid protobuf (last one wins): not our fast path
    assert read_data(two_fields) is None
    assert read_data(b"") is None


def test_data_frames_split_and_reassemble() -> None:
    data = np.arange(1000, dtype=np.float32).tobytes()
    frames = list(data_frames(data, chunk_bytes=999))
    assert len(frames) == 5
    assembler = PayloadAssembler(len(data))
    for frame in frames:
        piece = read_data(frame)
        assert piece is not None
        assembler.add(piece)
    assert bytes(assembler.result()) == data


def test_assembler_refuses_too_much_and_too_little() -> None:
    assembler = PayloadAssembler(8)
    assembler.add(b"1234")
    with pytest.raises(ValueError, match="exceeds the 8 bytes"):
        assembler.add(b"12345")
    with pytest.raises(ValueError, match="4 bytes of data received, the header announced 8"):
        assembler.result()


def test_bfloat16_rounds_to_nearest_even_and_decodes_exactly() -> None:
    values = np.array([1.0, 1.00390625, 1.01171875, -2.5, 3.0e38, 1e-40, 0.0], dtype=np.float32)
    bits = float32_to_bfloat16(values)
    # 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties go to the even mantissa (1.0).
    np.testing.assert_array_equal(bfloat16_to_float32(bits)[:3], np.array([1.0, 1.0, 1.015625], np.float32))
    assert bits.dtype == np.dtype("<u2")
    again = decode(pb.DTYPE_BFLOAT16, (values.size,), encode(values, pb.DTYPE_BFLOAT16))
    np.testing.assert_array_equal(again, bfloat16_to_float32(bits))
    relative = np.abs(again[:5] - values[:5]) / np.abs(values[:5])
    assert relative.max() <= 2**-8
