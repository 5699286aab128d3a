"""A ReplicaImage as bytes, for a primary to seed a backup over a socket, and its digest.

The bytes are one safetensors buffer, as checkpoints are (checkpoint_files.py), and so is no
pickle: tensors for every array (θ, buffers, the rule's global and per-worker state, the noise
estimate's window and numbers, the receipts' counts as int64 and statistics as float64, exactly:
NaN energies included) and JSON metadata for the rest (workers, the ledger's scopes in order, a
CRC-32 of the tensors). The central state (θ, buffers, the rule's global state, specs and
partition) is laid out as checkpoints lay it out (image_layout.py). `decode` trusts nothing:
anything malformed, damaged or inconsistent is a ValueError naming it. What fits this server is
images.adopt's to check.

`digest` is a SHA-256 of what primary and backup must hold alike: not the history's name, not
the noise estimate (a refused commit restarts the primary's window and is not forwarded), and
not the rule's bound on max |θ| (momentum's follows its bound on the velocity, which is not
carried: it decides only whether a pass runs in place, whose values are the same either way).
The encoding's bytes are not canonical (safetensors orders the header's metadata as it likes):
compare digests.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import struct
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import safetensors
import safetensors.numpy

from gemps_proto.schema import Buffers, buffer_counts
from gemps_proto.status import GradientNoise
from gemps_server.checkpoint_files import (
    MAX_COUNT,
    CheckpointError,
    crc32_of,
    parse_partition,
    parse_spec,
    strict_json,
)
from gemps_server.domain.ledger import MAX_REQUEST_ID_LENGTH, LedgerImage, Receipt, valid_client_id
from gemps_server.domain.noise import NoiseImage
from gemps_server.domain.records import StateImage
from gemps_server.domain.replica_image import ReplicaImage
from gemps_server.domain.rules import ApplyStats
from gemps_server.domain.workers import RegisteredWorker, RegistryImage
from gemps_server.image_layout import (
    BUFFERS_KEY,
    INTEGER_BUFFERS_KEY,
    RULE_STATE_PREFIX,
    partition_json,
    state_metadata,
    state_tensors,
)
from gemps_server.native import all_finite

FORMAT = "gemps-replica-image"
FORMAT_VERSION = "1"
THETA = "theta"
WORKER_PREFIX = "worker."  # worker.<its index in registration order>.<name>
RECEIPT_COUNTS, RECEIPT_STATS = "receipts.counts", "receipts.stats"  # the ledger's last, then legacy
NOISE_TOTAL, NOISE_NUMBERS = "noise.total", "noise.numbers"
STAT_FIELDS = tuple(f.name for f in dataclasses.fields(ApplyStats))
NOISE_COUNT_FIELDS = ("stride", "size", "count", "pending", "windows", "window", "assumed", "batch_size_assumed")
# An image from before the last two (issue 43): no commit taken as lacking num_samples.
NOISE_COUNT_FIELDS_BEFORE = len(NOISE_COUNT_FIELDS) - 2
MAX_HISTORY_LENGTH = 128
Blob = bytes | bytearray | memoryview


def encode(image: ReplicaImage) -> bytes:
    """`image` as one safetensors buffer."""
    return b"".join(encode_parts(image))


def encode_parts(image: ReplicaImage) -> list[memoryview]:
    """`image`'s safetensors bytes as parts to send one after another: the header, then each
    tensor's memory as it is (no copy): a seed streams from the image to the socket instead of
    being encoded into a second image's worth of bytes first."""
    tensors, metadata = _parts(image)
    metadata["crc32"] = crc32_of(tensors)
    entries: dict[str, Any] = {"__metadata__": metadata}
    parts: list[memoryview] = []
    offset = 0
    for key, array in tensors.items():
        view = np.ascontiguousarray(array).reshape(-1).view(np.uint8).data
        offsets = [offset, offset + view.nbytes]
        entries[key] = {"dtype": _DTYPES[array.dtype], "shape": list(array.shape), "data_offsets": offsets}
        if view.nbytes:  # an empty tensor has its offsets, and no bytes to send
            parts.append(view)
        offset += view.nbytes
    header = json.dumps(entries, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)  # safetensors pads its header so the tensors start aligned
    return [memoryview(struct.pack("<Q", len(header)) + header), *parts]


#: safetensors' names of the dtypes an image may hold
_DTYPES = {
    np.dtype(dtype): name
    for dtype, name in [(np.float64, "F64"), (np.float32, "F32"), (np.float16, "F16"), (np.int64, "I64"),
                        (np.uint64, "U64"), (np.int32, "I32"), (np.uint32, "U32"), (np.int16, "I16"),
                        (np.uint16, "U16"), (np.int8, "I8"), (np.uint8, "U8"), (np.bool_, "BOOL")]
}  # fmt: skip


