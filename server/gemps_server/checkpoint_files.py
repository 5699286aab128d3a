"""Checkpoint files: the central variable and what it takes to resume serving it, as snapshots.

One file per checkpoint, `checkpoint-<version, 12 digits>.safetensors`, in the one byte form a
server's state has (snapshot_codec.py; a backup's seed is the other): tensors (the flat central
variable, the model's buffers if it has any (float ones as float32, integer ones as int64,
exactly), plus any global state of the commit rule such as the `momentum` rule's velocity) and
string metadata (format, version, commit count, rule, parameter and buffer specs, partition,
training config, epoch, the commit ledger's receipts for deduplicating retries, a CRC-32 of the
tensor bytes). safetensors has no code paths that execute data: no pickle anywhere. Per-worker
GEM state (m_i, s_i) is not saved: after a restart workers register again and start with fresh
state, as a new worker would.

Writes are atomic: a temporary file in the same directory, fsync, rename over the final name,
fsync of the directory. A crash at any point leaves either the old set of checkpoints or the old
set plus the complete new one, never a torn file under a checkpoint's name. Loading checks the
format, the spec against the data, the CRC and finiteness; a file that fails is renamed to
`*.corrupt` and the next older one is used. One of a newer format_version is not damaged: it
stops the start, kept as it is (NewerCheckpointFormat). Older formats are read as they are
(without a rule, partition, buffers, receipts' scopes or epoch: each as it was before it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import safetensors.numpy

from gemps_proto.schema import integral, unflatten
from gemps_server.domain.records import StateImage
from gemps_server.snapshot_codec import (
    SnapshotError,
    check_crc,
    encode_parts,
    parse_count,
    read_file,
    refuse_others,
    state_parts,
    strict_json,
    take_state,
)
from gemps_server.snapshot_codec import crc32_of as crc32_of  # the CRC a checkpoint's metadata holds
from gemps_server.snapshot_sections import parse_receipts, receipts_metadata

FORMAT = "gemps-checkpoint"
FORMAT_VERSION = "1"
SUFFIX = ".safetensors"
NAME_PATTERN = re.compile(r"^checkpoint-(\d{12,})\.safetensors$")
TEMPORARY_PREFIX = ".checkpoint-"
TEMPORARY_SUFFIX = ".tmp"
CORRUPT_SUFFIX = ".corrupt"


class CheckpointError(Exception):
    """A checkpoint file is unreadable, incomplete or inconsistent."""


class NewerCheckpointFormat(CheckpointError, ValueError):
    """A checkpoint of a format newer than this gemps reads: written by a newer gemps, and not
    damaged, so never set aside as one. A ValueError: the server cannot start (exit 2)."""


def _newer_format(found: str | None) -> bool:
    return found is not None and found.isdecimal() and int(found) > int(FORMAT_VERSION)


@dataclass(frozen=True)
class Checkpoint:
    """What a server needs to resume (the state's image at one version), and the training
    config it was written under."""

    image: StateImage
    config: Mapping[str, Any] = field(default_factory=dict)  # the training config when written
    created: float = 0.0  # unix time
    # A replicated partition's epoch whose primary acknowledged the commits it holds (0: not
    # replicated, or written before epochs): which of two replicas' checkpoints is newer is told
    # by (epoch, version), never by version alone (an old primary's unacknowledged commits).
    epoch: int = 0

    @property
    def version(self) -> int:
        return self.image.version

    def named(self) -> dict[str, np.ndarray]:
        """The central variable and the buffers by name, each in its own shape (a state dict)."""
        if self.image.partition.count > 1:
            raise CheckpointError(
                f"this checkpoint holds {self.image.partition} of the model: export all partitions together"
            )
        return {**unflatten(self.image.theta, self.image.spec), **self.image.buffers.named(self.image.buffer_spec)}


def assemble_partitions(checkpoints: list[Checkpoint]) -> dict[str, np.ndarray]:
    """The state dict of θ from one checkpoint per partition (any order; buffers: partition 0's).

    Each partition's version is its own: the result holds each range as of its checkpoint."""
    ordered = sorted(checkpoints, key=lambda c: c.image.partition.index)
    count = ordered[0].image.partition.count if ordered else 0
    found = [c.image.partition.index for c in ordered]
    if found != list(range(count)) or any(c.image.partition.count != count for c in ordered):
        raise CheckpointError(f"need one checkpoint of each of {count} partitions, got partitions {found}")
    first = ordered[0].image
    if any(c.image.spec != first.spec for c in ordered):
        raise CheckpointError("the partitions' checkpoints describe different models")
    theta = np.concatenate([c.image.theta for c in ordered])
    return {**unflatten(theta, first.spec), **first.buffers.named(first.buffer_spec)}


def checkpoint_path(directory: Path, version: int) -> Path:
    return directory / f"checkpoint-{version:012d}{SUFFIX}"


def list_checkpoints(directory: Path) -> list[tuple[int, Path]]:
    """(version, path) of every checkpoint file in `directory`, oldest first."""
    if not directory.is_dir():
        return []
    found = []
    for path in directory.iterdir():
        match = NAME_PATTERN.match(path.name)
        if match is not None and path.is_file():
            found.append((int(match.group(1)), path))
    return sorted(found)


def _fsync_path(path: Path, directory: bool = False) -> None:
    flags = os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if directory else 0)
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _metadata(checkpoint: Checkpoint, central: Mapping[str, str]) -> dict[str, str]:
    from gemps_server import __version__

    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "gemps_version": __version__,
        **central,
        "config": json.dumps(dict(checkpoint.config), sort_keys=True),
        **receipts_metadata(checkpoint.image.receipts),
        "created": repr(checkpoint.created or time.time()),
        "epoch": str(checkpoint.epoch),
    }


