"""The range each option's value must lie in, declared once beside the option and checked at start.

An option's range is what the types its value meets can hold: on the wire (`uint32`, `uint64`,
`double`), at run time (float32 arithmetic on θ, gRPC's C `int` channel arguments, int64
versions). A value outside it (NaN and infinities included, for a range with finite ends) is
refused before anything runs, with one line naming the option, the value and the range, rather
than starting a server that fails every call (`Value out of range`) or crashes with a traceback.

A configuration dataclass declares a field's range in its metadata (`{"range": Range(...)}`);
`out_of_range(instance)` lists the fields outside theirs. `gemps_proto.schema.TrainingConfig`
holds the training options' ranges, the server's config the rest.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

INT32_MAX = 2**31 - 1  # gRPC's channel arguments (C int); process ids
UINT32_MAX = 2**32 - 1  # uint32 fields: batch size, shard index and count
INT64_MAX = 2**63 - 1  # versions and counts (int64 base_version, checkpoint metadata)
FLOAT32_MAX = (2 - 2**-23) * 2.0**127  # float32's largest value (numpy's finfo): factors applied to θ's values

RANGE = "range"  # the metadata key of a field's Range
DEFAULT_TEXT = "default_text"  # the metadata key of how --help words a default other options decide


@dataclass(frozen=True)
class Range:
    """The values from `low` to `high`, each end included unless it is open; finite values only."""

    low: float
    high: float
    low_open: bool = False
    high_open: bool = False
    unit: str = ""

    def admits(self, value: float) -> bool:
        if isinstance(value, float) and not math.isfinite(value):
            return False  # NaN compares false with everything, infinity is past any finite end
        above = value > self.low if self.low_open else value >= self.low
        below = value < self.high if self.high_open else value <= self.high
        return above and below

    def __str__(self) -> str:
        text = (
            f"{'(' if self.low_open else '['}{_number(self.low)}, {_number(self.high)}{')' if self.high_open else ']'}"
        )
        return f"{text} {self.unit}" if self.unit else text


# What the server's options' types hold (gemps_server.config). Durations meet gRPC's channel arguments, C ints of
# milliseconds, so every duration fits one (about 24.8 days; a value gRPC is given is at least a
# millisecond); counts of things held at once meet C ints too; data shards and worker slots are
# uint32 on the wire (Shard); a request message is limited by gRPC in an int32 of bytes.
MAX_SECONDS = INT32_MAX / 1000
SECONDS = Range(0, MAX_SECONDS, low_open=True, unit="seconds")
SECONDS_OR_ZERO = Range(0, MAX_SECONDS, unit="seconds")
GRPC_SECONDS = Range(0.001, MAX_SECONDS, unit="seconds")
PORT = Range(0, 65535)
COUNT = Range(1, INT32_MAX)
COUNT_OR_ZERO = Range(0, INT32_MAX)
# θ-sized buffers held at once: each is allocated when first needed, but the data plane lists
# them all at start, and more than this many copies of any θ could never be held anyway.
BUFFERS = Range(1, 1 << 16)
# Memory in MiB, counted in int64 bytes; 0 where it means "settled by the server" (auto).
MEBIBYTES_OR_ZERO = Range(0, INT64_MAX >> 20, unit="MiB")
# Threads a pool of the server's may start (more would only cost memory and switches).
THREADS = Range(1, 1024)


def _number(value: float) -> str:
    """`value` as a reader reads it: whole numbers in full, float32's largest (an end no option
    chooses: the type's) in three digits, 3.4e+38, not 3.4028234663852886e+38."""
    if isinstance(value, int) or (float(value).is_integer() and abs(value) < 2**53):
        return str(int(value))
    if abs(value) >= 2**53:
        return f"{value:.2g}"
    return repr(float(value))


def range_of(field: dataclasses.Field[object]) -> Range | None:
    found = field.metadata.get(RANGE)
    return found if isinstance(found, Range) else None


def out_of_range(instance: object) -> list[str]:
    """One line per field of a dataclass instance whose value is outside its declared range."""
    found = []
    for field in dataclasses.fields(instance):  # type: ignore[arg-type]
        bounds = range_of(field)
        value = getattr(instance, field.name)
        if bounds is not None and not bounds.admits(value):
            found.append(f"{field.name} {value!r} is outside {bounds}")
    return found
