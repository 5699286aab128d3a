"""One byte form of a server's state at one version, for both places it goes: a checkpoint file
(checkpoint_files.py) and the seed a primary streams to a backup (replication/image_codec.py).

A snapshot is one safetensors buffer, so no pickle anywhere: named arrays and text metadata. The
state every snapshot holds is laid out here, once: θ as `central_variable` (a partition: its
range), the float buffers as float32 and the integer ones as int64 (each only when the model has
some), the rule's global state under `rule.`; as text the version, the commit count, the rule,
the parameter and buffer specs, the partition, and a CRC-32 of the tensors' bytes. What only one
destination holds is in snapshot_sections.py (a checkpoint's receipts; a seed's workers, ledger
and noise estimate), the format's name and version in its front end.

`encode_parts` gives the bytes as the parts they are written or sent as: the header, then each
tensor's memory as it is (no copy, no second image's worth of bytes). Decoding trusts nothing
(the metadata is outside the CRC): anything malformed, damaged or inconsistent is a SnapshotError
naming it; each `take` removes what it read from the tensors, so the front ends can refuse any
left over.
"""

from __future__ import annotations

import json
import struct
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import safetensors
import safetensors.numpy

from gemps_proto.jobs import check_job
from gemps_proto.schema import Buffers, ParameterSpec, buffer_counts
from gemps_proto.tensor_codec import FLOAT32, INT64
from gemps_server.domain.ledger import MAX_REQUEST_ID_LENGTH
from gemps_server.domain.records import PartitionOf, StateImage
from gemps_server.native import all_finite

THETA_KEY = "central_variable"
BUFFERS_KEY = "buffers"
INTEGER_BUFFERS_KEY = "integer_buffers"
RULE_STATE_PREFIX = "rule."
# A spec entry's "dtype" in the metadata, when it is not float32 (files before integer buffers: none).
SPEC_DTYPES = {"int64": INT64}
# Versions and counts are int64 on the wire (base_version) and uint64 in replies: a snapshot
# claiming more is not one a server wrote.
MAX_COUNT = 2**63 - 1
Tensors = dict[str, np.ndarray]
Metadata = dict[str, str]

#: safetensors' names of the dtypes a snapshot may hold
_DTYPES = {
    np.dtype(dtype): name
    for dtype, name in [(np.float64, "F64"), (np.float32, "F32"), (np.float16, "F16"), (np.int64, "I64"),
                        (np.uint64, "U64"), (np.int32, "I32"), (np.uint32, "U32"), (np.int16, "I16"),
                        (np.uint16, "U16"), (np.int8, "I8"), (np.uint8, "U8"), (np.bool_, "BOOL")]
}  # fmt: skip


class SnapshotError(ValueError):
    """A snapshot is unreadable, incomplete or inconsistent: the message names what."""


# -- the bytes ----------------------------------------------------------------------------------


def crc32_of(tensors: Mapping[str, np.ndarray]) -> str:
    crc = 0
    for key in sorted(tensors):
        crc = zlib.crc32(np.ascontiguousarray(tensors[key]).data, crc)
    return f"{crc:08x}"


def encode_parts(tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str]) -> list[memoryview]:
    """The safetensors bytes of `tensors` and `metadata` (with the tensors' CRC-32 added) as parts
    to write or send one after another: the header, then each tensor's memory as it is."""
    entries: dict[str, Any] = {"__metadata__": {**metadata, "crc32": crc32_of(tensors)}}
    parts: list[memoryview] = []
    offset = 0
    for key, array in tensors.items():
        view = np.ascontiguousarray(array).reshape(-1).view(np.uint8).data
        entries[key] = {
            "dtype": _DTYPES[array.dtype],
            "shape": list(array.shape),
            "data_offsets": [offset, offset + view.nbytes],
        }
        if view.nbytes:  # an empty tensor has its offsets, and no bytes to send
            parts.append(view)
        offset += view.nbytes
    header = json.dumps(entries, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)  # safetensors pads its header so the tensors start aligned
    return [memoryview(struct.pack("<Q", len(header)) + header), *parts]


def read_buffer(raw: bytes) -> tuple[Metadata, Tensors]:
    """The metadata and tensors of safetensors bytes (a stream's)."""
    try:
        tensors = dict(safetensors.numpy.load(raw))
        (length,) = struct.unpack_from("<Q", raw)
        metadata = json.loads(raw[8 : 8 + length]).get("__metadata__") or {}
        if not isinstance(metadata, dict) or not all(isinstance(value, str) for value in metadata.values()):
            raise ValueError("its metadata is not text by name")
    except (safetensors.SafetensorError, struct.error, ValueError, AttributeError) as error:
        raise SnapshotError(f"not a readable safetensors buffer: {error}") from None
    return metadata, tensors