def write_atomically(path: Path, write: Callable[[Path], None]) -> int:
    """Run `write(temporary path)`, fsync, rename to `path`, fsync the directory; return bytes."""
    directory = path.parent
    directory.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=TEMPORARY_PREFIX, suffix=TEMPORARY_SUFFIX, dir=directory)
    os.close(fd)
    temporary = Path(name)
    try:
        write(temporary)
        _fsync_path(temporary)
        size = temporary.stat().st_size
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            temporary.unlink()
        raise
    _fsync_path(directory, directory=True)
    return size


def save(directory: Path, checkpoint: Checkpoint) -> tuple[Path, int]:
    """Write `checkpoint` atomically; returns its path and size in bytes."""
    tensors, central = state_parts(checkpoint.image)
    metadata = _metadata(checkpoint, central)
    # The loader's own checks (finiteness, counts, specs, receipts) before anything is written:
    # a file it would quarantine at the next start must not replace a good one (CheckpointError).
    try:
        _from_parts(metadata, dict(tensors), check=False)  # the CRC is computed from these tensors
    except SnapshotError as error:
        raise CheckpointError(str(error)) from None
    path = checkpoint_path(directory, checkpoint.version)
    size = write_atomically(path, lambda temporary: _write_parts(temporary, encode_parts(tensors, metadata)))
    return path, size


def _write_parts(path: Path, parts: list[memoryview]) -> None:
    with path.open("wb") as f:
        for part in parts:
            f.write(part)


def load(path: Path) -> Checkpoint:
    """Read and verify one checkpoint file; raises CheckpointError when anything is off."""
    try:
        metadata, tensors = read_file(path)
        checkpoint = _from_parts(metadata, tensors)
    except NewerCheckpointFormat as error:
        raise NewerCheckpointFormat(f"{path}: {error}") from None
    except (CheckpointError, SnapshotError) as error:
        raise CheckpointError(f"{path}: {error}") from None
    except (ValueError, TypeError, KeyError, AttributeError, OverflowError) as error:  # malformed values
        raise CheckpointError(f"{path}: malformed metadata: {error!r}") from None
    named = NAME_PATTERN.match(path.name)
    if named is not None and int(named.group(1)) != checkpoint.version:
        # Otherwise a renamed old file would sort as the newest and be restored over newer state.
        raise CheckpointError(f"{path}: its name says version {int(named.group(1))}, its metadata {checkpoint.version}")
    return checkpoint


