"""Journal entries (domain/journal.py) as replication frames, and back.

A commit travels as the data plane's COMMIT frame (gemps_server/commit_frame.py: its start and its
payload, as two blobs): the one byte form of a commit beyond gRPC, as the worker sent it, so the
backup runs the very same validation and rule on the very same bytes. `encode` copies each blob
(on the primary's applier, inside the operation): the wire's buffers are reused once it returns;
not a commit's payload that is the commit's own (landed out of its client's shared memory).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gemps_proto.jobs import check_job
from gemps_proto.schema import ParameterSpec
from gemps_proto.tensor_codec import EncodedBuffers, EncodedTensor
from gemps_server import commit_frame
from gemps_server.domain.journal import Committed, Departed, Entry, Joined
from gemps_server.replication import frames
from gemps_server.replication.frames import ENTRY, Blob, Frame


class BadEntry(ValueError):
    """A frame that is not a journal entry this version can apply."""


def encode(entry: Entry, position: int, epoch: int) -> Frame:
    header: dict[str, Any] = {"position": position, "epoch": epoch}
    blobs: list[Blob] = []

    def tensor(value: EncodedTensor | None) -> list[Any] | None:
        if value is None:
            return None
        blobs.append(bytes(value.data))
        return [value.dtype, list(value.shape), len(blobs) - 1]

    def buffers(value: EncodedBuffers | None) -> list[Any] | None:
        return None if value is None else [tensor(value.floats), tensor(value.integers)]

    if isinstance(entry, Committed):
        header["commit"] = "frame"  # its two blobs: a COMMIT frame's start and its payload
        blobs.extend(commit_frame.frame_of(entry.commit))
    elif isinstance(entry, Departed):
        header["departed"] = list(entry.worker_ids)
    else:
        header["joined"] = {
            "worker_id": entry.worker_id,
            "name": entry.name,
            "client_id": entry.client_id,
            "spec": _specs(entry.spec),
            "buffer_spec": _specs(entry.buffer_spec),
            "initial": tensor(entry.initial),
            "initial_buffers": buffers(entry.initial_buffers),
            "displaced": entry.displaced,
            "job": entry.job,
        }
    return Frame(ENTRY, header, blobs)


#: a commit's entry header as Frame.encode writes it (json.dumps, its keys in that order), for
#: `encoded`: written per commit without building and dumping a dict (issue 80)
_COMMIT_HEADER = '{"position":%d,"epoch":%d,"commit":"frame","kind":"entry","blobs":[%d,%d]}'


def encoded(entry: Entry, position: int, epoch: int) -> list[memoryview]:
    """`encode`'s frame as the bytes frames.buffers gives: those a backup is sent."""
    if not isinstance(entry, Committed):
        return frames.buffers(encode(entry, position, epoch))
    start, payload = (memoryview(blob).cast("B") for blob in commit_frame.frame_of(entry.commit))
    header = (_COMMIT_HEADER % (position, epoch, start.nbytes, payload.nbytes)).encode()
    return [memoryview(frames.started(header, start.nbytes + payload.nbytes)), start, payload]


def decode(frame: Frame) -> tuple[Entry, int, int]:
    """The entry a frame holds, its position and its epoch; BadEntry when it holds none."""
    header, blobs = frame.header, frame.blobs
    try:
        position, epoch = int(header["position"]), int(header["epoch"])
        if "commit" in header:
            if header["commit"] != "frame":
                raise BadEntry(f"malformed journal entry: a commit as {header['commit']!r}, not a COMMIT frame")
            return Committed(commit_frame.commit_of(blobs)), position, epoch
        if "departed" in header:
            return Departed(tuple(str(worker_id) for worker_id in header["departed"])), position, epoch
        j = header["joined"]
        joined = Joined(
            worker_id=str(j["worker_id"]),
            name=str(j["name"]),
            client_id=str(j["client_id"]),
            spec=_parse_specs(j["spec"]),
            buffer_spec=_parse_specs(j["buffer_spec"]),
            initial=_tensor(j["initial"], blobs),
            initial_buffers=_buffers(j["initial_buffers"], blobs),
            displaced=str(j["displaced"]),
            job=check_job(str(j["job"])),
        )
        return joined, position, epoch
    except (KeyError, TypeError, ValueError, IndexError) as error:
        if isinstance(error, BadEntry):
            raise
        raise BadEntry(f"malformed journal entry: {type(error).__name__}: {error}") from None


def _specs(spec: Sequence[ParameterSpec]) -> list[list[Any]]:
    return [[entry.name, list(entry.shape), entry.dtype] for entry in spec]


def _parse_specs(raw: list[list[Any]]) -> tuple[ParameterSpec, ...]:
    return tuple(ParameterSpec(str(name), tuple(int(n) for n in shape), int(dtype)) for name, shape, dtype in raw)


def _tensor(raw: list[Any] | None, blobs: Sequence[Blob]) -> EncodedTensor | None:
    if raw is None:
        return None
    dtype, shape, index = raw
    return EncodedTensor(int(dtype), tuple(int(n) for n in shape), blobs[int(index)])


def _buffers(raw: list[Any] | None, blobs: Sequence[Blob]) -> EncodedBuffers | None:
    if raw is None:
        return None
    return EncodedBuffers(_tensor(raw[0], blobs), _tensor(raw[1], blobs))
