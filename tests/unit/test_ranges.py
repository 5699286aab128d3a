"""Option ranges (gemps_proto.ranges): what a Range admits and how it reads in a refusal."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from gemps_proto.ranges import FLOAT32_MAX, RANGE, Range, out_of_range


def test_a_range_admits_its_closed_ends_and_excludes_its_open_ones() -> None:
    closed, half_open = Range(0, 1), Range(0, 1, low_open=True)
    assert closed.admits(0) and closed.admits(1) and closed.admits(0.5)
    assert not half_open.admits(0) and half_open.admits(1)
    assert not closed.admits(-1) and not closed.admits(2)


def test_nan_and_infinities_are_outside_every_range_with_finite_ends() -> None:
    for value in (math.nan, math.inf, -math.inf):
        assert not Range(-FLOAT32_MAX, FLOAT32_MAX).admits(value)


def test_a_range_reads_as_interval_notation_with_its_unit() -> None:
    assert str(Range(0, 1, high_open=True)) == "[0, 1)"
    assert str(Range(0, 2147483.647, low_open=True, unit="seconds")) == "(0, 2147483.647] seconds"
    assert str(Range(1, 2**63 - 1)) == "[1, 9223372036854775807]"


def test_fields_outside_their_declared_ranges_are_named_one_line_each() -> None:
    @dataclass(frozen=True)
    class Options:
        count: int = field(default=1, metadata={RANGE: Range(1, 10)})
        seconds: float = field(default=1.0, metadata={RANGE: Range(0, 5, low_open=True)})
        free: int = -7  # no range: anything goes

    assert out_of_range(Options()) == []
    assert out_of_range(Options(count=11, seconds=math.nan)) == [
        "count 11 is outside [1, 10]",
        "seconds nan is outside (0, 5]",
    ]


def test_an_end_at_float32s_largest_reads_as_a_reader_reads_it() -> None:
    """Issue 60, item 6: `(0, 3.4028234663852886e+38)` in --help and the command reference."""
    assert str(Range(0, FLOAT32_MAX, low_open=True)) == "(0, 3.4e+38]"
    assert str(Range(-FLOAT32_MAX, FLOAT32_MAX)) == "[-3.4e+38, 3.4e+38]"
