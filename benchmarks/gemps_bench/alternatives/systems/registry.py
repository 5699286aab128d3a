"""Every system by name: gemps' settings, DDP, and the peers the manifest lists."""

from __future__ import annotations

from gemps_bench.alternatives.systems.base import System
from gemps_bench.alternatives.systems.ddp import Ddp
from gemps_bench.alternatives.systems.gemps import SETTINGS, Gemps
from gemps_bench.alternatives.systems.peers import Peer, manifest


def system_names() -> list[str]:
    return [*SETTINGS, "ddp", *manifest()]


def system(name: str) -> System:
    if name in SETTINGS:
        return Gemps(name)
    if name == "ddp":
        return Ddp()
    peers = manifest()
    if name in peers:
        return Peer(name, peers[name])
    raise ValueError(f"unknown system {name!r}; choose from {', '.join(system_names())}")
