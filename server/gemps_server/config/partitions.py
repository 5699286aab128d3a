"""The partitions of θ (docs/ARCHITECTURE.md, "Partitions"): how many, which one this process
serves, and how workers reach each."""

from __future__ import annotations

from dataclasses import dataclass, field

from gemps_proto.ranges import RANGE, Range
from gemps_server import partition_addresses


@dataclass(frozen=True)
class PartitionOptions:
    partitions: int = field(
        default=1,
        metadata={
            "help": "split θ into this many contiguous ranges, each held by its own server process",
            RANGE: Range(1, 65535),
        },
    )
    partition_index: int = field(
        default=-1,
        metadata={
            "help": "serve only this partition (0-based; e.g. a Kubernetes pod's ordinal); "
            "-1: run all of them here, one process each on consecutive ports",
            RANGE: Range(-1, 65534),
        },
    )
    partition_addresses: str = field(
        default="",
        metadata={
            "help": "how workers reach each partition, announced by partition 0: comma-separated targets "
            "in partition order, or one with {index} (e.g. gemps-server-{index}.gemps-server:50051); "
            "':PORT' means the host workers reached partition 0 at; @PATH: a file holding either, read "
            "again when it changes (a launcher rewrites it when a partition moves to another machine)"
        },
    )

    def problems(self) -> list[str]:
        """The first problem of the partition options: each check assumes the ones before it passed
        (whether the partitions' ports fit: ServerConfig, which knows the ports)."""
        if self.partition_index >= self.partitions:
            return [f"partition_index {self.partition_index} outside -1..{self.partitions - 1}"]
        if self.partition_addresses:
            found = partition_addresses.problems(self.partition_addresses, self.partitions)
            if found:
                return found
        if self.partitions > 1 and self.partition_index == 0 and not self.partition_addresses:
            return ["partition 0 of several announces the layout: give partition_addresses"]
        return []

    @property
    def partition(self) -> int:
        """The partition this process serves (0 when θ is not partitioned)."""
        return max(self.partition_index, 0)

    def partition_address_list(self) -> tuple[str, ...]:
        """How workers reach each partition now (empty when unknown: only partition 0 must know)."""
        return partition_addresses.PartitionAddresses(self.partition_addresses, self.partitions).current()