def digest(image: ReplicaImage) -> str:
    """SHA-256 (hex) of θ, the buffers, the rule's global and per-worker state, the workers, the
    ledger, version and counts: equal on replicas that hold the same state."""
    tensors, metadata = _parts(image)
    sha = hashlib.sha256()
    for key in sorted(set(tensors) - {NOISE_TOTAL, NOISE_NUMBERS}):
        array = np.ascontiguousarray(tensors[key])
        sha.update(json.dumps([key, array.dtype.str, list(array.shape)]).encode())
        sha.update(array.data)
    state = strict_json(metadata.pop("state", "{}"))
    state.pop("theta_bound", None)
    for key, text in sorted({**metadata, "state": _dumps(state)}.items()):
        if key not in ("history", "noise"):
            sha.update(json.dumps([key, text]).encode())
    return sha.hexdigest()


def decode(data: Blob | Sequence[Blob]) -> ReplicaImage:
    """The image `encode` wrote (or `encode_parts`, as the blobs of a frame); ValueError naming the
    problem when `data` is not one."""
    raw = bytes(data) if isinstance(data, bytes | bytearray | memoryview) else b"".join(data)
    try:
        tensors = dict(safetensors.numpy.load(raw))
        (length,) = struct.unpack_from("<Q", raw)
        metadata = json.loads(raw[8 : 8 + length]).get("__metadata__") or {}
        if not isinstance(metadata, dict) or not all(isinstance(value, str) for value in metadata.values()):
            raise ValueError("its metadata is not text by name")
    except (safetensors.SafetensorError, struct.error, ValueError, AttributeError) as error:
        raise ValueError(f"not a replica image (damaged or truncated?): {error}") from None
    try:
        return _image(metadata, tensors)
    except (CheckpointError, ValueError) as error:
        raise ValueError(f"bad replica image: {error}") from None
    except (TypeError, KeyError, AttributeError, OverflowError, IndexError) as error:
        raise ValueError(f"malformed replica image: {error!r}") from None


# -- encoding ---------------------------------------------------------------------------------


def _parts(image: ReplicaImage) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    metadata = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "history": image.history,
        "partition": partition_json(image.partition),
    }
    state = image.state
    if state is None:
        return {}, metadata
    tensors = state_tensors(state, THETA, empty_buffers=True)
    for index, worker in enumerate(image.workers.workers):
        for name, value in image.worker_rule_state.get(worker.worker_id, {}).items():
            tensors[f"{WORKER_PREFIX}{index}.{name}"] = np.ascontiguousarray(value)
    ledger = image.ledger
    receipts = [receipt for _, _, receipt in ledger.last] + [receipt for _, receipt in ledger.legacy]
    counts = [[r.version, r.staleness, r.sequence] for r in receipts]
    tensors[RECEIPT_COUNTS] = np.array(counts, dtype=np.int64).reshape(-1, 3)
    stats = [[getattr(r.stats, name) for name in STAT_FIELDS] for r in receipts]
    tensors[RECEIPT_STATS] = np.array(stats, dtype=np.float64).reshape(-1, len(STAT_FIELDS))
    workers, noise = image.workers, image.noise
    if noise is not None:
        tensors[NOISE_TOTAL] = np.ascontiguousarray(noise.total)
        estimate = noise.estimate
        numbers = [noise.scale, noise.small, noise.inverse_batch, *noise.gradient_square, *noise.noise_trace]
        numbers += [estimate.gradient_square, estimate.noise_trace, estimate.batch_size]
        tensors[NOISE_NUMBERS] = np.array(numbers, dtype=np.float64)
    metadata |= {
        "state": _dumps({
            "version": state.version,
            "commits_applied": state.commits_applied,
            "rule": state.rule,
            "theta_bound": image.theta_bound,
        }),
        **state_metadata(state),
        "workers": _dumps({
            "registered": [[w.worker_id, w.name, w.slot, w.commits, w.client_id] for w in workers.workers],
            "free_slots": list(workers.free_slots),
            "next_slot": workers.next_slot,
        }),
        "ledger": _dumps({
            "last": [[scope, request_id] for scope, request_id, _ in ledger.last],
            "departed": list(ledger.departed),
            "legacy": [request_id for request_id, _ in ledger.legacy],
        }),
        "noise": _dumps(None if noise is None else [
            noise.stride, noise.size, noise.count, noise.pending, noise.estimate.windows, noise.estimate.window,
            noise.assumed, noise.estimate.batch_size_assumed,
        ]),
    }  # fmt: skip
    return tensors, metadata


