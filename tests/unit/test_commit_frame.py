"""A commit's one byte form (gemps_server/commit_frame.py): the COMMIT frame a worker sends on the
data plane is, byte for byte, the frame a primary journals for its backups, and both read back
into the same Commit."""

from __future__ import annotations

import dataclasses
import socket

import numpy as np
import pytest

from gemps.grpc_messages import announced_commit
from gemps.transport import CommitCall
from gemps_proto.data_plane_frames import Op, frame_start
from gemps_proto.schema import Buffers, PayloadKind
from gemps_proto.tensor_codec import FLOAT32
from gemps_server.commit_frame import commit_of, frame_of
from gemps_server.domain.journal import Committed
from gemps_server.replication import entries, frames


def sdk_frame(buffers: Buffers | None = None) -> tuple[bytes, bytes]:
    """The COMMIT frame the SDK's data-plane transport writes for one call: its start, its payload."""
    payload = np.linspace(-1.0, 1.0, 50, dtype=np.float32)
    call = CommitCall("worker-1", 7, PayloadKind.UPDATE, payload, 0.25, 32, "req-9", buffers, sequence=4)
    header = announced_commit(call, FLOAT32).SerializeToString()
    data = payload.tobytes()
    return frame_start(Op.COMMIT, header, len(data)), data


@pytest.mark.parametrize("buffers", [None, Buffers(np.ones(3, np.float32), np.arange(2, dtype=np.int64))])
def test_the_data_planes_frame_is_the_journals(buffers: Buffers | None) -> None:
    start, payload = sdk_frame(buffers)
    commit = commit_of([start, payload])
    assert (commit.worker_id, commit.base_version, commit.kind, commit.request_id, commit.sequence) == (
        "worker-1", 7, PayloadKind.UPDATE.value, "req-9", 4,
    )  # fmt: skip
    assert (commit.loss, commit.num_samples, commit.reply_dtype) == (0.25, 32, FLOAT32)
    assert bytes(commit.payload.data) == payload and commit.payload.shape == (50,)
    assert (commit.buffer_delta is None) == (buffers is None)
    assert frame_of(commit) == (start, payload)  # journalled: the very bytes the worker sent


def test_a_journal_entry_carries_the_frame() -> None:
    start, payload = sdk_frame()
    commit = commit_of([start, payload])
    frame = entries.encode(Committed(commit), position=3, epoch=2)
    assert [bytes(blob) for blob in frame.blobs] == [start, payload]
    decoded, position, epoch = entries.decode(frame)
    assert (position, epoch) == (3, 2) and isinstance(decoded, Committed)
    assert decoded.commit == commit_of([start, payload])


def test_what_is_not_a_commit_frame_is_refused_by_name() -> None:
    start, payload = sdk_frame()
    with pytest.raises(ValueError, match="lengths"):
        commit_of([start, payload[:-4]])
    with pytest.raises(ValueError, match="not a COMMIT"):
        commit_of([frame_start(Op.PULL, start[20:], len(payload)), payload])
    with pytest.raises(ValueError, match="not a COMMIT frame"):
        commit_of([b"GMDX" + start[4:], payload])
    with pytest.raises(ValueError, match="not a CommitRequest"):
        commit_of([frame_start(Op.COMMIT, b"\xff\xff\xff", len(payload)), payload])
    with pytest.raises(ValueError, match="its start and its payload"):
        commit_of([start])


@pytest.mark.parametrize("buffers", [None, Buffers(np.ones(3, np.float32), np.arange(2, dtype=np.int64))])
def test_a_commits_entry_is_sent_as_the_generic_encoding_writes_it(buffers: Buffers | None) -> None:
    """entries.encoded writes a commit's header without json per commit (issue 80): the bytes a
    backup is sent are those of the frame's generic encoding, and a commit whose payload the
    journal keeps as it is (landed into its own buffer) is framed as one copied."""
    start, payload = sdk_frame(buffers)
    commit = commit_of([start, payload])
    for entry in (commit, dataclasses.replace(commit, payload_owned=True)):
        sent = b"".join(entries.encoded(Committed(entry), 123456789, 42))
        assert sent == b"".join(
            bytes(view) for view in frames.buffers(entries.encode(Committed(commit), 123456789, 42))
        )
        frame = through_a_socket(sent)
        decoded, position, epoch = entries.decode(frame)
        assert (position, epoch, decoded) == (123456789, 42, Committed(commit))


def through_a_socket(sent: bytes) -> frames.Frame:
    ours, theirs = socket.socketpair()
    with ours, theirs:
        ours.sendall(sent)
        return frames.receive(theirs)
