"""Every system by name: gemps' settings, DDP's variants, and the peers the manifest lists."""

from __future__ import annotations

from gemps_bench.alternatives.systems.base import System
from gemps_bench.alternatives.systems.ddp import VARIANTS, Ddp
from gemps_bench.alternatives.systems.gemps import SETTINGS, Gemps
from gemps_bench.alternatives.systems.peers import Peer, manifest


def system_names() -> list[str]:
    return [*SETTINGS, *VARIANTS, *manifest()]


def system(name: str) -> System:
    if name in SETTINGS:
        return Gemps(name)
    if name in VARIANTS:
        return Ddp(name)
    peers = manifest()
    if name in peers:
        return Peer(name, peers[name])
    raise ValueError(f"unknown system {name!r}; choose from {', '.join(system_names())}")