def _dumps(value: Any) -> str:
    return json.dumps(value, allow_nan=False, separators=(",", ":"))


# -- decoding ---------------------------------------------------------------------------------


def _image(metadata: Mapping[str, Any], tensors: dict[str, np.ndarray]) -> ReplicaImage:
    if metadata.get("format") != FORMAT:
        raise ValueError(f"format {metadata.get('format')!r}, not {FORMAT}")
    if metadata.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"unsupported format version {metadata.get('format_version')!r}")
    if metadata.get("crc32") != crc32_of(tensors):
        raise ValueError("the tensors do not match their CRC-32: damaged")
    history = metadata["history"]
    if not isinstance(history, str) or not 0 < len(history) <= MAX_HISTORY_LENGTH:
        raise ValueError("bad history name")
    if "state" not in metadata:
        if tensors:
            raise ValueError("an image of a server not initialised holds tensors")
        return ReplicaImage(history, parse_partition(metadata["partition"], None))
    state = _object(metadata["state"], {"version", "commits_applied", "rule", "theta_bound"})
    names: set[str] = set()
    spec = parse_spec(metadata["spec"], names)
    buffer_spec = parse_spec(metadata["buffer_spec"], names, allow_empty=True, integers=True)
    partition = parse_partition(metadata["partition"], spec)
    start, stop = partition.bounds(sum(entry.size for entry in spec))
    float_count, integer_count = buffer_counts(buffer_spec)
    theta = _take(tensors, THETA, np.float32, (stop - start,))
    buffers = Buffers(
        _take(tensors, BUFFERS_KEY, np.float32, (float_count,)),
        _take(tensors, INTEGER_BUFFERS_KEY, np.int64, (integer_count,)),
    )
    workers = _workers(metadata["workers"])
    ledger = _ledger(metadata["ledger"], tensors)
    noise = _noise(metadata["noise"], tensors)
    rule_state = _prefixed(tensors, RULE_STATE_PREFIX)
    per_worker: dict[str, dict[str, np.ndarray]] = {}
    for key, value in _prefixed(tensors, WORKER_PREFIX).items():
        index, dot, name = key.partition(".")
        if not (index.isdigit() and dot and name and int(index) < len(workers.workers)):
            raise ValueError(f"unexpected tensor {WORKER_PREFIX}{key[:40]!r}")
        per_worker.setdefault(workers.workers[int(index)].worker_id, {})[name] = value
    if tensors:
        raise ValueError(f"unexpected tensors {sorted(tensors)[:3]}")
    arrays = [theta, buffers.floats, *rule_state.values(), *(v for s in per_worker.values() for v in s.values())]
    if not all(all_finite(value) for value in arrays if value.size and value.dtype.kind == "f"):
        raise ValueError("θ, the buffers or the rule's state hold NaN or Inf")
    bound = state["theta_bound"]
    if bound is not None and not (type(bound) in (int, float) and 0 <= bound <= float(np.finfo(np.float32).max)):
        raise ValueError(f"bad bound on θ {bound!r}")
    image = StateImage(
        version=_count(state, "version"),
        commits_applied=_count(state, "commits_applied"),
        spec=spec,
        theta=theta,
        rule=_string(state["rule"], "rule"),
        rule_state=rule_state,
        buffer_spec=buffer_spec,
        buffers=buffers,
        partition=partition,
    )
    theta_bound = None if bound is None else float(bound)
    return ReplicaImage(history, partition, image, workers, per_worker, ledger, noise, theta_bound)


def _object(raw: str, keys: set[str]) -> dict[str, Any]:
    value = strict_json(raw)
    if not isinstance(value, dict) or set(value) != keys:
        raise ValueError(f"expected an object of {sorted(keys)}, got {raw[:80]!r}")
    return value


def _count(values: Mapping[str, Any], key: str) -> int:
    value = values[key]
    if type(value) is not int or not 0 <= value <= MAX_COUNT:
        raise ValueError(f"{key} {value!r} is not a count")
    return value


def _string(value: Any, what: str, limit: int = MAX_REQUEST_ID_LENGTH) -> str:
    if not isinstance(value, str) or len(value) > limit:
        raise ValueError(f"bad {what} {str(value)[:40]!r}")
    return value


def _scope(value: Any) -> str:
    """A ledger scope: a client id, or a worker id (of a client that sent none)."""
    if not (isinstance(value, str) and value and valid_client_id(value)):
        raise ValueError(f"bad ledger scope {str(value)[:40]!r}")
    return value


