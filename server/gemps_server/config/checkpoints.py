"""Checkpoints and shutdown: where and how often the server writes its state, how many it keeps,
and how long in-flight RPCs get before the final one."""

from __future__ import annotations

from dataclasses import dataclass, field

from gemps_proto.ranges import COUNT, INT64_MAX, RANGE, SECONDS_OR_ZERO, Range


@dataclass(frozen=True)
class CheckpointOptions:
    """Only ranges to check, each beside its field (ServerConfig checks them)."""

    checkpoint_dir: str = field(
        default="",
        metadata={"help": "write checkpoints here and restore the latest on start; empty: no checkpoints"},
    )
    checkpoint_every: int = field(
        default=1000,
        metadata={
            "help": "checkpoint after this many commits since the last one; 0: not by count",
            RANGE: Range(0, INT64_MAX),
        },
    )
    checkpoint_interval: float = field(
        default=60.0,
        metadata={
            "help": "checkpoint this often, seconds, when the version moved; 0: not by time",
            RANGE: SECONDS_OR_ZERO,
        },
    )
    checkpoint_keep: int = field(default=3, metadata={"help": "checkpoints kept; older ones are deleted", RANGE: COUNT})
    shutdown_grace: float = field(
        default=10.0,
        metadata={
            "help": "seconds in-flight RPCs get to finish on SIGTERM before the final checkpoint",
            RANGE: SECONDS_OR_ZERO,
        },
    )