def read_file(path: Path) -> tuple[Metadata, Tensors]:
    """The metadata and tensors of a safetensors file (each tensor read into memory of its own)."""
    try:
        with safetensors.safe_open(str(path), framework="numpy") as f:
            metadata = f.metadata() or {}
            tensors = {key: np.array(f.get_tensor(key)) for key in f.keys()}  # noqa: SIM118 (not a dict)
    except (OSError, safetensors.SafetensorError) as error:
        raise SnapshotError(f"not a readable safetensors file: {error}") from None
    return metadata, tensors


def check_crc(metadata: Mapping[str, str], tensors: Mapping[str, np.ndarray]) -> None:
    if metadata.get("crc32") != crc32_of(tensors):
        raise SnapshotError("the tensors' data does not match its CRC-32: damaged")


# -- the state every snapshot holds ------------------------------------------------------------


def state_parts(image: StateImage) -> tuple[Tensors, Metadata]:
    """`image`'s arrays by name, each contiguous in the dtype it is read back as, and its text."""
    tensors: Tensors = {THETA_KEY: np.ascontiguousarray(image.theta, dtype=np.float32)}
    floats, integers = buffer_counts(image.buffer_spec)
    if floats:
        tensors[BUFFERS_KEY] = np.ascontiguousarray(image.buffers.floats, dtype=np.float32)
    if integers:
        tensors[INTEGER_BUFFERS_KEY] = np.ascontiguousarray(image.buffers.integers, dtype=np.int64)
    for key, value in image.rule_state.items():
        tensors[RULE_STATE_PREFIX + key] = np.ascontiguousarray(value, dtype=np.float32)
    metadata = {
        "version": str(image.version),
        "commits_applied": str(image.commits_applied),
        "rule": image.rule,
        "spec": spec_json(image.spec),
        "buffer_spec": spec_json(image.buffer_spec),
        "partition": partition_json(image.partition),
        "job": image.job,
    }
    return tensors, metadata


def take_state(metadata: Mapping[str, str], tensors: Tensors, rule: str | None = None) -> StateImage:
    """The state `state_parts` wrote (its receipts empty), its tensors taken out of `tensors`.
    `rule`: the rule's name when the metadata names none (checkpoints written before it did)."""
    if int(metadata["version"]) < 0 or int(metadata["commits_applied"]) < 0:
        raise SnapshotError(f"negative version {metadata['version']} or commit count {metadata['commits_applied']}")
    version = parse_count(metadata["version"], "version")
    commits = parse_count(metadata["commits_applied"], "commits_applied")
    if "rule" in metadata or rule is None:
        rule = text(metadata["rule"], "rule")
    names: set[str] = set()
    spec = parse_spec(metadata["spec"], names)
    buffer_spec = parse_spec(metadata.get("buffer_spec", "[]"), names, allow_empty=True, integers=True)
    partition = parse_partition(metadata.get("partition", '{"index": 0, "count": 1}'), spec)
    try:
        job = check_job(metadata.get("job", ""))  # "": a snapshot from before jobs
    except ValueError as error:
        raise SnapshotError(str(error)) from None
    start, stop = partition.bounds(sum(entry.size for entry in spec))
    theta = take(tensors, THETA_KEY, np.float32, (stop - start,))
    float_count, integer_count = buffer_counts(buffer_spec)
    buffers = Buffers(
        _buffers(tensors, BUFFERS_KEY, np.float32, float_count),
        _buffers(tensors, INTEGER_BUFFERS_KEY, np.int64, integer_count),
    )
    rule_state = prefixed(tensors, RULE_STATE_PREFIX)
    for name, value in rule_state.items():
        if value.dtype != np.float32:
            raise SnapshotError(f"unexpected tensor {RULE_STATE_PREFIX + name!r}: not float32")
    check_finite({"theta": theta, "buffers": buffers.floats, **rule_state})
    return StateImage(
        version=version,
        commits_applied=commits,
        spec=spec,
        theta=theta,
        rule=rule,
        rule_state=rule_state,
        buffer_spec=buffer_spec,
        buffers=buffers,
        partition=partition,
        job=job,
    )


def _buffers(tensors: Tensors, key: str, dtype: type[np.generic], expected: int) -> np.ndarray:
    """A kind of buffers the model has `expected` values of; none: an empty array (an empty tensor
    for it, which readers always let pass, is taken and dropped)."""
    if expected:
        return take(tensors, key, dtype, (expected,))
    tensors.pop(key, None)
    return np.empty(0, dtype)


# -- reading values ---------------------------------------------------------------------------


def strict_json(raw: str) -> Any:
    """Strict JSON (no NaN or Infinity); a crafted snapshot raises SnapshotError, never anything
    else (a checkpoint's loader then falls back to the older file)."""

    def refuse(constant: str) -> None:
        raise SnapshotError(f"{constant} in metadata")

    try:
        return json.loads(raw, parse_constant=refuse)
    except RecursionError:
        raise SnapshotError("metadata JSON nested too deeply") from None


def dumps(value: Any) -> str:
    return json.dumps(value, allow_nan=False, separators=(",", ":"))