def _take(tensors: dict[str, np.ndarray], key: str, dtype: type[np.generic], shape: tuple[int, ...]) -> np.ndarray:
    value = tensors.pop(key, None)
    if value is None or value.dtype != dtype or value.shape != shape:
        raise ValueError(f"missing or malformed {key!r} (expected {np.dtype(dtype).name} of shape {list(shape)})")
    return value


def _prefixed(tensors: dict[str, np.ndarray], prefix: str) -> dict[str, np.ndarray]:
    """The tensors named `prefix`..., by the rest of their name, taken out of `tensors`."""
    return {key[len(prefix) :]: tensors.pop(key) for key in [k for k in tensors if k.startswith(prefix)]}


def _workers(raw: str) -> RegistryImage:
    value = _object(raw, {"registered", "free_slots", "next_slot"})
    workers = []
    for entry in value["registered"]:
        if not (isinstance(entry, list) and len(entry) == 5):
            raise ValueError(f"bad worker {str(entry)[:80]!r}")
        worker_id, name, slot, commits, client_id = entry
        if not (isinstance(client_id, str) and valid_client_id(client_id)) or type(slot) is not int or slot < 0:
            raise ValueError(f"bad client id or slot of worker {str(worker_id)[:40]!r}")
        counted = _count({"commits": commits}, "commits")
        workers.append(
            RegisteredWorker(_string(worker_id, "worker id"), _string(name, "name"), slot, counted, client_id)
        )
    free = value["free_slots"]
    if not isinstance(free, list) or not all(type(slot) is int for slot in free):
        raise ValueError("bad free slots")
    return RegistryImage(tuple(workers), tuple(free), _count(value, "next_slot"))


def _ledger(raw: str, tensors: dict[str, np.ndarray]) -> LedgerImage:
    value = _object(raw, {"last", "departed", "legacy"})
    last, departed, legacy = value["last"], value["departed"], value["legacy"]
    if not all(isinstance(part, list) for part in (last, departed, legacy)):
        raise ValueError("the ledger's parts must be lists")
    rows = len(last) + len(legacy)
    counts = _take(tensors, RECEIPT_COUNTS, np.int64, (rows, 3))
    stats = _take(tensors, RECEIPT_STATS, np.float64, (rows, len(STAT_FIELDS)))
    if np.any(counts < 0):
        raise ValueError("a receipt with a negative version, staleness or sequence")
    receipts = [
        Receipt(int(version), int(staleness), ApplyStats(*(float(x) for x in row)), int(sequence))
        for (version, staleness, sequence), row in zip(counts, stats, strict=True)
    ]
    scopes = []
    for entry in last:
        if not (isinstance(entry, list) and len(entry) == 2):
            raise ValueError(f"bad ledger entry {str(entry)[:80]!r}")
        scopes.append((_scope(entry[0]), _string(entry[1], "request id")))
    return LedgerImage(
        tuple(
            (scope, request_id, receipt)
            for (scope, request_id), receipt in zip(scopes, receipts[: len(last)], strict=True)
        ),
        tuple(_scope(scope) for scope in departed),
        tuple(zip((_string(r, "request id") for r in legacy), receipts[len(last) :], strict=True)),
    )


def _noise(raw: str, tensors: dict[str, np.ndarray]) -> NoiseImage | None:
    value = strict_json(raw)
    if value is None:
        return None
    if not (isinstance(value, list) and len(value) in (NOISE_COUNT_FIELDS_BEFORE, len(NOISE_COUNT_FIELDS))):
        raise ValueError(f"bad noise estimate {raw[:80]!r}")
    counts = {"assumed": 0, "batch_size_assumed": False} | dict(zip(NOISE_COUNT_FIELDS, value, strict=False))
    stride, size, count, windows, window, assumed = (
        _count(counts, key) for key in ("stride", "size", "count", "windows", "window", "assumed")
    )
    if type(counts["pending"]) is not bool or type(counts["batch_size_assumed"]) is not bool:
        raise ValueError("bad noise pending or batch_size_assumed flag")
    total = tensors.pop(NOISE_TOTAL, None)
    if total is None or total.dtype != np.float32 or total.ndim != 1:
        raise ValueError(f"missing or malformed {NOISE_TOTAL!r}")
    numbers = [float(x) for x in _take(tensors, NOISE_NUMBERS, np.float64, (10,))]
    estimate = GradientNoise(numbers[7], numbers[8], numbers[9], windows, window, counts["batch_size_assumed"])
    return NoiseImage(
        total, stride, numbers[0], size, count, numbers[1], numbers[2], counts["pending"], assumed,
        (numbers[3], numbers[4]), (numbers[5], numbers[6]), estimate,
    )  # fmt: skip
