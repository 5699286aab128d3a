"""What only one of a snapshot's destinations holds (snapshot_codec.py lays out what both do),
each written and parsed here, once.

- A checkpoint's receipts (`client_receipts`): the ledger's receipts by ledger.receipt_key, each
  as seven JSON numbers (version, staleness, the four scaling statistics, sequence). Workers
  register again after a restart, so their scopes all count as departed and their order and the
  energies are not kept. Checkpoints written before scopes hold `receipts`, by request id alone
  (read under the legacy scope), with six numbers each (no sequence).
- A seed's workers (`workers`: each registration, the free slots, the next slot), their rule
  state (tensors `worker.<index in registration order>.<name>`), the ledger in its order
  (`ledger`: the scopes and request ids; tensors `receipts.counts` as int64 and `receipts.stats`
  as float64, exactly: NaN energies included) and the noise estimate (`noise`: its counts; tensors
  `noise.total` and `noise.numbers`).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

import numpy as np

from gemps_proto.status import GradientNoise
from gemps_server.domain.ledger import (
    KEY_SEPARATOR,
    LEGACY_SCOPE,
    MAX_REQUEST_ID_LENGTH,
    LedgerImage,
    Receipt,
    receipt_key,
    valid_client_id,
)
from gemps_server.domain.noise import NoiseImage
from gemps_server.domain.rules import ApplyStats
from gemps_server.domain.workers import RegisteredWorker, RegistryImage
from gemps_server.snapshot_codec import (
    MAX_COUNT,
    Metadata,
    SnapshotError,
    Tensors,
    dumps,
    parse_count,
    prefixed,
    strict_json,
    take,
    text,
)

WORKER_PREFIX = "worker."  # worker.<its index in registration order>.<name>
RECEIPT_COUNTS, RECEIPT_STATS = "receipts.counts", "receipts.stats"  # the ledger's last, then legacy
NOISE_TOTAL, NOISE_NUMBERS = "noise.total", "noise.numbers"
# A receipt's figures as a duplicate's reply repeats them: what a round said (`pending`, `kept_theta`)
# was the original reply's alone, and images from before they were added keep loading.
STAT_FIELDS = tuple(f.name for f in dataclasses.fields(ApplyStats) if f.name not in ("pending", "kept_theta"))
NOISE_COUNT_FIELDS = ("stride", "size", "count", "pending", "windows", "window", "assumed", "batch_size_assumed")
# A seed from before the last two (issue 43): no commit taken as lacking num_samples.
NOISE_COUNT_FIELDS_BEFORE = len(NOISE_COUNT_FIELDS) - 2


# -- a checkpoint's receipts ------------------------------------------------------------------


def receipts_metadata(receipts: Mapping[str, Receipt]) -> Metadata:
    # json.dumps as checkpoints always wrote it: a NaN statistic is refused by the check `save`
    # runs before writing (strict_json), as a CheckpointError.
    return {"client_receipts": json.dumps({key: receipt.to_list() for key, receipt in receipts.items()})}


def parse_receipts(metadata: Mapping[str, str]) -> dict[str, Receipt]:
    """Receipts by ledger.receipt_key (`receipts` of checkpoints before scopes: by request id alone)."""
    scoped = "client_receipts" in metadata
    entries = strict_json(metadata["client_receipts"] if scoped else metadata.get("receipts", "{}"))
    if not isinstance(entries, dict):
        raise SnapshotError("receipts must be an object")
    receipts = {}
    for key, values in entries.items():
        scope, separator, request_id = key.partition(KEY_SEPARATOR) if scoped else (LEGACY_SCOPE, "", key)
        if scoped and not separator:
            raise SnapshotError(f"receipt {key[:40]!r} names no client")
        if not request_id or len(request_id) > MAX_REQUEST_ID_LENGTH or not isinstance(values, list):
            raise SnapshotError(f"bad receipt for request {key[:40]!r}")
        if not valid_client_id(scope):
            raise SnapshotError(f"bad client of receipt {key[:40]!r}")
        if any(type(value) not in (int, float) for value in values):
            raise SnapshotError(f"receipt for request {request_id[:40]!r} is not numbers")
        receipt = Receipt.from_list(values)
        if receipt.version > MAX_COUNT or receipt.staleness > MAX_COUNT:
            raise SnapshotError(f"receipt for request {request_id[:40]!r} has an impossible version")
        receipts[receipt_key(scope, request_id)] = receipt
    return receipts


# -- a seed's workers and their rule state ------------------------------------------------------


def registry_metadata(workers: RegistryImage) -> Metadata:
    return {
        "workers": dumps({
            "registered": [[w.worker_id, w.name, w.slot, w.commits, w.client_id] for w in workers.workers],
            "free_slots": list(workers.free_slots),
            "next_slot": workers.next_slot,
        })
    }  # fmt: skip


def parse_registry(metadata: Mapping[str, str]) -> RegistryImage:
    value = _object(metadata["workers"], {"registered", "free_slots", "next_slot"})
    workers = []
    for entry in value["registered"]:
        if not (isinstance(entry, list) and len(entry) == 5):
            raise SnapshotError(f"bad worker {str(entry)[:80]!r}")
        worker_id, name, slot, commits, client_id = entry
        if not (isinstance(client_id, str) and valid_client_id(client_id)) or type(slot) is not int or slot < 0:
            raise SnapshotError(f"bad client id or slot of worker {str(worker_id)[:40]!r}")
        counted = parse_count(commits, "commits")
        workers.append(RegisteredWorker(text(worker_id, "worker id"), text(name, "name"), slot, counted, client_id))
    free = value["free_slots"]
    if not isinstance(free, list) or not all(type(slot) is int for slot in free):
        raise SnapshotError("bad free slots")
    return RegistryImage(tuple(workers), tuple(free), parse_count(value["next_slot"], "next_slot"))


def worker_state_tensors(workers: RegistryImage, states: Mapping[str, Mapping[str, np.ndarray]]) -> Tensors:
    return {
        f"{WORKER_PREFIX}{index}.{name}": np.ascontiguousarray(value)
        for index, worker in enumerate(workers.workers)
        for name, value in states.get(worker.worker_id, {}).items()
    }


def take_worker_state(tensors: Tensors, workers: RegistryImage) -> dict[str, dict[str, np.ndarray]]:
    """Each worker's rule state by worker id, taken out of `tensors`."""
    states: dict[str, dict[str, np.ndarray]] = {}
    for key, value in prefixed(tensors, WORKER_PREFIX).items():
        index, dot, name = key.partition(".")
        if not (index.isdigit() and dot and name and int(index) < len(workers.workers)):
            raise SnapshotError(f"unexpected tensor {WORKER_PREFIX}{key[:40]!r}")
        states.setdefault(workers.workers[int(index)].worker_id, {})[name] = value
    return states


