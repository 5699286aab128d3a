"""Checkpoints of other formats (issue 49, item 3): one of a newer format_version than this server
knows is not damaged, so it stops the start and stays as it is (never renamed `*.corrupt`, never
passed over for an older state or none); one written by the first format is read.

The first format's layout, as 838befe wrote it (server/gemps_server/checkpoint.py then), is built
here by hand: θ alone as `central_variable`, the spec without dtypes, receipts by request id with
six numbers each, and none of the keys added since (buffer_spec, partition, client_receipts,
epoch)."""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy

from gemps_server.checkpoint_files import (
    CORRUPT_SUFFIX,
    FORMAT_VERSION,
    CheckpointError,
    NewerCheckpointFormat,
    checkpoint_path,
    load,
    load_latest,
)
from gemps_server.domain.ledger import LEGACY_SCOPE, receipt_key

THETA = np.linspace(-1.0, 1.0, 8, dtype=np.float32)
SPEC = [{"name": "w", "shape": [2, 3]}, {"name": "b", "shape": [2]}]


def first_format_checkpoint(directory: Path, version: int, format_version: str = "1") -> Path:
    """A checkpoint in the first format's layout (838befe), `format_version` as given."""
    tensors = {"central_variable": THETA}
    crc = zlib.crc32(np.ascontiguousarray(THETA).data, 0)
    metadata = {
        "format": "gemps-checkpoint",
        "format_version": format_version,
        "gemps_version": "0.1.0" if format_version == "1" else "9.0.0",
        "version": str(version),
        "commits_applied": str(version),
        "spec": json.dumps(SPEC),
        "config": json.dumps({"learning_rate": 0.05, "rule": "gem"}, sort_keys=True),
        "receipts": json.dumps({"req-1": [version, 0, 1.0, 1.0, 0.0, 0.0]}),
        "created": repr(1_700_000_000.0),
        "crc32": f"{crc:08x}",
    }
    path = checkpoint_path(directory, version)
    directory.mkdir(parents=True, exist_ok=True)
    safetensors.numpy.save_file(tensors, str(path), metadata=metadata)
    return path


def test_a_checkpoint_of_the_first_format_is_read(tmp_path: Path) -> None:
    checkpoint = load(first_format_checkpoint(tmp_path, 12))
    image = checkpoint.image
    assert (checkpoint.version, image.commits_applied, checkpoint.epoch) == (12, 12, 0)
    np.testing.assert_array_equal(image.theta, THETA)
    assert [(entry.name, entry.shape) for entry in image.spec] == [("w", (2, 3)), ("b", (2,))]
    assert (image.partition.index, image.partition.count) == (0, 1) and image.buffer_spec == ()
    assert image.receipts[receipt_key(LEGACY_SCOPE, "req-1")].version == 12
    assert checkpoint.config["rule"] == "gem"


def test_a_newer_format_stops_the_restore_and_stays_as_it_is(tmp_path: Path) -> None:
    first_format_checkpoint(tmp_path, 5)  # an older good one: restoring it would lose the newer's commits
    newer = first_format_checkpoint(tmp_path, 9, format_version=str(int(FORMAT_VERSION) + 1))
    with pytest.raises(NewerCheckpointFormat) as refused:
        load_latest(tmp_path, on_corrupt=lambda path, error: pytest.fail(f"{path} taken for damaged: {error}"))
    message = str(refused.value)
    assert "\n" not in message and str(newer) in message
    assert f"format version {int(FORMAT_VERSION) + 1} (written by gemps 9.0.0)" in message
    assert f"newer than this server's {FORMAT_VERSION}" in message
    assert newer.exists() and not list(tmp_path.glob(f"*{CORRUPT_SUFFIX}"))
    assert isinstance(refused.value, ValueError)  # the server's start fails with exit 2 on it


@pytest.mark.parametrize("found", ["0", "1.5", "two", ""])
def test_a_format_version_that_is_not_a_newer_one_is_damage(tmp_path: Path, found: str) -> None:
    path = first_format_checkpoint(tmp_path, 3, format_version=found)
    with pytest.raises(CheckpointError, match="unsupported checkpoint format version") as refused:
        load(path)
    assert not isinstance(refused.value, NewerCheckpointFormat)
