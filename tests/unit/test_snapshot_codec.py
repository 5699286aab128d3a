"""One byte form of a state at one version (snapshot_codec.py) for both destinations: a
checkpoint file and a backup's seed lay the central state out alike; each holds what its reader
knows and nothing else; the seed's bytes are the image's own memory, not a copy."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy

from gemps_server.checkpoint_files import Checkpoint, CheckpointError, load, save
from gemps_server.domain import images
from gemps_server.replication.image_codec import decode, encode, encode_parts
from gemps_server.snapshot_codec import crc32_of
from tests.unit.test_replica_image import seeded

CENTRAL_METADATA = ("version", "commits_applied", "rule", "spec", "buffer_spec", "partition")


def header(raw: bytes) -> dict[str, dict[str, object]]:
    (length,) = struct.unpack_from("<Q", raw)
    found: dict[str, dict[str, object]] = json.loads(raw[8 : 8 + length])
    return found


def test_a_checkpoint_and_a_seed_lay_the_state_out_alike(tmp_path: Path) -> None:
    state, _ = seeded("momentum")
    path, _ = save(tmp_path, Checkpoint(images.checkpoint(state)))
    seed = encode(images.take(state))
    in_file, in_seed = safetensors.numpy.load_file(str(path)), safetensors.numpy.load(seed)
    central = {"central_variable", "buffers", "integer_buffers", "rule.velocity"}
    assert set(in_file) == central and central < set(in_seed)
    for key in central:
        assert in_file[key].dtype == in_seed[key].dtype and in_file[key].tobytes() == in_seed[key].tobytes()
    file_metadata, seed_metadata = header(path.read_bytes())["__metadata__"], header(seed)["__metadata__"]
    assert all(file_metadata[key] == seed_metadata[key] for key in CENTRAL_METADATA)
    assert file_metadata["rule"] == "momentum" and "crc32" in file_metadata and "crc32" in seed_metadata
    # What only a seed holds: the workers, their rule state, the ledger in its order, the noise estimate.
    assert {key.split(".")[0] for key in set(in_seed) - central} == {"receipts", "noise"}  # momentum: no worker state
    assert {"workers", "ledger", "noise", "history", "theta_bound"} <= set(seed_metadata) - set(file_metadata)
    assert "client_receipts" in file_metadata and "client_receipts" not in seed_metadata


def test_each_reader_refuses_a_tensor_it_does_not_know(tmp_path: Path) -> None:
    state, _ = seeded()
    path, _ = save(tmp_path, Checkpoint(images.checkpoint(state)))
    with safetensors.safe_open(str(path), "numpy") as handle:
        metadata = dict(handle.metadata())
        tensors = {key: handle.get_tensor(key) for key in handle.keys()}  # noqa: SIM118
    tensors["worker.0.proxy"] = np.zeros(3, np.float32)  # a worker's state: never a checkpoint's
    safetensors.numpy.save_file(tensors, str(path), metadata={**metadata, "crc32": crc32_of(tensors)})
    with pytest.raises(CheckpointError, match=r"unexpected tensor 'worker\.0\.proxy'"):
        load(path)
    seed = encode(images.take(state))
    seed_tensors = dict(safetensors.numpy.load(seed))
    seed_tensors["other"] = np.zeros(2, np.float32)
    seed_metadata = {**header(seed)["__metadata__"], "crc32": crc32_of(seed_tensors)}
    with pytest.raises(ValueError, match="bad replica image: unexpected tensor 'other'"):
        decode(safetensors.numpy.save(seed_tensors, metadata=seed_metadata))  # type: ignore[arg-type]


def test_a_seeds_parts_are_the_images_own_memory() -> None:
    state, _ = seeded()
    image = images.take(state)
    assert image.state is not None
    parts = encode_parts(image)
    assert any(np.shares_memory(np.frombuffer(part, np.uint8), image.state.theta) for part in parts[1:])
    assert b"".join(parts) == encode(image)