# -- a seed's ledger --------------------------------------------------------------------------


def ledger_parts(ledger: LedgerImage) -> tuple[Tensors, Metadata]:
    receipts = [receipt for _, _, receipt in ledger.last] + [receipt for _, receipt in ledger.legacy]
    counts = [[r.version, r.staleness, r.sequence] for r in receipts]
    stats = [[getattr(r.stats, name) for name in STAT_FIELDS] for r in receipts]
    tensors = {
        RECEIPT_COUNTS: np.array(counts, dtype=np.int64).reshape(-1, 3),
        RECEIPT_STATS: np.array(stats, dtype=np.float64).reshape(-1, len(STAT_FIELDS)),
    }
    order = {
        "last": [[scope, request_id] for scope, request_id, _ in ledger.last],
        "departed": list(ledger.departed),
        "legacy": [request_id for request_id, _ in ledger.legacy],
    }
    return tensors, {"ledger": dumps(order)}


def take_ledger(metadata: Mapping[str, str], tensors: Tensors) -> LedgerImage:
    value = _object(metadata["ledger"], {"last", "departed", "legacy"})
    last, departed, legacy = value["last"], value["departed"], value["legacy"]
    if not all(isinstance(part, list) for part in (last, departed, legacy)):
        raise SnapshotError("the ledger's parts must be lists")
    rows = len(last) + len(legacy)
    counts = take(tensors, RECEIPT_COUNTS, np.int64, (rows, 3), "the ledger")
    stats = take(tensors, RECEIPT_STATS, np.float64, (rows, len(STAT_FIELDS)), "the ledger")
    if np.any(counts < 0):
        raise SnapshotError("a receipt with a negative version, staleness or sequence")
    receipts = [
        Receipt(int(version), int(staleness), ApplyStats(*row.tolist()), int(sequence))
        for (version, staleness, sequence), row in zip(counts, stats, strict=True)
    ]
    scopes = []
    for entry in last:
        if not (isinstance(entry, list) and len(entry) == 2):
            raise SnapshotError(f"bad ledger entry {str(entry)[:80]!r}")
        scopes.append((_scope(entry[0]), text(entry[1], "request id")))
    return LedgerImage(
        tuple(
            (scope, request_id, receipt)
            for (scope, request_id), receipt in zip(scopes, receipts[: len(last)], strict=True)
        ),
        tuple(_scope(scope) for scope in departed),
        tuple(zip((text(r, "request id") for r in legacy), receipts[len(last) :], strict=True)),
    )