def _from_parts(metadata: dict[str, str], tensors: dict[str, np.ndarray], check: bool = True) -> Checkpoint:
    """The checkpoint of a file's metadata and tensors (taken out of `tensors`); `check` False:
    without checking the CRC, not yet written."""
    if metadata.get("format") != FORMAT:
        raise CheckpointError(f"not a gemps checkpoint (format {metadata.get('format')!r})")
    found = metadata.get("format_version")
    if _newer_format(found):
        from gemps_server import __version__

        writer = "".join(c if c.isprintable() else "?" for c in metadata.get("gemps_version", "?")[:64])  # one line
        raise NewerCheckpointFormat(
            f"unsupported checkpoint format version {found} (written by gemps {writer}): "
            f"newer than this server's {FORMAT_VERSION} (gemps {__version__}); start a gemps that reads it, or move "
            "the file out of the directory to start without it"
        )
    if found != FORMAT_VERSION:
        raise CheckpointError(f"unsupported checkpoint format version {metadata.get('format_version')!r}")
    if check:
        check_crc(metadata, tensors)
    config = strict_json(metadata.get("config", "{}"))
    if not isinstance(config, dict):
        raise CheckpointError("config must be an object")
    state = take_state(metadata, tensors, rule=str(config.get("rule", "")))  # the rule: config's, in older files
    refuse_others(tensors)
    image = dataclasses.replace(state, receipts=parse_receipts(metadata))
    epoch = parse_count(metadata["epoch"], "epoch") if "epoch" in metadata else 0
    return Checkpoint(image, config=config, created=float(metadata.get("created", "0")), epoch=epoch)


def load_latest(
    directory: Path, on_corrupt: Callable[[Path, CheckpointError], None] | None = None
) -> tuple[Path, Checkpoint] | None:
    """The newest checkpoint in `directory` that loads; damaged newer ones are renamed `*.corrupt`.
    NewerCheckpointFormat, the file left as it is, when the newest is of a newer format."""
    for _, path in reversed(list_checkpoints(directory)):
        try:
            return path, load(path)
        except NewerCheckpointFormat:  # not damaged: never set aside for an older state
            raise
        except CheckpointError as error:
            if on_corrupt is not None:
                on_corrupt(path, error)
            with contextlib.suppress(OSError):
                path.rename(path.with_name(path.name + CORRUPT_SUFFIX))
    return None


def prune(directory: Path, keep: int) -> list[Path]:
    """Delete all but the newest `keep` checkpoints; returns the deleted paths."""
    removed = []
    for _, path in list_checkpoints(directory)[:-keep] if keep > 0 else []:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
            removed.append(path)
    return removed


def remove_temporaries(directory: Path) -> list[Path]:
    """Delete leftovers of writes that never reached their rename (a crash mid-write)."""
    if not directory.is_dir():
        return []
    removed = []
    for path in directory.iterdir():
        if path.name.startswith(TEMPORARY_PREFIX) and path.name.endswith(TEMPORARY_SUFFIX):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
                removed.append(path)
    return removed


def export_state_dict(
    named: Mapping[str, np.ndarray], version: int, out: Path, metadata: Mapping[str, str] | None = None
) -> int:
    """Write parameters by name as safetensors (atomically); returns bytes. Integer arrays (integer
    buffers) are written as int64, exactly; the others as float32.

    `safetensors.torch.load_file(out)` gives a state dict for `model.load_state_dict(...)`.
    """
    tensors = {  # np.asarray keeps a scalar's shape () (num_batches_tracked); ascontiguousarray makes it [1]
        name: np.asarray(value, dtype=np.int64 if integral(value) else np.float32, order="C")
        for name, value in named.items()
    }
    info = {"format": "gemps-export", "version": str(version), **(metadata or {})}
    return write_atomically(out, lambda tmp: safetensors.numpy.save_file(tensors, str(tmp), metadata=info))
