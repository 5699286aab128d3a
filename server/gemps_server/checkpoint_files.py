"""Checkpoint files: the central variable and what it takes to resume serving it, in safetensors.

One file per checkpoint, `checkpoint-<version, 12 digits>.safetensors`: tensors (the flat central
variable, the model's buffers if it has any (float ones as float32, integer ones as int64,
exactly), plus any global state of the commit rule such as
the `momentum` rule's velocity) and string metadata (format, version, commit count, parameter
and buffer specs, training config, the commit
ledger's receipts for deduplicating retries, a CRC-32 of the tensor bytes). safetensors has no
code paths that execute data: no pickle anywhere. Per-worker GEM state (m_i, s_i) is not saved:
after a restart workers register again and start with fresh state, as a new worker would.

Writes are atomic: a temporary file in the same directory, fsync, rename over the final name,
fsync of the directory. A crash at any point leaves either the old set of checkpoints or the old
set plus the complete new one, never a torn file under a checkpoint's name. Loading checks the
format, the spec against the data, the CRC and finiteness; a file that fails is renamed to
`*.corrupt` and the next older one is used. One of a newer format_version is not damaged: it
stops the start, kept as it is (NewerCheckpointFormat). Older formats are read as they are.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import tempfile
import time
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import safetensors
import safetensors.numpy

from gemps_proto.schema import Buffers, ParameterSpec, buffer_counts, integral, unflatten
from gemps_proto.tensor_codec import FLOAT32
from gemps_server.domain.ledger import (
    KEY_SEPARATOR,
    LEGACY_SCOPE,
    MAX_REQUEST_ID_LENGTH,
    Receipt,
    receipt_key,
    valid_client_id,
)
from gemps_server.domain.records import PartitionOf, StateImage
from gemps_server.image_layout import (
    BUFFERS_KEY,
    INTEGER_BUFFERS_KEY,
    RULE_STATE_PREFIX,
    SPEC_DTYPES,
    state_metadata,
    state_tensors,
)
from gemps_server.native import all_finite

FORMAT = "gemps-checkpoint"
FORMAT_VERSION = "1"
THETA_KEY = "central_variable"
SUFFIX = ".safetensors"
# Versions and counts are int64 on the wire (base_version) and uint64 in replies: a checkpoint
# claiming more is not one this server wrote.
MAX_COUNT = 2**63 - 1
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


def crc32_of(tensors: Mapping[str, np.ndarray]) -> str:
    crc = 0
    for key in sorted(tensors):
        crc = zlib.crc32(np.ascontiguousarray(tensors[key]).data, crc)
    return f"{crc:08x}"


def _fsync_path(path: Path, directory: bool = False) -> None:
    flags = os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if directory else 0)
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _metadata(checkpoint: Checkpoint, tensors: Mapping[str, np.ndarray]) -> dict[str, str]:
    from gemps_server import __version__

    image = checkpoint.image
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "gemps_version": __version__,
        "version": str(image.version),
        "commits_applied": str(image.commits_applied),
        **state_metadata(image),
        "config": json.dumps(dict(checkpoint.config), sort_keys=True),
        # By (client scope, request id) (ledger.receipt_key); "receipts", by request id alone, is
        # what checkpoints written before scopes hold (read as the legacy scope).
        "client_receipts": json.dumps({key: r.to_list() for key, r in image.receipts.items()}),
        "created": repr(checkpoint.created or time.time()),
        "epoch": str(checkpoint.epoch),
        "crc32": crc32_of(tensors),
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
    tensors = state_tensors(checkpoint.image, THETA_KEY, empty_buffers=False)
    metadata = _metadata(checkpoint, tensors)
    # The loader's own checks (finiteness, counts, specs, receipts) before anything is written:
    # a file it would quarantine at the next start must not replace a good one (CheckpointError).
    _from_parts(metadata, tensors, check_crc=False)  # the CRC was computed from these tensors just now
    path = checkpoint_path(directory, checkpoint.version)
    size = write_atomically(path, lambda tmp: safetensors.numpy.save_file(tensors, str(tmp), metadata=metadata))
    return path, size


def strict_json(raw: str) -> Any:
    """Strict JSON (no NaN or Infinity); a crafted file raises CheckpointError, never anything
    that would stop the start instead of falling back to the older file."""

    def refuse(constant: str) -> None:
        raise CheckpointError(f"{constant} in metadata")

    try:
        return json.loads(raw, parse_constant=refuse)
    except RecursionError:
        raise CheckpointError("metadata JSON nested too deeply") from None


def _count(metadata: Mapping[str, str], key: str) -> int:
    value = int(metadata[key])
    if not 0 <= value <= MAX_COUNT:
        raise CheckpointError(f"{key} {value} outside 0..{MAX_COUNT}")
    return value


def parse_spec(
    raw: str, seen: set[str] | None = None, *, allow_empty: bool = False, integers: bool = False
) -> tuple[ParameterSpec, ...]:
    """Entries with unique names (also against `seen`, which collects them); `integers`: int64
    entries allowed (a buffer spec)."""
    entries = strict_json(raw)
    if not isinstance(entries, list) or not (entries or allow_empty):
        raise CheckpointError("spec must be a non-empty list")
    spec, seen = [], set() if seen is None else seen
    for entry in entries:
        if not isinstance(entry, dict):
            raise CheckpointError(f"bad spec entry {entry!r}")
        name, shape, dtype = entry.get("name"), entry.get("shape"), entry.get("dtype", "float32")
        if not isinstance(name, str) or not name or name in seen:
            raise CheckpointError(f"bad or repeated parameter name in spec: {name!r}")
        if not isinstance(shape, list) or not all(type(d) is int and 0 <= d <= MAX_COUNT for d in shape):
            raise CheckpointError(f"bad shape for {name!r}: {shape!r}")
        if dtype != "float32" and (not integers or dtype not in SPEC_DTYPES):
            raise CheckpointError(f"bad dtype for {name!r}: {dtype!r}")
        seen.add(name)
        spec.append(ParameterSpec(name, tuple(shape), SPEC_DTYPES.get(dtype, FLOAT32)))
    return tuple(spec)


def _parse_receipts(raw: str, scoped: bool = True) -> dict[str, Receipt]:
    """Receipts by ledger.receipt_key; `scoped` False: by request id alone (older checkpoints)."""
    entries = strict_json(raw)
    if not isinstance(entries, dict):
        raise CheckpointError("receipts must be an object")
    receipts = {}
    for key, values in entries.items():
        scope, separator, request_id = key.partition(KEY_SEPARATOR) if scoped else (LEGACY_SCOPE, "", key)
        if scoped and not separator:
            raise CheckpointError(f"receipt {key[:40]!r} names no client")
        if not request_id or len(request_id) > MAX_REQUEST_ID_LENGTH or not isinstance(values, list):
            raise CheckpointError(f"bad receipt for request {key[:40]!r}")
        if not valid_client_id(scope):
            raise CheckpointError(f"bad client of receipt {key[:40]!r}")
        if any(type(value) not in (int, float) for value in values):
            raise CheckpointError(f"receipt for request {request_id[:40]!r} is not numbers")
        receipt = Receipt.from_list(values)
        if receipt.version > MAX_COUNT or receipt.staleness > MAX_COUNT:
            raise CheckpointError(f"receipt for request {request_id[:40]!r} has an impossible version")
        receipts[receipt_key(scope, request_id)] = receipt
    return receipts


def load(path: Path) -> Checkpoint:
    """Read and verify one checkpoint file; raises CheckpointError when anything is off."""
    try:
        with safetensors.safe_open(str(path), framework="numpy") as f:
            metadata = f.metadata() or {}
            tensors = {key: np.array(f.get_tensor(key)) for key in f.keys()}  # noqa: SIM118 (not a dict)
    except (OSError, safetensors.SafetensorError) as error:
        raise CheckpointError(f"{path}: not a readable safetensors file: {error}") from None
    try:
        checkpoint = _from_parts(metadata, tensors)
    except NewerCheckpointFormat as error:
        raise NewerCheckpointFormat(f"{path}: {error}") from None
    except CheckpointError as error:
        raise CheckpointError(f"{path}: {error}") from None
    except (ValueError, TypeError, KeyError, AttributeError, OverflowError) as error:  # malformed values
        raise CheckpointError(f"{path}: malformed metadata: {error!r}") from None
    named = NAME_PATTERN.match(path.name)
    if named is not None and int(named.group(1)) != checkpoint.version:
        # Otherwise a renamed old file would sort as the newest and be restored over newer state.
        raise CheckpointError(f"{path}: its name says version {int(named.group(1))}, its metadata {checkpoint.version}")
    return checkpoint


def _from_parts(metadata: dict[str, str], tensors: dict[str, np.ndarray], check_crc: bool = True) -> Checkpoint:
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
    if check_crc and metadata.get("crc32") != crc32_of(tensors):
        raise CheckpointError("tensor data does not match its CRC-32: the file is damaged")
    if int(metadata["version"]) < 0 or int(metadata["commits_applied"]) < 0:
        raise CheckpointError(f"negative version {metadata['version']} or commit count {metadata['commits_applied']}")
    version, commits = _count(metadata, "version"), _count(metadata, "commits_applied")
    names: set[str] = set()
    spec = parse_spec(metadata["spec"], names)
    buffer_spec = parse_spec(metadata.get("buffer_spec", "[]"), names, allow_empty=True, integers=True)
    partition = parse_partition(metadata.get("partition", '{"index": 0, "count": 1}'), spec)
    start, stop = partition.bounds(sum(entry.size for entry in spec))
    theta = _flat_tensor(tensors, THETA_KEY, stop - start)
    float_count, integer_count = buffer_counts(buffer_spec)
    buffers = Buffers(
        _flat_tensor(tensors, BUFFERS_KEY, float_count) if float_count else np.empty(0, np.float32),
        _flat_tensor(tensors, INTEGER_BUFFERS_KEY, integer_count, np.int64) if integer_count else np.empty(0, np.int64),
    )
    rule_state = {}
    for key, value in tensors.items():
        if key in (THETA_KEY, BUFFERS_KEY, INTEGER_BUFFERS_KEY):
            continue
        if not key.startswith(RULE_STATE_PREFIX) or value.dtype != np.float32:
            raise CheckpointError(f"unexpected tensor {key!r}")
        rule_state[key[len(RULE_STATE_PREFIX) :]] = value
    for key, value in (("theta", theta), ("buffers", buffers.floats), *rule_state.items()):
        if value.size and not all_finite(value):  # one pass, no array of booleans
            raise CheckpointError(f"{key} contains NaN or Inf")
    config = strict_json(metadata.get("config", "{}"))
    if not isinstance(config, dict):
        raise CheckpointError("config must be an object")
    image = StateImage(
        version=version,
        commits_applied=commits,
        spec=spec,
        theta=theta,
        rule=str(config.get("rule", "")),
        rule_state=rule_state,
        receipts=(
            _parse_receipts(metadata["client_receipts"])
            if "client_receipts" in metadata
            else _parse_receipts(metadata.get("receipts", "{}"), scoped=False)
        ),
        buffer_spec=buffer_spec,
        buffers=buffers,
        partition=partition,
    )
    epoch = _count(metadata, "epoch") if "epoch" in metadata else 0
    return Checkpoint(image, config=config, created=float(metadata.get("created", "0")), epoch=epoch)


def _flat_tensor(
    tensors: Mapping[str, np.ndarray], key: str, expected: int, dtype: type[np.generic] = np.float32
) -> np.ndarray:
    value = tensors.get(key)
    if value is None or value.dtype != dtype or value.ndim != 1:
        raise CheckpointError(f"missing or malformed {key!r} tensor")
    if value.size != expected:
        raise CheckpointError(f"{key} has {value.size} values but the spec describes {expected}")
    return value


def parse_partition(raw: str, spec: tuple[ParameterSpec, ...] | None) -> PartitionOf:
    """The partition of θ a checkpoint holds (files from before partitions hold all of it);
    `spec` None: no model to check the count against."""
    value = strict_json(raw)
    if not isinstance(value, dict) or set(value) != {"index", "count"}:
        raise CheckpointError(f"partition must be an object with index and count, not {raw[:100]!r}")
    index, count = value["index"], value["count"]
    if not all(type(n) is int for n in (index, count)) or not 0 <= index < count:
        raise CheckpointError(f"partition index {index!r} of {count!r} is not a partition")
    if spec is not None and count > sum(entry.size for entry in spec):
        raise CheckpointError(f"{count} partitions of a model with fewer values")
    return PartitionOf(index, count)


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
