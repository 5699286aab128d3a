"""A multi-node Ray cluster on this one machine, for tests, measurements and trying `gemps ray`.

`ray.cluster_utils.Cluster` starts a head and more raylets, each a node with its own resources,
so placement across nodes is Ray's real scheduling. Every node is on 127.0.0.1; Ray gives actors
that address (and the partitions listen on it) only when `RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`
was set before ray was first imported: set it first thing in the program.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import ray
from ray.cluster_utils import Cluster

LOOPBACK = "127.0.0.1"
LOOPBACK_SWITCH = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"  # "0": Ray's node address is loopback


@contextlib.contextmanager
def local_cluster(nodes: int, cpus_per_node: float) -> Iterator[Cluster]:
    """`nodes` Ray nodes of `cpus_per_node` (logical) CPUs here, this process connected to them."""
    if os.environ.get(LOOPBACK_SWITCH) != "0":
        raise RuntimeError(f"set {LOOPBACK_SWITCH}=0 before importing ray: the nodes listen on {LOOPBACK} only")
    node: dict[str, Any] = {"num_cpus": cpus_per_node, "node_ip_address": LOOPBACK}
    cluster = Cluster(initialize_head=True, head_node_args={**node, "include_dashboard": False})
    try:
        for _ in range(nodes - 1):
            cluster.add_node(**node)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address)
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()
