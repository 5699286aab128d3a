"""The server's compiled loops (_native.c) are built, and agree with numpy."""

from __future__ import annotations

import numpy as np
import pytest

from gemps_proto.codec import all_finite as numpy_all_finite
from gemps_server import native


def test_the_extension_was_built() -> None:
    # Optional at install (no compiler: numpy serves); here, where CI runs, it must be there.
    assert native.compiled is not None, "gemps_server._native was not built: is a C compiler installed?"


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("where", [0, 1023, 1024, 70_001])
def test_all_finite_finds_any_nan_or_inf(bad: float, where: int) -> None:
    values = np.full(70_002, 3e38, np.float32)  # large but finite: no sum may overflow
    values[1::2] = -3e38
    values[7] = np.float32(1e-45)  # denormal
    assert native.all_finite(values) and numpy_all_finite(values)
    values[where] = bad
    assert not native.all_finite(values) and not numpy_all_finite(values)


def test_other_layouts_fall_back_to_numpy() -> None:
    strided = np.ones(20, np.float32)[::2]
    assert native.all_finite(strided)
    strided[3] = np.nan
    assert not native.all_finite(strided)
    assert native.all_finite(np.empty(0, np.float32))
