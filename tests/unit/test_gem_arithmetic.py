"""GEM's arithmetic around its passes is written once, in C (csrc/gem_rule.c: the in-place bound
and the statistics that GemRule, CompactGemRule and the compiled commit core all run), and held
here to plain Python references (reference_rules.py), bit for bit. The compiled commit core
reads only public names of the Python objects it works on."""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np

from gemps_server import native
from tests.unit import reference_rules

CSRC = Path(native.__file__).parent / "csrc"


def magnitudes(rng: np.random.Generator, count: int) -> list[float]:
    """Non-negative numbers from 0 to past float32's largest, and a few that are not finite."""
    found = [float(10.0 ** rng.uniform(-40, 39)) for _ in range(count)]
    return [*found, 0.0, 1.0, math.inf, math.nan, reference_rules.SAFE_MAGNITUDE]


def test_gems_bound_is_the_references_bit_for_bit() -> None:
    assert native.compiled is not None
    rng = np.random.default_rng(3)
    peaks = magnitudes(rng, 20)
    compared = 0
    for _ in range(4_000):
        scale = float(rng.choice([-1.0, 1.0])) * float(rng.choice(peaks))
        momentum, kappa, pi_max = float(rng.uniform(-1, 1)), float(rng.uniform(0.1, 3)), float(rng.uniform(0, 8))
        others = (float(rng.choice(peaks)) for _ in range(4))
        arguments = (scale, next(others), next(others), momentum, kappa, pi_max, next(others), next(others))
        want = reference_rules.gem_bounds(*arguments)
        got = native.compiled.gem_bounds(*arguments)
        assert repr(got) == repr(want), arguments
        compared += want is not None
    assert 500 < compared < 3_500  # both answers are well represented


def test_gems_statistics_are_the_references_bit_for_bit() -> None:
    assert native.compiled is not None
    rng = np.random.default_rng(4)
    for count in (1, 2, 7, 8, 1000, 1001):
        for still in (0.0, 0.3, 1.0):  # the share of parameters the commit does not move (NaN in the sample)
            samples = rng.choice([0.0, 5.0, 1.5], count).astype(np.float32) + rng.uniform(0, 1, count).astype(
                np.float32
            ) * np.float32(rng.integers(0, 2))
            samples[rng.uniform(0, 1, count) < still] = np.nan
            size, kept = count * 3, int(np.count_nonzero(~np.isnan(samples)))
            moving = size if kept == count else kept * 3  # a pass's: NaN in the sample only where Delta = 0
            sums = (moving, float(rng.uniform(0, 5 * size)), float(rng.integers(0, moving + 1)), 2.0, 0.7, 1.3)
            want = reference_rules.gem_stats(samples.copy(), size, sums)
            got = native.compiled.gem_stats(samples.copy(), size, *sums)
            assert repr(got) == repr(want), (count, still)


def test_the_compiled_core_reads_only_public_names() -> None:
    """Every attribute and method the compiled commit core reads, writes or calls is public (no
    name that starts with `_`): the Python objects' own state stays theirs to lay out."""
    sources = {path.name: path.read_text() for path in sorted(CSRC.glob("core*.[ch]"))}
    names = re.findall(r"X\((\w+)\)", "".join(text for name, text in sources.items() if name.endswith(".h")))
    assert "rule" in names and "proxy" in names
    assert [name for name in names if name.startswith("_")] == []
    for name, text in sources.items():
        assert re.findall(r"\bs__\w+", text) == [], name
        assert re.findall(r"CallMethod\w*\([^;]*\"_\w+\"", text) == [], name