def _scope(value: Any) -> str:
    """A ledger scope: a client id, or a worker id (of a client that sent none)."""
    if not (isinstance(value, str) and value and valid_client_id(value)):
        raise SnapshotError(f"bad ledger scope {str(value)[:40]!r}")
    return value


# -- a seed's noise estimate ------------------------------------------------------------------


def noise_parts(noise: NoiseImage | None) -> tuple[Tensors, Metadata]:
    if noise is None:
        return {}, {"noise": dumps(None)}
    estimate = noise.estimate
    numbers = [noise.scale, noise.small, noise.inverse_batch, *noise.gradient_square, *noise.noise_trace]
    numbers += [estimate.gradient_square, estimate.noise_trace, estimate.batch_size]
    tensors = {NOISE_TOTAL: np.ascontiguousarray(noise.total), NOISE_NUMBERS: np.array(numbers, dtype=np.float64)}
    counts = [
        noise.stride, noise.size, noise.count, noise.pending, estimate.windows, estimate.window, noise.assumed,
        estimate.batch_size_assumed,
    ]  # fmt: skip
    return tensors, {"noise": dumps(counts)}


def take_noise(metadata: Mapping[str, str], tensors: Tensors) -> NoiseImage | None:
    raw = metadata["noise"]
    value = strict_json(raw)
    if value is None:
        return None
    if not (isinstance(value, list) and len(value) in (NOISE_COUNT_FIELDS_BEFORE, len(NOISE_COUNT_FIELDS))):
        raise SnapshotError(f"bad noise estimate {raw[:80]!r}")
    counts = {"assumed": 0, "batch_size_assumed": False} | dict(zip(NOISE_COUNT_FIELDS, value, strict=False))
    stride, size, total_count, windows, window, assumed = (
        parse_count(counts[key], key) for key in ("stride", "size", "count", "windows", "window", "assumed")
    )
    if type(counts["pending"]) is not bool or type(counts["batch_size_assumed"]) is not bool:
        raise SnapshotError("bad noise pending or batch_size_assumed flag")
    total = tensors.pop(NOISE_TOTAL, None)
    if total is None or total.dtype != np.float32 or total.ndim != 1:
        raise SnapshotError(f"missing or malformed {NOISE_TOTAL!r}")
    numbers = [float(x) for x in take(tensors, NOISE_NUMBERS, np.float64, (10,), "the noise estimate")]
    estimate = GradientNoise(numbers[7], numbers[8], numbers[9], windows, window, counts["batch_size_assumed"])
    return NoiseImage(
        total, stride, numbers[0], size, total_count, numbers[1], numbers[2], counts["pending"], assumed,
        (numbers[3], numbers[4]), (numbers[5], numbers[6]), estimate,
    )  # fmt: skip


def _object(raw: str, keys: set[str]) -> dict[str, Any]:
    value = strict_json(raw)
    if not isinstance(value, dict) or set(value) != keys:
        raise SnapshotError(f"expected an object of {sorted(keys)}, got {raw[:80]!r}")
    return value
