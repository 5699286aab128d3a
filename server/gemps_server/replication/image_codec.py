"""A ReplicaImage as bytes, for a primary to seed a backup over a socket, and its digest.

The bytes are a snapshot (snapshot_codec.py), the one byte form checkpoints have too: the central
state laid out as a checkpoint lays it out, and besides it what a checkpoint leaves out (the
workers, their rule state, the ledger in its order, the noise estimate: snapshot_sections.py),
the primary's history and the rule's bound on max |θ|. Only processes of one gemps version read
each other's images (FORMAT_VERSION). `decode` trusts nothing: anything malformed, damaged or
inconsistent is a ValueError naming it. What fits this server is images.adopt's to check.

`digest` is a SHA-256 of what primary and backup must hold alike: not the history's name, not
the noise estimate (a refused commit restarts the primary's window and is not forwarded), and
not the rule's bound on max |θ| (momentum's follows its bound on the velocity, which is not
carried: it decides only whether a pass runs in place, whose values are the same either way).
The encoding's bytes are not canonical (the metadata's order may vary): compare digests.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence

import numpy as np

from gemps_server import snapshot_codec
from gemps_server.domain.replica_image import ReplicaImage
from gemps_server.snapshot_codec import (
    Metadata,
    SnapshotError,
    Tensors,
    check_crc,
    check_finite,
    dumps,
    parse_partition,
    partition_json,
    read_buffer,
    refuse_others,
    state_parts,
    strict_json,
    take_state,
)
from gemps_server.snapshot_sections import (
    NOISE_NUMBERS,
    NOISE_TOTAL,
    ledger_parts,
    noise_parts,
    parse_registry,
    registry_metadata,
    take_ledger,
    take_noise,
    take_worker_state,
    worker_state_tensors,
)

FORMAT = "gemps-replica-image"
# 2: the central state as checkpoints lay it out (snapshot_codec.py); 1 had its own.
FORMAT_VERSION = "2"
MAX_HISTORY_LENGTH = 128
# Left out of the digest: what replicas may hold differently (the module's docstring).
NOT_DIGESTED = frozenset({"history", "noise", "theta_bound", NOISE_TOTAL, NOISE_NUMBERS})
Blob = bytes | bytearray | memoryview


def encode(image: ReplicaImage) -> bytes:
    """`image` as one safetensors buffer."""
    return b"".join(encode_parts(image))


def encode_parts(image: ReplicaImage) -> list[memoryview]:
    """`image`'s bytes as parts to send one after another: the header, then each tensor's memory
    as it is (no copy): a seed streams from the image to the socket instead of being encoded into
    a second image's worth of bytes first."""
    return snapshot_codec.encode_parts(*_parts(image))


def digest(image: ReplicaImage) -> str:
    """SHA-256 (hex) of θ, the buffers, the rule's global and per-worker state, the workers, the
    ledger, version and counts: equal on replicas that hold the same state."""
    tensors, metadata = _parts(image)
    sha = hashlib.sha256()
    for key in sorted(set(tensors) - NOT_DIGESTED):
        array = np.ascontiguousarray(tensors[key])
        sha.update(json.dumps([key, array.dtype.str, list(array.shape)]).encode())
        sha.update(array.data)
    for key, value in sorted(metadata.items()):
        if key not in NOT_DIGESTED:
            sha.update(json.dumps([key, value]).encode())
    return sha.hexdigest()


def decode(data: Blob | Sequence[Blob]) -> ReplicaImage:
    """The image `encode` wrote (or `encode_parts`, as the blobs of a frame); ValueError naming the
    problem when `data` is not one."""
    raw = bytes(data) if isinstance(data, bytes | bytearray | memoryview) else b"".join(data)
    try:
        metadata, tensors = read_buffer(raw)
    except SnapshotError as error:
        raise ValueError(f"not a replica image (damaged or truncated?): {error}") from None
    try:
        return _image(metadata, tensors)
    except ValueError as error:  # SnapshotError among them
        raise ValueError(f"bad replica image: {error}") from None
    except (TypeError, KeyError, AttributeError, OverflowError, IndexError) as error:
        raise ValueError(f"malformed replica image: {error!r}") from None


def _parts(image: ReplicaImage) -> tuple[Tensors, Metadata]:
    metadata = {"format": FORMAT, "format_version": FORMAT_VERSION, "history": image.history}
    if image.state is None:
        return {}, {**metadata, "partition": partition_json(image.partition)}
    tensors, central = state_parts(image.state)
    ledger_tensors, ledger = ledger_parts(image.ledger)
    noise_tensors, noise = noise_parts(image.noise)
    tensors |= worker_state_tensors(image.workers, image.worker_rule_state) | ledger_tensors | noise_tensors
    extras = {"theta_bound": dumps(image.theta_bound), **registry_metadata(image.workers), **ledger, **noise}
    return tensors, {**metadata, **central, **extras}


def _image(metadata: Metadata, tensors: Tensors) -> ReplicaImage:
    if metadata.get("format") != FORMAT:
        raise SnapshotError(f"format {metadata.get('format')!r}, not {FORMAT}")
    if metadata.get("format_version") != FORMAT_VERSION:
        raise SnapshotError(f"unsupported format version {metadata.get('format_version')!r}")
    check_crc(metadata, tensors)
    history = metadata["history"]
    if not 0 < len(history) <= MAX_HISTORY_LENGTH:
        raise SnapshotError("bad history name")
    if "version" not in metadata:
        if tensors:
            raise SnapshotError("an image of a server not initialised holds tensors")
        return ReplicaImage(history, parse_partition(metadata["partition"], None))
    state = take_state(metadata, tensors)
    workers = parse_registry(metadata)
    per_worker = take_worker_state(tensors, workers)
    ledger = take_ledger(metadata, tensors)
    noise = take_noise(metadata, tensors)
    refuse_others(tensors)
    check_finite({f"{worker_id}'s {name}": v for worker_id, held in per_worker.items() for name, v in held.items()})
    bound = strict_json(metadata["theta_bound"])
    if bound is not None and not (type(bound) in (int, float) and 0 <= bound <= float(np.finfo(np.float32).max)):
        raise SnapshotError(f"bad bound on θ {bound!r}")
    theta_bound = None if bound is None else float(bound)
    return ReplicaImage(history, state.partition, state, workers, per_worker, ledger, noise, theta_bound)