def parse_count(value: Any, what: str) -> int:
    """`value` (an int, or the decimal text of one) in 0..MAX_COUNT."""
    number = int(value) if isinstance(value, str) else value
    if type(number) is not int or not 0 <= number <= MAX_COUNT:
        raise SnapshotError(f"{what} {number!r} outside 0..{MAX_COUNT}")
    return number


def text(value: Any, what: str, limit: int = MAX_REQUEST_ID_LENGTH) -> str:
    if not isinstance(value, str) or len(value) > limit:
        raise SnapshotError(f"bad {what} {str(value)[:40]!r}")
    return value


def take(
    tensors: Tensors, key: str, dtype: type[np.generic], shape: tuple[int, ...], source: str = "the spec"
) -> np.ndarray:
    """Tensor `key`, taken out of `tensors`: of `dtype` and the `shape` that `source` describes."""
    value = tensors.pop(key, None)
    if value is None or value.dtype != dtype or value.ndim != len(shape):
        expected = f"{np.dtype(dtype).name} of shape {list(shape)}"
        raise SnapshotError(f"missing or malformed {key!r} tensor (expected {expected})")
    if value.shape != shape:
        found, described = (value.size, shape[0]) if len(shape) == 1 else (list(value.shape), list(shape))
        raise SnapshotError(f"{key} has {found} values but {source} describes {described}")
    return value


def prefixed(tensors: Tensors, prefix: str) -> Tensors:
    """The tensors named `prefix`..., by the rest of their name, taken out of `tensors`."""
    return {key[len(prefix) :]: tensors.pop(key) for key in [k for k in tensors if k.startswith(prefix)]}


def refuse_others(tensors: Mapping[str, np.ndarray]) -> None:
    """What no `take` took: a snapshot holds nothing its reader does not know."""
    if tensors:
        raise SnapshotError(
            f"unexpected tensor {sorted(tensors)[0]!r}" + (f" and {len(tensors) - 1} more" if len(tensors) > 1 else "")
        )


def check_finite(arrays: Mapping[str, np.ndarray]) -> None:
    for key, value in arrays.items():
        if value.size and value.dtype.kind == "f" and not all_finite(value):  # one pass, no array of booleans
            raise SnapshotError(f"{key} contains NaN or Inf")


def parse_spec(
    raw: str, seen: set[str] | None = None, *, allow_empty: bool = False, integers: bool = False
) -> tuple[ParameterSpec, ...]:
    """Entries with unique names (also against `seen`, which collects them); `integers`: int64
    entries allowed (a buffer spec)."""
    entries = strict_json(raw)
    if not isinstance(entries, list) or not (entries or allow_empty):
        raise SnapshotError("spec must be a non-empty list")
    spec, seen = [], set() if seen is None else seen
    for entry in entries:
        if not isinstance(entry, dict):
            raise SnapshotError(f"bad spec entry {entry!r}")
        name, shape, dtype = entry.get("name"), entry.get("shape"), entry.get("dtype", "float32")
        if not isinstance(name, str) or not name or name in seen:
            raise SnapshotError(f"bad or repeated parameter name in spec: {name!r}")
        if not isinstance(shape, list) or not all(type(d) is int and 0 <= d <= MAX_COUNT for d in shape):
            raise SnapshotError(f"bad shape for {name!r}: {shape!r}")
        if dtype != "float32" and (not integers or dtype not in SPEC_DTYPES):
            raise SnapshotError(f"bad dtype for {name!r}: {dtype!r}")
        seen.add(name)
        spec.append(ParameterSpec(name, tuple(shape), SPEC_DTYPES.get(dtype, FLOAT32)))
    return tuple(spec)


def spec_json(spec: tuple[ParameterSpec, ...]) -> str:
    names = {dtype: name for name, dtype in SPEC_DTYPES.items()}
    return json.dumps([
        {"name": entry.name, "shape": list(entry.shape), **({"dtype": names[entry.dtype]} if entry.integer else {})}
        for entry in spec
    ])  # fmt: skip


def parse_partition(raw: str, spec: tuple[ParameterSpec, ...] | None) -> PartitionOf:
    """The partition of θ a snapshot holds (checkpoints from before partitions hold all of it);
    `spec` None: no model to check the count against."""
    value = strict_json(raw)
    if not isinstance(value, dict) or set(value) != {"index", "count"}:
        raise SnapshotError(f"partition must be an object with index and count, not {raw[:100]!r}")
    index, count_ = value["index"], value["count"]
    if not all(type(n) is int for n in (index, count_)) or not 0 <= index < count_:
        raise SnapshotError(f"partition index {index!r} of {count_!r} is not a partition")
    if spec is not None and count_ > sum(entry.size for entry in spec):
        raise SnapshotError(f"{count_} partitions of a model with fewer values")
    return PartitionOf(index, count_)


def partition_json(partition: PartitionOf) -> str:
    return json.dumps({"index": partition.index, "count": partition.count})
