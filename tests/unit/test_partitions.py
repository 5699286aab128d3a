"""The arithmetic and configuration of partitions of θ, without servers."""

from __future__ import annotations

import itertools
import json
import os
from pathlib import Path

import numpy as np
import pytest

from gemps.router import resolve_address
from gemps_proto.schema import ParameterSpec, partition_bounds
from gemps_server.checkpoint_files import Checkpoint, CheckpointError, assemble_partitions, load, save
from gemps_server.config import ServerConfig
from gemps_server.domain.records import PartitionOf, StateImage
from gemps_server.partition_addresses import PartitionAddresses


@pytest.mark.parametrize("size,count", [(10, 3), (10_007, 2), (10_007, 3), (5, 5), (8, 1), (1_000_000, 4)])
def test_bounds_cover_theta_contiguously_balanced_by_element_count(size: int, count: int) -> None:
    bounds = partition_bounds(size, count)
    assert len(bounds) == count and bounds[0][0] == 0 and bounds[-1][1] == size
    assert all(stop == start for (_, stop), (start, _) in itertools.pairwise(bounds))
    sizes = [stop - start for start, stop in bounds]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


def test_bounds_refuse_no_partitions() -> None:
    with pytest.raises(ValueError, match=">= 1"):
        partition_bounds(10, 0)


@pytest.mark.parametrize(
    "announced,reached,expected",
    [
        ("", "ps:50051", "ps:50051"),
        (":50052", "ps:50051", "ps:50052"),
        (":50052", "[::1]:50051", "[::1]:50052"),
        (":50052", "dns:///ps.example:50051", "dns:///ps.example:50052"),
        ("gemps-ps-1.gemps-ps:50051", "gemps-ps-0.gemps-ps:50051", "gemps-ps-1.gemps-ps:50051"),
    ],
)
def test_announced_addresses_resolve_against_the_one_reached(announced: str, reached: str, expected: str) -> None:
    assert resolve_address(announced, reached) == expected


def test_a_relative_address_needs_a_port_in_the_one_reached() -> None:
    with pytest.raises(ValueError, match="cannot tell the host"):
        resolve_address(":50052", "unix-socket-path")


def test_partition_options_are_checked() -> None:
    assert ServerConfig(partitions=3).partition == 0  # the supervisor: all of them, index -1
    assert ServerConfig(partitions=3, partition_index=2).partition == 2
    listed = ServerConfig(partitions=2, partition_index=0, partition_addresses=", :50052")
    assert listed.partition_address_list() == ("", ":50052")
    template = ServerConfig(partitions=3, partition_index=0, partition_addresses="ps-{index}.ps:1")
    assert template.partition_address_list() == ("ps-0.ps:1", "ps-1.ps:1", "ps-2.ps:1")
    for options, problem in (
        ({"partitions": 0}, r"partitions 0 is outside \[1, 65535\]"),
        ({"partitions": 3, "port": 65534}, r"port 65534 \+ 2 \(the last partition's\) is past 65535"),
        ({"partitions": 2, "partition_index": 2}, "partition_index 2 outside -1..1"),
        ({"partitions": 2, "partition_index": 0}, "partition 0 of several announces the layout"),
        ({"partitions": 3, "partition_index": 0, "partition_addresses": "a:1,b:1"}, "lists 2 addresses for 3"),
    ):
        with pytest.raises(ValueError, match=problem):
            ServerConfig(**options)


SPEC = (ParameterSpec("w", (3, 3)), ParameterSpec("b", (2,)))  # 11 values


def partition_image(index: int, count: int, theta: np.ndarray) -> StateImage:
    start, stop = PartitionOf(index, count).bounds(theta.size)
    return StateImage(
        version=4, commits_applied=4, spec=SPEC, theta=theta[start:stop], partition=PartitionOf(index, count)
    )


def test_checkpoints_record_their_partition_and_assemble_into_the_whole(tmp_path: Path) -> None:
    theta = np.arange(11, dtype=np.float32)
    loaded = []
    for index in range(3):
        path, _ = save(tmp_path / str(index), Checkpoint(partition_image(index, 3, theta)))
        loaded.append(load(path))
        assert loaded[-1].image.partition == PartitionOf(index, 3)
    named = assemble_partitions(list(reversed(loaded)))
    np.testing.assert_array_equal(named["w"], theta[:9].reshape(3, 3))
    np.testing.assert_array_equal(named["b"], theta[9:])
    with pytest.raises(CheckpointError, match="need one checkpoint of each of 3 partitions, got partitions \\[0, 2\\]"):
        assemble_partitions([loaded[0], loaded[2]])
    with pytest.raises(CheckpointError, match="export all partitions together"):
        loaded[1].named()


@pytest.mark.parametrize(
    "partition,error",
    [
        ('{"index": 3, "count": 3}', "is not a partition"),
        ('{"index": true, "count": 2}', "is not a partition"),
        ('{"index": 0}', "must be an object with index and count"),
        ('{"index": 0, "count": 99}', "99 partitions of a model with fewer values"),
        ('{"index": 0, "count": 1}', "has 4 values but the spec describes 11"),  # a slice passed off as all of θ
    ],
)
def test_crafted_partition_metadata_is_refused(tmp_path: Path, partition: str, error: str) -> None:
    import safetensors.numpy

    path, _ = save(tmp_path, Checkpoint(partition_image(1, 3, np.arange(11, dtype=np.float32))))
    with safetensors.safe_open(str(path), "numpy") as handle:
        metadata = dict(handle.metadata())
        tensors = {key: handle.get_tensor(key) for key in handle.keys()}  # noqa: SIM118
    metadata["partition"] = partition
    assert json.loads(partition) is not None
    safetensors.numpy.save_file(tensors, str(path), metadata=metadata)
    with pytest.raises(CheckpointError, match=error):
        load(path)


def test_partition_addresses_from_a_file_are_read_again_when_it_changes(tmp_path: Path) -> None:
    """A launcher that restarts a partition on another machine rewrites the file; partition 0
    announces the new address from then on (issue 34, item 2)."""
    path = tmp_path / "addresses"
    path.write_text("10.0.0.1:50051,10.0.0.2:50051\n")
    config = ServerConfig(partitions=2, partition_index=0, partition_addresses=f"@{path}")
    addresses = PartitionAddresses(config.partition_addresses, config.partitions)
    assert addresses.current() == ("10.0.0.1:50051", "10.0.0.2:50051")

    def rewrite(text: str, step: int) -> None:  # a new mtime even on a coarse clock
        path.write_text(text)
        os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + step * 1_000_000_000))

    rewrite("10.0.0.1:50051,10.0.0.3:50051\n", 1)
    assert addresses.reread() == addresses.current() == ("10.0.0.1:50051", "10.0.0.3:50051")
    rewrite("10.0.0.9:50051\n", 2)  # one address for two partitions: the last good list stays
    assert addresses.reread() == ("10.0.0.1:50051", "10.0.0.3:50051")
    with pytest.raises(ValueError, match="lists 1 addresses for 2"):
        ServerConfig(partitions=2, partition_index=0, partition_addresses=f"@{path}")
    with pytest.raises(ValueError, match="No such file"):
        ServerConfig(partitions=2, partition_index=0, partition_addresses=f"@{tmp_path / 'missing'}")
